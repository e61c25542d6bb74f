"""The generic family: normalise, run, scale and clip. Used by plain exported models.

Manifest fields it reads (all optional):

- ``preprocess.mean`` / ``preprocess.std``: per-feature normalisation ``(x - mean) / std``.
- ``postprocess.scale`` / ``postprocess.offset``: ``y * scale + offset`` (action scaling).
- ``postprocess.low`` / ``postprocess.high``: clip limits of the command actually sent.
- ``postprocess.safe_output``: the safe command (default zeros). A joint-*position* command on a ``joint_state``
  stream that states none holds the joints where they were last measured instead (zeros would drive every joint
  to 0 rad), and sends no safe command before the stream's first finite positions.
- ``postprocess.output``: which graph output is the command (default the first data output).
- ``extra.session.input`` / ``extra.session.command``: what the device streams and what
  is sent back (see ``closedloop.runtime.families.io``). Unstated, they follow the device's HELLO
  kind (a headstage: neural frames in, decoder outputs out; a plant: measurements in,
  actuator commands out) and otherwise default to plant measurement in, actuator
  command out. Neural frames are all processed in order (every bin); other inputs
  are acted on newest-first, once per period.
- ``extra.session.inputs``: ``{INPUT: INPUT_KIND}``, a message type that sets a held input
  (a goal, a mode) whenever the device sends one.

The device's stream feeds the input whose role is ``measurement`` (by default the first);
``preprocess`` normalises each frame. When that input has a ``window``, every frame goes
into the window (in order) and the model runs once every ``hop`` frames; the frames in
between send nothing. Other data inputs are held: set from the session's ``inputs`` or by
their message type.
"""

from __future__ import annotations

import numpy as np

from closedloop.runtime.families.base import FamilyPlugin, limit_order_problems, measurement_input
from closedloop.runtime.families.registry import register_family


def _vec(d: dict, key: str, n: int, default: float) -> np.ndarray:
    v = np.asarray(d.get(key, default), dtype=np.float32)
    if v.ndim == 0:
        v = np.full(n, float(v), dtype=np.float32)
    if v.shape != (n,):
        raise ValueError(f"{key} has shape {v.shape}, expected ({n},) to match the graph")
    return v


#: the postprocess fields the generic family reads
POSTPROCESS_KEYS = ("scale", "offset", "low", "high", "safe_output", "output")


@register_family
class GenericFamily(FamilyPlugin):
    name = "generic"
    session_from_device = True

    @property
    def consume(self) -> str:  # type: ignore[override]
        # Neural bins are a time series the model integrates (a decoder's state must see every bin), and
        # so is any stream a window is made of; a controller acts on the newest measurement and never
        # falls behind.
        return "all" if self.input_name == "neural_frame" or self.measurement.window is not None else "newest"

    @classmethod
    def problems(cls, bundle) -> list[str]:
        out = []
        spec = bundle.graph()
        if not spec.data_inputs or not spec.data_outputs:
            return ["generic family: the main graph needs one data input and one data output"]
        try:
            measurement = measurement_input(spec)
        except ValueError as exc:
            return [f"generic family: {exc}"]
        n_in = int(np.prod(measurement.frame_shape))
        y = spec.data_outputs[0]
        if len(y.shape) < 2:
            return [f"generic family: output {y.name!r} has shape {y.shape}, one value per batch row and no feature "
                    "axis; a command is (batch, n): return y.unsqueeze(-1) (or y.reshape(y.shape[0], -1)) from forward"]
        n_out = y.shape[-1]
        post = bundle.manifest.postprocess
        unknown = sorted(set(post) - set(POSTPROCESS_KEYS))
        if unknown:
            out.append(f"generic family: postprocess.{', postprocess.'.join(unknown)}: not a field this family reads "
                       f"({', '.join(POSTPROCESS_KEYS)}); a misspelt limit would leave the command unclipped")
        names = [t.name for t in spec.data_outputs]
        if "output" in post and post["output"] not in names:
            state = [t.name for t in spec.outputs if t.name not in names]
            out.append(f"generic family: postprocess.output {post['output']!r} is not one of the graph's data outputs "
                       f"({', '.join(names)})" + (f"; {', '.join(state)} carry the recurrent state, not a command"
                                                  if post["output"] in state else ""))
            return out
        if "output" in post:
            y = next(t for t in spec.data_outputs if t.name == post["output"])
            if len(y.shape) < 2:
                return out + [f"generic family: output {y.name!r} has shape {y.shape}: no feature axis for a command"]
            n_out = y.shape[-1]
        for k in ("scale", "offset", "low", "high", "safe_output"):
            v = post.get(k)
            items = v if isinstance(v, list) else [v]
            if k in post and not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in items):
                out.append(f"generic family: postprocess.{k} is {v!r}: give a number or a list of numbers (nothing is "
                           "coerced: a string or a boolean is not read as a number)")
        if "low" in post and "high" in post and not out:
            out += [f"generic family: {p}" for p in limit_order_problems(post["low"], post["high"])]
        for section, keys, n in (
            (bundle.manifest.preprocess, ("mean", "std"), n_in),
            (bundle.manifest.postprocess, ("scale", "offset", "low", "high", "safe_output"), n_out),
        ):
            for k in keys:
                if k in section:
                    try:
                        _vec(section, k, int(n), 0.0)
                    except (ValueError, TypeError) as exc:
                        out.append(f"generic family: {exc}")
        std = bundle.manifest.preprocess.get("std")
        if std is not None and np.any(np.asarray(std, dtype=np.float64) <= 0):
            out.append("generic family: preprocess.std has values <= 0; normalisation would divide by zero")
        return out

    def __init__(self, bundle, model):
        super().__init__(bundle, model)
        pre, post = bundle.manifest.preprocess, bundle.manifest.postprocess
        m = self.measurement
        x = model.inputs[m.name]
        # where a normalised frame goes: straight into the model input, or into a frame that feeds the window
        self._x = x if m.window is None else np.zeros(self._frame.size, dtype=x.dtype)
        self._window = model.window(m.name)
        out_name = post.get("output", model.spec.data_outputs[0].name)
        self._y = model.outputs[out_name]
        n_in, n_out = self._x.shape[-1], self._y.shape[-1]
        self._mean = _vec(pre, "mean", n_in, 0.0)
        self._inv_std = (1.0 / _vec(pre, "std", n_in, 1.0)).astype(np.float32)
        self._scale = _vec(post, "scale", n_out, 1.0)
        self._offset = _vec(post, "offset", n_out, 0.0)
        self._low = _vec(post, "low", n_out, -np.inf)
        self._high = _vec(post, "high", n_out, np.inf)
        # the safe command obeys the limits like any other (docs/protocol.md): a safe_output outside them is clipped
        self._safe = np.clip(_vec(post, "safe_output", n_out, 0.0), self._low, self._high).astype(np.float32)
        self._cmd = np.zeros(self._y.shape, dtype=np.float32)
        # a position command with no stated safe pose holds the measured one: the joints' positions come first in a
        # joint_state frame (docs/bundle.md); None where this does not apply
        self._hold: np.ndarray | None = None
        if (self.command_name == "joint_position" and self.input_name == "joint_state" and "safe_output" not in post
                and self._frame.size == 2 * n_out):
            self._hold = np.zeros(n_out, dtype=np.float32)
        self._seen = False

    def reset(self) -> None:
        super().reset()
        self._seen = False  # a device's re-handshake may follow a reboot that moved the arm

    def preprocess(self, frame: np.ndarray) -> None:
        hold = self._hold
        if hold is not None:  # the raw frame: a joint_state's positions come first
            q = frame.reshape(-1)[: hold.size]
            if np.isfinite(q).all():  # the safe command holds the last finite positions, never a NaN
                np.clip(q, self._low, self._high, out=hold)
                self._seen = True
        np.subtract(frame, self._mean, out=self._x)
        np.multiply(self._x, self._inv_std, out=self._x)
        if self._window is not None:
            self._due = self._window.push(self._x)

    def postprocess(self) -> np.ndarray:
        np.multiply(self._y, self._scale, out=self._cmd)
        np.add(self._cmd, self._offset, out=self._cmd)
        np.clip(self._cmd, self._low, self._high, out=self._cmd)
        return self._cmd

    def safe_output(self) -> np.ndarray:
        return np.broadcast_to(self._safe if self._hold is None else self._hold, self._cmd.shape)

    def safe_message(self, step: int):
        """The safe command; for a joint-position command that holds the measured pose, None until the stream's
        first finite positions (the session's start, or a device's re-handshake): any fixed pose would move the
        arm."""
        if self._hold is not None and not self._seen:
            return None
        return super().safe_message(step)

    def command_limits(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        post = self.bundle.manifest.postprocess
        if "low" not in post and "high" not in post:
            return None, None
        return self._low, self._high
