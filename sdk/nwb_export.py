"""Convert a session recording to NWB (``closedloop export-nwb``).

What goes where in the NWB file:

- ``acquisition``: the device's input stream, timestamped by the device clock
  (seconds since the device started): ``binned_spikes`` (bins x channels, counts) for
  neural frames; ``plant_output_y`` and ``plant_input_u`` for plant measurements;
  ``joint_positions`` and ``joint_velocities`` for joint states.
- ``processing["closedloop"]``: ``model_output`` (every recorded model output, host
  clock), ``commands_sent`` (actuator and joint commands, decoded from the exact bytes
  written, host clock), ``decoder_outputs`` (a decoder's DECODER_OUTPUT frames: bin index
  and the text added, as a table) and ``session_events`` (watchdog, disconnects, device
  status) as a table.
- ``session_description`` and ``notes`` carry the device, bundle and summary.

Host timestamps are seconds since the first record; device timestamps are the
device's own clock. Both are kept because they drift apart.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from closedloop.common.atomic import atomic_write_bytes
from closedloop.firmware_bridge import (
    ActuatorCommand,
    DecoderOutput,
    FrameParser,
    JointCommand,
    JointState,
    NeuralFrame,
    PlantMeasurement,
)
from closedloop.runtime.recording import RecordingReader, RecordType


def recording_to_nwb(recording: str | Path, out: str | Path, overwrite: bool = False) -> Path:
    from hdmf.common import DynamicTable, VectorData
    from pynwb import NWBHDF5IO, NWBFile, TimeSeries

    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass overwrite=True (--overwrite) or choose another name")
    reader = RecordingReader(recording)
    meta = reader.meta
    t0 = reader.records[0].host_ns if reader.records else 0
    start = meta.get("started_utc")
    start_dt = (
        datetime.strptime(start, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc) if start else datetime.now(timezone.utc)
    )
    nwb = NWBFile(
        session_description=f"closedloop session: bundle {meta.get('bundle_name', '?')} on device "
        f"{meta.get('device', {}).get('kind', '?')} ({meta.get('device_url', '?')})",
        identifier=f"closedloop-{Path(recording).stem}",
        session_start_time=start_dt,
        notes=json.dumps({"meta": meta, "summary": reader.summary, "recording": reader.describe()}),
    )
    rx, tx = FrameParser(), FrameParser()
    series: dict[str, tuple[list, list]] = {}
    outputs, out_t, cmds, cmd_t = [], [], [], []
    ev_t, ev_kind, ev_detail = [], [], []
    dec_t, dec_bin, dec_text = [], [], []  # a decoder's DECODER_OUTPUTs: the text it typed, bin by bin

    def add(name: str, t: float, v: np.ndarray) -> None:
        series.setdefault(name, ([], []))
        series[name][0].append(t)
        series[name][1].append(np.asarray(v, dtype=np.float64))

    for rec in reader:
        t_host = (rec.host_ns - t0) / 1e9
        if rec.type == RecordType.RX:
            for f in rx.feed(rec.payload):
                m, t_dev = f.message, f.timestamp_us / 1e6
                if isinstance(m, NeuralFrame):
                    add("binned_spikes", t_dev, m.counts)
                elif isinstance(m, PlantMeasurement):
                    add("plant_output_y", t_dev, m.y)
                    add("plant_input_u", t_dev, m.u)
                elif isinstance(m, JointState):
                    add("joint_positions", t_dev, m.q)
                    add("joint_velocities", t_dev, m.dq)
        elif rec.type == RecordType.TX:
            for f in tx.feed(rec.payload):
                m = f.message
                if isinstance(m, ActuatorCommand):
                    cmds.append(m.u)
                    cmd_t.append(t_host)
                elif isinstance(m, JointCommand):
                    cmds.append(m.values)
                    cmd_t.append(t_host)
                elif isinstance(m, DecoderOutput):
                    dec_t.append(t_host)
                    dec_bin.append(int(m.bin_index))
                    dec_text.append(m.text)
        elif rec.type == RecordType.OUTPUT:
            outputs.append(rec.output()[2].copy())
            out_t.append(t_host)
        elif rec.type == RecordType.EVENT:
            ev = rec.json()
            ev_t.append(t_host)
            ev_kind.append(str(ev.pop("event", "?")))
            ev_detail.append(json.dumps(ev))
    units = {"binned_spikes": "counts per bin"}
    for name, (ts, vals) in series.items():
        nwb.add_acquisition(TimeSeries(name=name, data=np.stack(vals), timestamps=np.asarray(ts), unit=units.get(name, "a.u.")))
    mod = nwb.create_processing_module("closedloop", "model outputs, commands and events of the closed-loop session")
    if outputs:
        mod.add(TimeSeries(name="model_output", data=np.stack(outputs), timestamps=np.asarray(out_t), unit="a.u."))
    if cmds:
        mod.add(TimeSeries(name="commands_sent", data=np.stack(cmds), timestamps=np.asarray(cmd_t), unit="a.u."))
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
    with NWBHDF5IO(str(tmp), "w") as io:
        io.write(nwb)
    atomic_write_bytes(out, tmp.read_bytes())
    tmp.unlink()
    return out
