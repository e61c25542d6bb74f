"""Character labels, greedy CTC and the lexicon-constrained prefix beam search on constructed log-probs."""

from __future__ import annotations

import numpy as np
import pytest

from closedloop.sdk.bci.charset import BLANK, N_CLASSES, CharsetError, decode, encode
from closedloop.sdk.bci.decoding import Lexicon, beam_decode, end_completion, greedy_decode


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


def spread_tail(text: str, mark: str, n_tail: int, p_mark: float) -> np.ndarray:
    """Log-probs that spell ``text`` one symbol per bin, then ``n_tail`` bins each giving ``mark`` ``p_mark``
    (the rest to blank): how a CTC decoder spreads a sentence-final mark over the rest bins after the pen stops."""
    head = path_logp("_".join(text) + "_")
    p = np.full((n_tail, N_CLASSES), 1e-6)
    p[:, encode(mark)[0]] = p_mark
    p[:, BLANK] = 1.0 - p_mark - 1e-6 * (N_CLASSES - 2)
    return np.concatenate([head, np.log(p)])


def _odds_by_enumeration(lp: np.ndarray, label: int) -> float:
    """P(the tail emits exactly one run of ``label``) / P(all blank), summed over every run explicitly."""
    p = np.exp(lp)
    total = 0.0
    for t in range(len(p)):
        for e in range(t, len(p)):
            total += np.prod(p[t: e + 1, label] / p[t: e + 1, BLANK])
    return total


def test_end_completion_odds_are_the_exact_ctc_ratio():
    tail = spread_tail("", "~", 7, 0.08)
    label, odds = end_completion(tail)
    assert odds == pytest.approx(_odds_by_enumeration(tail, encode("~")[0]), rel=1e-9)
    assert (label == encode("~")[0]) == (odds > 1.0)


def test_end_completion_appends_a_spread_mark_only_when_ctc_prefers_it():
    # 25 rest bins at p(~) = 0.06: greedy never emits it; one '~' is likelier than none
    confident = spread_tail("the>cat", "~", 25, 0.06)
    assert greedy_decode(confident) == "the>cat"
    assert greedy_decode(confident, complete_end=True) == "the>cat~"
    # at 0.02 per bin 'nothing more' is likelier: plain completion leaves it out
    unsure = spread_tail("the>cat", "~", 25, 0.02)
    assert end_completion(unsure)[1] < 1.0
    assert greedy_decode(unsure, complete_end=True) == "the>cat"
    # under the sentence-end rule a sentence must end with a mark: the likelier of '~' and '?' is appended
    assert greedy_decode(unsure, complete_end=True, sentence_end="?~") == "the>cat~"
    assert greedy_decode(spread_tail("the>cat", "?", 25, 0.02), complete_end=True, sentence_end="?~") == "the>cat?"


def test_end_completion_leaves_a_sentence_that_already_ends():
    done = path_logp("t_h_e_~___")
    assert greedy_decode(done, complete_end=True, sentence_end="?~") == "the~"
    assert greedy_decode(done, complete_end=True) == "the~"
    assert end_completion(np.zeros((0, N_CLASSES))) == (BLANK, 0.0)
