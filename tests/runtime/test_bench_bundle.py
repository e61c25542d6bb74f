"""`closedloop bench BUNDLE`: any bundle timed on every backend and variant here, with torch absent."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from closedloop.runtime import backend_names, load_bundle
from closedloop.runtime.backends import NUMBA_IMPORT_ERROR
from closedloop.runtime.roofline import graph_cost, gru_flops, mlp_flops
from closedloop.sdk.cli import main

ROOT = Path(__file__).resolve().parents[2]

# As tests/runtime/test_torch_free.py: importing torch, onnx or a training extra fails, as on a board.
_BLOCKED = ("torch", "onnx", "onnxscript", "matplotlib", "scipy", "tqdm")
BLOCKER = textwrap.dedent(
    f"""
    import sys
    class _Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {_BLOCKED!r}:
                raise ModuleNotFoundError(f"blocked for this test: {{name}}", name=name.split(".")[0])
            return None
    sys.meta_path.insert(0, _Block())
    """
)
QUICK = ["--steps", "50", "--paced-seconds", "0.2"]


def _cli_without_torch(argv: list[str]) -> subprocess.CompletedProcess:
    code = BLOCKER + textwrap.dedent(
        f"""
        from closedloop.sdk.cli import main
        code = main({argv!r})
        assert not any(m.split(".")[0] in {_BLOCKED!r} for m in sys.modules), sorted(sys.modules)
        sys.exit(code)
        """
    )
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


def _finite_numbers(d: dict) -> list[float]:
    out = []
    for v in d.values():
        if isinstance(v, dict):
            out += _finite_numbers(v)
        elif isinstance(v, int | float) and not isinstance(v, bool):
            out.append(float(v))
    return out


def test_bench_times_every_backend_and_variant_without_torch(gru_bundle, tmp_path):
    out = tmp_path / "bench.json"
    r = _cli_without_torch(["bench", str(gru_bundle), *QUICK, "--json", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "deadline 20000.0 us" in r.stdout and "p99<=deadline" in r.stdout

    doc = json.loads(out.read_text())
    assert doc["machine"]["single_core_peak_gflops"] > 0
    (bench,) = doc["bundles"]
    assert bench["rate_hz"] == 50.0 and bench["deadline_us"] == 20000.0
    assert bench["flops"] == gru_flops(12, 16, 2, 5) and bench["flops_exact"]
    pairs = {(row["backend"], row["variant"]) for row in bench["rows"]}
    # numba is a row even where its module failed to import (skipped, saying why)
    assert pairs == {(b, v) for b in {*backend_names(), "numba"} for v in ("fp32", "fp16", "int8")}
    timed = {(row["backend"], row["variant"]): row for row in bench["rows"] if row["status"] == "timed"}
    assert {("onnxruntime", "fp32"), ("onnxruntime", "fp16"), ("onnxruntime", "int8")} <= set(timed)
    assert ("numba", "fp32") in timed or NUMBA_IMPORT_ERROR is not None
    for row in bench["rows"]:
        if row["status"] != "timed":
            assert row["status"] == "skipped" and row["reason"], row
            continue
        assert set(row["modes"]) == {"back_to_back", "paced_cold", "paced_prewarmed"}
        numbers = _finite_numbers(row)
        assert numbers and all(math.isfinite(x) for x in numbers), row
        assert row["floor_us"] > 0 and row["floor_cold_us"] >= row["floor_us"] * 0.5
        assert row["modes"]["back_to_back"]["n"] == 50
        for mode in row["modes"].values():
            assert 0 < mode["p50_us"] <= mode["p99_us"] <= mode["max_us"]
            assert mode["meets_deadline"] == (mode["p99_us"] <= 20000.0)
            assert mode["floor_ratio"] == pytest.approx(mode["p50_us"] / mode["floor_us"])
    # each timed pair has a line per mode in the table; the skipped ones say why
    for backend, variant in timed:
        assert sum(line.split()[:2] == [backend, variant] for line in r.stdout.splitlines()) == 3
    assert "skipped numba" in r.stdout  # (fp16: it runs float32 graphs only)


def test_plot_without_matplotlib_says_what_to_install(gru_bundle, tmp_path):
    r = _cli_without_torch(["bench", str(gru_bundle), *QUICK, "--plot", str(tmp_path / "x.png")])
    assert r.returncode == 2 and "pip install matplotlib" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "x.png").exists()


def test_several_bundles_json_and_plot(gru_bundle, mlp_bundle, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    argv = ["bench", str(gru_bundle), str(mlp_bundle), "--backend", "onnxruntime", "--variant", "fp32",
            "--steps", "20", "--paced-seconds", "0.1", "--json", str(out), "--plot", str(png)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    text = captured.out
    assert "deadline 20000.0 us" in text and "deadline 1000.0 us" in text
    # progress goes to stderr, so stdout redirected to a file holds only the tables and what was written
    assert "single-core peak" in captured.err and "steps back to back" in captured.err
    assert "single-core peak ..." not in text and "steps back to back, then" not in text
    doc = json.loads(out.read_text())
    assert [b["name"] for b in doc["bundles"]] == ["tiny-gru", "tiny-mlp"]
    assert [[(r["backend"], r["variant"], r["status"]) for r in b["rows"]] for b in doc["bundles"]] == [
        [("onnxruntime", "fp32", "timed")]] * 2
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["{tmp}"], "manifest.json is missing; this is not a bundle"),
        (["{tmp}/nothing-here"], "no such file or folder"),
        (["{gru}", "--backend", "numba", "--variant", "fp16"],
         ("no backend asked for can run tiny-gru here: numba (fp16): the graph computes in float16",
          "backend 'numba' cannot run here: the numba backend did not import")),
        (["{gru}", "--backend", "warp-drive"], "unknown backend 'warp-drive'; known backends:"),
        (["{gru}", "--variant", "fp8"], "has no variant 'fp8'; it has ['fp16', 'int8']"),
        (["{gru}", "--steps", "1"], "steps must be at least 2"),
        (["--json", "{tmp}/x.json"], "--json time(s) a BUNDLE: name one"),
        (["{gru}", "--quick"], "--quick and --out belong to the spine benchmark"),
    ],
)
def test_bad_input_is_one_clear_line(gru_bundle, tmp_path, capsys, args, says):
    argv = ["bench", *(a.format(tmp=tmp_path, gru=gru_bundle) for a in args)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert any(s in err for s in ((says,) if isinstance(says, str) else says)), err
    assert err.startswith("closedloop bench: error:") and len(err.splitlines()) == 1, err


def test_graph_cost_counts_the_multiply_adds_and_each_variants_weights(gru_bundle, mlp_bundle):
    gru, mlp = load_bundle(gru_bundle), load_bundle(mlp_bundle)
    cost = graph_cost(gru.graph_path(), gru.graph())
    assert cost.exact and cost.flops == gru_flops(12, 16, 2, 5)
    assert set(cost.flops_by_op) == {"GRU", "Gemm"}
    assert graph_cost(mlp.graph_path(), mlp.graph()).flops == mlp_flops([6, 16, 16, 3])
    fp16 = graph_cost(gru.graph_path("main", "fp16")).weight_bytes
    assert fp16 == pytest.approx(cost.weight_bytes / 2, rel=0.01)
    # without shapes every product counts one row: for batch-1 graphs that is the same count
    assert graph_cost(gru.graph_path()).flops == cost.flops


def test_the_sdk_roofline_names_still_work():
    from closedloop.runtime import roofline
    from closedloop.sdk import roofline as sdk_roofline

    for name in ("single_core_peak_gflops", "read_bandwidth_gbs", "cold_read_bandwidth_gbs", "gru_flops", "mlp_flops"):
        assert getattr(sdk_roofline, name) is getattr(roofline, name)


def test_a_variant_outside_its_parity_tolerance_is_marked_in_the_verdict(gru_bundle, tmp_path, capsys):
    """A fast variant that is not the model (the export measured it beyond its tolerance) must not read as fine."""
    import shutil

    from closedloop.runtime.bundle import MANIFEST_NAME
    from closedloop.runtime.integrity import seal_manifest

    b = tmp_path / "b"
    shutil.copytree(gru_bundle, b)
    manifest = json.loads((b / MANIFEST_NAME).read_text())
    manifest["graphs"]["main"]["variants"]["fp16"]["within_tolerance"] = False  # as an export that measured 0.3
    (b / MANIFEST_NAME).write_text(json.dumps(seal_manifest(manifest)))
    argv = ["bench", str(b), "--backend", "onnxruntime", "--variant", "fp32", "--variant", "fp16", "--steps", "20",
            "--paced-seconds", "0.1", "--json", str(tmp_path / "b.json")]
    assert main(argv) == 0
    text = capsys.readouterr().out
    verdict = next(line for line in text.splitlines() if line.startswith("p99 within"))
    assert "onnxruntime/fp16 (outside its parity tolerance)" in verdict and "onnxruntime/fp32," in verdict + ","
    assert "variant fp16 differ from fp32 beyond its parity tolerance" in text
    rows = json.loads((tmp_path / "b.json").read_text())["bundles"][0]["rows"]
    assert [(r["variant"], r.get("within_tolerance")) for r in rows] == [("fp32", None), ("fp16", False)]


@pytest.mark.parametrize(("sig", "code"), [("SIGTERM", -15), ("SIGINT", 130)])
def test_a_signal_during_the_paced_timing_stops_the_benchmark(mlp_bundle, sig, code):
    """The paced part runs the real-time loop, which turns Ctrl-C and SIGTERM into a clean stop of itself: the
    benchmark then stops too (it went on and printed its table, exit 0): 130 for Ctrl-C, and for SIGTERM it ends by
    the signal itself (a shell's 143, docs/cli.md), saying so on stderr."""
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "closedloop.sdk", "bench", str(mlp_bundle), "--backend",
                             "onnxruntime", "--variant", "fp32", "--steps", "50", "--paced-seconds", "20"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(6.0)  # imports and the back-to-back part are done; the 20 s paced part is running
    proc.send_signal(getattr(signal, sig))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == code, (out, err)
    assert "internal error" not in err and out == ""
    if sig == "SIGTERM":
        assert "closedloop bench: terminated (SIGTERM)" in err
