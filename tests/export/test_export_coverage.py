"""Everyday torch layers export through ``export_bundle`` with parity, and a failure names the op and the module.

Each model is tiny and runs over a window: ``(B, T, F)`` for recurrent and attention layers, ``(B, C, T)`` for
convolutions. After export, ``Model(bundle, backend="onnxruntime")`` must give torch's output within the fp32
tolerance export_bundle states (``FP32_TOLERANCE``).
"""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from closedloop.export import FP32_TOLERANCE, ExportError, export_bundle
from closedloop.export.errors import GraphCheckError, UnsupportedOpError
from closedloop.export.prepare import explain_export_failure, export_settings
from closedloop.runtime import Model

T, FEATURES, CHANNELS = 12, 6, 4


class LSTMDecoder(nn.Module):
    """The recurrent protocol with two states: ``step(x, h, c)``; ``forward(seq, h, c)`` runs a whole sequence."""

    def __init__(self, n_in: int = FEATURES, hidden: int = 8, layers: int = 2, n_out: int = 3):
        super().__init__()
        self.lstm = nn.LSTM(n_in, hidden, layers, batch_first=True)
        self.head = nn.Linear(hidden, n_out)

    def init_state(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.lstm.num_layers, batch, self.lstm.hidden_size)
        return torch.zeros(shape), torch.zeros(shape)

    def step(self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor):
        y, (h, c) = self.lstm(x[:, None], (h, c))
        return self.head(y[:, 0]), h, c

    def forward(self, seq: torch.Tensor, h: torch.Tensor, c: torch.Tensor):
        y, (h, c) = self.lstm(seq, (h, c))
        return self.head(y), h, c


class RecurrentOverWindow(nn.Module):
    """An LSTM or GRU run over the whole window, the last step read out (no state crosses windows)."""

    def __init__(self, cell: type[nn.Module]):
        super().__init__()
        self.rnn = cell(FEATURES, 8, num_layers=2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.rnn(x)
        return self.head(y[:, -1])


class ConvOverWindow(nn.Module):
    """(B, C, T): Conv1d + BatchNorm (folded into the conv), every pooling kind, a linear head."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv1d(CHANNELS, 8, 3, padding=1), nn.BatchNorm1d(8), nn.ReLU(), nn.MaxPool1d(2),
            nn.Conv1d(8, 8, 3), nn.BatchNorm1d(8), nn.ReLU(), nn.AvgPool1d(2), nn.AdaptiveAvgPool1d(1),
        )
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


class Conv2dOverWindow(nn.Module):
    """(B, C, T) seen as a one-channel image: Conv2d + BatchNorm2d, MaxPool2d, AdaptiveAvgPool2d."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2), nn.AdaptiveAvgPool2d(1)
        )
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x[:, None]).flatten(1))


class NormsOverWindow(nn.Module):
    """LayerNorm over features, then a BatchNorm1d with no conv before it (one inference-mode node)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(FEATURES, 8)
        self.norm = nn.LayerNorm(8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(self.norm(self.embed(x)).mean(1)))


class AttentionOverWindow(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(FEATURES, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.embed(x)
        y, _ = self.attn(z, z, z)
        return self.head(y[:, -1])


class PreNormBlockOverWindow(nn.Module):
    """A pre-norm block as recent models write it: RMSNorm, F.scaled_dot_product_attention (causal), a SiLU MLP."""

    def __init__(self, eps: float | None = None):
        super().__init__()
        self.embed, self.heads = nn.Linear(FEATURES, 8), 2
        self.norm1, self.norm2 = nn.RMSNorm(8, eps=eps), nn.RMSNorm(8, eps=eps)
        self.qkv, self.proj, self.head = nn.Linear(8, 24), nn.Linear(8, 8), nn.Linear(8, 3)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.embed(x)
        b, t, d = z.shape
        q, k, v = (u.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for u in self.qkv(self.norm1(z)).chunk(3, -1))
        z = z + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        return self.head(z + self.mlp(self.norm2(z)))[:, -1]


class TransformerOverWindow(nn.Module):
    """One ``nn.TransformerEncoderLayer``, or an ``nn.TransformerEncoder`` of ``layers`` (nested tensors on, the default).

    ``causal``: GELU layers under a causal mask (each step attends to itself and the past only).
    """

    def __init__(self, layers: int = 0, norm_first: bool = False, causal: bool = False):
        super().__init__()
        self.embed = nn.Linear(FEATURES, 8)
        layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True, norm_first=norm_first,
                                           activation="gelu" if causal else "relu")
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=not norm_first) if layers else layer
        self.head = nn.Linear(8, 3)
        self.causal = causal
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(T) if causal else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.embed(x)
        z = self.encoder(z, mask=self.mask, is_causal=True) if self.causal else self.encoder(z)
        return self.head(z[:, -1])


WINDOW = (1, T, FEATURES)
CHANNEL_WINDOW = (1, CHANNELS, T)
#: name -> (build the module, example input shape, ONNX ops the graph must hold)
FEEDFORWARD: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], set[str]]] = {
    "lstm_over_window": (lambda: RecurrentOverWindow(nn.LSTM), WINDOW, {"LSTM"}),
    "gru_over_window": (lambda: RecurrentOverWindow(nn.GRU), WINDOW, {"GRU"}),
    "conv1d_bn_pools": (ConvOverWindow, CHANNEL_WINDOW, {"Conv", "MaxPool", "AveragePool", "GlobalAveragePool"}),
    "conv2d_bn_pools": (Conv2dOverWindow, CHANNEL_WINDOW, {"Conv", "MaxPool", "GlobalAveragePool"}),
    "layernorm_batchnorm": (NormsOverWindow, WINDOW, {"LayerNormalization", "BatchNormalization"}),
    "multihead_attention": (AttentionOverWindow, WINDOW, {"Softmax", "MatMul"}),
    "transformer_encoder_layer": (TransformerOverWindow, WINDOW, {"Softmax", "LayerNormalization"}),
    "transformer_encoder_2_layers": (lambda: TransformerOverWindow(layers=2), WINDOW, {"Softmax"}),
    "rmsnorm_sdpa_silu": (PreNormBlockOverWindow, WINDOW, {"ReduceMean", "Sqrt", "Softmax", "Sigmoid"}),
    "rmsnorm_eps": (lambda: PreNormBlockOverWindow(eps=1e-3), WINDOW, {"ReduceMean"}),
    "transformer_norm_first": (lambda: TransformerOverWindow(layers=1, norm_first=True), WINDOW, {"Softmax"}),
    "transformer_causal_gelu": (lambda: TransformerOverWindow(layers=2, causal=True), WINDOW, {"Softmax"}),
}


def _trained_looking(module: nn.Module) -> nn.Module:
    """Non-trivial BatchNorm statistics and affine terms (fresh ones are identity), then eval mode."""
    torch.manual_seed(1)
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.normal_(0.0, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            nn.init.normal_(m.weight, 1.0, 0.2)
            nn.init.normal_(m.bias, 0.0, 0.2)
    return module.eval()


def _export(module: nn.Module, path, kind: str, example: torch.Tensor):
    return export_bundle(module, path, kind=kind, example_input=example, rate_hz=50.0, variants=(),
                         tensorrt=False, report=lambda s: None)


def _graph_record(bundle) -> tuple[dict, set[str]]:
    import onnx

    manifest = json.loads((bundle / "manifest.json").read_text())
    ops = {n.op_type for n in onnx.load(str(bundle / "main.onnx")).graph.node}
    return manifest, ops


def _close(got: np.ndarray, want: np.ndarray) -> bool:
    err = float(np.max(np.abs(got - want)))
    return FP32_TOLERANCE.passes(err, err / (float(np.max(np.abs(want))) + 1e-12))


@pytest.mark.parametrize("name", sorted(FEEDFORWARD))
def test_window_model_exports_with_parity(name, tmp_path):
    build, shape, must_have = FEEDFORWARD[name]
    torch.manual_seed(0)
    module = _trained_looking(build())
    assert torch.backends.mha.get_fastpath_enabled()  # the user changed nothing: the exporter handles the fast path
    bundle = _export(module, tmp_path / name, "feedforward", torch.randn(shape))
    manifest, ops = _graph_record(bundle)
    graph = manifest["graphs"]["main"]
    assert graph["parity"]["within_tolerance"], graph["parity"]
    assert must_have <= ops, f"{name}: expected ONNX ops {must_have - ops} in {sorted(ops)}"
    assert torch.backends.mha.get_fastpath_enabled()  # and restored it

    model = Model(bundle, backend="onnxruntime")
    rng = np.random.default_rng(3)
    for _ in range(3):
        x = rng.standard_normal(shape).astype(np.float32)
        with torch.no_grad():
            want = module(torch.from_numpy(x)).numpy()
        got = model.step(x).copy()
        assert got.shape == want.shape
        assert _close(got, want), f"{name}: max abs error {np.max(np.abs(got - want)):.2e}"


@pytest.mark.parametrize("how", ["script", "trace", "load"])
def test_a_torchscript_module_exports_and_runs_like_torch(how, tmp_path):
    """A model shared as TorchScript (``torch.jit.script`` / ``trace``, or a ``.pt`` file read back with
    ``torch.jit.load``) exports as it is, with parity, and the bundle gives its outputs."""
    torch.manual_seed(0)
    python = _trained_looking(ConvOverWindow())
    example = torch.randn(CHANNEL_WINDOW)
    module = torch.jit.script(python) if how == "script" else torch.jit.trace(python, example)
    if how == "load":
        torch.jit.save(module, str(tmp_path / "model.pt"))
        module = torch.jit.load(str(tmp_path / "model.pt"))
    bundle = _export(module, tmp_path / how, "feedforward", example)
    graph = _graph_record(bundle)[0]["graphs"]["main"]
    assert graph["parity"]["within_tolerance"] and "Conv" in _graph_record(bundle)[1]
    model = Model(bundle, backend="onnxruntime")
    x = np.random.default_rng(3).standard_normal(CHANNEL_WINDOW).astype(np.float32)
    with torch.no_grad():
        want = python(torch.from_numpy(x)).numpy()
    assert _close(model.step(x).copy(), want)
    # its step() is out of the tracer's reach: said, not a torch traceback
    with pytest.raises(ExportError, match="TorchScript module .* Export the Python module"):
        _export(module, tmp_path / "rec", "recurrent", example)
    if how == "script":  # a scripted dict has no ONNX form: the advice says what to return instead
        with pytest.raises(ExportError, match="returns a dict has no ONNX form: return a tuple"):
            _export(torch.jit.script(TwoHeads().eval()), tmp_path / "dict", "feedforward", torch.zeros(1, FEATURES))


def test_a_torch_export_program_is_refused_with_what_to_export_instead(tmp_path):
    module = nn.Sequential(nn.Linear(FEATURES, 4), nn.Tanh()).eval()
    program = torch.export.export(module, (torch.zeros(2, FEATURES),), dynamic_shapes=({0: torch.export.Dim.AUTO},))
    with pytest.raises(ExportError, match=r"torch.export program's module .* Export the nn.Module"):
        _export(program.module(), tmp_path / "ep", "feedforward", torch.zeros(1, FEATURES))
    assert not (tmp_path / "ep").exists()


def test_a_float64_or_half_model_is_refused_with_the_conversion_and_a_numpy_example_is_taken_as_float32(tmp_path):
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, 2)).eval()
    for dtype in (torch.float64, torch.float16, torch.bfloat16):
        with pytest.raises(ExportError, match=rf"parameter '0.weight' \({dtype}\).* not float32; a bundle computes "
                                              r"in float32.*module.float\(\)"):
            _export(module.to(dtype), tmp_path / "wide", "feedforward", torch.zeros(1, FEATURES, dtype=dtype))
    module.float()
    with pytest.raises(ExportError, match=r"example input 'x' \(torch.float64\) is not float32"):
        _export(module, tmp_path / "x64", "feedforward", torch.zeros(1, FEATURES, dtype=torch.float64))
    bundle = _export(module, tmp_path / "np", "feedforward", np.zeros((1, FEATURES)))  # numpy's default float64
    assert _graph_record(bundle)[0]["graphs"]["main"]["inputs"][0]["dtype"] == "float32"


class DayDecoder(nn.Module):
    """A multi-day decoder: a per-day input offset looked up by an integer day index, then a GRU."""

    def __init__(self):
        super().__init__()
        self.day = nn.Embedding(4, FEATURES)
        self.gru = nn.GRU(FEATURES, 8, batch_first=True)
        self.head = nn.Linear(8, 2)

    def init_state(self, batch):
        return torch.zeros(1, batch, 8)

    def step(self, x, day, h):
        y, h = self.gru((x + self.day(day)).unsqueeze(1), h)
        return self.head(y[:, 0]), h


class OnDay(nn.Module):
    """The advice of the refusal below: the day fixed at export, one bundle per day."""

    def __init__(self, inner, day):
        super().__init__()
        self.inner, self.day_index = inner, day

    def init_state(self, batch):
        return self.inner.init_state(batch)

    def step(self, x, h):
        return self.inner.step(x, torch.full((x.shape[0],), self.day_index, dtype=torch.long), h)


def test_an_integer_or_featureless_input_is_refused_with_what_to_do_and_the_advice_exports(tmp_path):
    torch.manual_seed(0)
    model = DayDecoder().eval()
    with pytest.raises(ExportError, match=r"'x1' is torch.int64 \(1,\): a data input streams float values.*"
                                          r"session or day index.*fixed at export.*round\(\).long\(\)"):
        export_bundle(model, tmp_path / "int", kind="recurrent", rate_hz=50.0, report=lambda _: None,
                      example_input=(torch.zeros(1, FEATURES), torch.zeros(1, dtype=torch.long)))
    with pytest.raises(ExportError, match=r"'x' is torch.float32 \(1,\).*give it a feature axis.*unsqueeze"):
        _export(nn.Linear(1, 2).eval(), tmp_path / "flat", "feedforward", torch.zeros(1))
    assert not (tmp_path / "int").exists() and not (tmp_path / "flat").exists()
    bundle = _export(OnDay(model, 2).eval(), tmp_path / "day2", "recurrent", torch.zeros(1, FEATURES))
    for backend in ("onnxruntime", "numba"):
        m, h = Model(bundle, backend=backend), model.init_state(1)
        for x in torch.randn(20, 1, FEATURES):  # bin by bin against the torch model on day 2
            with torch.no_grad():
                ref, h = model.step(x, torch.tensor([2]), h)
            assert _close(m.step(x.numpy()).copy(), ref.numpy()), backend


class Classifier(nn.Module):
    """Probabilities and the chosen class; ``as_float`` returns the class index as a float."""

    def __init__(self, as_float: bool):
        super().__init__()
        self.layer, self.as_float = nn.Linear(FEATURES, 4), as_float

    def forward(self, x):
        y = self.layer(x)
        label = y.argmax(-1)
        return y.softmax(-1), (label.float() if self.as_float else label)


def test_an_integer_output_is_refused_with_what_to_do_and_a_float_label_exports(tmp_path):
    torch.manual_seed(0)
    with pytest.raises(GraphCheckError, match=r"output 'y1' has dtype 'int64'.*Return it as a float \(label.float\(\).*or return the scores"):
        _export(Classifier(as_float=False).eval(), tmp_path / "int", "feedforward", torch.zeros(1, FEATURES))
    assert not (tmp_path / "int").exists()
    module = Classifier(as_float=True).eval()
    bundle = _export(module, tmp_path / "float", "feedforward", torch.zeros(1, FEATURES))
    x = torch.randn(1, FEATURES)
    for backend in ("onnxruntime", "numba"):  # Numba keeps the ArgMax's index as a float32 value
        model = Model(bundle, backend=backend)
        model.step(x.numpy())
        assert model.outputs["y1"][0] == float(module(x)[1][0]), backend


class TwoHeads(nn.Module):
    """A cursor decoder's two heads, returned as a dict: velocity and click logits."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(FEATURES, 8)
        self.velocity, self.click = nn.Linear(8, 2), nn.Linear(8, 1)

    def forward(self, x):
        h = torch.tanh(self.body(x))
        return {"velocity": self.velocity(h), "click": self.click(h)}


def test_a_dict_of_outputs_names_the_graphs_outputs_by_its_keys(tmp_path):
    torch.manual_seed(0)
    module = TwoHeads().eval()
    bundle = _export(module, tmp_path / "heads", "feedforward", torch.zeros(1, FEATURES))
    graph = _graph_record(bundle)[0]["graphs"]["main"]
    assert [t["name"] for t in graph["outputs"]] == ["velocity", "click"] and graph["parity"]["within_tolerance"]
    model = Model(bundle, backend="onnxruntime")
    x = np.random.default_rng(2).standard_normal((1, FEATURES)).astype(np.float32)
    model.step(x)
    with torch.no_grad():
        want = module(torch.from_numpy(x))
    for name in ("velocity", "click"):
        assert _close(model.outputs[name].copy(), want[name].numpy())
    named = export_bundle(module, tmp_path / "named", kind="feedforward", example_input=torch.zeros(1, FEATURES),
                          rate_hz=50.0, variants=(), tensorrt=False, report=lambda s: None, output_name=["v", "c"])
    assert [t["name"] for t in _graph_record(named)[0]["graphs"]["main"]["outputs"]] == ["v", "c"]


class BatchOfOne(nn.Module):
    """Streaming code written for one window at a time: flattens with a hard-coded batch of 1."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(T * FEATURES, 2)

    def forward(self, x):
        return self.head(x.reshape(1, -1))


class SmoothsInside(nn.Module):
    """Keeps a running mean in a buffer that forward updates: state the traced graph would freeze."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(FEATURES, 2)
        self.register_buffer("mean", torch.zeros(FEATURES))
        self.register_buffer("cache", torch.zeros(0))  # filled on the first call only, as rotary tables are

    def forward(self, x):
        if self.cache.numel() == 0:
            self.cache = torch.ones(FEATURES)
        self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        return self.head(x * self.cache - self.mean)


def test_a_batch_of_one_or_state_in_buffers_is_explained_and_the_module_left_as_it_was(tmp_path):
    with pytest.raises(ExportError, match=r"BatchOfOne.forward runs at batch 1 but fails at batch 2 .*"
                                          r"x.reshape\(x.shape\[0\], -1\)"):
        _export(BatchOfOne().eval(), tmp_path / "b1", "feedforward", torch.zeros(WINDOW))
    module = SmoothsInside().eval()
    with pytest.raises(ExportError, match=r"changes its buffer\(s\) \['mean'\] .* kind='recurrent'"):
        _export(module, tmp_path / "ema", "feedforward", torch.zeros(1, FEATURES))  # zeros leave the mean at 0
    assert torch.equal(module.mean, torch.zeros(FEATURES)) and module.cache.numel() == 0  # as before the export


class ChannelsByTime(nn.Module):
    """Written for unbatched (channels, time) input, as torch's Conv1d allows."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(6, 4, 3)

    def forward(self, x):
        return self.conv(x).mean(-1)


def test_a_module_for_unbatched_input_is_told_that_axis_0_is_the_batch(tmp_path):
    # it runs on its example (6, 20); the exporter read axis 0 as the batch and ran it on (2, 20)
    with pytest.raises(ExportError, match=r"ChannelsByTime.forward runs on the example input\(s\) as given \(\(6, 20\)\)"
                                          r".* axis 0 of every example is the batch.* \(1, 6, 20\)"):
        _export(ChannelsByTime().eval(), tmp_path / "ct", "feedforward", torch.zeros(6, 20))


@pytest.mark.parametrize("opset", [17, 18])
def test_rmsnorm_is_written_with_onnx_ops_that_every_backend_runs(opset, tmp_path):
    from closedloop.export import ExportOptions

    torch.manual_seed(0)
    module = PreNormBlockOverWindow().eval()
    bundle = export_bundle(module, tmp_path / "block", kind="feedforward", example_input=torch.zeros(WINDOW),
                           rate_hz=50.0, variants=(), tensorrt=False, report=lambda s: None,
                           options=ExportOptions(opset=opset))
    assert _graph_record(bundle)[0]["graphs"]["main"]["parity"]["within_tolerance"]
    x = np.random.default_rng(4).standard_normal(WINDOW).astype(np.float32)
    with torch.no_grad():
        want = module(torch.from_numpy(x)).numpy()
    for backend in ("onnxruntime", "numba"):
        assert _close(Model(bundle, backend=backend).step(x).copy(), want), backend
    from torch.onnx._internal.torchscript_exporter.registration import registry

    assert not registry.is_registered_op("aten::rms_norm", opset)  # registered for the export only


def test_batchnorm_after_conv_is_folded_and_alone_is_inference_mode(tmp_path):
    conv = _export(_trained_looking(ConvOverWindow()), tmp_path / "conv", "feedforward", torch.randn(CHANNEL_WINDOW))
    checks = json.loads((conv / "manifest.json").read_text())["provenance"]["export"]["settings"]["graph_checks"]
    assert (checks["batchnorm_layers"], checks["batchnorm_nodes"], checks["batchnorm_folded"]) == (2, 0, 2)
    assert "BatchNormalization" not in _graph_record(conv)[1]

    norms = _export(_trained_looking(NormsOverWindow()), tmp_path / "norms", "feedforward", torch.randn(WINDOW))
    checks = json.loads((norms / "manifest.json").read_text())["provenance"]["export"]["settings"]["graph_checks"]
    assert (checks["batchnorm_layers"], checks["batchnorm_nodes"], checks["batchnorm_folded"]) == (1, 1, 0)


def test_batchnorm_node_in_training_mode_is_refused():
    import onnx

    from closedloop.export import GraphCheckError
    from closedloop.export.onnx_export import check_batchnorm_nodes
    from closedloop.runtime.onnx_reader import parse_onnx

    names = ["x", "scale", "bias", "mean", "var"]
    node = onnx.helper.make_node("BatchNormalization", names, ["y"], name="bn", training_mode=1)
    io = [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [2]) for n in [*names, "y"]]
    graph = onnx.helper.make_graph([node], "g", io[:-1], io[-1:])
    with pytest.raises(GraphCheckError, match="'bn' has training_mode=1"):
        check_batchnorm_nodes(parse_onnx(onnx.helper.make_model(graph).SerializeToString()), nn.BatchNorm1d(2))


def test_lstm_step_with_two_states_streams_like_torch(tmp_path):
    torch.manual_seed(0)
    module = LSTMDecoder().eval()
    bundle = _export(module, tmp_path / "lstm", "recurrent", torch.zeros(1, FEATURES))
    manifest, ops = _graph_record(bundle)
    graph = manifest["graphs"]["main"]
    assert [t["name"] for t in graph["inputs"]] == ["x", "h0", "h1"]
    assert [t["name"] for t in graph["outputs"]] == ["y", "h0_out", "h1_out"]
    assert "sequence_vs_torch_full_forward" in graph["parity"]["checks"]  # forward(seq, h, c) was compared too
    assert "LSTM" in ops

    seq = np.random.default_rng(5).standard_normal((40, FEATURES)).astype(np.float32)
    model = Model(bundle, backend="onnxruntime")
    got = np.stack([model.step(row[None]).copy()[0] for row in seq])
    with torch.no_grad():
        want, _, _ = module(torch.from_numpy(seq)[None], *module.init_state(1))
    assert _close(got, want[0].numpy()), f"max abs error {np.max(np.abs(got - want[0].numpy())):.2e}"


class SequenceModel(nn.Module):
    """A recurrent model as users write it: ``forward(seq, state) -> (out, new_state)``, batch first."""

    def __init__(self, cell: type[nn.Module], batch_first: bool = True):
        super().__init__()
        self.rnn = cell(FEATURES, 8, 2, batch_first=batch_first)
        self.head = nn.Linear(8, 3)

    def forward(self, seq, state):
        y, state = self.rnn(seq, state)
        return self.head(y).log_softmax(-1), state


@pytest.mark.parametrize(("cell", "batch_first"), [(nn.GRU, True), (nn.LSTM, True), (nn.GRU, False)])
def test_a_sequence_model_streams_through_the_step_adapter_like_one_call_over_the_sequence(cell, batch_first, tmp_path):
    from closedloop.export import SequenceStep

    torch.manual_seed(0)
    module = SequenceModel(cell, batch_first).eval()
    zeros = (lambda b: torch.zeros(2, b, 8)) if cell is nn.GRU else (lambda b: (torch.zeros(2, b, 8),) * 2)
    bundle = _export(SequenceStep(module, zeros, batch_first=batch_first), tmp_path / f"{cell.__name__}{batch_first}",
                     "recurrent", torch.zeros(1, FEATURES))
    graph = _graph_record(bundle)[0]["graphs"]["main"]
    assert [t["name"] for t in graph["inputs"]] == (["x", "h"] if cell is nn.GRU else ["x", "h", "c"])  # LSTM: (h, c)
    assert graph["parity"]["checks"]["sequence_vs_torch_full_forward"]["within_tolerance"]
    seq = np.random.default_rng(5).standard_normal((30, FEATURES)).astype(np.float32)
    model = Model(bundle, backend="onnxruntime")
    got = np.stack([model.step(row[None]).copy()[0] for row in seq])
    with torch.no_grad():
        want, _ = module(torch.from_numpy(seq)[None] if batch_first else torch.from_numpy(seq)[:, None], zeros(1))
    want = want[0] if batch_first else want[:, 0]
    assert _close(got, want.numpy()), f"max abs error {np.max(np.abs(got - want.numpy())):.2e}"
    # without the adapter the error names it
    with pytest.raises(ExportError, match=r"has no step or init_state\(\).*closedloop.export.SequenceStep"):
        _export(module, tmp_path / "bare", "recurrent", torch.zeros(1, FEATURES))
    if not batch_first:  # the adapter told the wrong layout: the failure says which layers and what to pass
        with pytest.raises(ExportError, match=r"fails at batch 2 .*'rnn' is time first \(batch_first=False\).*"
                                              r"SequenceStep\(\.\.\., batch_first=False\)"):
            _export(SequenceStep(module, zeros), tmp_path / "layout", "recurrent", torch.zeros(1, FEATURES))


def test_export_puts_each_layers_mode_back_and_says_when_it_changed_a_layer_in_training_mode(tmp_path):
    """A new SequenceStep (train mode, as every new nn.Module) around a model in eval mode must leave the model in
    eval mode (putting the wrapper back in train mode once turned the model's dropout on); a model left in train
    mode is exported in eval mode with a note saying which layers that changed, and keeps its own modes."""
    from closedloop.export import SequenceStep

    torch.manual_seed(0)
    module = SequenceModel(nn.GRU).eval()
    module.rnn.dropout = 0.5  # between the two layers: a different function in train mode
    step = SequenceStep(module, lambda b: torch.zeros(2, b, 8))
    assert step.training and not module.training
    bundle = _export(step, tmp_path / "wrapped", "recurrent", torch.zeros(1, FEATURES))
    assert step.training and not any(m.training for m in module.modules())
    assert _graph_record(bundle)[0]["provenance"]["export"]["settings"]["export_warnings"] == []

    ff = nn.Sequential(nn.Linear(FEATURES, 8), nn.Dropout(0.3), nn.BatchNorm1d(8), nn.Linear(8, 2))  # train mode
    lines: list[str] = []
    bundle = export_bundle(ff, tmp_path / "training", kind="feedforward", example_input=torch.zeros(1, FEATURES),
                           rate_hz=50.0, variants=(), tensorrt=False, report=lines.append)
    assert all(m.training for m in ff.modules())
    warned = _graph_record(bundle)[0]["provenance"]["export"]["settings"]["export_warnings"]
    assert len(warned) == 1 and "1 (Dropout), 2 (BatchNorm1d)" in warned[0] and "exported in eval mode" in warned[0]
    assert any(line.startswith("note: exported in eval mode") for line in lines)
    x = torch.randn(1, FEATURES)
    with torch.no_grad():
        want = ff.eval()(x).numpy()
    assert _close(Model(bundle, backend="onnxruntime").step(x.numpy()).copy(), want)


def test_a_sequence_model_exports_with_the_default_variants(tmp_path):
    """What a user who calls export_bundle without variants= gets: the fp16 and int8 variants too. The fp16
    conversion of SequenceStep's Transposes around the GRU crashes ONNX Runtime 1.32's session creation
    (MatmulTransposeFusion); the variant is rebuilt with the Transposes kept in float32 and says so."""
    from closedloop.export import SequenceStep

    torch.manual_seed(0)
    module = SequenceModel(nn.GRU).eval()
    bundle = export_bundle(SequenceStep(module, lambda b: torch.zeros(2, b, 8)), tmp_path / "gru", kind="recurrent",
                           example_input=torch.zeros(1, FEATURES), rate_hz=50.0, tensorrt=False, report=lambda s: None)
    variants = _graph_record(bundle)[0]["graphs"]["main"]["variants"]
    assert set(variants) == {"fp16", "int8"} and all(v["within_tolerance"] for v in variants.values())
    assert "Transpose" in variants["fp16"]["float32_ops"]
    for variant in ("fp16", "int8"):
        Model(bundle, backend="onnxruntime", variant=variant).step(np.ones((1, FEATURES), np.float32))


class ProjectedLSTM(nn.Module):
    """An LSTM with projections (LSTMP: proj_size), which ONNX's LSTM operator lacks."""

    def __init__(self, layers: int = 2):
        super().__init__()
        self.rnn = nn.LSTM(FEATURES, 16, layers, batch_first=True, proj_size=4)
        self.head = nn.Linear(4, 3)

    def forward(self, seq, state):
        y, state = self.rnn(seq, state)
        return self.head(y), state


@pytest.mark.parametrize("backend", ["onnxruntime", "numba"])
def test_an_lstm_with_projections_streams_as_torch_computes_it(backend, tmp_path):
    from closedloop.export import SequenceStep

    torch.manual_seed(0)
    module = ProjectedLSTM().eval()
    start = lambda b: (torch.zeros(2, b, 4), torch.zeros(2, b, 16))  # noqa: E731  (h: proj_size, c: hidden_size)
    bundle = _export(SequenceStep(module, start), tmp_path / "lstmp", "recurrent", torch.zeros(1, FEATURES))
    graph = _graph_record(bundle)[0]["graphs"]["main"]
    assert graph["parity"]["checks"]["sequence_vs_torch_full_forward"]["within_tolerance"]  # vs torch's own LSTM
    seq = np.random.default_rng(5).standard_normal((30, FEATURES)).astype(np.float32)
    model = Model(bundle, backend=backend)
    got = np.stack([model.step(row[None]).copy()[0] for row in seq])
    with torch.no_grad():
        want, _ = module(torch.from_numpy(seq)[None], start(1))
    assert _close(got, want[0].numpy()), f"max abs error {np.max(np.abs(got - want[0].numpy())):.2e}"
    assert module.rnn.forward.__func__ is nn.LSTM.forward  # the user's module keeps torch's own forward


def test_a_bidirectional_model_is_refused_by_the_step_adapter_saying_why():
    from closedloop.export import SequenceStep

    module = nn.GRU(FEATURES, 8, batch_first=True, bidirectional=True)
    with pytest.raises(ExportError, match="model is bidirectional: its reverse direction reads the sequence from its end"):
        SequenceStep(module, lambda b: torch.zeros(2, b, 8))


class ConvThenGRU(nn.Module):
    """A convolution over each window of frames, then a GRU whose state crosses windows; ``step`` only (no
    ``forward``), as a streaming-only model is often written."""

    def __init__(self):
        super().__init__()
        self.conv, self.gru, self.head = nn.Conv1d(CHANNELS, 8, 4, stride=4), nn.GRU(8, 8, batch_first=True), nn.Linear(8, 3)

    def init_state(self, batch):
        return (torch.zeros(1, batch, 8),)

    def step(self, x, h):  # x (B, CHANNELS, 4): the last 4 frames
        y, h = self.gru(torch.relu(self.conv(x)).transpose(1, 2), h)
        return self.head(y[:, -1]), h


def test_a_recurrent_model_over_windows_carries_its_state_from_window_to_window(tmp_path):
    torch.manual_seed(0)
    module = ConvThenGRU().eval()
    bundle = export_bundle(module, tmp_path / "convgru", kind="recurrent", example_input=torch.zeros(1, CHANNELS, 4),
                           rate_hz=50.0, variants=(), tensorrt=False, report=lambda s: None,
                           windows={"x": {"length": 4, "hop": 4, "layout": "channel_major"}})
    frames = np.random.default_rng(0).standard_normal((40, CHANNELS)).astype(np.float32)
    h, want = torch.zeros(1, 1, 8), []
    with torch.no_grad():
        for k in range(0, 40, 4):
            y, h = module.step(torch.from_numpy(frames[k:k + 4].T[None].copy()), h)
            want.append(y.numpy()[0])
    for backend in ("onnxruntime", "numba"):
        model = Model(bundle, backend=backend)
        got = [out.copy()[0] for f in frames if (out := model.feed(f[None])) is not None]
        assert len(got) == 10 and _close(np.stack(got), np.stack(want)), backend


def test_fast_path_is_off_inside_and_restored_after_even_on_error():
    for before in (True, False):
        torch.backends.mha.set_fastpath_enabled(before)
        try:
            with pytest.raises(RuntimeError, match="inside"), export_settings():
                assert not torch.backends.mha.get_fastpath_enabled()
                raise RuntimeError("inside")
            assert torch.backends.mha.get_fastpath_enabled() is before
        finally:
            torch.backends.mha.set_fastpath_enabled(True)


# --- failures: one short line naming the op, the module path and what to do ---------------------------------


class Whitener(nn.Module):
    """A learned whitening matrix inverted on every call: aten::linalg_inv has no ONNX export."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.eye(8) + 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ torch.linalg.inv(self.a)


class RunningMax(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cummax(x, dim=1).values


class OddPool(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.adaptive_avg_pool1d(x.transpose(1, 2), 5).transpose(1, 2)  # 5 does not divide T=12


class Layered(nn.Module):
    """``inner`` nested two containers deep: at ``model.encoder.layers.1``."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.embed = nn.Linear(FEATURES, 8)
        self.encoder = nn.ModuleDict({"layers": nn.Sequential(nn.ReLU(), inner)})
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder["layers"](self.embed(x)).mean(1))


@pytest.mark.parametrize("inner, op, hint", [
    (Whitener, "aten::linalg_inv", "store the result as a buffer"),
    (RunningMax, "aten::cummax", "register_custom_op_symbolic('aten::cummax', fn, 17)"),
    (OddPool, "aten::adaptive_avg_pool1d", "divides the input length"),
])
def test_unsupported_op_names_op_and_module_path(inner, op, hint, tmp_path, capfd):
    out = tmp_path / "bundle"
    with pytest.raises(UnsupportedOpError) as info:
        _export(Layered(inner()), out, "feedforward", torch.randn(WINDOW))
    err = info.value
    message = str(err)
    assert message.startswith(f"cannot export model.encoder.layers.1 ({inner.__name__}): op {op} "
                              "is not supported by ONNX opset 17"), message
    assert hint in message
    assert "test_export_coverage.py:" in message  # the line of the user's code that calls the op
    assert len(message) < 600 and "\n" not in message and "graph(" not in message and "%" not in message
    assert (err.op, err.module_path, err.module_type, err.opset) == (op, "model.encoder.layers.1", inner.__name__, 17)
    assert isinstance(err, ExportError) and isinstance(err, ValueError)
    assert isinstance(err.__cause__, RuntimeError)  # torch's own error, in full, for whoever wants it
    assert not out.exists()
    printed = capfd.readouterr()
    assert "Torch IR graph" not in printed.out + printed.err and "graph(" not in printed.out + printed.err


def test_op_of_a_later_opset_says_which(tmp_path):
    class Fold(nn.Module):
        def forward(self, x):
            return F.fold(x, (3, 3), (2, 2)).flatten(1)

    with pytest.raises(UnsupportedOpError, match=r"model\.1 \(Fold\): op aten::col2im .* supported from opset 18: "
                                                 r"export with options=ExportOptions\(opset=18\)"):
        _export(nn.Sequential(nn.Linear(4, 4), Fold()).eval(), tmp_path / "b", "feedforward", torch.randn(1, 4, 4))


def test_an_unrecognised_torch_error_is_still_one_short_line():
    ir = "graph(%0 : Float(*, 12, 6)):\n" + "  %1 : Float = aten::whatever(%0)\n" * 200
    exc = RuntimeError("Something torch did not expect " + "x" * 500 + "\n" + ir)
    err = explain_export_failure(exc, nn.Linear(2, 2), (torch.zeros(1, 2),), 17)
    message = str(err)
    assert message.startswith("cannot export model (Linear) to ONNX opset 17: torch.onnx.export failed: Something")
    assert len(message) < 600 and "\n" not in message and "graph(" not in message
    assert err.op is None and err.module_path == "model"


class CausalPaddedConv(nn.Module):
    """A causal TCN block written with F.pad: the left zeros, a dilated depthwise conv, a pointwise conv, flattened.
    torch's exporter computes F.pad's pads in the graph, and ONNX's shape inference then loses the output's size."""

    def __init__(self) -> None:
        super().__init__()
        self.depthwise = nn.Conv1d(CHANNELS, CHANNELS, 3, dilation=2, groups=CHANNELS)
        self.pointwise = nn.Conv1d(CHANNELS, 4, 1)

    def forward(self, x):
        return self.pointwise(torch.relu(self.depthwise(nn.functional.pad(x, (4, 0))))).flatten(1)


class StatisticsOfAWindow(nn.Module):
    """Per-channel summary statistics concatenated: the Concat's size is unknown to ONNX's shape inference."""

    def forward(self, x):
        return torch.cat([nn.functional.normalize(x, dim=-1).flatten(1), x.var(-1), x.std(-1), x.amax(-1)], dim=1)


@pytest.mark.parametrize("build", [CausalPaddedConv, StatisticsOfAWindow])
def test_a_fixed_size_the_graph_does_not_state_is_taken_from_torch_and_written_into_the_graph(build, tmp_path):
    import onnx

    torch.manual_seed(0)
    module = build().eval()
    example = torch.randn(CHANNEL_WINDOW)
    bundle = _export(module, tmp_path / "b", "feedforward", example)
    with torch.no_grad():
        width = module(example).shape[1]
    manifest, _ = _graph_record(bundle)
    assert manifest["graphs"]["main"]["outputs"][0]["shape"] == ["batch", width]
    declared = onnx.load(str(bundle / "main.onnx")).graph.output[0].type.tensor_type.shape.dim
    assert declared[0].dim_param == "batch" and declared[1].dim_value == width  # the graph says so too
    x = np.random.default_rng(1).standard_normal(CHANNEL_WINDOW).astype(np.float32)
    with torch.no_grad():
        want = module(torch.from_numpy(x)).numpy()
    for backend in ("onnxruntime", "numba"):
        assert _close(Model(bundle, backend=backend).step(x).copy(), want), backend


def test_a_size_that_depends_on_the_input_values_is_refused(tmp_path):
    class KeepsThePositive(nn.Module):
        def forward(self, x):
            return x[:, x[0] > 0]  # as many columns as the first row has positive values: NonZero

    with pytest.raises(GraphCheckError, match="NonZero.*depends on the input values"):
        _export(KeepsThePositive().eval(), tmp_path / "b", "feedforward", torch.tensor([[1.0, -1.0, 2.0, -3.0]]))


class LogSigmoidHead(nn.Module):
    """A click detector's log-probability, log sigmoid(w x + b): large negative logits are its normal range."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(1, 2)
        with torch.no_grad():
            self.lin.weight.copy_(torch.tensor([[1.0], [-1.0]]))
            self.lin.bias.zero_()

    def forward(self, x):
        return torch.nn.functional.logsigmoid(self.lin(x))


@pytest.mark.parametrize("backend", ["onnxruntime", "numba"])
def test_logsigmoid_is_exact_in_its_tail_on_every_backend(tmp_path, backend):
    """torch exports F.logsigmoid as Log(Sigmoid(x)); both backends' logistic is accurate to ~2e-7 absolute, so its
    log was -16.6 at x = -16 (ONNX Runtime), -17.3 for any x below -18 (Numba) and -inf below about -17 (ONNX
    Runtime). The exporter writes it as -Softplus(-x): relative error 1e-6 from -40 to 40."""
    from closedloop.runtime import Model

    bundle = _export(LogSigmoidHead().eval(), tmp_path / "ls", "feedforward", torch.zeros(1, 1))
    manifest, ops = _graph_record(bundle)
    assert "Softplus" in ops and "Log" not in ops and "Sigmoid" not in ops
    m = Model(bundle, backend=backend)
    xs = np.linspace(-40, 40, 81, dtype=np.float32)
    ref = torch.nn.functional.logsigmoid(torch.from_numpy(np.stack([xs, -xs], 1))).numpy()
    got = np.stack([m.step(np.array([[x]], np.float32)).reshape(-1).copy() for x in xs])
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-30)


class RejectsArtefacts(nn.Module):
    """Artefact rejection written as a Python if on the input's values: tracing freezes the branch."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(FEATURES, 2)

    def forward(self, x):
        if x.abs().max() > 6:
            return torch.zeros(x.shape[0], 2)
        return self.lin(x)


def test_a_python_branch_on_a_tensor_value_is_a_loud_export_warning_that_inspect_shows(tmp_path, capsys):
    """The traced graph always takes the example's branch; parity's standard-normal inputs never cross 6, so it
    passes. The export says so plainly (not "parity checks below test the result"), the manifest keeps it first,
    and `closedloop inspect` prints it."""
    from closedloop.export.onnx_export import BRANCH_FROZEN
    from closedloop.sdk.cli import main

    lines: list[str] = []
    bundle = export_bundle(RejectsArtefacts().eval(), tmp_path / "branch", kind="feedforward",
                           example_input=torch.zeros(1, FEATURES), rate_hz=50.0, variants=(), tensorrt=False,
                           report=lines.append)
    assert any(line.startswith("WARNING: " + BRANCH_FROZEN) for line in lines)
    warned = _graph_record(bundle)[0]["provenance"]["export"]["settings"]["export_warnings"]
    assert warned[0].startswith(BRANCH_FROZEN) and "torch.where" in warned[0]
    # what the warning is about: a saturated frame still goes through the linear layer in the bundle
    saturated = np.full((1, FEATURES), 10.0, np.float32)
    assert np.abs(Model(bundle, backend="onnxruntime").step(saturated)).max() > 0
    assert main(["inspect", str(bundle)]) == 0
    assert "export warning: " + BRANCH_FROZEN[:40] in capsys.readouterr().out
