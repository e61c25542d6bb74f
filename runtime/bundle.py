"""Load and verify a bundle: the only way a model enters the runtime.

``load_bundle`` refuses, with an error naming the file and the problem, a bundle
that misses a file, has a file whose SHA-256 differs from the manifest, has an
unknown schema version, whose graphs' inputs or outputs do not match the manifest,
or whose family plug-in rejects it (for example an observer whose certificate no
longer holds). It also refuses a manifest whose fields changed after export (its
``integrity`` digest, ``closedloop.runtime.integrity``), a listed file that is a symbolic
link or lies outside the bundle folder, and, given trusted keys, a bundle that no
trusted key signed. ``check_bundle`` returns every problem instead of raising on the
first, for ``closedloop inspect``.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from .errors import BundleError
from .integrity import INTEGRITY_FIELD, integrity_problem, manifest_digest
from .manifest import (
    MANIFEST_NAME,
    SUPPORTED_SCHEMA_VERSIONS,
    GraphSpec,
    Manifest,
    TensorSpec,
    loads_manifest,
)
from .onnx_reader import OnnxFormatError, OnnxModel, read_onnx
from .signing import SIGNATURE_NAME, TrustedKeys, TrustSpec, as_trusted_keys, signature_problem


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@dataclass
class Bundle:
    """A verified bundle on disk (a zipped bundle is unpacked to a private temp folder)."""

    root: Path
    manifest: Manifest
    source: Path
    checksums_verified: bool = True
    #: SHA-256 of the manifest's canonical form (None: written before manifests had one)
    digest: str | None = None
    #: id of the trusted key whose signature was verified at load (None: no trust was configured)
    signed_by: str | None = None
    _onnx: dict[str, OnnxModel] = field(default_factory=dict, repr=False)

    def graph(self, name: str = "main") -> GraphSpec:
        try:
            return self.manifest.graphs[name]
        except KeyError:
            raise BundleError(
                f"bundle {self.source}: no graph named {name!r}; it has {sorted(self.manifest.graphs)}"
            ) from None

    def graph_path(self, name: str = "main", variant: str | None = None) -> Path:
        spec = self.graph(name)
        if variant in (None, "fp32"):
            return self.root / spec.file
        if variant not in spec.variants:
            raise BundleError(
                f"bundle {self.source}: graph {name!r} has no variant {variant!r}; it has {sorted(spec.variants) or 'none'}"
            )
        return self.root / spec.variants[variant]["file"]

    def onnx(self, name: str = "main", variant: str | None = None) -> OnnxModel:
        key = f"{name}:{variant or 'fp32'}"
        if key not in self._onnx:
            self._onnx[key] = read_onnx(self.graph_path(name, variant))
        return self._onnx[key]


_TEMP_DIRS: list[str] = []


@atexit.register
def _cleanup_temp_dirs() -> None:
    for d in _TEMP_DIRS:
        shutil.rmtree(d, ignore_errors=True)


def _unpack_zip(path: Path) -> Path:
    tmp = tempfile.mkdtemp(prefix="closedloop-bundle-")
    _TEMP_DIRS.append(tmp)
    try:
        with zipfile.ZipFile(path) as zf:
            names = [i.filename for i in zf.infolist()]
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:  # readers differ on which copy counts (the last one here): none is taken
                raise _Refused(path, f"zip members {twice} appear more than once; a bundle holds each file once "
                                     "(zip the folder again)")
            for info in zf.infolist():
                member = info.filename
                # Refuse path traversal: a bundle is something someone may hand you.
                target = (Path(tmp) / member).resolve()
                if not target.is_relative_to(Path(tmp).resolve()):
                    raise _Refused(path, f"zip member {member!r} escapes the bundle folder")
                if (info.external_attr >> 16) & 0o170000 == 0o120000:  # a symbolic link stored in the zip
                    raise _Refused(path, f"zip member {member!r} is a symbolic link; a bundle's files must be "
                                         "regular files (zip the folder with the files themselves)")
            zf.extractall(tmp)
    except zipfile.BadZipFile as exc:
        raise BundleError(f"bundle {path}: not a readable zip ({exc}); re-export or re-copy it") from exc
    entries = list(Path(tmp).iterdir())
    # A zip may hold the bundle folder itself or its contents.
    if not (Path(tmp) / MANIFEST_NAME).exists() and len(entries) == 1 and entries[0].is_dir():
        return entries[0]
    return Path(tmp)


def _check_tensors(
    where: str, kind: str, declared: list[TensorSpec], actual: list, problems: list[str]
) -> None:
    names_decl = [t.name for t in declared]
    names_act = [v.name for v in actual]
    if names_decl != names_act:
        problems.append(f"{where}: graph {kind}s are {names_act} but the manifest declares {names_decl}")
        return
    for t, v in zip(declared, actual, strict=True):
        if v.dtype is not None and v.dtype != t.dtype:
            problems.append(f"{where}: {kind} {t.name!r} has dtype {v.dtype} in the graph, {t.dtype} in the manifest")
        if len(v.shape) != len(t.shape):
            problems.append(
                f"{where}: {kind} {t.name!r} has rank {len(v.shape)} in the graph ({v.shape}), "
                f"{len(t.shape)} in the manifest ({t.shape})"
            )
            continue
        for i, (dm, dg) in enumerate(zip(t.shape, v.shape, strict=True)):
            if isinstance(dm, int) and isinstance(dg, int) and dm != dg:
                problems.append(
                    f"{where}: {kind} {t.name!r} axis {i} is {dg} in the graph, {dm} in the manifest"
                )
            elif isinstance(dm, int) != isinstance(dg, int) and dg is not None:
                problems.append(
                    f"{where}: {kind} {t.name!r} axis {i} is {dg!r} in the graph, {dm!r} in the manifest "
                    "(one fixed, one dynamic)"
                )


def _check_state_pairs(where: str, spec: GraphSpec, problems: list[str]) -> None:
    outs = {t.name: t for t in spec.outputs}
    ins = {t.name: t for t in spec.inputs}
    for t in spec.state_inputs:
        pair = outs.get(t.state_pair or "")
        if pair is None or not pair.state:
            problems.append(f"{where}: state input {t.name!r} names output {t.state_pair!r}, which is not a state output")
        elif pair.shape != t.shape:
            problems.append(f"{where}: state {t.name!r} has shape {t.shape} but its output {pair.name!r} has {pair.shape}")
    for t in spec.outputs:
        if not t.state:
            continue
        back = ins.get(t.state_pair or "")
        if back is None or not back.state or back.state_pair != t.name:
            problems.append(f"{where}: state output {t.name!r} names input {t.state_pair!r}, which is not the state "
                            f"input it feeds (each state input and output name each other in state_pair)")


def _path_problem(rel: object) -> str | None:
    """Why ``rel`` is not a path inside the bundle (docs/bundle.md: relative POSIX, no ``..``, no ``\\``)."""
    if not isinstance(rel, str) or not rel:
        return f"path {rel!r} is not a non-empty string"
    if rel.startswith("/") or "\\" in rel or ".." in rel.split("/") or (len(rel) > 1 and rel[1] == ":"):
        return (f"path {rel!r} is not a relative POSIX path inside the bundle (no leading '/', no '..', "
                "no backslashes); refusing to read outside the bundle")
    return None


def _referenced_paths(manifest: Manifest) -> list[tuple[str, object]]:
    """Every path the manifest names, with where it is named."""
    out: list[tuple[str, object]] = [("files", rel) for rel in manifest.files]
    for gname, spec in manifest.graphs.items():
        out.append((f"graph {gname!r}", spec.file))
        out += [(f"graph {gname!r} variant {k}", v.get("file")) for k, v in spec.variants.items()]
        out += [(f"graph {gname!r} TensorRT engine {i}", e.get("file")) for i, e in enumerate(spec.tensorrt_engines)
                if isinstance(e, dict)]
    return out


def _link_problem(root: Path, rel: str) -> str | None:
    """Why ``root/rel`` is not a regular file inside the bundle folder: a symbolic link on the way, or outside."""
    here = root
    for part in rel.split("/"):
        here = here / part
        if here.is_symlink():
            what = f"file {rel}" if here == root / rel else f"folder {here.relative_to(root)} (holding file {rel})"
            return (f"{what}: is a symbolic link (to {os.readlink(here)}); a bundle's files must be regular files "
                    "inside its folder: copy the file in instead of linking it")
    if here.exists() and not here.resolve().is_relative_to(root.resolve()):
        return f"file {rel}: resolves to {here.resolve()}, outside the bundle folder; refusing to read it"
    return None


def _collect_problems(root: Path, manifest: Manifest, verify_checksums: bool) -> tuple[list[str], list[str]]:
    problems: list[str] = []
    notes: list[str] = []
    bad_paths = [f"{where}: {why}" for where, rel in _referenced_paths(manifest) if (why := _path_problem(rel))]
    if not bad_paths:
        bad_paths = [why for rel in manifest.files if (why := _link_problem(root, rel))]
    if bad_paths:
        return bad_paths, notes  # nothing outside the bundle is opened, not even to hash it
    if MANIFEST_NAME in manifest.files:
        problems.append(f"files lists {MANIFEST_NAME} itself; the manifest cannot hold its own checksum (its "
                        "integrity block and signature cover it): re-export the bundle")
    failed: set[str] = set()  # files whose size or checksum is wrong: never parsed (their bytes are not the bundle's)
    for rel, meta in manifest.files.items():
        p = root / rel
        if not p.is_file():
            problems.append(f"file {rel}: missing from the bundle (the manifest lists it); re-export the bundle")
            continue
        size = p.stat().st_size
        if meta.get("bytes") is not None and meta.get("bytes") != size:
            problems.append(f"file {rel}: {size} bytes, the manifest says {meta.get('bytes')!r}; the file changed "
                            "after export (truncated, appended or replaced); re-export or restore it")
            failed.add(rel)
            continue
        if not verify_checksums:
            continue
        want = meta.get("sha256")
        got = sha256_file(p)
        if want != got:
            problems.append(
                f"file {rel}: SHA-256 is {got[:16]}..., the manifest says {str(want)[:16]}...; "
                "the file changed after export (corruption or tampering); re-export or restore it"
            )
            failed.add(rel)
    if not verify_checksums:
        notes.append("checksums NOT verified (asked to skip); do not run this bundle on hardware")
    for gname, spec in manifest.graphs.items():
        where = f"graph {gname!r} (file {spec.file})"
        # an engine is deserialised by TensorRT: it must have a checksum like any graph
        files = [spec.file] + [v["file"] for v in spec.variants.values()]
        files += [e.get("file") for e in spec.tensorrt_engines if isinstance(e, dict)]
        for f in files:
            if f not in manifest.files:
                problems.append(f"{where}: file {f} is not listed in the manifest's files, so it has no checksum")
        if spec.kind not in ("recurrent", "feedforward"):
            problems.append(f"{where}: kind {spec.kind!r} is not 'recurrent' or 'feedforward'")
        elif (spec.kind == "recurrent") != bool(spec.state_inputs):
            # the state flags decide what a runtime carries between steps: a recurrent graph without them
            # would run with zero state at every step, a feed-forward one with them would carry state
            problems.append(f"{where}: kind {spec.kind!r} but {len(spec.state_inputs)} state inputs; a recurrent "
                            "graph marks its state tensors (state, state_pair), a feed-forward graph has none")
        _check_state_pairs(where, spec, problems)
        for variant, f in [(None, spec.file)] + [(k, v["file"]) for k, v in spec.variants.items()]:
            path = root / f
            if not path.is_file() or f in failed:
                continue
            try:
                model = read_onnx(path)
            except OnnxFormatError as exc:
                problems.append(f"{where}: {exc}")
                continue
            w = where if variant is None else f"{where} variant {variant} (file {f})"
            _check_tensors(w, "input", spec.inputs, model.graph_inputs(), problems)
            _check_tensors(w, "output", spec.outputs, model.outputs, problems)
    return problems, notes


class _Refused(BundleError):
    """A refusal found before the manifest is parsed (its digest, its signature); ``problem`` is the one line."""

    def __init__(self, source: Path, problem: str):
        super().__init__(f"bundle {source} refused:\n  - {problem}")
        self.problem = problem


def _read_raw(root: Path, source: Path) -> tuple[dict, str]:
    """``manifest.json`` as its JSON object, with its digest checked, and the SHA-256 of its bytes (both signed)."""
    mpath = root / MANIFEST_NAME
    if mpath.is_symlink():
        raise BundleError(f"bundle {source}: {MANIFEST_NAME} is a symbolic link (to {os.readlink(mpath)}); a bundle's "
                          "files must be regular files inside its folder")
    if not mpath.is_file():
        raise BundleError(
            f"bundle {source}: {MANIFEST_NAME} is missing; this is not a bundle or it was not written completely"
        )
    data = mpath.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BundleError(f"bundle {source}: {MANIFEST_NAME} is not UTF-8 ({exc}); the bundle is damaged, "
                          "re-export it") from exc
    raw = loads_manifest(text, f"{source}/{MANIFEST_NAME}")
    # the digest before the other checks (an edited field is named as edited, not as whatever else it breaks),
    # but after the schema version: a manifest of a version this reader does not know is refused as that
    if _known_version(raw) and (why := integrity_problem(raw)):
        raise _Refused(source, f"{MANIFEST_NAME}: {why}")
    return raw, hashlib.sha256(data).hexdigest()


def _known_version(raw: object) -> bool:
    return isinstance(raw, dict) and type(raw.get("schema_version")) is int \
        and raw["schema_version"] in SUPPORTED_SCHEMA_VERSIONS


def _read_manifest(root: Path, source: Path) -> Manifest:
    return Manifest.from_dict(_read_raw(root, source)[0], source=f"{source}/{MANIFEST_NAME}")


# files people hand over as "the model" that are not bundles, and what each is
_MODEL_FILES = {".onnx": "an ONNX model", ".pt": "a torch file", ".pth": "a torch file", ".pt2": "a torch.export program",
                ".ckpt": "a training checkpoint", ".safetensors": "a weights file"}


def _open(path: str | Path) -> tuple[Path, Path]:
    source = Path(path)
    if not source.exists():
        raise BundleError(f"bundle {source}: no such file or folder")
    what = _MODEL_FILES.get(source.suffix.lower()) if source.is_file() else None
    if what is not None:
        make = ("import it with closedloop import-onnx FILE OUT --rate HZ (closedloop.import_onnx in Python)"
                if source.suffix.lower() == ".onnx" else
                "make one from the torch module with closedloop.export_bundle(module, out, ...)")
        raise BundleError(f"bundle {source}: this is {what}, not a bundle (a folder or zip with manifest.json); "
                          f"{make} (docs/workflow.md)")
    if source.is_file() and source.name == MANIFEST_NAME:
        raise BundleError(f"bundle {source}: this is a bundle's manifest; give the folder that holds it, "
                          f"{source.parent}")
    root = _unpack_zip(source) if source.is_file() else source
    return root, source


def _signer(root: Path, source: Path, raw: dict, raw_sha: str, trusted: TrustedKeys | None, verify_checksums: bool,
            notes: list[str]) -> str | None:
    """The id of the trusted key that signed the bundle; ``BundleError`` if none did. Without trust, a note."""
    if trusted is None:
        if (root / SIGNATURE_NAME).is_file():
            notes.append(f"{SIGNATURE_NAME} present, not checked: no trusted keys given (--trust)")
        elif INTEGRITY_FIELD not in raw:
            notes.append("no manifest digest (written before closedloop had one): field edits cannot be detected")
        return None
    problem, key = signature_problem(root, raw, raw_sha, trusted) if _known_version(raw) else (None, None)
    if not verify_checksums:
        problem = ("trusted keys were given but checksums are skipped: a signature vouches for the files only "
                   "through their checksums; run with trust, or skip checksums without it")
    if problem:  # refused before anything else is read: nothing in an untrusted manifest is worth parsing
        raise _Refused(source, problem)
    if key is not None:
        notes.append(f"signed by {key.describe()}: signature verified")
    return key.key_id if key else None


def _verify(root: Path, source: Path, verify_checksums: bool,
            trusted: TrustedKeys | None) -> tuple[Bundle, list[str], list[str]]:
    """Check an opened bundle: manifest digest, signature (under trust), files, graphs, then the family."""
    raw, raw_sha = _read_raw(root, source)
    notes: list[str] = []
    signed_by = _signer(root, source, raw, raw_sha, trusted, verify_checksums, notes)
    manifest = Manifest.from_dict(raw, source=f"{source}/{MANIFEST_NAME}")
    problems, more = _collect_problems(root, manifest, verify_checksums)
    bundle = Bundle(root=root, manifest=manifest, source=source, checksums_verified=verify_checksums,
                    digest=manifest_digest(raw) if INTEGRITY_FIELD in raw else None, signed_by=signed_by)
    if not problems:
        from .families import family_problems  # local: families import the session machinery

        problems = family_problems(bundle)
    return bundle, problems, notes + more


def check_bundle(path: str | Path, verify_checksums: bool = True,
                 trust: TrustSpec = None) -> tuple[Manifest | None, list[str], list[str]]:
    """Return ``(manifest, problems, notes)`` without raising for the bundle's own faults.

    ``trust``: public key files or folders of them (``TrustedKeys``); the bundle must then be
    signed by one of them. A bad key file raises ``SigningError``.
    """
    trusted = as_trusted_keys(trust)  # a bad key file is the caller's fault: raised, not listed
    try:
        root, source = _open(path)  # a path that is no bundle at all raises; a refused zip is listed
    except _Refused as exc:
        return None, [exc.problem], []
    try:
        bundle, problems, notes = _verify(root, source, verify_checksums, trusted)
    except _Refused as exc:
        return None, [exc.problem], []
    except BundleError as exc:
        return None, [str(exc)], []
    return bundle.manifest, problems, notes


def load_bundle(path: str | Path, verify_checksums: bool = True, trust: TrustSpec = None) -> Bundle:
    """Load a bundle folder or zip and verify it; raise ``BundleError`` naming every problem.

    ``verify_checksums=False`` exists only for fault-injection studies that model
    corruption in memory; such a bundle says so in ``Bundle.checksums_verified``.
    ``trust``: public key files or folders of ``*.pub`` files (or ``TrustedKeys``); a bundle
    not signed by one of them is refused (docs/bundle.md, "Signatures and integrity").
    """
    trusted = as_trusted_keys(trust)
    root, source = _open(path)
    bundle, problems, _notes = _verify(root, source, verify_checksums, trusted)
    if problems:
        raise BundleError(f"bundle {bundle.source} refused:\n  - " + "\n  - ".join(problems))
    return bundle


def ensure_trusted(bundle: Bundle, trust: TrustSpec) -> Bundle:
    """Return ``bundle`` if ``trust`` is empty or one of its keys signed it; else raise ``BundleError``.

    For a bundle loaded earlier (``Model(bundle, trust=...)``): a bundle loaded under the same
    keys passes at once; any other is checked now, and its manifest must still be the one loaded.
    """
    trusted = as_trusted_keys(trust)
    if trusted is None or (bundle.signed_by is not None and trusted.find(bundle.signed_by) is not None):
        return bundle
    raw, raw_sha = _read_raw(bundle.root, bundle.source)
    key = _signer(bundle.root, bundle.source, raw, raw_sha, trusted, bundle.checksums_verified, [])
    if bundle.digest is None or manifest_digest(raw) != bundle.digest:
        raise _Refused(bundle.source, f"{MANIFEST_NAME} changed on disk since the bundle was loaded; load it again")
    bundle.signed_by = key
    return bundle
