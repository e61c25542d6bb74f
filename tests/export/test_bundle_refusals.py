"""The loader refuses a tampered bundle and says which file and what is wrong."""

from __future__ import annotations

import json
import re
import stat
import zipfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from closedloop.export import write_bundle
from closedloop.runtime.bundle import load_bundle
from closedloop.runtime.errors import BundleError
from closedloop.runtime.integrity import seal_manifest
from closedloop.runtime.manifest import MANIFEST_NAME, Manifest


@pytest.fixture
def bundle(tmp_path, gru_bundle) -> Path:
    manifest = Manifest.from_json((gru_bundle / MANIFEST_NAME).read_text())
    out = write_bundle(tmp_path / "gru", manifest, {rel: gru_bundle / rel for rel in manifest.files})
    load_bundle(out)  # sound before we tamper with it
    return out


def _edit_manifest(bundle: Path, edit) -> None:
    """Edit and reseal: the checks behind the digest, which a resealed or hand-made manifest must still pass."""
    path = bundle / MANIFEST_NAME
    d = json.loads(path.read_text())
    edit(d)
    path.write_text(json.dumps(seal_manifest(d)))


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


@pytest.mark.parametrize("path", ["../outside.onnx", "/etc/hostname", "sub\\main.onnx", "a/../../outside.onnx"])
def test_paths_that_leave_the_bundle_are_refused_before_anything_is_read(bundle, path):
    # docs/bundle.md: relative POSIX paths, no leading '/', no '..', no backslashes. A manifest naming a file
    # outside the bundle (with that file's true checksum) must not get it hashed, loaded or run.
    outside = bundle.parent / "outside.onnx"
    outside.write_bytes((bundle / "main.onnx").read_bytes())

    def point_outside(d):
        meta = d["files"].pop("main.onnx")
        d["files"][path] = meta
        d["graphs"]["main"]["file"] = path

    _edit_manifest(bundle, point_outside)
    with pytest.raises(BundleError) as info:
        load_bundle(bundle)
    msg = str(info.value)
    assert f"path {path!r} is not a relative POSIX path inside the bundle" in msg
    assert "SHA-256" not in msg and "missing" not in msg  # refused on the path alone


def test_a_replaced_graph_is_refused_on_its_size_or_checksum_without_being_parsed(bundle):
    """A model file whose bytes are not the bundle's is refused on its size or checksum alone: the replacement is
    never parsed (a 512 MB file was read whole by the ONNX reader, 2 minutes, before the refusal; its parse errors
    were listed beside it)."""
    graph = bundle / "main.onnx"
    graph.write_bytes(b"\x08" * 4096)  # not ONNX at all, another size
    with pytest.raises(BundleError) as info:
        load_bundle(bundle)
    msg = str(info.value)
    assert "file main.onnx: 4096 bytes, the manifest says" in msg and "graph 'main'" not in msg, msg


def test_a_file_whose_size_differs_from_the_manifest_is_refused(bundle):
    _edit_manifest(bundle, lambda d: d["files"]["main.onnx"].update(bytes=d["files"]["main.onnx"]["bytes"] + 1))
    with pytest.raises(BundleError, match=r"file main.onnx: \d+ bytes, the manifest says \d+"):
        load_bundle(bundle)


@pytest.mark.parametrize("field,value,message", [
    ("schema_version", 1.0, "unknown schema_version 1.0"),
    ("preprocess", [], "preprocess must be an object, got an array"),
    ("name", 5, "name must be a string, got an integer"),
    ("family", None, "family must be a string, got null"),
    ("schema_version", True, "unknown schema_version True"),
    ("rate_hz", "50", "rate_hz must be a positive number (Hz), got '50'"),
    ("rate_hz", 0, "rate_hz must be a positive number (Hz), got 0"),
])
def test_manifest_fields_of_the_wrong_type_are_refused(bundle, field, value, message):
    _edit_manifest(bundle, lambda d: d.update({field: value}))
    with pytest.raises(BundleError) as info:
        load_bundle(bundle)
    assert message in str(info.value) and MANIFEST_NAME in str(info.value)


def test_a_manifest_that_is_not_utf8_is_refused_naming_it(bundle):
    path = bundle / MANIFEST_NAME
    path.write_bytes(path.read_bytes().replace(b'"name": "', b'"name": "caf\xe9', 1))
    with pytest.raises(BundleError, match=f"{MANIFEST_NAME} is not UTF-8"):
        load_bundle(bundle)


def test_state_flags_must_agree_with_the_graph_kind(bundle):
    # the state flags decide what the runtime carries between steps: a recurrent graph with them removed would
    # silently run from zero state at every step
    def drop_state(d):
        for t in d["graphs"]["main"]["inputs"] + d["graphs"]["main"]["outputs"]:
            t.update(state=False, state_pair=None)

    _edit_manifest(bundle, drop_state)
    with pytest.raises(BundleError, match="kind 'recurrent' but 0 state inputs"):
        load_bundle(bundle)
    _edit_manifest(bundle, lambda d: d["graphs"]["main"].update(kind="feedforward"))
    load_bundle(bundle)  # consistent again: a feed-forward reading of the graph, as the manifest says


@pytest.mark.parametrize(("name", "what", "how"), [
    ("decoder.onnx", "an ONNX model", "closedloop import-onnx FILE OUT --rate HZ"),
    ("model.pt", "a torch file", "closedloop.export_bundle"),
    ("program.pt2", "a torch.export program", "closedloop.export_bundle")])
def test_a_model_file_handed_over_as_a_bundle_is_named_with_how_to_make_one(bundle, tmp_path, name, what, how):
    model = tmp_path / name
    model.write_bytes((bundle / "main.onnx").read_bytes())  # a real model file, just not a bundle
    with pytest.raises(BundleError, match=f"this is {what}, not a bundle .* {how}"):
        load_bundle(model)


def test_a_bundles_manifest_handed_over_as_the_bundle_names_the_folder(bundle):
    with pytest.raises(BundleError, match=f"this is a bundle's manifest; give the folder that holds it, {bundle}$"):
        load_bundle(bundle / "manifest.json")


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d["files"]["main.onnx"].update(bytes=float(d["files"]["main.onnx"]["bytes"])),
     "files['main.onnx'].bytes must be an integer, got a number"),
    (lambda d: d["graphs"]["main"]["inputs"][1].update(state=1), "graphs['main'].inputs[1].state must be true or false"),
    (lambda d: d["graphs"]["main"]["outputs"][0].update(name=5), "graphs['main'].outputs[0].name must be a string"),
    (lambda d: d["graphs"]["main"]["inputs"][0].update(shape=["batch", 12.0]),
     "graphs['main'].inputs[0].shape[1] must be an integer or a string, got a number"),
])
def test_a_field_of_another_json_type_is_refused_not_coerced(bundle, edit, message):
    """A reader in another language would take ``bytes: 1.0`` or ``state: 1`` its own way: the types are the spec's."""
    _edit_manifest(bundle, edit)
    with pytest.raises(BundleError, match=re.escape(message)):
        load_bundle(bundle)


def test_a_repeated_key_is_refused(bundle):
    """JSON parsers differ on which of two equal keys counts: one reader could check a signature over one value
    while another runs the other."""
    path = bundle / MANIFEST_NAME
    path.write_text(path.read_text().replace('"rate_hz": 50.0', '"rate_hz": 50.0, "rate_hz": 51.0', 1))
    with pytest.raises(BundleError, match="the key 'rate_hz' appears twice in one object"):
        load_bundle(bundle)


def test_each_state_output_names_its_input_back(bundle):
    _edit_manifest(bundle, lambda d: d["graphs"]["main"]["outputs"][1].update(state_pair="x"))
    with pytest.raises(BundleError, match="state output 'h_out' names input 'x', which is not the state input it feeds"):
        load_bundle(bundle)
    _edit_manifest(bundle, lambda d: d["graphs"]["main"]["outputs"][1].update(state_pair=None))
    with pytest.raises(BundleError, match="state output 'h_out' names input None"):
        load_bundle(bundle)


def test_a_version_1_manifest_with_a_role_or_window_is_refused(bundle):
    """Version 1 has neither: a version-1 reader would ignore a window and feed one frame where the model takes many."""
    def v1_with_role(d):
        d["schema_version"] = 1
        d["graphs"]["main"]["inputs"][0]["role"] = "measurement"

    _edit_manifest(bundle, v1_with_role)
    with pytest.raises(BundleError, match=r"schema_version 1 but main.inputs\[0\].role set"):
        load_bundle(bundle)
    _edit_manifest(bundle, lambda d: d["graphs"]["main"]["inputs"][0].pop("role"))
    load_bundle(bundle)  # version 1 as written before roles existed


def test_the_manifest_listing_itself_is_refused(bundle):
    def list_itself(d):
        d["files"][MANIFEST_NAME] = {"sha256": "0" * 64, "bytes": 1}

    _edit_manifest(bundle, list_itself)
    with pytest.raises(BundleError, match="files lists manifest.json itself"):
        load_bundle(bundle)


def _zip_with(bundle: Path, out: Path, extra: zipfile.ZipInfo, data: bytes) -> Path:
    with zipfile.ZipFile(out, "w") as zf:
        for f in sorted(bundle.iterdir()):
            zf.write(f, f.name)
        zf.writestr(extra, data)
    return out


@pytest.mark.parametrize(("member", "link", "message"), [
    ("../outside.txt", False, "zip member '../outside.txt' escapes the bundle folder"),
    ("main.fp16.onnx.link", True, "zip member 'main.fp16.onnx.link' is a symbolic link"),
    # a second main.onnx after the good one: the last copy would win where another reader takes the first
    ("main.onnx", False, "zip members ['main.onnx'] appear more than once"),
])
def test_a_zip_member_that_escapes_or_links_is_refused_as_the_bundle_is(bundle, tmp_path, member, link, message):
    """Refused like any other fault of the bundle (``inspect`` prints REFUSED and exits 1), naming the member."""
    from closedloop.runtime.bundle import check_bundle
    from closedloop.sdk.cli import main

    info = zipfile.ZipInfo(member)
    if link:
        info.external_attr = (stat.S_IFLNK | 0o777) << 16
    path = _zip_with(bundle, tmp_path / "b.zip", info, b"/etc/passwd" if link else b"x")
    with pytest.raises(BundleError, match=re.escape(message)):
        load_bundle(path)
    manifest, problems, _ = check_bundle(path)
    assert manifest is None and len(problems) == 1 and message in problems[0]
    assert main(["inspect", str(path)]) == 1


def _with_initial(value, version=3, tensor=1):
    def edit(d):
        d["schema_version"] = version
        d["graphs"]["main"]["inputs"][tensor]["initial"] = value
    return edit


def test_an_initial_state_reads_in_version_3_and_the_model_starts_there(bundle):
    h0 = [round(0.01 * i, 2) for i in range(32)]  # h: (2, batch, 16)
    _edit_manifest(bundle, _with_initial(h0))
    from closedloop.runtime import Model

    model = Model(load_bundle(bundle), backend="onnxruntime")
    np.testing.assert_array_equal(model.inputs["h"], np.asarray(h0, np.float32).reshape(2, 1, 16))


@pytest.mark.parametrize(("edit", "message"), [
    (_with_initial([0.5] * 32, version=2),
     r"schema_version 2 but main.inputs\[1\].initial set: an initial state is version 3"),
    (_with_initial([0.5] * 31), r"state input 'h' has 31 initial values; its shape \[2, 'batch', 16\] at batch 1 "
                                r"holds 32"),
    (_with_initial([0.5] * 12, tensor=0), r"'x' has an initial value; only a state input can"),
    (_with_initial([True] * 32), r"inputs\[1\].initial must hold finite JSON numbers only, got a boolean"),
    (_with_initial([0.5] * 31 + [None]), r"inputs\[1\].initial must hold finite JSON numbers only, got null"),
    (_with_initial([0.5] * 31 + [1e300]), r"state input 'h' has initial values that are not finite float32 numbers"),
    (_with_initial("0.5"), r"inputs\[1\].initial must be an array of numbers, got a string"),
])
def test_an_initial_state_that_does_not_fit_is_refused(bundle, edit, message):
    """A version-2 reader would start the state at zeros, so the field needs version 3; and it must fit the state."""
    _edit_manifest(bundle, edit)
    with pytest.raises(BundleError, match=message):
        load_bundle(bundle)
