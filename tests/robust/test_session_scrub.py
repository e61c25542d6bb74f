"""A session keeps running correct weights while bits flip under it; an unrepairable block stops it by policy."""

from __future__ import annotations

import numpy as np

from closedloop.runtime import Session, SessionConfig
from closedloop.sdk.robust.demo import FlipInjector

from .conftest import KEY


def _cfg(tmp_path, **kw):
    key_file = tmp_path / "weights.key"
    key_file.write_text(KEY.hex())
    kw.setdefault("duration_s", 1.5)
    return SessionConfig(device="sim://headstage?channels=12&seed=3", backend="numba", status=False,
                         weights_key_file=str(key_file), **kw)


def test_session_repairs_flips_injected_while_it_runs(keyed_bundle, tmp_path):
    with Session(keyed_bundle, _cfg(tmp_path)) as s:
        target = s.scrubber.scrubber.targets[0]
        weights = target.pos[target.pos >= 0]  # the arena also holds inputs, state and scratch
        clean = target.buf[weights].copy()
        inj = FlipInjector(target, count=5, every_s=0.1, bits=(30, 29, 31), seed=2, delay_s=0.2)
        s.start()
        inj.start()
        summary = s.run()
        inj.join()
        assert np.array_equal(target.buf[weights], clean)
    assert len(inj.done) == 5
    sc = summary.scrub
    assert sc["repaired"] == 5 and sc["unrepairable"] == 0 and sc["full_passes"] >= 1
    assert summary.loop.stopped_by == "duration"


def test_unrepairable_block_stops_the_session_under_policy_stop(keyed_bundle, tmp_path):
    with Session(keyed_bundle, _cfg(tmp_path, scrub_policy="stop", duration_s=3.0)) as s:
        target = s.scrubber.scrubber.targets[0]
        for j in (0, 1):  # two faults in one block
            target.words[target.pos[0, j]] ^= np.uint32(1 << 30)
        s.start()
        summary = s.run()
    assert summary.scrub["unrepairable"] >= 1
    assert summary.loop.stopped_by == "weights_unrepairable" and summary.loop.duration_s < 2.0


def test_unrepairable_block_is_restored_from_the_last_good_copy_under_policy_fallback(keyed_bundle, tmp_path):
    with Session(keyed_bundle, _cfg(tmp_path, scrub_policy="fallback", duration_s=1.0)) as s:
        target = s.scrubber.scrubber.targets[0]
        weights = target.pos[target.pos >= 0]
        clean = target.buf[weights].copy()
        for j in (0, 1):
            target.words[target.pos[0, j]] ^= np.uint32(1 << 30)
        s.start()
        summary = s.run()
        assert np.array_equal(target.buf[weights], clean)
    assert summary.scrub["restored"] == 1 and summary.loop.stopped_by == "duration"


def test_closedloop_run_takes_the_weights_key_file_the_error_names(keyed_bundle, tmp_path, capsys):
    import json

    from closedloop.sdk.cli import main

    key_file = tmp_path / "weights.key"
    key_file.write_text(KEY.hex())
    argv = ["run", str(keyed_bundle), "--device", "sim://headstage?channels=12&seed=3", "--duration", "0.5",
            "--backend", "numba", "--quiet"]
    assert main(argv) == 2  # keyed layout, no key: refused, naming the ways to give one
    assert "--weights-key-file" in capsys.readouterr().err
    assert main([*argv, "--weights-key-file", str(key_file), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["scrub"]["full_passes"] >= 1 and summary["scrub"]["unrepairable"] == 0
