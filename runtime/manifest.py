"""The bundle manifest: the contract between training and deployment.

A bundle is a folder (or a zip of one) holding ``manifest.json`` and the files it
names. This module defines the manifest's schema as dataclasses that serialise to
and from JSON; ``closedloop.runtime.bundle`` loads and verifies bundles, ``export`` writes them.
The schema is documented field by field in ``docs/bundle.md``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .errors import BundleError
from .integrity import LONE_SURROGATE

#: 2: inputs and outputs carry a ``role`` and inputs an optional ``window``. A version-1 manifest
#: (neither field) reads as version 2 with the default roles.
#: 3: a state input may carry ``initial``, the value its state starts (and resets) at; a version-2 reader
#: would start it at zeros, so a bundle that has one is written as version 3 and any other as version 2.
SCHEMA_VERSION = 2
INITIAL_STATE_SCHEMA_VERSION = 3
SUPPORTED_SCHEMA_VERSIONS = (1, 2, 3)
MANIFEST_NAME = "manifest.json"

Dim = int | str  # a fixed size, or a symbolic name for a dynamic axis ("batch")

#: What a data input is to a session: ``measurement`` comes from the device's stream every step;
#: ``goal``, ``mode`` and ``context`` are set by the session (its config, or a second message type)
#: and held between steps. ``state`` marks recurrent state (in and out).
INPUT_ROLES = ("measurement", "goal", "mode", "context", "state")
#: ``command`` is what the session sends (postprocessed); ``estimate`` and ``output`` are recorded;
#: ``state`` is recurrent state.
OUTPUT_ROLES = ("command", "estimate", "output", "state")
WINDOW_LAYOUTS = ("time_major", "channel_major")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r} appears twice in one object")
        out[key] = value
    return out


def loads_manifest(text: str, source: str = MANIFEST_NAME) -> Any:
    """``manifest.json``'s text as JSON, refusing an object with a repeated key.

    JSON parsers differ on which of two equal keys counts (Python's keeps the last, others the first), so a
    manifest with one could be read one way by the reader that checks its signature and another by a runtime.
    """
    try:
        value = json.loads(text, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        raise BundleError(f"{source}: not valid JSON ({exc}); the bundle is damaged, re-export it") from exc
    except ValueError as exc:
        raise BundleError(f"{source}: {exc}; JSON readers differ on which one counts, so a manifest may not "
                          "repeat a key: re-export the bundle") from exc
    try:  # every string must be Unicode text: a lone surrogate has no UTF-8 bytes, so no digest could cover it
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise BundleError(f"{source} {LONE_SURROGATE}: re-export the bundle with that string fixed") from None
    return value


def _kind_name(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


_STRING, _OBJECT, _ARRAY, _BOOL = (str,), (dict,), (list,), (bool,)


def _type_problems(d: dict[str, Any], source: str) -> list[str]:
    """Fields whose JSON type is not the one docs/bundle.md gives (``bytes`` 1.0, ``state`` 0, ``name`` 5 ...)."""
    out: list[str] = []

    def want(where: str, value: Any, types: tuple[type, ...], what: str, optional: bool = True) -> bool:
        if value is None and optional:
            return True
        if type(value) not in types:
            out.append(f"{source}: {where} must be {what}, got {_kind_name(value)} {str(value)[:40]!r}")
            return False
        return True

    want("family", d.get("family"), _STRING, "a string", optional=False)
    for key in ("name",):
        if key in d:
            want(key, d[key], _STRING, "a string", optional=False)
    for key in ("preprocess", "postprocess", "provenance", "extra"):
        if key in d:
            want(key, d[key], _OBJECT, "an object", optional=False)
    if "certificate" in d:
        want("certificate", d["certificate"], _OBJECT, "an object or null")
    if want("files", d.get("files"), _OBJECT, "an object", optional=False):
        for rel, meta in d["files"].items():
            if want(f"files[{rel!r}]", meta, _OBJECT, "an object", optional=False):
                want(f"files[{rel!r}].sha256", meta.get("sha256"), _STRING, "a string (64 lowercase hex digits)",
                     optional=False)
                if "bytes" in meta:
                    want(f"files[{rel!r}].bytes", meta["bytes"], (int,), "an integer", optional=False)
    if not want("graphs", d.get("graphs"), _OBJECT, "an object", optional=False):
        return out
    for gname, g in d["graphs"].items():
        where = f"graphs[{gname!r}]"
        if not want(where, g, _OBJECT, "an object", optional=False):
            continue
        want(f"{where}.file", g.get("file"), _STRING, "a string", optional=False)
        want(f"{where}.kind", g.get("kind"), _STRING, "a string", optional=False)
        for key, types, what in (("parity", _OBJECT, "an object"), ("variants", _OBJECT, "an object"),
                                 ("tensorrt_engines", _ARRAY, "an array"),
                                 ("tensorrt_compatibility", _OBJECT, "an object")):
            if key in g:
                want(f"{where}.{key}", g[key], types, what, optional=False)
        for side in ("inputs", "outputs"):
            if not want(f"{where}.{side}", g.get(side), _ARRAY, "an array", optional=False):
                continue
            for i, t in enumerate(g[side]):
                at = f"{where}.{side}[{i}]"
                if not want(at, t, _OBJECT, "an object", optional=False):
                    continue
                want(f"{at}.name", t.get("name"), _STRING, "a string", optional=False)
                want(f"{at}.dtype", t.get("dtype"), _STRING, "a string", optional=False)
                if want(f"{at}.shape", t.get("shape"), _ARRAY, "an array", optional=False):
                    for j, dim in enumerate(t["shape"]):
                        want(f"{at}.shape[{j}]", dim, (int, str), "an integer or a string", optional=False)
                if "state" in t:
                    want(f"{at}.state", t["state"], _BOOL, "true or false", optional=False)
                want(f"{at}.state_pair", t.get("state_pair"), _STRING, "a string or null")
                want(f"{at}.role", t.get("role"), _STRING, "a string")
                want(f"{at}.window", t.get("window"), _OBJECT, "an object")
                if "initial" in t and want(f"{at}.initial", t["initial"], _ARRAY, "an array of numbers",
                                           optional=False):
                    bad = [v for v in t["initial"] if type(v) not in (int, float)]
                    if bad:
                        out.append(f"{source}: {at}.initial must hold finite JSON numbers only, got "
                                   f"{_kind_name(bad[0])} {str(bad[0])[:40]!r}")
    return out


@dataclass
class Window:
    """A window over a stream of frames: the input holds the last ``length`` frames.

    ``time_major``: the input is ``(batch, length, features)``; ``channel_major``:
    ``(batch, features, length)`` (what Conv1d takes). The features may span several axes
    (``(batch, 1, channels, length)``, what an EEGNet-style Conv2d takes): a frame is all of
    them, in C order; ``(batch, length)`` is a window of one value per frame, either layout.
    The runtime keeps the frames in a preallocated ring buffer and runs the model once every
    ``hop`` frames, after the first ``length`` frames have arrived.
    """

    length: int
    hop: int = 1
    layout: str = "time_major"

    def problems(self, where: str) -> list[str]:
        out = []
        for key in ("length", "hop"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                out.append(f"{where}: window {key} must be a positive integer, got {v!r}")
        if self.layout not in WINDOW_LAYOUTS:
            out.append(f"{where}: window layout {self.layout!r} is not one of {list(WINDOW_LAYOUTS)}")
        return out

    def time_axis(self, rank: int) -> int:
        """The window's axis in an input of ``rank`` axes (batch first): the one after the batch for
        ``time_major``, the last for ``channel_major``."""
        return 1 if self.layout == "time_major" else rank - 1

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Window:
        unknown = sorted(set(d) - {"length", "hop", "layout"})
        if unknown:
            raise ValueError(f"unknown window field(s) {unknown}; known: length, hop, layout")
        return cls(length=d["length"], hop=d.get("hop", 1), layout=d.get("layout", "time_major"))


@dataclass
class TensorSpec:
    """One graph input or output.

    ``state_pair`` links a recurrent state input to the output that carries its next
    value (and back): the runtime copies output to input after every step. ``role`` says
    what the tensor is to a session (``INPUT_ROLES`` / ``OUTPUT_ROLES``; None: the default,
    see :meth:`GraphSpec.role_of`); ``window`` makes a data input a window over a stream.
    """

    name: str
    dtype: str
    shape: list[Dim]
    state: bool = False
    state_pair: str | None = None
    role: str | None = None
    window: Window | None = None
    #: A state input's starting value (a learned initial state), flattened in C order at batch 1; None: zeros.
    initial: list[float] | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TensorSpec:
        window = d.get("window")
        initial = d.get("initial")
        return cls(
            name=d["name"],
            dtype=d["dtype"],
            shape=list(d["shape"]),
            state=bool(d.get("state", False)),
            state_pair=d.get("state_pair"),
            role=d.get("role"),
            window=Window.from_dict(window) if window is not None else None,
            initial=[float(v) for v in initial] if initial is not None else None,
        )

    def initial_value(self, batch: int = 1) -> np.ndarray:
        """The value a state input starts and resets at, shaped for ``batch`` (zeros without ``initial``): the
        batch-1 value repeated along the batch axis."""
        shape = self.concrete_shape(batch)
        if self.initial is None:
            return np.zeros(shape, dtype=np.dtype(self.dtype))
        one = np.asarray(self.initial, dtype=np.dtype(self.dtype)).reshape(self.concrete_shape(1))
        axis = self.batch_axis
        return np.ascontiguousarray(one if axis is None or batch == 1 else np.repeat(one, batch, axis=axis))

    @property
    def batch_axis(self) -> int | None:
        """The axis of the dynamic (batch) dimension, or None for a tensor of fixed shape."""
        return next((i for i, d in enumerate(self.shape) if not isinstance(d, int)), None)

    @property
    def frame_shape(self) -> tuple[int, ...]:
        """The shape of one frame a device streams into this input (batch and window axes removed)."""
        dims = [d for d in self.shape[1:]]
        if self.window is not None:
            del dims[self.window.time_axis(len(self.shape)) - 1]
        return tuple(int(d) for d in dims)

    def concrete_shape(self, batch: int = 1) -> tuple[int, ...]:
        """Shape with every symbolic axis set to ``batch`` (the only dynamic axis we export)."""
        return tuple(d if isinstance(d, int) else batch for d in self.shape)


@dataclass
class GraphSpec:
    """One ONNX graph of the bundle and what is known about it."""

    file: str
    kind: str  # "recurrent" (single-step graph, explicit state) or "feedforward"
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    parity: dict[str, Any] = field(default_factory=dict)
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)
    tensorrt_engines: list[dict[str, Any]] = field(default_factory=list)
    tensorrt_compatibility: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GraphSpec:
        return cls(
            file=d["file"],
            kind=d["kind"],
            inputs=[TensorSpec.from_dict(t) for t in d["inputs"]],
            outputs=[TensorSpec.from_dict(t) for t in d["outputs"]],
            parity=dict(d.get("parity", {})),
            variants={k: dict(v) for k, v in d.get("variants", {}).items()},
            tensorrt_engines=list(d.get("tensorrt_engines", [])),
            tensorrt_compatibility=dict(d.get("tensorrt_compatibility", {})),
        )

    @property
    def data_inputs(self) -> list[TensorSpec]:
        return [t for t in self.inputs if not t.state]

    @property
    def data_outputs(self) -> list[TensorSpec]:
        return [t for t in self.outputs if not t.state]

    @property
    def state_inputs(self) -> list[TensorSpec]:
        return [t for t in self.inputs if t.state]

    def state_like_pairs(self) -> list[tuple[str, str]]:
        """``(input, output)`` where a data input after the first has a data output of its shape: likely a recurrent
        state left undeclared (a session would then ask for its value as a held input). An input given a role
        (a goal) is what its role says, not a state."""
        pairs = []
        for t in self.data_inputs[1:]:
            if t.role is not None:
                continue
            twin = next((o.name for o in self.data_outputs if list(o.shape) == list(t.shape)), None)
            if twin is not None:
                pairs.append((t.name, twin))
        return pairs

    def role_of(self, tensor: TensorSpec) -> str:
        """The tensor's role, with the defaults of a manifest that does not state it: state tensors are
        ``state``; the first data input is the ``measurement`` and the first data output the ``command``;
        other data inputs are ``context`` and other data outputs ``output``."""
        if tensor.role is not None:
            return tensor.role
        if tensor.state:
            return "state"
        if tensor in self.inputs:
            return "measurement" if tensor is self.data_inputs[0] else "context"
        return "command" if tensor is self.data_outputs[0] else "output"

    def input(self, name: str) -> TensorSpec:
        for t in self.inputs:
            if t.name == name:
                return t
        raise KeyError(f"the graph has no input {name!r}; its inputs: {[t.name for t in self.inputs]}")

    def problems(self, where: str) -> list[str]:
        """Roles and windows that do not fit the graph's tensors, one line each."""
        out = []
        for t in self.inputs + self.outputs:
            roles = INPUT_ROLES if t in self.inputs else OUTPUT_ROLES
            if t.role is not None and t.role not in roles:
                out.append(f"{where}: {t.name!r} has role {t.role!r}; known roles: {list(roles)}")
            if t.role is not None and (t.role == "state") != t.state:
                out.append(f"{where}: {t.name!r} has role {t.role!r} but state={t.state}")
        data = self.data_inputs
        if data and not out:
            measured = [t.name for t in data if self.role_of(t) == "measurement"]
            if len(measured) != 1:
                out.append(f"{where}: exactly one data input must have role 'measurement' (the device's stream); "
                           f"roles now: { {t.name: self.role_of(t) for t in data} }")
        for t in self.outputs:
            if t.window is not None:
                out.append(f"{where}: output {t.name!r} has a window; only inputs can")
        for t in self.inputs + self.outputs:
            if t.initial is None:
                continue
            if not t.state or t in self.outputs:
                out.append(f"{where}: {t.name!r} has an initial value; only a state input can (a data input is fed "
                           "every step, an output is computed)")
                continue
            size = math.prod(t.concrete_shape(1))
            if len(t.initial) != size:
                out.append(f"{where}: state input {t.name!r} has {len(t.initial)} initial values; its shape "
                           f"{t.shape} at batch 1 holds {size}")
                continue
            try:  # finite as the state's own dtype holds it: 1e300 is a finite JSON number but inf in float32
                limit = float(np.finfo(np.dtype(t.dtype)).max)
            except (TypeError, ValueError):
                continue  # not a float dtype: the dtype rules say so
            outside = [v for v in t.initial if not (math.isfinite(v) and abs(v) <= limit)]
            if outside:
                out.append(f"{where}: state input {t.name!r} has initial values that are not finite {t.dtype} "
                           f"numbers (first: {outside[0]!r}; largest allowed magnitude {limit:.8g})")
        for t in self.inputs:
            if t.window is None:
                continue
            what = f"{where}: input {t.name!r}"
            if t.state:
                out.append(f"{what} is recurrent state and cannot have a window")
                continue
            found = t.window.problems(what)
            if found:
                out += found
                continue
            rank = len(t.shape)
            if rank < 2:
                out.append(f"{what} has shape {t.shape}; a windowed input is (batch, length, features...) "
                           "(time_major), (batch, features..., length) (channel_major) or (batch, length) (one "
                           "value per frame)")
                continue
            if any(not isinstance(d, int) for d in t.shape[1:]):
                out.append(f"{what} has shape {t.shape}; a windowed input has its batch on axis 0 and fixed sizes "
                           "elsewhere")
                continue
            axis = t.window.time_axis(rank)
            if t.shape[axis] != t.window.length:
                other = "channel_major" if t.window.layout == "time_major" else "time_major"
                other_axis = rank - 1 if axis == 1 else 1
                hint = (f"; axis {other_axis} is {t.window.length}: the window is {other} (import-onnx "
                        f"--window {t.name}={t.window.length}:{t.window.hop}:{other}; export_bundle "
                        f"windows={{{t.name!r}: Window(length={t.window.length}, hop={t.window.hop}, layout={other!r})}})"
                        if t.shape[other_axis] == t.window.length else "")
                out.append(f"{what} has shape {t.shape}: axis {axis} is {t.shape[axis]}, "
                           f"its window ({t.window.layout}) is {t.window.length} frames{hint}")
        return out


@dataclass
class Manifest:
    """Everything the runtime needs to know about a bundle."""

    family: str
    graphs: dict[str, GraphSpec]
    files: dict[str, dict[str, Any]]  # relative path -> {"sha256": hex, "bytes": n}
    rate_hz: float
    name: str = ""
    schema_version: int = SCHEMA_VERSION
    preprocess: dict[str, Any] = field(default_factory=dict)
    postprocess: dict[str, Any] = field(default_factory=dict)
    certificate: dict[str, Any] | None = None
    provenance: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # family-specific, versioned by the family

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for g in d["graphs"].values():  # an unstated role or window is left out, not written as null
            for tensor in g["inputs"] + g["outputs"]:
                for key in ("role", "window", "initial"):
                    if tensor.get(key) is None:
                        tensor.pop(key, None)
        # Order keys so that a person reading manifest.json sees the important parts first.
        head = ["schema_version", "family", "name", "rate_hz", "graphs", "preprocess", "postprocess"]
        return {k: d[k] for k in head} | {k: v for k, v in d.items() if k not in head}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n"

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = MANIFEST_NAME) -> Manifest:
        if not isinstance(d, dict):
            raise BundleError(f"{source}: expected a JSON object at top level, got {type(d).__name__}")
        version = d.get("schema_version")
        if type(version) is not int or version not in SUPPORTED_SCHEMA_VERSIONS:  # 1.0 and true are not 1
            raise BundleError(
                f"{source}: unknown schema_version {version!r}; this runtime reads "
                f"{list(SUPPORTED_SCHEMA_VERSIONS)}. Upgrade closedloop or re-export the bundle."
            )
        missing = [k for k in ("family", "graphs", "files", "rate_hz") if k not in d]
        if missing:
            raise BundleError(f"{source}: missing required field(s) {missing}; re-export the bundle")
        typed = _type_problems(d, source)
        if typed:
            raise BundleError("; ".join(typed) + "; re-export the bundle")
        if version < INITIAL_STATE_SCHEMA_VERSION:  # a version-2 reader would start such a state at zeros
            learned = [f"{g}.inputs[{i}].initial" for g, spec in d["graphs"].items()
                       for i, t in enumerate(spec["inputs"]) if "initial" in t]
            if learned:
                raise BundleError(f"{source}: schema_version {version} but {', '.join(learned)} set: an initial "
                                  f"state is version {INITIAL_STATE_SCHEMA_VERSION} (an older reader would start "
                                  "the state at zeros and run the model wrongly); re-export the bundle, or set "
                                  f"schema_version {INITIAL_STATE_SCHEMA_VERSION}")
        if version == 1:  # a version-1 reader ignores roles and windows: a version-1 manifest has none
            newer = [f"{g}.{side}[{i}].{key}" for g, spec in d["graphs"].items() for side in ("inputs", "outputs")
                     for i, t in enumerate(spec[side]) for key in ("role", "window") if key in t]
            if newer:
                raise BundleError(f"{source}: schema_version 1 but {', '.join(newer)} set: roles and windows are "
                                  "version 2 (a version-1 reader would ignore them and feed the model wrongly); "
                                  "re-export the bundle, or set schema_version 2")
        rate = d["rate_hz"]
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not math.isfinite(rate) or rate <= 0:
            raise BundleError(f"{source}: rate_hz must be a positive number (Hz), got {rate!r}; re-export the bundle")
        try:
            manifest = cls(
                schema_version=version,
                family=str(d["family"]),
                name=str(d.get("name", "")),
                rate_hz=float(d["rate_hz"]),
                graphs={k: GraphSpec.from_dict(g) for k, g in d["graphs"].items()},
                files={k: dict(v) for k, v in d["files"].items()},
                preprocess=dict(d.get("preprocess", {})),
                postprocess=dict(d.get("postprocess", {})),
                certificate=d.get("certificate"),
                provenance=dict(d.get("provenance", {})),
                extra=dict(d.get("extra", {})),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise BundleError(f"{source}: malformed manifest ({exc!r}); re-export the bundle") from exc
        problems = [p for name, g in manifest.graphs.items() for p in g.problems(f"{source}: graph {name!r}")]
        if problems:
            raise BundleError("; ".join(problems) + "; re-export the bundle")
        return manifest

    @staticmethod
    def version_for(graphs: dict[str, GraphSpec]) -> int:
        """The schema version a writer gives these graphs: 3 where a state input has an initial value, else 2."""
        learned = any(t.initial is not None for g in graphs.values() for t in g.inputs)
        return INITIAL_STATE_SCHEMA_VERSION if learned else SCHEMA_VERSION

    @classmethod
    def from_json(cls, text: str, source: str = MANIFEST_NAME) -> Manifest:
        return cls.from_dict(loads_manifest(text, source), source)
