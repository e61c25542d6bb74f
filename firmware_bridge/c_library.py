"""The host scanner library: firmware_bridge/c built into a shared library on first use, loaded by ctypes.

The C-backed parser (:mod:`closedloop.firmware_bridge.c_parser`) calls ``clp_scan`` from
``c/closedloop_scan.c``, which runs the frame checks of the project's own
``c/closedloop_proto.c`` over a whole received chunk.  The sources ship inside the package;
this module compiles them once per machine with the C compiler found at run time (``$CC``,
else ``cc``, ``gcc`` or ``clang`` on ``PATH``) into a cache folder (``$CLOSEDLOOP_CACHE_DIR``,
else ``$XDG_CACHE_HOME/closedloop``, else ``~/.cache/closedloop``), named by a hash of the
sources and flags so that a changed source is rebuilt and never mixed up with an old build.
A board without a compiler can still use a library built there earlier; with neither,
:func:`load_scanner` raises :class:`CParserUnavailableError` saying why, and the callers fall
back to the Python parser.  ``python -m closedloop.firmware_bridge.c_library`` builds it ahead
of time (for a board image) and prints where it is.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CParserUnavailableError", "ScannerLibrary", "library_path", "load_scanner", "SCAN_ABI", "RECORD_SIZE"]

C_DIR = Path(__file__).parent / "c"
SOURCES = ("closedloop_proto.c", "closedloop_scan.c")
HEADERS = ("closedloop_proto.h", "closedloop_scan.h")
#: Must equal CLP_SCAN_ABI in closedloop_scan.h.
SCAN_ABI = 1
#: sizeof(clp_scan_record_t).
RECORD_SIZE = 32
# the fast CRC table is what makes the host library worth loading; -O2 is the portable optimum
CFLAGS = ("-std=c99", "-O2", "-fPIC", "-shared", "-DCLP_CRC_SLICE8")
_COMPILE_TIMEOUT_S = 120


class CParserUnavailableError(RuntimeError):
    """The C scanner library cannot be built or loaded here; the message says why and what to do."""


@dataclass(frozen=True)
class ScannerLibrary:
    """The loaded library, with ctypes signatures set."""

    lib: ctypes.CDLL
    path: Path
    scanner_size: int
    built_now: bool  # compiled by this process (else found in the cache)


def _cache_dir() -> Path:
    explicit = os.environ.get("CLOSEDLOOP_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "closedloop"


def _library_name() -> str:
    h = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        h.update(name.encode() + b"\0" + (C_DIR / name).read_bytes() + b"\0")
    h.update(" ".join(CFLAGS).encode() + f"|{SCAN_ABI}|{sys.platform}|{platform.machine()}".encode())
    return f"libclosedloop_scan-{h.hexdigest()[:16]}.so"


def library_path() -> Path:
    """Where this machine's scanner library is, or will be once built (the cache folder and the sources' hash)."""
    return _cache_dir() / _library_name()


def _compiler() -> list[str] | None:
    cc = os.environ.get("CC")
    if cc:
        argv = shlex.split(cc)
        return argv if argv and shutil.which(argv[0]) else None
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return [path]
    return None


def _build(compiler: list[str], folder: Path, name: str) -> Path:
    """Compile into ``folder/name`` through a temporary file, so that a concurrent loader never
    sees half a library."""
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=name + ".", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        cmd = [*compiler, *CFLAGS, f"-I{C_DIR}", *(str(C_DIR / s) for s in SOURCES), "-o", tmp]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=_COMPILE_TIMEOUT_S)
        if run.returncode != 0:
            raise CParserUnavailableError(
                f"compiling the C scanner failed ({shlex.join(cmd)} exited {run.returncode}): "
                f"{run.stderr.strip()[-800:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, folder / name)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return folder / name


def _bind(path: Path, built_now: bool) -> ScannerLibrary:
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise CParserUnavailableError(f"{path} does not load ({exc}); delete it to rebuild") from None
    lib.clp_scan_abi.restype = ctypes.c_int
    lib.clp_scan_abi.argtypes = []
    abi = lib.clp_scan_abi()
    if abi != SCAN_ABI:
        raise CParserUnavailableError(f"{path} has scanner ABI {abi}; this package needs {SCAN_ABI}: "
                                      "delete it to rebuild")
    lib.clp_scanner_size.restype = ctypes.c_size_t
    lib.clp_scanner_size.argtypes = []
    lib.clp_scanner_init.restype = None
    lib.clp_scanner_init.argtypes = [ctypes.c_void_p]
    lib.clp_scan.restype = ctypes.c_long
    lib.clp_scan.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_void_p,
                             ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    lib.clp_cobs_encode.restype = ctypes.c_size_t
    lib.clp_cobs_encode.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t]
    lib.clp_crc32c.restype = ctypes.c_uint32
    lib.clp_crc32c.argtypes = [ctypes.c_uint32, ctypes.c_char_p, ctypes.c_size_t]
    return ScannerLibrary(lib, path, int(lib.clp_scanner_size()), built_now)


def frame_encoders() -> tuple[Callable[[bytes], bytes], Callable[[bytes], int]]:
    """``(cobs_encode, crc32c)`` from the C library, byte for byte the Python ones (``cobs.py``, ``crc.py``)
    in a fraction of the time; raises :class:`CParserUnavailableError` where the library is not available."""
    lib = load_scanner().lib
    encode, crc = lib.clp_cobs_encode, lib.clp_crc32c
    buffer, addressof = ctypes.create_string_buffer, ctypes.addressof

    def cobs_encode(data: bytes) -> bytes:
        n = len(data)
        cap = n + n // 254 + 2  # COBS adds one byte per 254, plus the first code byte
        out = buffer(cap)
        used = encode(data, n, addressof(out), cap)
        return out.raw[:used]

    def crc32c(data: bytes) -> int:
        return int(crc(0, data, len(data)))

    return cobs_encode, crc32c


def _load() -> ScannerLibrary:
    name = _library_name()
    folder = _cache_dir()
    if (folder / name).is_file():
        return _bind(folder / name, built_now=False)
    compiler = _compiler()
    if compiler is None:
        cc = os.environ.get("CC")
        which = f"$CC={cc!r} is not an executable" if cc else "no C compiler (cc, gcc or clang) on PATH"
        raise CParserUnavailableError(
            f"{which} and no prebuilt scanner at {folder / name}: install a C compiler, or build the library "
            "on a machine like this one with `python -m closedloop.firmware_bridge.c_library` and copy it there")
    try:
        return _bind(_build(compiler, folder, name), built_now=True)
    except OSError:
        # an unwritable cache: build privately for this process (never load a shared temp file)
        return _bind(_build(compiler, Path(tempfile.mkdtemp(prefix="closedloop-scan-")), name), built_now=True)


_lock = threading.Lock()
_result: ScannerLibrary | CParserUnavailableError | None = None


def load_scanner() -> ScannerLibrary:
    """The scanner library, built if needed (once per process); raises :class:`CParserUnavailableError`."""
    global _result
    with _lock:
        if _result is None:
            try:
                _result = _load()
            except CParserUnavailableError as exc:
                _result = exc
            except (OSError, subprocess.SubprocessError) as exc:
                _result = CParserUnavailableError(f"building the C scanner failed: {exc}")
        if isinstance(_result, CParserUnavailableError):
            raise CParserUnavailableError(str(_result))  # a fresh one: no traceback piles up across calls
        return _result


def main() -> int:
    try:
        found = load_scanner()
    except CParserUnavailableError as exc:
        print(f"C scanner unavailable: {exc}", file=sys.stderr)
        return 1
    print(f"{'built' if found.built_now else 'found'} {found.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
