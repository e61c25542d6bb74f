"""Atomic file and folder writes.

Bundles, calibrations and recordings must never be half-written: a crash leaves
either the old version or the new one, never a mix. Files are written to a
temporary sibling, flushed and fsynced, then renamed into place (``os.replace`` is
atomic on POSIX and Windows within one filesystem); folders are built in a
temporary sibling and renamed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def fsync_dir(path: str | Path) -> None:
    """Flush a folder's entries (a rename into it) to disk; a no-op where folders cannot be opened."""
    with contextlib.suppress(OSError):  # not all platforms can open a directory
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _umask() -> int:
    """The process's umask, read without changing it where Linux says it (``/proc/self/status``)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)  # elsewhere: set and put back at once
    os.umask(old)
    return old


def atomic_write_bytes(path: str | Path, data: bytes, mode: int | None = None) -> Path:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one.

    ``mode`` sets the file's permission bits (a private key's ``0o600``); None gives what ``open`` would make
    (``0o666`` less the umask), not ``mkstemp``'s private ``0o600``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode if mode is not None else 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def fsync_tree(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def refuse_existing(path: str | Path, overwrite: bool) -> None:
    """Raise ``FileExistsError`` when ``path`` exists and may not be replaced; call it before any long work,
    so a run is not spent on a result that cannot be written."""
    if Path(path).exists() and not overwrite:
        raise FileExistsError(f"{path} already exists; choose another path, or replace it: overwrite=True in "
                              "Python, --overwrite on the command line")


@contextlib.contextmanager
def atomic_directory(target: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Build a folder in a temporary sibling, then rename it to ``target``.

    If the body raises, nothing appears at ``target``. With ``overwrite`` an existing
    ``target`` is swapped out (renamed aside, then removed) after the new one is complete.
    """
    target = Path(target)
    refuse_existing(target, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    # mkdtemp makes the folder 0700; give it the mode a plain mkdir would (umask applied).
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    try:
        yield tmp
        fsync_tree(tmp)
        if target.exists():
            # Two renames: a reader may briefly find nothing at target, never a mix.
            # If the second rename fails the old folder is put back.
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
            os.rmdir(old)
            os.replace(target, old)
            try:
                os.replace(tmp, target)
            except BaseException:
                os.replace(old, target)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
        fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
