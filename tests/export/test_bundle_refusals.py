"""The loader refuses a tampered bundle and says which file and what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from export import write_bundle
from runtime.bundle import load_bundle
from runtime.errors import BundleError
from runtime.manifest import MANIFEST_NAME, Manifest


@pytest.fixture
def bundle(tmp_path, gru_bundle) -> Path:
    manifest = Manifest.from_json((gru_bundle / MANIFEST_NAME).read_text())
    out = write_bundle(tmp_path / "gru", manifest, {rel: gru_bundle / rel for rel in manifest.files})
    load_bundle(out)  # sound before we tamper with it
    return out


def _edit_manifest(bundle: Path, edit) -> None:
    path = bundle / MANIFEST_NAME
    d = json.loads(path.read_text())
    edit(d)
    path.write_text(json.dumps(d))


def test_missing_file(bundle):
    (bundle / "main.int8.onnx").unlink()
    with pytest.raises(BundleError) as info:
        load_bundle(bundle)
    assert "file main.int8.onnx: missing" in str(info.value)


def test_changed_hash(bundle):
    # A valid ONNX file with one weight nudged: only the checksum can tell.
    model = onnx.load(bundle / "main.onnx")
    init = model.graph.initializer[0]
    arr = numpy_helper.to_array(init).copy()
    arr.flat[0] += np.float32(0.01)
    init.CopyFrom(numpy_helper.from_array(arr, init.name))
    onnx.save(model, bundle / "main.onnx")
    with pytest.raises(BundleError) as info:
        load_bundle(bundle)
    msg = str(info.value)
    assert "file main.onnx: SHA-256" in msg and "changed after export" in msg


def test_unknown_schema_version(bundle):
    _edit_manifest(bundle, lambda d: d.update(schema_version=99))
    with pytest.raises(BundleError) as info:
        load_bundle(bundle)
    msg = str(info.value)
    assert MANIFEST_NAME in msg and "unknown schema_version 99" in msg


def test_graph_inputs_do_not_match_the_manifest(bundle):
    def rename_and_resize(d):
        inputs = d["graphs"]["main"]["inputs"]
        inputs[0]["shape"] = ["batch", 13]  # the graph takes 12 features

    _edit_manifest(bundle, rename_and_resize)
    # The manifest itself changed: its checksum is not in the manifest, so only the graph check can catch this.
    with pytest.raises(BundleError) as info:
        load_bundle(bundle)
    msg = str(info.value)
    assert "main.onnx" in msg and "input 'x' axis 1 is 12 in the graph, 13 in the manifest" in msg

    _edit_manifest(bundle, lambda d: d["graphs"]["main"]["inputs"][0].update(name="obs", shape=["batch", 12]))
    with pytest.raises(BundleError) as info:
        load_bundle(bundle)
    assert "main.onnx" in str(info.value) and "graph inputs are ['x', 'h'] but the manifest declares ['obs', 'h']" in str(info.value)
