"""FALCON H2's CER/WER: edit distance, word split, per-session sums and the mean over sessions."""

from __future__ import annotations

import pytest

from closedloop.sdk.bci.metrics import edit_distance, falcon_metrics, score_session, to_words


@pytest.mark.parametrize("a,b,d", [
    ("", "", 0), ("abc", "", 3), ("", "ab", 2), ("kitten", "sitting", 3), ("flaw", "lawn", 2),
    ("abc", "abc", 0), ("ab", "ba", 2), (["he", "was"], ["he", "is", "was"], 1),
])
def test_edit_distance_hand_cases(a, b, d):
    assert edit_distance(a, b) == d
    assert edit_distance(b, a) == d


def test_word_split_matches_falcon_normalisation():
    assert to_words("he>was>an>important>man~") == ["he", "was", "an", "important", "man", "~"]
    assert to_words("yes,>no?") == ["yes", ",", "no", "?"]
    # split(" ") keeps empty words, as FALCON's does: an empty prediction is one empty word,
    # a double space gives an empty word, a leading punctuation mark an empty first word
    assert to_words("") == [""]
    assert to_words("a>>b") == ["a", "", "b"]
    assert to_words("~") == ["", "~"]


def test_session_rate_is_sum_of_distances_over_sum_of_lengths():
    refs = ["he>was~", "a>cat~"]
    preds = ["he>is~", "a>cat~"]
    s = score_session(preds, refs)
    # chars: "he>is~" vs "he>was~": substitute i->w, insert a -> 2... (he>is~ -> he>was~: i->w, +a, s kept) = 2
    assert (s.char_distance, s.n_chars) == (2, 7 + 6)
    # words: [he, is, ~] vs [he, was, ~]: 1 of 3; [a, cat, ~] exact
    assert (s.word_distance, s.n_words) == (1, 6)
    assert s.cer == pytest.approx(2 / 13) and s.wer == pytest.approx(1 / 6)


def test_reported_figure_is_the_mean_over_sessions_not_over_trials():
    # session 1: one short trial, all wrong; session 2: one long trial, all right
    m = falcon_metrics([["xx"], ["abcdefgh"]], [["ab"], ["abcdefgh"]])
    assert m["CER"] == pytest.approx((1.0 + 0.0) / 2)  # pooled over trials it would be 2/10
    assert m["WER"] == pytest.approx((1.0 + 0.0) / 2)
    assert m["CER Std."] == pytest.approx(0.5)
    assert [p["n_chars"] for p in m["per_session"]] == [2, 8]


def test_empty_prediction_costs_every_reference_word():
    s = score_session([""], ["he>was~"])
    assert s.char_distance == 7 and s.word_distance == 3  # [''] vs [he, was, ~]: 1 substitution + 2 insertions


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError, match="one decoded string per trial"):
        score_session(["a"], ["a", "b"])
