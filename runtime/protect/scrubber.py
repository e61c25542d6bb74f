"""Weight scrubbing: find, locate and repair single bit flips in a protected bundle's weights.

A protected bundle's weights sit in blocks whose sum and index-weighted sum are zero
(``closedloop.runtime.protect.layout``: keys, block membership, syndromes, tolerances; re-exported
here), so a single fault in a block names its member and the other members give back
its value. This module sits in ``runtime`` (no torch). It scans blocks with Numba
kernels (``closedloop.runtime.protect.kernels``; fp32, fp16 and int8 storage), repairs a single
faulty member per block (only to a value one bit flip away from the stored word: the
fault model is single-event upsets), and reports what it did. A repair is *verified*: it is
made only when exactly one single-bit change of one member restores both sums, and the
block is re-read afterwards; a fault that two such changes would explain (small changes of
the tolerance's size can alias) is reported as ambiguous, never guessed: the session's
policy restores the block from its last-good copy, and at load, where there is none yet,
it is left as found (a change of the tolerance's size) and checked from then on against
its present sums. Tensors that carry no
constraint (biases, a GRU's joined bias, int8 scales) are *guarded*: their clean block sums
are stored in the manifest and checked the same way. It reaches the weights
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
    guard_positions,
    guard_record,
    guard_sums,
    guardable,
    key_fingerprint,
    read_key,
    syndromes,
    tail_positions,
    tolerances,
)

__all__ = [
    "KEY_ENV", "KEY_FILE_ENV", "LAYOUT_VERSION", "MIN_BLOCK", "ROBUST_EXTRA", "ProtectionLayout", "ScrubError",
    "WeightsCorruptedError", "block_positions", "guard_positions", "guard_record", "guard_sums", "key_fingerprint",
    "read_key", "syndromes", "tail_positions", "tolerances",
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
    # "repaired" (verified), "restored" (from the last-good copy), "unrepairable", or "ambiguous" (left as found:
    # two single-bit repairs would explain it; only at load, where no last-good copy exists yet)
    status: str
    member: int = -1
    index: int = -1  # flat index in the tensor (ONNX layout)
    old: float = float("nan")
    new: float = float("nan")
    bit: int = -1
    reason: str = ""  # why a block was not repaired (several faults, ambiguous, not verified)
    ambiguous: bool = False  # several single-bit repairs would explain the block's sums

    def format(self) -> str:
        if self.status == "repaired":
            return (f"{self.target}: {self.tensor} block {self.block} member {self.member} (element {self.index}): "
                    f"{self.old:.6g} -> {self.new:.6g} (bit {self.bit}) repaired, verified")
        what = {"ambiguous": "NOT repaired, left as found", "restored": "restored from the last-good copy"}
        why = f" ({self.reason})" if self.reason else ""
        return f"{self.target}: {self.tensor} block {self.block}: {what.get(self.status, self.status)}{why}"


class ScrubTarget:
    """One memory the scrubber checks: a flat buffer, block positions into it, per-tensor tolerances.

    ``blocks`` holds one entry per tensor: ``(name, positions in buf, positions in the tensor, t0, t1)``
    for a constrained tensor (both sums zero), with a sixth item, the ``(blocks, 2)`` stored clean
    sums, for a guarded one, and a seventh, how many of its blocks are guarded (default all of them with sums):
    a constrained tensor's tail of 1 or 2 members is a guarded last block beside its zero-sum ones. ``push(names)`` carries repaired tensors to a backend that keeps its
    own copy (ORT).
    """

    def __init__(self, name: str, buf: np.ndarray, blocks: list[tuple], push=None):
        self.name, self.buf, self.push = name, buf, push
        self.tensors = [b[0] for b in blocks]
        refs = [np.asarray(b[5], dtype=np.float64).reshape(-1, 2) if len(b) > 5 and b[5] is not None
                else np.zeros((len(b[1]), 2)) for b in blocks]
        for b, r in zip(blocks, refs, strict=True):
            if len(r) != len(b[1]):
                raise ScrubError(f"{b[0]}: {len(r)} stored block sums for {len(b[1])} blocks; the guard record does "
                                 "not match the tensor")
        ref = np.concatenate(refs) if refs else np.zeros((0, 2))
        self.ref0, self.ref1 = np.ascontiguousarray(ref[:, 0]), np.ascontiguousarray(ref[:, 1])
        # blocks with stored sums per tensor (a constrained tensor's guarded tail counts one)
        self.guarded = [b[6] if len(b) > 6 else (len(b[1]) if len(b) > 5 and b[5] is not None else 0) for b in blocks]
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
        return int(kernels()["scan"](self._scan_words, self._table, self.pos, self.seg, self.tol0, self.tol1,
                                     self.ref0, self.ref1, b0, b1, out))

    def tensor_of(self, b: int) -> int:
        return int(np.searchsorted(self.seg, b, side="right") - 1)

    def _value(self, word) -> float:
        return float(np.array([word], dtype=self.words.dtype).view(self.buf.dtype)[0])

    def _holds(self, v: np.ndarray, t: int, b: int, clean: bool = False) -> bool:
        """Whether block values ``v`` (float64, member order) keep both sums within the tensor's tolerances.

        ``clean=True`` asks for what a clean block satisfies: the tolerances are twice the largest
        clean sums measured at export (or a floor above them), so a clean block's sums are within
        half of them (plus the rounding of summing in another order). A repair must meet this.
        """
        j = np.arange(v.size, dtype=np.float64)
        with np.errstate(all="ignore"):
            s0, s1 = v.sum() - self.ref0[b], v @ j - self.ref1[b]
            if not clean:
                return bool(abs(s0) <= self.tol0[t] and abs(s1) <= self.tol1[t])
            a = np.abs(v)
            r0, r1 = 4.0 * v.size * 2.0**-52 * a.sum(), 4.0 * v.size * 2.0**-52 * (a @ j)
            return bool(abs(s0) <= 0.5 * self.tol0[t] + r0 and abs(s1) <= 0.5 * self.tol1[t] + r1)

    def repair(self, b: int) -> ScrubEvent | None:
        """Locate and repair the single faulty member of block ``b``; ``None`` if the block is clean now.

        The repair is made only when it is certain and verified: exactly one single-bit change of one
        member brings both sums back within what a clean block satisfies (several such changes:
        ``ambiguous``, left as found), and the block, re-read from memory afterwards, holds with the
        word one bit away from the one found. Otherwise the event is "unrepairable" with its reason.
        """
        t = self.tensor_of(b)
        t0, t1 = self.tol0[t], self.tol1[t]
        r0, r1 = self.ref0[b], self.ref1[b]
        sel = self.pos[b] >= 0
        idx = self.pos[b][sel]
        local = self.local[b][sel]
        raw = self.buf[idx].copy()
        with np.errstate(all="ignore"):
            v = raw.astype(np.float64)
            if self._holds(v, t, b):
                return None
            m = v.size
            j = np.arange(m, dtype=np.float64)
            # For each member p: the value the others imply, and whether the block then holds.
            others = np.tile(v, (m, 1))
            np.fill_diagonal(others, 0.0)
            est = r0 - others.sum(axis=1)
            s1p = others @ j + j * est - r1
            ok = np.isfinite(est) & (np.abs(s1p) <= t1 + j * t0)
        ev = ScrubEvent(self.name, self.tensors[t], b, "unrepairable")
        found = []  # (member, word, bit): single-bit changes after which both sums hold
        for p in np.flatnonzero(ok):
            for word, bit in self._one_bit(raw[p], est[p], t0):
                trial = v.copy()
                trial[p] = self._value(word)
                if np.isfinite(trial[p]) and self._holds(trial, t, b, clean=True):
                    found.append((int(p), word, bit))
        if not found:
            ev.reason = "no single-bit change of one member restores both sums: several faults"
            return ev
        if len(found) > 1:
            # A change of the tolerance's size can alias: two members (or two bits) explain it equally.
            # Guessing would put a second wrong weight beside the first; say what it is instead.
            ev.ambiguous = True
            ev.reason = ("ambiguous: " + " or ".join(f"element {int(local[q])} bit {c}" for q, _, c in found[:4])
                         + (f" (+{len(found) - 4})" if len(found) > 4 else "")
                         + f" would each restore both sums; block sum off by {abs(v.sum() - r0):.2g}")
            return ev
        m, word, bit = found[0]
        before = self.words[idx[m]]
        self.words[idx[m]] = word
        after = self.words[idx[m]]
        # Verify in memory: one bit changed, and the block as it now reads holds both sums.
        one_bit = bin(int(before ^ after)).count("1") == 1
        if not (one_bit and self._holds(self.buf[idx].astype(np.float64), t, b, clean=True)):
            self.words[idx[m]] = before
            ev.reason = "the repair did not verify; left as found"
            return ev
        ev.member, ev.index, ev.bit = m, int(local[m]), bit
        ev.old, ev.new = float(v[m]), float(self.buf[idx[m]])
        ev.status = "repaired"
        return ev

    def _one_bit(self, x, target: float, tol: float) -> list:
        """Every single-bit change of word ``x`` whose value is within ``tol`` of ``target``: ``[(word, bit)]``."""
        ut = _UINT[self.buf.dtype.itemsize]
        w = np.array([x], dtype=self.buf.dtype).view(ut)[0]
        cands = np.bitwise_xor(w, (np.ones(1, ut) << np.arange(8 * self.buf.itemsize, dtype=ut)))
        with np.errstate(all="ignore"):
            err = np.abs(cands.view(self.buf.dtype).astype(np.float64) - target)
        err[~np.isfinite(err)] = np.inf
        return [(cands[bit], int(bit)) for bit in np.flatnonzero(err <= tol)]

    def accept(self, b: int) -> None:
        """Check block ``b`` from now on against its present sums (an ambiguous block left as found)."""
        t = self.tensor_of(b)
        v = self.buf[self.pos[b][self.pos[b] >= 0]].astype(np.float64)
        self.ref0[b], self.ref1[b] = v.sum(), v @ np.arange(v.size, dtype=np.float64)
        if not self._holds(v, t, b):  # cannot happen for finite values; never accept a block that still trips
            raise ScrubError(f"{self.tensors[t]} block {b}: cannot be accepted as found")

    def keep_last_good(self) -> None:
        self.last_good = self.buf.copy()

    def restore(self, b: int) -> bool:
        """Copy block ``b`` back from the last-good copy, if one is kept and that copy's block holds."""
        if self.last_good is None:
            return False
        idx = self.pos[b][self.pos[b] >= 0]
        if not self._holds(self.last_good[idx].astype(np.float64), self.tensor_of(b), b):
            return False
        self.buf[idx] = self.last_good[idx]
        return True


@dataclass
class ScrubStats:
    blocks: int = 0
    guarded_blocks: int = 0  # of ``blocks``: blocks of guarded tensors (stored sums: biases, scales)
    blocks_checked: int = 0
    full_passes: int = 0
    repaired: int = 0
    restored: int = 0
    unrepairable: int = 0
    ambiguous: int = 0  # left as found at load: several single-bit repairs would explain them (not guessed)
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
        self.stats = ScrubStats(blocks=sum(t.n_blocks for t in self.targets),
                                guarded_blocks=sum(sum(t.guarded) for t in self.targets))
        self.events: list[ScrubEvent] = []

    def _handle(self, target: ScrubTarget, flagged: np.ndarray, restore: bool,
                accept_ambiguous: bool = False) -> list[ScrubEvent]:
        events, pushed = [], set()
        for b in flagged:
            ev = target.repair(int(b))
            if ev is None:
                continue
            if ev.status != "repaired" and restore and target.restore(int(b)):
                ev.status = "restored"
            elif ev.ambiguous and accept_ambiguous:
                target.accept(int(b))
                ev.status = "ambiguous"
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

    def scrub_range(self, target: ScrubTarget, b0: int, b1: int, restore: bool = True,
                    accept_ambiguous: bool = False) -> list[ScrubEvent]:
        events: list[ScrubEvent] = []
        while b0 < b1:
            n = target.scan(b0, b1, self._out)
            self.stats.blocks_checked += b1 - b0
            if n == 0:
                break
            flagged = self._out[: min(n, self._out.size)].copy()
            events += self._handle(target, flagged, restore, accept_ambiguous)
            if n <= self._out.size:
                break
            b0 = int(flagged[-1]) + 1  # more faults than the event buffer holds: go on after the last one
        return events

    def scrub_all(self, restore: bool = True, accept_ambiguous: bool = False) -> list[ScrubEvent]:
        """Check every block of every target once; repair what can be repaired.

        A block that cannot be repaired with certainty is restored from the last-good copy (``restore``);
        failing that, an ambiguous one is left as found and checked against its present sums from then
        on (``accept_ambiguous``, used at load), and anything else is reported unrepairable.
        """
        t0 = time.perf_counter_ns()
        events = []
        for t in self.targets:
            events += self.scrub_range(t, 0, t.n_blocks, restore, accept_ambiguous)
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


@dataclass
class _Entry:
    """One tensor the scrubber checks, in the graph file of the precision it runs."""

    onnx: str  # initializer name in that file
    name: str  # name in events (the layout's fp32 name for a constrained tensor)
    pos: np.ndarray  # (blocks, k) flat indices into the tensor
    tol: tuple[float, float]
    sums: np.ndarray | None = None  # stored clean sums (guarded); None: constrained (both sums zero)
    guarded: int | None = None  # blocks with stored sums (None: all where ``sums`` is given)


def _guards(model: Any, layout: ProtectionLayout, prec: dict, key: bytes | None, inits: dict) -> list[_Entry]:
    """The guarded tensors: the manifest's records (``precisions[p]["guard"]``), or, for a bundle protected
    before guards existed, records computed now from the file, only when its checksums were verified."""
    records = prec.get("guard")
    if records is None:
        if not getattr(model.bundle, "checksums_verified", False):
            return []  # the file may already hold the faults: its sums would hide them
        protected = set(prec["names"].values())
        records = {o: guard_record(a, layout.k, key if layout.keyed else None, o, layout.window)
                   for o, a in inits.items() if o not in protected and guardable(a)}
    out = []
    for o, rec in records.items():
        a = inits.get(o)
        if a is None or list(a.shape) != list(rec["shape"]) or str(a.dtype) != rec["dtype"]:
            raise ScrubError(f"guarded tensor {o!r}: the graph holds {None if a is None else (list(a.shape), str(a.dtype))}, "
                             f"the manifest records {(rec['shape'], rec['dtype'])}; re-run protect_bundle")
        pos = guard_positions(a.size, layout.k, key if layout.keyed else None, o, layout.window)
        out.append(_Entry(o, o, pos, tuple(rec["tolerance"]), guard_sums(rec)))
    return out


def _constrained(model: Any, layout: ProtectionLayout, prec: dict, key: bytes | None, t: str, inits: dict) -> _Entry:
    """A constrained tensor's entry: its zero-sum blocks, and its tail of 1 or 2 members (too few to constrain) as a
    last block checked against its stored clean sums (``prec["tail"]``; for a bundle protected before tails were
    stored, sums computed now from the file, only when its checksums were verified)."""
    o = prec["names"][t]
    pos, tol = layout.positions(t, key), tuple(prec["tolerance"][t])
    tail = tail_positions(int(np.prod(layout.tensors[t])), layout.k, key if layout.keyed else None, t, layout.window)
    if tail is None:
        return _Entry(o, t, pos, tol)
    stored = (prec.get("tail") or {}).get(t)
    if stored is None:
        if not getattr(model.bundle, "checksums_verified", False):
            return _Entry(o, t, pos, tol)  # the file may already hold the faults: its sums would hide them
        s0, s1 = syndromes(inits[o], tail)
        stored = [float(s0[0]), float(s1[0])]
    sums = np.zeros((len(pos) + 1, 2))
    sums[-1] = stored
    return _Entry(o, t, np.concatenate([pos, tail]), tol, sums, guarded=1)


def _entries(model: Any, layout: ProtectionLayout, prec: dict, key: bytes | None, guard: bool) -> list[_Entry]:
    inits = model.bundle.onnx(model.graph_name, model.variant).initializers
    out = [_constrained(model, layout, prec, key, t, inits) for t in layout.tensors if t in prec["names"]]
    return out + (_guards(model, layout, prec, key, inits) if guard else [])


def _block(e: _Entry, where: np.ndarray) -> tuple:
    """A ScrubTarget block entry for ``e`` whose flat element ``i`` sits at ``where[i]`` of the buffer."""
    return (e.name, np.where(e.pos >= 0, where[np.maximum(e.pos, 0)], -1), e.pos, *e.tol, e.sums,
            len(e.pos) if e.guarded is None and e.sums is not None else (e.guarded or 0))


def _pusher(model: Any, views: dict[str, np.ndarray], onnx: dict[str, str]):
    """``push(names)`` for a host target: hand the repaired tensors (event names) to the backend."""

    def push(tensors: list[str]) -> None:
        model.backend.set_initializers({onnx[t]: views[onnx[t]] for t in tensors})

    return push


def _host_targets(model: Any, entries: list[_Entry]) -> list[ScrubTarget]:
    """Host copies of the checked initializers (one flat buffer per dtype); repairs rebuild the backend's weights."""
    inits = model.bundle.onnx(model.graph_name, model.variant).initializers
    views: dict[str, np.ndarray] = {}
    targets = []
    by_dtype: dict[np.dtype, list[_Entry]] = {}
    for e in entries:
        by_dtype.setdefault(inits[e.onnx].dtype, []).append(e)
    for dtype, group in by_dtype.items():
        buf = np.zeros(int(sum(inits[e.onnx].size for e in group)), dtype=dtype)
        mine, blocks, off = {}, [], 0
        for e in group:
            a = inits[e.onnx]
            buf[off: off + a.size] = a.reshape(-1)
            mine[e.onnx] = buf[off: off + a.size].reshape(a.shape)
            blocks.append(_block(e, np.arange(off, off + a.size)))
            off += a.size
        views |= mine
        suffix = f", {dtype}" if len(by_dtype) > 1 else ""
        targets.append(ScrubTarget(f"{model.backend_name} (host copy{suffix})", buf, blocks,
                                   _pusher(model, mine, {e.name: e.onnx for e in group})))
    model.backend.set_initializers(views)  # the backend now runs on exactly the copies that are checked
    return targets


def _arena_target(model: Any, entries: list[_Entry]) -> ScrubTarget | None:
    """The Numba backend's own arena, checked and repaired in place (no rebuild)."""
    inits = model.bundle.onnx(model.graph_name, model.variant).initializers
    entries = [e for e in entries if e.sums is None or e.guarded is not None or inits[e.onnx].dtype == np.float32]
    arena, where = model.backend.weight_locations([e.onnx for e in entries])
    blocks = []
    for e in entries:
        if np.any(where[e.onnx] < 0):
            if e.sums is None or e.guarded is not None:
                return None  # a constrained tensor the kernels do not hold as a plain copy: use the host copy
            continue  # a guarded tensor the kernels re-lay out (folded, summed): not reachable in place
        blocks.append(_block(e, where[e.onnx].reshape(-1)))
    return ScrubTarget("numba (arena)", arena, blocks)


def attach_scrubber(model: Any, key: bytes | None = None, scrub_at_load: bool = True,
                    keep_last_good: bool = True, guard: bool = True) -> Scrubber | None:
    """A scrubber over the weights ``model`` computes with, or ``None`` if its bundle is not protected.

    At load it checks every block and repairs what it can (each repair verified); a block several
    single-bit repairs would explain (a change of the tolerance's size) is left as found, reported
    ``ambiguous``, and checked against its present sums from then on; faults it cannot repair
    (several in a block) raise ``WeightsCorruptedError`` (no last-good copy exists yet). Then, with ``keep_last_good``,
    it keeps a copy that later unrepairable blocks are restored from. ``guard=False`` leaves the
    guarded tensors (biases, scales) out (for measuring what the guards add).
    """
    layout = ProtectionLayout.from_manifest(model.bundle.manifest)
    if layout is None:
        return None
    layout.check_key(key)
    prec = layout.precision(model.variant)
    entries = _entries(model, layout, prec, key, guard)
    target = None
    if hasattr(model.backend, "weight_locations"):
        target = _arena_target(model, entries)
    try:
        targets = [target] if target is not None else _host_targets(model, entries)
    except NotImplementedError as exc:
        raise ScrubError(f"backend {model.backend_name!r} cannot take repaired weights: {exc}") from exc
    scrubber = Scrubber(targets)
    if scrub_at_load:
        events = scrubber.scrub_all(restore=False, accept_ambiguous=True)
        bad = [e for e in events if e.status == "unrepairable"]
        if bad:
            raise WeightsCorruptedError(
                f"{len(bad)} block(s) hold faults that cannot be repaired with certainty, e.g. "
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
        self._at_load = list(scrubber.events)  # the load pass's findings (attach_scrubber ran it)
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

    def load_events(self, event, limit: int = 100) -> None:
        """Report what the load pass found (repaired or ambiguous blocks) through ``event(kind, **fields)`` as
        ``weights_<status>`` events with ``at_load=True``, the first ``limit``; past it one ``weights_at_load``
        event with the count of the rest (the summary's ``scrub`` block has every count)."""
        found = self._at_load
        for e in found[:limit]:
            event("weights_" + e.status, at_load=True, **asdict(e))
        if len(found) > limit:
            event("weights_at_load", not_listed=len(found) - limit, listed=limit)


def session_scrubber(model: Any, config: Any) -> SessionScrubber | None:
    """Build the session's scrubber from ``SessionConfig`` (``scrub``, ``scrub_budget_us``, ``scrub_policy``,
    ``weights_key_file``); ``None`` when scrubbing is off or the bundle is not protected."""
    if getattr(config, "scrub", "auto") == "off":
        return None
    key = read_key(key_file=getattr(config, "weights_key_file", None))
    scrubber = attach_scrubber(model, key=key, keep_last_good=config.scrub_policy == "fallback")
    if scrubber is None:
        return None
    if config.scrub_policy == "stop" and scrubber.stats.ambiguous:
        # "stop" runs only on weights it can vouch for: a block left as found at load (several single-bit repairs
        # would explain it) is not one; "fallback" starts on it and checks it against its present sums
        found = [e.format() for e in scrubber.events if e.status == "ambiguous"][:3]
        raise WeightsCorruptedError(
            f"{scrubber.stats.ambiguous} block(s) at load hold a fault that cannot be told apart from another "
            f"(ambiguous, left as found), e.g. {'; '.join(found)}; under --scrub-policy stop the session does not "
            "start on them: restore the bundle from a good copy (or run with --scrub-policy fallback)")
    return SessionScrubber(scrubber, config.scrub_budget_us, config.scrub_policy)
