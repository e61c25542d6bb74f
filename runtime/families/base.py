"""The family plug-in interface: what a model family adds to a session.

A family (BCI decoder, observer, RL policy, ...) owns the steps around the model:
``preprocess`` turns the newest device frame into the model's input buffer,
``postprocess`` turns the model's outputs into the command to send, ``safe_output``
is what the actuators get when the session must stop acting, ``live_metrics`` feeds
the status line, and ``problems`` runs family-specific checks at bundle load (an
observer re-checks its stability certificate there). All per-step methods work in
preallocated buffers. ``guarded_step`` is the whole step as a session takes it: a
non-finite model input, model output or command is reported, never returned to act on,
and ``recover_nonfinite`` then puts state that became non-finite back to its start.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from .io import DEVICE_ACCEPTS, DEVICE_SESSION_DEFAULTS, DEVICE_STREAMS, command_kind, input_kind

if TYPE_CHECKING:
    from closedloop.firmware_bridge import Hello, Message

    from ..bundle import Bundle
    from ..manifest import GraphSpec, TensorSpec
    from ..model import Model


def measurement_input(spec: GraphSpec) -> TensorSpec:
    """The data input a device's stream feeds: the one whose role is ``measurement`` (by default the first)."""
    found = [t for t in spec.data_inputs if spec.role_of(t) == "measurement"]
    if len(found) != 1:
        raise ValueError(f"the graph needs exactly one data input with role 'measurement' (the device's stream), "
                         f"found {[t.name for t in found]}; roles: "
                         f"{ {t.name: spec.role_of(t) for t in spec.data_inputs} }")
    return found[0]


_NO_STATE = np.zeros(0, dtype=np.float32)


def limit_problems(low: np.ndarray, high: np.ndarray, hello: Hello, names: tuple[str, ...] = ()) -> list[str]:
    """Each command value whose bundle limit lies outside the device's (HELLO ``command_low/high``, same size), named
    ``command i`` (with ``names[i]`` beside it where given)."""
    def what(i: Any) -> str:
        return f"command {i} ({names[i]})" if names else f"command {i}"

    return ([f"{what(i)}: bundle low limit {low[i]:g} is below the device's {hello.command_low[i]:g}"
             for i in np.flatnonzero(low < hello.command_low - 1e-6)]
            + [f"{what(i)}: bundle high limit {high[i]:g} is above the device's {hello.command_high[i]:g}"
               for i in np.flatnonzero(high > hello.command_high + 1e-6)])


def held_input_names(spec: GraphSpec) -> list[str]:
    """The graph's data inputs a session holds (set from its config or by a message type), not streamed."""
    streamed = measurement_input(spec).name
    return [t.name for t in spec.data_inputs if t.name != streamed]


def held_value_problem(name: str, value: Any) -> str | None:
    """Why ``value`` cannot be held input ``name`` for a session (a NaN, an infinity, beyond float32), or None: held
    for the whole session, such a value would make every step refused, the safe command only, with no word why."""
    with np.errstate(over="ignore"):
        as_f32 = np.asarray(value, dtype=np.float64).astype(np.float32)
    if np.isfinite(as_f32).all():
        return None
    return (f"session input {name!r} = {value!r}: every value must be a finite number a float32 holds (NaN, inf "
            "and values beyond 3.4e38 are not)")


def limit_order_problems(low: Any, high: Any, low_name: str = "postprocess.low",
                         high_name: str = "postprocess.high") -> list[str]:
    """Each command value whose low limit is not below its high one (equal, reversed or NaN): clipped to such
    limits, every command, the safe one included, would be one value, of the wrong sign where they are reversed."""
    try:
        lo, hi = np.broadcast_arrays(np.asarray(low, dtype=np.float64).ravel(), np.asarray(high, dtype=np.float64).ravel())
    except (TypeError, ValueError):
        return []  # the shapes or types are another check's to name
    bad = np.flatnonzero(~(lo < hi))
    out = [f"{low_name}[{i}] {lo[i]:g} is not below {high_name}[{i}] {hi[i]:g}: clipped to them every command "
           "(the safe one too) would be one value" + (", of the wrong sign" if lo[i] > hi[i] else "")
           + "; give low < high for each command value" for i in bad[:3]]
    if bad.size > 3:
        out.append(f"... and {bad.size - 3} more command values with low not below high")
    return out


def _window_hint(spec: Any, frame_size: int) -> str:
    """An input exported without a window whose shape holds the device's frame along one axis beside another:
    likely a window over the stream exported as one tensor; say how to export it."""
    dims = [d for d in spec.shape[1:] if isinstance(d, int)]
    if spec.window is not None or len(dims) != 2 or frame_size not in dims:
        return ""
    at = dims.index(frame_size)
    layout, length = ("time_major", dims[0]) if at == 1 else ("channel_major", dims[1])
    return (f"; if it is a window of {length} frames of {frame_size} values, export it with "
            f"windows={{{spec.name!r}: Window(length={length}, layout={layout!r})}} (docs/bundle.md, 'Windows')")


class FamilyPlugin:
    """Base class; subclasses register with ``@register_family``."""

    name: ClassVar[str]
    #: The device clock (microseconds) of the input frame being acted on: the session sets it before each
    #: ``guarded_step`` (the frame header's ``timestamp_us``, docs/protocol.md); None outside a session.
    frame_time_us: int | None = None
    #: Session defaults, overridable per bundle in ``manifest.extra["session"]``.
    default_input: ClassVar[str] = "plant_measurement"
    default_command: ClassVar[str] = "actuator_command"
    #: "newest": act once per period on the newest input frame (control: never fall
    #: behind); "all": process every frame in order (a decoder needs every bin; an observer's
    #: state must advance one sample period per measurement, or its dt is wrong).
    consume: ClassVar[str] = "newest"
    #: With ``consume = "all"``: send a command for every frame (a decoder's output per bin), or only for the
    #: newest frame of a step, the older ones updating the family's state alone (an observer catching up after a
    #: late step: one command, computed from the estimate that has seen every measurement).
    command_each_frame: ClassVar[bool] = True
    #: A bundle that does not name its session input/command takes them from the device's HELLO kind
    #: (``DEVICE_SESSION_DEFAULTS``) instead of the class defaults: for plain exports, whose family
    #: cannot know whether it decodes a headstage or controls a plant.
    session_from_device: ClassVar[bool] = False

    def __init__(self, bundle: Bundle, model: Model):
        self.bundle = bundle
        self.model = model
        session: dict[str, Any] = bundle.manifest.extra.get("session", {})
        self._session_stated = {k for k in ("input", "command") if k in session}
        self.input_name = session.get("input", self.default_input)
        self.command_name = session.get("command", self.default_command)
        self.input = input_kind(self.input_name)
        self.command = command_kind(self.command_name)
        #: the data input the device's stream feeds (its role is ``measurement``); a window over
        #: the stream when the manifest gives it one
        self.measurement = measurement_input(model.spec)
        self._frame = np.zeros(int(np.prod(self.measurement.frame_shape)), dtype=np.float32)
        #: the newest input frame's own bin number (a NEURAL_FRAME's bin_index), None for a stream without one:
        #: a DECODER_OUTPUT answers that bin, not the loop's step (a step catching up answers several)
        self._frame_bin: int | None = None
        #: why ``guarded_step`` last returned ``"size"``
        self.refused_reason = ""
        self._command_mask = np.zeros(0, dtype=bool)
        #: whether this frame's step ran the model (a windowed input runs it every ``hop`` frames)
        self._due = True
        self._side = self._side_inputs(session.get("inputs", {}))

    @property
    def frame_vector(self) -> np.ndarray:
        """The newest device frame as the family read it (float32, flat): what a monitor shows as the input."""
        return self._frame

    @property
    def state_vector(self) -> np.ndarray:
        """What the family computes outside the graph, after the step's model run (flat, a live buffer read on the
        loop's path): published in the step ring, the recording's FAMILY_STATE records and the monitor, named by
        ``state_labels``. Empty by default; the observer gives its estimate."""
        return _NO_STATE

    def state_labels(self) -> list[str]:
        """One ``GROUP/NAME`` label per value of ``state_vector``, e.g. ``state/x1``, ``disturbance/d1``: the
        monitor draws each GROUP in a band of its own (docs/families.md)."""
        return []

    @classmethod
    def problems(cls, bundle: Bundle) -> list[str]:
        """Family-specific reasons to refuse this bundle (empty if none)."""
        return []

    def reset(self) -> None:
        """Start of a session or trial: clear per-session state."""
        self.model.reset()
        self._frame_bin = None
        self.frame_time_us = None

    def preprocess(self, frame: np.ndarray) -> None:
        """Write the model input for this step from the newest device frame."""
        raise NotImplementedError

    def postprocess(self) -> np.ndarray:
        """Return the command for this step (a preallocated array)."""
        raise NotImplementedError

    def safe_output(self) -> np.ndarray:
        """The command that puts actuators in a safe state."""
        raise NotImplementedError

    def on_command_sent(self, values: np.ndarray) -> None:
        """The session sent a command with these values (the model's, or the safe one): what the device applies
        next. Default: nothing to keep (an observer keeps it for devices that do not report what they applied)."""

    def live_metrics(self) -> dict[str, float | str]:
        return {}

    def summary_metrics(self) -> dict[str, float | str | list[float]]:
        """What the session summary reports for this family (default: the live metrics)."""
        return dict(self.live_metrics())

    def typed_count(self) -> int:
        """Characters of text this family has typed since its last reset; -1 for a family that types none."""
        return -1

    def typed_resets(self) -> int:
        """How many times the typed text was reset (a new trial, a re-handshake); 0 for a family that types none."""
        return 0

    def typed_last(self) -> str:
        """What the last model run typed ('' for nothing); read on the loop's path, so it allocates nothing."""
        return ""

    def typed_tail(self, n: int) -> str:
        """The newest ``n`` typed characters, as people read them (a family that types text overrides it)."""
        return ""

    # --- session hooks -------------------------------------------------------------

    def adopt_device(self, kind: str) -> None:
        """At the first handshake (or replaying its recording): a bundle that leaves its session input/command
        unstated (and whose family allows it) reads and sends what a device of this HELLO ``kind`` streams and
        accepts. A later HELLO is checked against that choice (``check_device``), never adopted again."""
        defaults = DEVICE_SESSION_DEFAULTS.get(kind) if self.session_from_device else None
        if defaults is None:
            return
        if "input" not in self._session_stated:
            self.input_name, self.input = defaults[0], input_kind(defaults[0])
        if "command" not in self._session_stated:
            self.command_name, self.command = defaults[1], command_kind(defaults[1])

    def _kind_problems(self, hello: Hello) -> list[str]:
        """A device of a known kind that does not stream the bundle's input or take its command."""
        streams, accepts = DEVICE_STREAMS.get(hello.kind), DEVICE_ACCEPTS.get(hello.kind)
        # The bundle may be right and the device the wrong one: name the devices that fit it first
        fits = [k for k, st in DEVICE_STREAMS.items()
                if self.input_name in st and self.command_name in DEVICE_ACCEPTS.get(k, ())]
        fix = (f"; run it against a {' or '.join(fits)} device (the emulator: "
               f"{' or '.join(f'sim://{k}' for k in fits)}), or, if the bundle should read this device," if fits
               else "; if the bundle should read this device,")
        fix += (" state its session at export: extra={'session': {'input': ..., 'command': ...}} "
                "(docs/bundle.md, 'Session block')")
        out = []
        if streams is not None and self.input_name not in streams:
            if hello.name.startswith("lsl:") and self.input_name in ("neural_frame", "plant_measurement"):
                # an LSL stream's kind comes from its type or the URL: the fix is there, not in the bundle
                want = "headstage" if self.input_name == "neural_frame" else "plant"
                fix = (f"; an LSL stream is read as a {want} with kind={want} in its URL "
                       f"(lsl://{hello.name[4:]}?kind={want}, docs/lsl.md)")
            out.append(f"device {hello.kind!r} streams {' or '.join(streams)}, the bundle reads {self.input_name}{fix}")
        if accepts is not None and self.command_name not in accepts:
            out.append(f"device {hello.kind!r} takes {' or '.join(a for a in accepts if a != 'none')}, "
                       f"the bundle sends {self.command_name}{'' if out else fix}")  # the fix once
        return out

    def check_device(self, hello: Hello) -> list[str]:
        """Reasons this device cannot run this bundle, each naming both values."""
        problems = self._kind_problems(hello)
        n_in = self._frame.size
        if self.input.size_field and getattr(hello, self.input.size_field) != n_in:
            m = self.measurement
            takes = (f"a {m.window.layout} window of {m.window.length} frames of {n_in} values (shape {m.shape})"
                     if m.window is not None else f"frames of {n_in} values (shape {m.shape})")
            got = getattr(hello, self.input.size_field)
            problems.append(
                f"device {hello.kind!r} streams frames of {self.input.size_field}={got}, "
                f"the bundle's input {m.name!r} takes {takes}" + _window_hint(m, got)
            )
        rate = self.bundle.manifest.rate_hz
        if hello.rate_hz and abs(hello.rate_hz - rate) > 0.01 * rate:
            problems.append(f"device streams at {hello.rate_hz:g} Hz, the bundle runs at {rate:g} Hz")
        low, high = self.command_limits()
        if self.command.message is not None and self.command.hello_limits and hello.command_low.size:
            if low is None or high is None or low.size != hello.command_low.size:
                problems.append(
                    f"device takes {hello.command_low.size} command values within limits, the bundle "
                    + ("states no command limits (postprocess.low/high)" if low is None else f"sends {low.size}"))
            else:
                problems += limit_problems(low, high, hello)
        return problems

    def command_limits(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The clip limits of the command actually sent, if the bundle states them."""
        return None, None

    def on_message(self, message: Message) -> None:
        """Turn one input message into the model input (``preprocess``)."""
        self.input.to_vector(message, self._frame)
        self._frame_bin = getattr(message, "bin_index", None)
        self.preprocess(self._frame)

    # --- inputs the device does not stream ---------------------------------------------

    def _side_inputs(self, mapping: dict[str, str]) -> dict[type, tuple[str, Any, np.ndarray]]:
        """``extra.session.inputs``: data input name -> the input kind (message type) that sets it."""
        side: dict[type, tuple[str, Any, np.ndarray]] = {}
        names = [t.name for t in self.model.spec.data_inputs]
        for name, kind_name in mapping.items():
            if name not in names or name == self.measurement.name:
                raise ValueError(f"extra.session.inputs names {name!r}, which is not one of the inputs the session "
                                 f"sets ({[n for n in names if n != self.measurement.name]})")
            kind = input_kind(kind_name)
            side[kind.message] = (name, kind, np.zeros(self.model.inputs[name].shape, dtype=np.float32))
        return side

    @property
    def side_messages(self) -> tuple[type, ...]:
        """Message types (other than the streamed input's) that set a held input, e.g. a goal."""
        return tuple(self._side)

    def on_side_message(self, message: Message) -> None:
        """A message that sets a held input (``extra.session.inputs``): write it into that input."""
        name, kind, buf = self._side[type(message)]
        kind.to_vector(message, buf)
        self.model.set_input(name, buf)

    def held_inputs(self) -> list[str]:
        """Data inputs the session holds (set from its config or a side message), not streamed."""
        return held_input_names(self.model.spec)

    def set_held_inputs(self, values: dict[str, Any]) -> None:
        """Give held inputs their values (``SessionConfig.inputs``); refuse unknown names and any held
        input left with no value and no message to set it."""
        held = self.held_inputs()
        unknown = sorted(set(values) - set(held))
        if unknown:
            raise ValueError(f"session inputs {unknown} are not inputs this bundle holds; it holds {held}"
                             + (f" (its input {self.measurement.name!r} comes from the device)" if
                                self.measurement.name in unknown else ""))
        for name, value in values.items():
            problem = held_value_problem(name, value)
            if problem:
                raise ValueError(problem)
            self.model.set_input(name, value)
        by_message = {name for name, _, _ in self._side.values()}
        missing = [n for n in held if n not in values and n not in by_message]
        if missing:
            specs = {t.name: t for t in self.model.spec.data_inputs}
            raise ValueError(
                "; ".join(f"input {n!r} (role {self.model.spec.role_of(specs[n])}, shape {specs[n].shape}) is not "
                          "streamed by the device and has no value" for n in missing)
                + ": give it with SessionConfig(inputs={NAME: [...]}) or `closedloop run --input NAME=v1,v2,...`, "
                "or map a message type to it at export (extra={'session': {'inputs': {NAME: 'plant_measurement'}}})"
                + self._looks_like_state([specs[n] for n in missing]))

    def _looks_like_state(self, inputs: list[TensorSpec]) -> str:
        """A hint where a held input has an output of its shape: it is likely a recurrent state not declared as one."""
        names = {t.name for t in inputs}
        hints = [f"{i}={o}" for i, o in self.model.spec.state_like_pairs() if i in names]
        if not hints:
            return ""
        return (f". If {' / '.join(h.split('=')[0] for h in hints)} is a recurrent state that an output of the same "
                f"shape feeds back, the bundle must say so: `closedloop import-onnx FILE OUT "
                f"{' '.join('--state ' + h for h in hints)}`, or export_bundle(..., kind='recurrent') with "
                "init_state and step (docs/workflow.md)")

    def model_due(self) -> bool:
        """Whether the model runs on this frame (always, unless a window over the stream is not due)."""
        return self._due

    def guarded_step(self, message: Message) -> tuple[np.ndarray | None, str | None]:
        """One input message through ``on_message``, the model and ``postprocess``, guarded.

        Returns ``(command, None)``; ``(None, None)`` when the model did not run on this
        frame (a window over the stream that is not due: nothing to send); ``(None, "held")`` while a
        held input (a goal set by a message) has had no value yet; or ``(None, "input")`` when the model input (after
        preprocessing) is not finite, and ``(None, "output")`` when the model output or the
        command is not. Then nothing of this step may be acted on: send the safe command
        and call ``recover_nonfinite``. ``postprocess`` never sees a non-finite model output
        (its clip would turn +inf into the high limit, a command that looks fine). ``(None, "size")``: the frame
        does not have the size the device's HELLO said (``refused_reason`` says how); nothing of it was used.
        """
        try:
            self.on_message(message)
        except ValueError as exc:  # a frame of another size than the handshake's (numpy's broadcast, or a family's)
            self.refused_reason = f"{type(message).__name__} refused: {exc}"
            return None, "size"
        if not self._due:
            return None, None
        unset = self.model.unset_inputs  # checked without building a set: this is the hot path
        if unset and (len(unset) > 1 or self.measurement.name not in unset):
            return None, "held"  # a held input (a goal) has no value yet: nothing to act on
        bad = self.model.run_checked()
        if bad is not None:
            return None, bad
        command = self.postprocess()
        if command.dtype.kind in "fc":
            if self._command_mask.shape != command.shape:
                self._command_mask = np.empty(command.shape, dtype=bool)
            if not np.isfinite(command, out=self._command_mask).all():
                return None, "output"
        return command, None

    def recover_nonfinite(self) -> bool:
        """After a step ``guarded_step`` refused: reset whatever state became non-finite, so
        one bad frame does not poison every later step; return whether anything was reset.

        The default resets the model's recurrent state when it is not finite; a family
        with state of its own (the observer's estimate) extends this.
        """
        return self.model.reset_nonfinite_state()

    def _bin_index(self, step: int) -> int:
        """A DECODER_OUTPUT's ``bin_index``: the newest input frame's own bin where the stream numbers its bins
        (docs/protocol.md), the loop step otherwise; so a command never names a bin the device did not send."""
        return (self._frame_bin if self._frame_bin is not None else step) & 0xFFFFFFFF

    def command_message(self, command: np.ndarray, step: int) -> Message | None:
        """The message carrying ``command`` (its ``bin_index``: ``_bin_index``)."""
        return self.command.build(command, self._bin_index(step))

    def safe_message(self, step: int) -> Message | None:
        """The safe command's message (its ``bin_index`` as the model's commands have it)."""
        return self.command.build(np.ascontiguousarray(self.safe_output()), self._bin_index(step))
