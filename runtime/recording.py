"""Crash-safe session recordings: an append-only file of checksummed records.

Layout (little-endian), documented for outside readers in ``docs/recording.md``::

    file    := MAGIC record*
    MAGIC   := b"CLREC" 0x00 u16(version=1)                       (8 bytes)
    record  := u32 length | u32 crc | u8 type | u64 host_ns | payload[length]
    crc     := zlib.crc32 (CRC-32/ISO-HDLC) over length, type, host_ns and payload

``host_ns`` is ``time.monotonic_ns()`` of the recording host (the wall-clock start
time is in the first META record). Record types: META (JSON), RX (bytes exactly as
received from the device, so replay sees what the session saw, garbage included),
TX (bytes exactly as sent: the command after clipping), OUTPUT (u32 step index, u32 input
frame sequence number, float32 model output), EVENT (JSON: watchdog, reconnects, device status...),
SUMMARY (JSON, last), STEPS (per-step timing, written off the hot path: ``runtime.observe.record_steps``),
MORE_OUTPUT (u32 step index, u32 input frame sequence number, u32 index of the output in META ``outputs``,
float32 values: the graph's other data outputs, written right after the step's OUTPUT), FAMILY_STATE (u32 step
index, u32 input frame sequence number, float32 values: what the family computed outside the graph, an observer's
estimate, named by META ``family_state``; written after the step's outputs).

The hot path only appends to an in-memory buffer; a background thread writes it
out at least every ``flush_interval_s`` (default 0.5 s), so a session killed with
SIGKILL loses at most that much. The reader stops at a torn or corrupt tail and
reports how many bytes it dropped; a corrupt record with more of the file after it is reported as damage
(``damaged``), not as a session cut short.
"""

from __future__ import annotations

import enum
import json
import os
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from closedloop.common.atomic import atomic_write_bytes
from closedloop.common.jsonout import finite

MAGIC = b"CLREC\x00" + struct.pack("<H", 1)
_HEAD = struct.Struct("<IIBQ")  # length, crc, type, host_ns
_CRC_HEAD = struct.Struct("<IBQ")
_VALUES_HEAD = {0: struct.Struct("<II"), 1: struct.Struct("<III")}  # step, input seq (and a MORE_OUTPUT's index)
MAX_RECORD = 16 << 20


class RecordType(enum.IntEnum):
    META = 1
    RX = 2
    TX = 3
    OUTPUT = 4
    EVENT = 5
    SUMMARY = 6
    STEPS = 7
    MORE_OUTPUT = 8
    FAMILY_STATE = 9


class RecordingError(ValueError):
    """A file is not a closedloop recording, or a recording cannot be written."""


def _crc(length: int, rtype: int, host_ns: int, payload: bytes | memoryview) -> int:
    return zlib.crc32(payload, zlib.crc32(_CRC_HEAD.pack(length, rtype, host_ns)))


#: how far past a bad record the reader looks for intact ones (to tell damage from a file cut short)
_RESYNC_BYTES = 4 << 20  # a few seconds of scanning at worst; records are a few kB


def _next_intact(data: bytes, start: int, after_ns: int) -> int | None:
    """The offset of the first intact record at or after ``start`` (a header whose length fits, whose host time is
    not before ``after_ns`` nor a day after it, and whose checksum holds), within ``_RESYNC_BYTES``; None if none."""
    stop = min(len(data) - _HEAD.size, start + _RESYNC_BYTES)
    for q in range(start, stop + 1):
        n, crc, rtype, host_ns = _HEAD.unpack_from(data, q)
        if n > MAX_RECORD or q + _HEAD.size + n > len(data) or not after_ns <= host_ns <= after_ns + 86_400 * 10**9:
            continue
        if _crc(n, rtype, host_ns, memoryview(data)[q + _HEAD.size : q + _HEAD.size + n]) == crc:
            return q
    return None


def encode_record(rtype: int, payload: bytes | memoryview, host_ns: int) -> bytes:
    n = len(payload)
    return _HEAD.pack(n, _crc(n, rtype, host_ns, payload), rtype, host_ns) + bytes(payload)


class RecordingWriter:
    """Append records; a background thread flushes to disk at least every ``flush_interval_s``."""

    def __init__(self, path: str | Path, flush_interval_s: float = 0.5, fsync: bool = True):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        except FileExistsError:
            raise RecordingError(f"{self.path} already exists; recordings are never overwritten, choose a new name") from None
        os.write(self._fd, MAGIC)
        self._buf = bytearray()
        self._unflushed = 0  # records in _buf
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._fsync = fsync
        self._interval = flush_interval_s
        self._closed = threading.Event()
        self.bytes_written = len(MAGIC)
        self.records = 0
        #: why writing stopped (a full disk: "OSError: [Errno 28] No space left on device"), None while it works.
        #: From then on records are counted in ``records_dropped`` and not kept: the session goes on without them.
        self.error: str | None = None
        self.records_dropped = 0
        self._thread = threading.Thread(target=self._flusher, name="closedloop-recorder", daemon=True)
        self._thread.start()

    def append(self, rtype: int, payload: bytes | memoryview, host_ns: int | None = None) -> None:
        if host_ns is None:
            host_ns = time.monotonic_ns()
        n = len(payload)
        if n > MAX_RECORD:
            raise RecordingError(f"record of {n} bytes exceeds the {MAX_RECORD}-byte limit")
        if self.error is not None:  # writing has failed: nothing is kept (no buffer grows without end)
            self.records_dropped += 1
            return
        head = _HEAD.pack(n, _crc(n, rtype, host_ns, payload), rtype, host_ns)
        with self._lock:
            self._buf += head
            self._buf += payload
            self.records += 1
            self._unflushed += 1

    def append_json(self, rtype: int, obj: Any, host_ns: int | None = None) -> None:
        """Strict JSON (a non-finite number as null, as ``--json`` writes it), so any JSON reader takes the record."""
        self.append(rtype, json.dumps(finite(obj), default=_json_default, allow_nan=False).encode(), host_ns)

    def append_output(self, step: int, input_seq: int, values: np.ndarray, host_ns: int | None = None,
                      index: int = 0) -> None:
        """A model output: loop step, sequence number of the input frame it answered, values. ``index`` is the
        output's place among the graph's data outputs (META ``outputs``): 0, the first, is an OUTPUT record;
        another is a MORE_OUTPUT record that carries its index."""
        rtype = RecordType.MORE_OUTPUT if index else RecordType.OUTPUT
        self._append_values(rtype, step, input_seq, values, host_ns, (index,) if index else ())

    def append_state(self, step: int, input_seq: int, values: np.ndarray, host_ns: int | None = None) -> None:
        """The family's state after a model run (``FamilyPlugin.state_vector``): a FAMILY_STATE record."""
        self._append_values(RecordType.FAMILY_STATE, step, input_seq, values, host_ns)

    def _append_values(self, rtype: int, step: int, input_seq: int, values: np.ndarray, host_ns: int | None,
                       more: tuple[int, ...] = ()) -> None:
        """u32 step, u32 input sequence number (and ``more`` u32s), then the values as float32."""
        head = _VALUES_HEAD[len(more)].pack(step & 0xFFFFFFFF, input_seq & 0xFFFFFFFF, *more)
        self.append(rtype, head + values.astype(np.float32, copy=False).tobytes(), host_ns)

    def flush(self) -> None:
        """Write what was appended. A failed write (a full disk) is not raised: it is kept in ``error``, and the
        file ends with what was written until then (its last record torn, as a crash leaves it)."""
        with self._flush_lock:  # one flush at a time (the flusher thread's, a caller's): records stay in order
            with self._lock:
                data, self._buf, n_records = self._buf, bytearray(), self._unflushed
                self._unflushed = 0
            if not data or self.error is not None:
                return
            view = memoryview(data)
            try:
                while view:
                    n = os.write(self._fd, view)
                    view = view[n:]
                    self.bytes_written += n
                if self._fsync:
                    os.fsync(self._fd)
            except OSError as exc:
                self.error = f"{type(exc).__name__}: {exc}"
                self.records_dropped += n_records

    def _flusher(self) -> None:
        while not self._closed.wait(self._interval):
            self.flush()

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._thread.join()
        self.flush()
        os.close(self._fd)

    def __enter__(self) -> RecordingWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _json_default(o: Any) -> Any:
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, enum.Enum):
        return o.value
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"cannot record {type(o).__name__} as JSON")


@dataclass(slots=True)  # a long session's recording holds millions: no per-record __dict__
class Record:
    type: RecordType | int
    host_ns: int
    payload: bytes

    def json(self) -> Any:
        """The JSON value of a META, EVENT or SUMMARY record."""
        self._expect("json", (RecordType.META, RecordType.EVENT, RecordType.SUMMARY))
        return json.loads(self.payload)

    def output(self) -> tuple[int, int, np.ndarray]:
        """(loop step, input frame sequence number, float32 values) of an OUTPUT, MORE_OUTPUT or FAMILY_STATE record."""
        self._expect("output", (RecordType.OUTPUT, RecordType.MORE_OUTPUT, RecordType.FAMILY_STATE))
        step, seq = struct.unpack_from("<II", self.payload)
        return step, seq, np.frombuffer(self.payload, dtype=np.float32, offset=12 if self.output_index else 8)

    def _expect(self, method: str, types: tuple[RecordType, ...]) -> None:
        if self.type not in types:
            name = self.type.name if isinstance(self.type, RecordType) else f"type {self.type}"
            raise ValueError(f"Record.{method}() reads {', '.join(t.name for t in types)} records; this record is {name} "
                             "(docs/recording.md: what each record type holds)")

    @property
    def output_index(self) -> int:
        """The output's place among the graph's data outputs (META ``outputs``): 0 for an OUTPUT record."""
        return struct.unpack_from("<I", self.payload, 8)[0] if self.type == RecordType.MORE_OUTPUT else 0


class RecordingReader:
    """Read every intact record; stop at a torn or corrupt tail and say how much was dropped.

    With ``resync`` a damaged record inside the file (a disk or copy error: a bad checksum or length with intact
    records after it) is skipped and reading goes on from the next intact record; ``skipped`` lists each such
    stretch as ``(start byte, end byte)``. Without it (the format's rule, docs/recording.md) reading stops there.
    """

    def __init__(self, path: str | Path, resync: bool = False):
        self.path = Path(path)
        if not self.path.is_file():
            what = ("is a folder" if self.path.is_dir() else "does not exist" if not self.path.exists() else
                    "is not a regular file (a pipe or a device; a recording is read whole: copy it to a file first)")
            raise RecordingError(f"{self.path} {what}: give a recording file (closedloop run ... --record FILE.clrec)")
        data = self.path.read_bytes()
        if not data.startswith(MAGIC[:6]):
            raise RecordingError(f"{self.path} is not a closedloop recording (bad magic {data[:8]!r})")
        if len(data) < len(MAGIC):
            raise RecordingError(f"{self.path} is not a recording: {len(data)} bytes, shorter than the "
                                 f"{len(MAGIC)}-byte file header (a file cut short as it was created)")
        version = struct.unpack_from("<H", data, 6)[0]
        if version != 1:
            raise RecordingError(f"{self.path}: recording format version {version} is not supported (this reads 1)")
        self.records: list[Record] = []
        self.skipped: list[tuple[int, int]] = []  # with resync: damaged stretches skipped, (start, end) bytes
        pos = len(MAGIC)
        self.tail_problem = ""
        self.damaged = False  # a bad record with more of the file after it (not a tail cut short by a crash)
        while pos < len(data):
            if pos + _HEAD.size > len(data):
                self.tail_problem = "torn record header"
                break
            n, crc, rtype, host_ns = _HEAD.unpack_from(data, pos)
            end = pos + _HEAD.size + n
            if n > MAX_RECORD or end > len(data):
                # a crash cuts the last record short; a length no writer writes, or intact records further on,
                # say the file was damaged here instead
                later = _next_intact(data, pos + 1, self.records[-1].host_ns if self.records else 0)
                if resync and later is not None:
                    self.skipped.append((pos, later))
                    pos = later
                    continue
                self.damaged = n > MAX_RECORD or later is not None
                self.tail_problem = (f"record length {n} over the {MAX_RECORD}-byte limit" if n > MAX_RECORD
                                     else "torn record (length runs past the end of the file)")
                if self.damaged:
                    self.tail_problem += (f" at byte {pos}, with {len(data) - pos} more bytes after it"
                                          + (f" and intact records again from byte {later}" if later is not None else "")
                                          + ": the file was damaged there (a disk or copy error), not cut short")
                break
            payload = data[pos + _HEAD.size : end]
            if _crc(n, rtype, host_ns, payload) != crc:
                # the last record of a file cut short, or a record damaged inside a file that goes on after it
                later = (_next_intact(data, pos + 1, self.records[-1].host_ns if self.records else 0)
                         if resync and end < len(data) else None)
                if later is not None:
                    self.skipped.append((pos, later))
                    pos = later
                    continue
                self.damaged = end < len(data)
                self.tail_problem = ("record checksum mismatch" if not self.damaged else
                                     f"record checksum mismatch at byte {pos}, with {len(data) - end} more bytes "
                                     "after that record: the file was damaged there (a disk or copy error), not "
                                     "cut short")
                break
            try:
                t: RecordType | int = RecordType(rtype)
            except ValueError:
                t = rtype  # a newer writer's record type: keep it, readers skip what they don't know
            self.records.append(Record(t, host_ns, payload))
            pos = end
        self.valid_bytes = pos
        self.tail_bytes = len(data) - pos  # dropped at the end: a file cut short, or damage with nothing readable after
        self._tail_damaged = self.damaged
        self.dropped_bytes = self.tail_bytes + sum(b - a for a, b in self.skipped)
        self.damaged = self.damaged or bool(self.skipped)

    def __iter__(self) -> Iterator[Record]:
        return iter(self.records)

    def of_type(self, rtype: RecordType) -> list[Record]:
        return [r for r in self.records if r.type == rtype]

    @property
    def meta(self) -> dict:
        metas = self.of_type(RecordType.META)
        return metas[0].json() if metas else {}

    @property
    def summary(self) -> dict | None:
        s = self.of_type(RecordType.SUMMARY)
        return s[-1].json() if s else None

    def problems(self) -> list[str]:
        """What a reader of this recording should know before trusting it: bytes dropped at a bad record (damage
        or a session cut short), a session that never ended (no SUMMARY) or never ran (no META). Empty for a whole
        recording of a session that ended."""
        out = []
        for a, b in self.skipped:
            out.append(f"{b - a} bytes were skipped at a damaged record (bytes {a} to {b}: a disk or copy error); "
                       "reading went on from the next intact record, so the records of that stretch are missing")
        if self.tail_bytes:
            out.append(f"{self.tail_bytes} bytes were dropped at a bad record ({self.tail_problem})"
                       + ("" if self._tail_damaged else ": the session did not end cleanly"))
        elif self.summary is None and self.meta:
            out.append("no SUMMARY record: the session did not end (its process was killed, or the machine "
                       "stopped); what it recorded until then is here")
        if not self.meta and self.dropped_bytes:  # cut before or inside its META: whether it ran cannot be told
            out.append("no META record: the file ends before it (cut inside the first records), so whether the "
                       "session ran cannot be told from it")
        elif not self.meta:
            out.append("no META record: the session was refused before it ran (its handshake's bytes only)")
        return out

    def describe(self) -> str:
        counts: dict[str, int] = {}
        for r in self.records:
            name = r.type.name if isinstance(r.type, RecordType) else f"type{r.type}"
            counts[name] = counts.get(name, 0) + 1
        s = f"{self.path}: {len(self.records)} records ({', '.join(f'{k} {v}' for k, v in counts.items())})"
        if self.skipped:
            s += (f"; skipped {sum(b - a for a, b in self.skipped)} damaged bytes in {len(self.skipped)} "
                  f"stretch{'es' if len(self.skipped) > 1 else ''} (from byte {self.skipped[0][0]})")
        if self.tail_bytes:
            s += (f"; dropped a {self.tail_bytes}-byte tail ({self.tail_problem})"
                  + ("" if self._tail_damaged else " - the session did not end cleanly"))
        return s

    def said_by_describe(self) -> int:
        """How many of ``problems()``, from the first, ``describe()`` has already said (the skips and the tail)."""
        return len(self.skipped) + (1 if self.tail_bytes else 0)

    def salvage(self, out: str | Path) -> Path:
        """Write every record read (with ``resync``: past damaged stretches too) to a new recording ``out``, which
        every reader then reads whole; ``out`` must not exist (recordings are never overwritten)."""
        out = Path(out)
        if out.exists():
            raise RecordingError(f"{out} already exists; recordings are never overwritten, choose a new name")
        body = b"".join(encode_record(int(r.type), r.payload, r.host_ns) for r in self.records)
        return atomic_write_bytes(out, MAGIC + body)
