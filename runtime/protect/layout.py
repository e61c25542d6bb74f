"""The block layout of a protected bundle's weights: keys, block membership, syndromes, tolerances.

A *protected* bundle (``manifest.extra["robust"]``, written by ``closedloop.sdk.robust``) holds
weights whose every block of ``k`` satisfies two linear constraints, with no extra
parameters stored: the block sum is zero and the index-weighted sum is zero. A fault
that changes one member ``p`` by ``d`` shows as syndromes ``S0 = d`` and ``S1 = p d``,
so ``S1 / S0`` names the member and the other members give back its value. Block
membership can be keyed: a secret key (never in the bundle; the manifest keeps only an
HMAC fingerprint of it) seeds a permutation of each tensor's elements into blocks.

This module is shared by the export side (``closedloop.sdk.robust`` writes the layout) and the
runtime side (``closedloop.runtime.protect.scrubber`` rebuilds it to check and repair the weights, and
re-exports everything here). No torch, and numba only when a keyed layout is built.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from closedloop.runtime.protect.kernels import kernels

ROBUST_EXTRA = "robust"
LAYOUT_VERSION = 1
KEY_ENV = "CLOSEDLOOP_WEIGHTS_KEY"  # hex
KEY_FILE_ENV = "CLOSEDLOOP_WEIGHTS_KEY_FILE"
MIN_BLOCK = 3  # two constraints need at least three members to leave any freedom


class ScrubError(RuntimeError):
    """The scrubber cannot run (key missing or wrong, layout unreadable)."""


class WeightsCorruptedError(ScrubError):
    """Weights hold faults the scrubber cannot repair (several in one block)."""


# --- keys and layout -------------------------------------------------------------------


def key_fingerprint(key: bytes) -> str:
    """HMAC-SHA256 of a fixed string under ``key`` (first 16 hex digits): names the key, does not reveal it."""
    return hmac.new(key, b"closedloop.robust.v1/fingerprint", hashlib.sha256).hexdigest()[:16]


def read_key(key: bytes | str | None = None, key_file: str | Path | None = None) -> bytes | None:
    """The weights key from an argument (bytes, or hex text), a key file, or the environment, in that order.

    A key file holds hex text (surrounding whitespace and a final newline ignored) or, if its content is not hex,
    the raw key bytes exactly as stored (not stripped: a raw key may end in a byte that looks like whitespace).
    ``$CLOSEDLOOP_WEIGHTS_KEY_FILE`` comes before ``$CLOSEDLOOP_WEIGHTS_KEY`` (hex)."""
    if key is not None:
        return key if isinstance(key, bytes) else _hex_key(key, "the weights key")
    key_file = key_file or os.environ.get(KEY_FILE_ENV)
    if key_file:
        data = Path(key_file).read_bytes()
        try:
            return bytes.fromhex(data.decode("ascii").strip())
        except (UnicodeDecodeError, ValueError):
            return data
    env = os.environ.get(KEY_ENV)
    return _hex_key(env, f"${KEY_ENV}") if env else None


def _hex_key(text: str, where: str) -> bytes:
    try:
        return bytes.fromhex(text.strip())
    except ValueError:
        raise ScrubError(f"{where} is not hex ({len(text.strip())} characters): give the key as hex digits (64 for a "
                         "32-byte key), or its raw bytes in a key file (--weights-key-file)") from None


def block_positions(n: int, k: int, key: bytes | None = None, name: str = "", window: int = 4096,
                    min_last: int = MIN_BLOCK) -> np.ndarray:
    """Block membership of a tensor of ``n`` elements: ``(blocks, k)`` flat indices, ``-1`` padding.

    Unkeyed, block ``b`` is elements ``b*k .. b*k+k-1`` of the flattened tensor. Keyed, the
    elements are first permuted inside windows of ``window`` (a multiple of ``k``, which keeps
    a block's members close in memory) by a permutation seeded from HMAC(key, name). A last
    block of fewer than ``min_last`` members is left out (a constrained block needs three to
    leave any freedom; a guarded block, whose sums are stored, can have one).
    """
    if window % k:
        raise ValueError(f"window {window} must be a multiple of the block size k={k}")
    if key is None:
        perm = np.arange(n, dtype=np.int64)
    else:
        seed = hmac.new(key, b"closedloop.robust.v1/perm/" + name.encode(), hashlib.sha256).digest()[:8]
        perm = kernels()["permutation"](n, window, np.uint64(int.from_bytes(seed, "little")))
    nb = -(-n // k)
    pos: np.ndarray = np.full(nb * k, -1, dtype=np.int64)
    pos[:n] = perm
    pos = pos.reshape(nb, k)
    if nb and n - (nb - 1) * k < min_last:
        pos = pos[:-1]
    return pos


def tail_positions(n: int, k: int, key: bytes | None = None, name: str = "", window: int = 4096) -> np.ndarray | None:
    """The members of a constrained tensor's last block when it is too small to constrain (1 or 2 of ``n mod k``,
    left out by ``block_positions``): ``(1, k)`` flat indices, ``-1`` padding, in the keyed order, or None where
    there is no such tail. Its clean sums are stored (``precisions[p]["tail"]``), as a guarded block's are."""
    if not 0 < n % k < MIN_BLOCK:  # no last row that block_positions drops
        return None
    return block_positions(n, k, key, name, window, min_last=1)[-1:]


def syndromes(values: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-block ``(S0, S1)`` in float64 (``values`` flat, ``pos`` from ``block_positions``)."""
    v = np.where(pos >= 0, np.asarray(values).reshape(-1)[np.maximum(pos, 0)].astype(np.float64), 0.0)
    j = np.arange(pos.shape[1], dtype=np.float64)
    return v.sum(axis=1), v @ j


def tolerances(values: np.ndarray, pos: np.ndarray) -> tuple[float, float]:
    """Check thresholds of a clean float tensor: twice its largest clean syndromes, with a floor
    covering float64 re-association (so a clean block never trips the check); 0 for integers."""
    if np.asarray(values).dtype.kind in "iu":
        return 0.0, 0.0
    s0, s1 = syndromes(values, pos)
    k = pos.shape[1]
    top = float(np.max(np.abs(values))) if np.size(values) else 0.0
    floor = 64.0 * k * 2.0**-52 * top * k
    return max(2.0 * float(np.max(np.abs(s0), initial=0.0)), floor), max(2.0 * float(np.max(np.abs(s1), initial=0.0)), floor * k)


# --- guarded tensors: stored block sums -----------------------------------------------------
#
# Biases, a GRU's joined bias, int8 scales and other small tensors are not constrained (a
# constraint on them costs accuracy, and a GRU's bias pair is one initializer made of two
# parameters). They are *guarded* instead: the same blocks and syndromes, but the two sums of
# each clean block are stored in the manifest (``precisions[p]["guard"]``), so a single flip
# gives ``S0 - R0 = d`` and ``S1 - R1 = p d`` and is located and undone exactly as for a
# constrained block. Storage: two float64 per block of ``k`` (1 byte per weight at k = 16,
# base64 in the manifest, which the bundle's checksums and signature cover).


def guard_tolerance(values: np.ndarray, k: int) -> tuple[float, float]:
    """Check thresholds of a guarded tensor: the stored sums are exact up to float64 re-association
    (the kernel sums in member order), so only that floor; 0 for integers."""
    a = np.asarray(values)
    if a.dtype.kind in "iu" or not a.size:
        return 0.0, 0.0
    with np.errstate(all="ignore"):
        top = float(np.max(np.abs(a.astype(np.float64))))
    t0 = 64.0 * k * 2.0**-52 * top * k
    return t0, t0 * k


def guard_positions(n: int, k: int, key: bytes | None, name: str, window: int) -> np.ndarray:
    """Block membership of a guarded tensor (as ``block_positions``, a last block of any size kept)."""
    return block_positions(n, k, key, name, window, min_last=1)


def guard_record(values: np.ndarray, k: int, key: bytes | None, name: str, window: int) -> dict[str, Any]:
    """The manifest record of one guarded tensor: shape, dtype, tolerances and the clean block sums."""
    a = np.asarray(values)
    pos = guard_positions(a.size, k, key, name, window)
    s0, s1 = syndromes(a, pos)
    sums = np.ascontiguousarray(np.stack([s0, s1], axis=1), dtype="<f8")
    return {"shape": list(a.shape), "dtype": str(a.dtype), "tolerance": list(guard_tolerance(a, k)),
            "sums": base64.b64encode(sums.tobytes()).decode("ascii")}


def guard_sums(record: dict[str, Any]) -> np.ndarray:
    """``(blocks, 2)`` stored clean sums of a guard record."""
    return np.frombuffer(base64.b64decode(record["sums"]), dtype="<f8").reshape(-1, 2).astype(np.float64)


def guardable(values: np.ndarray) -> bool:
    """Whether an initializer is a weight a memory fault can hit and a guard can check (float or int8)."""
    a = np.asarray(values)
    return a.size > 0 and (a.dtype.kind == "f" or a.dtype == np.int8)


@dataclass
class ProtectionLayout:
    """What ``manifest.extra["robust"]`` says: block size, keying, tensors and per-precision checks."""

    k: int
    window: int
    keyed: bool
    key_fingerprint: str | None
    tensors: dict[str, list[int]]  # fp32 initializer name -> shape
    precisions: dict[str, dict[str, Any]]  # "fp32"/"fp16"/"int8" -> {"file", "dtype", "names", "tolerance"}
    version: int = LAYOUT_VERSION
    notes: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_manifest(cls, manifest: Any) -> ProtectionLayout | None:
        d = manifest.extra.get(ROBUST_EXTRA)
        if d is None:
            return None
        if d.get("version") != LAYOUT_VERSION:
            raise ScrubError(f"robust layout version {d.get('version')!r}; this runtime reads {LAYOUT_VERSION}")
        return cls(**{k: d[k] for k in ("k", "window", "keyed", "key_fingerprint", "tensors", "precisions")},
                   notes=dict(d.get("notes", {})))

    def check_key(self, key: bytes | None) -> None:
        if not self.keyed:
            return
        if key is None:
            raise ScrubError(f"this bundle's weights are keyed (fingerprint {self.key_fingerprint}); supply the key "
                             f"with --weights-key-file, ${KEY_FILE_ENV} or ${KEY_ENV}, or run without scrubbing "
                             "(--scrub off; SessionConfig(scrub='off'))")
        if key_fingerprint(key) != self.key_fingerprint:
            raise ScrubError(f"the weights key has fingerprint {key_fingerprint(key)}, the bundle was protected with "
                             f"{self.key_fingerprint}; use the key the bundle was exported with")

    def positions(self, name: str, key: bytes | None) -> np.ndarray:
        n = int(np.prod(self.tensors[name]))
        return block_positions(n, self.k, key if self.keyed else None, name, self.window)

    def precision(self, variant: str | None) -> dict[str, Any]:
        p = variant or "fp32"
        if p not in self.precisions:
            raise ScrubError(f"variant {p!r} is not protected; protected precisions: {sorted(self.precisions)}")
        return self.precisions[p]
