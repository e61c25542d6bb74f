"""Weights kept in float16 or int8 by the Numba kernels (the fp16w and int8w variants), and the auto choice.

Each kernel path that reads stored weights (dense, GRU, LSTM, convolution, and the products of an
attention block) runs a variant of a tiny zoo model on Numba and on ONNX Runtime; both compute the same
graph in float32 from the same stored weights, so they agree to float32 rounding (stated: 1e-5 abs). The
Numba arena holds the weights compressed, a step allocates nothing, and ``Model(backend="auto")`` takes
a variant only when its record allows it, it is within tolerance and it is faster.
"""

from __future__ import annotations

import numpy as np
import pytest

from closedloop.runtime import Model, load_bundle
from closedloop.runtime.backends import registry
from closedloop.runtime.model import auto_variants
from closedloop.sdk.zoo import make_bundle

VARIANTS = ("fp16w", "int8w")
NUMBA_VS_ORT_ABS = 1e-5  # same graph, same stored weights, float32 sums in another order
# which zoo model exercises which kernel path with stored weights (the ops the variant stored)
PATHS = {"mlp": {"Gemm"}, "gru": {"GRU", "Gemm"}, "lstm": {"LSTM", "Gemm"}, "cnn": {"Conv", "Gemm"},
         "transformer": {"MatMul", "Gemm"}}


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    root = tmp_path_factory.mktemp("stored-weights")
    return {name: make_bundle(name, "tiny", root / name, variants=VARIANTS) for name in PATHS}


def _run_both(bundle, variant: str, steps: int = 6) -> float:
    """Largest |numba - onnxruntime| over ``steps`` random steps (state carried on both sides)."""
    models = [Model(bundle, backend=b, variant=variant) for b in ("numba", "onnxruntime")]
    rng = np.random.default_rng(3)
    worst = 0.0
    for _ in range(steps):
        for t in models[0].spec.data_inputs:
            x = rng.standard_normal(models[0].inputs[t.name].shape).astype(np.float32)
            for m in models:
                m.inputs[t.name][...] = x
        for m in models:
            m.run()
        for t in models[0].spec.outputs:
            worst = max(worst, float(np.max(np.abs(models[0].outputs[t.name] - models[1].outputs[t.name]))))
    for m in models:
        m.close()
    return worst


@pytest.mark.parametrize("rows,inputs", [(37, 13), (16, 4), (5, 1)])
def test_panel_products_in_every_storage_match_numpy(rows, inputs):
    from closedloop.runtime import kernels as k

    rng = np.random.default_rng(rows)
    w = rng.standard_normal((rows, inputs)).astype(np.float32)
    x = rng.standard_normal((3, inputs)).astype(np.float32)
    b = rng.standard_normal((1, rows)).astype(np.float32)
    lanes = np.zeros((1, k.POSITIONS * k.LANES), np.float32)
    scale = np.abs(w).max(axis=1, keepdims=True) / 127
    stored = {k.W_F32: w, k.W_F16: w.astype(np.float16).astype(np.float32),
              k.W_I8: np.clip(np.rint(w / scale), -127, 127) * scale}  # what each storage holds
    for storage, values in stored.items():
        panels = k.panel_storage(k.panel_layout(w), storage)
        assert panels.shape[1] == k.panel_width(inputs, storage)
        y = np.zeros((3, rows), np.float32)
        k.matmul_panel(x, panels, b, y, lanes, storage)
        np.testing.assert_allclose(y, x @ values.T + b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", sorted(PATHS))
def test_numba_runs_stored_weights_like_onnxruntime(bundles, name, variant):
    spec = load_bundle(bundles[name]).graph()
    assert PATHS[name] <= set(spec.variants[variant]["stored_weights"])
    assert _run_both(bundles[name], variant) <= NUMBA_VS_ORT_ABS


@pytest.mark.parametrize("name", ["gru", "cnn"])
def test_the_arena_holds_the_weights_compressed(bundles, name):
    size = {v: Model(bundles[name], backend="numba", variant=v).backend._arena.nbytes for v in ("fp32", *VARIANTS)}
    weights = load_bundle(bundles[name]).graph().variants["fp16w"]["weight_bytes_stored"]["fp32"]
    # fp16 halves the stored weights and int8 quarters them (plus a scale per row); activations are the same
    assert size["fp32"] - size["fp16w"] >= 0.4 * weights
    assert size["fp16w"] > size["int8w"]


def test_recorded_error_is_within_the_stated_tolerance(bundles):
    for name, bundle in bundles.items():
        for variant, record in load_bundle(bundle).graph().variants.items():
            parity, tol = record["parity_vs_fp32"], record["tolerance"]
            assert record["within_tolerance"] is True, (name, variant)
            assert parity["max_abs"] <= tol["abs"] or parity["max_rel"] <= tol["rel"], (name, variant)
            assert record["auto_choice"] is True and record["compute_dtype"] == "float32"


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_step_on_stored_weights_allocates_nothing(bundles, variant, bytes_allocated):
    m = Model(bundles["gru"], backend="numba", variant=variant)
    m.run()
    grown = bytes_allocated(m.run, 500)
    assert grown < 1024, f"run() allocated {grown} bytes over 500 calls"  # tracemalloc's own few hundred


def _fake_timing(fast: str):
    """``time_backend`` that makes variant file ``fast`` (e.g. ``main.int8w.onnx``) 100 us and all else 200 us."""
    def timing(backend, steps: int = 300, warmup: int = 30, seed: int = 0):
        return np.full(steps, 100_000 if backend.path.name == fast else 200_000, dtype=np.int64)
    return timing


def test_auto_takes_a_faster_variant_within_tolerance(bundles, monkeypatch):
    monkeypatch.setattr(registry, "time_backend", _fake_timing("main.int8w.onnx"))
    m = Model(bundles["mlp"], backend="auto")
    assert m.variant == "int8w" and m.choice.variant == "int8w"
    assert {"numba/int8w", "numba/fp16w", "numba"} <= set(m.choice.p99_us)
    assert Model(bundles["mlp"], backend="auto", variant="fp32").variant == "fp32"


def test_auto_keeps_fp32_when_no_variant_is_clearly_faster(bundles, monkeypatch):
    monkeypatch.setattr(registry, "time_backend", _fake_timing("main.onnx"))
    m = Model(bundles["mlp"], backend="auto")
    assert m.variant is None and m.choice.variant == "fp32"


def test_auto_never_takes_a_variant_outside_its_tolerance(bundles, monkeypatch):
    monkeypatch.setattr(registry, "time_backend", _fake_timing("main.int8w.onnx"))
    b = load_bundle(bundles["mlp"])
    b.graph().variants["int8w"]["within_tolerance"] = False
    m = Model(b, backend="auto")
    assert m.variant is None and not any(k.endswith("/int8w") for k in m.choice.p99_us)


def test_auto_variants_reads_the_records():
    records = {"fp16": {"within_tolerance": True}, "int8w": {"auto_choice": True, "within_tolerance": True},
               "fp16w": {"auto_choice": True, "within_tolerance": False}}
    assert auto_variants(records) == ["int8w"]
