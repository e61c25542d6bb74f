"""The bundle writer: checksums, manifest last, and no half-written bundle after a crash."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

import closedloop.export.writer as writer
from closedloop.export import ExportError, write_bundle
from closedloop.runtime.bundle import load_bundle
from closedloop.runtime.manifest import MANIFEST_NAME, Manifest


class Crash(RuntimeError):
    pass


def _parts(bundle: Path) -> tuple[Manifest, dict[str, Path]]:
    manifest = Manifest.from_json((bundle / MANIFEST_NAME).read_text())
    return manifest, {rel: bundle / rel for rel in manifest.files}


def _tree(path: Path) -> dict[str, str]:
    return {p.relative_to(path).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.rglob("*")) if p.is_file()}


def _crash_on_second_file(monkeypatch):
    real, count = writer._write_file, [0]

    def flaky(root, rel, data):
        count[0] += 1
        if count[0] == 2:
            raise Crash("disk full, say")
        real(root, rel, data)

    monkeypatch.setattr(writer, "_write_file", flaky)


def test_writes_checksums_and_manifest_last(tmp_path, gru_bundle, monkeypatch):
    manifest, files = _parts(gru_bundle)
    manifest.files = {"stale.onnx": {"sha256": "0" * 64, "bytes": 1}}  # replaced by the writer
    order: list[str] = []
    real = writer._write_file
    monkeypatch.setattr(writer, "_write_file", lambda root, rel, data: (order.append(rel), real(root, rel, data)))
    out = write_bundle(tmp_path / "b", manifest, files)
    assert order[-1] == MANIFEST_NAME and sorted(order[:-1]) == sorted(files)
    written = load_bundle(out).manifest.files
    assert set(written) == set(files)
    for rel, meta in written.items():
        data = files[rel].read_bytes()
        assert meta == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def test_crash_mid_write_leaves_nothing(tmp_path, gru_bundle, monkeypatch):
    manifest, files = _parts(gru_bundle)
    _crash_on_second_file(monkeypatch)
    with pytest.raises(Crash):
        write_bundle(tmp_path / "b", manifest, files)
    assert list(tmp_path.iterdir()) == []  # no bundle, no temporary sibling


def test_crash_mid_overwrite_keeps_the_old_bundle(tmp_path, gru_bundle, monkeypatch):
    manifest, files = _parts(gru_bundle)
    out = write_bundle(tmp_path / "b", manifest, files)
    before = _tree(out)
    _crash_on_second_file(monkeypatch)
    manifest.name = "new"
    with pytest.raises(Crash):
        write_bundle(out, manifest, files, overwrite=True)
    assert _tree(out) == before and [p.name for p in tmp_path.iterdir()] == ["b"]
    assert load_bundle(out).manifest.name == "tiny-gru" != manifest.name


def test_crash_mid_zip_keeps_the_old_zip(tmp_path, gru_bundle, monkeypatch):
    manifest, files = _parts(gru_bundle)
    out = write_bundle(tmp_path / "b.zip", manifest, files, zip=True)
    before = out.read_bytes()

    def half_zip(folder, dest):
        dest.write_bytes(b"PK\x03\x04 half a zip")
        raise Crash("killed while zipping")

    monkeypatch.setattr(writer, "_zip_folder", half_zip)
    with pytest.raises(Crash):
        write_bundle(out, manifest, files, zip=True, overwrite=True)
    assert out.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["b.zip"]
    with zipfile.ZipFile(out) as zf:
        assert MANIFEST_NAME in zf.namelist()


def test_refuses_to_replace_without_overwrite(tmp_path, gru_bundle):
    manifest, files = _parts(gru_bundle)
    write_bundle(tmp_path / "b", manifest, files)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        write_bundle(tmp_path / "b", manifest, files)


@pytest.mark.parametrize("bad", ["../evil.onnx", "/abs.onnx", "a\\b.onnx", "./x.onnx", MANIFEST_NAME, ""])
def test_refuses_bad_file_names(tmp_path, gru_bundle, bad):
    manifest, files = _parts(gru_bundle)
    with pytest.raises(ExportError, match="rename"):
        write_bundle(tmp_path / "b", manifest, {**files, bad: b"x"})
    assert not (tmp_path / "b").exists()


def test_refuses_a_graph_file_it_is_not_given(tmp_path, gru_bundle):
    manifest, files = _parts(gru_bundle)
    del files["main.int8.onnx"]
    with pytest.raises(ExportError, match=r"graph 'main' names file\(s\) \['main.int8.onnx'\]"):
        write_bundle(tmp_path / "b", manifest, files)


def test_never_publishes_a_bundle_the_runtime_refuses(tmp_path, gru_bundle):
    manifest, files = _parts(gru_bundle)
    manifest.graphs["main"].inputs[0].name = "obs"  # the graph calls it "x"
    with pytest.raises(ExportError, match="would be refused") as info:
        write_bundle(tmp_path / "b", manifest, files)
    assert "main.onnx" in str(info.value) and "obs" in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_bundle_gets_ordinary_permissions(tmp_path, gru_bundle):
    import os

    manifest, files = _parts(gru_bundle)
    mask = os.umask(0o022)
    try:
        folder = write_bundle(tmp_path / "b", manifest, files)
        zipped = write_bundle(tmp_path / "b.zip", manifest, files, zip=True)
    finally:
        os.umask(mask)
    assert folder.stat().st_mode & 0o777 == 0o755 and zipped.stat().st_mode & 0o777 == 0o644


def test_files_written_atomically_get_ordinary_permissions(tmp_path):
    """A run.json, an NWB export, a results file: readable as any file the user makes (0o666 less the umask), not
    mkstemp's private 0o600; a key asks for 0o600 itself."""
    import os

    from closedloop.common.atomic import atomic_write_bytes

    mask = os.umask(0o022)
    try:
        plain = atomic_write_bytes(tmp_path / "run.json", b"{}")
        key = atomic_write_bytes(tmp_path / "lab.key", b"k", mode=0o600)
    finally:
        os.umask(mask)
    assert plain.stat().st_mode & 0o777 == 0o644 and key.stat().st_mode & 0o777 == 0o600
