"""The recurrent graph: PyTorch GRU semantics in the ONNX nodes, and a long streaming rollout."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from closedloop.export import GraphCheckError
from closedloop.export.onnx_export import check_gru_nodes
from closedloop.runtime.onnx_reader import parse_onnx, read_onnx


def test_one_gru_node_per_layer_with_linear_before_reset(gru_bundle):
    model = onnx.load(gru_bundle / "main.onnx")
    grus = [n for n in model.graph.node if n.op_type == "GRU"]
    assert len(grus) == 2  # 2 layers, not unrolled into MatMuls
    for n in grus:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        assert attrs["linear_before_reset"] == 1
        assert attrs["hidden_size"] == 16


def test_wrong_gru_semantics_fail_loudly(gru_bundle, gru_module):
    model = onnx.load(gru_bundle / "main.onnx")
    node = next(n for n in model.graph.node if n.op_type == "GRU")
    next(a for a in node.attribute if a.name == "linear_before_reset").i = 0
    with pytest.raises(GraphCheckError, match="linear_before_reset=0"):
        check_gru_nodes(parse_onnx(model.SerializeToString()), gru_module)


def test_unrolled_gru_is_refused(gru_module):
    # A graph without GRU nodes for a module with nn.GRU layers: what the dynamo exporter makes.
    assert check_gru_nodes(_graph_without_gru(), torch.nn.Linear(2, 2)) == {"gru_nodes": 0, "gru_linear_before_reset": []}
    with pytest.raises(GraphCheckError, match="2 nn.GRU layer"):
        check_gru_nodes(_graph_without_gru(), gru_module)


def _graph_without_gru():
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    g = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["y"])], "g", [x],
                               [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])])
    return parse_onnx(onnx.helper.make_model(g).SerializeToString())


def test_multi_step_rollout_matches_torch(gru_bundle, gru_module):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(gru_bundle / "main.onnx"), so, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(7)
    seq = np.cumsum(rng.standard_normal((200, 1, 12)) * 0.2, axis=0).astype(np.float32)
    (h_t,) = gru_module.init_state(1)
    h_o = h_t.numpy()
    worst = 0.0
    for x in seq:
        y_o, h_o = sess.run(None, {"x": x, "h": h_o})
        with torch.no_grad():
            y_t, h_t = gru_module.step(torch.from_numpy(x), h_t)
        worst = max(worst, float(np.abs(y_o - y_t.numpy()).max()), float(np.abs(h_o - h_t.numpy()).max()))
    assert worst < 1e-5
    # and the manifest says the same, over its own recorded checks
    parity = read_manifest_parity(gru_bundle)
    assert set(parity["checks"]) == {"random_batch_1", "random_batch_3", "sequence_step_by_step", "sequence_vs_torch_full_forward"}
    assert parity["checks"]["sequence_step_by_step"]["steps"] == 64 and parity["max_abs"] < 1e-5


def read_manifest_parity(path):
    import json

    return json.loads((path / "manifest.json").read_text())["graphs"]["main"]["parity"]


def test_graph_reader_sees_the_same_nodes(gru_bundle):
    model = read_onnx(gru_bundle / "main.onnx")
    assert [n.attributes["linear_before_reset"] for n in model.nodes if n.op_type == "GRU"] == [1, 1]
