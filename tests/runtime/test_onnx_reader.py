"""The dependency-free ONNX reader agrees with the onnx package on real exported graphs."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
torch = pytest.importorskip("torch")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from closedloop.runtime.onnx_reader import OnnxFormatError, parse_onnx, read_onnx  # noqa: E402


@pytest.fixture(scope="module")
def gru_onnx(tmp_path_factory):
    from closedloop.sdk.models import GRUDecoder

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = GRUDecoder(12, 16, 2, 5)

        def forward(self, x, h):
            return self.m.step(x, h)

    path = tmp_path_factory.mktemp("onnx") / "g.onnx"
    torch.onnx.export(
        Step().eval(), (torch.zeros(1, 12), torch.zeros(2, 1, 16)), str(path), dynamo=False, opset_version=17,
        input_names=["x", "h"], output_names=["y", "h_out"],
        dynamic_axes={"x": {0: "batch"}, "h": {1: "batch"}, "y": {0: "batch"}, "h_out": {1: "batch"}},
    )
    return path


def test_initializers_match_onnx_package(gru_onnx):
    ours = read_onnx(gru_onnx)
    ref = onnx.load(str(gru_onnx))
    assert len(ref.graph.initializer) > 0
    for t in ref.graph.initializer:
        np.testing.assert_array_equal(ours.initializers[t.name], numpy_helper.to_array(t))


def test_io_and_nodes_match_onnx_package(gru_onnx):
    ours = read_onnx(gru_onnx)
    ref = onnx.load(str(gru_onnx))
    assert [v.name for v in ours.inputs] == [v.name for v in ref.graph.input]
    assert ours.inputs[1].shape == [2, "batch", 16]
    assert ours.inputs[0].dtype == "float32"
    assert [n.op_type for n in ours.nodes] == [n.op_type for n in ref.graph.node]
    grus = [n for n in ours.nodes if n.op_type == "GRU"]
    assert len(grus) == 2 and all(n.attributes["linear_before_reset"] == 1 for n in grus)
    assert ours.opset["ai.onnx"] == 17


def test_float16_and_int_tensors_roundtrip():
    arrs = {
        "f16": np.array([[1.5, -2.0], [0.25, 65504]], dtype=np.float16),
        "i8": np.array([-128, 0, 127], dtype=np.int8),
        "i64": np.array([1, -(2**40)], dtype=np.int64),
    }
    inits = [numpy_helper.from_array(a, name=n) for n, a in arrs.items()]
    g = helper.make_graph([], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 3])], [], inits)
    m = parse_onnx(helper.make_model(g).SerializeToString())
    for n, a in arrs.items():
        np.testing.assert_array_equal(m.initializers[n], a)
    assert m.inputs[0].shape == [None, 3]


def test_garbage_raises_format_error(tmp_path):
    p = tmp_path / "bad.onnx"
    p.write_bytes(b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01")
    with pytest.raises(OnnxFormatError, match="bad.onnx"):
        read_onnx(p)
