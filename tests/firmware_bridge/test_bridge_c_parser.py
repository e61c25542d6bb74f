"""The C-backed parser gives what the Python parser gives: frames, counters, rejection reasons.

Every shared vector, whole and cut into pieces; a fuzz of corrupted streams (bit flips,
truncations, insertions, deletions, splices of two streams, forged signed frames, random
chunking) with both parsers fed the same bytes, and no corrupted frame accepted; the
choice between the parsers (argument, environment, fallback without a compiler).  The
benchmark (bench/bench_protocol.py) runs the same comparison on 1.2 million cases.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from closedloop.firmware_bridge import (
    ActuatorCommand,
    CFrameParser,
    CParserUnavailableError,
    FrameParser,
    FrameSigner,
    FrameVerifier,
    Heartbeat,
    Hello,
    JointState,
    Link,
    NeuralFrame,
    Status,
    UnknownMessage,
    cobs_decode,
    cobs_encode,
    crc32c,
    encode_frame,
    make_parser,
    open_pty_pair,
    parser_backend,
)
from closedloop.firmware_bridge.c_library import load_scanner
from closedloop.firmware_bridge.vectors import VECTORS_PATH

KEY = bytes(range(32))


@pytest.fixture(scope="module")
def scanner(cc: str):
    try:
        return load_scanner()
    except CParserUnavailableError as exc:  # a compiler is there: not building is a failure
        pytest.fail(f"the C scanner did not build with {cc}: {exc}")


def _frame_key(f) -> tuple:
    return (f.msg_type, f.seq, f.timestamp_us, f.flags, f.sign_counter, type(f.message).__name__,
            f.message.encode_payload())


def _feed_both(chunks: list[bytes], key: bytes | None = None, required: bool | None = None,
               max_payload_len: int = 4096) -> tuple[list, list]:
    """Feed both parsers the same chunks (each with its own verifier: verifiers keep state)."""
    results = []
    for cls in (FrameParser, CFrameParser):
        verifier = FrameVerifier(key, required=required) if key is not None or required else None
        parser = cls(verifier, max_payload_len)
        frames = [f for c in chunks for f in parser.feed(c)]
        results.append((frames, parser.stats.as_dict(), parser.last_rejection))
    (py_frames, py_stats, py_why), (c_frames, c_stats, c_why) = results
    assert [_frame_key(f) for f in c_frames] == [_frame_key(f) for f in py_frames]
    assert c_stats == py_stats
    assert c_why == py_why
    return py_frames, results[0][1:]


def _cuts(data: bytes, rng: np.random.Generator, pieces: int) -> list[bytes]:
    points = sorted(set(rng.integers(0, len(data) + 1, pieces).tolist()))
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


def test_every_vector_gives_the_same_frames_counters_and_reasons(scanner) -> None:
    vectors = json.loads(VECTORS_PATH.read_text())
    rng = np.random.default_rng(1)
    entries = [(e["wire"], e) for e in vectors["frames"]] + [(e["bytes"], e) for e in vectors["streams"]]
    for hex_bytes, entry in entries:
        data = bytes.fromhex(hex_bytes)
        key = bytes.fromhex(entry["key"]) if entry["key"] else None
        required = entry["require_signed"] if key else None
        for chunks in ([data], [data[i : i + 1] for i in range(len(data))], _cuts(data, rng, 5)):
            _feed_both(chunks, key, required)
        if "expect" in entry:  # the C parser reports the vector's own verdict
            parser = CFrameParser(FrameVerifier(key, required=required) if key else None)
            frames = parser.feed(data)
            if entry["expect"] == "accept":
                assert len(frames) == 1 and frames[0].message.encode_payload().hex() == entry["payload"]
            else:
                assert frames == [] and getattr(parser.stats, entry["expect"]) == 1, entry["name"]


def test_oversize_runs_and_small_payload_limits_match(scanner) -> None:
    rng = np.random.default_rng(2)
    big = rng.integers(1, 256, 9000, dtype=np.uint8).tobytes()  # no delimiter for longer than any frame
    ok = encode_frame(NeuralFrame(1, np.arange(300)), 7, 8)
    stream = ok + big + b"\x00" + ok + big[:4000] + b"\x00" + big[:5000] + ok
    for chunks in ([stream], _cuts(stream, rng, 3), [stream[i : i + 700] for i in range(0, len(stream), 700)]):
        frames, (stats, _) = _feed_both(chunks)
        # 9000 bytes, then 5000 bytes run into the last frame: oversize; the 4000-byte run is malformed
        assert stats["oversize"] == 2 and stats["duplicate"] == 1 and len(frames) == 1
        _feed_both(chunks, max_payload_len=256)


def _pool(rng: np.random.Generator, size: int, signer: FrameSigner) -> list[bytes]:
    makers = [
        lambda i: NeuralFrame(i, rng.poisson(0.5, int(rng.integers(1, 300)))),
        lambda i: Heartbeat(),
        lambda i: Status(i % 65536, 1, "s" * int(rng.integers(0, 300))),
        lambda i: ActuatorCommand(rng.normal(size=int(rng.integers(0, 80)))),
        lambda i: JointState(rng.normal(size=3), rng.normal(size=3), rng.normal(size=7)),
        lambda i: Hello("arm", "x", 1, 0, 50.0),
        # long runs without a zero: COBS 0xFF blocks
        lambda i: UnknownMessage(0xE1, rng.integers(1, 256, int(rng.integers(250, 900)), dtype=np.uint8).tobytes()),
    ]
    pool = []
    for i in range(size):
        msg = makers[i % len(makers)](i)
        # neighbouring numbers, across the u32 wrap: random picks are gaps, late and repeated frames
        pool.append(encode_frame(msg, (i - size // 2) % 2**32, i, signer if i % 4 == 0 else None))
    return pool


def _mutate(rng: np.random.Generator, data: bytearray, other: bytes) -> bytearray:
    kind = int(rng.integers(7))
    at = int(rng.integers(len(data)))
    if kind == 0:
        data[at] ^= 1 << int(rng.integers(8))
    elif kind == 1:
        del data[at:]
    elif kind == 2:
        data[at:at] = rng.integers(0, 256, int(rng.integers(1, 9)), dtype=np.uint8).tobytes()
    elif kind == 3:
        del data[at : at + int(rng.integers(1, 9))]
    elif kind == 4:  # splice: the tail of another stream from a random point
        data[at:] = other[int(rng.integers(len(other))) :]
    elif kind == 5:
        data[at] = 0
    else:  # a run without a delimiter, longer than any frame
        data[at:at] = rng.integers(1, 256, int(rng.integers(4000, 6000)), dtype=np.uint8).tobytes()
    return data


def _forged(rng: np.random.Generator, wire: bytes) -> bytes:
    raw = bytearray(cobs_decode(wire[:-1]))
    raw[3 + int(rng.integers(len(raw) - 31))] ^= int(rng.integers(1, 256))
    raw[-4:] = crc32c(bytes(raw[:-4])).to_bytes(4, "little")
    return cobs_encode(bytes(raw)) + b"\x00"


def test_fuzzed_streams_give_the_same_results_and_no_corrupted_frame(scanner) -> None:
    """About 125,000 frames in 2,500 streams (the benchmark runs 1.2 million cases through both parsers)."""
    rng = np.random.default_rng(2024)
    signer = FrameSigner(KEY, counter_start=1)
    pool = _pool(rng, 700, signer)
    sent = {}
    for wire in pool:
        raw = cobs_decode(wire[:-1])
        plen = int.from_bytes(raw[6:8], "little")
        sent[int.from_bytes(raw[8:12], "little")] = (raw[3], int.from_bytes(raw[12:20], "little"), raw[20 : 20 + plen])
    frames_fed = accepted = 0
    totals: dict[str, int] = {}
    for s in range(2500):
        picks = rng.integers(len(pool), size=int(rng.integers(1, 100)))
        parts = [pool[p] for p in picks.tolist()]
        if rng.random() < 0.2:
            parts.append(_forged(rng, pool[4 * int(rng.integers(len(pool) // 4))]))
        data = bytearray(b"".join(parts))
        other = b"".join(pool[p] for p in rng.integers(len(pool), size=5).tolist())
        for _ in range(int(rng.integers(0, 8))):
            if data:
                data = _mutate(rng, data, other)
        frames_fed += len(parts)
        chunks = _cuts(bytes(data), rng, int(rng.integers(0, 12)))
        frames, (stats, _) = _feed_both(chunks, KEY, required=bool(s % 2))
        for f in frames:  # accepted => exactly a frame that was sent
            assert sent.get(f.seq) == (f.msg_type, f.timestamp_us, f.message.encode_payload()), f
        accepted += len(frames)
        for k, v in stats.items():
            totals[k] = totals.get(k, 0) + v
    assert frames_fed > 120_000 and accepted > 25_000
    # every path was taken
    for k in ("crc_errors", "malformed", "oversize", "bad_tag", "replayed", "unsigned", "duplicate", "lost",
              "out_of_order", "seq_resets", "unknown_type"):
        assert totals[k] > 0, (k, totals)


def test_random_bytes_and_reset_match(scanner) -> None:
    rng = np.random.default_rng(5)
    for _ in range(300):
        data = rng.integers(0, 256, int(rng.integers(1, 3000)), dtype=np.uint8).tobytes()
        _feed_both(_cuts(data, rng, 4))
    py, c = FrameParser(), CFrameParser()
    wire = encode_frame(Heartbeat(), 5, 5)
    for p in (py, c):
        p.feed(wire + wire[:9])
        p.reset()  # the held half frame and the sequence history go; counters stay
        p.feed(wire[9:] + wire)
    assert py.stats.as_dict() == c.stats.as_dict() and c.stats.accepted == 2 and c.stats.malformed == 1


def test_choice_of_parser(scanner, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CLOSEDLOOP_PARSER", raising=False)
    assert type(make_parser()) is CFrameParser and parser_backend().name == "c"
    assert type(make_parser(backend="python")) is FrameParser
    monkeypatch.setenv("CLOSEDLOOP_PARSER", "python")
    backend = parser_backend()
    assert backend.name == "python" and "CLOSEDLOOP_PARSER=python" in backend.reason
    assert type(make_parser(backend="c")) is CFrameParser  # the argument wins
    monkeypatch.setenv("CLOSEDLOOP_PARSER", "fastest")
    with pytest.raises(ValueError, match="'fastest'.*auto, c, python"):
        make_parser()


def test_a_link_reads_with_the_c_parser_and_its_counters_are_live(scanner, monkeypatch) -> None:
    monkeypatch.delenv("CLOSEDLOOP_PARSER", raising=False)
    host_end, device_end = open_pty_pair()
    with Link(host_end) as host, Link(device_end, role="device", parser="python") as device:
        assert type(host.parser) is CFrameParser and type(device.parser) is FrameParser
        for i in range(5):
            device.send(NeuralFrame(i, np.full(1024, i)))
        got = [host.recv(2.0) for _ in range(5)]
        assert [f.message.bin_index for f in got] == list(range(5))
        assert host.stats.received is host.parser.stats and host.stats.received.accepted == 5


def _probe(env: dict[str, str], code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**{k: v for k, v in os.environ.items() if k != "CC"}, **env})


def test_without_a_compiler_the_python_parser_is_used_and_says_why(tmp_path: Path) -> None:
    env = {"PATH": str(tmp_path / "no-bin"), "CLOSEDLOOP_CACHE_DIR": str(tmp_path / "cache"),
           "CLOSEDLOOP_PARSER": "auto"}
    run = _probe(env, "from closedloop.firmware_bridge import make_parser, parser_backend\n"
                      "b = parser_backend(); print(b.name); print(b.reason); print(type(make_parser()).__name__)")
    assert run.returncode == 0, run.stderr
    name, reason, cls = run.stdout.strip().splitlines()
    assert (name, cls) == ("python", "FrameParser")
    assert "no C compiler" in reason and "c_library" in reason
    forced = _probe({**env, "CLOSEDLOOP_PARSER": "c"},
                    "from closedloop.firmware_bridge import make_parser\nmake_parser()")
    assert forced.returncode != 0
    assert "CParserUnavailableError" in forced.stderr and "CLOSEDLOOP_PARSER=c asks for the C parser" in forced.stderr


def test_a_library_built_earlier_serves_a_machine_without_a_compiler(cc: str, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    built = _probe({"CLOSEDLOOP_CACHE_DIR": str(cache)}, "from closedloop.firmware_bridge.c_library import main; main()")
    assert built.returncode == 0 and built.stdout.startswith("built "), built.stdout + built.stderr
    run = _probe({"PATH": str(tmp_path / "no-bin"), "CLOSEDLOOP_CACHE_DIR": str(cache)},
                 "from closedloop.firmware_bridge import parser_backend; print(parser_backend().reason)")
    assert run.returncode == 0 and "cached at" in run.stdout, run.stdout + run.stderr
