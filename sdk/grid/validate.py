"""``closedloop validate``: a batch of simulator-in-the-loop sessions with faults, before a live session.

Each session runs a bundle against an emulator (``sim://NAME?...``, docs/devices.md) with the
faults asked for (drops, corruption, silences, resets, glitched or non-finite frames), records itself, and is judged on the
worker that ran it: a session that misbehaved (:func:`misbehaviour`) keeps its recording, the
others' are deleted unless ``keep_all``. The sessions are cells of one grid
(:func:`closedloop.sdk.grid.run_grid`), so they run in parallel on Ray (locally or on a cluster)
and a rerun of the same batch resumes where it stopped.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from closedloop.common.jsonout import json_text
from closedloop.firmware_bridge.transports import redact_device_url
from closedloop.sdk.cli import command, trust_arg

from .runner import Cell, read_results, run_grid

#: fault name -> the emulator parameters it sets, as functions of the session's duration (seconds); a parameter
#: the device URL already gives is left as given
FAULTS: dict[str, Any] = {
    "drops": lambda d: {"drop": 0.02},
    "corruption": lambda d: {"corrupt": 0.01},
    "silences": lambda d: {"silence_at": round(0.6 * d, 3), "silence_s": round(min(0.5, 0.15 * d), 3)},
    "resets": lambda d: {"reset_at": round(0.3 * d, 3), "reset_s": round(min(0.3, 0.1 * d), 3)},
    # a misbehaving device: well-framed frames of the wrong size, or with a NaN or an infinity (float data only)
    "glitches": lambda d: {"glitch": 0.01},
    "nonfinite": lambda d: {"nonfinite": 0.01},
}


@dataclass(frozen=True)
class ValidateConfig:
    """A validation batch: ``sessions`` sessions of ``duration_s`` against ``device`` with ``faults``.

    A session misbehaved when its missed-deadline fraction exceeds ``max_miss`` or its safe
    commands exceed ``max_safe`` of its steps (see :func:`misbehaviour` for every rule).
    """

    bundle: str
    device: str
    sessions: int
    duration_s: float
    faults: tuple[str, ...] = ()
    out_dir: str = "validate-out"
    backend: str = "auto"
    max_miss: float = 0.02
    max_safe: float = 0.5
    keep_all: bool = False
    #: trusted public keys (or folders of them): given, the bundle must be signed by one of them (docs/bundle.md)
    trust: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.sessions < 1:
            raise ValueError(f"--sessions {self.sessions}: expected 1 or more")
        if not self.duration_s > 0:
            raise ValueError(f"--duration {self.duration_s}: expected seconds > 0")
        unknown = [f for f in self.faults if f not in FAULTS]
        if unknown:
            raise ValueError(f"--faults {','.join(unknown)}: unknown; choose from {','.join(FAULTS)}")
        if not self.device.startswith("sim://"):
            raise ValueError(f"--device {self.device!r}: validate runs against emulators, a sim://NAME?... URL "
                             "(closedloop device --list names them)")
        if not Path(self.bundle).exists():
            raise ValueError(f"bundle {self.bundle!r} does not exist: give a bundle folder or zip")
        for flag, v in (("--max-miss", self.max_miss), ("--max-safe", self.max_safe)):
            if not 0.0 <= v <= 1.0:  # NaN too: a limit nothing could exceed
                raise ValueError(f"{flag} {v}: a fraction of the session's steps, from 0 to 1")
        from closedloop.runtime import backend_names

        names = backend_names()
        if self.backend != "auto" and self.backend not in names:
            raise ValueError(f"--backend {self.backend!r}: unknown; choose auto or one of {', '.join(names)} "
                             "(closedloop backends)")


def session_url(device: str, faults: tuple[str, ...], duration_s: float, index: int) -> str:
    """``device`` with session ``index``'s seed (the URL's seed plus the index) and the faults' parameters.

    >>> session_url("sim://plant?model=msd&seed=5", ("drops",), 2.0, 3)
    'sim://plant?model=msd&seed=8&drop=0.02'
    """
    parts = urlsplit(device)
    params = dict(parse_qsl(parts.query, keep_blank_values=True))
    params["seed"] = str(int(params.get("seed", 0)) + index)
    for fault in faults:
        for k, v in FAULTS[fault](duration_s).items():
            params.setdefault(k, f"{v:g}")
    return urlunsplit(parts._replace(query=urlencode(params, safe=",")))


def misbehaviour(s: dict, max_miss: float, max_safe: float, nonfinite_injected: bool = False) -> list[str]:
    """What was wrong with a session, from its summary (empty: it behaved). docs/grid.md lists the rules.

    ``nonfinite_injected``: the device was told to send non-finite values (the ``nonfinite`` fault), so non-finite
    inputs are what it was asked for; a non-finite output still counts."""
    from closedloop.runtime.stats import SAFETY_STOPS

    why = []
    loop = s["loop"]
    if s.get("error"):
        why.append(f"ended with an error: {s['error']}")
    if loop["stopped_by"] in SAFETY_STOPS or loop["stopped_by"] not in ("duration", "steps"):
        why.append(f"stopped by {loop['stopped_by']}, not by its duration")
    if loop["missed_fraction"] > max_miss:
        why.append(f"missed {100 * loop['missed_fraction']:.2f}% of deadlines (limit {100 * max_miss:g}%)")
    steps = max(1, loop["steps"])
    if s["safe_commands_sent"] > max_safe * steps:
        why.append(f"safe command in {s['safe_commands_sent']} of {steps} periods (limit {100 * max_safe:g}%)")
    if (s["nonfinite_inputs"] and not nonfinite_injected) or s["nonfinite_outputs"]:
        why.append(f"non-finite values: {s['nonfinite_inputs']} inputs, {s['nonfinite_outputs']} outputs")
    if s["inputs_used"] == 0:
        why.append("never acted on an input frame")
    if s["stop_commands_sent"] == 0:
        why.append("the link was down at the end: no safe command at stop")
    return why


def run_validation_session(config: dict, seed: int) -> dict:
    """One cell: run the session, check its recording, judge it, delete a well-behaved one's recording."""
    from closedloop.runtime import SessionConfig, run_session
    from closedloop.runtime.recording import RecordingReader

    record = Path(config["record"])
    record.parent.mkdir(parents=True, exist_ok=True)
    if record.exists():  # an earlier attempt at this session that never finished (its worker died, Ctrl-C):
        n = 1            # kept beside, never overwritten, and this attempt records afresh
        while (kept := record.with_name(f"{record.name}.attempt{n}")).exists():
            n += 1
        record.rename(kept)
    started = time.perf_counter()
    s = run_session(config["bundle"], SessionConfig(device=config["device"], duration_s=config["duration_s"],
                                                    record=str(record), backend=config["backend"], status=False,
                                                    trust=config.get("trust", [])))
    d = s.to_dict()
    # Ctrl-C or SIGTERM reached a session running in the driver's own process (--no-ray): the session's loop took the
    # signal to end itself cleanly (its recording is whole); the batch ends too, as the signal asked, and a rerun
    # runs this session again
    if d["loop"]["stopped_by"] == "interrupt":
        raise KeyboardInterrupt
    if d["loop"]["stopped_by"] == "terminated":
        from .runner import Terminated

        raise Terminated(143)
    # the device asked to send non-finite values (the nonfinite fault, or nonfinite= in the URL itself)
    asked = float(dict(parse_qsl(urlsplit(config["device"]).query)).get("nonfinite") or 0) > 0
    why = misbehaviour(d, config["max_miss"], config["max_safe"], nonfinite_injected=asked)
    try:
        reader = RecordingReader(str(record))
        records = sum(1 for _ in reader)
        if reader.summary is None:
            why.append(f"recording {record} has no closing summary: it lost its end")
    except Exception as exc:  # an unreadable or missing recording is itself a finding
        why.append(f"recording {record} unreadable: {type(exc).__name__}: {exc}")
        records = 0
    kept = bool(why) or config["keep_all"]
    if not kept:
        record.unlink(missing_ok=True)
    loop = d["loop"]
    return {"index": config["index"], "device": redact_device_url(config["device"]), "misbehaved": why, "recording": str(record),
            "recording_kept": kept, "recording_records": records, "steps": loop["steps"],
            "stopped_by": loop["stopped_by"], "missed_deadlines": loop["missed_deadlines"],
            "missed_fraction": loop["missed_fraction"], "latency_p99_us": loop["latency_p99_us"],
            "safe_commands_sent": d["safe_commands_sent"], "watchdog_trips": d["watchdog_trips"],
            "reconnects": d["reconnects"], "link": {k: v for k, v in d["link"].items() if isinstance(v, int | float)},
            "frames_received": d["frames_received"], "inputs_used": d["inputs_used"],
            "inputs_refused": d["inputs_refused"], "nonfinite_inputs": d["nonfinite_inputs"],
            "session_wall_s": round(time.perf_counter() - started, 3)}


def _check_the_device_fits(cfg: ValidateConfig) -> None:
    """One handshake with the device before the batch: a bundle that does not fit it (another kind of device,
    channel count, rate or limits) is bad input, said once with the reasons (``DeviceMismatchError``, exit 2),
    not a "misbehaved" session per seed after the whole batch has run."""
    from closedloop.runtime import BackendUnavailableError, Session, SessionConfig

    def session(backend: str) -> Session:
        # session 0's own URL, faults and all: a fault the device cannot take is refused here too (its first timed
        # fault plays well after the handshake)
        return Session(cfg.bundle, SessionConfig(device=session_url(cfg.device, cfg.faults, cfg.duration_s, 0),
                                                 status=False, duration_s=cfg.duration_s, backend=backend,
                                                 trust=list(cfg.trust)))

    try:
        s = session(cfg.backend)
    except BackendUnavailableError:  # the workers' backend (a cluster's GPUs): the fit is the same on any
        s = session("auto")
    try:
        s.start()
    finally:
        s.close()


def validate(cfg: ValidateConfig, address: str | None = None, workers: int | None = None, progress: bool = True,
             backend: str = "auto") -> dict:
    """Run the batch; write ``out_dir/sessions.jsonl`` (one line per session) and ``out_dir/validate.json``."""
    from closedloop.runtime import load_bundle

    # the bundle is checked here, once, before any session (a bundle that does not verify is bad input, exit 2);
    # its manifest's digest is part of each session's key, so a changed bundle is validated afresh, never resumed
    checked = load_bundle(cfg.bundle, trust=list(cfg.trust) or None)
    _check_the_device_fits(cfg)
    manifest_sha = hashlib.sha256((checked.root / "manifest.json").read_bytes()).hexdigest()
    out = Path(cfg.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    bundle = str(Path(cfg.bundle).resolve())
    cells = [Cell({"bundle": bundle, "bundle_manifest_sha256": manifest_sha,
                   "device": session_url(cfg.device, cfg.faults, cfg.duration_s, i),
                   "duration_s": cfg.duration_s, "record": str(out / f"session-{i:04d}.clrec"), "index": i,
                   "backend": cfg.backend, "max_miss": cfg.max_miss, "max_safe": cfg.max_safe,
                   "keep_all": cfg.keep_all} | ({"trust": list(cfg.trust)} if cfg.trust else {}),
                   seed=i) for i in range(cfg.sessions)]
    stored = read_results(out / "sessions.jsonl")
    reused_keys = {c.key for c in cells if stored.get(c.key, {}).get("status") == "ok"}
    reused = len(reused_keys)
    t0 = time.perf_counter()
    recs = run_grid(run_validation_session, cells, results=out / "sessions.jsonl", address=address, workers=workers,
                    progress=progress, backend=backend, desc="validate")
    sessions = []
    for r in recs:
        if r["status"] == "ok":
            sessions.append(r["result"] | {"node": r["node"]})
        else:  # the session raised (a handshake that timed out, a bundle refused) or its worker died
            c = r["config"]
            why = " ".join(r["error"].split("\nTraceback")[0].split())  # the whole message, without the traceback
            sessions.append({"index": c["index"], "device": redact_device_url(c["device"]), "node": r.get("node", ""),
                             "misbehaved": [f"failed: {why}"], "recording": c["record"],
                             "recording_kept": Path(c["record"]).exists(), "error": r["error"]})
    bad = [s for s in sessions if s["misbehaved"]]
    ran = [s for s in sessions if "steps" in s]
    miss = [s["missed_fraction"] for s in ran]
    report = {
        "bundle": bundle, "device": redact_device_url(cfg.device), "faults": list(cfg.faults), "sessions": cfg.sessions,
        "duration_s": cfg.duration_s, "wall_s": round(time.perf_counter() - t0, 2),
        "reused": reused,  # sessions taken from sessions.jsonl, run before with this bundle and these settings
        # the nodes this run's sessions ran on (sessions taken from an earlier run ran where that run put them)
        "nodes": sorted({r.get("node") for r in recs if r.get("node") and r["key"] not in reused_keys}),
        "success_rate": (len(sessions) - len(bad)) / len(sessions),
        "deadline_miss_rate": {"mean": sum(miss) / len(miss) if miss else None, "max": max(miss, default=None)},
        "safe_command_periods": {"total": sum(s["safe_commands_sent"] for s in ran),
                                 "max": max((s["safe_commands_sent"] for s in ran), default=None),
                                 "watchdog_trips": sum(s["watchdog_trips"] for s in ran)},
        "misbehaved": [{"index": s["index"], "why": s["misbehaved"], "recording": s["recording"]} for s in bad],
        "recordings_kept": [s["recording"] for s in sessions if s.get("recording_kept")],
        "limits": {"max_miss": cfg.max_miss, "max_safe": cfg.max_safe},
        "session_summaries": sessions,
    }
    (out / "validate.json").write_text(json_text(report) + "\n")
    return report


def format_report(r: dict) -> str:
    m = r["deadline_miss_rate"]
    reused = r.get("reused", 0)
    lines = [f"validate: {r['sessions']} sessions of {r['duration_s']:g} s on {r['device']} "
             f"(faults: {','.join(r['faults']) or 'none'}) in {r['wall_s']:.1f} s on {len(r['nodes'])} node(s)"
             + (f"; {reused} of them from an earlier run of the same bundle and settings (sessions.jsonl; a new "
                "--out runs them all again)" if reused else ""),
             f"  behaved {100 * r['success_rate']:.1f}%; deadline misses mean "
             + (f"{100 * m['mean']:.3f}% max {100 * m['max']:.3f}%" if m["mean"] is not None else "n/a")
             + f"; safe-command periods {r['safe_command_periods']['total']} "
               f"(watchdog trips {r['safe_command_periods']['watchdog_trips']})"]
    for b in r["misbehaved"]:
        kept = f"recording kept: {b['recording']}" if Path(b["recording"]).exists() else "no recording"
        lines.append(f"  session {b['index']} misbehaved: {'; '.join(b['why'])} ({kept})")
    return "\n".join(lines)


def _validate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("bundle", help="the bundle each session runs (folder or zip)")
    p.add_argument("--device", required=True, help="emulator URL, sim://NAME?... (docs/devices.md)")
    p.add_argument("--sessions", type=int, required=True, help="how many sessions (each its own seed)")
    p.add_argument("--duration", type=float, required=True, help="seconds per session")
    p.add_argument("--faults", default="", help=f"comma-separated faults to inject: {','.join(FAULTS)}")
    p.add_argument("--address", default=None, help="a Ray cluster's address (default: a local Ray instance, or "
                                                    "in-process one by one without the [scale] extra)")
    p.add_argument("--no-ray", action="store_true", help="run the sessions in this process, one after another")
    p.add_argument("--workers", type=int, default=None, help="sessions at a time on a local instance (default: CPUs)")
    p.add_argument("--out", default="validate-out", help="folder for recordings, sessions.jsonl and validate.json")
    p.add_argument("--backend", default="auto", help="backend name or 'auto'")
    p.add_argument("--max-miss", type=float, default=0.02, help="missed-deadline fraction above which a session "
                                                                 "misbehaved (default 0.02)")
    p.add_argument("--max-safe", type=float, default=0.5, help="fraction of periods with the safe command above "
                                                                "which a session misbehaved (default 0.5)")
    p.add_argument("--keep-all", action="store_true", help="keep every session's recording, not only misbehaving ones")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    trust_arg(p)


@command("validate", "run a batch of simulator-in-the-loop sessions with faults; exit 1 if any misbehaved",
         _validate_args)
def _validate(a: argparse.Namespace) -> int:
    faults = tuple(f.strip() for f in a.faults.split(",") if f.strip())
    cfg = ValidateConfig(a.bundle, a.device, a.sessions, a.duration, faults, a.out, a.backend, a.max_miss,
                         a.max_safe, a.keep_all, tuple(a.trust))
    report = validate(cfg, address=a.address, workers=a.workers, progress=not a.json and sys.stderr.isatty(),
                      backend="inprocess" if a.no_ray else "auto")
    print(json_text(report) if a.json else format_report(report))
    return 1 if report["misbehaved"] else 0


os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # a validation batch reports nothing to Ray's servers
