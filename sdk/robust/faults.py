"""Bit flips in stored weights: random draws, applying them, and corrupted bundle copies.

A flip is ``(initializer, flat index, bit)`` in the ONNX layout of one graph file
(bit 0 is the least significant bit of the stored word: fp32 bits 23-30 are the
exponent and 31 the sign; fp16 10-14 and 15; int8 7 is the sign). ``inject_faults``
writes a copy of a bundle with flipped weights in one graph file and the manifest left
as it was, so the copy fails its SHA-256 check: loading it needs
``load_bundle(..., verify_checksums=False)``, which models faults that happen in memory
after a verified load. The flips are listed in ``faults.json`` beside the manifest.
"""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from closedloop.common.jsonout import write_json
from closedloop.runtime.bundle import load_bundle

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@dataclass(frozen=True)
class BitFlip:
    tensor: str
    index: int
    bit: int


def weight_tensors(initializers: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The initializers a memory fault can hit: float and int8 weights (not int64 shape constants)."""
    return {k: v for k, v in initializers.items() if v.dtype.kind == "f" or v.dtype == np.int8}


def random_flips(initializers: dict[str, np.ndarray], n: int, seed: int = 0,
                 names: list[str] | None = None) -> list[BitFlip]:
    """``n`` distinct bit positions drawn uniformly over every bit of the weight tensors (or ``names``)."""
    w = weight_tensors(initializers)
    names = sorted(w) if names is None else list(names)
    bits = np.array([w[k].size * w[k].itemsize * 8 for k in names], dtype=np.int64)
    total = int(bits.sum())
    rng = np.random.default_rng(seed)
    picks = rng.choice(total, size=min(n, total), replace=False)
    edges = np.cumsum(bits)
    out = []
    for g in np.sort(picks):
        t = int(np.searchsorted(edges, g, side="right"))
        local = int(g - (edges[t] - bits[t]))
        width = w[names[t]].itemsize * 8
        out.append(BitFlip(names[t], local // width, local % width))
    return out


def apply_flips(initializers: dict[str, np.ndarray], flips: list[BitFlip]) -> dict[str, np.ndarray]:
    """Copies of the touched initializers with the flips applied (the input is left alone)."""
    out: dict[str, np.ndarray] = {}
    for f in flips:
        if f.tensor not in out:
            out[f.tensor] = np.array(initializers[f.tensor], copy=True)
        a = out[f.tensor].reshape(-1)
        words = a.view(_UINT[a.itemsize])
        words[f.index] ^= words.dtype.type(1) << words.dtype.type(f.bit)
    return out


def replace_initializers(onnx_bytes: bytes, values: dict[str, np.ndarray]) -> bytes:
    """The graph with the named initializers' values replaced (same names, shapes and dtypes)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load_from_string(onnx_bytes)
    for t in model.graph.initializer:
        if t.name in values:
            old = numpy_helper.to_array(t)
            new = np.asarray(values[t.name], dtype=old.dtype).reshape(old.shape)  # a 0-d scale stays 0-d
            if t.raw_data:
                t.raw_data = new.astype(old.dtype.newbyteorder("<")).tobytes()  # same bytes, same file size
            else:
                t.CopyFrom(numpy_helper.from_array(new, t.name))
    return model.SerializeToString()


def write_corrupted_copy(bundle_path: str | Path, out: str | Path, variant: str | None,
                         flips: list[BitFlip], meta: dict | None = None, overwrite: bool = False) -> Path:
    """Copy the bundle folder to ``out`` with ``flips`` applied to the graph file of ``variant``."""
    bundle = load_bundle(bundle_path)
    out = Path(out)
    if out.exists():
        if not overwrite:
            raise FileExistsError(f"{out} exists; pass --overwrite or choose another path")
        shutil.rmtree(out)
    shutil.copytree(bundle.root, out)
    path = bundle.graph_path("main", variant)
    rel = path.relative_to(bundle.root)
    inits = bundle.onnx("main", variant).initializers
    (out / rel).write_bytes(replace_initializers(path.read_bytes(), apply_flips(inits, flips)))
    record = {"source": str(bundle_path), "graph_file": str(rel), "variant": variant or "fp32",
              "flips": [asdict(f) for f in flips], **(meta or {})}
    write_json(out / "faults.json", record)
    return out


def inject_faults(bundle_path: str | Path, out: str | Path, flips: int, mode: str = "random", seed: int = 0,
                  variant: str | None = None, adaptive: bool = False, data: np.ndarray | None = None,
                  overwrite: bool = False, report=print) -> Path:
    """``closedloop inject-faults``: write a corrupted copy of a bundle (see the module docstring).

    ``mode="random"`` draws ``flips`` bits uniformly over the weights; ``"targeted"`` runs the
    Bit-Flip-Attack-style progressive search (``closedloop.sdk.robust.attack``), with ``adaptive=True``
    the variant that only flips sets keeping the block constraints of the *unkeyed* layout.
    """
    if adaptive and (mode != "targeted" or variant != "int8"):
        raise ValueError("adaptive flips are sets of three int8 flips (+d, -2d, +d) in one block: they need "
                         "mode 'targeted' and the int8 variant (--mode targeted --variant int8)")
    bundle = load_bundle(bundle_path)
    inits = bundle.onnx("main", variant).initializers
    meta: dict = {"mode": mode, "seed": seed}
    if mode == "random":
        chosen = random_flips(inits, flips, seed)
    elif mode == "targeted":
        from .attack import AttackConfig, bit_flip_attack

        result = bit_flip_attack(bundle, variant, AttackConfig(flips=flips, seed=seed, adaptive=adaptive), data=data,
                                 report=report)
        chosen = result.flips
        meta |= {"adaptive": adaptive, "loss_trace": result.losses}
    else:
        raise ValueError(f"mode {mode!r} must be 'random' or 'targeted'")
    if not chosen:
        raise ValueError(f"no bit of the {variant or 'fp32'} weights could be flipped as asked ({mode} mode, "
                         f"{flips} flips); nothing written")
    path = write_corrupted_copy(bundle_path, out, variant, chosen, meta, overwrite)
    report(f"wrote {path} with {len(chosen)} flipped bit(s) in {variant or 'fp32'} weights; it fails its checksum: "
           "load it with verify_checksums=False (closedloop scrub --skip-checksum) to model faults in memory")
    return path
