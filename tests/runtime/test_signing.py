"""Issue 24, defect 4 and signed bundles: the manifest digest, symbolic links, Ed25519 signatures and --trust."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest

from closedloop.runtime import Model, Session, SessionConfig
from closedloop.runtime.bundle import load_bundle
from closedloop.runtime.errors import BundleError
from closedloop.runtime.integrity import integrity_problem, manifest_digest, seal_manifest
from closedloop.runtime.manifest import MANIFEST_NAME
from closedloop.runtime.signing import (
    SIGNATURE_NAME,
    SigningError,
    TrustedKeys,
    generate_key_pair,
    sign_bundle,
)
from closedloop.sdk.cli import main


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("keys")
    lab_key, lab_pub, _ = generate_key_pair(d / "lab")
    other_key, other_pub, _ = generate_key_pair(d / "other")
    folder = d / "trusted"
    folder.mkdir()
    shutil.copy(lab_pub, folder / "lab.pub")
    return {"key": lab_key, "pub": lab_pub, "other_key": other_key, "other_pub": other_pub, "folder": folder}


@pytest.fixture(scope="module")
def signed(mlp_bundle, keys, tmp_path_factory) -> Path:
    path = shutil.copytree(mlp_bundle, tmp_path_factory.mktemp("signed") / "mlp")
    sign_bundle(path, keys["key"])
    return path


@pytest.fixture(scope="module")
def protected(tmp_path_factory) -> Path:
    """A bundle with bit-flip protection (extra.robust: per-tensor tolerances)."""
    import torch

    from closedloop.sdk.robust.demo import make_protected_decoder

    torch.set_num_threads(1)
    return Path(make_protected_decoder(tmp_path_factory.mktemp("robust") / "decoder", None, n_channels=12))


def _copy(src: Path, tmp_path: Path, name: str = "copy") -> Path:
    return shutil.copytree(src, tmp_path / name)


def _raw(path: Path) -> dict:
    return json.loads((path / MANIFEST_NAME).read_text())


def _write(path: Path, raw: dict) -> None:
    (path / MANIFEST_NAME).write_text(json.dumps(raw, indent=2))


# --- the digest ------------------------------------------------------------------------------------


def test_the_writer_stores_a_digest_over_the_documented_canonical_form(mlp_bundle):
    raw = _raw(mlp_bundle)
    block = raw["integrity"]
    body = {k: v for k, v in raw.items() if k != "integrity"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    assert block["digest"] == hashlib.sha256(canonical).hexdigest() == manifest_digest(raw)
    assert block["algorithm"] == "sha256" and block["canonical"] == "json-sorted-compact-utf8"
    assert {"rate_hz", "postprocess.high", "graphs.main.outputs", "files[\"main.onnx\"].sha256"} <= set(block["fields"])
    assert integrity_problem(raw) is None and load_bundle(mlp_bundle).digest == block["digest"]


@pytest.mark.parametrize("edit, named", [
    (lambda m: m.update(rate_hz=51.0), "rate_hz changed"),  # the outside test's 51 Hz run
    (lambda m: m["postprocess"].update(high=[500.0] * 3), "postprocess.high changed"),  # +-5 -> +-500 limits
    (lambda m: m["postprocess"].update(low=[-500.0] * 3), "postprocess.low changed"),
    (lambda m: m["graphs"]["main"]["outputs"][0].update(name="z"), "graphs.main.outputs[0] changed"),
    (lambda m: m.update(name="other"), "name changed"),
    (lambda m: m.update(evil={"a": 1, "b": [2]}), "evil added"),
    (lambda m: m.pop("provenance"), "provenance removed"),
    (lambda m: m["integrity"].update(digest="0" * 64), "no field's digest differs, so integrity.digest itself was edited"),
])
def test_an_edited_manifest_field_is_refused_without_trust_naming_it(mlp_bundle, tmp_path, edit, named):
    path = _copy(mlp_bundle, tmp_path)
    raw = _raw(path)
    edit(raw)
    _write(path, raw)
    with pytest.raises(BundleError, match="manifest field\\(s\\) changed after export") as err:
        load_bundle(path)
    assert named in str(err.value)
    assert main(["inspect", str(path)]) == 1


@pytest.mark.parametrize("edit, named", [
    (lambda r: r["precisions"]["fp32"].update(tolerance={k: [1e300, 1e300] for k in r["precisions"]["fp32"]["tolerance"]}),
     "extra.robust.precisions.fp32 changed"),  # the outside test's 1e300: a bit-30 flip went unseen
    (lambda r: r.update(k=r["k"] + 1), "extra.robust.k changed"),
])
def test_edited_protection_tolerances_are_refused(protected, tmp_path, edit, named):
    path = _copy(protected, tmp_path)
    raw = _raw(path)
    assert "tolerance" in raw["extra"]["robust"]["precisions"]["fp32"]
    edit(raw["extra"]["robust"])
    _write(path, raw)
    with pytest.raises(BundleError, match=named.replace(".", "\\.")):
        load_bundle(path)


def test_a_tampered_integrity_table_is_refused(mlp_bundle, tmp_path):
    path = _copy(mlp_bundle, tmp_path)
    raw = _raw(path)
    raw["integrity"]["fields"]["rate_hz"] = "0" * 16
    _write(path, raw)
    with pytest.raises(BundleError, match="integrity.fields does not match the manifest, whose fields match its "
                                          "digest \\(rate_hz: entry differs\\): the table itself was edited"):
        load_bundle(path)
    upper = _copy(mlp_bundle, tmp_path, "upper")
    raw = _raw(upper)
    raw["integrity"]["digest"] = raw["integrity"]["digest"].upper()  # the same SHA-256, not in the form read
    _write(upper, raw)
    with pytest.raises(BundleError, match="integrity.digest is '[0-9A-F]{64}', not 64 lowercase hex digits"):
        load_bundle(upper)


def test_a_bundle_written_before_the_digest_loads_but_not_under_trust(mlp_bundle, keys, tmp_path):
    path = _copy(mlp_bundle, tmp_path)
    raw = _raw(path)
    del raw["integrity"]
    _write(path, raw)
    assert load_bundle(path).digest is None  # nothing to check: it loads as before
    with pytest.raises(BundleError, match="unsigned: the manifest has no integrity digest"):
        load_bundle(path, trust=keys["pub"])
    result = sign_bundle(path, keys["key"])  # signing adds the digest, then signs
    assert result.sealed and integrity_problem(_raw(path)) is None
    assert load_bundle(path, trust=keys["pub"]).signed_by == result.key_id


def test_a_manifest_string_that_is_not_unicode_text_is_refused_at_load_and_at_signing(mlp_bundle, keys, tmp_path):
    """A lone surrogate (``"\\ud800"`` in the JSON) has no UTF-8 bytes: the documented canonical form (strict
    UTF-8) does not exist for it, so no reader in another language could reproduce a digest over it."""
    path = _copy(mlp_bundle, tmp_path)
    raw = _raw(path)
    del raw["integrity"]
    raw["name"] = "bench-\ud800"
    _write(path, raw)  # json.dumps writes it as the escape \ud800
    assert "\\ud800" in (path / MANIFEST_NAME).read_text()
    with pytest.raises(BundleError, match="lone surrogate .* no canonical form"):
        load_bundle(path)
    with pytest.raises(ValueError, match="lone surrogate"):
        sign_bundle(path, keys["key"])
    assert not (path / SIGNATURE_NAME).exists() and "integrity" not in _raw(path)  # nothing half-written


# --- files: symbolic links ---------------------------------------------------------------------------


def test_a_graph_file_symlinked_outside_the_bundle_is_refused(mlp_bundle, tmp_path):
    path = _copy(mlp_bundle, tmp_path)
    outside = tmp_path / "elsewhere.onnx"
    shutil.move(path / "main.onnx", outside)
    os.symlink(outside, path / "main.onnx")  # same bytes: its checksum holds
    with pytest.raises(BundleError, match="file main.onnx: is a symbolic link \\(to .*elsewhere.onnx\\)"):
        load_bundle(path)


def test_a_symlink_inside_the_bundle_and_a_symlinked_manifest_are_refused(mlp_bundle, tmp_path):
    path = _copy(mlp_bundle, tmp_path)
    shutil.move(path / "main.onnx", path / "real.onnx")
    os.symlink("real.onnx", path / "main.onnx")
    with pytest.raises(BundleError, match="file main.onnx: is a symbolic link \\(to real.onnx\\)"):
        load_bundle(path)
    other = _copy(mlp_bundle, tmp_path, "other")
    shutil.move(other / MANIFEST_NAME, tmp_path / "m.json")
    os.symlink(tmp_path / "m.json", other / MANIFEST_NAME)
    with pytest.raises(BundleError, match="manifest.json is a symbolic link"):
        load_bundle(other)


# --- signatures ----------------------------------------------------------------------------------------


def test_a_signed_bundle_loads_and_steps_under_trust(signed, keys):
    sig = json.loads((signed / SIGNATURE_NAME).read_text())
    assert sig["format"] == "closedloop-bundle-signature" and sig["signatures"][0]["algorithm"] == "ed25519"
    for trust in (keys["pub"], [keys["folder"]], str(keys["folder"]), TrustedKeys.from_paths([keys["pub"]])):
        bundle = load_bundle(signed, trust=trust)
        assert bundle.signed_by == sig["signatures"][0]["key_id"]
    y = Model(signed, backend="onnxruntime", trust=keys["pub"]).step(np.zeros((1, 6), np.float32))
    assert y.shape == (1, 3) and np.all(np.isfinite(y))
    # a bundle loaded without trust is checked when a model is made under trust
    assert Model(load_bundle(signed), backend="onnxruntime", trust=keys["folder"]).bundle.signed_by


def test_an_unsigned_bundle_is_refused_under_trust_everywhere(mlp_bundle, keys):
    with pytest.raises(BundleError, match=f"unsigned: no {SIGNATURE_NAME}"):
        load_bundle(mlp_bundle, trust=keys["pub"])
    with pytest.raises(BundleError, match="unsigned"):
        Model(load_bundle(mlp_bundle), backend="onnxruntime", trust=keys["pub"])
    with pytest.raises(BundleError, match="unsigned"):  # refused before any device is opened
        Session(mlp_bundle, SessionConfig(device="loop://", trust=[str(keys["pub"])]))
    assert load_bundle(mlp_bundle).signed_by is None  # no trust configured: unsigned bundles keep working


def test_a_bundle_signed_by_another_key_is_refused_naming_both(signed, keys):
    other = TrustedKeys.from_paths([keys["other_pub"]])
    signer = load_bundle(signed, trust=keys["pub"]).signed_by
    with pytest.raises(BundleError) as err:
        load_bundle(signed, trust=other)
    msg = str(err.value)
    assert f"signed by key {signer}, which is not trusted here" in msg and other.keys[0].key_id in msg


def test_a_signature_file_that_is_ambiguous_or_no_file_or_forged_is_refused_saying_what_it_is(signed, keys, tmp_path):
    # the same key twice in manifest.sig: JSON readers differ on which copy counts
    dup = _copy(signed, tmp_path, "dup")
    text = (dup / SIGNATURE_NAME).read_text()
    (dup / SIGNATURE_NAME).write_text(text.replace('"version"', '"version": 99, "version"', 1))
    with pytest.raises(BundleError, match="duplicate key \\['version'\\]"):
        load_bundle(dup, trust=keys["pub"])
    # a folder where manifest.sig should be is not "unsigned"
    folder = _copy(signed, tmp_path, "folder")
    (folder / SIGNATURE_NAME).unlink()
    (folder / SIGNATURE_NAME).mkdir()
    with pytest.raises(BundleError, match="manifest.sig is not a regular file"):
        load_bundle(folder, trust=keys["pub"])
    with pytest.raises(SigningError, match="is not a regular file .* remove it, then sign again"):
        sign_bundle(folder, keys["key"])
    # the trusted key's own signature, flipped: the bundle changed, trusting more keys is not the answer
    forged = _copy(signed, tmp_path, "forged")
    doc = json.loads((forged / SIGNATURE_NAME).read_text())
    sig = doc["signatures"][0]["signature"]
    doc["signatures"][0]["signature"] = ("A" if sig[0] != "A" else "B") + sig[1:]
    (forged / SIGNATURE_NAME).write_text(json.dumps(doc))
    with pytest.raises(BundleError) as err:
        load_bundle(forged, trust=keys["pub"])
    assert "restore the bundle from the lab's copy" in str(err.value) and "trust its signer" not in str(err.value)
    # a folder named like a key among the trusted keys is not read as one
    (keys["folder"] / "dir.pub").mkdir(exist_ok=True)
    try:
        assert TrustedKeys.from_paths([keys["folder"]]).key_ids == TrustedKeys.from_paths([keys["pub"]]).key_ids
    finally:
        (keys["folder"] / "dir.pub").rmdir()


def test_co_signing_keeps_both_signatures(signed, keys, tmp_path):
    path = _copy(signed, tmp_path)
    assert sign_bundle(path, keys["other_key"]).kept == 1
    assert load_bundle(path, trust=keys["other_pub"]).signed_by and load_bundle(path, trust=keys["pub"]).signed_by


def test_a_zipped_bundle_is_signed_in_place(mlp_bundle, keys, tmp_path):
    z = tmp_path / "mlp.zip"
    with zipfile.ZipFile(z, "w") as zf:
        for f in sorted(mlp_bundle.iterdir()):
            zf.write(f, f"mlp/{f.name}")
    with pytest.raises(BundleError, match="unsigned"):
        load_bundle(z, trust=keys["pub"])
    sign_bundle(z, keys["key"])
    assert f"mlp/{SIGNATURE_NAME}" in zipfile.ZipFile(z).namelist()
    assert load_bundle(z, trust=keys["pub"]).signed_by


def _mutations(raw: dict) -> list[tuple[str, object]]:
    """(path, edit) for every top-level field and a few nested ones."""
    def bump(v):
        if isinstance(v, bool):
            return not v
        if isinstance(v, int | float):
            return v + 1
        if isinstance(v, str):
            return v + "x"
        if isinstance(v, list):
            return v + [0]
        if isinstance(v, dict):
            return {**v, "x": 1}
        return 1  # null

    top = [(k, (lambda m, k=k: m.update({k: bump(m[k])}))) for k in raw if k != "integrity"]
    nested = [
        ("graphs.main.outputs", lambda m: m["graphs"]["main"]["outputs"][0].update(shape=["batch", 4])),
        ("graphs.main.file", lambda m: m["graphs"]["main"].update(file="other.onnx")),
        ("postprocess.high", lambda m: m["postprocess"].update(high=[500.0] * 3)),
        ("files.sha256", lambda m: m["files"]["main.onnx"].update(sha256="0" * 64)),
        ("provenance.export", lambda m: m["provenance"]["export"].update(git_commit="feed")),
    ]
    return top + nested


FIELDS = ["schema_version", "family", "name", "rate_hz", "graphs", "preprocess", "postprocess", "certificate",
          "provenance", "extra", "files", "graphs.main.outputs", "graphs.main.file", "postprocess.high",
          "files.sha256", "provenance.export"]


def test_the_parametrized_fields_are_every_top_level_field(mlp_bundle):
    assert sorted(p for p, _ in _mutations(_raw(mlp_bundle)) if "." not in p) == sorted(f for f in FIELDS if "." not in f)


@pytest.mark.parametrize("field", FIELDS)
def test_every_manifest_field_changed_is_refused_under_trust_even_resealed(signed, keys, tmp_path, field):
    path = _copy(signed, tmp_path)
    raw = _raw(path)
    dict(_mutations(raw))[field](raw)
    _write(path, seal_manifest(raw))  # an adversary recomputes the digest: only the signature can tell
    with pytest.raises(BundleError) as err:
        load_bundle(path, trust=keys["pub"])
    msg = str(err.value)
    assert "the manifest changed after signing" in msg or "schema_version" in msg, msg
    if field in ("rate_hz", "postprocess.high", "name"):
        assert f"({field} changed)" in msg  # named from the table the signer signed


def _flip_each_byte(path: Path, rel: str, trusted: TrustedKeys) -> list[int]:
    """Offsets at which flipping one bit of ``rel`` still loads under trust (must be none)."""
    target = path / rel
    data = bytearray(target.read_bytes())
    accepted = []
    try:
        for i in range(len(data)):
            data[i] ^= 0x01
            target.write_bytes(data)
            try:
                load_bundle(path, trust=trusted)
                accepted.append(i)
            except BundleError:
                pass
            data[i] ^= 0x01
    finally:
        target.write_bytes(data)
    return accepted


@pytest.mark.parametrize("rel", ["main.onnx", MANIFEST_NAME, SIGNATURE_NAME])
def test_every_file_byte_changed_is_refused_under_trust(signed, keys, tmp_path, rel):
    path = _copy(signed, tmp_path)
    assert sorted(p.name for p in path.iterdir()) == sorted(["main.onnx", MANIFEST_NAME, SIGNATURE_NAME])
    trusted = TrustedKeys.from_paths([keys["pub"]])
    assert _flip_each_byte(path, rel, trusted) == []
    assert load_bundle(path, trust=trusted).signed_by  # restored: loads again


def test_skipping_checksums_under_trust_is_refused(signed, keys):
    with pytest.raises(BundleError, match="checksums are skipped"):
        load_bundle(signed, verify_checksums=False, trust=keys["pub"])


def test_bad_trust_configurations_are_refused_clearly(keys, tmp_path):
    with pytest.raises(SigningError, match="is a private key"):
        TrustedKeys.from_paths([keys["key"]])
    (tmp_path / "empty").mkdir()
    with pytest.raises(SigningError, match="holds no \\*.pub file"):
        TrustedKeys.from_paths([tmp_path / "empty"])
    with pytest.raises(SigningError, match="no such file"):
        TrustedKeys.from_paths([tmp_path / "nope.pub"])
    (tmp_path / "junk.pub").write_text("not a key")
    with pytest.raises(SigningError, match="not a public key"):
        TrustedKeys.from_paths([tmp_path / "junk.pub"])
    with pytest.raises(SigningError, match="is a public key; signing needs the private key"):
        sign_bundle(tmp_path / "any", keys["pub"])
    with pytest.raises(SigningError, match="already exists"):
        generate_key_pair(keys["key"].with_suffix(""))
    assert oct(keys["key"].stat().st_mode & 0o777) == "0o600"


# --- the CLI -----------------------------------------------------------------------------------------------


def test_cli_keygen_sign_run_and_inspect_with_trust(mlp_bundle, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["keygen"]) == 0
    assert "wrote lab.key" in capsys.readouterr().out and Path("lab.pub").is_file()
    bundle = _copy(mlp_bundle, tmp_path, "b")
    assert main(["run", str(bundle), "--trust", "lab.pub", "--duration", "0.2", "--quiet"]) == 2
    assert "unsigned" in capsys.readouterr().err
    assert main(["sign", str(bundle), "--key", "lab.key"]) == 0
    assert "signed" in capsys.readouterr().out
    assert main(["run", str(bundle), "--trust", "lab.pub", "--duration", "0.5", "--backend", "numba", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(bundle), "--trust", "lab.pub"]) == 0
    assert "signature verified" in capsys.readouterr().out
    assert main(["keygen", "other"]) == 0
    assert main(["inspect", str(bundle), "--trust", "other.pub"]) == 1
    assert "not signed by a trusted key" in capsys.readouterr().out


def test_a_session_runs_a_signed_bundle_under_trust(signed, keys):
    from closedloop.runtime import run_session

    cfg = SessionConfig(device="sim://headstage?channels=6&rate=1000&seed=1", duration_s=0.5, status=False,
                        backend="onnxruntime", trust=[str(keys["folder"])])
    s = run_session(signed, cfg)
    assert s.inputs_used > 50 and s.commands_sent > 50


def test_openssh_ed25519_keys_sign_and_verify(mlp_bundle, tmp_path):
    from cryptography.hazmat.primitives import serialization as ser
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()  # what ssh-keygen -t ed25519 -N '' writes
    (tmp_path / "id_ed25519").write_bytes(key.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.OpenSSH,
                                                            ser.NoEncryption()))
    (tmp_path / "id_ed25519.pub").write_bytes(key.public_key().public_bytes(ser.Encoding.OpenSSH,
                                                                            ser.PublicFormat.OpenSSH) + b" lab\n")
    path = _copy(mlp_bundle, tmp_path)
    sign_bundle(path, tmp_path / "id_ed25519")
    assert load_bundle(path, trust=tmp_path / "id_ed25519.pub").signed_by


def test_keygen_given_a_key_file_name_writes_that_pair(tmp_path):
    key, pub, _ = generate_key_pair(tmp_path / "site.key")
    assert (key.name, pub.name) == ("site.key", "site.pub")
