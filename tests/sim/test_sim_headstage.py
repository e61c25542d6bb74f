"""The headstage streams NEURAL_FRAME bins at its rate and takes DECODER_OUTPUT from the host."""

from __future__ import annotations

import numpy as np

from closedloop.firmware_bridge import DecoderOutput, NeuralFrame


def test_frames_at_50_hz_with_increasing_bin_index_and_n_channels(host):
    h = host("sim://headstage?source=poisson&channels=192&rate=50&seed=1")
    h.handshake()
    frames = [f for _, f in h.collect(2.0, NeuralFrame)]
    assert 85 <= len(frames) <= 110, f"{len(frames)} frames in 2 s at 50 Hz"
    bins = [f.message.bin_index for f in frames]
    assert bins[0] <= 2 and np.all(np.diff(bins) == 1)
    assert all(f.message.counts.shape == (192,) and f.message.counts.dtype == np.uint16 for f in frames)
    # device timestamps are the bin times on the device's own microsecond clock
    assert np.allclose(np.diff([f.timestamp_us for f in frames]), 20_000, atol=2)
    assert h.stats.lost == 0 and h.stats.rejected == 0
    assert 0 < np.mean([f.message.counts.mean() for f in frames]) < 1.0  # ~8 Hz * 20 ms


def test_same_seed_same_counts(host):
    a = host("sim://headstage?channels=16&seed=5")
    b = host("sim://headstage?channels=16&seed=5")
    counts = []
    for h in (a, b):
        h.handshake()
        frames = {f.message.bin_index: f.message.counts for _, f in h.collect(0.4, NeuralFrame)}
        counts.append(frames)
    common = sorted(set(counts[0]) & set(counts[1]))[:10]
    assert common and all(np.array_equal(counts[0][i], counts[1][i]) for i in common)


def test_decoder_output_is_counted_and_its_text_kept(host):
    h = host("sim://headstage?channels=8")
    h.handshake()
    for i, text in enumerate(["hel", "", "lo wor", "ld"]):
        h.send(DecoderOutput(i, text, np.full(3, 0.5)))
    report = h.report()
    assert report["decoder_outputs"] == 4
    assert report["decoded_text"] == "hello world"
    assert report["last_decoded_bin"] == 3
