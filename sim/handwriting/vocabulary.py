"""The built-in vocabulary and the sentence maker of the synthetic handwriting task.

Prompts follow FALCON H2's conventions: lower-case words joined by ``>`` (space), an
occasional ``,`` after a word, contractions carry ``'``, and a sentence ends with
``~`` (period) or ``?``. Example: ``we>can>walk>home,>then>eat~``. The word list is
our own: a few hundred common English words, a few of them contractions.
"""

from __future__ import annotations

import numpy as np

from closedloop.common.handwriting import CHARSET

__all__ = ["VOCABULARY", "make_sentence"]

_WORDS = """
a about above across act add after again against age ago air all almost alone along already also always am
among an and animal another answer any anyone anything are area arm around art as ask at away back bad bag
ball bank be beach bear beautiful because bed been before began begin behind being believe below best better
between big bird black blue boat body book both box boy bread bring brother brown build built busy but buy by
call came can car care carry case cat catch cause center change child children city class clean clear close
cold color come common could country course cover cut dark day dear deep did different dinner do doctor does
dog done door down draw dream dress drink drive during each early earth east easy eat egg end enough even
evening ever every eye face fact fall family far farm fast father feel feet few field find fine fire first
fish five floor fly follow food foot for form found four free friend from front full game garden gave get
girl give glad go gold good got great green ground group grow had half hand happy hard has have he head hear
heart heavy help her here high hill him his hold home hope horse hot hour house how idea if important in
inside into is island it its just keep kept kind king knew know lady land large last late laugh learn leave
left let letter life light like line list listen little live long look lost lot love low made make man many
map may me mean men might mile milk mind minute miss money month moon more morning most mother mountain move
much music must my name near need never new next nice night no north not note nothing now number of off often
old on once one only open or order other our out over own page paper park part party pass past pay people
person picture piece place plan plant play please point poor possible power pretty pull put question quick
quiet rain ran read ready real red remember rest right river road rock room round run said same sat saw say
school sea second see seem sent set shall she ship short should show side simple sing sister sit six sleep
slow small snow so some something song soon sound south speak spring stand star start stay step still stone
stop story street strong study such summer sun sure table take talk tall teacher tell ten than thank that the
their them then there these they thing think this those though thought three through time to today together
told too took top toward town tree true try turn two under until up upon us use very visit voice wait walk
wall want war warm was watch water way we weather week well went were west what when where which while white
who whole why will wind window winter with without woman wood word work world would write year yes yet you
young your
don't can't it's i'm we're you're isn't didn't won't that's let's i'll
"""

#: The vocabulary, in a fixed order (sentences index into it).
VOCABULARY: tuple[str, ...] = tuple(dict.fromkeys(_WORDS.split()))

assert all(set(w) <= set(CHARSET) for w in VOCABULARY), "vocabulary word outside CHARSET"


def make_sentence(rng: np.random.Generator, words_per_sentence: tuple[int, int] = (3, 9),
                  question_prob: float = 0.15, comma_prob: float = 0.07) -> str:
    """One prompt in FALCON H2 form, e.g. ``i>think>it's>time,>yes~``.

    ``words_per_sentence`` is the inclusive (min, max) word count; a comma never
    follows the last word.
    """
    lo, hi = words_per_sentence
    n = int(rng.integers(lo, hi + 1))
    words = [VOCABULARY[int(i)] for i in rng.integers(0, len(VOCABULARY), size=n)]
    commas = rng.random(n) < comma_prob
    parts = [w + ("," if commas[i] and i < n - 1 else "") for i, w in enumerate(words)]
    end = "?" if rng.random() < question_prob else "~"
    return ">".join(parts) + end
