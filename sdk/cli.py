"""The ``closedloop`` command line: one subcommand per stage.

Subcommands register themselves with ``@command`` (name, help, argument setup), so
adding one is a function here or in a family's module, never an if/elif chain.

Exit codes (docs/cli.md): 0 a clean end; 1 a check that failed or a session stopped by a
safety rule (overrun policy stop, the device changed, the watchdog limit, unrepairable
weights); 2 usage or bad input; 130 Ctrl-C; 141 a closed output pipe (``| head``); SIGTERM outside a
session's loop: everything closed, then the process ends by SIGTERM (143).
With ``--json`` a command prints only JSON on stdout; everything else goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import numpy as np

from closedloop.common.jsonout import json_text

_COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {}


def command(name: str, help: str, setup: Callable[[argparse.ArgumentParser], None] = lambda p: None):
    def deco(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        _COMMANDS[name] = (help, setup, fn)
        return fn

    return deco


def _jsonable(obj: object) -> object:
    """A report dataclass as a dict (``--json``)."""
    import dataclasses

    return dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) and not isinstance(obj, type) else obj


def trust_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trust", action="append", default=[], metavar="PATH",
                   help="a trusted public key (NAME.pub from closedloop keygen) or a folder of them; repeatable. "
                        "Given, a bundle must be signed by one of these keys (docs/bundle.md)")


def _inspect_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("bundle", help="bundle folder or zip")
    p.add_argument("--json", action="store_true", help="print the manifest and problems as JSON")
    trust_arg(p)


@command("inspect", "print a bundle's manifest and verify it", _inspect_args)
def _inspect(a: argparse.Namespace) -> int:
    from .inspect_bundle import inspect_bundle

    text, ok = inspect_bundle(a.bundle, as_json=a.json, trust=a.trust)
    print(text)
    return 0 if ok else 1


def _backends_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("bundle", nargs="?", help="also check which backends can run this bundle's main graph")
    p.add_argument("--json", action="store_true", help="print {backend: {available, reason}} as JSON")


@command("backends", "list backends and whether each can run here", _backends_args)
def _backends(a: argparse.Namespace) -> int:
    from closedloop.runtime import backend_report, load_bundle

    path = spec = None
    if a.bundle:
        b = load_bundle(a.bundle)
        path, spec = b.graph_path(), b.graph()
    report = backend_report(path, spec)
    if a.json:
        print(json_text({name: {"available": bool(av), "reason": av.reason} for name, av in report.items()}))
        return 0
    for name, av in report.items():
        print(f"{name:<22} {'available' if av else 'unavailable':<12} {av.reason}")
    return 0


def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("bundle", help="bundle folder or zip")
    p.add_argument("--device", default=None,
                   help="device URL: a port path, serial:///dev/ttyACM0?baud=921600, sim://NAME?..., replay://FILE, "
                        "lsl://STREAM?type=... (an LSL stream, [lsl] extra), loop://, socket://HOST:PORT (spy+URL "
                        "hexdumps traffic). Without it, synthetic frames drive the loop")
    p.add_argument("--backend", default="auto", help="backend name or 'auto' (fastest measured here)")
    p.add_argument("--variant", default=None,
                   help="graph variant: fp32, fp16, int8, fp16w or int8w (those the bundle holds; default fp32, or "
                        "with --backend auto a variant recorded as auto_choice when within tolerance and faster)")
    p.add_argument("--duration", type=float, default=None, help="seconds to run (default: until Ctrl-C; 5 s without a device)")
    p.add_argument("--rate", type=float, default=None, help="loop rate in Hz (default: the bundle's)")
    p.add_argument("--overrun", choices=["skip", "hold", "stop"], default="hold",
                   help="a step that ends past the next deadline: hold (default) resumes at the next deadline ahead "
                        "and re-sends the last command once per skipped period; skip resumes without re-sending; "
                        "stop ends the session (exit 1). docs/runtime.md, 'The loop'")
    p.add_argument("--record", default=None, help="write a crash-safe recording of the session here")
    p.add_argument("--watchdog", type=float, default=0.25, help="seconds without input before the safe command")
    p.add_argument("--handshake-timeout", type=float, default=10.0, metavar="S",
                   help="with --device: seconds to wait for the device's HELLO before giving up (exit 2; default 10)")
    p.add_argument("--key", default=None, help="hex shared secret for a signed link")
    p.add_argument("--weights-key-file", default=None,
                   help="key of a protected bundle's keyed weight layout (docs/robustness.md; or "
                        "$CLOSEDLOOP_WEIGHTS_KEY_FILE / $CLOSEDLOOP_WEIGHTS_KEY)")
    p.add_argument("--scrub", choices=("auto", "off"), default="auto",
                   help="weight scrubbing of a protected bundle in the loop's idle time (default auto)")
    p.add_argument("--scrub-policy", choices=("fallback", "stop"), default="fallback",
                   help="a block the scrubber cannot repair: fallback (restore it from the last-good copy, default) "
                        "or stop (safe output, end the session: stopped_by weights_unrepairable, exit 1)")
    p.add_argument("--skip-checksum", action="store_true",
                   help="FAULT-INJECTION EXPERIMENTS ONLY: run a bundle whose file checksums fail (a copy written by "
                        "closedloop inject-faults); never for a bundle that drives real hardware")
    p.add_argument("--input", action="append", default=[], metavar="NAME=V1,V2,...",
                   help="value of a model input the device does not stream (a goal, a mode); repeat per input")
    p.add_argument("--monitor", default=None, metavar="[HOST:]PORT",
                   help="serve a live view of the session in a browser (127.0.0.1:PORT; 0 picks a free port; "
                        "needs the [monitor] extra)")
    p.add_argument("--monitor-public", action="store_true",
                   help="allow --monitor on an address other machines reach (a token is then required and printed)")
    p.add_argument("--lsl-out", default=None, metavar="NAME",
                   help="publish the session as LSL outlets: NAME-outputs, NAME-commands (a command with values), "
                        "NAME-text (typed text), NAME-state (an observer's estimate) ([lsl] extra; docs/lsl.md)")
    p.add_argument("--lsl-out-wait", type=float, default=0.0, metavar="S",
                   help="with --lsl-out: publish nothing until every outlet has a consumer (a recorder), at most S "
                        "seconds; the steps meanwhile are published after, with their own timestamps")
    p.add_argument("--watchdog-limit", type=float, default=None, metavar="S",
                   help="end the session (exit 1) after S seconds without input; default: wait for the device")
    p.add_argument("--wake-on-input", action="store_true",
                   help="with --device: step as soon as a frame arrives instead of on the next tick of the rate's "
                        "clock (the rate is then the watchdog's tick); for a stream paced by its own clock, such as LSL")
    p.add_argument("--rt", action="store_true",
                   help="real-time settings for the loop: SCHED_FIFO, memory locked (mlockall), pinned with --cpu; "
                        "refused with the reason where not permitted (docs/realtime.md; check with closedloop doctor)")
    p.add_argument("--cpu", type=int, default=None, metavar="N", help="with --rt: pin the loop's thread to CPU N")
    p.add_argument("--priority", type=int, default=None, metavar="P",
                   help="with --rt: the SCHED_FIFO priority, 1-99 (default 80)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic frames when there is no --device")
    p.add_argument("--quiet", action="store_true", help="no live status line")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    trust_arg(p)


def _held_inputs(given: list[str]) -> dict[str, list[float]]:
    """``--input NAME=V1,V2`` options as ``{NAME: [V1, V2]}``, refusing a malformed one by its text."""
    values: dict[str, list[float]] = {}
    for item in given:
        name, eq, text = item.partition("=")
        try:
            if not eq or not name:
                raise ValueError
            values[name] = [float(v) for v in text.split(",")]
        except ValueError:  # bad input: exit 2 through main, with the command's name
            raise ValueError(f"--input {item!r}: expected NAME=V1,V2,... (numbers separated by commas)") from None
    return values


def _run_bundle(a: argparse.Namespace):
    """The bundle path, or with ``--skip-checksum`` the bundle loaded without its checksums, said loudly."""
    if not a.skip_checksum:
        return a.bundle
    if getattr(a, "trust", None):
        raise ValueError("--skip-checksum cannot be combined with --trust: a trusted bundle is verified in every byte")
    from closedloop.runtime import load_bundle

    bar = "!" * 78
    print(f"{bar}\n!! WARNING: --skip-checksum: {a.bundle} is run WITHOUT verifying its SHA-256 checksums.\n"
          "!! For fault-injection experiments only (a copy from closedloop inject-faults): a corrupted or altered\n"
          f"!! bundle runs as if it were good. Never use it to drive hardware that matters.\n{bar}", file=sys.stderr)
    return load_bundle(a.bundle, verify_checksums=False)


@command("run", "run a bundle in the real-time loop against a device (or synthetic frames)", _run_args)
def _run(a: argparse.Namespace) -> int:
    for flag, value, unit, default in (("--rate", a.rate, "Hz", "to use the bundle's rate"),
                                       ("--duration", a.duration, "seconds", "to run until Ctrl-C"),
                                       ("--watchdog", a.watchdog, "seconds", "for the default 0.25 s"),
                                       ("--handshake-timeout", a.handshake_timeout, "seconds", "for the default 10 s"),
                                       ("--watchdog-limit", a.watchdog_limit, "seconds", "for no limit")):
        if value is not None and not (np.isfinite(value) and value > 0):
            raise ValueError(f"{flag} {value:g}: must be a positive number of {unit} (leave it out {default})")
    if a.device:
        from closedloop.runtime import SessionConfig, run_session

        cfg = SessionConfig(
            device=a.device, backend=a.backend, variant=a.variant, duration_s=a.duration, rate_hz=a.rate,
            record=a.record, watchdog_s=a.watchdog, overrun=a.overrun, key=a.key, status=not a.quiet,
            handshake_timeout_s=a.handshake_timeout,
            weights_key_file=a.weights_key_file, scrub=a.scrub, scrub_policy=a.scrub_policy,
            inputs=_held_inputs(a.input), trust=a.trust,
            monitor=a.monitor, monitor_public=a.monitor_public, lsl_out=a.lsl_out, lsl_out_wait_s=a.lsl_out_wait,
            watchdog_limit_s=a.watchdog_limit,
            wake_on_input=a.wake_on_input, **_rt_settings(a),
        )
        from closedloop.runtime.session import DeviceChangedError

        try:
            summary = run_session(_run_bundle(a), cfg)
        except DeviceChangedError as exc:  # a safety stop, not bad input: the summary still comes out (with error)
            stopped = getattr(exc, "summary", None)
            if stopped is not None:
                print(json_text(stopped.to_dict()) if a.json else stopped.format())
            print(f"closedloop run: stopped: {exc}", file=sys.stderr)
            return EXIT_FAILED
        print(json_text(summary.to_dict()) if a.json else summary.format())
        if summary.commands_sent == 0 and (summary.inputs_refused or summary.nonfinite_inputs):
            print(f"closedloop run: warning: the model never acted: every input frame was refused "
                  f"({summary.nonfinite_inputs} with a value not finite, {summary.inputs_refused} of the wrong size), "
                  "so the device got only the safe command; check the device's stream (docs/recording.md: "
                  "input_refused and nonfinite events)", file=sys.stderr)
        if summary.recording_error:  # the session ran on; what it should have kept is partly lost: not a clean end
            print(f"closedloop run: error: the recording {a.record} stopped: {summary.recording_error}",
                  file=sys.stderr)
            return max(_exit_code(summary.loop.stopped_by), EXIT_FAILED)
        return _exit_code(summary.loop.stopped_by)
    device_only = [flag for flag, value in (("--record", a.record), ("--key", a.key), ("--monitor", a.monitor),
                                            ("--lsl-out", a.lsl_out), ("--lsl-out-wait", a.lsl_out_wait)) if value]
    if device_only:
        print(f"closedloop run: error: {' and '.join(device_only)} need{'s' if len(device_only) == 1 else ''} --device: "
              "without a device the loop runs on synthetic frames, with no link to sign, nothing to record, watch or "
              "publish", file=sys.stderr)
        return 2
    from closedloop.runtime import LoopConfig, Model, RealTimeLoop, SessionConfig, get_family, load_bundle
    from closedloop.runtime.protect.scrubber import session_scrubber

    bundle = _run_bundle(a)
    bundle = load_bundle(bundle, trust=a.trust or None) if isinstance(bundle, str) else bundle
    model = Model(bundle, backend=a.backend, variant=a.variant)
    # a protected bundle is scrubbed in the loop's idle time as a session does (same defaults: budget, policy)
    scrub = session_scrubber(model, SessionConfig(device="(synthetic frames)", scrub=a.scrub, scrub_policy=a.scrub_policy,
                                                  weights_key_file=a.weights_key_file))
    fam = get_family(bundle.manifest.family)(bundle, model)
    held = _held_inputs(a.input)
    for name in fam.held_inputs():  # synthetic frames: a held input nobody gave is zeros
        held.setdefault(name, np.zeros(model.inputs[name].shape, dtype=np.float32))
    fam.set_held_inputs(held)
    rng = np.random.default_rng(a.seed)
    # one frame as a device's message gives it: its values in a row (a window over (1, channels, time) included)
    frames = rng.standard_normal((256, int(np.prod(fam.measurement.frame_shape)))).astype(np.float32)
    rate = bundle.manifest.rate_hz if a.rate is None else a.rate
    duration = 5.0 if a.duration is None else a.duration
    choice = model.choice
    log = sys.stderr if a.json else sys.stdout  # --json: stdout holds only the JSON
    say = (lambda *_args, **_kw: None) if a.quiet else print  # -q: only warnings and errors
    if choice.p99_us:
        say("backend auto-selection (p99 us): " + ", ".join(f"{k} {v:.1f}" for k, v in choice.p99_us.items()),
            file=log)
    for k, why in choice.skipped.items():
        say(f"  skipped {k}: {why}", file=log)
    say(f"no --device: synthetic frames into {bundle.manifest.name or a.bundle} on {model.backend_name} "
        f"at {rate:g} Hz for {duration:g} s (Ctrl-C stops)", file=log)

    def step(k: int) -> None:
        fam.preprocess(frames[k & 255])
        if fam.model_due():
            model.run()
            fam.postprocess()

    loop = RealTimeLoop(LoopConfig(rate_hz=rate, duration_s=duration, overrun=a.overrun))

    def idle(k: int, budget_ns: int) -> None:
        if scrub.on_idle(budget_ns) == "stop":  # an unrepairable block under policy "stop"
            loop.stop("weights_unrepairable")

    with _rt_context(a, loop.config.freeze_gc) as grant:
        summary = loop.run(step, on_idle=idle if scrub is not None else None)
    sc = scrub.summary() if scrub is not None else {}
    rt = {"realtime": grant.to_dict()} if grant is not None else {}
    if a.json:
        print(json_text(summary.to_dict() | ({"scrub": sc} if sc else {}) | rt))
        return _exit_code(summary.stopped_by)
    print(summary.format())
    if grant is not None:
        print(f"  {grant.format()}")
    if sc:
        print(f"  weights scrubbed: {sc['full_passes']} full passes, repaired {sc['repaired']}, restored "
              f"{sc['restored']}, unrepairable {sc['unrepairable']} (full scrub {sc['full_scrub_us']:.0f} us)")
        for line in sc["events"][:5]:
            print(f"    {line}")
    return _exit_code(summary.stopped_by)


def _rt_settings(a: argparse.Namespace) -> dict:
    """``--rt --cpu N --priority P`` as SessionConfig's fields; --cpu or --priority without --rt is refused."""
    if not a.rt and (a.cpu is not None or a.priority is not None):
        raise ValueError("--cpu and --priority are real-time settings: add --rt (closedloop run BUNDLE --rt --cpu 1)")
    from closedloop.runtime.realtime import DEFAULT_PRIORITY

    return {"rt": a.rt, "rt_cpu": a.cpu, "rt_priority": DEFAULT_PRIORITY if a.priority is None else a.priority}


def _rt_context(a: argparse.Namespace, gc_frozen: bool):
    """The no-device loop's real-time settings as a context (yields the grant, or None without --rt)."""
    import contextlib

    from closedloop.runtime.realtime import RealtimeConfig, realtime

    rt = _rt_settings(a)
    if not rt["rt"]:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def ctx():
        with realtime(RealtimeConfig(priority=rt["rt_priority"], cpu=rt["rt_cpu"])) as grant:
            grant.gc_frozen = gc_frozen
            yield grant

    return ctx()


def _exit_code(stopped_by: str) -> int:
    """A run's exit code from what ended its loop (module docstring)."""
    from closedloop.runtime.stats import SAFETY_STOPS

    if stopped_by == "interrupt":
        return EXIT_INTERRUPTED
    return EXIT_FAILED if stopped_by in SAFETY_STOPS else EXIT_OK


def _doctor_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    p.add_argument("--jitter-seconds", type=float, default=2.0, metavar="S", help="length of the loop-jitter probe")
    p.add_argument("--check", action="append", default=None, metavar="NAME",
                   help="run only this check (repeatable; names as in --json's output and docs/realtime.md)")


@command("doctor", "is this machine ready for a real-time session? each check pass / warn / fail, with the fix "
                   "(exit 1 when one fails)", _doctor_args)
def _doctor(a: argparse.Namespace) -> int:
    from closedloop.runtime.doctor import DoctorConfig, run_doctor

    if not 0 < a.jitter_seconds <= 600:
        raise ValueError(f"--jitter-seconds {a.jitter_seconds:g}: the loop-jitter probe needs a length in seconds, "
                         "above 0 and at most 600")
    report = run_doctor(DoctorConfig(jitter_s=a.jitter_seconds, only=a.check))
    print(json_text(report.to_dict()) if a.json else report.format())
    return EXIT_FAILED if report.failed else EXIT_OK


def _replay_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recording", help="a session recording (.clrec)")
    p.add_argument("--bundle", required=True, help="bundle to re-run over the recorded input frames")
    p.add_argument("--backend", default="recorded",
                   help="'recorded' (default: the backend and variant the session ran on, so the bundle that ran "
                        "it reproduces its outputs exactly), 'auto' (fastest here) or a backend name")
    p.add_argument("--variant", default=None,
                   help="graph variant to re-run (fp32, fp16, int8, fp16w, int8w; default the session's with "
                        "--backend recorded, else fp32 or auto's choice)")
    p.add_argument("--tolerance", type=float, default=None,
                   help="fail (exit 1) if any output differs from the recorded one by more than this")
    p.add_argument("--key", default=None,
                   help="hex shared secret of a signed session: check every recorded frame's tag again "
                        "(without it signed frames replay unchecked, and the report says so)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


@command("replay", "re-run a bundle over a recorded session and compare outputs", _replay_args)
def _replay(a: argparse.Namespace) -> int:
    from closedloop.runtime import replay_recording

    if a.tolerance is not None and not a.tolerance >= 0:  # NaN too: no difference would pass or fail it
        raise ValueError(f"--tolerance {a.tolerance:g}: the largest |difference| allowed, 0 or more")
    report = replay_recording(a.recording, a.bundle, backend=a.backend, key=a.key, variant=a.variant)
    print(json_text(_jsonable(report)) if a.json else report.format())
    if report.outputs_compared == 0 and report.signed_frames_refused:
        print(f"error: {report.signed_frames_refused} recorded frames failed their signature check with this --key: "
              "give the key the session ran with, or replay without --key", file=sys.stderr)
        return 1
    if report.outputs_compared == 0 and report.missing_inputs:
        print(f"error: none of the {report.missing_inputs} recorded outputs could be re-run: their input frames are "
              "not the bundle's session input (manifest extra.session.input, docs/bundle.md)", file=sys.stderr)
        return 1
    if report.outputs_compared == 0 and report.outputs_not_due:
        print(f"error: none of the {report.outputs_not_due} recorded outputs falls where this bundle's window is due "
              "(another window or hop than the session's bundle): nothing was compared", file=sys.stderr)
        return 1
    if report.outputs_compared == 0:  # nothing was compared: no verdict either way, the recording holds no run
        print(f"error: {a.recording} holds no model output to re-run (no OUTPUT record: a session refused before it "
              "ran, or one that ended before its first step); nothing was compared", file=sys.stderr)
        return 2
    if a.tolerance is not None and not report.max_abs_diff <= a.tolerance:
        print(f"outputs differ by more than {a.tolerance:g}", file=sys.stderr if a.json else sys.stdout)
        return 1
    return 0


def _nwb_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recording", help="a session recording (.clrec)")
    p.add_argument("out", help="NWB file to write")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists (atomically)")
    p.add_argument("--json", action="store_true", help="print the file written as JSON")


@command("export-nwb", "convert a session recording to NWB", _nwb_args)
def _export_nwb(a: argparse.Namespace) -> int:
    from .nwb_export import recording_to_nwb

    path = recording_to_nwb(a.recording, a.out, overwrite=a.overwrite)
    print(json_text({"nwb": str(path)}) if a.json else f"wrote {path}")
    return 0


def _recording_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recording", help="a session recording (.clrec)")
    p.add_argument("--json", action="store_true", help="print what it holds, its META and SUMMARY as JSON")
    p.add_argument("--plot", default=None, metavar="OUT.png",
                   help="draw latency over time, its histogram, the input stream, the commands and the events")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --plot file")
    p.add_argument("--salvage", default=None, metavar="OUT.clrec",
                   help="a recording damaged inside (a disk or copy error): read on past each damaged record and "
                        "write every intact record to a new recording OUT.clrec, which reads whole")


@command("recording", "summarise a recording (records, torn tail, session summary); --plot draws it", _recording_args)
def _recording(a: argparse.Namespace) -> int:
    from pathlib import Path

    from closedloop.common.atomic import refuse_existing
    from closedloop.runtime import RecordingReader

    if a.plot:
        if Path(a.plot).resolve() == Path(a.recording).resolve():
            raise ValueError(f"--plot {a.plot} is the recording itself: recordings are never overwritten; give the "
                             "figure another path")
        if Path(a.plot).is_dir():
            raise ValueError(f"--plot {a.plot} is a folder: give the figure's file, like {Path(a.plot) / 'session.png'}")
        refuse_existing(a.plot, a.overwrite)
    if a.salvage and Path(a.salvage).exists():  # said before a long recording is read
        raise ValueError(f"--salvage {a.salvage} already exists: recordings are never overwritten; give a new path")
    r = RecordingReader(a.recording, resync=bool(a.salvage))
    salvaged = str(r.salvage(a.salvage)) if a.salvage else None
    plotted = None
    if a.plot:
        from .recording_plot import plot_recording

        plotted = str(plot_recording(r, a.plot))
    if a.json:
        counts: dict[str, int] = {}
        for rec in r.records:
            name = rec.type.name if hasattr(rec.type, "name") else f"type{rec.type}"
            counts[name] = counts.get(name, 0) + 1
        print(json_text({"path": str(r.path), "records": counts, "dropped_bytes": r.dropped_bytes,
                          "tail_problem": r.tail_problem, "damaged": r.damaged, "skipped": r.skipped,
                          "problems": r.problems(), "meta": r.meta, "summary": r.summary, "plot": plotted,
                          "salvaged": salvaged}))
        return 0
    if plotted:
        print(f"wrote {plotted}")
    if salvaged:
        print(f"wrote {salvaged}: the {len(r.records)} intact records")
    print(r.describe())
    for problem in r.problems()[r.said_by_describe():]:  # describe() has said those already
        print(f"  {problem}")
    if r.meta:
        bundle = r.meta.get("bundle_name") or r.meta.get("bundle")
        print(f"device {r.meta.get('device_url')}, bundle {bundle}, started {r.meta.get('started_utc')}")
    if r.summary:
        print(json_text(r.summary.get("loop", {})))
    return 0


def _monitor_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recording", help="a session recording (.clrec) to show in the monitor's page")
    p.add_argument("--port", type=int, default=8765, help="port to listen on (0 picks a free one; default 8765)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1, this machine only; another needs --public)")
    p.add_argument("--public", action="store_true",
                   help="allow a --host other machines reach (a token is then required and printed in the URL)")


@command("monitor", "show a recording in the browser monitor's page, with a time slider ([monitor] extra)",
         _monitor_args)
def _monitor(a: argparse.Namespace) -> int:
    import asyncio
    import secrets

    from closedloop.runtime.monitor.server import is_loopback

    if not 0 <= a.port <= 65535:
        print(f"closedloop monitor: error: --port {a.port} is outside 0..65535 (0 picks a free one)", file=sys.stderr)
        return 2
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        print("closedloop monitor: error: needs aiohttp: pip install 'closedloop[monitor]'", file=sys.stderr)
        return 2
    from closedloop.runtime.monitor.recording_server import serve_recording

    token = None
    if not is_loopback(a.host):
        if not a.public:
            print(f"closedloop monitor: error: --host {a.host} is reachable from other machines, and the page shows "
                  "the recording's data; bind 127.0.0.1 (the default), or pass --public to serve it there "
                  "with a token", file=sys.stderr)
            return 2
        token = secrets.token_urlsafe(16)
        print(f"warning: serving {a.recording} on {a.host}, reachable from other machines; the page asks for the "
              "token in the URL below", file=sys.stderr)
    try:
        asyncio.run(serve_recording(a.recording, a.host, a.port, token=token,
                                    ready=_say_monitor_urls))
    except KeyboardInterrupt:
        return 0
    return 0


def _say_monitor_urls(url: str, remote: str | None = None) -> None:
    """As ``run --monitor`` prints them: the URL for this machine, then the one for others where there is one."""
    print(f"monitor: {url} (Ctrl-C stops)", flush=True)
    if remote:
        print(f"monitor from other machines: {remote}", flush=True)


def _bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("bundles", nargs="*", metavar="BUNDLE",
                   help="bundle folders or zips to time on every backend and variant that runs here (no torch "
                        "needed); without one, the spine benchmark (GRU and MLP on torch eager, ONNX Runtime, Numba)")
    mine = p.add_argument_group("with BUNDLE")
    mine.add_argument("--steps", type=int, default=None, help="back-to-back steps per backend and variant (default 2000)")
    mine.add_argument("--paced-seconds", type=float, default=None,
                      help="seconds at the bundle's rate per backend and variant, cold and prewarmed each (default 1)")
    mine.add_argument("--backend", action="append", default=None,
                      help="time only this backend (repeatable; default every backend that runs here)")
    mine.add_argument("--variant", action="append", default=None,
                      help="time only this variant: fp32 or one the bundle holds (repeatable; default all)")
    mine.add_argument("--rate", type=float, default=None, help="pace at this rate in Hz (default the bundle's rate_hz)")
    mine.add_argument("--graph", default=None, help="which graph of the bundle (default main)")
    mine.add_argument("--json", dest="json_out", default=None, metavar="FILE", help="write the results as JSON")
    mine.add_argument("--plot", default=None, metavar="FILE.png", help="draw the latency distributions (matplotlib)")
    spine = p.add_argument_group("without BUNDLE (the spine benchmark; needs torch)")
    spine.add_argument("--quick", action="store_true", help="a few seconds per part instead of the full run")
    spine.add_argument("--out", default=None, help="folder for spine.json and spine_latency.png (default "
                                                   "bench/results/spine for a full run; --quick writes nothing "
                                                   "unless given --out)")


# option -> (its attribute, BenchConfig's field or None); each defaults to None, BenchConfig holds the defaults
_BUNDLE_ONLY = {"--steps": ("steps", "steps"), "--paced-seconds": ("paced_seconds", "paced_s"),
                "--backend": ("backend", "backends"), "--variant": ("variant", "variants"), "--rate": ("rate", "rate_hz"),
                "--graph": ("graph", "graph"), "--json": ("json_out", None), "--plot": ("plot", None)}


@command("bench", "time BUNDLEs on every backend and variant here against their deadline and floor; without one, "
                  "the spine benchmark (GRU and MLP steps, the loop at 1 kHz and 50 Hz)", _bench_args)
def _bench(a: argparse.Namespace) -> int:
    if not a.bundles:
        given = [flag for flag, (key, _) in _BUNDLE_ONLY.items() if getattr(a, key) is not None]
        if given:
            print(f"closedloop bench: error: {', '.join(given)} time(s) a BUNDLE: name one, e.g. "
                  "closedloop bench out/demo/gru --json bench.json", file=sys.stderr)
            return 2
        from .benchmark import SpineBenchConfig, run_spine_benchmark

        cfg = SpineBenchConfig.quick() if a.quick else SpineBenchConfig()
        if a.out is not None or not a.quick:  # a quick run never replaces the committed full-run results by default
            cfg.out_dir = a.out or "bench/results/spine"
        run_spine_benchmark(cfg)
        return 0
    if a.quick or a.out is not None:
        print("closedloop bench: error: --quick and --out belong to the spine benchmark (no BUNDLE); with a BUNDLE "
              "use --steps, --paced-seconds, --json FILE and --plot FILE.png", file=sys.stderr)
        return 2
    from pathlib import Path

    for flag, path in (("--json", a.json_out), ("--plot", a.plot)):  # said before minutes of timing, not after
        if path and Path(path).is_dir():
            print(f"closedloop bench: error: {flag} {path} is a folder: give a file path", file=sys.stderr)
            return 2
    if a.plot and not _importable("matplotlib"):  # said before minutes of timing, not after
        print("closedloop bench: error: --plot needs matplotlib, which is not installed: pip install matplotlib "
              "(or leave out --plot; --json keeps the numbers)", file=sys.stderr)
        return 2
    from closedloop.runtime.timing import BenchConfig, format_bench_table

    from .bench_bundle import bench_bundles, plot_bench, write_bench_json

    cfg = BenchConfig(**{field: getattr(a, key) for key, field in _BUNDLE_ONLY.values()
                         if field and getattr(a, key) is not None})
    # progress on stderr: stdout holds the tables, so `closedloop bench B > table.txt` keeps only them
    quiet = getattr(a, "global_quiet", False)  # -q: only warnings and errors on stderr
    benches = bench_bundles(a.bundles, cfg, report=lambda line: None if quiet else print(line, file=sys.stderr,
                                                                                          flush=True))
    for bench in benches:
        print()
        print(format_bench_table(bench))
    if a.json_out:
        print(f"wrote {write_bench_json(benches, a.json_out)}")
    if a.plot:
        print(f"wrote {plot_bench(benches, a.plot)}")
    return 0


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", help="folder for the NWB files (FALCON H2 layout, DANDI-style names)")
    p.add_argument("--preset", choices=["default", "tiny"], default="default",
                   help="default: FALCON H2's 21 held-in and 5 held-out days, 192 channels; tiny: 3 + 2 days of 16 "
                        "channels and 8 short trials, for a quick try")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated recording (default 0)")
    p.add_argument("--config", default=None, help="a HandwritingConfig JSON (overrides --preset)")
    p.add_argument("--ablate", default=None, help="switch one drift component off (see docs/handwriting_data.md)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a non-empty OUT folder (atomically: the old one stays until the new one is written)")


@command("generate-data", "write a synthetic handwriting iBCI recording as FALCON H2 NWB files", _generate_args)
def _generate(a: argparse.Namespace) -> int:
    from pathlib import Path

    from closedloop.common.atomic import atomic_directory
    from closedloop.sim.handwriting import VOCABULARY, HandwritingConfig, generate_recording

    from .bci.nwb import write_falcon_h2_dir

    if a.config:
        cfg = HandwritingConfig.from_json(Path(a.config).read_text())
    else:
        cfg = HandwritingConfig.tiny(seed=a.seed) if a.preset == "tiny" else HandwritingConfig(seed=a.seed)
    if a.ablate:
        cfg = cfg.ablate(a.ablate)
    out = Path(a.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not a.overwrite:
        # files of another recording left beside the new ones would be read as more sessions of it
        raise FileExistsError(f"{out} exists and is not empty: give a new folder, or --overwrite to replace it")
    sessions = generate_recording(cfg)
    with atomic_directory(out, overwrite=out.exists()) as work:
        paths = write_falcon_h2_dir(sessions, work)
        Path(work, "handwriting_config.json").write_text(cfg.to_json())
        Path(work, "vocabulary.txt").write_text("\n".join(VOCABULARY) + "\n")  # the words sentences are drawn from
    print(f"wrote {len(paths)} NWB files for {len(sessions)} sessions to {a.out} (config in handwriting_config.json, "
          "the generator's words in vocabulary.txt: evaluate --beam --lexicon)")
    return 0


def _certify_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("bundle", help="an observer bundle")
    p.add_argument("--json", action="store_true", help="print the verdicts and figures as JSON (docs/cli.md)")


@command("certify", "re-check an observer bundle's stability certificate from its own weights and print the report",
         _certify_args)
def _certify(a: argparse.Namespace) -> int:
    from closedloop.runtime.families.observer.certificate_bundle import certify_bundle_record

    rec = certify_bundle_record(a.bundle)  # another family's bundle: ValueError, bad input
    print(json_text({"bundle": a.bundle, **rec}) if a.json else rec["report"])
    # 2: the bundle does not verify (bad input, as everywhere else; whatever its certificate's check gave on bytes
    # that are not the bundle's); 1: it verifies and its certificate does not hold
    return 0 if rec["passed"] else 2 if not rec["bundle_verifies"] else 1


def _keygen_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?", default="lab",
                   help="writes NAME.key (private: keep it off boards, mode 0600) and NAME.pub (give it to boards); "
                        "default lab")
    p.add_argument("--force", action="store_true", help="replace an existing key pair of that name")
    p.add_argument("--json", action="store_true", help="print the files and key id as JSON")


@command("keygen", "make an Ed25519 key pair for signing bundles (NAME.key, NAME.pub)", _keygen_args)
def _keygen(a: argparse.Namespace) -> int:
    from closedloop.runtime.signing import generate_key_pair

    key, pub, kid = generate_key_pair(a.name, overwrite=a.force)
    if a.json:
        print(json_text({"private_key": str(key), "public_key": str(pub), "key_id": kid}))
        return 0
    print(f"wrote {key} (private: sign with it, keep it secret) and {pub} (public: --trust {pub} on boards); key id {kid}")
    return 0


def _sign_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("bundle", help="bundle folder or zip to sign (verified first; manifest.sig is written into it)")
    p.add_argument("--key", required=True, help="private key file (NAME.key from closedloop keygen)")
    p.add_argument("--json", action="store_true", help="print the signature's details as JSON")


@command("sign", "sign a bundle with a lab's private key, so boards that trust the public key run it", _sign_args)
def _sign(a: argparse.Namespace) -> int:
    from closedloop.runtime.signing import sign_bundle

    r = sign_bundle(a.bundle, a.key)
    if a.json:
        print(json_text(_jsonable(r)))
        return 0
    print(f"signed {r.bundle} with key {r.key_id}: manifest digest {r.digest[:16]}..., signature in {r.signature_file}"
          + (" (the manifest had no digest: one was added)" if r.sealed else "")
          + (f"; kept {r.kept} other signature(s)" if r.kept else ""))
    return 0


def _pairs(items: list[str], flag: str) -> dict[str, str]:
    """``NAME=VALUE`` arguments as a dict."""
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise ValueError(f"{flag} {item!r}: give NAME=VALUE")
        out[name] = value
    return out


def _json_arg(text: str | None, flag: str) -> dict | None:
    """A JSON object given inline or as @FILE."""
    if text is None:
        return None
    from pathlib import Path

    source = Path(text[1:]).read_text() if text.startswith("@") else text
    try:
        value = json.loads(source)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag}: not JSON ({exc}); give an object such as '{{\"low\": [-1], \"high\": [1]}}' or "
                         "@FILE") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag}: give a JSON object, not {type(value).__name__}")
    return value


def _import_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="the .onnx file (float32 inputs and outputs, weights inside the file)")
    p.add_argument("out", help="the bundle folder to write (or a .zip with --zip)")
    p.add_argument("--rate", type=float, required=True, help="the loop rate in Hz the model was trained for")
    p.add_argument("--state", action="append", default=[], metavar="IN=OUT",
                   help="a recurrent state: the input a step reads and the output that feeds it back (repeatable)")
    p.add_argument("--initial", action="append", default=[], metavar="IN=FILE.npy",
                   help="a learned initial state for state input IN (a .npy array shaped as the state at batch 1): "
                        "the runtime starts and resets it there instead of at zeros (repeatable)")
    p.add_argument("--output", action="append", default=None, metavar="NAME",
                   help="keep this output (repeatable, in order: a session acts on the first); the others are cut "
                        "from the graph. Default: every output, in the file's order")
    p.add_argument("--name", default="", help="the bundle's name (default: the file's stem)")
    p.add_argument("--family", default="generic", help="the runtime family that runs it (default generic)")
    p.add_argument("--input-role", action="append", default=[], metavar="NAME=ROLE",
                   help="an input's role: measurement, goal, mode or context (docs/bundle.md)")
    p.add_argument("--output-role", action="append", default=[], metavar="NAME=ROLE",
                   help="an output's role: command, estimate or output")
    p.add_argument("--window", action="append", default=[], metavar="NAME=LENGTH[:HOP[:LAYOUT]]",
                   help="an input that is a window over a stream: its length in frames, the hop (default 1) and "
                        "time_major or channel_major (default time_major)")
    p.add_argument("--preprocess", metavar="JSON", help="the manifest's preprocess object (JSON or @FILE), e.g. mean/std")
    p.add_argument("--postprocess", metavar="JSON",
                   help="the manifest's postprocess object (JSON or @FILE), e.g. command limits low/high")
    p.add_argument("--extra", metavar="JSON", help="the manifest's extra object (JSON or @FILE), e.g. session I/O")
    p.add_argument("--variants", default="fp16,int8",
                   help="reduced-precision variants to add, comma-separated (fp16, int8, fp16w, int8w) or none")
    p.add_argument("--no-tensorrt", action="store_true", help="do not build a TensorRT engine even where one could be")
    p.add_argument("--overwrite", action="store_true", help="replace an existing bundle at OUT")
    p.add_argument("--zip", action="store_true", help="write one zip file instead of a folder")
    p.add_argument("--json", action="store_true", help="print the bundle's path and its parity record as JSON")


def _window(text: str) -> dict:
    name_fields = text.split(":")
    out: dict = {"length": int(name_fields[0])}
    if len(name_fields) > 1:
        out["hop"] = int(name_fields[1])
    if len(name_fields) > 2:
        out["layout"] = name_fields[2]
    return out


@command("import-onnx", "make a bundle from an ONNX file made elsewhere (another framework, torch.onnx.export): "
                        "checked on ONNX Runtime and Numba, variants added", _import_args)
def _import_onnx(a: argparse.Namespace) -> int:
    if not _can_import("onnx"):
        print("closedloop import-onnx: error: needs onnx, which is not installed: pip install 'closedloop[onnx]' "
              "(torch is not needed)", file=sys.stderr)
        return 2
    from closedloop.export import import_onnx
    from closedloop.runtime import load_bundle

    try:
        windows = {k: _window(v) for k, v in _pairs(a.window, "--window").items()}
    except ValueError as exc:
        raise ValueError(f"--window: {exc}; give NAME=LENGTH[:HOP[:LAYOUT]]") from None
    variants = [] if a.variants.strip().lower() in ("", "none") else [v.strip() for v in a.variants.split(",")]
    initial = {}
    for name, file in _pairs(a.initial, "--initial").items():
        try:
            initial[name] = np.load(file, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise ValueError(f"--initial {name}={file}: cannot read a .npy array there ({exc})") from None
    path = import_onnx(a.model, a.out, rate_hz=a.rate, state=_pairs(a.state, "--state"), initial=initial,
                       outputs=a.output, family=a.family, name=a.name,
                       preprocess=_json_arg(a.preprocess, "--preprocess"),
                       postprocess=_json_arg(a.postprocess, "--postprocess"), extra=_json_arg(a.extra, "--extra"),
                       input_roles=_pairs(a.input_role, "--input-role"),
                       output_roles=_pairs(a.output_role, "--output-role"), windows=windows or None,
                       variants=variants, tensorrt=not a.no_tensorrt, overwrite=a.overwrite, zip=a.zip,
                       report=lambda s: print(s, file=sys.stderr if a.json else sys.stdout))
    if a.json:
        spec = load_bundle(path).graph()
        print(json_text({"bundle": str(path), "kind": spec.kind, "parity": spec.parity,
                          "variants": {k: {"within_tolerance": v["within_tolerance"]} for k, v in spec.variants.items()}}))
    return 0


def _package_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("bundles", nargs="+", metavar="BUNDLE", help="bundle folders or zips (each verified first)")
    p.add_argument("--target", required=True, help="the board: jetson-jp6, or host (this machine)")
    p.add_argument("--out", required=True, help="the package folder to write")
    p.add_argument("--extras", nargs="*", default=[], metavar="EXTRA", help="closedloop extras to include (monitor, lsl)")
    p.add_argument("--ort-only", action="store_true",
                   help="no Numba or llvmlite: the smallest install, bundles run on ONNX Runtime")
    p.add_argument("--find-links", action="append", default=[], metavar="DIR", help="a folder of wheels for pip")
    p.add_argument("--no-index", action="store_true", help="fetch wheels only from --find-links (offline)")
    p.add_argument("--from-installed", action="store_true",
                   help="host only: rebuild the wheels from this interpreter's installed packages (offline)")
    p.add_argument("--prefix", default="/opt/closedloop", help="where install.sh puts the venv and bundles")
    p.add_argument("--device", default="/dev/ttyACM0", help="the device URL the service's session opens")
    p.add_argument("--cpu", type=int, default=1, help="the CPU the service's loop is pinned to")
    p.add_argument("--priority", type=int, default=80, help="the service's SCHED_FIFO priority (1-99)")
    p.add_argument("--user", default="closedloop", help="the user the service runs as")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out folder")
    p.add_argument("--trust", action="append", default=[], metavar="KEY.pub|DIR",
                   help="public key (or folder of *.pub keys): every bundle must be signed by one; the keys go into "
                        "the package and the service runs with --trust (repeatable; without it nothing checks "
                        "signatures on the board)")
    p.add_argument("--input", action="append", default=[], metavar="NAME=V1,V2,...",
                   help="the value of an input the device does not stream (a goal), passed to the service's "
                        "closedloop run as --input (repeatable); a bundle that needs one and has none is refused")
    p.add_argument("--overrun", choices=("skip", "hold", "stop"), default=None,
                   help="the service's closedloop run --overrun (default: run's own); stop ends the session at an "
                        "overrun with exit 1, which the unit does not restart")
    p.add_argument("--watchdog-limit", type=float, default=None, metavar="S",
                   help="the service's closedloop run --watchdog-limit: stop the session (exit 1, not restarted) after "
                        "S seconds without input")
    p.add_argument("--sign", default=None, metavar="KEY",
                   help="a lab's private key: sign SHA256SUMS with it (SHA256SUMS.sig); a board that already trusts "
                        "its public key installs only packages so signed")


@command("package", "bundles and their runtime for a board: wheelhouse, install.sh, systemd unit", _package_args)
def _package(a: argparse.Namespace) -> int:
    from .package import PackageOptions, package

    if not 1 <= a.priority <= 99:
        raise ValueError(f"--priority {a.priority}: SCHED_FIFO priorities are 1 to 99")
    opts = PackageOptions(target=a.target, extras=a.extras, ort_only=a.ort_only, find_links=a.find_links,
                          no_index=a.no_index, from_installed=a.from_installed, prefix=a.prefix, device=a.device,
                          cpu=a.cpu, priority=a.priority, user=a.user, overwrite=a.overwrite, trust=a.trust,
                          inputs=_held_inputs(a.input), overrun=a.overrun, watchdog_limit_s=a.watchdog_limit,
                          sign_key=a.sign)
    quiet = getattr(a, "global_quiet", False)  # -q: warnings, errors and the digest of SHA256SUMS, its result
    package(a.bundles, a.out, opts,
            report=lambda s: None if quiet and not s.startswith("SHA256SUMS") else print(s, file=sys.stderr))
    return 0


def _device_passthrough(argv: list[str]) -> int:
    from closedloop.sim import cli_main

    try:
        return int(cli_main(argv) or 0)
    except (ValueError, OSError) as exc:  # a port that cannot be opened, a parameter that means nothing
        print(f"closedloop device: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


# Commands whose arguments belong to another parser (the emulators') are handed over whole.
_PASSTHROUGH: dict[str, tuple[str, Callable[[list[str]], int]]] = {
    "device": ("start a device emulator on a serial port: device NAME --port PATH [--PARAM VALUE ...] "
               "(device --list, device NAME --help)", _device_passthrough),
}


_TRAIN_EXTRAS = ("pip install 'closedloop[train,sim,rl]' and PyTorch (the Makefile's TORCH_SPEC); the deployed "
                 "footprint runs, inspects, replays and serves devices without them")


def _needs(name: str, help_: str, missing: str) -> None:
    """Register ``name`` as a command that says which training dependency it lacks (a torch-free install)."""

    def run(argv: list[str]) -> int:
        print(f"closedloop {name}: needs {missing}, which is not installed: {_TRAIN_EXTRAS}", file=sys.stderr)
        return 2

    _PASSTHROUGH[name] = (f"{help_} [needs {missing}]", run)


def _can_import(module: str) -> bool:
    """Whether ``module`` is installed, without importing it (torch alone takes seconds to import)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _family_commands(module: str, commands: tuple[tuple[str, str], ...], requires: tuple[str, ...] = ()) -> None:
    """Register a family's commands by importing ``module``; where a package in ``requires`` (or one the module
    imports) is missing, each command instead says which one it needs."""
    import importlib

    missing = next((m for m in requires if not _can_import(m)), None)
    if missing is not None:
        for name, help_ in commands:
            _needs(name, help_, missing)
        return
    try:
        importlib.import_module(module)  # registers its commands
    except ImportError as exc:
        for name, help_ in commands:
            _needs(name, help_, exc.name or str(exc))


_family_commands("closedloop.sdk.bci.cli", (("calibrate", "fit a bundle's alignment layer to a new session"),
                                 ("bci-train", "train the pooled handwriting decoder"),
                                 ("evaluate", "score a decoder bundle on NWB data")), requires=("torch",))
_family_commands("closedloop.sdk.rl.cli", (("rl-train", "behaviour-clone and fine-tune a Panda policy"),),
                 requires=("torch", "gymnasium"))
_family_commands("closedloop.sdk.robust.cli", (("inject-faults", "flip weight bits in a copy of a bundle"),
                                    ("scrub", "check and repair a protected bundle's weights")))
_family_commands("closedloop.sdk.grid.validate", (("validate", "run a batch of simulator-in-the-loop sessions"),))


EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 0, 1, 2, 130, 141
EXIT_INTERNAL = 70  # a bug in closedloop (sysexits' EX_SOFTWARE): not a failed check, not bad input
EXIT_TERMINATED = 128 + 15  # SIGTERM outside a session's loop (the console script then dies by the signal itself)


class Terminated(SystemExit):
    """SIGTERM (``kill PID``, ``systemctl stop``) while a command is not in a session's loop (which takes it as a
    clean stop of its own): it unwinds like Ctrl-C, so every ``finally`` runs (the monitor's server, an emulator,
    the device and a recording are closed, a half-written bundle is removed). A ``SystemExit`` so that asyncio and
    the grid runner pass it on rather than log it."""

    def __init__(self) -> None:
        super().__init__(EXIT_TERMINATED)


def _unwind_on_sigterm() -> Callable[[], None]:
    """Make SIGTERM raise :class:`Terminated` in the main thread until the returned function restores the handler."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum: int, frame: object) -> None:  # noqa: ARG001
        raise Terminated

    previous = signal.signal(signal.SIGTERM, handler)
    return lambda: signal.signal(signal.SIGTERM, previous)


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("closedloop")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def _build() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(prog="closedloop", description="closed-loop deployment of neural models",
                                     epilog="exit codes: 0 clean end; 1 a failed check or a session stopped by a "
                                            "safety rule; 2 usage or bad input; 70 an internal error (a bug); 130 Ctrl-C; "
                                            "141 closed pipe; 143 SIGTERM outside a session's loop")
    parser.add_argument("--version", action="version", version=f"closedloop {_version()}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log messages on stderr (-vv: debug)")
    parser.add_argument("-q", "--quiet", dest="global_quiet", action="store_true",
                        help="only warnings and errors on stderr (and no live status line)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    subparsers: dict[str, argparse.ArgumentParser] = {}
    for name, (help_, setup, fn) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        setup(p)
        # -v / -q also after the command (closedloop run B -q), where people put them; absent there, the top
        # level's value stands (SUPPRESS); given in both places, the one after the command counts
        if not {"-v", "--verbose"} & set(p._option_string_actions):
            p.add_argument("-v", "--verbose", dest="after_verbose", action="count", default=argparse.SUPPRESS,
                           help="more log messages on stderr (-vv: debug); also before the command")
        if "-q" not in p._option_string_actions:
            p.add_argument("-q", dest="after_quiet", action="store_true", default=argparse.SUPPRESS,
                           help="only warnings and errors on stderr (and no live status line); also before the command")
        p.set_defaults(func=fn)
        subparsers[name] = p
    for name, (help_, _fn) in _PASSTHROUGH.items():
        sub.add_parser(name, help=help_, description=help_, add_help=False)
    return parser, subparsers


def build_parser() -> argparse.ArgumentParser:
    return _build()[0]


def verbosity(args: argparse.Namespace) -> tuple[int, bool]:
    """``(verbose, quiet)``: the -v/-q given after the command where any was, else those before it."""
    if hasattr(args, "after_verbose") or hasattr(args, "after_quiet"):
        return getattr(args, "after_verbose", 0), getattr(args, "after_quiet", False)
    return args.verbose, args.global_quiet


def _configure_logging(verbose: int, quiet: bool) -> None:
    import logging

    level = logging.WARNING if quiet or not verbose else (logging.INFO if verbose == 1 else logging.DEBUG)
    logging.basicConfig(stream=sys.stderr, level=level, format="%(levelname)s %(name)s: %(message)s")


def _quiet_broken_pipe() -> int:
    """stdout's reader went away (``closedloop inspect B | head -1``): no traceback, no second error at exit."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return EXIT_BROKEN_PIPE


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    lead = next((i for i, a in enumerate(argv) if not a.startswith("-")), len(argv))
    if lead < len(argv) and argv[lead] in _PASSTHROUGH and all(
            a in ("-q", "--quiet", "--verbose") or (a.startswith("-v") and set(a[1:]) == {"v"}) for a in argv[:lead]):
        # -v / -q before a command that parses its own arguments (closedloop device): they set the logging here
        verbose = sum(a.count("v") if a.startswith("-v") else 1 for a in argv[:lead] if a != "-q" and a != "--quiet")
        _configure_logging(verbose, any(a in ("-q", "--quiet") for a in argv[:lead]))
        return _PASSTHROUGH[argv[lead]][1](argv[lead + 1:])
    parser, subparsers = _build()
    before = argv[: next((i for i, a in enumerate(argv) if not a.startswith("-")), len(argv))]
    unknown = [a for a in before if a.split("=")[0] not in parser._option_string_actions and not a.startswith("-v")]
    if unknown:  # an unknown flag before the command: name it (argparse would only say COMMAND is missing)
        parser.error(f"unrecognized arguments: {' '.join(unknown)} (options of a command go after it)")
    args, extra = parser.parse_known_args(argv)
    if extra:  # a subcommand's unknown flag: that subcommand's usage, not the top level's
        subparsers[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    sub = subparsers[args.command]
    empty = [k for k, v in vars(args).items() if v == "" and sub.get_default(k) != ""]
    if empty:  # an empty path read as the current folder, an empty --device as no device: a script's unset variable
        sub.error(f"{', '.join(k.replace('_', '-') for k in empty)}: given as an empty string; give a value, or leave "
                  "the option out")
    args.verbose, args.global_quiet = verbosity(args)
    _configure_logging(args.verbose, args.global_quiet)
    if args.global_quiet and hasattr(args, "quiet"):
        args.quiet = True
    restore = _unwind_on_sigterm()
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"closedloop {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Terminated:
        print(f"closedloop {args.command}: terminated (SIGTERM)", file=sys.stderr)
        return EXIT_TERMINATED
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except ImportError as exc:  # a command that needs a training dependency, on a torch-free install
        print(f"closedloop {args.command}: error: needs {exc.name or exc}, which is not installed: {_TRAIN_EXTRAS}",
              file=sys.stderr)
        return EXIT_USAGE
    except (ValueError, RuntimeError, OSError) as exc:
        # Typed errors carry a message that says what was wrong and what to do.
        print(f"closedloop {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:  # noqa: BLE001  (anything else is a bug: say so, with the traceback to report)
        import traceback

        traceback.print_exc(file=sys.stderr)
        print(f"closedloop {args.command}: internal error: {type(exc).__name__}: {exc}. This is a bug in closedloop, "
              "not in your input: please report it with the traceback above", file=sys.stderr)
        return EXIT_INTERNAL
    finally:
        restore()


def console_main() -> int:
    """The ``closedloop`` console script: ``main``, with a stdout closed by the time it flushes handled too."""
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        code = _quiet_broken_pipe()
    if code == EXIT_TERMINATED:  # everything closed: now end by SIGTERM itself, as a supervisor expects of it
        import os
        import signal

        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
    return code


if __name__ == "__main__":
    # run the imported module's main: family modules register their commands on sdk.cli, not on __main__
    from closedloop.sdk.cli import console_main

    sys.exit(console_main())
