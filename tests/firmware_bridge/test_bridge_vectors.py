"""Shared test vectors: the checked-in JSON is current, Python agrees with it, and the C
implementation (compiled here with the host compiler) agrees byte for byte."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from closedloop import firmware_bridge
from closedloop.firmware_bridge import FrameParser, FrameVerifier
from closedloop.firmware_bridge.vectors import VECTORS_PATH, build_vectors, write_c_vectors

C_DIR = Path(firmware_bridge.__file__).parent / "c"
CFLAGS = ["-std=c99", "-Wall", "-Wextra", "-Werror", "-pedantic", "-O2"]


@pytest.fixture(scope="module")
def vectors() -> dict:
    return json.loads(VECTORS_PATH.read_text())


def test_checked_in_vectors_are_current(vectors: dict) -> None:
    assert vectors == json.loads(json.dumps(build_vectors())), (
        "frames.json is stale: run `python -m closedloop.firmware_bridge.vectors` and review the diff")


def test_vectors_cover_every_message_type_and_every_rejection(vectors: dict) -> None:
    types = {f["header"]["msg_type"] for f in vectors["frames"] if f["expect"] == "accept"}
    assert set(firmware_bridge.MESSAGE_TYPES) <= types
    reasons = {f["expect"] for f in vectors["frames"]} - {"accept"}
    assert reasons == {"crc_errors", "malformed", "oversize", "bad_tag", "unsigned"}
    assert any(s["counters"]["replayed"] for s in vectors["streams"])
    assert any(f["sign_counter"] is not None for f in vectors["frames"] if f["expect"] == "accept")


def _parser(entry: dict) -> FrameParser:
    key = bytes.fromhex(entry["key"]) if entry["key"] else None
    return FrameParser(FrameVerifier(key, required=entry["require_signed"]) if key else None)


def test_python_parser_agrees_with_every_frame_vector(vectors: dict) -> None:
    for entry in vectors["frames"]:
        parser = _parser(entry)
        frames = parser.feed(bytes.fromhex(entry["wire"]))
        if entry["expect"] == "accept":
            assert len(frames) == 1, entry["name"]
            f, h = frames[0], entry["header"]
            assert (f.msg_type, f.flags, f.seq, f.timestamp_us, f.sign_counter) == (
                h["msg_type"], h["flags"], h["seq"], h["timestamp_us"], entry["sign_counter"]), entry["name"]
            assert f.message.encode_payload().hex() == entry["payload"], entry["name"]
        else:
            assert frames == [] and getattr(parser.stats, entry["expect"]) == 1, entry["name"]


def test_python_parser_agrees_with_every_stream_vector(vectors: dict) -> None:
    for entry in vectors["streams"]:
        parser = _parser(entry)
        assert [f.seq for f in parser.feed(bytes.fromhex(entry["bytes"]))] == entry["accepted_seqs"]
        counters = parser.stats.as_dict()
        counters.pop("bytes_in")
        assert counters == entry["counters"], entry["name"]


def test_c_sources_use_no_libc_beyond_string_h() -> None:
    for name in ("closedloop_proto.c", "closedloop_proto.h"):
        includes = set(re.findall(r'#include [<"]([^>"]+)[>"]', (C_DIR / name).read_text()))
        assert includes <= {"string.h", "stdint.h", "stddef.h", "closedloop_proto.h"}, (name, includes)
    assert "malloc" not in (C_DIR / "closedloop_proto.c").read_text()


def test_c_implementation_matches_vectors_byte_for_byte(cc: str, vectors: dict, tmp_path: Path) -> None:
    exe = tmp_path / "test_vectors"
    subprocess.run([cc, *CFLAGS, str(C_DIR / "closedloop_proto.c"), str(C_DIR / "test_vectors.c"), "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    text = tmp_path / "vectors.txt"
    write_c_vectors(vectors, text)
    run = subprocess.run([str(exe), str(text)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert ", 0 failures" in run.stdout
    checks = int(run.stdout.split()[-4])
    assert checks >= 90

    # the harness really compares: a vector with one wrong byte must fail
    lines = text.read_text().splitlines()
    i = next(n for n, line in enumerate(lines) if line.startswith("FRAME heartbeat accept"))
    parts = lines[i].split(" ")
    parts[-1] = "02"  # claim a different payload
    lines[i] = " ".join(parts)
    text.write_text("\n".join(lines) + "\n")
    bad = subprocess.run([str(exe), str(text)], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "FAIL" in bad.stdout


@pytest.mark.parametrize("defines", [["-DCLP_NO_SIGNING"], ["-DCLP_RX_MAX_PAYLOAD=256"], ["-DCLP_CRC_SLICE8"]])
def test_c_compiles_in_reduced_configurations(cc: str, defines: list[str], tmp_path: Path) -> None:
    subprocess.run([cc, *CFLAGS, *defines, "-c", str(C_DIR / "closedloop_proto.c"), "-o", str(tmp_path / "p.o")],
                   check=True, capture_output=True, text=True)


def test_spec_worked_examples_are_the_vectors(vectors: dict) -> None:
    spec = Path(firmware_bridge.__file__).parents[1] / "docs" / "protocol.md"
    if not spec.exists():
        pytest.skip("docs/protocol.md is not in this checkout")
    flat = re.sub(r"[\s|]", "", spec.read_text()).lower()
    by_name = {f["name"]: f for f in vectors["frames"]}
    for name in ("heartbeat", "neural_frame", "signed_neural_frame", "crc_error"):
        assert by_name[name]["wire"].removesuffix("00" if name == "crc_error" else "") in flat, name
    assert "e3069283" in flat and vectors["key_derivation"]["host_to_device"][:8] in flat
