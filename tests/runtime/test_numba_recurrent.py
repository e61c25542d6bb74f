"""The Numba backend's LSTM (and sequence GRU and RNN) against ONNX Runtime, and streaming through ``Model``.

Graphs are what torch.onnx exports for ``nn.LSTM``: a single-step graph ``step(x, h, c) ->
(y, h_out, c_out)`` with explicit state (one ONNX LSTM node per layer, initial state read
from a layer slice of ``h``/``c``, final state concatenated into ``h_out``/``c_out``), and
an LSTM or GRU run over a whole window inside a feedforward graph. Reverse-direction
layers, which torch does not export alone, come from graphs written with ``onnx.helper``.

Tolerance (every test here): fp32, ``|numba - ort| <= 1e-5 + 1e-4 |ort|`` per element. The
backend sums in SIMD lanes and uses rational tanh/sigmoid (errors below 4e-7), ONNX
Runtime its own order and functions; a wrong gate order, bias or layer shows up as 1e-2.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("numba")

from closedloop.export import export_bundle  # noqa: E402
from closedloop.runtime import Model  # noqa: E402
from closedloop.runtime.backends.base import BackendOptions  # noqa: E402
from closedloop.runtime.backends.numba_backend import NumbaBackend  # noqa: E402
from closedloop.runtime.backends.onnxruntime_backend import OrtCpuBackend  # noqa: E402
from closedloop.runtime.manifest import GraphSpec, TensorSpec  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                        "ignore::torch.jit.TracerWarning")

ATOL, RTOL = 1e-5, 1e-4


class LstmDecoder(torch.nn.Module):
    """x (B, I) and state (L, B, H) twice -> y (B, O) and the next state: what a user's LSTM decoder exports."""

    def __init__(self, n_in: int = 32, hidden: int = 64, layers: int = 2, n_out: int = 8):
        super().__init__()
        self.layers, self.hidden = layers, hidden
        self.lstm = torch.nn.LSTM(n_in, hidden, layers, batch_first=True)
        self.head = torch.nn.Linear(hidden, n_out)

    def init_state(self, batch: int):
        return torch.zeros(self.layers, batch, self.hidden), torch.zeros(self.layers, batch, self.hidden)

    def step(self, x, h, c):
        y, (h2, c2) = self.lstm(x.unsqueeze(1), (h, c))
        return self.head(y[:, 0]), h2, c2

    def forward(self, seq, h, c):
        y, (h2, c2) = self.lstm(seq, (h, c))
        return self.head(y), h2, c2


class Windowed(torch.nn.Module):
    """(B, T, F) -> (B, O): a recurrent layer over the whole window, then its last output."""

    def __init__(self, cell: type, n_in: int = 6, hidden: int = 20, layers: int = 2, **options):
        super().__init__()
        self.rnn = cell(n_in, hidden, layers, batch_first=True, **options)
        self.head = torch.nn.Linear(hidden, 3)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


def _step_graph(tmp_path, layers: int, n_in: int = 32, hidden: int = 64, n_out: int = 8):
    torch.manual_seed(layers)
    module = LstmDecoder(n_in, hidden, layers, n_out).eval()
    path = tmp_path / f"lstm{layers}.onnx"
    dyn = {"x": {0: "batch"}, "h": {1: "batch"}, "c": {1: "batch"}, "y": {0: "batch"}, "h_out": {1: "batch"},
           "c_out": {1: "batch"}}
    wrapper = _StepOnly(module).eval()
    torch.onnx.export(wrapper, (torch.randn(1, n_in), *module.init_state(1)), str(path), dynamo=False,
                      opset_version=17, input_names=["x", "h", "c"], output_names=["y", "h_out", "c_out"],
                      dynamic_axes=dyn)
    state = [layers, "batch", hidden]
    spec = GraphSpec(
        file=path.name, kind="recurrent",
        inputs=[TensorSpec("x", "float32", ["batch", n_in]),
                TensorSpec("h", "float32", state, state=True, state_pair="h_out"),
                TensorSpec("c", "float32", state, state=True, state_pair="c_out")],
        outputs=[TensorSpec("y", "float32", ["batch", n_out]),
                 TensorSpec("h_out", "float32", state, state=True, state_pair="h"),
                 TensorSpec("c_out", "float32", state, state=True, state_pair="c")],
    )
    return path, spec


class _StepOnly(torch.nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x, h, c):
        return self.module.step(x, h, c)


def _feedforward_spec(path, in_shape, out_shape) -> GraphSpec:
    return GraphSpec(file=path.name, kind="feedforward", inputs=[TensorSpec("x", "float32", ["batch", *in_shape])],
                     outputs=[TensorSpec("y", "float32", ["batch", *out_shape])])


def _assert_matches(path, spec, batch: int, steps: int = 3, seed: int = 0) -> NumbaBackend:
    opts = BackendOptions(batch=batch)
    nb, ort = NumbaBackend(path, spec, opts), OrtCpuBackend(path, spec, opts)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        for name, arr in nb.inputs.items():
            arr[...] = rng.standard_normal(arr.shape)
            ort.inputs[name][...] = arr
        nb.run()
        ort.run()
        for name in nb.outputs:
            np.testing.assert_allclose(nb.outputs[name], ort.outputs[name], rtol=RTOL, atol=ATOL, err_msg=name)
    return nb


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("layers", [1, 2])
def test_lstm_step_matches_onnxruntime(tmp_path, layers, batch):
    path, spec = _step_graph(tmp_path, layers)
    nb = _assert_matches(path, spec, batch)
    # one LSTM step per layer and the head: state slices and concatenations cost no step
    assert len(nb._program) == layers + 1


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("cell", ["LSTM", "GRU", "RNN", "RNN-relu"])
def test_recurrent_layer_over_a_window_matches_onnxruntime(tmp_path, cell, batch):
    torch.manual_seed(7)
    name, _, nonlinearity = cell.partition("-")
    module = Windowed(getattr(torch.nn, name), **({"nonlinearity": nonlinearity} if nonlinearity else {})).eval()
    path = tmp_path / f"{cell}_window.onnx"
    torch.onnx.export(module, (torch.randn(1, 12, 6),), str(path), dynamo=False, opset_version=17,
                      input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}})
    _assert_matches(path, _feedforward_spec(path, (12, 6), (3,)), batch)


def _reverse_graph(path, op: str, steps: int, n_in: int, hidden: int):
    """One ``op`` node with direction="reverse" over a (steps, batch, n_in) input, all outputs."""
    from onnx import TensorProto, helper, numpy_helper

    gates = {"LSTM": 4, "GRU": 3, "RNN": 1}[op]
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array((rng.standard_normal(shape) * 0.4).astype(np.float32), name)
             for name, shape in (("W", (1, gates * hidden, n_in)), ("R", (1, gates * hidden, hidden)),
                                 ("B", (1, 2 * gates * hidden)))]
    states = ["h0", "c0"] if op == "LSTM" else ["h0"]
    outs = ["y", "h_last", "c_last"] if op == "LSTM" else ["y", "h_last"]
    extra = {"linear_before_reset": 1} if op == "GRU" else {}
    node = helper.make_node(op, ["x", "W", "R", "B", "", *states], outs, hidden_size=hidden, direction="reverse",
                            **extra)
    ins = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [steps, "batch", n_in])]
    ins += [helper.make_tensor_value_info(s, TensorProto.FLOAT, [1, "batch", hidden]) for s in states]
    shapes = {"y": [steps, 1, "batch", hidden], "h_last": [1, "batch", hidden], "c_last": [1, "batch", hidden]}
    graph = helper.make_graph([node], "reverse", ins,
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, shapes[o]) for o in outs], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))

    def spec_of(names, shape_of):
        return [TensorSpec(n, "float32", ["batch" if d == "batch" else d for d in shape_of(n)]) for n in names]

    in_shapes = {"x": [steps, "batch", n_in], "h0": [1, "batch", hidden], "c0": [1, "batch", hidden]}
    return GraphSpec(file=path.name, kind="feedforward", inputs=spec_of(["x", *states], in_shapes.__getitem__),
                     outputs=spec_of(outs, shapes.__getitem__))


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_reverse_direction_matches_onnxruntime(tmp_path, op, batch):
    path = tmp_path / f"{op}_reverse.onnx"
    spec = _reverse_graph(path, op, steps=5, n_in=7, hidden=24)
    _assert_matches(path, spec, batch)


def test_lstm_streams_through_model_as_onnxruntime_over_50_steps(tmp_path):
    """The user's view: export a bundle, step it 50 times on each backend, state carried by ``Model``."""
    torch.manual_seed(11)
    module = LstmDecoder().eval()
    bundle = export_bundle(module, tmp_path / "lstm", kind="recurrent", example_input=torch.randn(1, 32), rate_hz=50,
                           variants=(), tensorrt=False, report=lambda _: None)
    xs = np.random.default_rng(5).standard_normal((50, 1, 32)).astype(np.float32)
    outs = {}
    for backend in ("numba", "onnxruntime"):
        model = Model(bundle, backend=backend)
        assert model.backend_name == backend
        outs[backend] = np.stack([np.array(model.step(x), copy=True) for x in xs])
        model.close()
    np.testing.assert_allclose(outs["numba"], outs["onnxruntime"], rtol=RTOL, atol=ATOL)
    with torch.inference_mode():  # and the same sequence through torch in one call
        ref, _, _ = module(torch.from_numpy(xs[:, 0][None]), *module.init_state(1))
    np.testing.assert_allclose(outs["numba"][:, 0], ref[0].numpy(), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("nonlinearity", ["tanh", "relu"])
def test_an_elman_rnn_streams_on_numba_as_torch_computes_it(tmp_path, nonlinearity):
    """nn.RNN (the recurrent networks of cortex models) through SequenceStep: one Numba step per layer."""
    from closedloop.export import SequenceStep

    class Elman(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = torch.nn.RNN(6, 16, 2, batch_first=True, nonlinearity=nonlinearity)
            self.head = torch.nn.Linear(16, 3)

        def forward(self, seq, h):
            y, h = self.rnn(seq, h)
            return self.head(y), h

    torch.manual_seed(2)
    module = Elman().eval()
    bundle = export_bundle(SequenceStep(module, lambda b: torch.zeros(2, b, 16)), tmp_path / "rnn", kind="recurrent",
                           example_input=torch.zeros(1, 6), rate_hz=50, variants=(), tensorrt=False,
                           report=lambda _: None)
    xs = np.random.default_rng(4).standard_normal((40, 6)).astype(np.float32)
    model = Model(bundle, backend="numba")
    got = np.stack([model.step(x[None]).copy()[0] for x in xs])
    with torch.inference_mode():
        want, _ = module(torch.from_numpy(xs)[None], torch.zeros(2, 1, 16))
    np.testing.assert_allclose(got, want[0].numpy(), rtol=RTOL, atol=ATOL)
    assert len(model.backend._program) == 3  # one RNN step per layer and the head


def test_lstm_step_allocates_nothing(tmp_path, bytes_allocated):
    path, spec = _step_graph(tmp_path, 2)
    nb = NumbaBackend(path, spec)
    nb.inputs["x"][...] = 1.0
    nb.run()
    grown = bytes_allocated(nb.run, 500)
    assert grown < 1024, f"run() allocated {grown} bytes over 500 calls"
