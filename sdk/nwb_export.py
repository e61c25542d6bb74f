"""Convert a session recording to NWB (``closedloop export-nwb``).

What goes where in the NWB file:

- ``acquisition``: the device's input stream, timestamped when the host read each frame (the host clock, as
  everything else in the file): ``binned_spikes`` (bins x channels, counts) for neural frames;
  ``plant_output_y`` and ``plant_input_u`` (when the device reports it) for plant measurements;
  ``joint_positions`` and ``joint_velocities`` for joint states. Each has a ``NAME_device_clock`` beside it: the
  device's own timestamp of each frame (its data, seconds), at the same host times, since the two clocks drift
  apart (an LSL source's clock, for ``lsl://``).
- ``processing["closedloop"]``: ``model_output`` (every recorded model output, host
  clock; a graph with several data outputs: the first, and ``model_output_NAME`` for each
  other), ``family_state`` (what the family computed outside the graph after each run, an observer's
  estimate: its columns named in the description by the recording's META ``family_state`` labels, host clock),
  ``commands_sent`` (actuator and joint commands, decoded from the exact bytes
  written, host clock), ``step_timing`` (each loop step's latency and lateness, host clock), ``decoder_outputs`` (a decoder's DECODER_OUTPUT frames: bin index
  and the text added, as a table) and ``session_events`` (watchdog, disconnects, device
  status) as a table.
- ``session_description`` and ``notes`` carry the device, bundle and summary.

Every timestamp is the recording host's monotonic clock in seconds since the file's first record, whose
``time.monotonic_ns()`` is ``t0_host_ns`` in ``notes`` (on Linux the same clock as LSL's ``local_clock()``); the
file's ``timestamps_reference_time`` (= ``session_start_time``) is the wall clock at that record, to the
nanosecond where the recording has META ``started_unix_ns``, else to the second.
"""

from __future__ import annotations

import hashlib
import json
import logging
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from closedloop.common.atomic import atomic_write_bytes, refuse_existing
from closedloop.runtime.recording_view import view_recording

log = logging.getLogger("closedloop.nwb")


def _nwb_name(name: str) -> str:
    """An output's name as part of an NWB object's name (which cannot hold '/' or ':')."""
    return "".join(c if c.isalnum() or c in "_-." else "_" for c in name)


def _first_record_utc(view) -> datetime:
    """The wall clock at the recording's first record: META's ``started_unix_ns`` (read at META's host time) less the
    host time from the first record to META; an older recording's ``started_utc`` (to the second) likewise."""
    meta, at_meta_s = view.meta, view.meta_host_s
    if isinstance(meta.get("started_unix_ns"), int):
        return datetime.fromtimestamp(meta["started_unix_ns"] / 1e9 - at_meta_s, tz=timezone.utc)
    start = meta.get("started_utc")
    if start:
        return datetime.fromtimestamp(datetime.strptime(start, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
                                      .timestamp() - at_meta_s, tz=timezone.utc)
    return datetime.now(timezone.utc)


def recording_to_nwb(recording: str | Path, out: str | Path, overwrite: bool = False) -> Path:
    from hdmf.common import DynamicTable, VectorData
    from pynwb import NWBHDF5IO, NWBFile, TimeSeries

    out = Path(out)
    if out.exists() and Path(recording).exists() and out.resolve() == Path(recording).resolve():
        raise ValueError(f"{out} is the recording itself: give the NWB file another path (recordings are never "
                         "overwritten)")
    refuse_existing(out, overwrite)
    view = view_recording(recording)
    for problem in view.problems():  # said where the user looks, not only inside the file's notes
        log.warning("%s: %s", recording, problem)
    meta = view.meta
    start_dt = _first_record_utc(view)
    bundle = meta.get("bundle_name") or Path(str(meta.get("bundle") or "?")).name
    # one identifier per session, never shared by two recordings that happen to have one file name
    ident = hashlib.sha256(json.dumps([meta, view.t0_ns], sort_keys=True, default=str).encode()).hexdigest()[:16]
    nwb = NWBFile(
        session_description=f"closedloop session: bundle {bundle} on device "
        f"{meta.get('device', {}).get('kind', '?')} ({meta.get('device_url', '?')})",
        identifier=f"closedloop-{Path(recording).stem}-{ident}",
        session_start_time=start_dt,
        notes=json.dumps({"meta": meta, "summary": view.summary, "recording": view.described,
                          "frames_left_out": view.odd_frames, "problems": view.problems(),
                          "t0_host_ns": view.t0_ns,
                          "clock": "every timestamp: host monotonic seconds since t0_host_ns (the first record)"}),
        timestamps_reference_time=start_dt,
    )
    series = {name: s for name, s in view.inputs.items() if len(s) and s.values[0].size}  # no empty u series
    outputs, out_t = view.outputs.values, view.outputs.t_host_s
    cmds, cmd_t = view.commands.values, view.commands.t_host_s
    dec_t = [t for t, _, _ in view.typed]
    dec_bin = [b for _, b, _ in view.typed]
    dec_text = [x for _, _, x in view.typed]
    ev_t = [t for t, _ in view.events]
    ev_kind = [str(ev.get("event", "?")) for _, ev in view.events]
    ev_detail = [json.dumps({k: v for k, v in ev.items() if k != "event"}) for _, ev in view.events]
    units = {"binned_spikes": "counts per bin"}
    channels = view.channels  # an LSL source's channel labels, units and types, where it gave them
    for name, s in series.items():
        described = channels is not None and len(channels["label"]) == s.values[0].size
        nwb.add_acquisition(TimeSeries(name=name, data=s.array(), timestamps=np.asarray(s.t_host_s),
                                       unit=units.get(name, "a.u."),
                                       description="the device's frames, at the host time each was read (host clock)",
                                       comments=(json.dumps({"channels": channels}) if described
                                                 else "no comments")))
        nwb.add_acquisition(TimeSeries(name=f"{name}_device_clock", data=np.asarray(s.t_device_s),
                                       timestamps=np.asarray(s.t_host_s), unit="seconds",
                                       description=f"the device's own timestamp of each frame of {name} (its clock, "
                                                   "which drifts from the host's), at the host time it was read"))
    mod = nwb.create_processing_module("closedloop", "model outputs, commands and events of the closed-loop session")
    if outputs:
        first = (meta.get("outputs") or [{}])[0].get("name")
        mod.add(TimeSeries(name="model_output", data=np.stack(outputs), timestamps=np.asarray(out_t), unit="a.u.",
                           description=f"the graph's first data output{f' ({first!r})' if first else ''}, each "
                                       "step the model ran; host clock"))
    for name, s in view.more_outputs.items():
        mod.add(TimeSeries(name=f"model_output_{_nwb_name(name)}", data=s.array(), timestamps=np.asarray(s.t_host_s),
                           unit="a.u.", description=f"the graph's data output {name!r}, each step the model ran "
                                                    "(the same steps as model_output); host clock"))
    if len(view.state):
        mod.add(TimeSeries(name="family_state", data=view.state.array(), timestamps=np.asarray(view.state.t_host_s),
                           unit="a.u.", description="what the family computed outside the graph after each model run "
                                                    f"(FAMILY_STATE records), columns: {', '.join(view.state_labels)}; "
                                                    "host clock"))
    if cmds:
        mod.add(TimeSeries(name="commands_sent", data=np.stack(cmds), timestamps=np.asarray(cmd_t),
                           unit="the device's command units",
                           description="every command frame the session wrote to the device (the model's, the safe "
                                       "command, one re-sent after an overrun and the stop command), at the host time "
                                       "it was written; step_flags says which steps sent the safe command and which "
                                       "had the link down (a frame written then did not reach the device); host clock"))
    steps = view.steps
    if steps["step"].size:
        mod.add(TimeSeries(name="step_timing", data=np.stack([steps["latency_us"], steps["lateness_us"]], axis=1),
                           timestamps=steps["t_s"], unit="microseconds",
                           description="per loop step (STEPS records): column 0 its latency, column 1 its lateness "
                                       "(start minus deadline); timestamps are the steps' starts, host clock"))
        mod.add(TimeSeries(name="step_flags", data=np.asarray(steps["flags"], dtype=np.int64),
                           timestamps=steps["t_s"], unit="bit flags",
                           description="per loop step (STEPS records), OR of: 1 the model ran on a device frame, 2 a "
                                       "model command was sent, 4 the safe command was sent, 8 the link was down, 16 "
                                       "the watchdog had tripped (docs/recording.md); host clock"))
    if dec_t:
        mod.add(
            DynamicTable(
                name="decoder_outputs",
                description="DECODER_OUTPUT frames sent: the text added at each bin (a delta; often empty); their "
                            "per-character values are the model outputs in model_output",
                columns=[
                    VectorData(name="time", description="host seconds since the first record", data=dec_t),
                    VectorData(name="bin_index", description="the bin the output answers", data=dec_bin),
                    VectorData(name="text", description="text added at this bin", data=dec_text),
                ],
            )
        )
    if ev_t:
        mod.add(
            DynamicTable(
                name="session_events",
                description="watchdog trips, disconnects, reconnects and device status during the session",
                columns=[
                    VectorData(name="time", description="host seconds since the first record", data=ev_t),
                    VectorData(name="event", description="event kind", data=ev_kind),
                    VectorData(name="detail", description="event fields as JSON", data=ev_detail),
                ],
            )
        )
    tmp = out.with_name(f".{out.stem}.tmp.nwb")  # pynwb warns about a name without the .nwb suffix
    try:
        with NWBHDF5IO(str(tmp), "w") as io:
            io.write(nwb)
        atomic_write_bytes(out, tmp.read_bytes())
    finally:
        tmp.unlink(missing_ok=True)  # a failed write (OUT a folder, a full disk) leaves no partial file behind
    return out
