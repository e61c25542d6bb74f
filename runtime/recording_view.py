"""A recording decoded into arrays: what a plot, a monitor or an NWB file is made from.

``view_recording`` reads a recording once and decodes its RX bytes into the device's
input stream (neural counts, plant measurements, joint states), its TX bytes into the
commands actually sent (and a decoder's typed text), its OUTPUT records into model
outputs (and MORE_OUTPUT records into the graph's other data outputs, by name; FAMILY_STATE records into what the
family computed outside the graph, an observer's estimate), its EVENTs, and its STEPS records into per-step timing.
Host times are
seconds since the first record; device times are the device's own clock.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from closedloop.firmware_bridge import (
    ActuatorCommand,
    DecoderOutput,
    FrameParser,
    JointCommand,
    JointState,
    NeuralFrame,
    PlantMeasurement,
)
from closedloop.firmware_bridge.signing import UnverifiedTags
from closedloop.firmware_bridge.transports.lsl import STATUS_LSL_CHANNELS

from .observe.record_steps import STEPS_RECORD_TYPE, decode_steps
from .recording import RecordingReader, RecordType


@dataclass
class Series:
    """Samples of one stream: host seconds, device seconds (NaN where none), values (samples x width) and the
    device frame sequence number each belongs to (-1 where none: a command), which pairs an input frame with the
    model run that read it."""

    t_host_s: list[float] = field(default_factory=list)
    t_device_s: list[float] = field(default_factory=list)
    values: list[np.ndarray] = field(default_factory=list)
    seq: list[int] = field(default_factory=list)

    def add(self, t_host: float, t_device: float, v: np.ndarray, seq: int = -1) -> None:
        self.t_host_s.append(t_host)
        self.t_device_s.append(t_device)
        self.values.append(np.asarray(v, dtype=np.float64).reshape(-1))
        self.seq.append(seq)

    def array(self) -> np.ndarray:
        return np.stack(self.values) if self.values else np.zeros((0, 0))

    def drop_odd_sizes(self) -> int:
        """Keep the samples of the stream's own width (the most common one) and drop the others, returning how
        many: frames of another size than the HELLO's, which the session refused (``input_refused`` events), would
        make the stream's samples no table."""
        if not self.values:
            return 0
        sizes = np.array([v.size for v in self.values])
        values, counts = np.unique(sizes, return_counts=True)
        width = values[np.argmax(counts)]
        keep = np.flatnonzero(sizes == width)
        dropped = len(self.values) - keep.size
        if dropped:
            for name in ("t_host_s", "t_device_s", "values", "seq"):
                old = getattr(self, name)
                setattr(self, name, [old[i] for i in keep])
        return int(dropped)

    def __len__(self) -> int:
        return len(self.values)


@dataclass
class RecordingView:
    path: Path
    meta: dict[str, Any]
    summary: dict[str, Any] | None
    t0_ns: int
    #: the device's stream by NWB-style name: binned_spikes, plant_output_y, plant_input_u, joint_positions, ...
    inputs: dict[str, Series]
    commands: Series
    outputs: Series
    #: a decoder's DECODER_OUTPUT frames: (host seconds, bin index, text added)
    typed: list[tuple[float, int, str]]
    #: (host seconds, event dict)
    events: list[tuple[float, dict[str, Any]]]
    #: per-step timing (STEPS records): step, t_s (host seconds), latency_us, lateness_us, input_seq, flags
    steps: dict[str, np.ndarray]
    described: str = ""
    #: the graph's other data outputs (MORE_OUTPUT records) by name, META ``outputs`` order
    more_outputs: dict[str, Series] = field(default_factory=dict)
    #: FAMILY_STATE records (an observer's estimate after each run), their values named by ``state_labels``
    state: Series = field(default_factory=Series)
    state_labels: list[str] = field(default_factory=list)
    #: host seconds of the META record since the first record (the handshake's TX and RX come before it)
    meta_host_s: float = 0.0
    #: frames left out of a stream by name, because their size was not the stream's (the session refused them)
    odd_frames: dict[str, int] = field(default_factory=dict)
    #: what the reader found wrong with the file (``RecordingReader.problems``)
    file_problems: list[str] = field(default_factory=list)
    #: frames of a signed link (the device's, the host's) read without checking their tags: no key is given here
    signed_unchecked: tuple[int, int] = (0, 0)

    def problems(self) -> list[str]:
        """What a reader of this recording should know before trusting what it shows: the file's problems (data
        dropped, a session that never ended or never ran), frames left out of a stream, and an LSL source whose
        channel descriptions changed mid-session. Empty for a whole, clean recording."""
        described = channel_descriptions_over_time(ev for _, ev in self.events)
        times = [t for t, ev in self.events if ev.get("event") == "device_status" and ev.get("code") == STATUS_LSL_CHANNELS]
        changed = ([f"the LSL source's channel descriptions changed during the session ({len(described)} different "
                    f"ones, the last from {max(times):.1f} s): `channels` and the NWB comments hold the first"]
                   if len(described) > 1 and times else [])
        dev, host = self.signed_unchecked
        signed = ([f"the link was signed: {dev} device frames and {host} host frames are shown without checking their "
                   "tags (the session checked the device's as they arrived; `closedloop replay FILE --bundle B --key "
                   "HEX` checks them again)"] if dev or host else [])
        return self.file_problems + changed + signed + [
            f"{n} frame(s) of {name} had another size than the stream's and are left out (the session refused "
            "them: input_refused events)" for name, n in self.odd_frames.items()]

    @property
    def text(self) -> str:
        return "".join(t for _, _, t in self.typed)

    @property
    def channels(self) -> dict[str, list[str]] | None:
        """The input's channel descriptions as an LSL source gave them (``{"label", "unit", "type"}``, one string
        per channel; the ``LSL_CHANNELS`` device statuses, docs/lsl.md), or None where the device sent none."""
        return channels_from_events(ev for _, ev in self.events)


def channel_descriptions_over_time(events) -> list[dict[str, list[str]]]:
    """Every complete ``LSL_CHANNELS`` description among ``device_status`` events that differs from the one before,
    in order (one for a source that never changed its channels)."""
    out: list[dict[str, list[str]]] = []
    for desc in _complete_descriptions(events):
        if not out or desc != out[-1]:
            out.append(desc)
    return out


def channels_from_events(events) -> dict[str, list[str]] | None:
    """Join the parts of the first complete ``LSL_CHANNELS`` description among ``device_status`` events."""
    return next(_complete_descriptions(events), None)


def _complete_descriptions(events):
    got: dict[str, list[str]] = {}
    for ev in events:
        if ev.get("event") != "device_status" or ev.get("code") != STATUS_LSL_CHANNELS:
            continue
        try:
            part = json.loads(ev.get("text", ""))
            first, total = int(part["first"]), int(part["of"])
        except (ValueError, KeyError, TypeError):
            continue
        if first == 0:
            got = {k: [] for k in ("label", "unit", "type")}
        if not got or len(got["label"]) != first:
            continue  # a part out of order (a description cut short): wait for the next whole one
        for k in got:
            got[k].extend(str(x) for x in part.get(k, [""] * int(part["count"])))
        if len(got["label"]) == total:
            yield got
            got = {}


def view_recording(recording: str | Path | RecordingReader) -> RecordingView:
    reader = recording if isinstance(recording, RecordingReader) else RecordingReader(recording)
    t0 = reader.records[0].host_ns if reader.records else 0
    # a signed link's frames carry tags this reader has no key for: read them unchecked, and say how many
    rx_tags, tx_tags = UnverifiedTags(), UnverifiedTags()
    rx, tx = FrameParser(rx_tags), FrameParser(tx_tags)
    inputs: dict[str, Series] = {}
    commands, outputs, state = Series(), Series(), Series()
    more: dict[str, Series] = {}
    out_names = [str(o.get("name", f"output_{i}")) for i, o in enumerate(reader.meta.get("outputs") or [])]
    typed: list[tuple[float, int, str]] = []
    events: list[tuple[float, dict[str, Any]]] = []
    steps_payloads: list[bytes] = []

    def add(name: str, t_host: float, t_dev: float, v: np.ndarray, seq: int) -> None:
        inputs.setdefault(name, Series()).add(t_host, t_dev, v, seq)

    for rec in reader:
        t_host = (rec.host_ns - t0) / 1e9
        if rec.type == RecordType.RX:
            for f in rx.feed(rec.payload):
                m, t_dev, seq = f.message, f.timestamp_us / 1e6, f.seq
                if isinstance(m, NeuralFrame):
                    add("binned_spikes", t_host, t_dev, m.counts, seq)
                elif isinstance(m, PlantMeasurement):
                    add("plant_output_y", t_host, t_dev, m.y, seq)
                    add("plant_input_u", t_host, t_dev, m.u, seq)
                elif isinstance(m, JointState):
                    add("joint_positions", t_host, t_dev, m.q, seq)
                    add("joint_velocities", t_host, t_dev, m.dq, seq)
        elif rec.type == RecordType.TX:
            for f in tx.feed(rec.payload):
                m = f.message
                if isinstance(m, ActuatorCommand):
                    commands.add(t_host, float("nan"), m.u)
                elif isinstance(m, JointCommand):
                    commands.add(t_host, float("nan"), m.values)
                elif isinstance(m, DecoderOutput):
                    typed.append((t_host, int(m.bin_index), m.text))
                    if m.char_probs is not None and m.char_probs.size:  # a decoder that sends its outputs (a generic one): those are its commands
                        commands.add(t_host, float("nan"), m.char_probs)
        elif rec.type in (RecordType.OUTPUT, RecordType.MORE_OUTPUT, RecordType.FAMILY_STATE):
            _, seq, values = rec.output()
            if rec.type == RecordType.OUTPUT:
                series = outputs
            elif rec.type == RecordType.FAMILY_STATE:
                series = state
            else:
                i = rec.output_index
                series = more.setdefault(out_names[i] if i < len(out_names) else f"output_{i}", Series())
            series.add(t_host, float("nan"), values, seq)
        elif rec.type == RecordType.EVENT:
            events.append((t_host, rec.json()))
        elif rec.type == STEPS_RECORD_TYPE:
            steps_payloads.append(bytes(rec.payload))
    odd = {name: n for name, series in inputs.items() if (n := series.drop_odd_sizes())}
    raw = decode_steps(steps_payloads)
    steps = {
        "step": raw["step"],
        "t_s": (raw["t_ns"] - t0) / 1e9,
        "latency_us": raw["latency_ns"] / 1e3,
        "lateness_us": raw["lateness_ns"] / 1e3,
        "input_seq": raw["input_seq"],
        "flags": raw["flags"],
    }
    return RecordingView(path=Path(reader.path), meta=reader.meta, summary=reader.summary, t0_ns=t0, inputs=inputs,
                         commands=commands, outputs=outputs, typed=typed, events=events, steps=steps,
                         described=reader.describe(), more_outputs=more, state=state,
                         state_labels=[str(x) for x in reader.meta.get("family_state") or []],
                         meta_host_s=next(((r.host_ns - t0) / 1e9 for r in reader.records if r.type == RecordType.META),
                                          0.0), odd_frames=odd, file_problems=reader.problems(),
                         signed_unchecked=(rx_tags.signed, tx_tags.signed))
