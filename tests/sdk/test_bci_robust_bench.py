"""bench/bench_bci_robust.py's parts that decide what a cell is and what the report says: the generator settings
each axis changes, and the targets' bookkeeping (the grid run itself is the benchmark, not a test)."""

from __future__ import annotations

import json

import numpy as np
import pytest


@pytest.fixture(scope="module")
def bench(bench_script):
    return bench_script("bench_bci_robust")


def test_each_axis_changes_its_part_of_the_generator_and_nothing_else(bench):
    from closedloop.sim.handwriting import HandwritingConfig
    from closedloop.sim.handwriting.config import FALCON_H2_HELD_IN_DATES

    base = HandwritingConfig(seed=3)
    same = bench.recording_config(bench.DEFAULT_CELL, 3)
    assert same.to_dict() == base.to_dict()  # the default cell is the generator's calibrated default
    hw = bench.recording_config({**bench.DEFAULT_CELL, "signal": 2.0, "drift": 0.5, "held_in": 8, "trials": 10,
                                 "jumps": True}, 3)
    assert hw.population.velocity_depth == 2 * base.population.velocity_depth
    assert hw.population.accel_depth == 2 * base.population.accel_depth
    assert hw.drift.scale == 0.5 * base.drift.scale and hw.drift.session_rotation > 0 and hw.drift.session_gain > 0
    assert len(hw.held_in_dates) == 8 and hw.held_in_dates[-1] == FALCON_H2_HELD_IN_DATES[-1]
    assert hw.held_in_dates[0] == FALCON_H2_HELD_IN_DATES[0] and hw.held_out_dates == base.held_out_dates
    assert hw.trials_per_session == 10 and hw.n_channels == base.n_channels
    with pytest.raises(ValueError, match="held_in 30"):
        bench.recording_config({**bench.DEFAULT_CELL, "held_in": 30}, 0)


def test_the_designs_vary_one_axis_at_a_time_or_all_of_them(bench):
    one = bench.one_at_a_time()
    assert one[0] == bench.DEFAULT_CELL and len(one) == 1 + sum(len(v) - 1 for v in bench.AXES.values())
    assert all(sum(c[k] != bench.DEFAULT_CELL[k] for k in bench.AXES) == 1 for c in one[1:])
    assert len(bench.every_combination()) == int(np.prod([len(v) for v in bench.AXES.values()]))


def _pieces(key, ts1, ts4, sl1, ts_errors=(0, 0), sl_errors=(0, 0)):
    """The four stored pieces of a cell; the texts carry ``*_errors`` wrong characters of 10 (trial 1, trial 2)."""
    refs = ["abcdefghij", "klmnopqrst"]

    def texts(errors):
        return [r[:len(r) - e] + "z" * e for r, e in zip(refs, errors, strict=True)]

    def piece(budget, method, cer, errors):
        training = ({"stage1": {"steps_run": 100, "stop_reason": "patience"}, "learned": True}
                    if method == "two_stage" else {"steps_run": 90, "stop_reason": "patience"})
        return {"key": f"{key}_x{budget:g}_{method}", "status": "ok", "result": {
            "cell": dict.fromkeys(("signal", "drift"), 1.0) | {"held_in": 21, "trials": 40, "jumps": False},
            "seed": 0, "data": {}, "budget": budget, "method": method, "training": training, "wall_s": 1.0,
            "scores": {"greedy_CER": cer, "sessions": {"day": {"greedy_CER": cer, "texts": {
                "reference": refs, "greedy": texts(errors)}}}}}}

    return [piece(1.0, "two_stage", ts1, ts_errors), piece(4.0, "two_stage", ts4, ts_errors),
            piece(1.0, "session_layers", sl1, sl_errors), piece(4.0, "session_layers", sl1, sl_errors)]


def test_the_report_joins_the_pieces_and_counts_the_cells_that_meet_each_target(bench, tmp_path):
    pieces = (_pieces("a", 0.10, 0.09, 0.20, (0, 0), (4, 4))     # within 1.25x, two-stage clearly better
              + _pieces("b", 0.30, 0.10, 0.20, (3, 3), (2, 2))   # stopped too early: 3x the 4x run's CER
              + _pieces("c", 0.12, 0.11, 0.12, (1, 1), (1, 1))   # a tie
              + _pieces("d", 0.1, 0.1, 0.1)[:3]                  # only the optional 4x session-layers piece missing
              + _pieces("g", 0.1, 0.1, 0.1)[1:]                  # the default two-stage piece not run yet
              + [{"key": "e_x1_two_stage", "status": "failed", "error": "MemoryError: out"}]
              + _pieces("f", 0.2, 0.2, 0.2)[:1])                 # only the default two-stage piece
    cells = bench.assemble(pieces)
    status = {c["key"]: c["status"] for c in cells}
    assert status == {"a": "ok", "b": "ok", "c": "ok", "d": "ok", "e": "failed", "f": "pending", "g": "pending"}
    joined = next(c for c in cells if c["key"] == "a")["result"]
    assert joined["x4"]["scores"]["two_stage"]["greedy_CER"] == 0.09
    assert joined["paired_greedy_CER"]["ratio_95"][1] < 1  # 0 errors against 8: the bootstrap says better
    s = bench.summarize(cells)
    # each target is judged on the cells whose pieces for it are in: d lacks only its 4x session-layers piece, so
    # it counts for both (ratio 1.0, a tie); f has only its default-budget two-stage piece and counts for neither
    assert (s["n_cells"], s["n_ok"], s["n_pending"], s["n_all_pieces"]) == (7, 4, 2, 3)
    assert (s["within_ratio"], s["n_ratio"], s["two_stage_better"], s["n_methods"]) == (3, 4, 1, 4)
    rows = {r["key"]: r for r in s["cells"]}
    assert rows["b"]["ratio_to_x4"] == pytest.approx(3.0) and not rows["b"]["within_ratio"]
    assert rows["b"]["ratio_to_x4_95"] == [1.0, 1.0]  # the interval is the held-out texts', paired by trial
    assert rows["d"]["missing"] == ["x4 session_layers"] and "pending" not in rows["d"]
    assert rows["g"]["pending"] and rows["g"]["missing"] == ["x1 two_stage"]
    assert rows["d"]["two_stage_CER"] == 0.1 and rows["d"]["ratio_to_x4"] == 1.0
    assert "two_stage_vs_session_layers_95" in rows["d"]
    assert rows["f"]["two_stage_CER"] == 0.2 and "ratio_to_x4" not in rows["f"] and "two_stage_better" not in rows["f"]
    md = bench.markdown(s, "test machine")
    assert "3 of 4 cells with both two-stage pieces (target: every cell)" in md
    assert "1 of 4 cells with both default-budget pieces (target: most cells)" in md
    assert "3.00 [1.00, 1.00] (over)" in md  # b's texts: the same 6 errors in both budgets' pieces
    assert "failed: MemoryError" in md and "| x4 session_layers |" in md and "| x1 two_stage |" in md
    assert md.startswith("# Robustness of the bci-train recipe (4 of 7 cells measured for both targets, 3 with all "
                         "four pieces)")
    assert "2 of 7 cell(s) lack a piece a target needs" in md and "is optional: no target needs it" in md
    assert "| 20.0 | - | - | - | - | - |" in md  # f: its one piece, the rest not run yet
    bench.plot(s, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_the_report_says_how_much_of_a_pieces_cer_is_the_sentence_end_mark(bench):
    def piece(greedy):
        refs = ["ab>cd~", "ef>gh?"]
        return {"key": "a_x1_two_stage", "status": "ok", "config": {"commit": "abc1234"}, "result": {
            "budget": 1.0, "method": "two_stage", "scores": {"greedy_CER": 0.0, "sessions": {"day": {"texts": {
                "reference": refs, "greedy": greedy}}}}}}

    # one mark missing (1 error in 12 characters), one wrong letter elsewhere; the other mark written
    (row,) = bench.piece_rows([piece(["ab>cd", "ef>gx?"]), {"key": "b_x1_two_stage", "status": "failed"}])
    assert row["key"] == "a" and row["commit"] == "abc1234"
    assert row["end_marks"]["missed"] == 1 and row["end_marks"]["of"] == 2
    assert row["end_marks"]["CER_end_restored"] == pytest.approx(1 / 12)  # only the wrong letter is left
    md = bench.markdown({"cells": [], "n_cells": 0, "n_ok": 0, "n_ratio": 0, "within_ratio": 0, "n_methods": 0,
                         "two_stage_better": 0, "pieces": [row]}, "test machine")
    assert "| a | x1 | two_stage | 0.0 | 1 of 2 | 8.3 |" in md
    assert "Where the pieces ran (their records' `host`; a time budget's steps depend on it): not recorded: 1." in md
    # a piece records where it ran, and the report counts the pieces per machine
    host = bench.piece_host()
    assert host["cores"] >= 1 and host["cpu"] and host["torch_threads"] == 1
    recorded = piece(["ab>cd~", "ef>gh?"])
    recorded["result"]["host"] = host
    rows = bench.piece_rows([piece(["ab>cd~", "ef>gh?"]), recorded, recorded])
    md = bench.markdown({"cells": [], "n_cells": 0, "n_ok": 0, "n_ratio": 0, "within_ratio": 0, "n_methods": 0,
                         "two_stage_better": 0, "pieces": rows}, "test machine")
    assert f"{host['cpu']}, {host['cores']} cores: 2; not recorded: 1." in md


def test_the_report_compares_the_budgets_validation_curves_at_the_same_step(bench, tmp_path):
    # the default run anneals to 2% by its last step (300); the 4x run is at 5% by then and reaches 1% later:
    # its lead is the steps the default budget did not reach, which the report shows as 2% against 5%
    pieces = _pieces("a", 0.04, 0.02, 0.05)
    curve = [[100, 0.5, 1.0], [200, 0.1, 0.4], [300, 0.02, 0.1]]  # [step, validation CER, loss] rows
    curve_x4 = [[100, 0.5, 1.0], [200, 0.1, 0.4], [300, 0.05, 0.2], [600, 0.01, 0.05], [900, 0.03, 0.1]]
    pieces[0]["result"]["training"]["stage1"] |= {"steps_run": 300, "best_val_CER": 0.02, "val_curve": curve}
    pieces[1]["result"]["training"]["stage1"] |= {"steps_run": 900, "best_val_CER": 0.01, "val_curve": curve_x4}
    s = bench.summarize(bench.assemble(pieces + _pieces("b", 0.1, 0.1, 0.1)))
    rows = {r["key"]: r for r in s["cells"]}
    assert rows["a"]["same_steps"] == {"steps": 300, "best_val_CER": 0.02, "best_val_CER_x4_by_then": 0.05,
                                       "best_val_CER_x4": 0.01}
    assert "same_steps" not in rows["b"]  # a cell without the 4x run's curve is not compared
    # a default-budget record with its best but no curve is compared too; only the 4x curve is needed
    del pieces[0]["result"]["training"]["stage1"]["val_curve"]
    (row,) = bench.summarize(bench.assemble(pieces))["cells"]
    assert row["same_steps"]["best_val_CER_x4_by_then"] == 0.05
    md = bench.markdown(s, "test machine")
    assert "| a | 300 | 2.0 | 5.0 | 1.0 |" in md
    bench.plot(s, tmp_path / "p.png")
    import matplotlib.image

    assert matplotlib.image.imread(tmp_path / "p.png").shape[1] > 1500  # the third panel, the curves, is drawn


def test_compare_pairs_two_folders_pieces_by_cell_seed_and_method(bench, tmp_path, capsys):
    # a recipe change measured in its own folder (a: 2 of 20 characters wrong) against the grid's pieces (b: 4)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (a / "bci_robust_cells.jsonl").write_text("".join(json.dumps(p) + "\n" for p in _pieces("c", 0.1, 0.1, 0.1, (1, 1))[:1]))
    (b / "bci_robust_cells.jsonl").write_text("".join(json.dumps(p) + "\n" for p in _pieces("c", 0.2, 0.05, 0.3, (2, 2), (1, 0))
                                                      + _pieces("d", 0.2, 0.1, 0.3)))
    (row,) = bench.compare(str(a), str(b))  # only cell c's default-budget two-stage piece is in both
    assert (row["cell"], row["method"], row["budget_a"], row["budget_b"]) == ("c", "two_stage", 1.0, 1.0)
    assert row["ratio"] == pytest.approx(0.5) and row["ratio_95"] == pytest.approx([0.5, 0.5])
    # one side's budget named: the default-budget piece against the 4x run of the same cell
    (row,) = bench.compare(f"{a}:x1", f"{b}:x4")
    assert (row["budget_a"], row["budget_b"]) == (1.0, 4.0)
    assert bench.main(["--compare", str(a), f"{b}:x1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["ratio"] == pytest.approx(0.5)
    other = tmp_path / "other"
    other.mkdir()
    (other / "bci_robust_cells.jsonl").write_text(json.dumps(_pieces("d", 0.2, 0.1, 0.3)[0]) + "\n")
    assert bench.main(["--compare", str(a), str(other)]) == 0  # nothing in common: said, not an error
    assert "no piece of the same cell" in capsys.readouterr().out
    assert bench.main(["--compare", str(a), str(b)]) == 0
    assert "| c | two_stage | x1, x1 | 10.0 | 20.0 | 0 / 0, 0 / 0 | 0.50 [0.50, 0.50] |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no .*bci_robust_cells.jsonl; give a results folder"):
        bench.compare(str(a), str(tmp_path / "missing"))
    with pytest.raises(SystemExit, match="budget x2 is not one of x1, x4"):
        bench.compare(f"{a}:x2", str(b))


def test_one_worker_runs_the_pieces_in_this_process_and_more_or_a_cluster_use_ray(bench, tmp_path, monkeypatch):
    import closedloop.sdk.grid as grid

    calls = []
    monkeypatch.setattr(grid, "run_grid", lambda fn, cells, **kw: calls.append((len(cells), kw)) or [])
    monkeypatch.setattr(bench, "report", lambda *a: None)
    base = ["--cell", "0", "--budget", "1", "--method", "two_stage", "--out", str(tmp_path)]
    assert bench.main(base + ["--workers", "1"]) == 0  # no Ray instance to start, or for a `ray stop` to end
    assert bench.main(base + ["--workers", "2"]) == 0
    assert bench.main(base + ["--workers", "1", "--address", "10.0.0.1:6379"]) == 0
    # the grid runner's rule decides from what the bench passes on: one worker here, more (or a cluster) on Ray
    assert [(n, kw["workers"], kw.get("address")) for n, kw in calls] == [(1, 1, None), (1, 2, None),
                                                                          (1, 1, "10.0.0.1:6379")]
    chosen = [grid.resolve_backend(kw.get("backend", "auto"), kw["workers"], kw.get("address")) for _, kw in calls]
    assert chosen == ["inprocess", "ray", "ray"]
