"""Recordings: round trip, torn tails, corruption, SIGKILL of the writing process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from closedloop.runtime.recording import MAGIC, RecordingError, RecordingReader, RecordingWriter, RecordType


def test_round_trip_every_record_type(tmp_path):
    p = tmp_path / "s.clrec"
    with RecordingWriter(p) as w:
        w.append_json(RecordType.META, {"rate_hz": 50, "arr": np.arange(3)})
        w.append(RecordType.RX, b"\x00\x01garbage\x00")
        w.append_output(7, 41, np.array([1.5, -2.0], dtype=np.float32))
        w.append_output(7, 41, np.array([0.25], dtype=np.float32), index=2)  # the graph's third data output
        w.append(RecordType.TX, b"\x05\x06")
        w.append_json(RecordType.EVENT, {"event": "watchdog"})
        w.append_json(RecordType.SUMMARY, {"steps": 3})
    r = RecordingReader(p)
    assert [rec.type for rec in r] == [RecordType.META, RecordType.RX, RecordType.OUTPUT, RecordType.MORE_OUTPUT,
                                       RecordType.TX, RecordType.EVENT, RecordType.SUMMARY]
    assert r.meta == {"rate_hz": 50, "arr": [0, 1, 2]}
    step, seq, vals = r.of_type(RecordType.OUTPUT)[0].output()
    assert step == 7 and seq == 41 and vals.tolist() == [1.5, -2.0]
    more = r.of_type(RecordType.MORE_OUTPUT)[0]
    assert more.output_index == 2 and more.output()[0:2] == (7, 41) and more.output()[2].tolist() == [0.25]
    assert len(more.payload) == 12 + 4  # u32 step, u32 input seq, u32 index, one float32
    assert r.of_type(RecordType.RX)[0].payload == b"\x00\x01garbage\x00"
    assert r.summary == {"steps": 3}
    assert r.dropped_bytes == 0
    hosts = [rec.host_ns for rec in r]
    assert hosts == sorted(hosts)
    # a record read as what it is not is refused, naming what it is (not JSON text read as floats)
    with pytest.raises(ValueError, match=r"Record.output\(\) reads OUTPUT, MORE_OUTPUT, FAMILY_STATE records; "
                                         r"this record is META"):
        r.of_type(RecordType.META)[0].output()
    with pytest.raises(ValueError, match=r"Record.json\(\) reads META, EVENT, SUMMARY records; this record is OUTPUT"):
        r.of_type(RecordType.OUTPUT)[0].json()


def test_never_overwrites(tmp_path):
    p = tmp_path / "s.clrec"
    RecordingWriter(p).close()
    with pytest.raises(RecordingError, match="already exists"):
        RecordingWriter(p)


def _rx_recording(p, n: int):
    """A recording of ``n`` RX records of 20 bytes each (37 bytes a record with its 17-byte header)."""
    with RecordingWriter(p) as w:
        for i in range(n):
            w.append(RecordType.RX, bytes([i]) * 20)
    return p


@pytest.mark.parametrize("cut", [1, 5, 13, 20])
def test_torn_tail_keeps_everything_before_it(tmp_path, cut):
    p = _rx_recording(tmp_path / "s.clrec", 10)
    data = p.read_bytes()
    p.write_bytes(data[:-cut])
    r = RecordingReader(p)
    assert len(r.records) == 9
    assert r.dropped_bytes == 37 - cut  # one record is 17 header + 20 payload bytes
    assert "did not end cleanly" in r.describe()


def test_a_file_cut_before_its_meta_does_not_say_the_session_was_refused(tmp_path):
    """A session refused at the handshake leaves no META; a file cut short before its META (a crash at the start,
    a copy that stopped) cannot tell whether the session ran, and says that instead."""
    refused = _rx_recording(tmp_path / "refused.clrec", 3)
    assert any("refused before it ran" in p for p in RecordingReader(refused).problems())
    cut = tmp_path / "cut.clrec"
    with RecordingWriter(cut) as w:
        w.append(RecordType.RX, b"hello")
        w.append_json(RecordType.META, {"rate_hz": 50, "pad": "x" * 200})
    cut.write_bytes(cut.read_bytes()[:-40])  # inside the META record
    problems = RecordingReader(cut).problems()
    assert any("whether the session ran cannot be told" in p for p in problems), problems
    assert not any("refused before it ran" in p for p in problems)


def test_a_path_that_is_no_file_is_named_for_what_it_is(tmp_path):
    import os

    with pytest.raises(RecordingError, match="does not exist"):
        RecordingReader(tmp_path / "none.clrec")
    with pytest.raises(RecordingError, match="is a folder"):
        RecordingReader(tmp_path)
    os.mkfifo(tmp_path / "fifo.clrec")
    with pytest.raises(RecordingError, match=r"is not a regular file \(a pipe or a device"):
        RecordingReader(tmp_path / "fifo.clrec")


def test_corrupt_record_stops_reading_there(tmp_path):
    p = _rx_recording(tmp_path / "s.clrec", 5)
    data = bytearray(p.read_bytes())
    data[len(MAGIC) + 2 * 37 + 17 + 3] ^= 0x40  # a payload byte of record 3
    p.write_bytes(bytes(data))
    r = RecordingReader(p)
    assert len(r.records) == 2 and r.damaged and r.dropped_bytes == 3 * 37
    # two records follow it: damage inside the file, said as such, not a session that did not end cleanly
    assert r.tail_problem == ("record checksum mismatch at byte 82, with 74 more bytes after that record: the file "
                              "was damaged there (a disk or copy error), not cut short")
    assert "did not end cleanly" not in r.describe()
    # read on past it (resync): the records after the damaged one are there, the damaged stretch said
    again = RecordingReader(p, resync=True)
    assert [rec.payload[0] for rec in again.records] == [0, 1, 3, 4]
    assert again.skipped == [(82, 119)] and again.dropped_bytes == 37 and again.damaged and again.tail_bytes == 0
    assert again.problems()[0].startswith("37 bytes were skipped at a damaged record (bytes 82 to 119")
    assert "skipped 37 damaged bytes in 1 stretch (from byte 82)" in again.describe()
    # salvaged into a new recording, which reads whole; the damaged file is kept as it is
    from closedloop.sdk.cli import main

    out = tmp_path / "salvaged.clrec"
    assert main(["recording", str(p), "--salvage", str(out)]) == 0
    whole = RecordingReader(out)
    assert [(x.type, x.host_ns, x.payload) for x in whole.records] == [(x.type, x.host_ns, x.payload)
                                                                         for x in again.records]
    assert whole.dropped_bytes == 0 and not whole.damaged and p.read_bytes() == bytes(data)
    assert main(["recording", str(p), "--salvage", str(out)]) == 2  # never overwritten
    # the same mismatch in the last record is a tail cut short by a crash
    p.write_bytes(bytes(data[:len(MAGIC) + 3 * 37]))
    r = RecordingReader(p)
    assert len(r.records) == 2 and not r.damaged and r.tail_problem == "record checksum mismatch"
    assert "did not end cleanly" in r.describe()


def test_a_record_longer_than_the_limit_ends_the_valid_part_and_says_so(tmp_path):
    import struct

    p = _rx_recording(tmp_path / "s.clrec", 3)
    data = bytearray(p.read_bytes())
    struct.pack_into("<I", data, len(MAGIC) + 37, (16 << 20) + 1)  # record 2 claims 16 MiB + 1 byte
    p.write_bytes(bytes(data) + bytes(1 << 10))
    r = RecordingReader(p)
    assert len(r.records) == 1
    assert r.tail_problem.startswith(f"record length {(16 << 20) + 1} over the {16 << 20}-byte limit at byte 45")
    assert r.damaged and "did not end cleanly" not in r.describe()  # no writer writes such a length: damage


def test_a_damaged_length_in_the_middle_is_damage_not_a_session_cut_short(tmp_path):
    """A flipped bit in a record's length makes it run past the end of the file, as a torn last record does; the
    intact records after it say the file was damaged there, and a session that ended is not called cut short."""
    import struct

    p = _rx_recording(tmp_path / "s.clrec", 6)
    data = bytearray(p.read_bytes())
    struct.pack_into("<I", data, len(MAGIC) + 2 * 37, 20 | (1 << 16))  # record 3's length: 65,556 bytes
    p.write_bytes(bytes(data))
    r = RecordingReader(p)
    assert len(r.records) == 2 and r.damaged and r.dropped_bytes == 4 * 37
    assert "intact records again from byte 119" in r.tail_problem and "not cut short" in r.tail_problem
    assert "did not end cleanly" not in r.describe() and "did not end cleanly" not in " ".join(r.problems())
    again = RecordingReader(p, resync=True)  # the length cannot be trusted; the next intact record can
    assert [rec.payload[0] for rec in again.records] == [0, 1, 3, 4, 5] and again.skipped == [(82, 119)]
    # the same length in the last record, with nothing after it: a session cut short
    p.write_bytes(bytes(data[:len(MAGIC) + 3 * 37]))
    r = RecordingReader(p)
    assert not r.damaged and r.tail_problem == "torn record (length runs past the end of the file)"


def test_not_a_recording(tmp_path):
    p = tmp_path / "x.clrec"
    p.write_bytes(b"hello world")
    with pytest.raises(RecordingError, match="not a closedloop recording"):
        RecordingReader(p)
    p.write_bytes(MAGIC[:7])  # a file cut short as it was created: not "version None"
    with pytest.raises(RecordingError, match="is not a recording: 7 bytes, shorter than the 8-byte file header"):
        RecordingReader(p)


WRITER = """
import sys, time
from closedloop.runtime.recording import RecordingWriter, RecordType
w = RecordingWriter(sys.argv[1], flush_interval_s=0.2)
i = 0
t0 = time.monotonic()
while True:
    w.append(RecordType.RX, i.to_bytes(4, "little") * 8)
    i += 1
    if i % 100 == 0:
        print(i, flush=True)
    time.sleep(0.001)
"""


def test_sigkill_loses_at_most_the_last_flush_interval(tmp_path):
    p = tmp_path / "killed.clrec"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(p)], stdout=subprocess.PIPE, text=True)
    try:
        # kill once the writer has appended 500 records (>= 0.5 s at 1 ms each: at least two flush
        # intervals), however long a loaded machine takes to start it
        last = 0
        t_end = time.monotonic() + 60.0
        while last < 500 and time.monotonic() < t_end:
            line = proc.stdout.readline()
            if line:
                last = int(line)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    r = RecordingReader(p)
    n = len(r.records)
    # every record recovered is intact and in order
    assert [int.from_bytes(rec.payload[:4], "little") for rec in r] == list(range(n))
    # at ~1 record per ms and a 0.2 s flush interval, at most ~0.3 s worth may be lost
    assert n > 0 and n >= last - 400, f"recovered {n} records, the writer had reported {last}"
    assert os.path.getsize(p) == r.valid_bytes + r.dropped_bytes


def test_replay_device_keeps_the_recorded_timing_from_the_first_read(tmp_path):
    import time

    from closedloop.firmware_bridge import open_transport

    path = tmp_path / "paced.clrec"
    w = RecordingWriter(path)
    for i in range(6):
        w.append(RecordType.RX, bytes([i]), host_ns=10**9 + i * 100_000_000)  # one byte every 100 ms
    w.close()
    t = open_transport(f"replay://{path}")
    time.sleep(0.35)  # a session setting up: the device must not have "sent" 0.35 s of data meanwhile
    assert t.read(64, 0.0) == b"\x00"  # only what is due at the first read
    got, t0 = b"\x00", time.monotonic()
    while len(got) < 6 and time.monotonic() - t0 < 5:
        got += t.read(64, 0.2)
    assert got == bytes(range(6)) and time.monotonic() - t0 >= 0.4  # in order, at the recorded pace
    t.close()
    fast = open_transport(f"replay://{path}?speed=0")
    assert fast.read(64, 0.0) == bytes(range(6))  # speed=0: all at once
    fast.close()
