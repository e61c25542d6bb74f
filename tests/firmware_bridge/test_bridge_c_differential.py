"""Differential test: the C parser and the Python parser agree on corrupted streams.

Random valid frames (signed and unsigned, every message type) are concatenated, cut into
and corrupted, then fed to both parsers; the accepted sequence numbers and every
counter must match.  The C harness is compiled here with the host compiler.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np

from closedloop import firmware_bridge
from closedloop.firmware_bridge import (
    ActuatorCommand,
    FrameParser,
    FrameSigner,
    FrameVerifier,
    Heartbeat,
    Hello,
    JointState,
    NeuralFrame,
    Status,
    UnknownMessage,
    cobs_decode,
    cobs_encode,
    crc32c,
    encode_frame,
)

C_DIR = Path(firmware_bridge.__file__).parent / "c"
KEY = bytes(range(32))
HARNESS = r"""
#include "closedloop_proto.h"
#include <stdio.h>
#include <string.h>
static char line[1 << 20];
static clp_parser_t p;
int main(void) {
    uint8_t key[32];
    unsigned i;
    for (i = 0; i < 32; i++) key[i] = (uint8_t)i;
    while (fgets(line, sizeof line, stdin) != NULL) {
        size_t n = strlen(line), k;
        clp_frame_t f;
        clp_parser_init(&p, key, 32, 0);
        for (k = 0; k + 1 < n && line[k] != '\n'; k += 2) {
            unsigned v;
            sscanf(line + k, "%2x", &v);
            if (clp_parser_feed(&p, (uint8_t)v, &f) == CLP_FRAME) printf("%lu,", (unsigned long)f.seq);
        }
        printf(" %lu %lu %lu %lu %lu %lu %lld %lu %lu %lu %llu\n", (unsigned long)p.stats.crc_errors,
               (unsigned long)p.stats.malformed, (unsigned long)p.stats.oversize, (unsigned long)p.stats.bad_tag,
               (unsigned long)p.stats.replayed, (unsigned long)p.stats.accepted, (long long)p.stats.lost,
               (unsigned long)p.stats.duplicate, (unsigned long)p.stats.out_of_order,
               (unsigned long)p.stats.seq_resets, (unsigned long long)p.stats.bytes_discarded);
    }
    return 0;
}
"""
FIELDS = ("crc_errors", "malformed", "oversize", "bad_tag", "replayed", "accepted", "lost", "duplicate",
          "out_of_order", "seq_resets", "bytes_discarded")


def _streams(count: int) -> list[bytes]:
    rng = np.random.default_rng(2024)
    signer = FrameSigner(KEY, counter_start=1)
    makers = [
        lambda i: NeuralFrame(i, rng.poisson(0.5, int(rng.integers(1, 200)))),
        lambda i: Heartbeat(),
        lambda i: Status(i % 65536, 1, "s" * int(rng.integers(0, 300))),
        lambda i: ActuatorCommand(rng.normal(size=int(rng.integers(0, 80)))),
        lambda i: JointState(rng.normal(size=3), rng.normal(size=3), rng.normal(size=7)),
        lambda i: Hello("arm", "x", 1, 0, 50.0),
        lambda i: UnknownMessage(0xE1, rng.integers(1, 256, int(rng.integers(250, 600)), dtype=np.uint8).tobytes()),
    ]
    streams = []
    for s in range(count):
        parts = []
        seq = int(rng.integers(2**32))
        for i in range(int(rng.integers(1, 25))):
            seq = (seq + int(rng.choice([1, 1, 1, 2, 0, -1, -3, 100]))) % 2**32
            msg = makers[int(rng.integers(len(makers)))](i)
            parts.append(encode_frame(msg, seq, i, signer if rng.random() < 0.3 else None))
            roll = rng.random()
            if roll < 0.08:  # a frame sent again: a duplicate, or a replay when signed
                parts.append(parts[int(rng.integers(len(parts)))])
            elif roll < 0.16:  # a signed frame edited with a repaired CRC: only the tag can tell
                raw = bytearray(cobs_decode(encode_frame(msg, seq, i, signer)[:-1]))
                raw[20 + int(rng.integers(max(1, len(raw) - 48)))] ^= 0x40
                raw[-4:] = crc32c(bytes(raw[:-4])).to_bytes(4, "little")
                parts.append(cobs_encode(bytes(raw)) + b"\x00")
            if rng.random() < 0.1:
                parts.append(rng.integers(0, 256, int(rng.integers(1, 30)), dtype=np.uint8).tobytes())
        data = bytearray(b"".join(parts))
        if s % 10 == 0:
            data += bytes(rng.integers(1, 256, 4200, dtype=np.uint8)) + b"\x00"  # an oversize segment
        for _ in range(int(rng.integers(0, 6))):
            at = int(rng.integers(len(data)))
            kind = int(rng.integers(4))
            if kind == 0:
                data[at] ^= 1 << int(rng.integers(8))
            elif kind == 1:
                del data[at : at + int(rng.integers(1, 5))]
            elif kind == 2:
                data[at:at] = rng.integers(0, 256, int(rng.integers(1, 5)), dtype=np.uint8).tobytes()
            elif len(data) > at + 1:
                data[at], data[at + 1] = data[at + 1], data[at]
        streams.append(bytes(data))
    return streams


def test_c_and_python_parsers_agree_on_corrupted_streams(cc: str, tmp_path: Path) -> None:
    (tmp_path / "harness.c").write_text(HARNESS)
    exe = tmp_path / "harness"
    subprocess.run([cc, "-std=c99", "-O2", "-Wall", "-Wextra", "-Werror", f"-I{C_DIR}", str(tmp_path / "harness.c"),
                    str(C_DIR / "closedloop_proto.c"), "-o", str(exe)], check=True, capture_output=True, text=True)
    streams = _streams(300)
    run = subprocess.run([str(exe)], input="\n".join(s.hex() for s in streams) + "\n", capture_output=True,
                         text=True, check=True, timeout=60)
    lines = run.stdout.splitlines()
    assert len(lines) == len(streams)
    totals = dict.fromkeys(FIELDS, 0)
    for data, line in zip(streams, lines, strict=True):
        parser = FrameParser(FrameVerifier(KEY, required=False))
        seqs = [f.seq for f in parser.feed(data)]
        c_seqs, *c_counts = line.split(" ")
        stats = parser.stats.as_dict()
        assert c_seqs == "".join(f"{s}," for s in seqs)
        assert [int(v) for v in c_counts] == [stats[k] for k in FIELDS], data.hex()
        for k in FIELDS:
            totals[k] += stats[k]
    # the streams really exercised every path
    assert all(totals[k] > 0 for k in FIELDS), totals
