"""Issue 24, defect 8: biases (the GRU's joined ONNX bias included), int8 scales and other unconstrained
weights are guarded: their clean block sums are stored in the manifest and a flip there is found and undone."""

from __future__ import annotations

import numpy as np
import pytest

from closedloop.runtime import Model, Session, SessionConfig, load_bundle
from closedloop.runtime.protect.scrubber import Scrubber, ScrubTarget, attach_scrubber
from closedloop.sdk.robust.faults import BitFlip, write_corrupted_copy

from .conftest import KEY

GRU_BIAS = "onnx::GRU_99"  # the GRU's B: bias_ih and bias_hh joined, gates re-ordered
TOP = {1: 6, 2: 14, 4: 30}  # a high exponent bit (int8: the top magnitude bit)


def _outputs(model, steps=20, seed=0):
    rng = np.random.default_rng(seed)
    model.reset()
    return np.stack([model.step(rng.standard_normal(12).astype(np.float32)).copy() for _ in range(steps)])


def test_every_precision_records_a_guard_for_each_unconstrained_weight(keyed_bundle):
    b = load_bundle(keyed_bundle)
    robust = b.manifest.extra["robust"]
    for prec, rec in robust["precisions"].items():
        inits = b.onnx("main", None if prec == "fp32" else prec).initializers
        weights = {k for k, v in inits.items() if v.dtype.kind == "f" or v.dtype == np.int8}
        assert set(rec["guard"]) == weights - set(rec["names"].values()), prec
        assert GRU_BIAS in rec["guard"] and "module.readout.bias" in rec["guard"]
    assert {"onnx::GRU_97_scale", "onnx::GRU_97_zero"} <= set(robust["precisions"]["int8"]["guard"])


def _guard_flips(bundle, variant):
    inits = bundle.onnx("main", variant).initializers
    names = [GRU_BIAS, "module.readout.bias"] + (["onnx::GRU_98_scale", "onnx::GRU_97_zero"] if variant == "int8" else [])
    return [BitFlip(n, (7 * i + 3) % inits[n].size, TOP[inits[n].itemsize]) for i, n in enumerate(names)]


@pytest.mark.parametrize("variant", [None, "fp16", "int8"])
@pytest.mark.parametrize("backend", ["numba", "onnxruntime"])
def test_a_flip_in_a_bias_or_scale_is_found_and_repaired(keyed_bundle, tmp_path, backend, variant):
    clean_bundle = load_bundle(keyed_bundle)
    try:
        clean = _outputs(Model(clean_bundle, backend=backend, variant=variant))
    except Exception as exc:  # noqa: BLE001 - numba runs fp32 graphs only
        pytest.skip(f"{backend} cannot run {variant}: {exc}")
    flips = _guard_flips(clean_bundle, variant)
    bad = write_corrupted_copy(keyed_bundle, tmp_path / "bad", variant, flips)
    model = Model(load_bundle(bad, verify_checksums=False), backend=backend, variant=variant)
    assert not np.allclose(_outputs(model), clean, atol=1e-3)
    scrubber = attach_scrubber(model, key=KEY)
    st = scrubber.stats
    assert st.repaired == len(flips) and st.unrepairable == 0, st.events
    assert st.guarded_blocks > 0 and all("repaired, verified" in e for e in st.events)
    assert {e.tensor for e in scrubber.events} == {f.tensor for f in flips}
    np.testing.assert_allclose(_outputs(model), clean, atol=1e-6)


def test_every_bit_of_the_gru_bias_is_repaired_bit_exactly(keyed_bundle):
    from closedloop.runtime.protect.scrubber import guard_positions, guard_sums

    b = load_bundle(keyed_bundle)
    rec = b.manifest.extra["robust"]["precisions"]["fp32"]["guard"][GRU_BIAS]
    w = b.onnx("main").initializers[GRU_BIAS].reshape(-1).copy()
    pos = guard_positions(w.size, 16, KEY, GRU_BIAS, 4096)
    sums = guard_sums(rec)
    wrong, repaired, unseen = [], 0, []
    for blk in (0, len(pos) - 1):
        sub = pos[blk: blk + 1]
        for e in sub[sub >= 0]:
            for bit in range(32):
                buf = w.copy()
                buf.view(np.uint32)[e] ^= np.uint32(1 << bit)
                events = Scrubber([ScrubTarget("t", buf, [(GRU_BIAS, sub, sub, *rec["tolerance"],
                                                           sums[blk: blk + 1])])]).scrub_all(restore=False)
                if not events:
                    unseen.append((int(e), bit))
                elif events[0].status == "repaired" and np.array_equal(buf.view(np.uint32), w.view(np.uint32)):
                    repaired += 1
                else:
                    wrong.append((int(e), bit, events[0].format()))
    assert not wrong
    # stored sums are exact up to float64 rounding: only the lowest mantissa bits of tiny entries can hide
    assert all(bit < 8 for _, bit in unseen), unseen
    assert repaired >= 0.9 * (repaired + len(unseen))


def test_a_session_repairs_a_flip_in_the_gru_bias_while_it_runs(keyed_bundle, tmp_path):
    key_file = tmp_path / "weights.key"
    key_file.write_text(KEY.hex())
    cfg = SessionConfig(device="sim://headstage?channels=12&seed=3", backend="numba", status=False, duration_s=0.8,
                        weights_key_file=str(key_file))
    with Session(keyed_bundle, cfg) as s:
        target = s.scrubber.scrubber.targets[0]
        t = target.tensors.index(GRU_BIAS)
        rows = target.pos[target.seg[t]: target.seg[t + 1]]
        bias = rows[rows >= 0]
        clean = target.buf[bias].copy()
        for p in bias[[1, 40, 150]]:  # three blocks of the joined bias, after the last-good copy was taken
            target.words[p] ^= np.uint32(1 << 30)
        s.start()
        summary = s.run()
        assert np.array_equal(target.buf[bias], clean)
    assert summary.scrub["repaired"] == 3 and summary.scrub["unrepairable"] == 0


def test_a_bundle_protected_before_guards_gets_them_at_load_only_when_its_checksums_held(keyed_bundle):
    for verified in (True, False):
        b = load_bundle(keyed_bundle, verify_checksums=verified)
        b.manifest.extra["robust"]["precisions"]["fp32"].pop("guard")  # as protect_bundle wrote it before
        s = attach_scrubber(Model(b, backend="onnxruntime"), key=KEY)
        names = {n for t in s.targets for n, g in zip(t.tensors, t.guarded, strict=True) if g}
        # from a file whose checksums were not verified the sums could include the faults: no guard then
        assert names == ({GRU_BIAS, "module.readout.bias"} if verified else set())
