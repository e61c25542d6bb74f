"""Every pair of backends available here agrees on real exported bundles, and with torch.

Tolerances: fp32 graphs, max abs error 1e-4 after a 50-step rollout that carries the
recurrent state. Backends sum in different orders (Numba's fastmath reductions,
ONNX Runtime's MLAS kernels), so bitwise equality is not expected; 1e-4 is well above
the ~1e-6 reordering error seen and far below any error that changes a decision.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from closedloop.runtime import Model, backend_report, load_bundle

TOL = 1e-4


def _available(bundle_path):
    b = load_bundle(bundle_path)
    return [n for n, a in backend_report(b.graph_path(), b.graph()).items() if a]


def _rollout(bundle_path, backend, xs):
    m = Model(bundle_path, backend=backend)
    out = np.stack([m.step(x[None]).copy()[0] for x in xs])
    m.close()
    return out


def _torch_rollout(model, xs, recurrent):
    with torch.no_grad():
        if recurrent:
            y, _ = model(torch.from_numpy(xs)[None])
            return y[0].numpy()
        return model(torch.from_numpy(xs)).numpy()


@pytest.mark.parametrize("which", ["gru", "mlp"])
def test_all_backend_pairs_agree(which, request, tiny_models):
    path = request.getfixturevalue(f"{which}_bundle")
    names = _available(path)
    assert "onnxruntime" in names and "numba" in names, f"expected both CPU backends here, got {names}"
    n_in = 12 if which == "gru" else 6
    xs = np.random.default_rng(3).standard_normal((50, n_in)).astype(np.float32)
    outs = {n: _rollout(path, n, xs) for n in names}
    outs["torch"] = _torch_rollout(tiny_models[which], xs, which == "gru")
    for a, b in itertools.combinations(outs, 2):
        err = np.abs(outs[a] - outs[b]).max()
        assert err <= TOL, f"{which}: {a} vs {b} differ by {err:.2e} (> {TOL})"


def test_reset_restarts_the_sequence(gru_bundle):
    m = Model(gru_bundle, backend="onnxruntime")
    xs = np.random.default_rng(0).standard_normal((10, 1, 12)).astype(np.float32)
    first = [m.step(x).copy() for x in xs]
    m.reset()
    again = [m.step(x).copy() for x in xs]
    np.testing.assert_array_equal(np.array(first), np.array(again))
    # without reset the state carries on and outputs differ
    third = [m.step(x).copy() for x in xs]
    assert np.abs(np.array(third) - np.array(first)).max() > 1e-6


def test_auto_picks_a_measured_backend(gru_bundle):
    m = Model(gru_bundle, backend="auto")
    assert m.backend_name in m.choice.p99_us
    assert m.choice.p99_us[m.backend_name] == min(m.choice.p99_us.values())
    # backends that cannot run here are reported with a reason, not silently dropped
    for name, reason in m.choice.skipped.items():
        assert reason, name


def test_unknown_backend_is_refused_with_the_list(gru_bundle):
    from closedloop.runtime import BackendUnavailableError

    with pytest.raises(BackendUnavailableError, match="known backends"):
        Model(gru_bundle, backend="tpu")


def test_unavailable_backend_says_why(gru_bundle):
    from closedloop.runtime import BackendUnavailableError

    with pytest.raises(BackendUnavailableError, match="tensorrt"):
        Model(gru_bundle, backend="tensorrt")


@pytest.mark.parametrize("variant", ["fp16", "int8"])
def test_variants_run_close_to_fp32(gru_bundle, variant):
    xs = np.random.default_rng(1).standard_normal((20, 1, 12)).astype(np.float32)
    ref = Model(gru_bundle, backend="onnxruntime")
    var = Model(gru_bundle, backend="onnxruntime", variant=variant)
    err = max(np.abs(ref.step(x) - var.step(x)).max() for x in xs)
    assert err < {"fp16": 1e-2, "int8": 5e-2}[variant]
