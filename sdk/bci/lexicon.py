"""The beam search's vocabulary and sentence-end rule, chosen explicitly.

``closedloop evaluate --beam`` takes them from options or from what the bundle stored when it was
trained and calibrated (``extra.bci.decoding``, written by :func:`decoding_block`), never from
whichever files ``--data`` points at, so the same bundle and evaluation file give the same beam text
whether ``--data`` is that file or a folder holding it.

Lexicons (:func:`resolve_lexicon`):

* ``closed``: the words of the sentences the decoder learned from (held-in training sentences,
  plus a calibrated bundle's calibration sentences), stored in the bundle with their counts. When
  the evaluation sentences reuse those words (FALCON H2's prompts do), the beam can only produce
  words that are known to be right, so its WER is optimistic: no open-vocabulary decoder reaches it.
* ``open``: English, the ``OPEN_WORDS`` most frequent words in ``wordfreq``'s ``en`` list that the
  charset can write, with their frequencies as the unigram prior (the package ships its data; no
  network). This is what a comparison with published numbers should use.
* a file: its whitespace- or ``>``-separated words (trailing punctuation dropped), counted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .charset import PUNCTUATION, SPACE
from .decoding import Lexicon

#: Words of the open English vocabulary (``wordfreq.top_n_list("en", OPEN_WORDS)``, those the charset writes).
OPEN_WORDS = 50_000
#: Unigram prior weight of the open lexicon's beam search (per completed word, on the natural-log frequency).
OPEN_WORD_WEIGHT = 0.5
_LETTERS = frozenset("abcdefghijklmnopqrstuvwxyz'")


def sentence_words(sentences: Iterable[str]) -> dict[str, int]:
    """Word counts of ``sentences`` (split at ``>`` or whitespace, trailing punctuation removed)."""
    counts: dict[str, int] = {}
    for s in sentences:
        for token in s.replace(SPACE, " ").split():
            w = token.strip(PUNCTUATION)
            if w:
                counts[w] = counts.get(w, 0) + 1
    return counts


def sentence_end_of(sentences: Iterable[str]) -> str:
    """The sentence-final marks of ``sentences`` when every one ends with ``~`` or ``?`` (else "")."""
    return Lexicon.from_sentences(list(sentences)).sentence_end


def decoding_block(sentences: Iterable[str], base: Mapping[str, Any] | None = None) -> dict:
    """``extra.bci.decoding`` for a bundle trained (or calibrated) on ``sentences``.

    ``vocabulary``: the closed lexicon's word counts (``base``'s, plus these sentences');
    ``sentence_end``: the rule the training sentences set (kept from ``base`` when given: a
    calibration's three sentences do not change what the decoder was trained to end with).
    """
    sentences = list(sentences)
    vocab = dict((base or {}).get("vocabulary") or {})
    for w, n in sentence_words(sentences).items():
        vocab[w] = vocab.get(w, 0) + n
    end = (base or {}).get("sentence_end")
    return {"vocabulary": dict(sorted(vocab.items())),
            "sentence_end": sentence_end_of(sentences) if end is None else str(end)}


#: Seconds of a new session's data whose statistics normalise it when the bundle is not calibrated
#: (``extra.bci.normalization``, the runtime's warm-up; ``closedloop evaluate`` streams the same way).
WARMUP_S = 20.0


def pooled_bundle_defaults(held_in: Iterable[Any], warmup_s: float = WARMUP_S) -> dict:
    """``export_bci_bundle`` settings of an uncalibrated pooled bundle trained on ``held_in`` sessions:
    the beam's defaults from their training sentences and the warm-up normalisation of a new day."""
    from closedloop.common.handwriting import BIN_S

    from .data import fit_indices

    sentences = [s.trials[i].sentence for s in held_in for i in fit_indices(s)]
    return {"decoding": decoding_block(sentences), "warmup_bins": max(1, round(warmup_s / BIN_S))}


def calibrated_decoding(bci: Mapping[str, Any], calibration_sentences: Iterable[str]) -> dict | None:
    """A calibrated bundle's ``extra.bci.decoding``: the given bundle's, its vocabulary joined by the calibration
    sentences' words (None when the given bundle stores none)."""
    base = bci.get("decoding")
    return None if base is None else decoding_block(calibration_sentences, base)


@dataclass
class LexiconChoice:
    """The lexicon a beam search used and where it came from (``evaluate`` reports it)."""

    lexicon: Lexicon
    mode: str  # "closed", "open" or "file"
    source: str
    word_weight: float
    sentence_end_source: str

    def describe(self) -> dict:
        return {"mode": self.mode, "source": self.source, "words": len(self.lexicon), "word_weight": self.word_weight,
                "sentence_end": self.lexicon.sentence_end, "sentence_end_source": self.sentence_end_source}


def open_vocabulary(n_words: int = OPEN_WORDS) -> dict[str, float]:
    """The ``n_words`` most frequent English words (``wordfreq``) the charset can write, with their frequencies."""
    try:
        import wordfreq
    except ImportError as exc:
        raise ValueError("--lexicon open needs the wordfreq package (the train extra: pip install "
                         "'closedloop[train]' -c constraints.txt); or pass --lexicon closed or a word file") from exc
    words = [w for w in wordfreq.top_n_list("en", n_words) if set(w) <= _LETTERS and w.strip("'")]
    return {w: wordfreq.word_frequency(w, "en") for w in words}


def resolve_sentence_end(option: str | None, stored: Mapping[str, Any] | None, end_completion: str | None) -> tuple[str, str]:
    """The sentence-end rule and where it came from: ``option`` ("none" for no rule), else the bundle's stored
    ``decoding.sentence_end``, else its end-completion marks, else no rule."""
    if option is not None:
        rule = "" if option.lower() == "none" else option
        bad = [c for c in rule if c not in PUNCTUATION]
        if bad:
            raise ValueError(f"--sentence-end {option!r}: only the punctuation marks {PUNCTUATION!r} may end a sentence "
                             "(e.g. '~?'), or 'none' for no rule")
        return rule, "--sentence-end"
    if stored is not None and stored.get("sentence_end") is not None:
        return str(stored["sentence_end"]), "bundle (training sentences)"
    if end_completion:
        return end_completion, "bundle (end completion)"
    return "", "none (the bundle stores no rule; pass --sentence-end)"


def resolve_lexicon(option: str | Path | None, stored: Mapping[str, Any] | None, sentence_end: str,
                    sentence_end_source: str, word_weight: float | None = None,
                    open_words: int = OPEN_WORDS) -> LexiconChoice:
    """The beam's lexicon for ``--lexicon`` (``closed`` when None, ``open`` or a word file)."""
    mode = "closed" if option is None else str(option)
    if mode == "closed":
        vocab = (stored or {}).get("vocabulary")
        if not vocab:
            raise ValueError("--lexicon closed: the bundle stores no vocabulary (extra.bci.decoding; bundles from "
                             "`closedloop bci-train` and `calibrate` carry one): pass --lexicon open or --lexicon "
                             "WORDS.txt")
        lex = Lexicon(vocab, {w: int(n) for w, n in vocab.items()}, sentence_end)
        return LexiconChoice(lex, "closed", "the sentences the bundle was trained (and calibrated) on", word_weight or 0.0,
                             sentence_end_source)
    if mode == "open":
        freq = open_vocabulary(open_words)
        lex = Lexicon(freq, None, sentence_end)
        total = sum(freq.values())
        lex.log_prior = [_log(freq[w] / total) for w in lex.words]
        from importlib.metadata import version

        return LexiconChoice(lex, "open", f"wordfreq {version('wordfreq')} en, top {open_words} words",
                             OPEN_WORD_WEIGHT if word_weight is None else word_weight, sentence_end_source)
    path = Path(mode)
    if not path.exists():
        raise ValueError(f"--lexicon {mode}: no such file; give 'closed', 'open' or the path of a word file")
    if not path.is_file():
        raise ValueError(f"--lexicon {mode}: not a file (a folder?); give 'closed', 'open' or the path of a word file")
    counts = sentence_words([path.read_text()])
    if not counts:
        raise ValueError(f"--lexicon {path}: the file holds no words")
    try:
        lex = Lexicon(counts, counts, sentence_end)
    except ValueError as exc:
        raise ValueError(f"--lexicon {path}: {exc}") from exc
    return LexiconChoice(lex, "file", str(path), word_weight or 0.0, sentence_end_source)


def _log(p: float) -> float:
    import math

    return math.log(p)


__all__ = ["OPEN_WORDS", "OPEN_WORD_WEIGHT", "WARMUP_S", "LexiconChoice", "calibrated_decoding", "decoding_block",
           "open_vocabulary", "pooled_bundle_defaults",
           "resolve_lexicon", "resolve_sentence_end", "sentence_end_of", "sentence_words"]
