"""Write a bundle folder (or zip) atomically: files first, ``manifest.json`` last.

This is the only place a bundle is written. Every file's SHA-256 and size go into
``manifest.files``, and the manifest's ``integrity`` digest over all of it
(``closedloop.runtime.integrity.seal_manifest``); the manifest is written after every file it names, and the
whole folder is built in a temporary sibling and renamed into place
(``closedloop.common.atomic.atomic_directory``), so a crash mid-write leaves either nothing
or the previous bundle at the target, never something that loads. Before the
rename the new folder is checked with ``closedloop.runtime.bundle.check_bundle``, so the
writer never publishes a bundle the runtime would refuse. The zip form is built
from a finished folder into a temporary file next to the target, then renamed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import zipfile
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path, PurePosixPath

from closedloop.common.atomic import atomic_directory, fsync_dir, refuse_existing
from closedloop.runtime.integrity import seal_manifest
from closedloop.runtime.manifest import MANIFEST_NAME, Manifest
from closedloop.runtime.signing import SIGNATURE_NAME

from .errors import ExportError

FileSource = bytes | Path

# A fixed timestamp for zip members, so the same bundle always zips to the same bytes.
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)


def _check_relpath(rel: str) -> str:
    p = PurePosixPath(rel)
    if not rel or p.is_absolute() or ".." in p.parts or "\\" in rel or str(p) != rel:
        raise ExportError(
            f"bundle file name {rel!r} is not a plain relative POSIX path (like 'main.onnx' or "
            "'engines/main.engine'); rename it"
        )
    if rel in (MANIFEST_NAME, SIGNATURE_NAME):
        raise ExportError(f"bundle file name {rel!r} is reserved for the manifest and its signature; rename the file")
    return rel


def _file_bytes(rel: str, src: FileSource) -> bytes:
    if isinstance(src, bytes | bytearray | memoryview):
        return bytes(src)
    path = Path(src)
    if not path.is_file():
        raise ExportError(f"bundle file {rel!r}: source {path} is not a file; pass bytes or an existing path")
    return path.read_bytes()


def _write_file(root: Path, rel: str, data: bytes) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def _check_graph_files(manifest: Manifest, names: set[str]) -> None:
    for gname, spec in manifest.graphs.items():
        wanted = [spec.file] + [v["file"] for v in spec.variants.values()]
        wanted += [e["file"] for e in spec.tensorrt_engines]
        missing = [f for f in wanted if f not in names]
        if missing:
            raise ExportError(
                f"graph {gname!r} names file(s) {missing} that are not among the files to write "
                f"({sorted(names)}); pass them in `files`"
            )


def _verify(root: Path) -> None:
    from closedloop.runtime.bundle import check_bundle

    _manifest, problems, _notes = check_bundle(root)
    if problems:
        raise ExportError(
            "the bundle as written would be refused by the runtime, so it was not published:\n  - "
            + "\n  - ".join(problems)
        )


def _fill(root: Path, manifest: Manifest, blobs: dict[str, bytes]) -> None:
    for rel, data in blobs.items():
        _write_file(root, rel, data)
    # The manifest goes last: a folder without it is never taken for a bundle.
    _write_file(root, MANIFEST_NAME, manifest_bytes(manifest))


def manifest_bytes(manifest: Manifest) -> bytes:
    """``manifest.json`` as written: the manifest and its ``integrity`` digest, over exactly what a reader parses."""
    raw = json.loads(manifest.to_json())
    return (json.dumps(seal_manifest(raw), indent=2) + "\n").encode("utf-8")


def _zip_folder(folder: Path, dest: Path) -> None:
    with zipfile.ZipFile(dest, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            info = zipfile.ZipInfo(path.relative_to(folder).as_posix(), date_time=_ZIP_DATE)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, path.read_bytes())


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_bundle(
    out_path: str | Path,
    manifest: Manifest,
    files: Mapping[str, FileSource],
    *,
    overwrite: bool = False,
    zip: bool = False,
    verify: bool = True,
) -> Path:
    """Write ``files`` and ``manifest`` as a bundle at ``out_path``; return the path.

    Parameters
    ----------
    out_path
        The bundle folder to create (or, with ``zip=True``, the zip file).
    manifest
        Everything but ``files``: the writer fills ``manifest.files`` with each file's
        ``{"sha256", "bytes"}`` (any value passed in is replaced).
    files
        Relative POSIX path inside the bundle -> the file's bytes, or a path to copy.
    overwrite
        Replace an existing bundle at ``out_path`` (atomically: the old one stays
        until the new one is complete).
    zip
        Write one zip file (members at its top level) instead of a folder.
    verify
        Check the finished folder with ``closedloop.runtime.bundle.check_bundle`` before it is
        published; a problem raises ``ExportError`` and nothing is published.
    """
    out_path = Path(out_path)
    refuse_existing(out_path, overwrite)
    zip = zip or out_path.suffix == ".zip"  # a bundle named like a zip is written as one (not a folder "x.zip")
    if zip and out_path.is_dir():
        raise ExportError(f"{out_path} is a folder; a zipped bundle needs a file path (e.g. {out_path}.zip)")
    if not zip and out_path.is_file():
        raise ExportError(f"{out_path} is a file; a bundle folder needs a folder path (or pass zip=True)")
    blobs = {_check_relpath(rel): _file_bytes(rel, src) for rel, src in files.items()}
    _check_graph_files(manifest, set(blobs))
    manifest = replace(
        manifest,
        files={rel: {"sha256": hashlib.sha256(d).hexdigest(), "bytes": len(d)} for rel, d in sorted(blobs.items())},
    )

    if not zip:
        with atomic_directory(out_path, overwrite=overwrite) as tmp:
            os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it 0700; a bundle is shared like any folder
            _fill(tmp, manifest, blobs)
            if verify:
                _verify(tmp)
        return out_path

    out_path.parent.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix="closedloop-bundle-build-"))
    fd, tmp_zip = tempfile.mkstemp(prefix=f".{out_path.name}.", suffix=".tmp", dir=out_path.parent)
    os.close(fd)
    try:
        _fill(build, manifest, blobs)
        if verify:
            _verify(build)
        _zip_folder(build, Path(tmp_zip))
        os.chmod(tmp_zip, 0o666 & ~_umask())  # mkstemp makes it 0600
        with open(tmp_zip, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp_zip, out_path)
        fsync_dir(out_path.parent)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp_zip)
        raise
    finally:
        shutil.rmtree(build, ignore_errors=True)
    return out_path
