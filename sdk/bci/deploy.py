"""Deploying a handwriting decoder: export to a ``bci_handwriting`` bundle, and measure it.

``export_bci_bundle`` wraps ``closedloop.export.export_bundle`` for the decoder family: a
recurrent module whose single step takes one 20 ms bin of (normalised) spike counts
and returns CTC log-probabilities over the blank and the characters. Whatever the
module holds in front of its backbone (a session's calibrated alignment layer) is part
of the exported graph, so a calibrated bundle is self-contained; the session's
per-channel normalisation goes in ``preprocess``, the charset and session facts in
``extra.bci`` (see ``docs/bci_deployment.md``). The runtime plug-in that reads them
is ``closedloop.runtime.families.bci``.

A bundle exported from an ``AlignedDecoder`` (alignment + ``GRUBackbone``) is also
*calibratable*: it carries ``calibration_state.npz`` (listed with its checksum in the
manifest) holding the frozen backbone's weights, the alignment layer in the graph and,
for a two-stage model, the meta-learned alignment initialisation and per-parameter step
sizes, with the inner-step count, normalisation floor, charset and channel count.
``closedloop calibrate`` (:mod:`closedloop.sdk.bci.cli`) rebuilds the torch modules from it alone
(:func:`decoder_from_state`), fits a new session's alignment and exports the next bundle.
The runtime reads and checks the file without torch
(``closedloop.runtime.families.bci.read_calibration_state``); the format is in ``docs/bci_deployment.md``.

``bench_bci_step_latency`` times the deployed per-bin path (frame to normalised input,
model step, greedy CTC) on each backend, back to back or paced as in a session.
"""

from __future__ import annotations

import gc
import io
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from closedloop.common.atomic import refuse_existing
from closedloop.common.handwriting import BIN_S, CHARSET

__all__ = ["BCI_FAMILY", "BCI_MANIFEST_VERSION", "CALIBRATION_STATE_FILE", "bench_bci_step_latency",
           "calibration_state_arrays", "check_bci_module", "decoder_from_state", "export_bci_bundle"]

BCI_FAMILY = "bci_handwriting"
BCI_MANIFEST_VERSION = 1
CALIBRATION_STATE_FILE = "calibration_state.npz"


def _channel_stats(name: str, v: Any, n_channels: int) -> np.ndarray:
    a = np.asarray(v, dtype=np.float64).reshape(-1)
    if a.shape != (n_channels,):
        raise ValueError(f"{name} has {a.size} values; expected {n_channels}, one per channel")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} has non-finite values at channels {np.flatnonzero(~np.isfinite(a))[:8].tolist()}")
    return a


def check_bci_module(module: Any, n_channels: int, n_outputs: int) -> None:
    """Raise ``ValueError`` naming what is wrong if ``module`` cannot be a decoder bundle.

    It needs ``init_state(batch)`` and ``step(x, *state) -> (logp, *state)`` with ``x``
    of shape (batch, ``n_channels``) and ``logp`` of shape (batch, ``n_outputs``).
    """
    import torch

    for attr in ("init_state", "step"):
        if not callable(getattr(module, attr, None)):
            raise ValueError(f"{type(module).__name__} has no {attr}(); a decoder needs init_state(batch) and "
                             "step(x, h) -> (log_probs, h), as sdk.models.GRUDecoder has")
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            state = module.init_state(1)
            state = state if isinstance(state, tuple | list) else (state,)
            param = next(module.parameters(), None)
            x = torch.zeros(1, n_channels, device=param.device if param is not None else "cpu")
            out = module.step(x, *state)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ValueError(f"{type(module).__name__}.step failed on one bin of {n_channels} channels: {exc}") from exc
    finally:
        module.train(was_training)
    y = out[0] if isinstance(out, tuple | list) else out
    if tuple(y.shape) != (1, n_outputs):
        raise ValueError(f"{type(module).__name__}.step returns shape {tuple(y.shape)}; expected (1, {n_outputs}): "
                         f"the blank and {n_outputs - 1} characters")


def _is_calibratable(module: Any) -> bool:
    from .models import AffineAlignment, AlignedDecoder, GRUBackbone

    return (isinstance(module, AlignedDecoder) and isinstance(module.alignment, AffineAlignment)
            and isinstance(module.backbone, GRUBackbone))


def calibration_state_arrays(module: Any, meta: Any = None, *, std_floor: float | None = None,
                             charset: str = CHARSET, blank: int = 0) -> dict[str, np.ndarray]:
    """The calibration state of ``module`` (an ``AlignedDecoder`` over a ``GRUBackbone``) as named arrays.

    ``meta`` is the stage-2 ``MetaAlignment`` (its initialisation, log step sizes and
    inner-step count go in too), or None for a decoder calibrated from identity;
    ``std_floor`` defaults to ``closedloop.sdk.bci.data.DEFAULT_STD_FLOOR``. Every array is a
    bit-exact float32 copy of the torch parameter. Names, shapes and dtypes are listed in
    ``docs/bci_deployment.md``.
    """
    if std_floor is None:
        from .data import DEFAULT_STD_FLOOR as std_floor
    if not _is_calibratable(module):
        raise ValueError(f"{type(module).__name__} has no calibration state: a calibratable bundle needs "
                         "closedloop.sdk.bci.models.AlignedDecoder(AffineAlignment, GRUBackbone)")
    bb = module.backbone
    c = int(module.n_inputs)

    def f32(t: Any) -> np.ndarray:
        return t.detach().cpu().numpy().astype(np.float32, copy=True)

    out: dict[str, np.ndarray] = {
        "format": np.array(1, dtype=np.int64), "n_channels": np.array(c, dtype=np.int64),
        "charset": np.array(charset), "blank": np.array(int(blank), dtype=np.int64),
        "std_floor": np.array(float(std_floor), dtype=np.float64),
        "n_hidden": np.array(bb.n_hidden, dtype=np.int64), "n_layers": np.array(bb.n_layers, dtype=np.int64),
        "inner_steps": np.array(int(meta.inner_steps) if meta is not None else 0, dtype=np.int64),
    }
    out.update({f"backbone.{k}": f32(v) for k, v in bb.state_dict().items()})
    out["alignment.weight"] = f32(module.alignment.weight)
    out["alignment.bias"] = f32(module.alignment.bias)
    if meta is not None:
        if meta.n_channels != c:
            raise ValueError(f"meta alignment has {meta.n_channels} channels; the decoder takes {c}")
        for name in meta.init:
            out[f"meta.init_{name}"] = f32(meta.init[name])
            out[f"meta.log_step_{name}"] = f32(meta.log_step[name])
    return out


def decoder_from_state(state: Mapping[str, Any]) -> tuple[Any, Any]:
    """Rebuild ``(AlignedDecoder, MetaAlignment or None)`` from ``closedloop.runtime.families.bci.read_calibration_state``.

    The torch parameters are bit-exact copies of the stored float32 arrays.
    """
    import torch

    from closedloop.runtime.families.bci import meta_form_of

    from .meta import MetaAlignment
    from .models import AffineAlignment, AlignedDecoder, GRUBackbone

    c = int(state["n_channels"])
    bb = GRUBackbone(c, int(state["n_hidden"]), int(state["n_layers"]))
    bb.load_state_dict({k[len("backbone."):]: torch.from_numpy(np.array(v)) for k, v in state.items()
                        if k.startswith("backbone.")})
    alignment = AffineAlignment(c).load(torch.from_numpy(np.array(state["alignment.weight"])),
                                        torch.from_numpy(np.array(state["alignment.bias"])))
    meta = None
    form = state.get("meta_form", meta_form_of(state))
    if form is not None:
        rank = int(np.shape(state["meta.init_u"])[1]) if form == "lowrank" else 0
        meta = MetaAlignment(c, max(int(state["inner_steps"]), 1), form=form, rank=rank)
        with torch.no_grad():
            for name in meta.init:
                meta.init[name].copy_(torch.from_numpy(np.array(state[f"meta.init_{name}"])))
                meta.log_step[name].copy_(torch.from_numpy(np.array(state[f"meta.log_step_{name}"])))
        meta.eval()
    return AlignedDecoder(alignment, bb).eval(), meta


def _npz_bytes(arrays: Mapping[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def export_bci_bundle(
    module: Any,
    out: str | Path,
    *,
    n_channels: int,
    mean: Sequence[float] | np.ndarray,
    std: Sequence[float] | np.ndarray,
    session_name: str,
    calibration_info: Mapping[str, Any] | None = None,
    provenance: Mapping[str, Any] | None = None,
    charset: str = CHARSET,
    blank: int = 0,
    name: str | None = None,
    rate_hz: float = 1.0 / BIN_S,
    recorded_bins: np.ndarray | None = None,
    display: Mapping[str, str] | None = None,
    char_probs: bool = False,
    end_completion: str | None = None,
    decoding: Mapping[str, Any] | None = None,
    warmup_bins: int | None = None,
    meta: Any = None,
    std_floor: float | None = None,
    calibration_config: Mapping[str, Any] | None = None,
    calibratable: bool | None = None,
    variants: Sequence[str] = ("fp16", "int8"),
    tensorrt: bool = True,
    overwrite: bool = False,
    zip: bool = False,
    report: Callable[[str], None] = print,
) -> Path:
    """Export a streaming handwriting decoder for one session; return the bundle's path.

    Parameters
    ----------
    module
        A torch module with ``init_state(batch)``, ``step(x, h) -> (log_probs, h)`` and
        ``forward(seq, h)``, whose step takes a bin of ``n_channels`` normalised counts and
        returns ``len(charset) + 1`` log-probabilities (for example the training stage's
        ``AlignedDecoder(alignment, backbone)``: the alignment layer is exported with it).
    out
        Where to write the bundle (a folder, or a zip with ``zip=True``).
    n_channels
        Channels per bin (192 for FALCON H2).
    mean, std
        Per-channel normalisation ``(counts - mean) / std`` from this session's
        calibration data only. ``std`` must be > 0 (give silent channels 1).
    session_name, calibration_info
        Which session this bundle is calibrated for and how (trials used, bins, method,
        the data file): stored in ``extra.bci`` for people and for ``closedloop inspect``.
    provenance
        Training record (config, data, seeds), stored beside the export's own.
    charset, blank
        The characters of the non-blank outputs in order, and the blank's output index.
    recorded_bins
        Raw counts ``(T, n_channels)`` from the session (e.g. a calibration sentence) for
        the sequence parity check, normalised here; a random walk when None.
    display, char_probs
        Status-line replacements (default ``>`` -> space, ``~`` -> period); whether each
        bin's ``DecoderOutput`` carries the character probabilities.
    end_completion
        None (default): the runtime's text is plain greedy CTC. A string: at each trial's
        end the runtime applies end-of-trial completion (``closedloop.runtime.families.bci.ctc``): ``"~?"`` appends
        the likelier of these sentence-final marks when the text lacks one (the lexicon
        beam search's sentence-end rule, as ``greedy_end`` in the harness), ``""`` appends
        a character only when CTC rates it more probable than none.
    decoding
        The beam search's defaults (``closedloop.sdk.bci.lexicon.decoding_block``): the closed
        lexicon's word counts and the sentence-end rule of the training sentences, stored as
        ``extra.bci.decoding`` for ``closedloop evaluate``.
    warmup_bins
        None (default): ``mean`` / ``std`` normalise every bin (a calibrated bundle). A count:
        the runtime normalises a session with its own statistics, accumulated over its first
        ``warmup_bins`` bins and then frozen (``extra.bci.normalization``; ``mean`` / ``std``
        are then only stored, not used): an uncalibrated pooled bundle on a new day.
    meta, std_floor, calibration_config
        For the calibration state: the stage-2 ``MetaAlignment`` (None: a new session's
        alignment is fitted from identity), the normalisation's std floor (default
        ``closedloop.sdk.bci.data.DEFAULT_STD_FLOOR``), and the ``CalibrationConfig`` (as a dict)
        that ``closedloop calibrate`` should use.
    calibratable
        Write ``calibration_state.npz``: None (default) when ``module`` is an
        ``AlignedDecoder`` over a ``GRUBackbone``; True requires it; False never.
    variants, tensorrt, overwrite, zip, report
        As for ``closedloop.export.export_bundle``.
    """
    import torch

    from closedloop.export import export_bundle
    from closedloop.runtime.families.bci import DEFAULT_DISPLAY

    n_channels = int(n_channels)
    mean_a = _channel_stats("mean", mean, n_channels)
    std_a = _channel_stats("std", std, n_channels)
    if np.any(std_a <= 0):
        raise ValueError(f"std is <= 0 at channels {np.flatnonzero(std_a <= 0)[:8].tolist()}; "
                         "set silent calibration channels to std 1")
    if len(set(charset)) != len(charset):
        raise ValueError(f"charset {charset!r} repeats characters")
    if not 0 <= blank <= len(charset):
        raise ValueError(f"blank {blank} must be an output index in 0..{len(charset)}")
    check_bci_module(module, n_channels, len(charset) + 1)
    if calibratable is None:
        calibratable = _is_calibratable(module)
    state = None
    if calibratable:
        state = calibration_state_arrays(module, meta, std_floor=std_floor, charset=charset, blank=blank)
    elif meta is not None:
        raise ValueError("meta given with calibratable=False: the meta state is only stored in a calibratable bundle")
    out = Path(out)
    refuse_existing(out, overwrite)
    sequence = None
    if recorded_bins is not None:
        bins = np.asarray(recorded_bins, dtype=np.float64)
        if bins.ndim != 2 or bins.shape[1] != n_channels:
            raise ValueError(f"recorded_bins has shape {bins.shape}; expected (T, {n_channels})")
        sequence = ((bins - mean_a) / std_a).astype(np.float32)
    bci = {
        "version": BCI_MANIFEST_VERSION,
        "charset": charset,
        "blank": int(blank),
        "n_channels": n_channels,
        "bin_s": 1.0 / float(rate_hz),
        "session": session_name,
        "calibration": dict(calibration_info or {}),
        "display": dict(DEFAULT_DISPLAY if display is None else display),
        "char_probs": bool(char_probs),
        "end_completion": None if end_completion is None else {"sentence_end": str(end_completion)},
    }
    if decoding is not None:
        bci["decoding"] = dict(decoding)
    if warmup_bins is not None:
        if int(warmup_bins) < 1:
            raise ValueError(f"warmup_bins {warmup_bins}: the session's own statistics need at least one bin")
        if std_floor is None:
            from .data import DEFAULT_STD_FLOOR as std_floor
        bci["normalization"] = {"source": "warmup", "warmup_bins": int(warmup_bins), "std_floor": float(std_floor)}
    kwargs = dict(kind="recurrent", example_input=torch.zeros(1, n_channels), rate_hz=float(rate_hz),
                  family=BCI_FAMILY, name=name or f"bci-{session_name}",
                  preprocess={"mean": mean_a.tolist(), "std": std_a.tolist()},
                  extra={"bci": bci}, provenance=dict(provenance or {}), recorded_sequence=sequence,
                  variants=variants, tensorrt=tensorrt, report=report)
    if state is None:
        return export_bundle(module, out, overwrite=overwrite, zip=zip, **kwargs)
    return _export_with_state(module, out, state, {"file": CALIBRATION_STATE_FILE, "version": 1,
                                                   "meta": meta is not None,
                                                   "config": dict(calibration_config or {})},
                              overwrite=overwrite, zip=zip, **kwargs)


def _export_with_state(module: Any, out: Path, state: Mapping[str, np.ndarray], block: dict, *, overwrite: bool,
                       zip: bool, **kwargs: Any) -> Path:
    """Export to a scratch folder, then publish graph files + state file + manifest in one atomic write.

    ``closedloop.export.export_bundle`` writes only what it makes itself; the state file joins its
    files here and ``closedloop.export.writer.write_bundle`` checksums everything again.
    """
    from closedloop.export import export_bundle
    from closedloop.export.writer import write_bundle
    from closedloop.runtime.manifest import MANIFEST_NAME, Manifest

    report = kwargs["report"]
    kwargs["report"] = lambda line: None if line.startswith("wrote bundle ") else report(line)  # not the scratch one
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    try:
        first = export_bundle(module, scratch / "b", overwrite=False, zip=False, **kwargs)
        manifest = Manifest.from_json((first / MANIFEST_NAME).read_text(), source=str(first / MANIFEST_NAME))
        files: dict[str, Any] = {rel: first / rel for rel in manifest.files}
        files[CALIBRATION_STATE_FILE] = _npz_bytes(state)
        manifest.extra["bci"]["calibration_state"] = block
        path = write_bundle(out, manifest, files, overwrite=overwrite, zip=zip)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report(f"wrote calibratable bundle {path} ({CALIBRATION_STATE_FILE}: backbone, alignment"
           f"{', meta-learned initialisation and step sizes' if block['meta'] else ''})")
    return path


def bench_bci_step_latency(
    bundle: str | Path,
    backends: Sequence[str] = ("numba", "onnxruntime"),
    n_bins: int = 3000,
    warmup: int = 200,
    paced: bool = False,
    seed: int = 0,
) -> dict[str, dict[str, float]]:
    """Per-bin latency of the deployed decoder, in microseconds, per backend.

    One bin is what a session does with a frame: copy the ``NeuralFrame`` counts into
    the input, normalise (Numba), step the model, decode greedy CTC (Numba). With
    ``paced=True`` bins run in the real-time loop at the bundle's rate with its cache
    prewarm, as in a session (``n_bins`` then takes ``n_bins / rate`` seconds);
    otherwise back to back with the garbage collector frozen.

    Returns ``{backend: {"p50_us", "p99_us", "max_us", "mean_us", "bins"}}``; a backend
    that is not available here reports ``{"error": why}`` instead.
    """
    from closedloop.firmware_bridge import NeuralFrame
    from closedloop.runtime import LoopConfig, Model, RealTimeLoop, get_family, load_bundle
    from closedloop.runtime.errors import BackendUnavailableError, GraphUnsupportedError

    b = load_bundle(bundle)
    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {}
    for backend in backends:
        try:
            model = Model(b, backend=backend)
        except (BackendUnavailableError, GraphUnsupportedError) as exc:
            out[backend] = {"error": str(exc)}
            continue
        fam = get_family(b.manifest.family)(b, model)
        n_ch = fam.n_channels
        frames = [NeuralFrame(i, rng.poisson(0.16, n_ch).astype(np.uint16)) for i in range(256)]

        def one_bin(k: int, fam: Any = fam, model: Model = model, frames: list = frames) -> None:
            fam.on_message(frames[k & 255])
            model.run()
            fam.postprocess()

        for k in range(warmup):
            one_bin(k)
        fam.reset()
        if paced:
            loop = RealTimeLoop(LoopConfig(rate_hz=b.manifest.rate_hz, max_steps=n_bins))
            loop.run(one_bin, prewarm=model.prewarm)
            samples = loop.latency.samples() / 1e3
        else:
            samples = np.zeros(n_bins, dtype=np.float64)
            gc.collect()
            gc.freeze()
            gc.disable()
            try:
                clock = time.perf_counter_ns
                for k in range(n_bins):
                    t0 = clock()
                    one_bin(k)
                    samples[k] = clock() - t0
            finally:
                gc.enable()
                gc.unfreeze()
            samples /= 1e3
        out[backend] = {
            "p50_us": float(np.percentile(samples, 50)),
            "p99_us": float(np.percentile(samples, 99)),
            "max_us": float(samples.max()),
            "mean_us": float(samples.mean()),
            "bins": int(samples.size),
        }
        model.close()
    return out
