"""The weight-storage variants (fp16w, int8w) at export, and the checks every variant passes before it is written."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from closedloop.export import ExportError, export_bundle
from closedloop.export import variants as variants_module
from closedloop.export.weight_storage import store_weights
from closedloop.runtime.bundle import load_bundle


@pytest.fixture
def gru_stored(tmp_path, gru_module, quiet):
    return export_bundle(gru_module, tmp_path / "g", kind="recurrent", example_input=torch.zeros(1, 12), rate_hz=50.0,
                         variants=("fp16w", "int8w"), report=quiet)


def test_the_records_say_how_the_weights_are_stored(gru_stored):
    g = load_bundle(gru_stored).graph()
    for name, storage in (("fp16w", "float16"), ("int8w", "int8, one float32 scale per output row")):
        v = g.variants[name]
        assert v["file"] == f"main.{name}.onnx" and v["weight_storage"] == storage
        assert v["compute_dtype"] == "float32" and v["io_dtype"] == "float32" and v["auto_choice"] is True
        assert v["stored_weights"] == {"GRU": 4, "Gemm": 1}  # W and R of both layers, and the read-out
        ratio = v["weight_bytes_stored"]["variant"] / v["weight_bytes_stored"]["fp32"]
        # int8: a quarter, plus a float32 scale per output row (a row of the tiny GRU has 12 or 16 weights)
        assert ratio == 0.5 if name == "fp16w" else 0.25 < ratio < 0.35
        assert v["within_tolerance"] is True and v["parity_vs_fp32"]["max_abs"] <= v["tolerance"]["abs"]


def test_int8_codes_are_per_output_row(gru_stored):
    model = onnx.load(gru_stored / "main.int8w.onnx")
    init = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    assert len(dq) == 5
    for n in dq:
        codes, scale = init[n.input[0]], init[n.input[1]]
        axis = next(a.i for a in n.attribute if a.name == "axis")
        assert codes.dtype == np.int8 and scale.shape == (codes.shape[axis],)
        # symmetric, and each output row uses its whole range
        assert np.all(np.abs(codes).max(axis=tuple(a for a in range(codes.ndim) if a != axis)) == 127)


def _graph_with_a_shared_weight() -> bytes:
    w = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(3, 4), "W")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["y"]), helper.make_node("Add", ["W", "W"], ["w2"]),
             helper.make_node("MatMul", ["y", "V"], ["z"])]
    v = numpy_helper.from_array(np.ones((4, 2), np.float32), "V")
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 2]),
                               helper.make_tensor_value_info("w2", TensorProto.FLOAT, [3, 4])], [w, v])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


@pytest.mark.parametrize("storage", ["float16", "int8"])
def test_a_weight_another_op_reads_stays_float32(storage):
    data, record = store_weights(_graph_with_a_shared_weight(), storage)
    init = {t.name: numpy_helper.to_array(t) for t in onnx.load_from_string(data).graph.initializer}
    assert init["W"].dtype == np.float32  # Add reads it too: its values must not change
    assert "V" not in init and record["stored_weights"] == {"MatMul": 1}


def test_a_variant_that_crashes_onnxruntime_is_refused_by_name(tmp_path, gru_module, quiet, monkeypatch):
    monkeypatch.setattr(variants_module, "_session_crash", lambda data: "is killed by SIGSEGV")
    with pytest.raises(ExportError, match=r"variant fp16: ONNX Runtime .* is killed by SIGSEGV creating a session "
                                          r"for it .*export without it"):
        export_bundle(gru_module, tmp_path / "g", kind="recurrent", example_input=torch.zeros(1, 12), rate_hz=50.0,
                      variants=("fp16",), report=quiet)
    assert not (tmp_path / "g").exists()  # nothing half-written


def test_the_crash_check_runs_onnxruntime_in_a_child():
    assert variants_module._session_crash(_graph_with_a_shared_weight()) is None
    assert variants_module._session_crash(b"not an onnx graph").startswith("fails (")


def test_fp16_keeps_layer_normalization_in_float32(tmp_path, quiet):
    from closedloop.sdk.zoo import make_bundle

    b = make_bundle("transformer", "tiny", tmp_path / "t", variants=("fp16",))
    v = load_bundle(b).graph().variants["fp16"]
    assert v["float32_ops"] == ["LayerNormalization"] and v["within_tolerance"] is True
    model = onnx.load(b / v["file"])
    init = {t.name: t.data_type for t in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "LayerNormalization":
            assert init.get(n.input[1], TensorProto.FLOAT) == TensorProto.FLOAT
