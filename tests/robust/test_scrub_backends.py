"""Repair through each backend (Numba arena in place, ONNX Runtime rebuilt), load-time scrub, time budget."""

from __future__ import annotations

import numpy as np
import pytest

from closedloop.runtime import Model, load_bundle
from closedloop.runtime.errors import BundleError
from closedloop.runtime.protect.scrubber import ScrubError, WeightsCorruptedError, attach_scrubber
from closedloop.sdk.robust.faults import BitFlip, write_corrupted_copy

from .conftest import KEY


def _outputs(model, steps=20, seed=0):
    rng = np.random.default_rng(seed)
    model.reset()
    return np.stack([model.step(rng.standard_normal(12).astype(np.float32)).copy() for _ in range(steps)])


def _exponent_flips(bundle, variant, n, seed):
    """One high-bit flip in each of ``n`` different blocks of the protected tensors."""
    layout = bundle.manifest.extra["robust"]
    prec = layout["precisions"][variant or "fp32"]
    inits = bundle.onnx("main", variant).initializers
    rng = np.random.default_rng(seed)
    out = []
    for name in list(layout["tensors"])[:n]:
        o = prec["names"][name]
        top = {1: 6, 2: 14, 4: 30}[inits[o].itemsize]
        out.append(BitFlip(o, int(rng.integers(inits[o].size)), top))
    return out


@pytest.mark.parametrize("variant", [None, "fp16", "int8"])
@pytest.mark.parametrize("backend", ["numba", "onnxruntime"])
def test_corrupted_copy_is_refused_then_repaired_at_load_to_the_clean_outputs(keyed_bundle, tmp_path, backend, variant):
    clean_bundle = load_bundle(keyed_bundle)
    try:
        clean = _outputs(Model(clean_bundle, backend=backend, variant=variant))
    except Exception as exc:  # noqa: BLE001 - numba runs fp32 graphs only
        pytest.skip(f"{backend} cannot run {variant}: {exc}")
    flips = _exponent_flips(clean_bundle, variant, 3, seed=1)
    bad = write_corrupted_copy(keyed_bundle, tmp_path / "bad", variant, flips)
    with pytest.raises(BundleError, match="SHA-256"):
        load_bundle(bad)
    model = Model(load_bundle(bad, verify_checksums=False), backend=backend, variant=variant)
    corrupted = _outputs(model)
    assert not np.allclose(corrupted, clean, atol=1e-3)
    scrubber = attach_scrubber(model, key=KEY)
    assert scrubber.stats.repaired == len(flips) and scrubber.stats.unrepairable == 0
    np.testing.assert_allclose(_outputs(model), clean, atol=1e-6)


def test_keyed_bundle_needs_the_right_key(keyed_bundle):
    model = Model(load_bundle(keyed_bundle), backend="onnxruntime")
    with pytest.raises(ScrubError, match="keyed"):
        attach_scrubber(model, key=None)
    with pytest.raises(ScrubError, match="fingerprint"):
        attach_scrubber(model, key=b"wrong key")
    assert KEY.hex() not in (load_bundle(keyed_bundle).root / "manifest.json").read_text()


def test_two_faults_in_one_block_at_load_are_refused(unkeyed_bundle, tmp_path):
    b = load_bundle(unkeyed_bundle)
    name = next(iter(b.manifest.extra["robust"]["tensors"]))
    bad = write_corrupted_copy(unkeyed_bundle, tmp_path / "bad", None, [BitFlip(name, 1, 30), BitFlip(name, 5, 30)])
    model = Model(load_bundle(bad, verify_checksums=False), backend="numba")
    with pytest.raises(WeightsCorruptedError, match="cannot be repaired"):
        attach_scrubber(model, key=None)


def test_step_keeps_to_its_budget_and_covers_every_block_round_robin(unkeyed_bundle):
    model = Model(load_bundle(unkeyed_bundle), backend="numba")
    s = attach_scrubber(model)
    total = s.stats.blocks
    per_step = max(1, int(20_000 / s.stats.ns_per_block))  # a 20 us budget
    target = s.targets[0]
    p = int(target.pos[total - 1, 3])  # a fault in the last block: found only when the cursor gets there
    target.words[p] ^= np.uint32(1 << 30)
    checked0 = s.stats.blocks_checked
    events = s.step(20_000)
    assert s.stats.blocks_checked - checked0 == min(per_step, total)
    steps = 1
    while not events:
        events = s.step(20_000)
        steps += 1
        assert steps <= total // per_step + 2
    assert events[0].status == "repaired" and events[0].block == total - 1


def test_the_exact_int8_variant_carries_its_tensorrt_report(keyed_bundle):
    # bundle.md: every variant record says whether TensorRT's parser takes it (inspect prints it per variant)
    v = load_bundle(keyed_bundle).graph().variants["int8"]
    assert v["quantizer"].startswith("closedloop.sdk.robust") and v["tensorrt_compatibility"]["checked_without_tensorrt"]
    assert isinstance(v["tensorrt_compatibility"]["compatible"], bool)


@pytest.fixture(scope="module")
def tail_bundle(tmp_path_factory):
    """An MLP whose second weight has 66 elements: four blocks of 16 and a tail of 2, too few to constrain."""
    import torch

    from closedloop.export import export_bundle
    from closedloop.sdk.robust.bundle import protect_bundle
    from closedloop.sdk.robust.protection import finalize, protect

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(12, 11), torch.nn.Tanh(), torch.nn.Linear(11, 6), torch.nn.Tanh(),
                              torch.nn.Linear(6, 3)).eval()
    plan = protect(net, torch.zeros(1, 12), kind="feedforward", k=16, key=KEY, min_numel=64)
    finalize(net, plan, KEY)
    path = export_bundle(net, tmp_path_factory.mktemp("tail") / "mlp", kind="feedforward",
                         example_input=torch.zeros(1, 12), rate_hz=100.0, variants=(), tensorrt=False,
                         report=lambda s: None)
    return protect_bundle(path, plan, KEY, int8=False, report=lambda s: None)


@pytest.mark.parametrize("backend", ["numba", "onnxruntime"])
def test_the_members_left_over_by_a_constrained_tensors_last_block_are_guarded(tail_bundle, tmp_path, backend):
    """66 elements in blocks of 16 leave 2 that no zero-sum block holds: their clean sums are stored, so a flip
    there is found and repaired like any other (they were neither checked nor listed as unprotected)."""
    from closedloop.runtime.protect.scrubber import tail_positions

    bundle = load_bundle(tail_bundle)
    layout = bundle.manifest.extra["robust"]
    name = next(t for t, shape in layout["tensors"].items() if int(np.prod(shape)) == 66)
    tail = tail_positions(66, layout["k"], KEY, name, layout["window"])
    assert tail is not None and int((tail >= 0).sum()) == 2
    assert name in layout["precisions"]["fp32"]["tail"]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 12)).astype(np.float32)
    clean = np.stack([Model(bundle, backend=backend).step(r).copy() for r in x])
    o = layout["precisions"]["fp32"]["names"][name]
    for i, member in enumerate(tail[tail >= 0]):
        bad = write_corrupted_copy(tail_bundle, tmp_path / f"bad{i}", None, [BitFlip(o, int(member), 30)])
        model = Model(load_bundle(bad, verify_checksums=False), backend=backend)
        assert not np.allclose(np.stack([model.step(r).copy() for r in x]), clean, atol=1e-3)
        scrubber = attach_scrubber(model, key=KEY)
        assert scrubber.stats.repaired == 1 and scrubber.stats.guarded_blocks >= 1
        np.testing.assert_allclose(np.stack([model.step(r).copy() for r in x]), clean, atol=1e-6)


def test_inspect_says_a_bundle_is_protected_and_how(keyed_bundle, unkeyed_bundle):
    from closedloop.sdk.inspect_bundle import render_manifest

    text = render_manifest(load_bundle(keyed_bundle).manifest)
    fp = load_bundle(keyed_bundle).manifest.extra["robust"]["key_fingerprint"]
    assert f"weights protected: 3 tensors in zero-sum blocks of 16, keyed (key fingerprint {fp})" in text
    assert "not keyed" in render_manifest(load_bundle(unkeyed_bundle).manifest)
