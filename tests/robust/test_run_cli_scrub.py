"""Issue 24, defect 7: ``closedloop run`` scrubs a protected bundle without ``--device`` too (``--scrub auto`` is the
default), and a bundle with injected faults can be run for a fault-injection experiment with ``--skip-checksum``."""

from __future__ import annotations

import json

import numpy as np

from closedloop.runtime import load_bundle
from closedloop.sdk.cli import main
from closedloop.sdk.robust.faults import BitFlip, write_corrupted_copy

from .conftest import KEY

RUN = ["--duration", "0.5", "--backend", "numba", "--quiet"]


def _json(out: str) -> dict:
    return json.loads(out[out.index("{"):])  # without a device, a line about the synthetic frames comes first


def test_run_without_device_scrubs_a_protected_bundle(unkeyed_bundle, capsys):
    assert main(["run", str(unkeyed_bundle), *RUN, "--json"]) == 0
    sc = _json(capsys.readouterr().out)["scrub"]
    assert sc["blocks"] > 0 and sc["full_passes"] >= 1 and sc["unrepairable"] == 0
    assert main(["run", str(unkeyed_bundle), *RUN, "--json", "--scrub", "off"]) == 0
    assert "scrub" not in _json(capsys.readouterr().out)
    assert main(["run", str(unkeyed_bundle), *RUN]) == 0
    assert "weights scrubbed:" in capsys.readouterr().out


def test_run_without_device_takes_the_weights_key_of_a_keyed_bundle(keyed_bundle, tmp_path, capsys):
    assert main(["run", str(keyed_bundle), *RUN]) == 2  # keyed, no key: refused, naming the ways to give one
    assert "--weights-key-file" in capsys.readouterr().err
    key_file = tmp_path / "weights.key"
    key_file.write_text(KEY.hex())
    assert main(["run", str(keyed_bundle), *RUN, "--json", "--weights-key-file", str(key_file)]) == 0
    assert _json(capsys.readouterr().out)["scrub"]["full_passes"] >= 1


def _faulty(bundle, tmp_path):
    b = load_bundle(bundle)
    names = list(b.manifest.extra["robust"]["tensors"])
    flips = [BitFlip(names[0], 5, 30), BitFlip(names[1], 77, 29)]
    return write_corrupted_copy(bundle, tmp_path / "faulty", None, flips), len(flips)


def test_run_skip_checksum_runs_a_fault_injected_copy_loudly_and_repairs_it(unkeyed_bundle, tmp_path, capsys):
    bad, n = _faulty(unkeyed_bundle, tmp_path)
    assert main(["run", str(bad), *RUN]) == 2
    assert "SHA-256" in capsys.readouterr().err  # refused without the flag
    assert main(["run", str(bad), *RUN, "--json", "--skip-checksum"]) == 0
    out, err = capsys.readouterr()
    assert "WARNING" in err and "--skip-checksum" in err and "fault-injection" in err
    sc = _json(out)["scrub"]
    assert sc["repaired"] == n and sc["unrepairable"] == 0  # repaired at load, before the loop started


def test_run_skip_checksum_with_a_device(unkeyed_bundle, tmp_path, capsys):
    from closedloop.runtime import RecordingReader, RecordType

    bad, n = _faulty(unkeyed_bundle, tmp_path)
    rec = tmp_path / "faulty.clrec"
    argv = ["run", str(bad), "--device", "sim://headstage?channels=12&seed=3", *RUN, "--json", "--record", str(rec)]
    assert main(argv) == 2
    assert main([*argv, "--skip-checksum"]) == 0
    out, err = capsys.readouterr()
    assert "WARNING" in err
    summary = _json(out)
    assert summary["scrub"]["repaired"] == n and summary["inputs_used"] > 0
    assert np.isfinite(summary["loop"]["latency_p99_us"])
    # the repairs made at load are in the recording too, each naming its tensor, element and bit
    events = [r.json() for r in RecordingReader(rec).of_type(RecordType.EVENT)]
    at_load = [e for e in events if e["event"] == "weights_repaired" and e.get("at_load")]
    names = list(load_bundle(unkeyed_bundle).manifest.extra["robust"]["tensors"])
    assert sorted((e["tensor"], e["index"], e["bit"]) for e in at_load) == sorted([(names[0], 5, 30),
                                                                                  (names[1], 77, 29)])


def test_scrub_policy_stop_reaches_the_session_and_its_stop_gives_exit_1(unkeyed_bundle, monkeypatch, capsys):
    """``--scrub-policy stop`` (docs/cli.md's exit code 1 for unrepairable weights): the session gets the policy, and a
    session that stopped for weights_unrepairable exits 1 (the stop itself: tests/robust/test_session_scrub.py)."""
    import closedloop.runtime as runtime
    from closedloop.runtime import run_session

    seen = {}

    def spy(bundle, cfg, **kw):
        seen["policy"] = cfg.scrub_policy
        summary = run_session(bundle, cfg, **kw)
        summary.loop.stopped_by = "weights_unrepairable"  # as the scrubber's stop leaves it
        return summary

    monkeypatch.setattr(runtime, "run_session", spy)
    code = main(["run", str(unkeyed_bundle), "--device", "sim://headstage?channels=12", "--duration", "0.3", "--quiet",
                 "--scrub-policy", "stop"])
    assert seen == {"policy": "stop"} and code == 1
    capsys.readouterr()
