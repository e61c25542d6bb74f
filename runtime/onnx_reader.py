"""A minimal, dependency-free reader of ONNX model files.

The deployed runtime must not need the ``onnx`` package (nor torch): this module
decodes just the parts of the ``ModelProto`` protobuf the runtime uses (graph
inputs and outputs with dtypes and shapes, nodes with attributes, and initializers
as numpy arrays) straight from the wire format. Field numbers follow ``onnx.proto``
(ONNX IR version 3 and later). Unknown fields are skipped, so newer files still load.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# TensorProto.DataType -> numpy dtype (the ones a deployed model uses).
ONNX_DTYPES: dict[int, np.dtype] = {
    1: np.dtype(np.float32),
    2: np.dtype(np.uint8),
    3: np.dtype(np.int8),
    4: np.dtype(np.uint16),
    5: np.dtype(np.int16),
    6: np.dtype(np.int32),
    7: np.dtype(np.int64),
    9: np.dtype(np.bool_),
    10: np.dtype(np.float16),
    11: np.dtype(np.float64),
    12: np.dtype(np.uint32),
    13: np.dtype(np.uint64),
}
DTYPE_NAMES: dict[int, str] = {k: v.name for k, v in ONNX_DTYPES.items()}


class OnnxFormatError(ValueError):
    """The file is not a readable ONNX model."""


@dataclass
class ValueInfo:
    name: str
    dtype: str | None
    shape: list[int | str | None]


@dataclass
class Node:
    op_type: str
    name: str
    inputs: list[str]
    outputs: list[str]
    attributes: dict[str, Any] = field(default_factory=dict)
    domain: str = ""


@dataclass
class OnnxModel:
    inputs: list[ValueInfo]
    outputs: list[ValueInfo]
    nodes: list[Node]
    initializers: dict[str, np.ndarray]
    opset: dict[str, int]
    ir_version: int = 0
    producer: str = ""

    def graph_inputs(self) -> list[ValueInfo]:
        """Inputs a caller must feed (initializers listed as inputs excluded, as ONNX allows)."""
        return [v for v in self.inputs if v.name not in self.initializers]


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while True:
        if pos >= len(buf):
            raise OnnxFormatError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 70:
            raise OnnxFormatError("varint too long")


def _fields(buf: memoryview):
    """Yield (field_number, wire_type, value) of one protobuf message."""
    pos = 0
    n = len(buf)
    while pos < n:
        key, pos = _varint(buf, pos)
        fnum, wt = key >> 3, key & 7
        val: int | memoryview
        if wt == 0:
            val, pos = _varint(buf, pos)
        elif wt == 1:
            val = buf[pos : pos + 8]
            pos += 8
        elif wt == 2:
            ln, pos = _varint(buf, pos)
            val = buf[pos : pos + ln]
            pos += ln
        elif wt == 5:
            val = buf[pos : pos + 4]
            pos += 4
        else:
            raise OnnxFormatError(f"unsupported protobuf wire type {wt}")
        if pos > n:
            raise OnnxFormatError("truncated field")
        yield fnum, wt, val


def _signed64(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _packed_varints(val: Any, wt: int) -> list[int]:
    if wt == 0:
        return [_signed64(val)]
    out, pos = [], 0
    while pos < len(val):
        v, pos = _varint(val, pos)
        out.append(_signed64(v))
    return out


def _packed_floats(val: Any, wt: int, fmt: str) -> list[float]:
    if wt in (1, 5):
        return [struct.unpack("<" + fmt, bytes(val))[0]]
    size = struct.calcsize(fmt)
    return list(struct.unpack(f"<{len(val) // size}{fmt}", bytes(val)))


def _tensor(buf: memoryview) -> tuple[str, np.ndarray]:
    dims: list[int] = []
    dtype_code = 0
    name = ""
    raw: bytes | None = None
    floats: list[float] = []
    ints: list[int] = []
    doubles: list[float] = []
    external = False
    for f, wt, v in _fields(buf):
        if f == 1:
            dims.extend(_packed_varints(v, wt))
        elif f == 2:
            dtype_code = v
        elif f == 4:
            floats.extend(_packed_floats(v, wt, "f"))
        elif f in (5, 7, 11):  # int32_data, int64_data, uint64_data
            ints.extend(_packed_varints(v, wt))
        elif f == 10:
            doubles.extend(_packed_floats(v, wt, "d"))
        elif f == 8:
            name = bytes(v).decode()
        elif f == 9:
            raw = bytes(v)
        elif f == 14:
            external = v == 1
    if external:
        raise OnnxFormatError(f"initializer {name!r} uses external data; re-export with weights inside the file")
    if dtype_code not in ONNX_DTYPES:
        raise OnnxFormatError(f"initializer {name!r} has unsupported data type {dtype_code}")
    dt = ONNX_DTYPES[dtype_code]
    if raw is not None:
        arr = np.frombuffer(raw, dtype=dt.newbyteorder("<")).astype(dt, copy=True)
    elif dtype_code == 1:
        arr = np.asarray(floats, dtype=dt)
    elif dtype_code == 11:
        arr = np.asarray(doubles, dtype=dt)
    elif dtype_code == 10:  # float16 stored as uint16 bit patterns in int32_data
        arr = np.asarray(ints, dtype=np.uint16).view(np.float16)
    else:
        arr = np.asarray(ints, dtype=dt)
    count = int(np.prod(dims)) if dims else 1
    if arr.size != count:
        raise OnnxFormatError(f"initializer {name!r}: {arr.size} values for shape {dims}")
    return name, arr.reshape(dims)


def _attribute(buf: memoryview) -> tuple[str, Any]:
    name = ""
    vals: dict[int, Any] = {}
    floats: list[float] = []
    ints: list[int] = []
    strings: list[str] = []
    for f, wt, v in _fields(buf):
        if f == 1:
            name = bytes(v).decode()
        elif f == 2:
            vals[2] = struct.unpack("<f", bytes(v))[0]
        elif f == 3:
            vals[3] = _signed64(v)
        elif f == 4:
            vals[4] = bytes(v).decode(errors="replace")
        elif f == 5:
            vals[5] = _tensor(v)[1]
        elif f == 7:
            floats.extend(_packed_floats(v, wt, "f"))
        elif f == 8:
            ints.extend(_packed_varints(v, wt))
        elif f == 9:
            strings.append(bytes(v).decode(errors="replace"))
        elif f == 20:
            vals[20] = v
    kind = vals.get(20)
    value: Any
    if kind == 1 or (kind is None and 2 in vals):
        value = vals.get(2, 0.0)
    elif kind == 2 or (kind is None and 3 in vals):
        value = vals.get(3, 0)
    elif kind == 3 or (kind is None and 4 in vals):
        value = vals.get(4, "")
    elif kind == 4 or (kind is None and 5 in vals):
        value = vals.get(5)
    elif kind == 6 or (kind is None and floats):
        value = floats
    elif kind == 7 or (kind is None and ints):
        value = ints
    elif kind == 8 or strings:
        value = strings
    else:
        value = None
    return name, value


def _node(buf: memoryview) -> Node:
    node = Node(op_type="", name="", inputs=[], outputs=[])
    for f, _, v in _fields(buf):
        if f == 1:
            node.inputs.append(bytes(v).decode())
        elif f == 2:
            node.outputs.append(bytes(v).decode())
        elif f == 3:
            node.name = bytes(v).decode()
        elif f == 4:
            node.op_type = bytes(v).decode()
        elif f == 5:
            k, val = _attribute(v)
            node.attributes[k] = val
        elif f == 7:
            node.domain = bytes(v).decode()
    return node


def _value_info(buf: memoryview) -> ValueInfo:
    name = ""
    dtype: str | None = None
    shape: list[int | str | None] = []
    for f, _, v in _fields(buf):
        if f == 1:
            name = bytes(v).decode()
        elif f == 2:  # TypeProto
            for tf, _, tv in _fields(v):
                if tf != 1:  # tensor_type
                    continue
                for ef, _, ev in _fields(tv):
                    if ef == 1:
                        dtype = DTYPE_NAMES.get(ev, f"onnx-type-{ev}")
                    elif ef == 2:  # TensorShapeProto
                        for _sf, _, dim in _fields(ev):
                            d: int | str | None = None
                            for df, _, dv in _fields(dim):
                                if df == 1:
                                    d = int(dv)
                                elif df == 2:
                                    d = bytes(dv).decode()
                            shape.append(d)
    return ValueInfo(name=name, dtype=dtype, shape=shape)


def parse_onnx(data: bytes) -> OnnxModel:
    """Decode an ONNX ``ModelProto`` from bytes."""
    buf = memoryview(data)
    model = OnnxModel(inputs=[], outputs=[], nodes=[], initializers={}, opset={})
    graph: memoryview | None = None
    try:
        for f, _, v in _fields(buf):
            if f == 1:
                model.ir_version = v
            elif f == 2:
                model.producer = bytes(v).decode(errors="replace")
            elif f == 7:
                graph = v
            elif f == 8:
                domain, version = "", 0
                for of, _, ov in _fields(v):
                    if of == 1:
                        domain = bytes(ov).decode()
                    elif of == 2:
                        version = ov
                model.opset[domain or "ai.onnx"] = version
        if graph is None:
            raise OnnxFormatError("no graph in model")
        for f, _, v in _fields(graph):
            if f == 1:
                model.nodes.append(_node(v))
            elif f == 5:
                name, arr = _tensor(v)
                model.initializers[name] = arr
            elif f == 11:
                model.inputs.append(_value_info(v))
            elif f == 12:
                model.outputs.append(_value_info(v))
    except OnnxFormatError:
        raise
    except (IndexError, UnicodeDecodeError, struct.error, ValueError) as exc:
        raise OnnxFormatError(f"malformed ONNX protobuf: {exc}") from exc
    # Constant nodes behave as initializers for readers that want values.
    for node in model.nodes:
        if node.op_type == "Constant" and "value" in node.attributes and node.outputs:
            model.initializers.setdefault(node.outputs[0], node.attributes["value"])
    return model


def read_onnx(path: str | Path) -> OnnxModel:
    """Read and decode an ONNX file, naming the file in any error."""
    p = Path(path)
    try:
        return parse_onnx(p.read_bytes())
    except OnnxFormatError as exc:
        raise OnnxFormatError(f"{p}: {exc}") from exc


def op_counts(model: OnnxModel) -> dict[str, int]:
    """Op type -> node count (custom domains written as ``domain::Op``)."""
    counts: dict[str, int] = {}
    for n in model.nodes:
        key = n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}::{n.op_type}"
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))
