"""TensorRT: the op-list report (no TensorRT needed) and the engine-build path against a stand-in module."""

from __future__ import annotations

import sys
import types

import onnx
import pytest
from onnx import TensorProto, helper

import closedloop.export.tensorrt as trt_mod
from closedloop.export import build_tensorrt_engines, tensorrt_compatibility
from closedloop.runtime.bundle import load_bundle


def _graph(op: str, domain: str = "", opset: int = 17, **attrs) -> bytes:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    node = helper.make_node(op, ["x"], ["y"], domain=domain, **attrs)
    imports = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    return helper.make_model(helper.make_graph([node], "g", [x], [y]), opset_imports=imports).SerializeToString()


def test_op_list_names_its_source():
    table = trt_mod.tensorrt_op_table()
    assert "onnx-tensorrt" in table["source"] and "operators.md" in table["source"]
    assert {"GRU", "Gemm", "LogSoftmax", "MatMul", "Relu", "Tanh"} <= set(table["supported"])
    assert {"MatMulInteger", "DynamicQuantizeLinear"} <= set(table["unsupported"])


def test_our_graphs_pass(gru_bundle, mlp_bundle):
    for path in (gru_bundle, mlp_bundle):
        report = load_bundle(path).manifest.graphs["main"].tensorrt_compatibility
        assert report["compatible"] is True and report["unsupported_ops"] == []
        assert report["source"] == trt_mod.tensorrt_op_table()["source"]
        assert any("optimization profile" in n for n in report["notes"])  # dynamic batch
    gru = load_bundle(gru_bundle).manifest.graphs["main"].tensorrt_compatibility
    assert gru["ops"]["GRU"] == 2 and any("loop of small matrix layers" in n for n in gru["notes"])


@pytest.mark.parametrize(
    ("graph", "flagged"),
    [
        (_graph("Unique"), "Unique"),  # listed as unsupported
        (_graph("MadeUpOp"), "MadeUpOp"),  # in no list
        (_graph("FusedThing", domain="com.microsoft"), "com.microsoft::FusedThing"),  # needs a plugin
        (_graph("Relu", opset=7), "opset 7"),
    ],
)
def test_unsupported_things_are_flagged(graph, flagged):
    report = tensorrt_compatibility(graph)
    assert report["compatible"] is False
    assert flagged in report["unsupported_ops"]
    assert any(flagged.split("::")[-1].split()[0] in n for n in report["notes"])


def test_ops_newer_than_jetpack6_are_noted():
    report = tensorrt_compatibility(_graph("HannWindow"))
    assert report["compatible"] is True and report["min_tensorrt"] == "10.4"
    assert any("JetPack 6 ships 10.3" in n for n in report["notes"])


def test_no_tensorrt_is_one_line_and_no_engine(gru_bundle, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import tensorrt -> ImportError
    spec = load_bundle(gru_bundle).manifest.graphs["main"]
    lines: list[str] = []
    assert build_tensorrt_engines("main", spec, b"", None, report=lines.append) == {}
    assert len(lines) == 1 and "not installed" in lines[0] and spec.tensorrt_engines == []


class _FakeTensorRT(types.ModuleType):
    """Just enough of the tensorrt module to follow the build path (records what it was asked)."""

    def __init__(self, version: str, fp16_flag: bool):
        super().__init__("tensorrt")
        self.__version__ = version
        self.calls: dict = {"flags": [], "shapes": {}}
        calls = self.calls

        class Logger:
            WARNING = 2

            def __init__(self, level):
                pass

        class BuilderFlag:
            pass

        if fp16_flag:
            BuilderFlag.FP16 = "FP16"

        class Profile:
            def set_shape(self, name, lo, opt, hi):
                calls["shapes"][name] = (tuple(lo), tuple(opt), tuple(hi))

        class Config:
            def set_flag(self, flag):
                calls["flags"].append(flag)

            def add_optimization_profile(self, profile):
                calls["profile"] = profile

        class Builder:
            def __init__(self, logger):
                pass

            def create_network(self, flags):
                calls["network_flags"] = flags
                return object()

            def create_builder_config(self):
                return Config()

            def create_optimization_profile(self):
                return Profile()

            def build_serialized_network(self, network, config):
                return b"ENGINE"

        class OnnxParser:
            num_errors = 0

            def __init__(self, network, logger):
                pass

            def parse(self, data):
                calls["parsed"] = data
                return True

        self.Logger, self.BuilderFlag, self.Builder, self.OnnxParser = Logger, BuilderFlag, Builder, OnnxParser


@pytest.mark.parametrize(("version", "fp16_flag", "source"), [("10.3.0", True, b"FP32"), ("11.1.0", False, b"FP16")])
def test_engine_build_path(gru_bundle, monkeypatch, version, fp16_flag, source):
    fake = _FakeTensorRT(version, fp16_flag)
    monkeypatch.setitem(sys.modules, "tensorrt", fake)
    monkeypatch.setattr(trt_mod, "_gpu", lambda: ("NVIDIA Jetson AGX Orin", "8.7"))
    spec = load_bundle(gru_bundle).manifest.graphs["main"]
    lines: list[str] = []
    files = build_tensorrt_engines("main", spec, b"FP32", b"FP16", max_batch=4, report=lines.append)
    rel = f"engines/main.nvidia-jetson-agx-orin.trt{version}.fp16.engine"
    assert files == {rel: b"ENGINE"} and len(lines) == 1
    assert fake.calls["parsed"] == source  # TensorRT 11: precision from the fp16 graph, no builder flag
    assert fake.calls["flags"] == (["FP16"] if fp16_flag else [])
    assert fake.calls["shapes"] == {"x": ((1, 12), (1, 12), (4, 12)), "h": ((2, 1, 16), (2, 1, 16), (2, 4, 16))}
    (entry,) = spec.tensorrt_engines
    assert entry["file"] == rel and entry["gpu"] == "NVIDIA Jetson AGX Orin" and entry["tensorrt_version"] == version


def test_engine_build_without_gpu_is_one_line(gru_bundle, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", _FakeTensorRT("10.3.0", True))
    monkeypatch.setattr(trt_mod, "_gpu", lambda: None)
    lines: list[str] = []
    spec = load_bundle(gru_bundle).manifest.graphs["main"]
    assert build_tensorrt_engines("main", spec, b"x", None, report=lines.append) == {}
    assert lines == ["TensorRT 10.3.0: no CUDA GPU found, no engine built"]


def test_gru_layout_1_is_flagged():
    model = onnx.load_from_string(_graph("Relu"))
    model.graph.node.append(helper.make_node("GRU", ["x", "w", "r"], ["", "hn"], hidden_size=4, layout=1))
    report = tensorrt_compatibility(model.SerializeToString())
    assert "GRU(layout=1)" in report["unsupported_ops"]
