"""The ``bci_handwriting`` family: spike-count bins in, characters of typed text out.

A handwriting decoder sees every 20 ms bin of threshold crossings in order (``consume
= "all"``: a skipped bin would change the text). Per bin the family normalises the
channels with the session's calibration statistics (a Numba kernel, in place), the
model steps its recurrent state, and greedy CTC decoding (``closedloop.runtime.families.bci.ctc``) turns the
bin's log-probabilities into at most one new character, sent to the device or display
as a ``DecoderOutput`` whose ``text`` is that character (usually ``''``). Streaming
gives the same text as offline greedy decoding of the same bins.

Manifest fields it reads (written by ``closedloop.sdk.bci.deploy.export_bci_bundle``; documented
in ``docs/bci_deployment.md``):

- ``preprocess.mean`` / ``preprocess.std`` (required): per-channel normalisation
  ``(x - mean) / std``, computed from the session's calibration data.
- ``extra.bci.charset`` (required): the characters of the non-blank outputs in order.
- ``extra.bci.blank``: index of the CTC blank among the outputs (default 0).
- ``extra.bci.output``: the graph output holding the log-probabilities (default the
  first data output).
- ``extra.bci.n_channels``: channels per bin, checked against the graph.
- ``extra.bci.display``: character replacements for people (default ``>`` -> space,
  ``~`` -> period), used by the status line and ``display_text``.
- ``extra.bci.char_probs``: also send each bin's character probabilities (default false).
- ``extra.bci.text_capacity``: characters of text kept per trial (default 16384).
- ``extra.bci.end_completion``: absent or null: off. ``{"sentence_end": "~?"}``: when a
  trial ends (``end_trial``), end-of-trial completion (``closedloop.runtime.families.bci.ctc``) appends the
  sentence-final mark greedy decoding left out, the likelier of those listed;
  ``{"sentence_end": ""}``: append whatever single character CTC rates more probable
  than nothing.
- ``extra.bci.normalization``: absent: ``preprocess.mean`` / ``std`` normalise every bin
  (a calibrated bundle). ``{"source": "warmup", "warmup_bins": N, "std_floor": f}`` (an
  uncalibrated pooled bundle): the session is normalised with its own statistics, the running
  mean and standard deviation (floored at ``f``) of its bins so far, frozen after its first ``N``
  bins (``normalize_warmup``); they are kept across trials and start again only when the family is
  built or :meth:`BCIHandwritingFamily.restart_warmup` is called. ``closedloop evaluate`` streams
  each session's evaluation trials through this same code, so offline and live agree.
- ``extra.bci.decoding``: the beam search's defaults for ``closedloop evaluate`` (closed
  vocabulary, sentence-end rule); the runtime does not read it.
- ``extra.bci.calibration_state``: ``{"file", "version", "meta", "config"}`` naming the
  bundle's calibration state file (an ``.npz`` listed, with its checksum, in the
  manifest's files): the frozen backbone's weights, the alignment layer in the graph and,
  for a two-stage model, the meta-learned alignment initialisation and step sizes, so
  ``closedloop calibrate`` can fit a new session's alignment from the bundle alone. The
  runtime never needs it to decode; it checks it at load (:func:`read_calibration_state`).
"""

from __future__ import annotations

import zipfile
from typing import TYPE_CHECKING, Any

import numpy as np

from closedloop.firmware_bridge import DecoderOutput
from closedloop.runtime.errors import BundleError
from closedloop.runtime.families.base import FamilyPlugin
from closedloop.runtime.families.registry import register_family

if TYPE_CHECKING:
    from closedloop.firmware_bridge import Message
    from closedloop.runtime.bundle import Bundle
    from closedloop.runtime.families.bci.ctc import StreamingCTC
    from closedloop.runtime.model import Model

BLOCK = "bci"
DEFAULT_DISPLAY = {">": " ", "~": "."}
DEFAULT_TEXT_CAPACITY = 16384
STATUS_TAIL_CHARS = 40
_COMMANDS = ("decoder_output", "none")
STATE_BLOCK = "calibration_state"
STATE_VERSION = 1


def _row(buf: np.ndarray) -> np.ndarray:
    """A 1-D view of a (1, n) or (n,) buffer that writes through to it."""
    row = buf[0] if buf.ndim == 2 else buf.reshape(-1)
    if buf.ndim > 2 or (buf.ndim == 2 and buf.shape[0] != 1) or not np.shares_memory(row, buf):
        raise ValueError(f"bci_handwriting: expected a (1, n) model buffer, got shape {buf.shape}")
    return row


def _channel_vector(pre: dict[str, Any], key: str, n: int) -> tuple[np.ndarray | None, str | None]:
    if key not in pre:
        return None, (f"bci_handwriting: preprocess.{key} is missing; a decoder bundle carries the per-channel "
                      "normalisation from its session's calibration data (export with sdk.bci.export_bci_bundle)")
    try:
        v = np.asarray(pre[key], dtype=np.float64)
    except (TypeError, ValueError):
        return None, f"bci_handwriting: preprocess.{key} is not a list of numbers"
    if v.shape != (n,):
        return None, f"bci_handwriting: preprocess.{key} has shape {v.shape}, expected ({n},): one value per channel"
    if not np.all(np.isfinite(v)):
        return None, f"bci_handwriting: preprocess.{key} has non-finite values at channels {np.flatnonzero(~np.isfinite(v))[:8].tolist()}"
    return v, None


@register_family
class BCIHandwritingFamily(FamilyPlugin):
    """Streaming handwriting decoder: normalise, step, greedy CTC; one ``DecoderOutput`` per bin."""

    name = "bci_handwriting"
    default_input = "neural_frame"
    default_command = "decoder_output"
    consume = "all"

    @classmethod
    def problems(cls, bundle: Bundle) -> list[str]:
        spec = bundle.graph()
        if not spec.data_inputs or not spec.data_outputs:
            return ["bci_handwriting: the main graph needs one data input (a bin) and one data output (log-probabilities)"]
        m = bundle.manifest
        cfg = m.extra.get(BLOCK)
        if not isinstance(cfg, dict):
            return [f"bci_handwriting: manifest extra.{BLOCK} is missing; it names the charset and the CTC blank "
                    "(see docs/bci_deployment.md)"]
        out: list[str] = []
        n_in = spec.data_inputs[0].shape[-1]
        out_name = cfg.get("output", spec.data_outputs[0].name)
        outputs = {t.name: t for t in spec.data_outputs}
        if out_name not in outputs:
            out.append(f"bci_handwriting: extra.bci.output {out_name!r} is not a data output of the graph ({sorted(outputs)})")
            n_out = None
        else:
            n_out = outputs[out_name].shape[-1]
        charset, blank = cfg.get("charset"), cfg.get("blank", 0)
        if not isinstance(charset, str) or not charset:
            out.append(f"bci_handwriting: extra.bci.charset must be a non-empty string, got {charset!r}")
        else:
            dup = sorted({c for c in charset if charset.count(c) > 1})
            if dup:
                out.append(f"bci_handwriting: extra.bci.charset repeats {dup}; each output needs its own character")
            if isinstance(n_out, int) and len(charset) + 1 != n_out:
                out.append(f"bci_handwriting: charset has {len(charset)} characters + blank = {len(charset) + 1} outputs, "
                           f"but the graph's output {out_name!r} has {n_out}")
            if not isinstance(blank, int) or isinstance(blank, bool) or not 0 <= blank <= len(charset):
                out.append(f"bci_handwriting: extra.bci.blank {blank!r} must be an output index in 0..{len(charset)}")
        if "n_channels" in cfg and cfg["n_channels"] != n_in:
            out.append(f"bci_handwriting: extra.bci.n_channels is {cfg['n_channels']}, the graph takes {n_in} channels")
        cap = cfg.get("text_capacity", DEFAULT_TEXT_CAPACITY)
        if not isinstance(cap, int) or cap < 1:
            out.append(f"bci_handwriting: extra.bci.text_capacity {cap!r} must be a positive integer")
        display = cfg.get("display", DEFAULT_DISPLAY)
        if not isinstance(display, dict) or not all(isinstance(k, str) and len(k) == 1 and isinstance(v, str)
                                                    for k, v in display.items()):
            out.append(f"bci_handwriting: extra.bci.display must map single characters to strings, got {display!r}")
        ec = cfg.get("end_completion")
        if ec is not None:
            ends = ec.get("sentence_end") if isinstance(ec, dict) else None
            if not isinstance(ends, str) or (isinstance(charset, str) and any(c not in charset for c in ends)):
                out.append(f"bci_handwriting: extra.bci.end_completion must be null or {{\"sentence_end\": S}} with S a "
                           f"string of charset characters (\"\" for plain completion), got {ec!r}")
        norm = cfg.get("normalization")
        if norm is not None and not (isinstance(norm, dict) and norm.get("source") == "warmup"
                                     and isinstance(norm.get("warmup_bins"), int) and norm["warmup_bins"] >= 1
                                     and isinstance(norm.get("std_floor"), int | float) and norm["std_floor"] > 0):
            out.append("bci_handwriting: extra.bci.normalization must be absent or {\"source\": \"warmup\", "
                       f"\"warmup_bins\": N >= 1, \"std_floor\": f > 0}}, got {norm!r}")
        command = m.extra.get("session", {}).get("command", cls.default_command)
        if command not in _COMMANDS:
            out.append(f"bci_handwriting: session command {command!r} is not one of {_COMMANDS}")
        if isinstance(n_in, int):
            _, why = _channel_vector(m.preprocess, "mean", n_in)
            out += [why] if why else []
            std, why = _channel_vector(m.preprocess, "std", n_in)
            out += [why] if why else []
            if std is not None and np.any(std <= 0):
                bad = np.flatnonzero(std <= 0)
                out.append(f"bci_handwriting: preprocess.std is <= 0 at channels {bad[:8].tolist()}"
                           f"{' ...' if bad.size > 8 else ''}; a silent calibration channel needs std 1 (or drop it)")
        if STATE_BLOCK in cfg and not out:
            try:
                read_calibration_state(bundle)
            except BundleError as exc:
                out.append(str(exc))
        return out

    def __init__(self, bundle: Bundle, model: Model):
        # Numba is imported only when a decoder is built: ``import closedloop.runtime`` must work
        # (and say what is missing) without it.
        from closedloop.runtime.families.bci.ctc import StreamingCTC, normalize, normalize_warmup

        super().__init__(bundle, model)
        self._normalize = normalize
        cfg = bundle.manifest.extra[BLOCK]
        spec = model.spec
        pre = bundle.manifest.preprocess
        self.charset: str = cfg["charset"]
        self.blank: int = int(cfg.get("blank", 0))
        self._x = _row(model.inputs[spec.data_inputs[0].name])
        self._y_buf = model.outputs[cfg.get("output", spec.data_outputs[0].name)]
        self._y = _row(self._y_buf)
        n = self._x.size
        self._mean = np.ascontiguousarray(pre["mean"], dtype=np.float32).reshape(n)
        self._inv_std = (1.0 / np.asarray(pre["std"], dtype=np.float64)).astype(np.float32).reshape(n)
        self._display = str.maketrans(cfg.get("display", DEFAULT_DISPLAY))
        self._probs = np.zeros(self._y.size, dtype=np.float32) if cfg.get("char_probs", False) else None
        self._no_probs = np.zeros(0, dtype=np.float32)
        self.ctc: StreamingCTC = StreamingCTC(self.charset, self.blank, int(cfg.get("text_capacity", DEFAULT_TEXT_CAPACITY)))
        ec = cfg.get("end_completion")
        self.sentence_end: str | None = None if ec is None else str(ec["sentence_end"])  # None: no completion
        norm = cfg.get("normalization")
        self.warmup_bins: int = int(norm["warmup_bins"]) if norm is not None else 0  # 0: fixed statistics
        self._std_floor = float(norm["std_floor"]) if norm is not None else 0.0
        self._warm_sums = np.zeros((2, n), dtype=np.float64)
        self._warm_count = np.zeros(1, dtype=np.int64)
        self._normalize_warmup = normalize_warmup
        self.bins = 0  # bins decoded since the last reset
        self.text_resets = 0  # resets of the typed text so far
        # Compile (or load from Numba's cache) both kernels for the exact array types of
        # the hot path now, so that the first bin of a session compiles nothing.
        normalize(self._frame, self._mean, self._inv_std, self._x)
        if self.warmup_bins:
            normalize_warmup(self._frame, self._warm_sums, self._warm_count, self.warmup_bins, self._std_floor,
                             self._mean, self._inv_std, self._x)
        self.ctc.step(self._y)
        self.restart_warmup()
        self.reset()

    def restart_warmup(self) -> None:
        """A new session (another day) on the same decoder: learn its statistics again from its first bins.

        Only for a bundle with ``extra.bci.normalization`` (warm-up); otherwise nothing to do.
        """
        self._warm_sums[:] = 0.0
        self._warm_count[0] = 0

    @property
    def warmed_up(self) -> bool:
        """Whether the session's statistics are final (always, for a bundle with fixed statistics)."""
        return int(self._warm_count[0]) >= self.warmup_bins

    # --- per trial -------------------------------------------------------------------

    def reset(self) -> None:
        """Start of a session or trial: zero the recurrent state and the decoded text."""
        super().reset()
        self.ctc.reset()
        self.bins = 0
        self.text_resets += 1  # a new trial or a re-handshake: typed events say the text starts again

    def end_trial(self) -> str:
        """Return the trial's decoded text (in the charset, e.g. ``he>was~``) and reset.

        With ``extra.bci.end_completion`` set, the character end-of-trial completion picks
        is appended first (``closedloop.runtime.families.bci.ctc.StreamingCTC.complete_end``).
        """
        if self.sentence_end is not None:
            self.ctc.complete_end(self.sentence_end)
        text = self.ctc.text()
        self.reset()
        return text

    def text(self, last_n: int | None = None) -> str:
        """Text decoded since the last reset, in the charset (its newest ``last_n`` characters)."""
        return self.ctc.text(last_n)

    def display_text(self, last_n: int | None = None) -> str:
        """The same text for people: ``>`` as a space, ``~`` as a period (``extra.bci.display``)."""
        return self.ctc.text(last_n).translate(self._display)

    @property
    def n_channels(self) -> int:
        return int(self._frame.size)

    @property
    def log_probs(self) -> np.ndarray:
        """The last bin's output, shape (1, outputs) (the backend's buffer: overwritten each bin)."""
        return self._y_buf

    @property
    def new_text(self) -> str:
        """What the last bin added: one character or ''."""
        return self.ctc.last

    # --- per bin ---------------------------------------------------------------------

    def preprocess(self, frame: np.ndarray) -> None:
        if frame.dtype != np.float32 or frame.ndim != 1:
            np.copyto(self._frame, frame.reshape(-1), casting="unsafe")
            frame = self._frame
        if self.warmup_bins:
            self._normalize_warmup(frame, self._warm_sums, self._warm_count, self.warmup_bins, self._std_floor,
                                   self._mean, self._inv_std, self._x)
            return
        self._normalize(frame, self._mean, self._inv_std, self._x)

    def postprocess(self) -> np.ndarray:
        self.ctc.step(self._y)
        self.bins += 1
        return self._y_buf

    def decode_bin(self, counts: np.ndarray) -> str:
        """One bin, start to end (normalise, step, decode); return the new character or ''."""
        self.preprocess(counts)
        self.model.run()
        self.postprocess()
        return self.ctc.last

    def safe_output(self) -> np.ndarray:
        return self._no_probs  # a decoder drives no actuator

    def live_metrics(self) -> dict[str, float | str]:
        return {"chars": self.ctc.count, "text": self.display_text(STATUS_TAIL_CHARS)}

    def typed_count(self) -> int:
        return self.ctc.count

    def typed_last(self) -> str:
        return self.ctc.last

    def typed_resets(self) -> int:
        return self.text_resets

    def typed_tail(self, n: int) -> str:
        return self.display_text(n) if n > 0 else ""

    def summary_metrics(self) -> dict[str, float | str | list[float]]:
        # the whole decoded text (as far as the ring holds it), not the status line's tail
        return {"chars": self.ctc.count, "text": self.display_text()}

    # --- session hooks ---------------------------------------------------------------

    def command_message(self, command: np.ndarray, step: int) -> Message | None:
        if self.command.message is None:
            return None
        probs = None
        if self._probs is not None:
            np.exp(self._y, out=self._probs)
            probs = self._probs
        k = self._frame_bin if self._frame_bin is not None else step
        return DecoderOutput(bin_index=k & 0xFFFFFFFF, text=self.ctc.last, char_probs=probs)

    def safe_message(self, step: int) -> Message | None:
        """None: a decoder has no actuator to make safe, and an empty output would read as a bin."""
        return None


# --- the calibration state file ----------------------------------------------------------

_STATE_SCALARS = {"format": "i", "n_channels": "i", "charset": "U", "blank": "i", "std_floor": "f",
                  "n_hidden": "i", "n_layers": "i", "inner_steps": "i"}
#: The meta-learned state of each alignment form: parameter names (``meta.init_<name>`` and
#: ``meta.log_step_<name>`` are stored for each). ``full``: A0 (C, C), b0 (C,); ``lowrank``:
#: A0 = diag(gain) + u @ v with gain (C,), bias (C,), u (C, r), v (r, C).
META_FORMS = {"full": ("weight", "bias"), "lowrank": ("gain", "bias", "u", "v")}


def _meta_keys(form: str) -> list[str]:
    return [f"meta.{kind}_{name}" for kind in ("init", "log_step") for name in META_FORMS[form]]


def meta_form_of(names: Any) -> str | None:
    """The alignment form whose meta arrays are among ``names`` (None: no meta state).

    ``full`` is told by ``meta.init_weight``, ``lowrank`` by ``meta.init_u``; anything else
    that starts with ``meta.`` alone still counts as a (broken) ``full`` state, so the
    reader names what is missing.
    """
    names = set(names)
    if "meta.init_u" in names or "meta.init_gain" in names:
        return "lowrank"
    return "full" if any(n.startswith("meta.") for n in names) else None


def calibration_state_shapes(n_channels: int, n_hidden: int, n_layers: int, n_outputs: int,
                             meta_form: str | None, rank: int = 0) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every float32 array of a version-1 calibration state file.

    The backbone arrays are torch's ``nn.GRU`` / ``nn.Linear`` parameters as they are
    (gate order r, z, n); ``alignment.*`` is the layer :math:`x \\mapsto W x + b` in the
    graph; ``meta.*`` the meta-learned initialisation and log step sizes (two-stage only)
    of the alignment form ``meta_form`` (None: no meta state; ``rank`` for ``"lowrank"``).
    """
    c, h = n_channels, n_hidden
    shapes: dict[str, tuple[int, ...]] = {}
    for k in range(n_layers):
        shapes[f"backbone.gru.weight_ih_l{k}"] = (3 * h, c if k == 0 else h)
        shapes[f"backbone.gru.weight_hh_l{k}"] = (3 * h, h)
        shapes[f"backbone.gru.bias_ih_l{k}"] = (3 * h,)
        shapes[f"backbone.gru.bias_hh_l{k}"] = (3 * h,)
    shapes["backbone.readout.weight"] = (n_outputs, h)
    shapes["backbone.readout.bias"] = (n_outputs,)
    shapes["alignment.weight"] = (c, c)
    shapes["alignment.bias"] = (c,)
    if meta_form is not None:
        per = {"weight": (c, c), "bias": (c,), "gain": (c,), "u": (c, rank), "v": (rank, c)}
        shapes.update({key: per[key.rsplit("_", 1)[-1]] for key in _meta_keys(meta_form)})
    return shapes


def _load_npz(path: Any, where: str) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise BundleError(f"{where}: not a readable .npz of plain arrays ({type(exc).__name__}: {exc}); "
                          "re-export the bundle") from exc


def read_calibration_state(bundle: Bundle) -> dict[str, Any] | None:
    """The arrays of ``bundle``'s calibration state file, checked; None when it has none.

    Scalars come back as Python values (``charset`` a str, counts ints, ``std_floor`` a
    float), arrays as float32 ``np.ndarray``. Raises :class:`~closedloop.runtime.errors.BundleError`
    naming the first thing that is wrong (file not listed with a checksum, a missing or
    misshapen array, a wrong dtype, a non-finite value, a charset that is not the
    bundle's). No torch: a board can read it, though only ``sdk`` calibrates.
    """
    m = bundle.manifest
    cfg = m.extra.get(BLOCK, {})
    block = cfg.get(STATE_BLOCK)
    if block is None:
        return None
    if not isinstance(block, dict) or not isinstance(block.get("file"), str):
        raise BundleError(f"bci_handwriting: extra.bci.{STATE_BLOCK} must be an object with a 'file' name, got {block!r}")
    rel = block["file"]
    where = f"bci_handwriting: calibration state {rel}"
    if rel not in m.files:
        raise BundleError(f"{where} is not listed in the manifest's files, so it has no checksum; re-export the bundle")
    if block.get("version", STATE_VERSION) != STATE_VERSION:
        raise BundleError(f"{where}: version {block.get('version')!r}; this runtime reads version {STATE_VERSION}")
    raw = _load_npz(bundle.root / rel, where)
    state: dict[str, Any] = {}
    for key, kind in _STATE_SCALARS.items():
        a = raw.get(key)
        if a is None or a.shape != () or a.dtype.kind not in (kind + ("iu" if kind == "i" else "")):
            got = "missing" if a is None else f"{a.dtype} shape {a.shape}"
            raise BundleError(f"{where}: scalar {key!r} is {got}; expected a 0-d {'str' if kind == 'U' else kind} array")
        state[key] = str(a) if kind == "U" else int(a) if kind == "i" else float(a)
    if state["format"] != STATE_VERSION:
        raise BundleError(f"{where}: format {state['format']}; this runtime reads format {STATE_VERSION}")
    spec = bundle.graph()
    n_in = spec.data_inputs[0].shape[-1]
    out_name = cfg.get("output", spec.data_outputs[0].name)
    n_out = {t.name: t.shape[-1] for t in spec.data_outputs}.get(out_name)
    if state["n_channels"] != n_in:
        raise BundleError(f"{where}: n_channels {state['n_channels']}, the graph takes {n_in}")
    if state["charset"] != cfg.get("charset") or state["blank"] != cfg.get("blank", 0):
        raise BundleError(f"{where}: charset {state['charset']!r} / blank {state['blank']} differ from "
                          f"extra.bci's {cfg.get('charset')!r} / {cfg.get('blank', 0)}")
    if state["n_hidden"] < 1 or state["n_layers"] < 1 or state["inner_steps"] < 0 or not state["std_floor"] > 0:
        raise BundleError(f"{where}: n_hidden {state['n_hidden']}, n_layers {state['n_layers']}, inner_steps "
                          f"{state['inner_steps']}, std_floor {state['std_floor']} out of range")
    form = meta_form_of(raw)
    has_meta = form is not None
    rank = 0
    if form == "lowrank":
        u = raw.get("meta.init_u")
        if u is None or u.ndim != 2 or not 1 <= u.shape[1] <= n_in:
            raise BundleError(f"{where}: a lowrank meta state needs meta.init_u of shape ({n_in}, r) with "
                              f"1 <= r <= {n_in}, got {None if u is None else u.shape}")
        rank = int(u.shape[1])
    shapes = calibration_state_shapes(state["n_channels"], state["n_hidden"], state["n_layers"], int(n_out or 0), form, rank)
    for key, shape in shapes.items():
        a = raw.get(key)
        if a is None:
            raise BundleError(f"{where}: array {key!r} is missing"
                              + (f" (a {form} meta state needs all of " + ", ".join(_meta_keys(form)) + ")" if form is not None else ""))
        if a.dtype != np.float32 or a.shape != shape:
            raise BundleError(f"{where}: array {key!r} is {a.dtype} {a.shape}; expected float32 {shape}")
        if not np.all(np.isfinite(a)):
            raise BundleError(f"{where}: array {key!r} has non-finite values")
        state[key] = a
    unknown = sorted(set(raw) - set(shapes) - set(_STATE_SCALARS))
    if unknown:
        raise BundleError(f"{where}: unknown arrays {unknown}; a version-{STATE_VERSION} state has "
                          f"{sorted(shapes)} and the scalars {sorted(_STATE_SCALARS)}")
    state["has_meta"] = has_meta
    state["meta_form"] = form
    return state
