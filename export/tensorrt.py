"""TensorRT: a compatibility report made without TensorRT, and FP16 engines where it exists.

``tensorrt_compatibility`` checks every op of a graph against the ONNX ops that
TensorRT's ONNX parser supports, kept in ``export/data/tensorrt_onnx_ops.json`` (from
onnx-tensorrt's ``docs/operators.md`` for TensorRT 10.x, source named in the file),
plus the restrictions that matter to us (GRU, dynamic shapes, custom domains). It
needs no TensorRT and no GPU, so every bundle carries it.

``build_tensorrt_engines`` builds an FP16 engine only when ``tensorrt`` imports and a
CUDA GPU is present, and otherwise says so in one line and returns nothing. An
engine only runs on the GPU model and TensorRT version that built it, so both are
in its file name and its manifest entry. TensorRT 10.x takes the FP32 graph with
the FP16 builder flag; TensorRT 11 removed the precision flags (networks are
strongly typed) and builds from the FP16 ONNX variant instead. This path cannot be
tested where TensorRT cannot be installed; see ``docs/tensorrt.md``.
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from closedloop.runtime.manifest import GraphSpec
from closedloop.runtime.onnx_reader import OnnxModel, op_counts, parse_onnx

OPS_FILE = Path(__file__).parent / "data" / "tensorrt_onnx_ops.json"
JETPACK6_TENSORRT = "10.3"


@functools.lru_cache(maxsize=1)
def tensorrt_op_table() -> dict[str, Any]:
    """The supported-op table (see its ``source`` field)."""
    return json.loads(OPS_FILE.read_text(encoding="utf-8"))


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in v.split(".") if p.isdigit())


def _odd_constants(model: OnnxModel) -> bool:
    odd = {"sparse_value", "value_string", "value_strings"}
    return any(n.op_type == "Constant" and odd & set(n.attributes) for n in model.nodes)


def tensorrt_compatibility(graph: bytes | OnnxModel) -> dict[str, Any]:
    """Check a graph's ops against TensorRT 10.x's ONNX parser; return the report stored in the manifest."""
    model = parse_onnx(graph) if isinstance(graph, bytes | bytearray) else graph
    table = tensorrt_op_table()
    supported, unsupported = table["supported"], table["unsupported"]
    ops = op_counts(model)
    bad: list[str] = []
    notes: list[str] = []
    min_version = "10.0"
    for op in ops:
        if "::" in op:
            bad.append(op)
            notes.append(f"{op}: custom-domain op; TensorRT needs a plugin for it")
        elif op in unsupported:
            bad.append(op)
            notes.append(f"{op}: not supported by TensorRT's ONNX parser ({unsupported[op]})")
        elif op not in supported:
            bad.append(op)
            notes.append(f"{op}: not in TensorRT's ONNX operator list")
        else:
            entry = supported[op]
            if op == "Constant" and not _odd_constants(model):
                pass  # its restriction (sparse or string values) does not apply to ordinary weights
            elif entry.get("restrictions"):
                notes.append(f"{op}: {entry['restrictions']}")
            since = entry.get("since")
            if since and _version(since) > _version(min_version):
                min_version = since
            if since and _version(since) > _version(JETPACK6_TENSORRT):
                notes.append(f"{op}: needs TensorRT >= {since}; JetPack 6 ships {JETPACK6_TENSORRT}")
    for n in model.nodes:
        if n.op_type in ("GRU", "LSTM", "RNN") and n.attributes.get("layout", 0) != 0:
            bad.append(f"{n.op_type}(layout={n.attributes['layout']})")
            notes.append(f"{n.op_type} node {n.name!r}: layout must be 0 (TensorRT's importer ignores the attribute)")
    if "GRU" in ops:
        notes.append(table["project_notes"]["GRU"])
    opset = model.opset.get("ai.onnx")
    if opset is not None and not table["opset_min"] <= opset <= table["opset_max"]:
        bad.append(f"opset {opset}")
        notes.append(f"opset {opset} is outside TensorRT 10.x's range {table['opset_min']}..{table['opset_max']}")
    dynamic = [v.name for v in model.graph_inputs() if any(not isinstance(d, int) for d in v.shape)]
    if dynamic:
        notes.append(f"dynamic axes on inputs {dynamic}: " + table["project_notes"]["dynamic_shapes"])
    return {
        "compatible": not bad,
        "unsupported_ops": sorted(set(bad)),
        "ops": ops,
        "min_tensorrt": min_version,
        "opset": opset,
        "notes": notes,
        "source": table["source"],
        "checked_without_tensorrt": True,
    }


def _gpu() -> tuple[str, str] | None:
    """(name, compute capability) of CUDA GPU 0, or None."""
    try:
        import torch

        if torch.cuda.is_available():
            cc = ".".join(str(v) for v in torch.cuda.get_device_capability(0))
            return torch.cuda.get_device_name(0), cc
    except Exception:  # noqa: BLE001 - a broken CUDA install means "no GPU" here
        pass
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    line = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
    if not line:
        return None
    name, _, cc = line.partition(",")
    return name.strip(), cc.strip()


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-")


def _build(trt: Any, onnx_bytes: bytes, spec: GraphSpec, max_batch: int, fp16_flag: bool) -> bytes:
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch is the only mode in TensorRT >= 10
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(onnx_bytes):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT's ONNX parser rejected the graph: {errors}")
    config = builder.create_builder_config()
    if fp16_flag:
        config.set_flag(trt.BuilderFlag.FP16)
    dynamic = [t for t in spec.inputs if any(isinstance(d, str) for d in t.shape)]
    if dynamic:  # batch 1 is the deployed case: optimise for it, allow up to max_batch
        profile = builder.create_optimization_profile()
        for t in dynamic:
            profile.set_shape(t.name, t.concrete_shape(1), t.concrete_shape(1), t.concrete_shape(max_batch))
        config.add_optimization_profile(profile)
    blob = builder.build_serialized_network(network, config)
    if blob is None:
        raise RuntimeError("build_serialized_network returned nothing (TensorRT logged the reason above)")
    return bytes(blob)


def build_tensorrt_engines(
    graph_name: str,
    spec: GraphSpec,
    fp32_onnx: bytes,
    fp16_onnx: bytes | None,
    *,
    max_batch: int = 8,
    report: Callable[[str], None] = print,
) -> dict[str, bytes]:
    """Build an FP16 engine for this machine's GPU if TensorRT and a GPU are here.

    Returns ``{relative file: engine bytes}`` (empty if nothing was built) and appends
    the engine's record to ``spec.tensorrt_engines``. Never raises for a missing or
    failing TensorRT: it reports one line and the export goes on.
    """
    try:
        import tensorrt as trt
    except ImportError:
        report("TensorRT: not installed here, no engine built (build one on the target: docs/tensorrt.md)")
        return {}
    version = str(getattr(trt, "__version__", "0"))
    major = _version(version)[0] if _version(version) else 0
    if major < 10:
        report(f"TensorRT {version}: older than 10, not supported, no engine built")
        return {}
    gpu = _gpu()
    if gpu is None:
        report(f"TensorRT {version}: no CUDA GPU found, no engine built")
        return {}
    weak_typing = major < 11 and hasattr(trt.BuilderFlag, "FP16")
    source, source_name = (fp32_onnx, spec.file) if weak_typing else (fp16_onnx, spec.variants.get("fp16", {}).get("file"))
    if source is None:
        report(f"TensorRT {version}: precision comes from the graph in TensorRT 11; export the 'fp16' variant to build an engine")
        return {}
    try:
        engine = _build(trt, source, spec, max_batch, fp16_flag=weak_typing)
    except Exception as exc:  # noqa: BLE001 - report and go on: the ONNX graphs still deploy
        report(f"TensorRT {version}: engine build failed on {gpu[0]}: {exc}")
        return {}
    rel = f"engines/{graph_name}.{_slug(gpu[0])}.trt{version}.fp16.engine"
    spec.tensorrt_engines.append(
        {
            "file": rel,
            "gpu": gpu[0],
            "compute_capability": gpu[1],
            "tensorrt_version": version,
            "precision": "fp16",
            "precision_from": "builder flag FP16" if weak_typing else "fp16 ONNX variant (strongly typed)",
            "built_from": source_name,
            "batch_profile": {"min": 1, "opt": 1, "max": max_batch},
            "built_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "parity": "not measured at export; run the bundle's parity inputs on the target",
        }
    )
    report(f"TensorRT {version}: built {rel} ({len(engine) / 1e6:.1f} MB)")
    return {rel: engine}
