"""A lock-free ring of per-step records in shared memory: the loop writes, observers read.

The session loop must never wait for whoever watches it (a browser monitor, an LSL
outlet, a user's callback). So each step's record goes into a fixed-size ring that
the loop fills without allocating and without a lock, and each reader keeps its own
cursor: a reader that falls more than ``capacity`` steps behind loses the oldest
records and counts them, the loop never notices. The ring lives in a
``multiprocessing.shared_memory`` block, so a reader can be another process (the
monitor's web server runs in one, away from the loop's GIL) that attaches by name.

Layout (little-endian; an outside reader can implement it from this table): a
header of ``_HEADER`` int64 words, then the step arrays, then the event slots.

=======  ===================================================================
word     meaning
=======  ===================================================================
0        magic ``0x434C4F4F50524E47`` ("CLOOPRNG")
1        layout version (4)
2        capacity C (step records)
3        n_in (input values per step), 4: n_out, 5: n_cmd
6        steps published (monotonic count; slot of step record j is j mod C)
7        event capacity E, 8: event slot size in bytes, 9: events published
10       run capacity R (model-run records), 11: runs published (slot of run j is j mod R)
12       n_state (the family's state values per step; 0 for a family that publishes none)
13       sent capacity S (command records), 14: commands sent (slot of command j is j mod S)
=======  ===================================================================

Step arrays, each C long: int64 ``step``, ``t_ns`` (``time.monotonic_ns`` at the step's
start), ``latency_ns``, ``lateness_ns``, ``input_seq`` (-1: no input acted on), int64
``flags`` (``FLAG_*``); float32 ``inputs[C, n_in]``, ``outputs[C, n_out]``, ``command[C, n_cmd]``
(NaN where nothing was sent), ``state[C, n_state]`` (what the family computes outside the graph after the
step's last model run, named by the session info's ``state`` labels: an observer's estimate; NaN where the model
did not run). Run arrays, each R long: int64 ``run_step``, ``run_input_seq``,
``run_t_ns`` (``time.monotonic_ns`` when the output was ready); float32 ``run_outputs[R, n_out]``:
one record per model run, so a step that ran the model on several frames (a decoder catching up)
has a run record for each, where its step record holds the last. Sent arrays, each S long: int64
``sent_step``, ``sent_t_ns`` (``time.monotonic_ns`` right after the command was written to the device),
``sent_flags`` (``FLAG_COMMAND`` or ``FLAG_SAFE``); float32 ``sent_command[S, n_cmd]``: one record per command
a step sent, so a step that sent several (a decoder answering each frame of a backlog) has one for each, where its step
record holds the last. Event slots: E slots of
``slot`` bytes, each a u32 length then that many bytes of UTF-8 JSON.

A record is written in full before the published count moves past it; a reader
copies a span, then re-reads the count and discards any record the writer may have
overwritten meanwhile, so what it keeps is whole.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np

MAGIC = 0x434C4F4F50524E47
LAYOUT_VERSION = 4
_HEADER = 16
_W_CAP, _W_NIN, _W_NOUT, _W_NCMD, _W_HEAD, _W_ECAP, _W_ESLOT, _W_EHEAD = 2, 3, 4, 5, 6, 7, 8, 9
_W_RCAP, _W_RHEAD, _W_NSTATE, _W_SCAP, _W_SHEAD = 10, 11, 12, 13, 14

FLAG_ACTED = 1  # the model ran on a device frame this step
FLAG_COMMAND = 2  # a model command was sent
FLAG_SAFE = 4  # the safe command was sent (watchdog, held input missing, non-finite value)
FLAG_DISCONNECTED = 8  # the transport was down for this step
FLAG_WATCHDOG = 16  # the watchdog was tripped (no input for watchdog_s)

_INT_FIELDS = ("step", "t_ns", "latency_ns", "lateness_ns", "input_seq", "flags")
_RUN_FIELDS = ("step", "input_seq", "t_ns")
_SENT_FIELDS = ("step", "t_ns", "flags")


@dataclass
class StepBatch:
    """Copies of the records a reader took in one read, oldest first, and how many it lost before them."""

    step: np.ndarray
    t_ns: np.ndarray
    latency_ns: np.ndarray
    lateness_ns: np.ndarray
    input_seq: np.ndarray
    flags: np.ndarray
    inputs: np.ndarray
    outputs: np.ndarray
    command: np.ndarray
    #: the family's state values after the step's last model run (``info["state"]`` names them; no columns for a
    #: family that publishes none)
    state: np.ndarray
    lost: int = 0

    def __len__(self) -> int:
        return int(self.step.size)


@dataclass
class RunBatch:
    """Copies of model-run records, oldest first: every output the model gave, a step that ran it on several frames
    included (``StepBatch`` holds a step's last), and how many the ring overwrote before this read."""

    step: np.ndarray
    input_seq: np.ndarray
    t_ns: np.ndarray  # time.monotonic_ns() when the output was ready
    outputs: np.ndarray
    lost: int = 0

    def __len__(self) -> int:
        return int(self.step.size)


@dataclass
class CommandBatch:
    """Copies of sent-command records, oldest first: every command a step sent, the model's and the safe one, a step
    that sent several (a decoder answering each frame of a backlog) included (``StepBatch`` holds a step's last;
    the loop's re-sends under ``--overrun hold`` and the stop's safe command have none), and how many the ring
    overwrote before this read."""

    step: np.ndarray
    t_ns: np.ndarray  # time.monotonic_ns() right after the command was written to the device
    flags: np.ndarray  # FLAG_COMMAND (the model's) or FLAG_SAFE (the safe command)
    command: np.ndarray
    lost: int = 0

    def __len__(self) -> int:
        return int(self.step.size)


def _nbytes(capacity: int, n_in: int, n_out: int, n_cmd: int, event_capacity: int, event_slot: int,
            run_capacity: int, n_state: int = 0, sent_capacity: int = 0) -> int:
    return (8 * _HEADER + capacity * (8 * len(_INT_FIELDS) + 4 * (n_in + n_out + n_cmd + n_state))
            + run_capacity * (8 * len(_RUN_FIELDS) + 4 * n_out)
            + sent_capacity * (8 * len(_SENT_FIELDS) + 4 * n_cmd) + event_capacity * event_slot)


def _copy_span(head_now: Any, capacity: int, head: int, cursor: int, max_records: int | None,
               arrays: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], int]:
    """Copies of records ``[start, head)`` of ring ``arrays`` and the number lost before them (overwritten before
    this read, skipped for ``max_records``, or torn while copied: those the writer may have reached meanwhile)."""
    # The slot after the newest record is the next one the writer fills: C - 1 records are readable.
    start = max(cursor, head - capacity + 1)
    if max_records is not None and head - start > max_records:
        start = head - max_records  # a reader that only wants the newest: the rest counts as skipped
    idx = np.arange(start, head) % capacity
    out = {name: arr[idx] for name, arr in arrays.items()}
    # Anything the writer reached while we copied may be torn: keep only records it cannot have touched.
    # (The record being filled is slot head2 % C, which a published span of at most C - 1 never includes.)
    drop = max(0, head_now() - capacity + 1 - start)
    if drop:
        out = {k: v[drop:] for k, v in out.items()}
    return out, (start - cursor) + drop


class StepRing:
    """The shared ring. ``StepRing.create(...)`` for the writer, ``StepRing.attach(name)`` for a reader elsewhere."""

    def __init__(self, shm: shared_memory.SharedMemory, owner: bool):
        self._shm = shm
        self.owner = owner
        buf = shm.buf
        self._header = np.ndarray((_HEADER,), dtype="<i8", buffer=buf)
        h = self._header
        if int(h[0]) != MAGIC:
            raise ValueError(f"shared memory {shm.name!r} is not a closedloop step ring (no CLOOPRNG magic)")
        if int(h[1]) != LAYOUT_VERSION:
            raise ValueError(f"shared memory {shm.name!r} is a step ring of layout {int(h[1])}; this closedloop reads "
                             f"layout {LAYOUT_VERSION} (docs/monitor.md): read it with the closedloop version that "
                             "runs the session")
        cap, n_in, n_out, n_cmd = (int(h[w]) for w in (_W_CAP, _W_NIN, _W_NOUT, _W_NCMD))
        self.capacity, self.n_in, self.n_out, self.n_cmd = cap, n_in, n_out, n_cmd
        self.n_state = int(h[_W_NSTATE])
        self.event_capacity, self.event_slot = int(h[_W_ECAP]), int(h[_W_ESLOT])
        self.run_capacity = rcap = int(h[_W_RCAP])
        off = 8 * _HEADER

        def carve(shape: tuple[int, ...], dtype: str) -> np.ndarray:  # the next array of the layout
            nonlocal off
            a = np.ndarray(shape, dtype=dtype, buffer=buf, offset=off)
            off += a.nbytes
            return a

        self._ints: dict[str, np.ndarray] = {name: carve((cap,), "<i8") for name in _INT_FIELDS}
        self.inputs, self.outputs, self.command, self.state = (
            carve((cap, n), "<f4") for n in (n_in, n_out, n_cmd, self.n_state))
        self._run_ints: dict[str, np.ndarray] = {name: carve((rcap,), "<i8") for name in _RUN_FIELDS}
        self.run_outputs = carve((rcap, n_out), "<f4")
        self.sent_capacity = scap = int(h[_W_SCAP])
        self._sent_ints: dict[str, np.ndarray] = {name: carve((scap,), "<i8") for name in _SENT_FIELDS}
        self.sent_command = carve((scap, n_cmd), "<f4")
        self._events = np.ndarray((self.event_capacity, self.event_slot), dtype=np.uint8, buffer=buf, offset=off)
        # Per-slot row views made once, so the writer's copies create no array objects per step.
        self._in_rows = list(self.inputs)
        self._out_rows = list(self.outputs)
        self._cmd_rows = list(self.command)
        self._state_rows = list(self.state)
        self._run_out_rows = list(self.run_outputs)
        self._sent_rows = list(self.sent_command)
        self._slot = 0  # writer: slot of the record being filled

    # --- lifecycle ----------------------------------------------------------------

    @classmethod
    def create(cls, n_in: int, n_out: int, n_cmd: int, capacity: int = 4096, event_capacity: int = 256,
               event_slot: int = 2048, run_capacity: int | None = None, n_state: int = 0,
               sent_capacity: int | None = None) -> StepRing:
        """``run_capacity``: model-run records and ``sent_capacity``: sent-command records (each default
        ``capacity``); ``n_state``: the family's state values per step (``FamilyPlugin.state_vector``)."""
        run_capacity = capacity if run_capacity is None else run_capacity
        sent_capacity = capacity if sent_capacity is None else sent_capacity
        for what, v in (("n_in", n_in), ("n_out", n_out), ("n_cmd", n_cmd), ("n_state", n_state)):
            if v < 0:
                raise ValueError(f"{what} must be >= 0, got {v}")
        if capacity < 2 or run_capacity < 2 or sent_capacity < 2 or event_capacity < 1 or event_slot < 64:
            raise ValueError(f"ring capacity {capacity} (>= 2), run capacity {run_capacity} (>= 2), sent capacity "
                             f"{sent_capacity} (>= 2), event capacity {event_capacity} (>= 1) and event slot "
                             f"{event_slot} bytes (>= 64) are too small")
        size = _nbytes(capacity, n_in, n_out, n_cmd, event_capacity, event_slot, run_capacity, n_state,
                       sent_capacity)
        shm = shared_memory.SharedMemory(create=True, size=size)
        h = np.ndarray((_HEADER,), dtype="<i8", buffer=shm.buf)
        h[:] = 0
        h[0], h[1] = MAGIC, LAYOUT_VERSION
        h[_W_CAP], h[_W_NIN], h[_W_NOUT], h[_W_NCMD] = capacity, n_in, n_out, n_cmd
        h[_W_ECAP], h[_W_ESLOT] = event_capacity, event_slot
        h[_W_RCAP], h[_W_NSTATE], h[_W_SCAP] = run_capacity, n_state, sent_capacity
        del h
        return cls(shm, owner=True)

    @classmethod
    def attach(cls, name: str) -> StepRing:
        # track=False: a reader must not unlink the writer's block when it exits (Python >= 3.13 has the
        # flag; on 3.11/3.12 the resource tracker is told to forget the block instead).
        try:
            shm = shared_memory.SharedMemory(name=name, track=False)  # type: ignore[call-arg]
        except TypeError:
            shm = shared_memory.SharedMemory(name=name)
            try:
                from multiprocessing import resource_tracker

                resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
            except Exception:  # noqa: BLE001  (best effort: only a warning at exit is at stake)
                pass
        return cls(shm, owner=False)

    @property
    def name(self) -> str:
        return self._shm.name

    def close(self) -> None:
        """Drop this process's mapping; the owner also frees the block."""
        for attr in ("_header", "_ints", "inputs", "outputs", "command", "state", "_events", "_in_rows", "_out_rows",
                     "_cmd_rows", "_state_rows", "_run_ints", "run_outputs", "_run_out_rows"):
            if hasattr(self, attr):
                delattr(self, attr)
        try:
            self._shm.close()
        except BufferError:
            return  # a StepBatch view still points into it; the mapping goes with the process
        if self.owner:
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass

    # --- writer (the loop's thread; no allocation, no lock) -------------------------

    def begin(self, step: int, t_ns: int) -> None:
        """Start the record of ``step``: inputs, outputs, command and state start as NaN, flags as 0."""
        i = int(self._header[_W_HEAD]) % self.capacity
        self._slot = i
        ints = self._ints
        ints["step"][i] = step
        ints["t_ns"][i] = t_ns
        ints["input_seq"][i] = -1
        ints["flags"][i] = 0
        self._in_rows[i].fill(np.nan)
        self._out_rows[i].fill(np.nan)
        self._cmd_rows[i].fill(np.nan)
        self._state_rows[i].fill(np.nan)

    def input_row(self) -> np.ndarray:
        """The current record's input row, to be written in place (``InputKind.to_vector``)."""
        return self._in_rows[self._slot]

    def set_input_seq(self, seq: int) -> None:
        self._ints["input_seq"][self._slot] = seq

    def set_output(self, values: np.ndarray, offset: int = 0) -> None:
        """Write ``values`` into the current record's output row from ``offset`` (a graph's further data outputs
        follow its first, in order: the session's ``info["outputs"]`` gives each one's ``offset``)."""
        _fill(self._out_rows[self._slot], values, offset)

    def set_command(self, values: np.ndarray) -> None:
        _fill(self._cmd_rows[self._slot], values)

    def publish_command(self, values: np.ndarray, t_ns: int, flags: int) -> None:
        """A command went to the device at ``t_ns``: write it into the current record's command row (the step's
        last), add ``flags`` (``FLAG_COMMAND`` or ``FLAG_SAFE``) and publish a sent record of its own."""
        _fill(self._cmd_rows[self._slot], values)
        self._ints["flags"][self._slot] |= flags
        j = int(self._header[_W_SHEAD])
        i = j % self.sent_capacity
        sent = self._sent_ints
        sent["step"][i] = self._ints["step"][self._slot]
        sent["t_ns"][i] = t_ns
        sent["flags"][i] = flags
        row = self._sent_rows[i]
        row.fill(np.nan)
        _fill(row, values)
        self._header[_W_SHEAD] = j + 1

    def set_state(self, values: np.ndarray) -> None:
        """The family's state after this step's model run (its first ``n_state`` values)."""
        _fill(self._state_rows[self._slot], values)

    def add_flags(self, flags: int) -> None:
        self._ints["flags"][self._slot] |= flags

    def publish_run(self, t_ns: int) -> None:
        """The model ran on the current record's input frame: publish a run record of its step, input sequence
        number and output row as they are now (a later run in the same step overwrites the step record's)."""
        j = int(self._header[_W_RHEAD])
        i = j % self.run_capacity
        runs, ints, slot = self._run_ints, self._ints, self._slot
        runs["step"][i] = ints["step"][slot]
        runs["input_seq"][i] = ints["input_seq"][slot]
        runs["t_ns"][i] = t_ns
        np.copyto(self._run_out_rows[i], self._out_rows[slot])
        self._header[_W_RHEAD] = j + 1

    def publish(self, latency_ns: int, lateness_ns: int) -> None:
        """Finish the current record and make it visible to readers."""
        i = self._slot
        self._ints["latency_ns"][i] = latency_ns
        self._ints["lateness_ns"][i] = lateness_ns
        self._header[_W_HEAD] += 1

    def event(self, obj: dict[str, Any]) -> None:
        """Append an event (rare: watchdog trips, reconnects, repairs); JSON longer than a slot is cut to its kind."""
        data = json.dumps(obj, default=_json_default, separators=(",", ":")).encode()
        if len(data) + 4 > self.event_slot:
            data = json.dumps({"event": obj.get("event"), "step": obj.get("step"), "truncated": True}).encode()
        j = int(self._header[_W_EHEAD])
        slot = self._events[j % self.event_capacity]
        slot[:4] = np.frombuffer(np.uint32(len(data)).tobytes(), dtype=np.uint8)
        slot[4 : 4 + len(data)] = np.frombuffer(data, dtype=np.uint8)
        self._header[_W_EHEAD] = j + 1

    # --- readers (any thread or process) ----------------------------------------------

    @property
    def published(self) -> int:
        return int(self._header[_W_HEAD])

    @property
    def events_published(self) -> int:
        return int(self._header[_W_EHEAD])

    @property
    def runs_published(self) -> int:
        return int(self._header[_W_RHEAD])

    @property
    def commands_published(self) -> int:
        return int(self._header[_W_SHEAD])

    def read(self, cursor: int, max_records: int | None = None) -> tuple[StepBatch, int]:
        """Copies of the records from ``cursor`` on; returns them and the cursor to pass next time."""
        head = self.published
        arrays = dict(self._ints, inputs=self.inputs, outputs=self.outputs, command=self.command, state=self.state)
        got, lost = _copy_span(lambda: self.published, self.capacity, head, cursor, max_records, arrays)
        return StepBatch(**got, lost=lost), head

    def read_runs(self, cursor: int, max_records: int | None = None) -> tuple[RunBatch, int]:
        """Copies of the model-run records from ``cursor`` on; returns them and the cursor to pass next time."""
        head = self.runs_published
        arrays = dict(self._run_ints, outputs=self.run_outputs)
        got, lost = _copy_span(lambda: self.runs_published, self.run_capacity, head, cursor, max_records, arrays)
        return RunBatch(**got, lost=lost), head

    def read_commands(self, cursor: int, max_records: int | None = None) -> tuple[CommandBatch, int]:
        """Copies of the sent-command records from ``cursor`` on; returns them and the cursor to pass next time."""
        head = self.commands_published
        arrays = dict(self._sent_ints, command=self.sent_command)
        got, lost = _copy_span(lambda: self.commands_published, self.sent_capacity, head, cursor, max_records, arrays)
        return CommandBatch(**got, lost=lost), head

    def read_events(self, cursor: int) -> tuple[list[dict[str, Any]], int, int]:
        """Events from ``cursor`` on: (events, next cursor, number lost to overwriting)."""
        head = self.events_published
        start = max(cursor, head - self.event_capacity + 1)
        out = []
        for j in range(start, head):
            slot = self._events[j % self.event_capacity]
            n = int(np.frombuffer(slot[:4].tobytes(), dtype="<u4")[0])
            try:
                out.append(json.loads(slot[4 : 4 + n].tobytes()))
            except (ValueError, UnicodeDecodeError):
                continue  # overwritten while read
        return out, head, start - cursor


def _fill(row: np.ndarray, values: np.ndarray, offset: int = 0) -> None:
    """Copy what fits of ``values`` into ``row`` from ``offset`` (no allocation: the loop's path)."""
    n = min(row.size - offset, values.size)
    if n > 0:
        np.copyto(row[offset:offset + n], values.reshape(-1)[:n], casting="unsafe")


def _json_default(o: Any) -> Any:
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, np.generic):
        return o.item()
    return str(o)
