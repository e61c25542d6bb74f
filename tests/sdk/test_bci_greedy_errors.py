"""closedloop.sdk.bci.greedy_errors: per-character recall and the end-mark counterfactual on constructed decodes."""

from __future__ import annotations

import pytest

from closedloop.sdk.bci import greedy_errors as ge


def test_alignment_marks_exactly_the_matched_prompt_characters():
    assert ge.matched_characters("the>cat", "the>cat~") == [True] * 7 + [False]
    assert ge.matched_characters("ill", "i'll") == [True, False, True, True]
    assert ge.matched_characters("tbe", "the") == [True, False, True]
    assert ge.matched_characters("", "ab") == [False, False]


def test_end_restored_appends_only_a_missing_final_mark():
    assert ge.with_end_restored("the>cat", "the>cat~") == "the>cat~"
    assert ge.with_end_restored("the>cat~", "the>cat~") == "the>cat~"
    assert ge.with_end_restored("the>ca", "the>cat?") == "the>ca?"
    assert ge.with_end_restored("abc", "abc") == "abc"  # a prompt without a final mark is left alone


def test_analysis_sizes_the_missing_marks_per_decoder():
    texts = {"reference": ["ab~", "cd?"], "greedy": ["ab", "cd"], "greedy_end": ["ab~", "cd~"]}
    results = {"runs": [{"methods": {"m": {"sessions": {"s1": {"texts": texts}}}},
                         "reference": {"held_in": {"sessions": {"s0": {"texts": texts}}}}}]}
    out = ge.analyse(results)
    assert set(out) == {"m (held-out)", "reference, held-in"}
    a = out["m (held-out)"]
    assert a["greedy_CER"] == pytest.approx(2 / 6)  # one missing mark per 3-character prompt
    assert a["greedy_CER_end_restored"] == 0.0
    assert a["greedy_end_CER"] == pytest.approx(1 / 6)  # '?' replaced by '~' in the second
    assert a["recall"]["~"] == 0.0 and a["recall"]["a"] == 1.0
    assert a["greedy_end_final_mark"] == {"~": 1.0, "?": 0.0}
    assert "| m (held-out) | 33.33% | 0.00% | 16.67% | 1.00 / 0.00 |" in ge.markdown(out, "x")
