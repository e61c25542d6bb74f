"""Ed25519 bundle signatures: a board runs only what its lab signed.

``sign_bundle`` signs a bundle with a lab's private key into ``manifest.sig``: the manifest
digest (``closedloop.runtime.integrity``, which covers every field and, through ``files``, every
file's SHA-256 and size) and the SHA-256 of ``manifest.json``'s exact bytes. A reader given
``TrustedKeys`` (public key files, or folders of ``*.pub`` files) refuses a bundle that no trusted
key signed, naming what differs. ``closedloop.runtime.bundle`` calls ``signature_problem``;
``closedloop keygen``, ``sign`` and ``--trust`` are the CLI. Formats and the threat model:
docs/bundle.md, "Signatures and integrity". No torch; ``cryptography`` is imported only to make,
sign or verify with a key.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import tempfile
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from closedloop.common.atomic import atomic_write_bytes

from .errors import BundleError
from .integrity import INTEGRITY_FIELD, changed_fields, field_digests, manifest_digest, seal_manifest

SIGNATURE_NAME = "manifest.sig"
SIGNATURE_FORMAT = "closedloop-bundle-signature"
SIGNATURE_VERSION = 1
SIGNATURE_ALGORITHM = "ed25519"
#: Prefixed to what is signed, so a bundle signature cannot pass for a signature over anything else
#: made with the same key.
SIGNATURE_CONTEXT = b"closedloop-bundle-manifest-v1\x00"
_ENTRY_KEYS = {"algorithm", "key_id", "digest", "manifest_sha256", "signature", "fields"}
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)


class SigningError(ValueError):
    """A key file, a trusted-keys folder or a signing request is unusable (not: a bundle was refused)."""


# --- keys -----------------------------------------------------------------------------------------


def _crypto():
    try:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError as exc:  # a runtime dependency; said plainly if a board lacks it
        raise SigningError("bundle signatures need the 'cryptography' package: pip install cryptography") from exc
    return ed25519, serialization, InvalidSignature


def key_id(public_raw: bytes) -> str:
    """A public key's id: the first 16 hex digits of SHA-256 over its 32 raw bytes."""
    return hashlib.sha256(public_raw).hexdigest()[:16]


@dataclass(frozen=True)
class TrustedKey:
    """One public key a board trusts, with the file it came from."""

    key_id: str
    public_raw: bytes
    source: str

    def describe(self) -> str:
        return f"key {self.key_id} ({self.source})"


def _public_raw(key: Any) -> bytes:
    _ed, ser, _ = _crypto()
    return key.public_bytes(ser.Encoding.Raw, ser.PublicFormat.Raw)


def read_public_key(path: str | Path) -> TrustedKey:
    """Read an Ed25519 public key: PEM ``PUBLIC KEY`` (SubjectPublicKeyInfo) or an OpenSSH ``ssh-ed25519`` line."""
    ed, ser, _ = _crypto()
    path = Path(path)
    data = path.read_bytes()
    if b"PRIVATE KEY" in data:
        raise SigningError(f"{path} is a private key; a board is given only public keys (the .pub file that "
                           "closedloop keygen wrote next to it)")
    try:
        key = ser.load_ssh_public_key(data) if data.lstrip().startswith(b"ssh-") else ser.load_pem_public_key(data)
    except (ValueError, TypeError) as exc:
        raise SigningError(f"{path} is not a public key in PEM (-----BEGIN PUBLIC KEY-----) or OpenSSH form "
                           f"({exc}); make one with closedloop keygen") from None
    if not isinstance(key, ed.Ed25519PublicKey):
        raise SigningError(f"{path} holds a {type(key).__name__}, not an Ed25519 public key; make one with "
                           "closedloop keygen")
    raw = _public_raw(key)
    return TrustedKey(key_id(raw), raw, str(path))


def read_private_key(path: str | Path) -> Any:
    """Read an Ed25519 private key: unencrypted PEM PKCS#8 (what ``keygen`` writes) or OpenSSH."""
    ed, ser, _ = _crypto()
    path = Path(path)
    if not path.is_file():
        raise SigningError(f"private key {path}: no such file (make a key pair with closedloop keygen NAME)")
    data = path.read_bytes()
    if b"PUBLIC KEY" in data or data.lstrip().startswith(b"ssh-"):
        raise SigningError(f"{path} is a public key; signing needs the private key (NAME.key from closedloop keygen)")
    try:
        if b"OPENSSH PRIVATE KEY" in data:
            key = ser.load_ssh_private_key(data, password=None)
        else:
            key = ser.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise SigningError(f"{path} is not an unencrypted private key in PEM (-----BEGIN PRIVATE KEY-----) or "
                           f"OpenSSH form ({exc}); make one with closedloop keygen") from None
    if not isinstance(key, ed.Ed25519PrivateKey):
        raise SigningError(f"{path} holds a {type(key).__name__}, not an Ed25519 private key; make one with "
                           "closedloop keygen")
    return key


def generate_key_pair(prefix: str | Path, *, overwrite: bool = False) -> tuple[Path, Path, str]:
    """Write ``PREFIX.key`` (private, mode 0600) and ``PREFIX.pub``; return both paths and the key id."""
    ed, ser, _ = _crypto()
    prefix = Path(prefix)
    if prefix.suffix in (".key", ".pub"):  # "keygen lab.key" means the pair lab.key / lab.pub, not lab.key.key
        prefix = prefix.with_suffix("")
    key_path, pub_path = prefix.with_name(prefix.name + ".key"), prefix.with_name(prefix.name + ".pub")
    for p in (key_path, pub_path):
        if p.exists() and not overwrite:
            raise SigningError(f"{p} already exists; choose another name, or pass --force to replace the key pair "
                               "(bundles signed with the old key will no longer verify against the new one)")
    key = ed.Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.PKCS8, ser.NoEncryption())
    public_pem = key.public_key().public_bytes(ser.Encoding.PEM, ser.PublicFormat.SubjectPublicKeyInfo)
    key_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(key_path, private_pem, mode=0o600)
    atomic_write_bytes(pub_path, public_pem, mode=0o644)
    return key_path, pub_path, key_id(_public_raw(key.public_key()))


class TrustedKeys:
    """The public keys a board trusts: key files, and every ``*.pub`` file of a folder.

    >>> TrustedKeys([]).key_ids
    []
    """

    def __init__(self, keys: Iterable[TrustedKey]):
        self.keys: tuple[TrustedKey, ...] = tuple(keys)

    @classmethod
    def from_paths(cls, paths: Iterable[str | Path]) -> TrustedKeys:
        """Read each path: a key file, or a folder whose ``*.pub`` files are read (a folder with none is refused)."""
        keys: list[TrustedKey] = []
        for p in (Path(x) for x in paths):
            if p.is_dir():
                found = sorted(f for f in p.glob("*.pub") if f.is_file())  # a folder named x.pub is no key
                if not found:
                    raise SigningError(f"trusted-keys folder {p} holds no *.pub file, so it would refuse every bundle; "
                                       "copy the lab's public key (NAME.pub from closedloop keygen) into it")
                keys += [read_public_key(f) for f in found]
            elif p.is_file():
                keys.append(read_public_key(p))
            else:
                raise SigningError(f"trusted key {p}: no such file or folder")
        return cls(keys)

    @property
    def key_ids(self) -> list[str]:
        return [k.key_id for k in self.keys]

    def find(self, kid: str) -> TrustedKey | None:
        return next((k for k in self.keys if k.key_id == kid), None)

    def describe(self) -> str:
        return ", ".join(k.describe() for k in self.keys) or "none"


TrustSpec = TrustedKeys | str | Path | Sequence[str | Path] | None


def as_trusted_keys(trust: TrustSpec) -> TrustedKeys | None:
    """``trust`` as keys: None or an empty list means no trust configured (unsigned bundles load)."""
    if trust is None or isinstance(trust, TrustedKeys):
        return trust
    paths = [trust] if isinstance(trust, str | Path) else list(trust)
    return TrustedKeys.from_paths(paths) if paths else None


# --- signatures -----------------------------------------------------------------------------------


def signed_message(digest: str, manifest_sha256: str) -> bytes:
    """The bytes an Ed25519 signature covers: context, manifest digest, SHA-256 of manifest.json (raw, 64 bytes)."""
    return SIGNATURE_CONTEXT + bytes.fromhex(digest) + bytes.fromhex(manifest_sha256)


def read_signatures(path: Path) -> list[dict[str, Any]]:
    """The entries of a ``manifest.sig`` file; ``BundleError`` if it is not one, exactly."""
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in pairs]
        if len(set(keys)) != len(keys):  # which copy a reader keeps differs between JSON libraries
            raise json.JSONDecodeError(f"duplicate key {sorted({k for k in keys if keys.count(k) > 1})}", "", 0)
        return dict(pairs)

    try:
        doc = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BundleError(f"{SIGNATURE_NAME} is not UTF-8 JSON ({exc}); the signature file was altered or damaged: "
                          "sign the bundle again") from None
    if not isinstance(doc, dict) or set(doc) != {"format", "version", "signatures"} \
            or doc["format"] != SIGNATURE_FORMAT or doc["version"] != SIGNATURE_VERSION \
            or not isinstance(doc["signatures"], list) or not all(isinstance(s, dict) for s in doc["signatures"]):
        raise BundleError(f"{SIGNATURE_NAME} is not a {SIGNATURE_FORMAT!r} version {SIGNATURE_VERSION} file (format, "
                          "version, signatures); it was altered, or written by another version: sign the bundle again")
    return doc["signatures"]


def _entry_problem(s: dict[str, Any], trusted: TrustedKeys, digest: str, raw_sha: str,
                   manifest: dict[str, Any]) -> tuple[str | None, TrustedKey | None]:
    """Why one signature entry does not vouch for this manifest under ``trusted`` (or the key it verifies with)."""
    ed, _ser, invalid = _crypto()
    kid = str(s.get("key_id"))
    key = trusted.find(kid)
    if set(s) != _ENTRY_KEYS or s["algorithm"] != SIGNATURE_ALGORITHM:
        return (f"the signature entry of key {kid} is not an {SIGNATURE_ALGORITHM} entry with exactly "
                f"{sorted(_ENTRY_KEYS)}: {SIGNATURE_NAME} was altered"), None
    if key is None:
        return f"signed by key {kid}, which is not trusted here", None
    if s["digest"] != digest:
        fields = s["fields"] if isinstance(s["fields"], dict) else {}
        changes = changed_fields(fields, field_digests(manifest))
        return (f"key {kid} signed manifest digest {str(s['digest'])[:16]}..., but the manifest's digest is "
                f"{digest[:16]}...: the manifest changed after signing" + (f" ({', '.join(changes)})" if changes else "")), None
    if s["manifest_sha256"] != raw_sha:
        return (f"key {kid} signed manifest.json with SHA-256 {str(s['manifest_sha256'])[:16]}..., but its bytes now "
                f"hash to {raw_sha[:16]}... (same fields and values: reformatted or re-serialised after signing); "
                "sign the bundle again"), None
    try:
        sig = base64.b64decode(str(s["signature"]), validate=True)
        if base64.b64encode(sig).decode("ascii") != s["signature"]:  # one signature, one spelling
            raise ValueError("not canonical base64")
        ed.Ed25519PublicKey.from_public_bytes(key.public_raw).verify(sig, signed_message(digest, raw_sha))
    except (invalid, ValueError):
        return f"the signature by {key.describe()} does not verify: {SIGNATURE_NAME} was altered or forged", None
    if s["fields"] != field_digests(manifest):
        return f"the field table of the signature by {key.describe()} does not match the manifest: it was altered", None
    return None, key


def signature_problem(root: Path, manifest: dict[str, Any], manifest_sha256: str,
                      trusted: TrustedKeys) -> tuple[str | None, TrustedKey | None]:
    """``(problem, None)``, or ``(None, the trusted key whose signature holds)``, for a bundle under trust.

    ``manifest`` is ``manifest.json`` parsed and ``manifest_sha256`` the SHA-256 of its bytes.
    """
    if not isinstance(manifest.get(INTEGRITY_FIELD), dict):
        return ("unsigned: the manifest has no integrity digest (written before closedloop had one, or by hand), "
                "and a board with trusted keys runs only signed bundles; sign it: closedloop sign BUNDLE --key LAB.key "
                "(which adds the digest; check the bundle is the one you mean to vouch for first)"), None
    sig_path = root / SIGNATURE_NAME
    if sig_path.is_symlink():
        return f"{SIGNATURE_NAME} is a symbolic link; a bundle's files must be regular files inside its folder", None
    if sig_path.exists() and not sig_path.is_file():
        return (f"{SIGNATURE_NAME} is not a regular file (a folder or a device); a bundle's files must be regular "
                "files: remove it and sign the bundle again"), None
    if not sig_path.is_file():
        return (f"unsigned: no {SIGNATURE_NAME}, and a board with trusted keys ({trusted.describe()}) runs only signed "
                "bundles; sign it: closedloop sign BUNDLE --key LAB.key"), None
    try:
        entries = read_signatures(sig_path)
    except BundleError as exc:
        return str(exc), None
    digest = manifest_digest(manifest)
    why = []
    for s in entries:
        problem, key = _entry_problem(s, trusted, digest, manifest_sha256, manifest)
        if key is not None:
            return None, key
        why.append(problem)
    why = why or [f"{SIGNATURE_NAME} holds no signature"]
    # a trusted key's signature that does not hold means the bundle or the signature changed: not a key to trust
    tampered = any(trusted.find(str(s.get("key_id"))) is not None for s in entries)
    advice = ("a trusted key's signature does not hold, so the bundle or its signature changed after signing: "
              "restore the bundle from the lab's copy (or re-sign it there after checking it)" if tampered else
              "sign the bundle with a trusted key, or trust its signer's public key")
    return (f"not signed by a trusted key: {'; '.join(str(w) for w in why)}. Trusted: {trusted.describe()}; "
            f"{advice}"), None


@dataclass
class SignResult:
    """What ``sign_bundle`` did."""

    bundle: Path
    key_id: str
    digest: str
    signature_file: str
    sealed: bool  # the manifest had no digest and one was added
    kept: int  # other keys' signatures kept


def _signature_entry(key: Any, manifest: dict[str, Any], manifest_sha256: str) -> dict[str, Any]:
    digest = manifest_digest(manifest)
    return {"algorithm": SIGNATURE_ALGORITHM, "key_id": key_id(_public_raw(key.public_key())), "digest": digest,
            "manifest_sha256": manifest_sha256,
            "signature": base64.b64encode(key.sign(signed_message(digest, manifest_sha256))).decode("ascii"),
            "fields": field_digests(manifest)}


def _signature_file(entries: list[dict[str, Any]]) -> bytes:
    doc = {"format": SIGNATURE_FORMAT, "version": SIGNATURE_VERSION, "signatures": entries}
    return (json.dumps(doc, indent=2) + "\n").encode("utf-8")


def _merge(old: list[dict[str, Any]], new: dict[str, Any]) -> list[dict[str, Any]]:
    """Keep other keys' signatures over the same digest (co-signing); drop stale ones and this key's old one."""
    return [s for s in old if s.get("digest") == new["digest"] and s.get("key_id") != new["key_id"]] + [new]


def sign_bundle(path: str | Path, key_file: str | Path) -> SignResult:
    """Sign the bundle at ``path`` (folder or zip) with ``key_file``, writing ``manifest.sig`` into it.

    The bundle is verified first (checksums, schema, graphs, family: the same as ``load_bundle``);
    a bundle written before manifests had a digest gets one. Other keys' signatures over the same
    manifest are kept. Files are replaced atomically.
    """
    from .bundle import load_bundle

    key = read_private_key(key_file)
    path = Path(path)
    bundle = load_bundle(path)  # refuse to vouch for a bundle the runtime would refuse
    text = (bundle.root / "manifest.json").read_bytes()
    raw = json.loads(text)
    sealed = INTEGRITY_FIELD not in raw
    if sealed:
        text = (json.dumps(seal_manifest(raw), indent=2) + "\n").encode("utf-8")
    old: list[dict[str, Any]] = []
    sig_path = bundle.root / SIGNATURE_NAME
    if sig_path.exists() and not sig_path.is_file() and not sig_path.is_symlink():
        raise SigningError(f"{sig_path} is not a regular file (a folder or a device): remove it, then sign again")
    if sig_path.is_file() and not sealed:
        try:
            old = read_signatures(sig_path)
        except BundleError:
            old = []  # a damaged signature file is replaced
    entry = _signature_entry(key, raw, hashlib.sha256(text).hexdigest())
    entries = _merge(old, entry)
    updates = {SIGNATURE_NAME: _signature_file(entries)}
    if sealed:
        updates["manifest.json"] = text
    if path.is_file():
        _rewrite_zip(path, updates)
    else:
        for name, data in updates.items():  # the manifest first: a signature never precedes what it signs
            atomic_write_bytes(path / name, data, mode=0o644)
    return SignResult(path, entry["key_id"], entry["digest"], SIGNATURE_NAME, sealed, len(entries) - 1)


def _rewrite_zip(path: Path, updates: dict[str, bytes]) -> None:
    """Replace or add members (next to ``manifest.json``, wherever the zip keeps it), atomically."""
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
        manifest = next(n for n in names if n == "manifest.json" or n.endswith("/manifest.json"))
        prefix = manifest[: -len("manifest.json")]
        members = {n: zf.read(n) for n in names if not n.endswith("/")}
    for name, data in updates.items():
        members[prefix + name] = data
    buf = Path(tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)[1])
    try:
        with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as out:
            for name in sorted(members):
                info = zipfile.ZipInfo(name, date_time=_ZIP_DATE)
                info.compress_type = zipfile.ZIP_DEFLATED
                info.external_attr = 0o644 << 16
                out.writestr(info, members[name])
        with open(buf, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(buf, 0o644)
        os.replace(buf, path)
    except BaseException:
        buf.unlink(missing_ok=True)
        raise


__all__ = ["SIGNATURE_NAME", "SIGNATURE_CONTEXT", "SigningError", "TrustedKey", "TrustedKeys", "TrustSpec", "SignResult",
           "key_id", "read_public_key", "read_private_key", "generate_key_pair", "as_trusted_keys", "signed_message",
           "read_signatures", "signature_problem", "sign_bundle", "seal_manifest", "manifest_digest"]
