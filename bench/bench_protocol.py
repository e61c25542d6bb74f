"""Benchmark of the wire protocol: fuzzing, parser throughput, and pty round-trip latency.

    python bench/bench_protocol.py            # full run (~2 min on 2 cores); writes bench/results/protocol/
    python bench/bench_protocol.py --quick    # smoke run in seconds; writes protocol_quick.* (not committed)

(a) Fuzz: 1.2 * 10**6 cases (over 10**6 of them mutated or random), each a valid frame (the control), a mutation of one
(bit flips, truncation, insertion, deletion, byte swaps) or pure random bytes, fed to a
FrameParser one case at a time with sequence and replay state reset in between, plus
whole streams of frames with stream-level corruption.  Counts accepted frames,
rejections per reason and exceptions (must be 0), and checks that every accepted
frame is identical to the frame it was made from (an accepted corrupted frame would
be a protocol failure).  Every case is also fed, cut at random points, to the C-backed
parser (CFrameParser), which must give the same frames and the same counters.
(b) Throughput: 192- and 1,024-channel NEURAL_FRAMEs parsed per second on one core by
the Python parser, the C-backed parser and a bare ``bytes.split`` over the same bytes
(splitting alone, no checks: a bound no Python-level parser passes), in 4 KiB reads and one frame per read, in the
same run; and the CPU time each parser takes for a 1,024-channel stream paced at 1 kHz
(one frame per read, as a link reads it), as a fraction of one core.  (c) Latency: frames sent over a
pty pair to an echo device in another process (which parses and re-sends each frame,
as firmware would), p50/p99 over the round trips.  Prints a table and writes
``protocol.json``, ``protocol.md`` and ``protocol_latency.png`` (``protocol_quick*`` with ``--quick``) to ``--out``
(default ``bench/results/protocol``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from closedloop.firmware_bridge import (
    REJECTION_REASONS,
    ActuatorCommand,
    CFrameParser,
    DecoderOutput,
    FrameParser,
    FrameSigner,
    FrameVerifier,
    Heartbeat,
    Hello,
    JointCommand,
    JointMode,
    JointState,
    Link,
    NeuralFrame,
    PlantMeasurement,
    Status,
    cobs_decode,
    cobs_encode,
    crc32c,
    encode_frame,
    open_pty_pair,
    parser_backend,
)
from closedloop.firmware_bridge.transports import open_transport
from closedloop.sdk.grid import Cell, run_grid

RESULTS = Path("bench/results/protocol")
KEY = bytes(range(32))
MUTATIONS = ("valid", "bitflip", "truncate", "insert", "delete", "swap", "random", "long_random", "forge")
MUTATION_P = (0.1, 0.3, 0.1, 0.1, 0.1, 0.1, 0.1, 0.02, 0.08)


# ----------------------------------------------------------------------------- fuzz

def _random_message(rng: np.random.Generator, i: int):
    k = i % 9
    if k == 0:
        return NeuralFrame(int(rng.integers(2**32)), rng.poisson(rng.uniform(0.1, 5), int(rng.integers(1, 256))))
    if k == 1:
        n = int(rng.integers(0, 8))
        return Hello("arm", f"dev{i}", 1, int(rng.integers(65536)), 50.0, -np.ones(n), np.ones(n))
    if k == 2:
        return Heartbeat()
    if k == 3:
        return Status(int(rng.integers(65536)), 2, "x" * int(rng.integers(0, 80)))
    if k == 4:
        return DecoderOutput(i, "abc"[: int(rng.integers(0, 4))], rng.random(int(rng.integers(1, 30))))
    if k == 5:
        return PlantMeasurement(rng.normal(size=int(rng.integers(0, 12))), rng.normal(size=int(rng.integers(0, 4))))
    if k == 6:
        return ActuatorCommand(rng.normal(size=int(rng.integers(0, 8))))
    if k == 7:
        n = int(rng.integers(1, 8))
        return JointState(rng.normal(size=n), rng.normal(size=n), rng.normal(size=7) if i % 2 else None)
    return JointCommand(JointMode.POSITION, rng.normal(size=int(rng.integers(1, 8))))


def _pool(rng: np.random.Generator, size: int) -> list[tuple[bytes, tuple, bool]]:
    """Valid wire frames (a fifth of them signed) with the content each must decode to."""
    signer = FrameSigner(KEY, counter_start=1)
    pool = []
    for i in range(size):
        msg = _random_message(rng, i)
        wire = encode_frame(msg, int(rng.integers(2**32)), int(rng.integers(2**63)), signer if i % 5 == 0 else None)
        raw = cobs_decode(wire[:-1])
        pool.append((wire, (raw[3], int.from_bytes(raw[8:12], "little"), int.from_bytes(raw[12:20], "little"),
                            msg.encode_payload()), bool(raw[4] & 1)))
    return pool


def _mutate(rng: np.random.Generator, wire: bytes, kind: str) -> bytes:
    data = bytearray(wire)
    n = len(data)
    if kind == "bitflip":
        for _ in range(int(rng.integers(1, 4))):
            data[int(rng.integers(n))] ^= 1 << int(rng.integers(8))
    elif kind == "truncate":
        del data[int(rng.integers(1, n)) :]
    elif kind == "insert":
        at = int(rng.integers(n + 1))
        data[at:at] = rng.integers(0, 256, int(rng.integers(1, 9)), dtype=np.uint8).tobytes()
    elif kind == "delete":
        at = int(rng.integers(n))
        del data[at : at + int(rng.integers(1, 9))]
    elif kind == "swap":
        a, b = (int(x) for x in rng.integers(n, size=2))
        data[a], data[b] = data[b], data[a]
    elif kind == "random":
        return rng.integers(0, 256, int(rng.integers(1, 600)), dtype=np.uint8).tobytes()
    elif kind == "long_random":  # longer than any legal frame, no delimiter inside
        return rng.integers(1, 256, int(rng.integers(4162, 9000)), dtype=np.uint8).tobytes()
    elif kind == "forge":  # an attacker edits a signed frame and repairs its CRC: only the tag can tell
        raw = bytearray(cobs_decode(wire[:-1]))
        at = int(rng.integers(3, len(raw) - 28))  # header after magic/version, payload, or counter
        raw[at] ^= int(rng.integers(1, 256))
        raw[-4:] = crc32c(bytes(raw[:-4])).to_bytes(4, "little")
        return cobs_encode(bytes(raw)) + b"\x00"
    return bytes(data)


def _fuzz_worker(args: tuple[int, int]) -> dict:
    seed, cases = args
    rng = np.random.default_rng(seed)
    pool = _pool(rng, 3000)
    verifier = FrameVerifier(KEY, required=False)
    parser = FrameParser(verifier)
    c_verifier = FrameVerifier(KEY, required=False)  # verifiers keep state: one per parser
    c_parser = CFrameParser(c_verifier)
    out = {"cases": {k: 0 for k in MUTATIONS}, "identical_after_mutation": 0, "exceptions": 0,
           "accepted_valid": 0, "accepted_from_mutated": 0, "accepted_corrupted": 0, "valid_lost": 0,
           "first_exception": None, "c_exceptions": 0, "c_differs": 0, "c_accepted_corrupted": 0}
    kinds = rng.choice(len(MUTATIONS), size=cases, p=MUTATION_P)
    picks = rng.integers(len(pool), size=cases)
    signed_picks = [i for i, entry in enumerate(pool) if entry[2]]
    for kind_index, pick in zip(kinds.tolist(), picks.tolist(), strict=True):
        kind = MUTATIONS[kind_index]
        if kind == "forge":
            pick = signed_picks[pick % len(signed_picks)]
        wire, expected, _ = pool[pick]
        case = wire if kind == "valid" else _mutate(rng, wire, kind)
        out["cases"][kind] += 1
        if kind != "valid" and case == wire:
            out["identical_after_mutation"] += 1
        parser.sequence.reset()
        verifier.last_counter = -1
        c_parser.sequence.reset()
        c_verifier.last_counter = -1
        wire_case = b"\x00" + case + b"\x00"
        try:
            frames = parser.feed(wire_case)
        except Exception as exc:  # noqa: BLE001 - counting is the point
            out["exceptions"] += 1
            out["first_exception"] = out["first_exception"] or repr(exc)
            continue
        cut = int(rng.integers(len(wire_case) + 1))
        try:
            c_frames = c_parser.feed(wire_case[:cut]) + c_parser.feed(wire_case[cut:])
        except Exception as exc:  # noqa: BLE001
            out["c_exceptions"] += 1
            out["first_exception"] = out["first_exception"] or repr(exc)
            continue
        # the reason, not its wording: an oversize run reads "without a delimiter" when a read ends inside it
        if [_content(f) for f in c_frames] != [_content(f) for f in frames] or \
                _reason(c_parser.last_rejection) != _reason(parser.last_rejection):
            out["c_differs"] += 1
        out["c_accepted_corrupted"] += sum(_content(f)[:4] != expected for f in c_frames)
        for f in frames:
            got = (f.msg_type, f.seq, f.timestamp_us, f.message.encode_payload())
            if got != expected:
                out["accepted_corrupted"] += 1
            elif kind == "valid" or case == wire:
                out["accepted_valid"] += 1
            else:
                out["accepted_from_mutated"] += 1  # bytes changed outside the frame, content intact
        if kind == "valid" and len(frames) != 1:
            out["valid_lost"] += 1
    out["stream"] = _stream_fuzz(rng, pool, max(1, cases // 2000))
    stats = parser.stats.as_dict()
    out["parser"] = {k: stats[k] for k in ("accepted", *REJECTION_REASONS, "bytes_in", "bytes_discarded")}
    out["c_counters_differ"] = int(c_parser.stats.as_dict() != stats)
    return out


def _reason(why: tuple[str, str] | None) -> str | None:
    return None if why is None else why[0]


def _content(f) -> tuple:
    return (f.msg_type, f.seq, f.timestamp_us, f.message.encode_payload(), f.flags, f.sign_counter)


def _stream_fuzz(rng: np.random.Generator, pool: list, streams: int) -> dict:
    """Concatenated frames with corruption anywhere: accepted frames must match what was sent."""
    res = {"streams": streams, "frames_sent": 0, "accepted": 0, "accepted_corrupted": 0, "exceptions": 0,
           "c_differs": 0}
    for _ in range(streams):
        picks = rng.integers(len(pool), size=100)
        parser = FrameParser(FrameVerifier(KEY, required=False))
        c_parser = CFrameParser(FrameVerifier(KEY, required=False))
        data = bytearray()
        sent = {}
        for seq, p in enumerate(picks.tolist()):
            msg_wire, (t, _, ts, payload), signed = pool[p]
            if signed:  # signed frames cannot be renumbered (and would replay): leave them out here
                continue
            sent[seq] = (t, seq, ts, payload)
            data += _renumber(msg_wire, seq)
        for _ in range(int(rng.integers(1, 20))):
            kind = str(rng.choice(["bitflip", "insert", "delete", "swap"]))
            data = bytearray(_mutate(rng, bytes(data), kind))
        res["frames_sent"] += len(sent)
        try:
            frames = parser.feed(bytes(data))
            points = sorted(rng.integers(len(data) + 1, size=int(rng.integers(0, 20))).tolist())
            c_frames = [f for a, b in zip([0, *points], [*points, len(data)], strict=True)
                        for f in c_parser.feed(bytes(data[a:b]))]
            for f in frames:
                res["accepted"] += 1
                if sent.get(f.seq) != (f.msg_type, f.seq, f.timestamp_us, f.message.encode_payload()):
                    res["accepted_corrupted"] += 1
            res["c_differs"] += int([_content(f) for f in c_frames] != [_content(f) for f in frames]
                                    or c_parser.stats != parser.stats)
        except Exception:  # noqa: BLE001
            res["exceptions"] += 1
    return res


def _renumber(wire: bytes, seq: int) -> bytes:
    raw = bytearray(cobs_decode(wire[:-1]))
    raw[8:12] = seq.to_bytes(4, "little")
    raw[-4:] = crc32c(bytes(raw[:-4])).to_bytes(4, "little")
    return cobs_encode(bytes(raw)) + b"\x00"


def _fuzz_cell(config: dict, seed: int) -> dict:
    return _fuzz_worker((seed, config["cases"]))


def run_fuzz(total: int, workers: int) -> dict:
    per = [total // workers + (1 if i < total % workers else 0) for i in range(workers)]
    t0 = time.perf_counter()
    if workers > 1:  # one cell per worker on the grid runner (a local Ray instance; in-process without Ray)
        recs = run_grid(_fuzz_cell, [Cell({"cases": n}, seed=1000 + i) for i, n in enumerate(per)],
                        workers=workers, desc="fuzz")
        failed = [r["error"] for r in recs if r["status"] != "ok"]
        if failed:
            raise RuntimeError(f"a fuzz cell failed: {failed[0]}")
        parts = [r["result"] for r in recs]
    else:
        parts = [_fuzz_worker((1000, total))]
    merged: dict = {"seconds": round(time.perf_counter() - t0, 1), "workers": workers, "total_cases": total}
    for part in parts:
        for key, value in part.items():
            if isinstance(value, dict):
                bucket = merged.setdefault(key, {})
                for k, v in value.items():
                    bucket[k] = bucket.get(k, 0) + v
            elif isinstance(value, int):
                merged[key] = merged.get(key, 0) + value
            elif value is not None:
                merged.setdefault("first_exception", value)
    return merged


# ----------------------------------------------------------------------- throughput

PARSERS = {"python": FrameParser, "c": CFrameParser}


def _rate(frames: int, chunks: list[bytes], make) -> float:
    parser = make()
    t0 = time.perf_counter()
    n = sum(len(parser.feed(c)) for c in chunks)
    dt = time.perf_counter() - t0
    assert n == frames, (n, frames)
    return frames / dt


def _split_rate(frames: int, chunks: list[bytes]) -> float:
    """A bare ``bytes.split`` over the same chunks: what splitting alone costs in Python."""
    t0 = time.perf_counter()
    for c in chunks:
        c.split(b"\x00")
    return frames / (time.perf_counter() - t0)


def _best_rates(frames: int, chunks: list[bytes], makers: dict, repeats: int) -> dict[str, float]:
    """Frames per second of each maker's fastest pass.  The passes alternate between the makers,
    so that a busy spell of a shared machine slows all of them rather than one."""
    best = dict.fromkeys(makers, 0.0)
    for _ in range(repeats):
        for name, make in makers.items():
            rate = _split_rate(frames, chunks) if make is None else _rate(frames, chunks, make)
            best[name] = max(best[name], rate)
    return best


def run_throughput(frames: int, channels: int, rate: float = 0.4) -> dict:
    rng = np.random.default_rng(7)
    wires = [encode_frame(NeuralFrame(i, rng.poisson(rate, channels)), i, 20_000 * i) for i in range(frames)]
    stream = b"".join(wires)
    reads = {"4KiB_reads": [stream[i : i + 4096] for i in range(0, len(stream), 4096)], "one_frame_per_read": wires}
    out: dict = {"channels": channels, "poisson_mean_count": rate, "frames": frames,
                 "bytes_per_frame": round(len(stream) / frames, 1)}
    for label, chunks in reads.items():
        for name, fps in _best_rates(frames, chunks, {**PARSERS, "split": None}, repeats=5).items():
            out[f"{name}_frames_per_s_{label}"] = round(fps)
    for label in reads:
        out[f"c_speedup_{label}"] = round(out[f"c_frames_per_s_{label}"] / out[f"python_frames_per_s_{label}"], 1)
    signer = FrameSigner(KEY, counter_start=1)
    signed = b"".join(encode_frame(NeuralFrame(i, rng.poisson(rate, channels)), i, i, signer) for i in range(frames))
    signed_chunks = [signed[i : i + 4096] for i in range(0, len(signed), 4096)]
    signed_makers = {name: (lambda cls=cls: cls(FrameVerifier(KEY))) for name, cls in PARSERS.items()}
    for name, fps in _best_rates(frames, signed_chunks, signed_makers, repeats=2).items():
        out[f"{name}_frames_per_s_signed_4KiB_reads"] = round(fps)
    t0 = time.perf_counter()
    for i in range(min(frames, 5000)):
        encode_frame(NeuralFrame(i, rng.poisson(rate, channels)), i, i)
    out["frames_per_s_encode"] = round(min(frames, 5000) / (time.perf_counter() - t0))
    return out


def run_paced_cpu(seconds: float, channels: int = 1024, rate_hz: float = 1000.0) -> dict:
    """CPU time each parser spends on a stream paced at ``rate_hz``, one frame per read (as a
    Link reads a live device), as a fraction of one core: thread CPU time inside ``feed``
    over the stream's wall time."""
    rng = np.random.default_rng(11)
    n = int(seconds * rate_hz)
    wires = [encode_frame(NeuralFrame(i, rng.poisson(0.4, channels)), i, 1000 * i) for i in range(n)]
    out: dict = {"channels": channels, "rate_hz": rate_hz, "frames": n,
                 "bytes_per_frame": round(sum(map(len, wires)) / len(wires), 1)}
    period = 1.0 / rate_hz
    for name, cls in PARSERS.items():
        parser = cls()
        cpu = 0.0
        start = time.perf_counter()
        for i in range(n):
            while time.perf_counter() < start + i * period:
                time.sleep(max(0.0, start + i * period - time.perf_counter() - 2e-4))
            c0 = time.thread_time()
            parser.feed(wires[i])
            cpu += time.thread_time() - c0
        wall = time.perf_counter() - start
        out[f"{name}_core_fraction"] = round(cpu / wall, 4)
        out[f"{name}_cpu_us_per_frame"] = round(cpu / n * 1e6, 1)
        assert parser.stats.accepted == n, parser.stats
    return out


# -------------------------------------------------------------------------- latency

def _echo_device(path: str, ready, stop) -> None:
    with open_transport(path) as port:  # the device end, opened by path through pyserial
        link = Link(port, role="device")
        ready.set()
        while not stop.is_set():
            frame = link.recv(0.05)
            if frame is not None:
                link.send(frame.message, timestamp_us=frame.timestamp_us)


def run_latency(round_trips: int, channels: int = 192) -> dict:
    host_end, device_end = open_pty_pair()
    ctx = mp.get_context("fork")
    ready, stop = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_echo_device, args=(device_end.path, ready, stop), daemon=True)
    proc.start()
    ready.wait(10)
    rng = np.random.default_rng(3)
    msgs = [NeuralFrame(i, rng.poisson(0.4, channels)) for i in range(256)]
    rtt_us = np.empty(round_trips)
    lost = 0
    with Link(host_end) as host:
        for i in range(200):  # warm-up
            host.send(msgs[i % 256])
            host.recv(1.0)
        for i in range(round_trips):
            t0 = time.perf_counter_ns()
            host.send(msgs[i % 256])
            frame = host.recv(1.0)
            rtt_us[i] = (time.perf_counter_ns() - t0) / 1000
            lost += frame is None
        stop.set()
        proc.join(5)
    device_end.close()
    pct = np.percentile(rtt_us, [50, 90, 99, 99.9])
    return {"round_trips": round_trips, "channels": channels, "lost": lost,
            "p50_us": round(float(pct[0]), 1), "p90_us": round(float(pct[1]), 1), "p99_us": round(float(pct[2]), 1),
            "p999_us": round(float(pct[3]), 1), "max_us": round(float(rtt_us.max()), 1),
            "mean_us": round(float(rtt_us.mean()), 1),
            "_samples": rtt_us}


def plot_latency(lat: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    samples = lat["_samples"]
    limit = max(1500.0, float(np.percentile(samples, 99.9)))
    over = int((samples > limit).sum())
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.hist(np.minimum(samples, limit), bins=120, range=(0, limit), color="#3b7dd8")
    for key, style in (("p50_us", "--"), ("p99_us", ":")):
        ax1.axvline(lat[key], color="k", linestyle=style, label=f"{key[:-3]} {lat[key]:.0f} us")
    ax1.axvline(1000, color="r", label="1 ms target")
    ax1.set_xlabel(f"round trip (us); {over} samples above {limit:.0f} us are in the last bin")
    ax1.set_ylabel("count")
    ax1.legend()
    ax1.set_title(f"pty round trip, {lat['channels']}-ch NEURAL_FRAME, n={lat['round_trips']}")
    ax2.plot(samples, ".", markersize=1.5, color="#3b7dd8")
    ax2.set_yscale("log")
    ax2.yaxis.set_major_formatter(ScalarFormatter())
    ax2.yaxis.set_minor_formatter(NullFormatter())
    ax2.set_xlabel("round trip #")
    ax2.set_ylabel("round trip (us)")
    ax2.set_title("over time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_rows(fuzz: dict, thr: dict, lat: dict, paced: dict) -> list[tuple[str, str]]:
    """The printed summary: (what, result) rows."""
    rows = [
        ("fuzz cases", f"{fuzz['total_cases']:,} in {fuzz['seconds']} s ({fuzz['workers']} workers)"),
        ("  by kind", ", ".join(f"{k} {v:,}" for k, v in fuzz["cases"].items())),
        ("  mutated or random", f"{fuzz['total_cases'] - fuzz['cases']['valid']:,}"),
        ("  accepted", f"{fuzz['accepted_valid']:,} intact + {fuzz['accepted_from_mutated']:,} intact inside "
                       f"mutated bytes; corrupted accepted: {fuzz['accepted_corrupted']}"),
        ("  rejected", ", ".join(f"{r} {fuzz['parser'][r]:,}" for r in REJECTION_REASONS)),
        ("  exceptions", f"{fuzz['exceptions']}; valid controls lost: {fuzz['valid_lost']}"),
        ("  stream fuzz", f"{fuzz['stream']['streams']} streams, {fuzz['stream']['accepted']:,}/"
                          f"{fuzz['stream']['frames_sent']:,} frames accepted, corrupted accepted: "
                          f"{fuzz['stream']['accepted_corrupted']}"),
        ("  C parser, same cases cut at random", f"cases that differ from Python: {fuzz['c_differs']}, counters "
                                                 f"differ: {fuzz['c_counters_differ']}, corrupted accepted: "
                                                 f"{fuzz['c_accepted_corrupted']}, exceptions: {fuzz['c_exceptions']}; "
                                                 f"streams that differ: {fuzz['stream']['c_differs']}"),
    ]
    for t in thr.values():
        ch = t["channels"]
        for label, what in (("4KiB_reads", "4 KiB reads"), ("one_frame_per_read", "one frame per read")):
            rows.append((f"parse {ch}-ch frames, {what}",
                         f"Python {t[f'python_frames_per_s_{label}']:,}/s, C {t[f'c_frames_per_s_{label}']:,}/s "
                         f"({t[f'c_speedup_{label}']}x), bare split {t[f'split_frames_per_s_{label}']:,}/s"))
        rows.append((f"  {ch}-ch signed / encode", f"Python {t['python_frames_per_s_signed_4KiB_reads']:,}/s, "
                                                  f"C {t['c_frames_per_s_signed_4KiB_reads']:,}/s signed; "
                                                  f"{t['frames_per_s_encode']:,}/s encode"))
    rows.append((f"{paced['channels']}-ch at {paced['rate_hz']:.0f} Hz, CPU",
                 f"C {100 * paced['c_core_fraction']:.2f}% of one core ({paced['c_cpu_us_per_frame']} us/frame), "
                 f"Python {100 * paced['python_core_fraction']:.2f}% ({paced['python_cpu_us_per_frame']} us/frame), "
                 f"{paced['frames']:,} frames"))
    rows.append(("pty round trip", f"p50 {lat['p50_us']} us, p99 {lat['p99_us']} us, p99.9 {lat['p999_us']} us, "
                                   f"max {lat['max_us']} us, lost {lat['lost']} (n={lat['round_trips']:,})"))
    return rows


def markdown(record: dict) -> str:
    rows = summary_rows(record["fuzz"], record["throughput"], record["latency"], record["paced_cpu"])
    sysinfo = record.get("system", {})
    lines = ["# Wire protocol: fuzzing, parser throughput, pty round trip", "",
             f"Written by `{record.get('command', 'python bench/bench_protocol.py')}` on "
             f"{sysinfo.get('cpu_count', '?')} CPUs ({sysinfo.get('machine', '?')}, Python {sysinfo.get('python', '?')},"
             f" numpy {sysinfo.get('numpy', '?')}); C parser library {record.get('c_library', '?')}.", "",
             "| what | result |", "| --- | --- |"]
    lines += [f"| {name.strip()} | {value} |" for name, value in rows]
    lines += ["", "| target | result |", "| --- | --- |"]
    lines += [f"| {name} | {'met' if met else 'NOT MET'} |" for name, met in record["targets"].items()]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fuzz-cases", type=int, default=1_200_000, help="10%% are unmutated controls")
    ap.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--throughput-frames", type=int, default=20_000)
    ap.add_argument("--round-trips", type=int, default=5_000)
    ap.add_argument("--paced-seconds", type=float, default=5.0, help="length of the 1 kHz stream")
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if args.quick:
        args.fuzz_cases, args.throughput_frames, args.round_trips, args.paced_seconds = 20_000, 2_000, 500, 1.0

    print(f"fuzzing {args.fuzz_cases:,} cases on {args.workers} worker(s)...", flush=True)
    fuzz = run_fuzz(args.fuzz_cases, args.workers)
    backend = parser_backend("c")  # the comparison needs both parsers: fail here, saying why, without one
    print("parser throughput...", flush=True)
    thr = {str(ch): run_throughput(args.throughput_frames, ch) for ch in (192, 1024)}
    print("1,024 channels paced at 1 kHz...", flush=True)
    paced = run_paced_cpu(args.paced_seconds)
    print("pty round trips...", flush=True)
    lat = run_latency(args.round_trips)

    ok_fuzz = fuzz["exceptions"] == 0 and fuzz["accepted_corrupted"] == 0 and fuzz["valid_lost"] == 0 \
        and fuzz["stream"]["accepted_corrupted"] == 0 and fuzz["stream"]["exceptions"] == 0
    same_c = fuzz["c_differs"] == 0 and fuzz["c_counters_differ"] == 0 and fuzz["c_accepted_corrupted"] == 0 \
        and fuzz["c_exceptions"] == 0 and fuzz["stream"]["c_differs"] == 0
    targets = {
        "fuzz_no_exception_no_corrupted_accept": bool(ok_fuzz),
        "c_parser_same_frames_and_counters_under_fuzz": bool(same_c),
        "throughput_ge_20000_frames_per_s": bool(thr["192"]["python_frames_per_s_4KiB_reads"] >= 20_000),
        "c_parser_ge_10x_python_192ch_4KiB_reads": bool(thr["192"]["c_speedup_4KiB_reads"] >= 10),
        "c_parser_1024ch_1kHz_lt_10pct_of_a_core": bool(paced["c_core_fraction"] < 0.10),
        "pty_round_trip_p99_lt_1ms": bool(lat["p99_us"] < 1000),
    }
    rows = summary_rows(fuzz, thr, lat, paced)
    width = max(len(r[0]) for r in rows)
    print()
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    for name, met in targets.items():
        print(f"target {name}: {'MET' if met else 'NOT MET'}")

    stem = "protocol_quick" if args.quick else "protocol"
    args.out.mkdir(parents=True, exist_ok=True)
    plot_latency(lat, args.out / f"{stem}_latency.png")
    record = {
        "command": "python bench/bench_protocol.py" + (" --quick" if args.quick else ""),
        "system": {"python": platform.python_version(), "machine": platform.machine(),
                   "cpu_count": os.cpu_count(), "numpy": np.__version__},
        "c_library": Path(backend.library or "?").name,
        "fuzz": fuzz, "throughput": thr, "paced_cpu": paced,
        "latency": {k: v for k, v in lat.items() if not k.startswith("_")},
        "targets": targets,
    }
    (args.out / f"{stem}.json").write_text(json.dumps(record, indent=1) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(record))
    print(f"wrote {args.out / stem}.json, .md and _latency.png")
    return 0 if ok_fuzz and same_c else 1


if __name__ == "__main__":
    sys.exit(main())
