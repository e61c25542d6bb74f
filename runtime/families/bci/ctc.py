"""Numba kernels for streaming character decoders: per-channel normalisation and greedy CTC.

A handwriting decoder (``closedloop.runtime.families.bci``) runs once per 20 ms bin: the bin's
spike counts are normalised per channel (``normalize``), the model emits one vector
of CTC log-probabilities (blank + characters), and ``ctc_greedy_step`` turns that
vector into at most one new character. Greedy CTC decoding is the argmax per step,
repeats collapsed and blanks dropped; done one step at a time it needs only the
previous step's argmax, so streaming gives exactly the text that offline decoding
(``greedy_decode``) gives for the same log-probabilities.

When a trial ends, ``StreamingCTC.complete_end`` may append one more character:
*end-of-trial completion*. Greedy decoding never emits a character whose probability
is spread thinly over many bins (a handwriting decoder spreads the sentence-final
``~`` over the rest bins after the pen stops). Each step therefore also keeps, per
output ``c``, the CTC odds that the bins since the last non-blank argmax hold exactly
one more ``c`` rather than nothing: with ``r = p(c) / p(blank)``, ``E <- r (1 + E)``
and ``O <- O + E`` (``closedloop.sdk.bci.decoding.end_completion`` is the offline reference; the
formula is in docs/bci_deployment.md). 32 exponentials per bin; nothing else changes.

Nothing here allocates per step: the kernels write into arrays passed in, and
``StreamingCTC`` keeps the emitted output indices in a preallocated ring and hands
out each new character as an element of a prebuilt label list (one-character strings
are shared objects in CPython). Text is assembled only when asked for (the status
line, the end of a trial), off the hot path.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numba import njit

# Reassociation lets LLVM vectorise the loops; no nnan/ninf, so a NaN from a broken
# model stays NaN (and loses every argmax comparison) instead of turning into an
# arbitrary character. Same flags as ``closedloop.runtime.kernels``.
_FASTMATH = {"reassoc", "contract", "arcp", "nsz", "afn"}

#: ``state`` layout of ``ctc_greedy_step``: previous argmax (-1 at a trial's start),
#: then the number of characters emitted since the last reset.
STATE_PREV = 0
STATE_COUNT = 1
STATE_SIZE = 2
#: ``tail`` rows of ``ctc_greedy_step``: runs ending at this step (E), odds so far (O).
TAIL_RUNS = 0
TAIL_ODDS = 1


@njit(cache=True, fastmath=_FASTMATH, nogil=True)
def normalize(x: np.ndarray, mean: np.ndarray, inv_std: np.ndarray, out: np.ndarray) -> None:
    """``out[i] = (x[i] - mean[i]) * inv_std[i]`` in float32; ``out`` may be ``x``."""
    for i in range(out.shape[0]):
        out[i] = (np.float32(x[i]) - mean[i]) * inv_std[i]


@njit(cache=True, fastmath=_FASTMATH, nogil=True)
def normalize_warmup(x: np.ndarray, sums: np.ndarray, count: np.ndarray, warmup: int, std_floor: float,
                     mean: np.ndarray, inv_std: np.ndarray, out: np.ndarray) -> None:
    """``normalize`` with the session's own statistics, learned over its first ``warmup`` bins.

    While ``count[0] < warmup`` the bin is added to ``sums`` (2 x channels, float64: sum and sum
    of squares) and ``mean`` / ``inv_std`` become the mean and ``1 / max(std, std_floor)`` of the
    bins so far, this one included; from then on they stay as they are (frozen). ``out`` may be ``x``.
    """
    n = count[0]
    if n < warmup:
        n += 1
        count[0] = n
        for i in range(out.shape[0]):
            v = np.float64(x[i])
            sums[0, i] += v
            sums[1, i] += v * v
            m = sums[0, i] / n
            var = sums[1, i] / n - m * m
            sd = np.sqrt(var) if var > 0.0 else 0.0
            mean[i] = np.float32(m)
            inv_std[i] = np.float32(1.0 / (sd if sd > std_floor else std_floor))
    for i in range(out.shape[0]):
        out[i] = (np.float32(x[i]) - mean[i]) * inv_std[i]


@njit(cache=True, fastmath=_FASTMATH, nogil=True)
def ctc_greedy_step(logp: np.ndarray, blank: int, state: np.ndarray, ring: np.ndarray, tail: np.ndarray) -> int:
    """One step of greedy CTC decoding; returns the emitted output index, or -1.

    ``logp`` holds one step's scores (log-probabilities or logits: the argmax and the
    ratios ``p(c) / p(blank)`` are the same). A character is emitted when the step's
    argmax is not the blank and differs from the previous step's argmax (CTC collapses
    repeats; a blank between two equal characters separates them). Emitted indices are
    written to ``ring`` at ``state[STATE_COUNT] % ring.size``. ``tail`` (2 x outputs,
    float64) keeps the end-of-trial completion odds: zeroed when the argmax is not the
    blank, else updated with this step's ratios (each <= 1, since the blank is the argmax).
    """
    best = 0
    best_v = logp[0]
    for k in range(1, logp.shape[0]):
        if logp[k] > best_v:  # strict: ties go to the lower index, as numpy.argmax does
            best_v = logp[k]
            best = k
    if best == blank:
        for k in range(logp.shape[0]):
            r = np.exp(np.float64(logp[k]) - np.float64(logp[blank]))
            tail[TAIL_RUNS, k] = r * (1.0 + tail[TAIL_RUNS, k])
            tail[TAIL_ODDS, k] += tail[TAIL_RUNS, k]
    else:
        tail[:, :] = 0.0
    prev = state[STATE_PREV]
    state[STATE_PREV] = best
    if best == blank or best == prev:
        return -1
    n = state[STATE_COUNT]
    ring[n % ring.shape[0]] = best
    state[STATE_COUNT] = n + 1
    return best


def output_labels(charset: str, blank: int) -> list[str]:
    """The string each model output stands for: ``''`` for the blank, else one character.

    Outputs other than the blank map to ``charset`` in order, so with ``blank=0``
    output ``k`` is ``charset[k - 1]`` (FALCON H2's convention).
    """
    n = len(charset) + 1
    if not 0 <= blank < n:
        raise ValueError(f"blank index {blank} is outside 0..{n - 1} for a {len(charset)}-character charset")
    chars = iter(charset)
    return ["" if k == blank else next(chars) for k in range(n)]


def tail_odds(logp: np.ndarray, blank: int = 0) -> tuple[np.ndarray, int]:
    """End-of-trial completion odds of a whole trial's scores ``logp`` (T, outputs), offline.

    Returns the odds ``O_c`` per output over the tail (the steps after the last one whose
    argmax is not the blank; the whole trial if there is none) and the last emitted
    output (-1 for none): what ``ctc_greedy_step`` accumulates step by step.
    """
    logp = np.asarray(logp, dtype=np.float64)
    odds = np.zeros(logp.shape[1])
    if logp.shape[0] == 0:
        return odds, -1
    best = logp.argmax(axis=1)
    nonblank = np.flatnonzero(best != blank)
    runs = np.zeros(logp.shape[1])
    for row in logp[nonblank[-1] + 1:] if nonblank.size else logp:
        runs = np.exp(row - row[blank]) * (1.0 + runs)
        odds += runs
    return odds, int(best[nonblank[-1]]) if nonblank.size else -1


def completion_label(odds: np.ndarray, blank: int, last: int, ends: Sequence[int] | None) -> int:
    """The output end-of-trial completion appends (-1: none), from the tail's odds.

    ``ends`` None: the output with the largest odds, if they exceed 1 (one more character
    is more probable than none). Otherwise the outputs a sentence must end with: when
    ``last`` (the last emitted output, -1 for none) is not one of them, the one of them
    with the largest odds, whatever they are.
    """
    if ends is not None:
        if last in ends:
            return -1
        return max(ends, key=lambda k: (odds[k], -k))
    o = np.array(odds, dtype=np.float64)
    o[blank] = 0.0
    k = int(o.argmax())
    return k if o[k] > 1.0 else -1


def end_outputs(labels: Sequence[str], sentence_end: str) -> list[int] | None:
    """Output indices of the characters in ``sentence_end`` (``""``: None, plain completion)."""
    if not sentence_end:
        return None
    labels = list(labels)
    missing = [c for c in sentence_end if c not in labels]
    if missing:
        raise ValueError(f"sentence_end {sentence_end!r} holds {missing}, not in the charset {''.join(labels)!r}")
    return [labels.index(c) for c in sentence_end]


def greedy_decode(logp: np.ndarray, charset: str, blank: int = 0, complete_end: bool = False,
                  sentence_end: str = "") -> str:
    """Offline greedy CTC decoding of ``logp`` (T, outputs): the reference for streaming.

    With ``complete_end`` the trial is over and end-of-trial completion applies
    (``sentence_end``: the characters a sentence must end with; ``""``: plain completion).
    """
    logp = np.asarray(logp)
    if logp.ndim != 2 or logp.shape[1] != len(charset) + 1:
        raise ValueError(f"logp has shape {logp.shape}; expected (T, {len(charset) + 1}) for a "
                         f"{len(charset)}-character charset plus the blank")
    best = np.argmax(logp, axis=1)
    keep = np.ones(best.shape, dtype=bool)
    keep[1:] = best[1:] != best[:-1]
    labels = output_labels(charset, blank)
    text = "".join(labels[k] for k in best[keep & (best != blank)])
    if complete_end:
        odds, last = tail_odds(logp, blank)
        k = completion_label(odds, blank, last, end_outputs(labels, sentence_end))
        if k >= 0:
            text += labels[k]
    return text


class StreamingCTC:
    """Greedy CTC decoding one step at a time, with the text kept in a preallocated ring.

    Parameters
    ----------
    charset
        The characters of the non-blank outputs, in output order.
    blank
        Index of the CTC blank among the outputs.
    capacity
        How many characters the ring keeps; ``text()`` returns at most this many (the
        newest). A trial is one sentence, so the default is generous.
    """

    def __init__(self, charset: str, blank: int = 0, capacity: int = 16384):
        if capacity < 1:
            raise ValueError(f"capacity {capacity} must be at least 1 character")
        self.charset, self.blank = charset, int(blank)
        self.labels = output_labels(charset, self.blank)
        self._state = np.zeros(STATE_SIZE, dtype=np.int64)
        self._ring = np.zeros(int(capacity), dtype=np.int64)
        self._tail = np.zeros((2, len(self.labels)), dtype=np.float64)
        self.last = ""  # the character the last step emitted ('' for none)
        self.warm_up()
        self.reset()

    @property
    def n_outputs(self) -> int:
        return len(self.labels)

    @property
    def count(self) -> int:
        """Characters emitted since the last reset (may exceed the ring's capacity)."""
        return int(self._state[STATE_COUNT])

    def warm_up(self) -> None:
        """Compile (or load from Numba's cache) the step kernel for these array types."""
        ctc_greedy_step(np.zeros(self.n_outputs, dtype=np.float32), self.blank, self._state, self._ring, self._tail)
        self.reset()

    def reset(self) -> None:
        self._state[STATE_PREV] = -1
        self._state[STATE_COUNT] = 0
        self._tail[:, :] = 0.0
        self.last = ""

    def step(self, logp: np.ndarray) -> str:
        """Decode one step (a 1-D float32 view of the scores); return the new character or ''."""
        k = ctc_greedy_step(logp, self.blank, self._state, self._ring, self._tail)
        self.last = self.labels[k] if k >= 0 else ""
        return self.last

    def complete_end(self, sentence_end: str = "") -> str:
        """The trial is over: append the character end-of-trial completion picks; return it or ''.

        ``sentence_end``: the characters a sentence must end with (e.g. ``"~?"``); ``""`` for
        plain completion (append only what CTC rates more probable than nothing).
        """
        n = self.count
        last = int(self._ring[(n - 1) % self._ring.size]) if n else -1
        k = completion_label(self._tail[TAIL_ODDS], self.blank, last, end_outputs(self.labels, sentence_end))
        if k < 0:
            return ""
        self._ring[n % self._ring.size] = k
        self._state[STATE_COUNT] = n + 1
        self._state[STATE_PREV] = k
        self._tail[:, :] = 0.0
        return self.labels[k]

    def indices(self, last_n: int | None = None) -> np.ndarray:
        """The newest emitted output indices, oldest first (a copy)."""
        n = self.count
        cap = self._ring.size
        keep = min(n, cap) if last_n is None else min(n, cap, max(int(last_n), 0))
        start = n - keep
        idx = (np.arange(start, n) % cap) if keep else np.zeros(0, dtype=np.int64)
        return self._ring[idx]

    def text(self, last_n: int | None = None) -> str:
        """The text decoded since the last reset (its newest ``last_n`` characters if given)."""
        labels = self.labels
        return "".join(labels[k] for k in self.indices(last_n))
