"""Weight scrubbing: find, locate and repair single bit flips in a protected bundle's weights.

A protected bundle's weights sit in blocks whose sum and index-weighted sum are zero
(``closedloop.runtime.protect.layout``: keys, block membership, syndromes, tolerances; re-exported
here), so a single fault in a block names its member and the other members give back
its value. This module sits in ``runtime`` (no torch). It scans blocks with Numba
kernels (``closedloop.runtime.protect.kernels``; fp32, fp16 and int8 storage), repairs a single
faulty member per block (only to a value one bit flip away from the stored word: the
fault model is single-event upsets), and reports what it did. It reaches the weights
each backend computes with: the Numba backend's arena in place, or for ONNX Runtime a
host copy of the initializers whose repairs rebuild the session.
``Scrubber.step(budget_ns)`` scrubs round-robin under a time budget (the loop's idle
hook); ``session_scrubber`` wires this into ``closedloop.runtime.session``. See docs/robustness.md.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from closedloop.runtime.protect.kernels import kernels
from closedloop.runtime.protect.layout import (
    KEY_ENV,
    KEY_FILE_ENV,
    LAYOUT_VERSION,
    MIN_BLOCK,
    ROBUST_EXTRA,
    ProtectionLayout,
    ScrubError,
    WeightsCorruptedError,
    block_positions,
    key_fingerprint,
    read_key,
    syndromes,
    tolerances,
)

__all__ = [
    "KEY_ENV", "KEY_FILE_ENV", "LAYOUT_VERSION", "MIN_BLOCK", "ROBUST_EXTRA", "ProtectionLayout", "ScrubError",
    "WeightsCorruptedError", "block_positions", "key_fingerprint", "read_key", "syndromes", "tolerances",
    "ScrubEvent", "ScrubTarget", "ScrubStats", "Scrubber", "attach_scrubber", "SessionScrubber", "session_scrubber",
]

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
        # float16 is scanned as uint16 words through a decode table; other dtypes as they are (empty table)
        if buf.dtype == np.float16:
            self._scan_words = self.words
            self._table = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
        else:
            self._scan_words, self._table = buf, np.zeros(0, dtype=np.float32)
        self.last_good: np.ndarray | None = None

    @property
    def n_blocks(self) -> int:
        return int(self.seg[-1])

    def scan(self, b0: int, b1: int, out: np.ndarray) -> int:
        return int(kernels()["scan"](self._scan_words, self._table, self.pos, self.seg, self.tol0, self.tol1, b0, b1,
                                     out))

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
