"""CTC decoding of per-bin character log-probabilities into text.

Two decoders over the 32-way output of the family's models (blank = 0, see
:mod:`closedloop.sdk.bci.charset`):

* :func:`greedy_decode`: the most likely class per bin, repeats collapsed, blanks
  dropped. This is what the runtime's streaming CTC kernel computes. With
  ``complete_end=True`` it also applies *end-of-trial completion*
  (:func:`end_completion`): when the trial is over, one more character is appended if
  CTC rates it more probable than none over the bins after the last emitted one, or,
  with ``sentence_end``, the sentence-final mark the text lacks.
* :func:`beam_decode`: CTC prefix beam search constrained to a :class:`Lexicon`.
  Text is a sequence of lexicon words separated by ``>``; a word may be followed by
  one punctuation mark (``,``, ``~`` or ``?``). When every training sentence ends with
  ``~`` or ``?`` (FALCON H2's prompts do), so must the decoded text
  (``Lexicon.sentence_end``). No language model is used beyond this constraint, unless ``word_weight > 0`` adds a unigram prior
  :math:`\\lambda \\log p(w)` each time a word is completed, with :math:`p(w)` the
  add-one smoothed word frequency in the *training* sentences the lexicon was built
  from.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from closedloop.common.handwriting import CHARSET
from closedloop.runtime.families.bci.ctc import completion_label, end_outputs, output_labels, tail_odds
from closedloop.runtime.families.bci.ctc import greedy_decode as runtime_greedy_decode

from .charset import BLANK, PUNCTUATION, SPACE, decode, encode

#: The harness's decoders, in the order tables show them: best path, best path with end-of-trial
#: completion (:func:`end_completion`), lexicon beam search.
DECODERS = ("greedy", "greedy_end", "beam")
NEG_INF = -math.inf
_LABELS = output_labels(CHARSET, BLANK)
_SPACE_ID = encode(SPACE)[0]
_PUNCT_IDS = frozenset(encode(PUNCTUATION))


def greedy_decode(logp: np.ndarray, complete_end: bool = False, sentence_end: str = "") -> str:
    """Best path: argmax per bin, collapse repeats, drop blanks.

    Parameters
    ----------
    logp
        ``(T, 32)`` log-probabilities of a whole trial (without ``complete_end`` any scores
        do; only the argmax matters). The runtime's offline reference
        (``closedloop.runtime.families.bci.ctc.greedy_decode``) with FALCON H2's charset: one implementation.
    complete_end, sentence_end
        With ``complete_end`` the trial is over: apply :func:`end_completion` (append the
        character the tail holds; with ``sentence_end``, the sentence-final mark it lacks).
    """
    return runtime_greedy_decode(logp, CHARSET, BLANK, complete_end, sentence_end)


def end_completion(logp: np.ndarray, sentence_end: str = "") -> tuple[int, float]:
    """The character greedy decoding leaves out at the end of a trial.

    Greedy decoding drops a character whose probability is spread thinly over many bins:
    each bin's argmax stays blank. Sentence-final marks behave like this (after the pen
    stops every bin looks like rest, and a decoder trained with CTC spreads ``~`` over
    them, about 0.04 per bin), so greedy decoding never emits them. Once the trial has
    ended the question can be asked of the whole tail, the bins after the last one whose
    argmax is not blank: does the tail emit nothing (every bin blank) or exactly one more
    character ``c`` (blanks, a run of ``c``, blanks)? With
    :math:`r_t = p_t(c) / p_t(\text{blank})` the CTC odds of the second against the first are

    .. math:: O_c = \\sum_{t \\le e} \\prod_{s=t}^{e} r_s,

    summed over every run ``t..e`` in the tail (streaming: ``E <- r (1 + E)``, the runs
    ending at this bin, and ``O <- O + E``).

    Parameters
    ----------
    logp
        ``(T, 32)`` log-probabilities of one whole trial.
    sentence_end
        ``""``: append the character with the largest odds if they exceed 1 (more probable
        than nothing). Otherwise the characters a sentence must end with (``"~?"`` for
        FALCON's prompts, :attr:`Lexicon.sentence_end`): when the greedy text does not end
        with one of them, append the one with the largest odds, whatever they are (the lexicon
        beam search prefers the hypotheses that end with one of them, and appends nothing).

    Returns
    -------
    label, odds
        The label to append (0: none) and its odds ``O_c``.
    """
    odds, last = tail_odds(logp, BLANK)
    odds[BLANK] = 0.0
    label = completion_label(odds, BLANK, last, end_outputs(_LABELS, sentence_end))
    return (BLANK, float(odds.max())) if label < 0 else (label, float(odds[label]))


def _logaddexp(a: float, b: float) -> float:
    if a == NEG_INF:
        return b
    if b == NEG_INF:
        return a
    if a > b:
        return a + math.log1p(math.exp(b - a))
    return b + math.log1p(math.exp(a - b))


class Lexicon:
    """The vocabulary as a character trie, with optional unigram log-probabilities.

    A word is a string of letters and apostrophes (anything but ``>`` and the
    punctuation ``, ~ ?``). Build one from training sentences with
    :meth:`from_sentences`. ``sentence_end``: the characters a sentence must end with
    ("" for no such rule).
    """

    def __init__(self, words: Iterable[str], counts: dict[str, int] | None = None, sentence_end: str = ""):
        if any(c not in PUNCTUATION for c in sentence_end):
            raise ValueError(f"sentence_end {sentence_end!r} may only hold punctuation {PUNCTUATION!r}")
        self.sentence_end = sentence_end
        self._end_ids = frozenset(encode(sentence_end))
        self.children: list[dict[int, int]] = [{}]
        self.word_at: list[int] = [-1]
        self.words: list[str] = []
        for w in sorted(set(words)):
            if not w or any(c in PUNCTUATION or c == SPACE for c in w):
                raise ValueError(f"lexicon word {w!r} must be non-empty and hold no '>' or punctuation {PUNCTUATION!r}")
            node = 0
            for c in encode(w):
                nxt = self.children[node].get(c)
                if nxt is None:
                    nxt = len(self.children)
                    self.children[node][c] = nxt
                    self.children.append({})
                    self.word_at.append(-1)
                node = nxt
            if self.word_at[node] < 0:
                self.word_at[node] = len(self.words)
                self.words.append(w)
        counts = counts or {}
        total = sum(counts.get(w, 0) for w in self.words) + len(self.words)
        self.log_prior = [math.log((counts.get(w, 0) + 1) / total) for w in self.words]

    @classmethod
    def from_sentences(cls, sentences: Iterable[str]) -> Lexicon:
        """Words (and their counts) of ``sentences``, split at ``>`` with trailing punctuation removed.

        ``sentence_end`` is set to the final characters of the sentences when every one of
        them ends with ``~`` or ``?``.
        """
        counts: dict[str, int] = {}
        sentences = list(sentences)
        ends = {s[-1] for s in sentences if s}
        for s in sentences:
            for token in s.split(SPACE):
                w = token.rstrip(PUNCTUATION)
                if w:
                    counts[w] = counts.get(w, 0) + 1
        end = "".join(sorted(ends)) if ends and ends <= set("~?") else ""
        return cls(counts, counts, end)

    def __len__(self) -> int:
        return len(self.words)

    def __contains__(self, word: str) -> bool:
        return word in set(self.words)


# A grammar state is (trie node, phase): phase 0 inside a word (node 0 = at a word's
# start), phase 1 just after a punctuation mark (only a space may follow).
_State = tuple[int, int]


def _advance(lex: Lexicon, state: _State, c: int) -> tuple[_State | None, int]:
    """Next grammar state after character ``c`` (None if not allowed) and the word it completes (or -1)."""
    node, phase = state
    if phase == 1:
        return ((0, 0), -1) if c == _SPACE_ID else (None, -1)
    nxt = lex.children[node].get(c)
    if nxt is not None:
        return (nxt, 0), -1
    word = lex.word_at[node]
    if word >= 0 and (c == _SPACE_ID or c in _PUNCT_IDS):
        return ((0, 0) if c == _SPACE_ID else (node, 1)), word
    return None, -1


@dataclass
class _Beam:
    blank: float  # log P(prefix, path ends in blank)
    label: float  # log P(prefix, path ends in its last label)
    state: _State
    lm: float  # accumulated word prior

    def total(self) -> float:
        return _logaddexp(self.blank, self.label)


def _entry(beams: dict[tuple[int, ...], _Beam], prefix: tuple[int, ...], state: _State, lm: float) -> _Beam:
    b = beams.get(prefix)
    if b is None:
        b = beams[prefix] = _Beam(NEG_INF, NEG_INF, state, lm)
    return b


def beam_decode(
    logp: np.ndarray,
    lexicon: Lexicon,
    beam_width: int = 16,
    prune_logp: float = math.log(1e-3),
    word_weight: float = 0.0,
) -> str:
    """CTC prefix beam search constrained to ``lexicon``.

    Parameters
    ----------
    logp
        ``(T, 32)`` log-probabilities, blank at index 0.
    lexicon
        Allowed words; see the module notes for the grammar around them.
    beam_width
        Prefixes kept after each bin.
    prune_logp
        Characters whose log-probability in a bin is below this are not tried there
        (the usual CTC pruning; greedy's choice is always tried).
    word_weight
        Weight :math:`\\lambda` of the unigram prior (0: lexicon constraint only).

    Notes
    -----
    For each prefix :math:`\\ell` the search keeps :math:`p_b(\\ell)` and
    :math:`p_{nb}(\\ell)`, the probabilities of all paths over the bins so far that
    collapse to :math:`\\ell` and end in a blank or in :math:`\\ell`'s last label. For
    a bin with probabilities :math:`y`: :math:`p_b'(\\ell) \\mathrel{+}= (p_b + p_{nb}) y_\\varnothing`;
    :math:`p_{nb}'(\\ell) \\mathrel{+}= p_{nb}\\, y_{\\ell_{-1}}` (repeat collapsed); and for an
    allowed character :math:`c`, :math:`p_{nb}'(\\ell c) \\mathrel{+}= y_c (p_b + p_{nb})`, or
    :math:`y_c\\, p_b` when :math:`c` repeats the last label. At the end, prefixes that
    end a word (or a punctuation mark) are preferred; if none does, the best partial
    prefix is returned. With ``lexicon.sentence_end`` set, prefixes that end with one of
    those characters come first.
    """
    logp = np.asarray(logp, dtype=np.float64)
    beams: dict[tuple[int, ...], _Beam] = {(): _Beam(0.0, NEG_INF, (0, 0), 0.0)}
    for row in logp:
        cands = np.flatnonzero(row >= prune_logp).tolist()
        top = int(row.argmax())
        if top not in cands:
            cands.append(top)
        cands = [c for c in cands if c != BLANK]
        nxt: dict[tuple[int, ...], _Beam] = {}
        blank_lp = row[BLANK]
        for prefix, b in beams.items():
            tot = b.total()
            same = _entry(nxt, prefix, b.state, b.lm)
            same.blank = _logaddexp(same.blank, tot + blank_lp)
            if prefix:
                same.label = _logaddexp(same.label, b.label + row[prefix[-1]])
            for c in cands:
                state, word = _advance(lexicon, b.state, c)
                if state is None:
                    continue
                lm = b.lm + (word_weight * lexicon.log_prior[word] if word >= 0 and word_weight else 0.0)
                ext = _entry(nxt, prefix + (c,), state, lm)
                src = b.blank if prefix and c == prefix[-1] else tot
                ext.label = _logaddexp(ext.label, src + row[c])
        beams = dict(sorted(nxt.items(), key=lambda kv: kv[1].total() + kv[1].lm, reverse=True)[:beam_width])

    def final_score(prefix: tuple[int, ...], b: _Beam) -> tuple[bool, bool, float]:
        node, phase = b.state
        word = lexicon.word_at[node] if phase == 0 else -1
        complete = phase == 1 or word >= 0
        ended = not lexicon.sentence_end or (phase == 1 and prefix[-1] in lexicon._end_ids)
        bonus = word_weight * lexicon.log_prior[word] if word >= 0 and word_weight else 0.0
        return ended, complete, b.total() + b.lm + bonus

    best = max(beams.items(), key=lambda kv: final_score(*kv))
    return decode(best[0])
