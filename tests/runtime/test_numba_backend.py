"""The Numba backend against ONNX Runtime and torch, on real small ONNX graphs.

Tolerances. The backend cannot be bitwise equal to torch or ONNX Runtime: its
matrix-vector products sum in 16 SIMD lanes times 4 chains (``fastmath`` lets LLVM
reorder float sums), and tanh/sigmoid are rational approximations with at most
5e-7 absolute error (3.1e-7 measured, tested below), where torch and ORT sum in their
own (also different) orders. float32 has a 6e-8 relative epsilon, and a 448-term dot product of O(1) values
carries roughly 1e-6 of rounding; so one step must agree to 2e-5 and a 20-step
rollout, whose state feeds back, to 1e-4 (max abs error). A real bug (a gate in the
wrong order, a missed bias, the wrong layer's state) shows up as errors of 1e-2 or more.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime")
pytest.importorskip("numba")

from closedloop.runtime.backends.base import BackendOptions  # noqa: E402
from closedloop.runtime.backends.numba_backend import NumbaBackend  # noqa: E402
from closedloop.runtime.backends.onnxruntime_backend import OrtCpuBackend  # noqa: E402
from closedloop.runtime.backends.registry import backend_report, create_backend  # noqa: E402
from closedloop.runtime.errors import BackendUnavailableError, GraphUnsupportedError  # noqa: E402
from closedloop.runtime.manifest import GraphSpec, TensorSpec  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::torch.jit.TracerWarning")

STEP_ATOL = 2e-5
ROLLOUT_ATOL = 1e-4


# -- graphs ------------------------------------------------------------------------------
class GruStep(torch.nn.Module):
    """A single-step GRU decoder: x (B, I), h (L, B, H) -> logp (B, O), h_out (L, B, H)."""

    def __init__(self, n_in: int, hidden: int, layers: int, n_out: int):
        super().__init__()
        self.g = torch.nn.GRU(n_in, hidden, layers, batch_first=True)
        self.o = torch.nn.Linear(hidden, n_out)

    def forward(self, x, h):
        y, h2 = self.g(x.unsqueeze(1), h)
        return torch.log_softmax(self.o(y[:, 0]), -1), h2


def _export(module, args, path: Path, inputs: list[str], outputs: list[str], batch_axes: dict) -> Path:
    torch.onnx.export(
        module.eval(), args, str(path), dynamo=False, opset_version=17,
        input_names=inputs, output_names=outputs, dynamic_axes=batch_axes,
    )
    return path


def _gru_graph(tmp: Path, n_in: int, hidden: int, layers: int, n_out: int):
    torch.manual_seed(n_in * 1000 + hidden + layers)
    m = GruStep(n_in, hidden, layers, n_out).eval()
    path = _export(
        m, (torch.randn(1, n_in), torch.zeros(layers, 1, hidden)), tmp / f"gru_{n_in}_{hidden}_{layers}.onnx",
        ["x", "h"], ["logp", "h_out"], {"x": {0: "batch"}, "h": {1: "batch"}, "logp": {0: "batch"}, "h_out": {1: "batch"}},
    )
    spec = GraphSpec(
        file=path.name, kind="recurrent",
        inputs=[TensorSpec("x", "float32", ["batch", n_in]),
                TensorSpec("h", "float32", [layers, "batch", hidden], state=True, state_pair="h_out")],
        outputs=[TensorSpec("logp", "float32", ["batch", n_out]),
                 TensorSpec("h_out", "float32", [layers, "batch", hidden], state=True, state_pair="h")],
    )
    return m, path, spec


def _mlp_graph(tmp: Path, name: str, module: torch.nn.Module, obs_shape: tuple[int, ...], n_act: int):
    path = _export(module, (torch.randn(1, *obs_shape),), tmp / f"{name}.onnx", ["obs"], ["act"],
                   {"obs": {0: "batch"}, "act": {0: "batch"}})
    spec = GraphSpec(file=path.name, kind="feedforward",
                     inputs=[TensorSpec("obs", "float32", ["batch", *obs_shape])],
                     outputs=[TensorSpec("act", "float32", ["batch", n_act])])
    return module, path, spec


class Normalised(torch.nn.Module):
    """(obs - mean) / std, then an MLP: the export gives Sub and Div by constant vectors."""

    def __init__(self, net: torch.nn.Module, n_obs: int):
        super().__init__()
        self.net = net
        self.register_buffer("mean", torch.linspace(-1, 1, n_obs))
        self.register_buffer("std", torch.linspace(0.5, 2, n_obs))

    def forward(self, x):
        return self.net((x - self.mean) / self.std)


class MatMulPolicy(torch.nn.Module):
    """Reshape by a computed shape, x @ W + b (MatMul, Add), sigmoid, scale, softmax."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(12, 37) * 0.3)
        self.b = torch.nn.Parameter(torch.randn(37))

    def forward(self, x):
        y = torch.sigmoid(x.reshape(x.shape[0], -1) @ self.w + self.b)
        return torch.softmax(2.0 * y - 1.0, -1)


def _seq(*layers):
    torch.manual_seed(len(layers))
    return torch.nn.Sequential(*layers).eval()


MLPS = {
    "relu_tanh_final_tanh": lambda: (_seq(torch.nn.Linear(40, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                          torch.nn.Tanh(), torch.nn.Linear(256, 8), torch.nn.Tanh()), (40,), 8),
    "relu_no_final_act": lambda: (_seq(torch.nn.Linear(17, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                       torch.nn.ReLU(), torch.nn.Linear(64, 3)), (17,), 3),
    "normalised_tanh": lambda: (Normalised(_seq(torch.nn.Linear(40, 100), torch.nn.Tanh(), torch.nn.Linear(100, 7),
                                                torch.nn.Tanh()), 40).eval(), (40,), 7),
    "matmul_flatten_softmax": lambda: (MatMulPolicy().eval(), (3, 4), 37),
}


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    """Build each graph once per module (exporting is the slow part)."""
    tmp = tmp_path_factory.mktemp("numba_graphs")
    cache: dict = {}

    def get(kind: str, *key):
        if (kind, key) not in cache:
            if kind == "gru":
                cache[(kind, key)] = _gru_graph(tmp, *key)
            else:
                module, obs_shape, n_act = MLPS[key[0]]()
                cache[(kind, key)] = _mlp_graph(tmp, key[0], module, obs_shape, n_act)
        return cache[(kind, key)]

    return get


def _fill(backend, rng, scale=1.0):
    for arr in backend.inputs.values():
        arr[...] = (rng.standard_normal(arr.shape) * scale).astype(np.float32)


# -- parity ------------------------------------------------------------------------------
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("size", [(20, 16, 1, 5), (192, 256, 2, 32), (7, 33, 2, 3), (64, 48, 3, 10)])
def test_gru_step_matches_onnxruntime_and_torch(graphs, size, batch):
    model, path, spec = graphs("gru", *size)
    opts = BackendOptions(batch=batch)
    nb, ort = NumbaBackend(path, spec, opts), OrtCpuBackend(path, spec, opts)
    rng = np.random.default_rng(1)
    for _ in range(3):
        nb.inputs["x"][...] = rng.standard_normal(nb.inputs["x"].shape)
        nb.inputs["h"][...] = np.tanh(rng.standard_normal(nb.inputs["h"].shape))
        for name in nb.inputs:
            ort.inputs[name][...] = nb.inputs[name]
        nb.run()
        ort.run()
        with torch.inference_mode():
            logp, h = model(torch.from_numpy(nb.inputs["x"].copy()), torch.from_numpy(nb.inputs["h"].copy()))
        for name, ref in (("logp", logp.numpy()), ("h_out", h.numpy())):
            np.testing.assert_allclose(nb.outputs[name], ref, rtol=0, atol=STEP_ATOL, err_msg=f"{name} vs torch")
            np.testing.assert_allclose(nb.outputs[name], ort.outputs[name], rtol=0, atol=STEP_ATOL, err_msg=name)


@pytest.mark.parametrize("batch", [1, 3])
def test_gru_20_step_rollout_matches_torch_on_the_whole_sequence(graphs, batch):
    model, path, spec = graphs("gru", 192, 256, 2, 32)
    nb = NumbaBackend(path, spec, BackendOptions(batch=batch))
    rng = np.random.default_rng(2)
    xs = rng.standard_normal((batch, 20, 192)).astype(np.float32)
    h0 = np.tanh(rng.standard_normal((2, batch, 256))).astype(np.float32)
    with torch.inference_mode():
        y, h_last = model.g(torch.from_numpy(xs), torch.from_numpy(h0))
        ref_logp = torch.log_softmax(model.o(y), -1).numpy()
    nb.inputs["h"][...] = h0
    worst = 0.0
    for t in range(20):
        nb.inputs["x"][...] = xs[:, t]
        nb.run()
        worst = max(worst, float(np.abs(nb.outputs["logp"] - ref_logp[:, t]).max()))
        nb.inputs["h"][...] = nb.outputs["h_out"]  # what the runtime does with state_pair
    assert worst <= ROLLOUT_ATOL, f"log-probabilities drift {worst:.2e} over 20 steps"
    np.testing.assert_allclose(nb.outputs["h_out"], h_last.numpy(), rtol=0, atol=ROLLOUT_ATOL)


@pytest.mark.parametrize("name", sorted(MLPS))
@pytest.mark.parametrize("batch", [1, 3])
def test_mlp_matches_onnxruntime_and_torch(graphs, name, batch):
    model, path, spec = graphs("mlp", name)
    opts = BackendOptions(batch=batch)
    nb, ort = NumbaBackend(path, spec, opts), OrtCpuBackend(path, spec, opts)
    rng = np.random.default_rng(3)
    for _ in range(3):
        _fill(nb, rng, scale=2.0)
        ort.inputs["obs"][...] = nb.inputs["obs"]
        nb.run()
        ort.run()
        with torch.inference_mode():
            ref = model(torch.from_numpy(nb.inputs["obs"].copy())).numpy()
        np.testing.assert_allclose(nb.outputs["act"], ref, rtol=0, atol=STEP_ATOL)
        np.testing.assert_allclose(nb.outputs["act"], ort.outputs["act"], rtol=0, atol=STEP_ATOL)


def test_plumbing_and_fusion_leave_few_kernel_steps(graphs):
    _, path, spec = graphs("gru", 192, 256, 2, 32)
    # Two GRU layers and one dense layer with its log-softmax fused: nothing for the plumbing.
    assert len(NumbaBackend(path, spec)._program) == 3
    _, path, spec = graphs("mlp", "matmul_flatten_softmax")
    # MatMul with Add and Sigmoid fused; 2*y-1 as one affine step; softmax.
    assert len(NumbaBackend(path, spec)._program) == 3


@pytest.mark.parametrize("kind, key", [("gru", (192, 256, 2, 32)), ("mlp", ("relu_tanh_final_tanh",))])
def test_nan_input_shows_up_as_nan_outputs_as_in_torch(graphs, kind, key):
    """fastmath must not turn a NaN into a plausible number the runtime's guards would miss.

    (ONNX Runtime's GRU does exactly that: its gate approximations map NaN to numbers.)
    """
    model, path, spec = graphs(kind, *key)
    nb = NumbaBackend(path, spec, BackendOptions(batch=2))
    _fill(nb, np.random.default_rng(8))
    data = spec.data_inputs[0].name
    nb.inputs[data][1, 3] = np.nan
    nb.run()
    with torch.inference_mode():
        ref = model(*(torch.from_numpy(nb.inputs[t.name].copy()) for t in spec.inputs))
    ref = ref if isinstance(ref, tuple) else (ref,)
    for t, r in zip(spec.outputs, ref, strict=True):
        got = np.isnan(nb.outputs[t.name])
        assert got.any(), f"NaN input vanished from {t.name}"
        np.testing.assert_array_equal(got, np.isnan(r.numpy()), err_msg=t.name)



# -- activation kernels ------------------------------------------------------------------
ACTIVATION_ATOL = 5e-7  # fast_tanh measures 3.1e-7 (tools/fit_tanh.py); float32 rounding is ~3e-7 of it


def test_fast_tanh_and_sigmoid_match_numpy_over_a_dense_grid_and_saturate():
    """Through ``activate``, the compiled path the models use; tanh(x/2) covers [-10, 10] for sigmoid."""
    from closedloop.runtime import kernels

    special = [0.0, -0.0, 1e-30, -1e-30, 1e-7, 8.999999, 9.0, 9.000001, -9.0, 30.0, -30.0, 1e4, -1e4,
               3e38, -3e38, np.inf, -np.inf]
    x = np.concatenate([np.linspace(-20, 20, 4_000_001), special]).astype(np.float32)[None, :]
    x64 = x.astype(np.float64)
    for act, exact, low in [(kernels.ACT_TANH, np.tanh(x64), -1.0),
                            (kernels.ACT_SIGMOID, 0.5 * np.tanh(0.5 * x64) + 0.5, 0.0)]:
        y = np.empty_like(x)
        kernels.activate(x, y, act)
        err = np.abs(y - exact)
        worst = int(np.argmax(err))
        assert err[0, worst] <= ACTIVATION_ATOL, f"act {act}: error {err[0, worst]:.3g} at x = {x[0, worst]}"
        assert y.min() >= low and y.max() <= 1.0, f"act {act}: outside [{low}, 1]"
        np.testing.assert_allclose(y[0, -2:], [1.0, low], rtol=0, atol=ACTIVATION_ATOL)  # +-inf saturate


@pytest.mark.parametrize("act", ["ACT_TANH", "ACT_SIGMOID"])
def test_fast_tanh_and_sigmoid_keep_nan(act):
    from closedloop.runtime import kernels

    x = np.array([[np.nan, 0.5, -np.nan, 20.0, np.nan]], np.float32)
    y = np.empty_like(x)
    kernels.activate(x, y, getattr(kernels, act))
    np.testing.assert_array_equal(np.isnan(y), np.isnan(x))


# -- refusing what it cannot run ---------------------------------------------------------
class BiLstm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l = torch.nn.LSTM(6, 4, bidirectional=True)

    def forward(self, x):
        return self.l(x.unsqueeze(0))[0][0]


class DetNet(torch.nn.Module):
    def forward(self, x):
        return torch.linalg.det(x)[:, None]


class BiGru(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.g = torch.nn.GRU(6, 8, bidirectional=True)

    def forward(self, x):
        return self.g(x.unsqueeze(0))[0][0]


@pytest.mark.parametrize(("module", "n_out"), [(BiLstm, 8), (BiGru, 16)])
def test_a_bidirectional_layer_runs_as_torch_computes_it(tmp_path, module, n_out):
    torch.manual_seed(0)
    model, path, spec = _mlp_graph(tmp_path, module.__name__, module().eval(), (6,), n_out)
    nb = NumbaBackend(path, spec, BackendOptions(batch=3))
    _fill(nb, np.random.default_rng(3))
    nb.run()
    with torch.inference_mode():
        want = model(torch.from_numpy(nb.inputs["obs"].copy())).numpy()
    np.testing.assert_allclose(nb.outputs["act"], want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("module, obs, n_out, op", [(DetNet, (3, 3), 1, "Det")])
def test_unsupported_graph_is_refused_naming_the_op(tmp_path, module, obs, n_out, op):
    _, path, spec = _mlp_graph(tmp_path, module.__name__, module().eval(), obs, n_out)
    verdict = NumbaBackend.supports(path, spec)
    assert not verdict
    assert op in verdict.reason and "onnxruntime" in verdict.reason
    with pytest.raises(GraphUnsupportedError, match=op):
        NumbaBackend(path, spec)
    with pytest.raises(BackendUnavailableError, match=op):  # and by name through the registry
        create_backend("numba", path, spec)


def test_manifest_that_does_not_match_the_graph_is_refused(graphs):
    _, path, spec = graphs("mlp", "relu_no_final_act")
    wrong = GraphSpec(file=spec.file, kind="feedforward", inputs=[TensorSpec("x", "float32", ["batch", 17])],
                      outputs=spec.outputs)
    verdict = NumbaBackend.supports(path, wrong)
    assert not verdict and "manifest" in verdict.reason


# -- real-time properties ----------------------------------------------------------------
def test_run_writes_outputs_in_place_and_allocates_nothing(graphs, bytes_allocated):
    _, path, spec = graphs("gru", 192, 256, 2, 32)
    nb = NumbaBackend(path, spec)
    outputs = {k: (v, v.ctypes.data) for k, v in nb.outputs.items()}
    rng = np.random.default_rng(4)
    _fill(nb, rng)
    nb.run()
    first = nb.outputs["logp"].copy()
    grown = bytes_allocated(nb.run, 500)
    assert grown < 1024, f"run() allocated {grown} bytes over 500 calls"
    nb.inputs["x"][...] = rng.standard_normal(nb.inputs["x"].shape)
    nb.run()
    for name, (arr, ptr) in outputs.items():
        assert nb.outputs[name] is arr and arr.ctypes.data == ptr, f"{name} was replaced, not written in place"
    assert not np.allclose(nb.outputs["logp"], first), "new input, same output: outputs not written in place"


def test_first_timed_step_is_not_a_compile(graphs):
    _, path, spec = graphs("gru", 192, 256, 2, 32)
    nb = NumbaBackend(path, spec)
    _fill(nb, np.random.default_rng(5))
    t0 = time.perf_counter_ns()
    nb.run()
    first = time.perf_counter_ns() - t0
    times = []
    for _ in range(200):
        t0 = time.perf_counter_ns()
        nb.run()
        times.append(time.perf_counter_ns() - t0)
    median = float(np.median(times))
    assert first < 5e6 and first < 50 * median, f"first step {first / 1e3:.0f} us, median {median / 1e3:.0f} us"


# -- weights -----------------------------------------------------------------------------
def test_set_initializers_replaces_weights(graphs):
    model, path, spec = graphs("gru", 20, 16, 1, 5)
    nb, ort = NumbaBackend(path, spec), OrtCpuBackend(path, spec)
    rng = np.random.default_rng(6)
    _fill(nb, rng)
    nb.run()
    before = nb.outputs["logp"].copy()
    recurrent = next(k for k, v in nb._model.initializers.items() if v.shape == (1, 48, 16))
    new = {"o.bias": np.arange(5, dtype=np.float32), recurrent: np.zeros((1, 48, 16), np.float32)}
    nb.set_initializers(new)
    ort.set_initializers(new)
    for name in nb.inputs:
        ort.inputs[name][...] = nb.inputs[name]
    nb.run()
    ort.run()
    assert not np.allclose(nb.outputs["logp"], before, atol=1e-3)
    for name in nb.outputs:
        np.testing.assert_allclose(nb.outputs[name], ort.outputs[name], rtol=0, atol=STEP_ATOL)
    with pytest.raises(KeyError, match="no_such_weight"):
        nb.set_initializers({"no_such_weight": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match="shape"):
        nb.set_initializers({"o.bias": np.zeros(4, np.float32)})


def test_set_initializers_refolds_constants_into_the_bias(graphs):
    model, path, spec = graphs("mlp", "matmul_flatten_softmax")
    nb, ort = NumbaBackend(path, spec), OrtCpuBackend(path, spec)
    new = {"b": np.linspace(-3, 3, 37).astype(np.float32)}
    nb.set_initializers(new)
    ort.set_initializers(new)
    _fill(nb, np.random.default_rng(7))
    ort.inputs["obs"][...] = nb.inputs["obs"]
    nb.run()
    ort.run()
    np.testing.assert_allclose(nb.outputs["act"], ort.outputs["act"], rtol=0, atol=STEP_ATOL)


# -- packaging ---------------------------------------------------------------------------
def test_registered_and_reported(graphs):
    _, path, spec = graphs("mlp", "relu_no_final_act")
    report = backend_report(path, spec)
    assert report["numba"] and "numba" in NumbaBackend.availability().reason
    backend, choice = create_backend("numba", path, spec)
    assert isinstance(backend, NumbaBackend) and choice.chosen == "numba"


def test_runtime_side_imports_neither_torch_nor_onnx():
    code = (
        "import sys, closedloop.runtime.kernels, closedloop.runtime.backends.numba_backend\n"
        "bad = [m for m in ('torch', 'onnx') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


def test_an_fp16_variant_is_refused_saying_why(gru_bundle):
    # the fp16 variant casts its float32 inputs down; the backend names the precision, not the first cast it meets
    from closedloop.runtime import Model

    with pytest.raises(BackendUnavailableError, match="computes in float16 .an fp16 variant.; the numba backend runs "
                                                      "float32 graphs and float16 weights widened to float32 .an "
                                                      "fp16w variant.; use --backend onnxruntime"):
        Model(gru_bundle, backend="numba", variant="fp16")
    assert Model(gru_bundle, backend="onnxruntime", variant="fp16").backend_name == "onnxruntime"
