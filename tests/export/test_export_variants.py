"""FP16 and INT8 variants: written, float32 at their I/O, measured against FP32, flagged when too far off."""

from __future__ import annotations

import pytest
import torch

from closedloop.export import ExportError, ExportOptions, Tolerance, export_bundle
from closedloop.runtime.bundle import load_bundle


def test_gru_variants_have_parity_numbers(gru_bundle):
    g = load_bundle(gru_bundle).manifest.graphs["main"]
    assert set(g.variants) == {"fp16", "int8"}
    for name, v in g.variants.items():
        p = v["parity_vs_fp32"]
        assert v["file"] == f"main.{name}.onnx"
        assert p["reference"].startswith("fp32 ONNX")
        assert {"random_batch_1", "random_batch_3", "sequence_step_by_step"} <= set(p["checks"])
        assert 0 < p["max_abs"] < v["tolerance"]["abs"] and v["within_tolerance"] is True
        assert "compatible" in v["tensorrt_compatibility"]
    int8 = g.variants["int8"]
    assert int8["quantized_ops"] == ["Gemm"]  # the read-out; the GRU has no integer kernel
    assert "GRU" in int8["float_ops_kept"] and "MatMulInteger" in int8["added_ops"]
    assert int8["tensorrt_compatibility"]["compatible"] is False  # MatMulInteger: no TensorRT parser support
    assert g.variants["fp16"]["io_dtype"] == "float32"


def test_variant_outside_its_tolerance_is_written_and_flagged(tmp_path, gru_module, quiet):
    lines: list[str] = []
    opts = ExportOptions(variant_tolerances={"int8": Tolerance(abs=1e-9, rel=1e-9)})
    out = export_bundle(gru_module, tmp_path / "g", kind="recurrent", example_input=torch.zeros(1, 12),
                        rate_hz=50.0, variants=("int8",), options=opts, report=lines.append)
    v = load_bundle(out).manifest.graphs["main"].variants["int8"]
    assert v["within_tolerance"] is False and v["tolerance"] == {"abs": 1e-9, "rel": 1e-9}
    assert any("OUTSIDE" in line and "int8" in line for line in lines)


def test_unknown_variant_is_refused(tmp_path, gru_module):
    with pytest.raises(ExportError, match=r"unknown variant\(s\) \['int4'\]"):
        export_bundle(gru_module, tmp_path / "g", kind="recurrent", example_input=torch.zeros(1, 12),
                      rate_hz=50.0, variants=("fp16", "int4"))
