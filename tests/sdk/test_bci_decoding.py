"""Character labels, greedy CTC and the lexicon-constrained prefix beam search on constructed log-probs."""

from __future__ import annotations

import numpy as np
import pytest

from sdk.bci.charset import BLANK, N_CLASSES, CharsetError, decode, encode
from sdk.bci.decoding import Lexicon, beam_decode, greedy_decode


def path_logp(path: str, confusions: dict[int, dict[str, float]] | None = None, p_top: float = 0.9) -> np.ndarray:
    """Log-probs with one bin per symbol of ``path`` ('_' = blank); bin i may share mass per ``confusions``."""
    rows = []
    for i, sym in enumerate(path):
        p = np.full(N_CLASSES, 1e-4)
        mass = confusions.get(i, {}) if confusions else {}
        top = BLANK if sym == "_" else encode(sym)[0]
        p[top] = p_top if not mass else 1.0 - sum(mass.values())
        for ch, q in mass.items():
            p[encode(ch)[0]] = q
        rows.append(np.log(p / p.sum()))
    return np.array(rows)


def test_charset_has_blank_zero_and_31_characters():
    assert N_CLASSES == 32 and BLANK == 0
    assert decode(encode("it's>a>cat,>yes?~")) == "it's>a>cat,>yes?~"
    assert min(encode("a")) == 1 and max(encode("~")) == 31
    with pytest.raises(CharsetError, match="write spaces as '>'"):
        encode("a b")


def test_greedy_collapses_repeats_and_drops_blanks():
    assert greedy_decode(path_logp("cc_aa_t_t")) == "catt"
    assert greedy_decode(path_logp("__")) == ""
    assert greedy_decode(np.zeros((0, N_CLASSES))) == ""


def test_beam_recovers_a_lexicon_word_that_greedy_misspells():
    lex = Lexicon(["cat", "dog"])
    # the middle bin prefers 'o' (0.5) over 'a' (0.4): greedy writes "cot", not a word
    lp = path_logp("c_o_t", confusions={2: {"o": 0.5, "a": 0.4}})
    assert greedy_decode(lp) == "cot"
    assert beam_decode(lp, lex, beam_width=8) == "cat"


def test_beam_follows_the_grammar_spaces_and_final_punctuation():
    lex = Lexicon.from_sentences(["the>cat~", "a>dog?"])
    assert set(lex.words) == {"the", "cat", "a", "dog"}
    lp = path_logp("t_h_e_>_d_o_g_~")
    assert beam_decode(lp, lex) == "the>dog~"
    # an 'x' in the input cannot appear in the output: the lexicon has no word with it
    lp = path_logp("c_a_t_>_d_x_g", confusions={10: {"x": 0.6, "o": 0.35}})
    assert beam_decode(lp, lex) == "cat>dog"


def test_beam_matches_greedy_when_greedy_is_in_the_lexicon():
    lex = Lexicon(["he", "was", "here"])
    lp = path_logp("h_e_>_w_a_s_>_h_e_r_e_~")
    assert beam_decode(lp, lex) == greedy_decode(lp) == "he>was>here~"


def test_unigram_prior_breaks_a_tie_towards_the_frequent_word():
    lex = Lexicon.from_sentences(["cat~"] * 9 + ["cot~"])
    lp = path_logp("c_o_t", confusions={2: {"o": 0.45, "a": 0.45}})
    assert beam_decode(lp, lex, word_weight=1.0) == "cat"
    with pytest.raises(ValueError, match="must be non-empty"):
        Lexicon(["a>b"])


def test_sentence_end_rule_prefers_a_final_period_the_model_was_unsure_of():
    lex = Lexicon.from_sentences(["the>cat~", "a>dog?"])
    assert lex.sentence_end == "?~"
    lp = path_logp("t_h_e_>_c_a_t___", confusions={14: {"~": 0.2}})  # the period bin prefers blank (0.8)
    assert greedy_decode(lp) == "the>cat"
    assert beam_decode(lp, lex) == "the>cat~"
    assert beam_decode(lp, Lexicon(lex.words)) == "the>cat"  # no rule: the likelier text wins
    assert Lexicon.from_sentences(["the>cat", "a>dog?"]).sentence_end == ""
