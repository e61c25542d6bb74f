"""The manifest digest: a reader refuses a manifest whose fields changed after export, naming them.

Every bundle's ``manifest.json`` carries an ``integrity`` block (written by ``export``): the
SHA-256 of the manifest's canonical form (``canonical_manifest``: JSON with sorted keys, no
whitespace, UTF-8, the ``integrity`` field itself left out) and a short digest per field, down to
``FIELD_DEPTH`` keys, so that a changed field can be named. This stops accidents and careless
edits (the outside test's 51 Hz ``rate_hz``, +-500 command limits, 1e300 tolerances); an
adversary can recompute it, which only a signature (``closedloop.runtime.signing``) stops.
``closedloop.runtime.bundle`` calls ``integrity_problem`` on every load. Formats: docs/bundle.md,
"Signatures and integrity". Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

INTEGRITY_FIELD = "integrity"
#: The name of the canonical form, recorded in the integrity block (docs/bundle.md).
CANONICAL_FORM = "json-sorted-compact-utf8"
DIGEST_ALGORITHM = "sha256"
#: Per-field digests go this many keys deep (``graphs.main.outputs[0]`` is four).
FIELD_DEPTH = 4
FIELD_DIGEST_HEX = 16

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*\Z")
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")


#: Why a string with a lone surrogate has no canonical form (the manifest reader and the writers say it).
LONE_SURROGATE = ("holds a string with a lone surrogate (a \\uD800-\\uDFFF escape that is not half of a pair), "
                  "which is not Unicode text and has no UTF-8 form, so the manifest has no canonical form to digest "
                  "or sign")


def canonical_json(value: Any) -> bytes:
    """JSON with sorted keys, no whitespace, non-ASCII as UTF-8 (Python's ``json.dumps`` number forms).

    Raises ``ValueError`` for a string that is not Unicode text (a lone surrogate): strict UTF-8 has no bytes for it.
    """
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"the manifest {LONE_SURROGATE}; replace that character") from None


def canonical_manifest(manifest: dict[str, Any]) -> bytes:
    """The bytes the manifest digest hashes: the manifest without its ``integrity`` block, canonical."""
    return canonical_json({k: v for k, v in manifest.items() if k != INTEGRITY_FIELD})


def manifest_digest(manifest: dict[str, Any]) -> str:
    """SHA-256 (lowercase hex) of ``canonical_manifest``: covers every field, every file's SHA-256 and size."""
    return hashlib.sha256(canonical_manifest(manifest)).hexdigest()


def _path_part(key: str) -> str:
    return key if _IDENT.match(key) else "[" + json.dumps(key, ensure_ascii=False) + "]"


def _join(path: str, key: str) -> str:
    part = _path_part(key)
    return part if not path else (path + part if part.startswith("[") else f"{path}.{part}")


def field_digests(manifest: dict[str, Any]) -> dict[str, str]:
    """Path -> short digest of the value, for every field down to ``FIELD_DEPTH`` keys.

    Objects are entered key by key and arrays of objects element by element (``graphs.main.outputs[0]``);
    other arrays (matrices, channel lists) are one field. Only for naming a changed field: the
    manifest digest alone decides.
    """
    out: dict[str, str] = {}

    def visit(path: str, value: Any, depth: int) -> None:
        out[path] = hashlib.sha256(canonical_json(value)).hexdigest()[:FIELD_DIGEST_HEX]
        if depth >= FIELD_DEPTH:
            return
        if isinstance(value, dict):
            for k, v in value.items():
                visit(_join(path, str(k)), v, depth + 1)
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for i, v in enumerate(value):
                visit(f"{path}[{i}]", v, depth + 1)

    for key, value in manifest.items():
        if key != INTEGRITY_FIELD:
            visit(_join("", str(key)), value, 1)
    return out


def integrity_block(manifest: dict[str, Any]) -> dict[str, Any]:
    """The ``integrity`` block a writer stores for ``manifest``."""
    return {"algorithm": DIGEST_ALGORITHM, "canonical": CANONICAL_FORM, "digest": manifest_digest(manifest),
            "fields": field_digests(manifest)}


def seal_manifest(manifest: dict[str, Any]) -> dict[str, Any]:
    """Store a fresh ``integrity`` block in ``manifest`` (a JSON dict, changed in place) and return it.

    The exporter does this; call it yourself only after a deliberate edit of a manifest by hand
    (an edited bundle is refused until it is resealed, and is no longer signed).
    """
    manifest.pop(INTEGRITY_FIELD, None)
    manifest[INTEGRITY_FIELD] = integrity_block(manifest)
    return manifest


def _descends(path: str, ancestor: str) -> bool:
    return path.startswith(ancestor) and len(path) > len(ancestor) and path[len(ancestor)] in ".["


def changed_fields(stored: dict[str, str], current: dict[str, str]) -> list[str]:
    """The most specific fields whose digests differ, each with what happened, in path order.

    ``["rate_hz changed", "extra.robust.tolerance changed", "evil added"]``: a changed field is
    named at the deepest level the table reaches; an added or removed subtree by its top.
    """
    differ = sorted(p for p in stored.keys() | current.keys() if stored.get(p) != current.get(p))
    out = []
    for p in differ:
        if p not in stored:
            if any(_descends(p, q) and q not in stored for q in differ):
                continue
            out.append(f"{p} added")
        elif p not in current:
            if any(_descends(p, q) and q not in current for q in differ):
                continue
            out.append(f"{p} removed")
        elif not any(_descends(q, p) for q in differ):
            out.append(f"{p} changed")
    return out


def integrity_problem(manifest: dict[str, Any]) -> str | None:
    """Why the manifest's ``integrity`` block does not hold (None: it holds, or there is none).

    A manifest written before the digest existed has no block: nothing to check here (under
    trust it is refused as unsigned). The message names the changed fields.
    """
    block = manifest.get(INTEGRITY_FIELD)
    if block is None:
        return None
    if not isinstance(block, dict) or not isinstance(block.get("digest"), str) \
            or not isinstance(block.get("fields"), dict):
        return (f"{INTEGRITY_FIELD} is not an object with a digest and fields ({str(block)[:60]!r}); the manifest was "
                "edited or damaged: re-export the bundle")
    if block.get("algorithm") != DIGEST_ALGORITHM or block.get("canonical") != CANONICAL_FORM:
        return (f"{INTEGRITY_FIELD} uses algorithm {block.get('algorithm')!r} over form {block.get('canonical')!r}; this "
                f"runtime checks {DIGEST_ALGORITHM!r} over {CANONICAL_FORM!r}: upgrade closedloop or re-export the bundle")
    digest, stored = manifest_digest(manifest), block["fields"]
    current = field_digests(manifest)
    if not _HEX64.match(block["digest"]):
        return (f"{INTEGRITY_FIELD}.digest is {block['digest'][:70]!r}, not 64 lowercase hex digits (a SHA-256); the "
                "integrity block was edited or damaged: re-export the bundle or restore its manifest.json")
    if digest != block["digest"]:
        changes = changed_fields(stored, current) or [
            f"no field's digest differs, so {INTEGRITY_FIELD}.digest itself was edited"]
        return (f"manifest field(s) changed after export: {', '.join(changes)} (manifest digest {digest[:16]}..., "
                f"recorded {str(block['digest'])[:16]}...); an edited or corrupted manifest is refused: re-export the "
                "bundle or restore its manifest.json")
    if stored != current:
        entries = [f"{p}: {'no entry' if p not in stored else 'an entry for no field' if p not in current else 'entry differs'}"
                   for p in sorted(stored.keys() | current.keys()) if stored.get(p) != current.get(p)]
        return (f"{INTEGRITY_FIELD}.fields does not match the manifest, whose fields match its digest "
                f"({'; '.join(entries[:8])}{'; ...' if len(entries) > 8 else ''}): the table itself was edited or "
                "damaged; re-export the bundle or restore its manifest.json")
    return None


__all__ = ["INTEGRITY_FIELD", "CANONICAL_FORM", "FIELD_DEPTH", "canonical_json", "canonical_manifest", "manifest_digest",
           "field_digests", "integrity_block", "seal_manifest", "changed_fields", "integrity_problem"]
