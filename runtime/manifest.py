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

from .errors import BundleError

SCHEMA_VERSION = 1
SUPPORTED_SCHEMA_VERSIONS = (1,)
MANIFEST_NAME = "manifest.json"

Dim = int | str  # a fixed size, or a symbolic name for a dynamic axis ("batch")


@dataclass
class TensorSpec:
    """One graph input or output.

    ``state_pair`` links a recurrent state input to the output that carries its next
    value (and back): the runtime copies output to input after every step.
    """

    name: str
    dtype: str
    shape: list[Dim]
    state: bool = False
    state_pair: str | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TensorSpec:
        return cls(
            name=d["name"],
            dtype=d["dtype"],
            shape=list(d["shape"]),
            state=bool(d.get("state", False)),
            state_pair=d.get("state_pair"),
        )

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
        rate = d["rate_hz"]
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not math.isfinite(rate) or rate <= 0:
            raise BundleError(f"{source}: rate_hz must be a positive number (Hz), got {rate!r}; re-export the bundle")
        try:
            return cls(
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

    @classmethod
    def from_json(cls, text: str, source: str = MANIFEST_NAME) -> Manifest:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise BundleError(f"{source}: not valid JSON ({exc}); the bundle is damaged, re-export it") from exc
        return cls.from_dict(d, source)
