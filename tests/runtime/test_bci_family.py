"""The bci_handwriting family: Numba normalisation and greedy CTC, streaming equal to offline, load checks."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from torch import nn

from closedloop.firmware_bridge import DecoderOutput, NeuralFrame
from closedloop.runtime import BundleError, Model, get_family, load_bundle
from closedloop.runtime.families.bci.ctc import (
    StreamingCTC,
    greedy_decode,
    normalize,
    output_labels,
    tail_odds,
)
from closedloop.runtime.integrity import seal_manifest
from closedloop.sdk.bci.deploy import export_bci_bundle
from closedloop.sdk.models import GRUDecoder
from closedloop.sim.handwriting import CHARSET

C = 16


class Aligned(nn.Module):
    """An alignment layer in front of a backbone, with the backbone's streaming interface."""

    def __init__(self, n: int, backbone: GRUDecoder):
        super().__init__()
        self.alignment = nn.Linear(n, n)
        self.backbone = backbone

    def init_state(self, batch: int = 1):
        return self.backbone.init_state(batch)

    def forward(self, seq, h=None):
        return self.backbone(self.alignment(seq), h)

    def step(self, x, h):
        return self.backbone.step(self.alignment(x), h)


def _trial(rng, n_bins):
    rates = 2 + 2 * np.sin(np.arange(n_bins)[:, None] / 7.0 + rng.uniform(0, 6, C))
    return rng.poisson(rates).astype(np.uint16)


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    torch.manual_seed(1)
    backbone = GRUDecoder(C, 24, 2, 32)
    with torch.no_grad():  # sharpen the read-out so the text is varied, with blanks between repeats
        backbone.readout.weight.mul_(8)
        backbone.readout.bias[0] += 2.0
    module = Aligned(C, backbone).eval()
    rng = np.random.default_rng(1)
    trials = [_trial(rng, 200), _trial(rng, 120)]
    calib = np.concatenate(trials).astype(np.float64)
    mean, std = calib.mean(0), calib.std(0)
    path = export_bci_bundle(
        module, tmp_path_factory.mktemp("bci") / "dec", n_channels=C, mean=mean, std=std, session_name="s0",
        calibration_info={"trials": [0, 1]}, recorded_bins=trials[0][:50], variants=(), tensorrt=False,
        report=lambda s: None,
    )
    return {"module": module, "path": path, "trials": trials, "mean": mean, "std": std}


def _offline(decoder, counts):
    x = ((counts - decoder["mean"]) / decoder["std"]).astype(np.float32)
    with torch.no_grad():
        logp, _ = decoder["module"](torch.from_numpy(x)[None])
    return logp[0].numpy()


def _family(path, backend):
    b = load_bundle(path)
    return get_family(b.manifest.family)(b, Model(b, backend=backend))


# --- kernels -------------------------------------------------------------------------
def test_greedy_decoding_collapses_repeats_and_drops_blanks():
    def onehot(seq, k):
        return np.eye(k, dtype=np.float32)[seq] * 5.0 - 2.5

    seq = [0, 1, 1, 0, 1, 2, 2, 3, 0, 0, 3]
    assert greedy_decode(onehot(seq, 4), "abc", blank=0) == "aabcc"
    assert output_labels("abc", 3) == ["a", "b", "c", ""]
    assert greedy_decode(onehot([3, 0, 0, 3, 0, 1, 3], 4), "abc", blank=3) == "aab"
    s = StreamingCTC("abc", blank=0)
    emitted = [s.step(row) for row in onehot(seq, 4)]
    assert emitted == ["", "a", "", "", "a", "b", "", "c", "", "", "c"]
    assert s.text() == "aabcc" and s.count == 5


def test_streaming_kernel_equals_offline_and_ring_keeps_newest():
    rng = np.random.default_rng(0)
    logp = rng.standard_normal((2000, 32)).astype(np.float32)
    logp[rng.random(2000) < 0.4, 0] += 3.0  # frequent blanks
    logp[1::2] = logp[0::2]  # every step repeated: collapses
    ref = greedy_decode(logp, CHARSET)
    s = StreamingCTC(CHARSET, capacity=64)
    assert "".join(s.step(row) for row in logp) == ref  # every character is handed out as it is decoded
    assert s.count == len(ref) and s.text() == ref[-64:] and s.text(5) == ref[-5:]
    big = StreamingCTC(CHARSET)
    for row in logp:
        big.step(row)
    assert big.text() == ref
    big.reset()
    assert big.text() == "" and big.count == 0


def _spread_end(rng, mark_index: int, p_mark: float, n_tail: int = 25) -> np.ndarray:
    """Random steps, then ``n_tail`` rest steps where ``mark_index`` gets ``p_mark`` and the blank the rest."""
    head = rng.standard_normal((300, 32)).astype(np.float32)
    head[rng.random(300) < 0.5, 0] += 3.0
    tail = np.full((n_tail, 32), 1e-6, dtype=np.float64)
    tail[:, mark_index] = p_mark
    tail[:, 0] = 1.0 - p_mark - 31e-6
    return np.concatenate([head, np.log(tail).astype(np.float32)])


def test_end_of_trial_completion_streaming_equals_offline():
    rng = np.random.default_rng(3)
    period, question = CHARSET.index("~") + 1, CHARSET.index("?") + 1
    for p_mark, rule, appended in [(0.06, "", "~"), (0.02, "", ""), (0.02, "~?", "~")]:
        logp = _spread_end(rng, period, p_mark)
        plain = greedy_decode(logp, CHARSET)
        offline = greedy_decode(logp, CHARSET, complete_end=True, sentence_end=rule)
        s = StreamingCTC(CHARSET)
        streamed = "".join(s.step(row) for row in logp)
        assert streamed == plain and not plain.endswith("~")  # greedy decoding leaves the spread mark out
        np.testing.assert_allclose(s._tail[1], tail_odds(logp)[0], rtol=1e-5)  # the kernel's odds: the reference's
        assert s.complete_end(rule) == appended
        assert s.text() == offline == plain + appended
    # the rule picks the likelier mark, and a sentence that already ends is left alone
    logp = _spread_end(rng, question, 0.02)
    assert greedy_decode(logp, CHARSET, complete_end=True, sentence_end="~?").endswith("?")
    s = StreamingCTC(CHARSET, capacity=8)
    for row in np.eye(32, dtype=np.float32)[[5, 0, period, 0, 0]] * 5:
        s.step(row)
    assert s.complete_end("~?") == "" and s.text() == "e~"
    with pytest.raises(ValueError, match="not in the charset"):
        s.complete_end("!")


def test_normalisation_kernel_matches_numpy_in_place():
    rng = np.random.default_rng(2)
    x = rng.poisson(3.0, 192).astype(np.float32)
    mean, std = rng.uniform(0, 3, 192).astype(np.float32), rng.uniform(0.5, 2, 192).astype(np.float32)
    out = np.empty_like(x)
    normalize(x, mean, (1 / std).astype(np.float32), out)
    np.testing.assert_allclose(out, (x - mean) / std, rtol=1e-5, atol=1e-6)
    normalize(x, mean, (1 / std).astype(np.float32), x)
    np.testing.assert_array_equal(x, out)


# --- streaming equals offline -------------------------------------------------------------
@pytest.mark.parametrize("backend", ["numba", "onnxruntime"])
def test_streaming_equals_offline_decoding(decoder, backend):
    fam = _family(decoder["path"], backend)
    assert fam.consume == "all" and fam.input.message is NeuralFrame and fam.command.message is DecoderOutput
    for counts in decoder["trials"]:
        logp = _offline(decoder, counts)
        best = logp.argmax(1)
        # the trial exercises both CTC rules: collapsed repeats and a doubled letter split by a blank
        assert np.any((best[1:] == best[:-1]) & (best[1:] != 0))
        expected = greedy_decode(logp, CHARSET)
        streamed = "".join(fam.decode_bin(row) for row in counts)
        assert len(expected) >= 10
        assert streamed == expected == fam.text()
        np.testing.assert_allclose(fam.log_probs[0], logp[-1], atol=1e-4)
        assert fam.end_trial() == expected  # and the next trial starts from zero state and no text
        assert fam.text() == "" and fam.bins == 0


def test_end_completion_bundle_field_applies_at_the_end_of_each_trial(decoder, tmp_path):
    path = export_bci_bundle(
        decoder["module"], tmp_path / "ec", n_channels=C, mean=decoder["mean"], std=decoder["std"], session_name="s0",
        recorded_bins=decoder["trials"][0][:50], variants=(), tensorrt=False, end_completion="~?", report=lambda s: None,
    )
    assert load_bundle(path).manifest.extra["bci"]["end_completion"] == {"sentence_end": "~?"}
    fam = _family(path, "numba")
    for counts in decoder["trials"]:
        logp = _offline(decoder, counts)
        streamed = "".join(fam.decode_bin(row) for row in counts)
        assert streamed == greedy_decode(logp, CHARSET)  # the live characters are plain greedy
        text = fam.end_trial()
        assert text == greedy_decode(logp, CHARSET, complete_end=True, sentence_end="~?")
        assert text[-1] in "~?"
    # a bundle without the field decodes plain greedy text at the end of a trial too
    plain = _family(decoder["path"], "numba")
    assert load_bundle(decoder["path"]).manifest.extra["bci"]["end_completion"] is None
    for row in decoder["trials"][0]:
        plain.decode_bin(row)
    assert plain.end_trial() == greedy_decode(_offline(decoder, decoder["trials"][0]), CHARSET)


def test_messages_carry_the_frame_bin_and_new_characters(decoder):
    fam = _family(decoder["path"], "onnxruntime")
    counts = decoder["trials"][0]
    sent = []
    for i, row in enumerate(counts):
        fam.on_message(NeuralFrame(1000 + i, row))
        fam.model.run()
        msg = fam.command_message(fam.postprocess(), step=7)
        assert isinstance(msg, DecoderOutput) and msg.bin_index == 1000 + i and msg.char_probs is None
        sent.append(msg.text)
    assert "".join(sent) == fam.text() == greedy_decode(_offline(decoder, counts), CHARSET)
    assert sum(1 for t in sent if t) == fam.ctc.count
    live = fam.live_metrics()
    assert live["chars"] == len(fam.text()) and live["text"] == fam.text()[-40:].replace(">", " ").replace("~", ".")
    assert fam.safe_message(3) is None
    fam.reset()
    assert fam.text() == "" and fam.live_metrics()["chars"] == 0


def test_char_probs_option_sends_probabilities(decoder, tmp_path):
    path = tmp_path / "probs"
    shutil.copytree(decoder["path"], path)
    mpath = path / "manifest.json"
    d = json.loads(mpath.read_text())
    d["extra"]["bci"]["char_probs"] = True
    mpath.write_text(json.dumps(seal_manifest(d)))
    fam = _family(path, "onnxruntime")
    fam.on_message(NeuralFrame(0, decoder["trials"][0][0]))
    fam.model.run()
    msg = fam.command_message(fam.postprocess(), 0)
    assert msg.char_probs.shape == (32,) and abs(float(msg.char_probs.sum()) - 1.0) < 1e-4


# --- load-time checks ----------------------------------------------------------------
def test_inconsistent_decoder_bundle_is_refused_naming_each_problem(decoder, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(decoder["path"], bad)
    mpath = bad / "manifest.json"
    d = json.loads(mpath.read_text())
    d["extra"]["bci"]["charset"] = CHARSET[:-1]
    d["preprocess"]["mean"] = d["preprocess"]["mean"][:-1]
    d["preprocess"]["std"][3] = 0.0
    d["extra"]["bci"]["end_completion"] = {"sentence_end": "!"}
    mpath.write_text(json.dumps(seal_manifest(d)))
    with pytest.raises(BundleError) as e:
        load_bundle(bad)
    msg = str(e.value)
    assert "extra.bci.end_completion must be null or" in msg and "'!'" in msg
    assert "charset has 30 characters + blank = 31 outputs, but the graph's output 'y' has 32" in msg
    assert f"preprocess.mean has shape ({C - 1},), expected ({C},)" in msg
    assert "preprocess.std is <= 0 at channels [3]" in msg
    del d["extra"]["bci"]
    mpath.write_text(json.dumps(seal_manifest(d)))
    with pytest.raises(BundleError, match="extra.bci is missing"):
        load_bundle(bad)
