"""Weight scrubbing: find, locate and repair single bit flips in a protected bundle's weights.

A *protected* bundle (``manifest.extra["robust"]``, written by ``sdk.robust``) holds
weights whose every block of ``k`` satisfies two linear constraints, with no extra
parameters stored: the block sum is zero and the index-weighted sum is zero. A fault
that changes one member ``p`` by ``d`` shows as syndromes ``S0 = d`` and ``S1 = p d``,
so ``S1 / S0`` names the member and the other members give back its value. Block
membership can be keyed: a secret key (never in the bundle; the manifest keeps only an
HMAC fingerprint of it) seeds a permutation of each tensor's elements into blocks.

This module sits in ``runtime`` (no torch). It rebuilds the block layout from the
manifest and the key, scans blocks with Numba kernels (fp32, fp16 and int8 storage),
repairs a single faulty member per block (only to a value one bit flip away from the
stored word: the fault model is single-event upsets), and reports what it did. It reaches
the weights each backend computes with: the Numba backend's arena in place, or for
ONNX Runtime a host copy of the initializers whose repairs rebuild the session.
``Scrubber.step(budget_ns)`` scrubs round-robin under a time budget (the loop's idle
hook); ``session_scrubber`` wires this into ``runtime.session``. See docs/robustness.md.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

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
    """The weights key from an argument (bytes, or hex text), a key file, or the environment."""
    if key is not None:
        return key if isinstance(key, bytes) else bytes.fromhex(key)
    key_file = key_file or os.environ.get(KEY_FILE_ENV)
    if key_file:
        data = Path(key_file).read_bytes().strip()
        try:
            return bytes.fromhex(data.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            return data
    env = os.environ.get(KEY_ENV)
    return bytes.fromhex(env) if env else None


def _window_permutation(n: int, window: int, seed: np.uint64) -> np.ndarray:
    """Fisher-Yates inside each window of ``window`` elements, driven by splitmix64 (version-stable)."""
    perm = np.arange(n)
    state = np.uint64(seed)
    for start in range(0, n, window):
        size = min(window, n - start)
        for i in range(size - 1, 0, -1):
            state += np.uint64(0x9E3779B97F4A7C15)
            z = state
            z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            z = z ^ (z >> np.uint64(31))
            j = int(z % np.uint64(i + 1))
            a = perm[start + i]
            perm[start + i] = perm[start + j]
            perm[start + j] = a
    return perm


def block_positions(n: int, k: int, key: bytes | None = None, name: str = "", window: int = 4096) -> np.ndarray:
    """Block membership of a tensor of ``n`` elements: ``(blocks, k)`` flat indices, ``-1`` padding.

    Unkeyed, block ``b`` is elements ``b*k .. b*k+k-1`` of the flattened tensor. Keyed, the
    elements are first permuted inside windows of ``window`` (a multiple of ``k``, which keeps
    a block's members close in memory) by a permutation seeded from HMAC(key, name). A last
    block of fewer than three members is left out (unprotected).
    """
    if window % k:
        raise ValueError(f"window {window} must be a multiple of the block size k={k}")
    if key is None:
        perm = np.arange(n, dtype=np.int64)
    else:
        seed = hmac.new(key, b"closedloop.robust.v1/perm/" + name.encode(), hashlib.sha256).digest()[:8]
        perm = _kernels()["permutation"](n, window, np.uint64(int.from_bytes(seed, "little")))
    nb = -(-n // k)
    pos = np.full(nb * k, -1, dtype=np.int64)
    pos[:n] = perm
    pos = pos.reshape(nb, k)
    if nb and n - (nb - 1) * k < MIN_BLOCK:
        pos = pos[:-1]
    return pos


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
                             f"with --weights-key-file, ${KEY_FILE_ENV} or ${KEY_ENV}, or run with scrub='off'")
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


# --- scan kernels ------------------------------------------------------------------------


def _scan_float(buf, pos, seg, tol0, tol1, b0, b1, out):
    """Indices of blocks in [b0, b1) whose syndromes exceed their tensor's tolerances (float32 or int8 words)."""
    n = 0
    k = pos.shape[1]
    for t in range(seg.size - 1):
        a, c = tol0[t], tol1[t]
        for b in range(max(seg[t], b0), min(seg[t + 1], b1)):
            s0 = 0.0
            s1 = 0.0
            for j in range(k):
                p = pos[b, j]
                if p >= 0:
                    v = float(buf[p])
                    s0 += v
                    s1 += j * v
            if not (abs(s0) <= a and abs(s1) <= c):  # NaN fails too
                if n < out.size:
                    out[n] = b
                n += 1
    return n


def _scan_half(words, table, pos, seg, tol0, tol1, b0, b1, out):
    """``_scan_float`` for float16 weights read as uint16 words, decoded through a 65536-entry table."""
    n = 0
    k = pos.shape[1]
    for t in range(seg.size - 1):
        a, c = tol0[t], tol1[t]
        for b in range(max(seg[t], b0), min(seg[t + 1], b1)):
            s0 = 0.0
            s1 = 0.0
            for j in range(k):
                p = pos[b, j]
                if p >= 0:
                    v = float(table[words[p]])
                    s0 += v
                    s1 += j * v
            if not (abs(s0) <= a and abs(s1) <= c):
                if n < out.size:
                    out[n] = b
                n += 1
    return n


_KERNELS: dict = {}


def _kernels() -> dict:
    """The Numba-compiled kernels, compiled (or loaded from cache) on first use: importing the runtime
    must not import numba (which pulls in scipy) until a kernel is needed."""
    if not _KERNELS:
        from numba import njit

        _KERNELS["permutation"] = njit(cache=True)(_window_permutation)
        _KERNELS["float"] = njit(cache=True, nogil=True)(_scan_float)
        _KERNELS["half"] = njit(cache=True, nogil=True)(_scan_half)
    return _KERNELS


_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


# --- targets and the scrubber ----------------------------------------------------------


@dataclass
class ScrubEvent:
    """One block the scrubber found faulty, and what it did."""

    target: str
    tensor: str
    block: int
    status: str  # "repaired", "unrepairable", "restored" (from the last-good copy)
    member: int = -1
    index: int = -1  # flat index in the tensor (ONNX layout)
    old: float = float("nan")
    new: float = float("nan")
    bit: int = -1

    def format(self) -> str:
        if self.status == "repaired":
            return (f"{self.target}: {self.tensor} block {self.block} member {self.member} (element {self.index}): "
                    f"{self.old:.6g} -> {self.new:.6g} (bit {self.bit}) repaired")
        return f"{self.target}: {self.tensor} block {self.block}: {self.status}"


class ScrubTarget:
    """One memory the scrubber checks: a flat buffer, block positions into it, per-tensor tolerances.

    ``push(names)`` carries repaired tensors to a backend that keeps its own copy (ORT).
    """

    def __init__(self, name: str, buf: np.ndarray, blocks: list[tuple[str, np.ndarray, np.ndarray, float, float]],
                 push=None):
        self.name, self.buf, self.push = name, buf, push
        self.tensors = [b[0] for b in blocks]
        self.pos = np.ascontiguousarray(np.concatenate([b[1] for b in blocks]) if blocks else np.zeros((0, 1), np.int64))
        self.local = np.concatenate([b[2] for b in blocks]) if blocks else np.zeros((0, 1), np.int64)
        counts = [len(b[1]) for b in blocks]
        self.seg = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.tol0 = np.array([b[3] for b in blocks], dtype=np.float64)
        self.tol1 = np.array([b[4] for b in blocks], dtype=np.float64)
        self.words = buf.view(_UINT[buf.dtype.itemsize])
        self._half = buf.dtype == np.float16
        if self._half:
            self._table = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
        self.last_good: np.ndarray | None = None

    @property
    def n_blocks(self) -> int:
        return int(self.seg[-1])

    def scan(self, b0: int, b1: int, out: np.ndarray) -> int:
        if self._half:
            return int(_kernels()["half"](self.words, self._table, self.pos, self.seg, self.tol0, self.tol1, b0, b1, out))
        return int(_kernels()["float"](self.buf, self.pos, self.seg, self.tol0, self.tol1, b0, b1, out))

    def tensor_of(self, b: int) -> int:
        return int(np.searchsorted(self.seg, b, side="right") - 1)

    def repair(self, b: int) -> ScrubEvent | None:
        """Locate and repair the single faulty member of block ``b``; ``None`` if the block is clean now."""
        t = self.tensor_of(b)
        t0, t1 = self.tol0[t], self.tol1[t]
        sel = self.pos[b] >= 0
        idx = self.pos[b][sel]
        raw = self.buf[idx]
        with np.errstate(all="ignore"):
            v = raw.astype(np.float64)
            m = v.size
            j = np.arange(m, dtype=np.float64)
            s0, s1 = v.sum(), v @ j
            ev = ScrubEvent(self.name, self.tensors[t], b, "unrepairable")
            if abs(s0) <= t0 and abs(s1) <= t1:
                return None
            # For each member p: the value the others imply, and whether the block then holds.
            others = np.tile(v, (m, 1))
            np.fill_diagonal(others, 0.0)
            est = -others.sum(axis=1)
            s1p = others @ j + j * est
            ok = np.isfinite(est) & (np.abs(s1p) <= t1 + j * t0)
        found = []
        for p in np.flatnonzero(ok):
            hit = self._one_bit(raw[p], est[p], t0)
            if hit is not None:
                found.append((abs(s1p[p]) / (t1 + p * t0 + 1e-300), int(p), *hit))
        if not found:
            return ev
        # Several members can explain a change barely above the tolerance; the one whose repair leaves
        # the smallest index-weighted residual is taken (a large fault leaves only the true member).
        _, p, word, bit = min(found, key=lambda f: f[0])
        ev.member, ev.index, ev.bit = p, int(self.local[b][sel][p]), bit
        ev.old = float(v[p])
        self.words[idx[p]] = word
        ev.new = float(self.buf[idx[p]])
        ev.status = "repaired"
        return ev

    def _one_bit(self, x, target: float, tol: float):
        """The single-bit change of word ``x`` closest to ``target``, if within ``tol``."""
        ut = _UINT[self.buf.dtype.itemsize]
        w = np.array([x], dtype=self.buf.dtype).view(ut)[0]
        cands = np.bitwise_xor(w, (np.ones(1, ut) << np.arange(8 * self.buf.itemsize, dtype=ut)))
        with np.errstate(all="ignore"):
            err = np.abs(cands.view(self.buf.dtype).astype(np.float64) - target)
        err[~np.isfinite(err)] = np.inf
        bit = int(np.argmin(err))
        if err[bit] <= tol:
            return cands[bit], bit
        return None

    def keep_last_good(self) -> None:
        self.last_good = self.buf.copy()

    def restore(self, b: int) -> bool:
        """Copy block ``b`` back from the last-good copy, if one is kept and that copy's block holds."""
        if self.last_good is None:
            return False
        idx = self.pos[b][self.pos[b] >= 0]
        good = self.last_good[idx].astype(np.float64)
        t = self.tensor_of(b)
        j = np.arange(good.size)
        if not (abs(good.sum()) <= self.tol0[t] and abs(good @ j) <= self.tol1[t]):
            return False
        self.buf[idx] = self.last_good[idx]
        return True


@dataclass
class ScrubStats:
    blocks: int = 0
    blocks_checked: int = 0
    full_passes: int = 0
    repaired: int = 0
    restored: int = 0
    unrepairable: int = 0
    full_scrub_us: float = float("nan")
    ns_per_block: float = float("nan")
    budget_us: float = float("nan")
    events: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Scrubber:
    """Check and repair every block of one or more targets; round-robin under a time budget."""

    def __init__(self, targets: list[ScrubTarget], max_events: int = 4096, keep_events: int = 100):
        self.targets = [t for t in targets if t.n_blocks]
        self._out = np.zeros(max_events, dtype=np.int64)
        self._cursor = (0, 0)
        self.keep_events = keep_events
        self.stats = ScrubStats(blocks=sum(t.n_blocks for t in self.targets))
        self.events: list[ScrubEvent] = []

    def _handle(self, target: ScrubTarget, flagged: np.ndarray, restore: bool) -> list[ScrubEvent]:
        events, pushed = [], set()
        for b in flagged:
            ev = target.repair(int(b))
            if ev is None:
                continue
            if ev.status != "repaired" and restore and target.restore(int(b)):
                ev.status = "restored"
            events.append(ev)
            if ev.status != "unrepairable":
                pushed.add(ev.tensor)
        for ev in events:
            setattr(self.stats, ev.status, getattr(self.stats, ev.status) + 1)
            if len(self.stats.events) < self.keep_events:
                self.stats.events.append(ev.format())
        if pushed and target.push is not None:
            target.push(sorted(pushed))
        self.events += events
        return events

    def scrub_range(self, target: ScrubTarget, b0: int, b1: int, restore: bool = True) -> list[ScrubEvent]:
        events: list[ScrubEvent] = []
        while b0 < b1:
            n = target.scan(b0, b1, self._out)
            self.stats.blocks_checked += b1 - b0
            if n == 0:
                break
            flagged = self._out[: min(n, self._out.size)].copy()
            events += self._handle(target, flagged, restore)
            if n <= self._out.size:
                break
            b0 = int(flagged[-1]) + 1  # more faults than the event buffer holds: go on after the last one
        return events

    def scrub_all(self, restore: bool = True) -> list[ScrubEvent]:
        """Check every block of every target once; repair what can be repaired."""
        t0 = time.perf_counter_ns()
        events = []
        for t in self.targets:
            events += self.scrub_range(t, 0, t.n_blocks, restore)
        self.stats.full_passes += 1
        if not events:
            self.stats.full_scrub_us = (time.perf_counter_ns() - t0) / 1e3
        return events

    def calibrate(self, reps: int = 3) -> float:
        """Time a clean full pass (best of ``reps``); sets ``ns_per_block`` for ``step``."""
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter_ns()
            for t in self.targets:
                t.scan(0, t.n_blocks, self._out)
            best = min(best, time.perf_counter_ns() - t0)
        self.stats.full_scrub_us = best / 1e3
        self.stats.ns_per_block = best / max(1, self.stats.blocks)
        return self.stats.full_scrub_us

    def step(self, budget_ns: int, restore: bool = True) -> list[ScrubEvent]:
        """Scrub as many blocks as fit in ``budget_ns`` (from the calibrated cost), continuing round-robin."""
        if not self.targets:
            return []
        if not self.stats.ns_per_block == self.stats.ns_per_block:  # NaN: not calibrated yet
            self.calibrate()
        n = max(1, int(budget_ns / max(self.stats.ns_per_block, 1e-3)))
        ti, b = self._cursor
        events: list[ScrubEvent] = []
        while n > 0:
            t = self.targets[ti]
            hi = min(t.n_blocks, b + n)
            events += self.scrub_range(t, b, hi, restore)
            n -= hi - b
            b = hi
            if b >= t.n_blocks:
                ti, b = ti + 1, 0
                if ti == len(self.targets):
                    ti = 0
                    self.stats.full_passes += 1
                    break
        self._cursor = (ti, b)
        return events

    def keep_last_good(self) -> None:
        for t in self.targets:
            t.keep_last_good()


# --- reaching a model's weights ---------------------------------------------------------


def _host_target(model: Any, layout: ProtectionLayout, prec: dict, key: bytes | None) -> ScrubTarget:
    """A host copy of the protected initializers (one flat buffer); repairs rebuild the backend's weights."""
    inits = model.bundle.onnx(model.graph_name, model.variant).initializers
    names = [(t, prec["names"][t]) for t in layout.tensors if t in prec["names"]]
    dtype = np.dtype(prec["dtype"])
    sizes = [inits[o].size for _, o in names]
    buf = np.zeros(int(sum(sizes)), dtype=dtype)
    views, blocks, off = {}, [], 0
    for (t, o), n in zip(names, sizes, strict=True):
        buf[off: off + n] = inits[o].reshape(-1)
        views[o] = buf[off: off + n].reshape(inits[o].shape)
        pos = layout.positions(t, key)
        blocks.append((t, np.where(pos >= 0, pos + off, -1), pos, *prec["tolerance"][t]))
        off += n

    def push(tensors: list[str]) -> None:
        model.backend.set_initializers({prec["names"][t]: views[prec["names"][t]] for t in tensors})

    model.backend.set_initializers(views)  # the backend now runs on exactly the copy that is checked
    return ScrubTarget(f"{model.backend_name} (host copy)", buf, blocks, push)


def _arena_target(model: Any, layout: ProtectionLayout, prec: dict, key: bytes | None) -> ScrubTarget | None:
    """The Numba backend's own arena, checked and repaired in place (no rebuild)."""
    names = [prec["names"][t] for t in layout.tensors if t in prec["names"]]
    arena, where = model.backend.weight_locations(names)
    blocks = []
    for t in layout.tensors:
        o = prec["names"].get(t)
        if o is None or np.any(where[o] < 0):
            return None  # a tensor the kernels do not hold as a plain copy: fall back to the host copy
        pos = layout.positions(t, key)
        blocks.append((t, np.where(pos >= 0, where[o].reshape(-1)[np.maximum(pos, 0)], -1), pos, *prec["tolerance"][t]))
    return ScrubTarget("numba (arena)", arena, blocks)


def attach_scrubber(model: Any, key: bytes | None = None, scrub_at_load: bool = True,
                    keep_last_good: bool = True) -> Scrubber | None:
    """A scrubber over the weights ``model`` computes with, or ``None`` if its bundle is not protected.

    At load it checks every block and repairs what it can; faults it cannot repair raise
    ``WeightsCorruptedError`` (no last-good copy exists yet). Then, with ``keep_last_good``,
    it keeps a copy that later unrepairable blocks are restored from.
    """
    layout = ProtectionLayout.from_manifest(model.bundle.manifest)
    if layout is None:
        return None
    layout.check_key(key)
    prec = layout.precision(model.variant)
    target = None
    if hasattr(model.backend, "weight_locations"):
        target = _arena_target(model, layout, prec, key)
    if target is None:
        try:
            target = _host_target(model, layout, prec, key)
        except NotImplementedError as exc:
            raise ScrubError(f"backend {model.backend_name!r} cannot take repaired weights: {exc}") from exc
    scrubber = Scrubber([target])
    if scrub_at_load:
        events = scrubber.scrub_all(restore=False)
        bad = [e for e in events if e.status == "unrepairable"]
        if bad:
            raise WeightsCorruptedError(
                f"{len(bad)} block(s) hold faults that cannot be repaired (several per block), e.g. "
                + "; ".join(e.format() for e in bad[:3]) + "; restore the bundle from a good copy")
    scrubber.calibrate()
    if keep_last_good:
        scrubber.keep_last_good()
    return scrubber


class SessionScrubber:
    """The session's side: scrub in idle time under a budget, act on unrepairable blocks by policy.

    ``policy="fallback"`` restores such blocks from the last-good copy (and stops only if
    that copy is bad too); ``"stop"`` makes the session send its safe output and stop.
    """

    def __init__(self, scrubber: Scrubber, budget_us: float, policy: str):
        if policy not in ("stop", "fallback"):
            raise ValueError(f"scrub policy {policy!r} must be 'stop' or 'fallback'")
        self.scrubber, self.budget_ns, self.policy = scrubber, int(budget_us * 1000), policy
        scrubber.stats.budget_us = budget_us

    def on_idle(self, budget_ns: int, event=None) -> str | None:
        """Scrub within ``min(budget_ns, the stated budget)``; return ``"stop"`` when the session must stop."""
        events = self.scrubber.step(min(budget_ns, self.budget_ns), restore=self.policy == "fallback")
        stop = False
        for e in events:
            if event is not None:
                event("weights_" + e.status, **asdict(e))
            stop |= e.status == "unrepairable"
        return "stop" if stop else None

    def summary(self) -> dict[str, Any]:
        return self.scrubber.stats.to_dict() | {"policy": self.policy}


def session_scrubber(model: Any, config: Any) -> SessionScrubber | None:
    """Build the session's scrubber from ``SessionConfig`` (``scrub``, ``scrub_budget_us``, ``scrub_policy``,
    ``weights_key_file``); ``None`` when scrubbing is off or the bundle is not protected."""
    if getattr(config, "scrub", "auto") == "off":
        return None
    key = read_key(key_file=getattr(config, "weights_key_file", None))
    scrubber = attach_scrubber(model, key=key, keep_last_good=config.scrub_policy == "fallback")
    if scrubber is None:
        return None
    return SessionScrubber(scrubber, config.scrub_budget_us, config.scrub_policy)
