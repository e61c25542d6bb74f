"""bench/bench_rl.py's cells: parsing, resuming (a finished cell is skipped) and the report's bootstrap intervals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench(bench_script):
    return bench_script("bench_rl")


def test_parse_cell_and_its_errors(bench):
    assert bench.parse_cell("PandaPush-v3:sparse_her:3") == {"task": "PandaPush-v3", "reward": "sparse_her",
                                                               "seed": 3, "prior": "scratch"}
    assert bench.parse_cell("push:svm:1:bc")["prior"] == "bc"
    assert bench.parse_cell("PandaPickAndPlace-v3:svm_her:1:bc")["prior"] == "bc"
    # a lambda*beta sweep's cells are other experiments: their ids differ, the default's id stays short
    cell = bench.parse_cell("PandaPush-v3:svm_her:0:bc")
    assert bench.cell_id(cell) == "PandaPush-v3:svm_her:0:bc"
    assert bench.cell_id(cell | {"lam": 0.2}) == "PandaPush-v3:svm_her:0:bc@lam=0.2"
    assert bench.cell_id(cell | {"lam": 0.05, "beta": 2.0}) == "PandaPush-v3:svm_her:0:bc@beta=2"
    for bad, what in (("PandaPush-v3:svm", "TASK:REWARD:SEED"), ("Pong:svm:0", "task"), ("push:dense:0", "reward"),
                      ("push:svm_her:0", "HER needs"), ("PandaReach-v3:svm:0:bc", "from scratch"),
                      ("push:svm:x", "seed")):
        with pytest.raises(ValueError, match=what):
            bench.parse_cell(bad)


def _rec(bench, reward, seed, curve, steps=1000):
    cell = {"task": "PandaPush-v3", "reward": reward, "seed": seed, "prior": "scratch"}
    return {"id": bench.cell_id(cell), "cell": cell, "settings": bench.CELL_DEFAULTS | {"steps": steps},
            "curve": curve, "wall_s": 1.0}


def test_report_gives_bootstrap_intervals_and_counts_unreached_at_the_budget(bench, tmp_path):
    path = tmp_path / "cells.jsonl"
    recs = [_rec(bench, "svm_her", s, [[0, 0.0], [500, 0.85], [1000, 0.95]]) for s in range(3)]
    recs.append(_rec(bench, "sparse_her", 0, [[0, 0.0], [500, 0.5], [1000, 0.8]]))
    recs.append(_rec(bench, "sparse_her", 1, [[0, 0.0], [500, 0.6], [1000, 0.7]]))  # never reaches 80%
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = bench.report(path, tmp_path)
    rows = {r["reward"]: r for r in out["table"]}
    svm, sparse = rows["svm_her (lam 0.05, beta 5)"], rows["sparse_her"]
    assert svm["to_80"]["mean"] == 500 and svm["to_80"]["ci95"] == [500, 500] and svm["to_80"]["all_reached"]
    assert sparse["to_80"]["per_seed"] == [1000, None] and not sparse["to_80"]["all_reached"]
    assert sparse["to_80"]["mean"] == 1000  # the unreached seed counts at its budget
    assert ">= 1,000" in (tmp_path / "cells.md").read_text()
    assert sorted(sparse["final_success"]["per_seed"]) == [0.7, 0.8] and sparse["final_success"]["mean"] == 0.75
    assert "0.95 [0.95, 0.95]" in (tmp_path / "cells.md").read_text()  # svm's success at the end, every seed
    # 500 steps against sparse's 1000 (one seed counted at its budget): an upper bound of 0.5, the target met
    r = svm["ratio_to_sparse_80"]
    assert r["ratio"] == 0.5 and r["bound"] == "upper bound" and r["target_met"]
    assert "<= 0.50" in (tmp_path / "cells.md").read_text()
    assert (tmp_path / "cells_success.png").stat().st_size > 0
    mean, lo, hi = bench.bootstrap_mean(np.array([1.0, 2.0, 3.0, 10.0]))
    assert lo < mean < hi and lo >= 1.0 and hi <= 10.0


def test_one_seeds_runs_at_two_budgets_are_not_pooled_and_a_task_without_her_is_compared_with_sparse(bench, tmp_path):
    """A seed rerun with a longer budget is another experiment (pooling both would count the seed twice); the
    project's tasks have no HER, so their shaped reward is compared with sparse, and never meets a target that is
    stated against sparse + HER on panda-gym."""
    def rec(reward, seed, curve, steps):
        cell = {"task": "push", "reward": reward, "seed": seed, "prior": "bc"}
        return {"id": bench.cell_id(cell | {"steps": steps}), "cell": cell,
                "settings": bench.CELL_DEFAULTS | {"steps": steps}, "curve": curve, "wall_s": 1.0}

    recs = [rec("sparse", s, [[0, 0.2], [10_000, 0.7]], 10_000) for s in range(2)]
    recs += [rec("sparse", s, [[0, 0.2], [12_000, 0.85]], 20_000) for s in range(2)]
    recs += [rec("svm", s, [[0, 0.2], [4_000, 0.85]], 20_000) for s in range(2)]
    path = tmp_path / "cells.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    rows = {(r["reward"], r["prior"]): r for r in bench.report(path, tmp_path)["table"]}
    assert rows[("sparse", "bc, 10,000 steps")]["seeds"] == [0, 1] and rows[("sparse", "bc")]["seeds"] == [0, 1]
    r = rows[("svm (lam 0.05, beta 5)", "bc")]["ratio_to_sparse_80"]
    assert r["baseline"] == "sparse" and r["ratio"] == pytest.approx(4_000 / 12_000) and not r["target_met"]
    assert "(vs sparse, no HER)" in (tmp_path / "cells.md").read_text()


def test_each_reward_is_compared_with_the_sparse_baseline_of_its_own_relabelling(bench):
    """With and without HER on one task: a shaped reward with HER against sparse + HER (the target's), one without
    against sparse without (what the bonus does alone), and sparse without HER against sparse + HER."""
    ran = {"sparse", "sparse_her", "svm", "svm_her", "gail"}
    assert bench.baseline_reward("svm_her", ran) == "sparse_her"
    assert bench.baseline_reward("svm_her (lam 0.2, beta 5)", ran) == "sparse_her"  # the report's row label
    assert bench.baseline_reward("svm", ran) == "sparse" and bench.baseline_reward("gail", ran) == "sparse"
    assert bench.baseline_reward("sparse", ran) == "sparse_her"
    assert bench.baseline_reward("sparse_her", ran) is None
    assert bench.baseline_reward("svm", {"sparse_her", "svm"}) == "sparse_her"  # no plain sparse ran
    assert bench.baseline_reward("svm_her", {"sparse", "svm_her"}) is None  # never against a weaker baseline


def test_a_finished_cell_is_skipped(bench, tmp_path, monkeypatch):
    path = tmp_path / "cells.jsonl"
    rec = _rec(bench, "svm_her", 0, [[0, 0.0]])
    path.write_text(json.dumps(rec) + "\n")
    monkeypatch.setattr(bench, "run_cell", lambda cell: pytest.fail("a finished cell was run again"))
    assert bench.run_and_append(dict(rec["cell"]), path) is None
    monkeypatch.setattr(bench, "run_cell", lambda cell: _rec(bench, cell["reward"], cell["seed"], [[0, 1.0]]))
    assert bench.run_and_append({**rec["cell"], "seed": 1}, path)["id"].endswith(":1:scratch")
    assert len(path.read_text().splitlines()) == 2


def test_a_cell_pattern_expands_to_every_combination_and_an_impossible_one_is_an_error(bench):
    cells = bench.expand_cells("PandaPush-v3,PandaPickAndPlace-v3:sparse_her,svm_her:0-4:bc")
    assert len(cells) == 20 and len({bench.cell_id(c) for c in cells}) == 20
    assert bench.cell_id(cells[0]) == "PandaPush-v3:sparse_her:0:bc"
    assert {c["seed"] for c in cells} == set(range(5)) and {c["prior"] for c in cells} == {"bc"}
    assert [c["seed"] for c in bench.expand_cells("push:svm:0-2,7,1")] == [0, 1, 2, 7]  # duplicates dropped
    assert bench.expand_cells("push:svm:3") == [bench.parse_cell("push:svm:3")]
    with pytest.raises(ValueError, match="HER needs"):  # push has no goals: named, not skipped
        bench.expand_cells("PandaPush-v3,push:svm_her:0")
    with pytest.raises(ValueError, match="ends before it starts"):
        bench.expand_cells("push:svm:4-1")
    with pytest.raises(ValueError, match="seed 'x'"):
        bench.expand_cells("push:svm:0,x")


def test_cells_run_through_the_grid_runner_append_records_the_report_and_a_rerun_read(bench, tmp_path, monkeypatch):
    path = tmp_path / "cells.jsonl"
    path.write_text(json.dumps(_rec(bench, "svm_her", 0, [[0, 0.0], [1000, 0.9]])) + "\n")  # run here before
    ran = []

    def fake(cell):
        ran.append(bench.cell_id(cell))
        if cell["seed"] == 2:
            raise RuntimeError("worker lost")
        return _rec(bench, cell["reward"], cell["seed"], [[0, 0.0], [1000, 0.85]])

    monkeypatch.setattr(bench, "run_cell", fake)
    cells = bench.expand_cells("PandaPush-v3:svm_her:0-2")
    records = bench.run_cells(cells, path, workers=1)  # one worker: in this process (no Ray)
    assert ran == ["PandaPush-v3:svm_her:1:scratch", "PandaPush-v3:svm_her:2:scratch"]  # seed 0 was in the file
    assert [r["status"] for r in records] == ["ok", "failed"]
    done = bench.finished_cells(path)  # both record forms; the failed cell is not finished
    assert sorted(done) == ["PandaPush-v3:svm_her:0:scratch", "PandaPush-v3:svm_her:1:scratch"]
    assert bench.report(path, tmp_path)["table"][0]["to_80"]["per_seed"] == [1000, 1000]
    ran.clear()
    bench.run_cells(cells, path, workers=1)
    assert ran == ["PandaPush-v3:svm_her:2:scratch"]  # a rerun runs only the failed cell again


def test_prior_pull_and_refit_cells_are_their_own_experiments(bench, tmp_path):
    """A weaker pull towards a cloned prior is compared with sparse + HER under the same pull; a slower refit
    schedule is its own row of the shaped reward; settings that cannot apply are refused, not ignored."""
    bc = bench.parse_cell("PandaPush-v3:svm_her:0:bc")
    assert bench.cell_id(bc | {"prior_weight": 0.0}) == "PandaPush-v3:svm_her:0:bc@prior_weight=0"
    assert bench.cell_id(bc | {"refit": 2}) == "PandaPush-v3:svm_her:0:bc@refit=2"

    def rec(reward, seed, curve, **settings):
        cell = {"task": "PandaPush-v3", "reward": reward, "seed": seed, "prior": "bc"}
        settings = {"steps": 1000, **settings}
        return {"id": bench.cell_id(cell | settings), "cell": cell, "settings": bench.CELL_DEFAULTS | settings,
                "curve": curve, "wall_s": 1.0}

    recs = [rec("sparse_her", 0, [[0, 0.2], [1000, 0.3]]),  # pull 1: never reaches 80%
            rec("sparse_her", 0, [[0, 0.2], [500, 0.9]], prior_weight=0.0),
            rec("svm_her", 0, [[0, 0.2], [250, 0.9]], prior_weight=0.0),
            rec("svm_her", 0, [[0, 0.2], [750, 0.9]], refit=2)]
    path = tmp_path / "cells.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    rows = {(r["reward"], r["prior"]): r for r in bench.report(path, tmp_path)["table"]}
    # the pull-0 svm row is compared with the pull-0 sparse row (250 / 500), not with the pull-1 one
    assert rows[("svm_her (lam 0.05, beta 5)", "bc, pull 0, 1,000 steps")]["ratio_to_sparse_80"]["ratio"] == 0.5
    # the slower refit is its own row, compared with the default pull's sparse + HER (an upper bound: 750 / 1000)
    r = rows[("svm_her (lam 0.05, beta 5, refit 2)", "bc, 1,000 steps")]["ratio_to_sparse_80"]
    assert r["ratio"] == 0.75 and r["bound"] == "upper bound"
    for bad, what in (({"prior_weight": 0.0}, "cloned prior"), ({"refit": 2}, "sparse reward has none"),
                      ({"refit": 0}, "refit must be >= 1")):
        reward = "sparse_her" if "refit" in bad and bad["refit"] else "svm_her"
        cell = {"task": "PandaReach-v3", "reward": reward, "seed": 0, "prior": "scratch", **bad}
        with pytest.raises(ValueError, match=what):
            bench.run_cell(cell)
