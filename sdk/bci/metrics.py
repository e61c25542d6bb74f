"""Character and word error rates exactly as FALCON H2 scores them.

This is the scoring rule of ``FalconEvaluator.compute_metrics_edit_distance`` in the
``falcon_challenge`` package, rewritten here so that the SDK needs no extra
dependency:

* the distance is the Levenshtein edit distance (insertions, deletions and
  substitutions each cost 1);
* CER compares characters of the raw strings (``>`` and ``~`` are characters too);
* WER first maps ``>`` to a space, puts a space before each of ``~ , ! ?`` (so each
  is a word of its own) and splits on single spaces, keeping empty words exactly as
  ``str.split(" ")`` does (an empty prediction is one empty word);
* a session's rate is the sum of its trials' distances over the sum of their
  reference lengths, and the reported figure is the unweighted mean over sessions.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

_SPLIT_BEFORE = re.compile(r"([~,!?])")


def edit_distance(a: Sequence, b: Sequence) -> int:
    """Levenshtein distance between two sequences (strings or lists of words).

    Notes
    -----
    The usual dynamic programme, one row at a time:
    :math:`D_{i,j} = \\min(D_{i-1,j} + 1,\\ D_{i,j-1} + 1,\\ D_{i-1,j-1} + [a_i \\ne b_j])`.

    >>> edit_distance("kitten", "sitting")
    3
    >>> edit_distance(["a", "b"], ["a", "c", "b"])
    1
    """
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i]
        for j, y in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y)))
        prev = cur
    return prev[-1]


def to_words(text: str) -> list[str]:
    """FALCON's word split: ``>`` is a space; ``~ , ! ?`` are words of their own.

    >>> to_words("he>was>here,>i>think~")
    ['he', 'was', 'here', ',', 'i', 'think', '~']
    """
    return _SPLIT_BEFORE.sub(r" \1", text.replace(">", " ")).split(" ")


@dataclass
class SessionScore:
    """One session's edit distances and reference lengths, and the rates they give."""

    char_distance: int
    n_chars: int
    word_distance: int
    n_words: int
    n_trials: int

    @property
    def cer(self) -> float:
        return self.char_distance / self.n_chars if self.n_chars else float("nan")

    @property
    def wer(self) -> float:
        return self.word_distance / self.n_words if self.n_words else float("nan")

    def as_dict(self) -> dict:
        return {**asdict(self), "CER": self.cer, "WER": self.wer}


def score_session(predictions: Sequence[str], references: Sequence[str]) -> SessionScore:
    """Sum the character and word distances of one session's trials."""
    if len(predictions) != len(references):
        raise ValueError(
            f"{len(predictions)} predictions for {len(references)} references; one decoded string per trial is needed"
        )
    cd = nc = wd = nw = 0
    for pred, ref in zip(predictions, references, strict=True):
        cd += edit_distance(pred, ref)
        nc += len(ref)
        pw, rw = to_words(pred), to_words(ref)
        wd += edit_distance(pw, rw)
        nw += len(rw)
    return SessionScore(cd, nc, wd, nw, len(references))


def falcon_metrics(predictions: Sequence[Sequence[str]], references: Sequence[Sequence[str]]) -> dict:
    """FALCON H2's figures over sessions: ``CER``, ``WER`` (means over sessions) and their spreads.

    Parameters
    ----------
    predictions, references
        One list of strings per session, one string per trial.

    Returns
    -------
    dict
        ``CER``, ``WER``, ``CER Std.``, ``WER Std.`` (population std over sessions, as
        FALCON reports) and ``per_session`` (a list of :meth:`SessionScore.as_dict`).
    """
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} sessions of predictions for {len(references)} sessions of references")
    scores = [score_session(p, r) for p, r in zip(predictions, references, strict=True)]
    cers = np.array([s.cer for s in scores])
    wers = np.array([s.wer for s in scores])
    return {
        "CER": float(np.mean(cers)),
        "WER": float(np.mean(wers)),
        "CER Std.": float(np.std(cers)),
        "WER Std.": float(np.std(wers)),
        "per_session": [s.as_dict() for s in scores],
    }
