"""Character labels of the iBCI handwriting decoder: FALCON H2's 31 characters plus the CTC blank.

The decoder's read-out has 32 outputs: index 0 is the CTC blank and indices 1..31 are
the characters of :data:`closedloop.sim.handwriting.CHARSET` in order (``a``-``z``, ``'``, ``,``,
``?``, ``>`` for a space, ``~`` for a period). Every part of the family (training
targets, decoders, the runtime's CTC kernel through the bundle's ``postprocess``
block) uses this one mapping.
"""

from __future__ import annotations

from collections.abc import Iterable

from closedloop.common.handwriting import CHARSET

BLANK = 0
N_CLASSES = len(CHARSET) + 1
SPACE = ">"
PERIOD = "~"
#: Punctuation that may follow a word (``,`` mid-sentence; ``~`` and ``?`` end a sentence).
PUNCTUATION = ",~?"

_INDEX = {c: i + 1 for i, c in enumerate(CHARSET)}


class CharsetError(ValueError):
    """A sentence holds a character outside FALCON H2's character set."""


def encode(sentence: str) -> list[int]:
    """Labels ``1..31`` of ``sentence`` (no blanks).

    >>> encode("hi>a~")
    [8, 9, 30, 1, 31]
    """
    try:
        return [_INDEX[c] for c in sentence]
    except KeyError as exc:
        raise CharsetError(
            f"character {exc.args[0]!r} in {sentence!r} is not in the character set {CHARSET!r}; "
            "write spaces as '>' and periods as '~' (FALCON H2's convention)"
        ) from None


def decode(labels: Iterable[int]) -> str:
    """The text of a label sequence; blanks (0) are dropped, repeats are kept.

    >>> decode([8, 0, 9, 30, 1, 31])
    'hi>a~'
    """
    out = []
    for i in labels:
        i = int(i)
        if i == BLANK:
            continue
        if not 1 <= i < N_CLASSES:
            raise CharsetError(f"label {i} is outside 0..{N_CLASSES - 1} (0 is the CTC blank)")
        out.append(CHARSET[i - 1])
    return "".join(out)


def charset_manifest() -> dict:
    """The ``postprocess`` entry a bundle needs to turn output indices into text."""
    return {"charset": CHARSET, "blank": BLANK, "space": SPACE, "period": PERIOD}
