"""A bundle's graph on a chosen backend, with recurrent state carried between steps.

``Model.step(x)`` is the streaming call: one bin in, one output out, state kept.
For a recurrent graph the state outputs are copied into the state inputs after
every step (in place, no allocation); ``reset()`` zeroes the state. A graph with
several data inputs takes them by position or by name (``step(obs, goal)``,
``step(obs=..., goal=...)``); an input left out keeps the value it was last given
(``set_input`` sets one, a goal or a mode, between steps). ``feed(frame)`` drives a
graph whose input is a window over a stream (``TensorSpec.window``): one frame in,
and the model runs when the window is due (see ``closedloop.runtime.window``).

Backends disagree on a non-finite input (Numba propagates a NaN, ONNX Runtime's GRU
turns it into ordinary-looking numbers), so the model guards its own boundary:
``run_checked`` never runs the graph on a non-finite input and says when an output
is not finite, and ``reset_nonfinite_state`` keeps one bad step from poisoning every
later one. The checks write into preallocated masks: nothing is allocated per step.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .backends import BackendChoice, BackendOptions, choose_backend, create_backend
from .bundle import Bundle, ensure_trusted, load_bundle
from .manifest import TensorSpec
from .signing import TrustSpec
from .window import FrameWindow


class Model:
    """Run one graph of a verified bundle.

    Parameters
    ----------
    bundle
        A loaded bundle (see ``load_bundle``) or a path to one.
    backend
        A backend name (``closedloop backends`` lists them) or ``"auto"``, which times
        every available backend on this graph and keeps the fastest at p99.
    variant
        ``"fp32"``, or a variant the bundle holds (``"fp16"``, ``"int8"``, ``"fp16w"``, ``"int8w"``).
        ``None``: fp32, except that with ``backend="auto"`` the variants whose record allows an
        automatic choice (``auto_choice``, the weight-storage variants fp16w and int8w) and that are
        within their tolerance are timed too, and the fastest is kept if it is clearly faster than
        fp32 (``model.variant`` and ``model.choice`` say which). ``"fp32"`` rules the variants out.
    trust
        Public key files or folders of ``*.pub`` files: refuse a bundle none of them signed
        (docs/bundle.md, "Signatures and integrity"). ``None``: unsigned bundles load.
    """

    def __init__(
        self,
        bundle: Bundle | str | Path,
        backend: str = "auto",
        graph: str = "main",
        variant: str | None = None,
        options: BackendOptions | None = None,
        trust: TrustSpec = None,
    ):
        self.bundle = ensure_trusted(bundle, trust) if isinstance(bundle, Bundle) else load_bundle(bundle, trust=trust)
        self.spec = self.bundle.graph(graph)
        self.graph_name, self.variant = graph, variant
        picks = auto_variants(self.spec.variants) if backend == "auto" and variant is None else []
        if picks:
            paths = {"fp32": self.bundle.graph_path(graph)} | {v: self.bundle.graph_path(graph, v) for v in picks}
            self.backend, self.choice = choose_backend(paths, self.spec, options)
            self.variant = None if self.choice.variant == "fp32" else self.choice.variant
        else:
            path = self.bundle.graph_path(graph, variant)
            self.backend, self.choice = create_backend(backend, path, self.spec, options)
        self.inputs = self.backend.inputs
        self.outputs = self.backend.outputs
        self._pairs = [(self.inputs[t.name], self.outputs[t.state_pair or ""]) for t in self.spec.state_inputs]
        # where each state starts and resets: zeros, or the bundle's learned initial state (schema version 3)
        self._initial = [_initial_state(t, state_in) for t, (state_in, _) in zip(self.spec.state_inputs, self._pairs,
                                                                                  strict=True)]
        self._data_names = [t.name for t in self.spec.data_inputs]
        self._x = self.inputs[self._data_names[0]]
        self._y = self.outputs[self.spec.data_outputs[0].name]
        # inputs never given a value: a step refuses to run on their zeros (checked until all are given)
        self._unset = set(self._data_names)
        self._windows = {t.name: FrameWindow(self.inputs[t.name][:1], t.window.length, t.window.hop, t.window.layout)
                         for t in self.spec.data_inputs if t.window is not None}
        self._run = self.backend.run
        self._input_checks = _finite_checks(self.inputs[t.name] for t in self.spec.data_inputs)
        self._output_checks = _finite_checks(self.outputs[t.name] for t in self.spec.data_outputs)
        self._state_checks = _finite_checks(state_in for state_in, _ in self._pairs)
        self.reset()

    @property
    def backend_name(self) -> str:
        return self.backend.name

    @property
    def output(self) -> np.ndarray:
        """The first data output: the array :meth:`step` returns, overwritten in place by every step.

        Read it after a step (a session records it); copy it to keep it past the next step.
        """
        return self._y

    @property
    def choice_report(self) -> BackendChoice:
        return self.choice

    def reset(self) -> None:
        """Put the recurrent state at its start (zeros, or the bundle's initial state) and empty every window
        (start of a trial or session)."""
        for (state_in, _), initial in zip(self._pairs, self._initial, strict=True):
            if initial is None:
                state_in.fill(0)
            else:
                np.copyto(state_in, initial)
        for window in getattr(self, "_windows", {}).values():
            window.reset()

    def window(self, name: str) -> FrameWindow | None:
        """The window over a stream that feeds input ``name`` (None when the input has none)."""
        return self._windows.get(name)

    @property
    def unset_inputs(self) -> set[str]:
        """Data inputs never given a value (a held goal whose first message has not come): empty once all have."""
        return self._unset

    @property
    def input_names(self) -> list[str]:
        """The data inputs (recurrent state excluded), in the order ``step`` takes them."""
        return list(self._data_names)

    def set_input(self, name: str, value: np.ndarray | list[float] | float) -> None:
        """Give data input ``name`` a value it keeps until set again (a goal, a mode)."""
        buf = self._input_buffer(name)
        arr = np.asarray(value, dtype=buf.dtype)
        if arr.size != buf.size:  # one value for a goal of two is a typo, not a broadcast
            raise ValueError(_shape_error(self.spec.input(name), buf, arr.shape))
        try:
            np.copyto(buf, arr)
        except ValueError:
            raise ValueError(_shape_error(self.spec.input(name), buf, arr.shape)) from None
        self._unset.discard(name)

    def _input_buffer(self, name: str) -> np.ndarray:
        if name not in self._data_names:
            state = [t.name for t in self.spec.state_inputs]
            raise ValueError(f"the model has no data input {name!r}; its inputs: {self._data_names}"
                           + (f" (recurrent state {state} is carried by the model)" if state else ""))
        return self.inputs[name]

    def _assign(self, args: tuple, kwargs: dict) -> None:
        if len(args) > len(self._data_names):
            raise TypeError(f"step() takes {len(self._data_names)} input(s) {self._data_names}, got {len(args)}")
        if len(args) == 1 and not kwargs:
            roles = {t.name: self.spec.role_of(t) for t in self.spec.data_inputs}
            first = self._data_names[0]
            measured = [n for n, r in roles.items() if r == "measurement"]
            if roles[first] != "measurement" and len(measured) == 1:
                # a loop that holds a goal and calls step(obs) would write the observation into the goal silently
                raise TypeError(
                    f"step() got one input by position: it would set {first!r} (role {roles[first]!r}), the graph's "
                    f"first data input, not its measurement {measured[0]!r}, which a session feeds. Name it: "
                    f"step({measured[0]}=x), with {first!r} set by set_input({first!r}, value) or by name")
        for name, value in zip(self._data_names, args, strict=False):
            if name in kwargs:
                raise TypeError(f"step() got input {name!r} both by position and by name")
            self.set_input(name, value)
        for name, value in kwargs.items():
            self.set_input(name, value)
        if self._unset:
            raise ValueError(f"input(s) {sorted(self._unset)} have no value yet: pass them to step() or set them "
                             f"with set_input() (the model's inputs: {self._data_names})")

    def run(self) -> None:
        """One step on whatever is in ``inputs``; state carried forward."""
        self._run()
        for state_in, state_out in self._pairs:
            np.copyto(state_in, state_out)

    def reset_nonfinite_state(self) -> bool:
        """Reset the recurrent state (to its start) if any of it is not finite; return whether it did."""
        if _all_finite(self._state_checks):
            return False
        self.reset()
        return True

    def run_checked(self) -> str | None:
        """``run`` behind the non-finite guard; return ``None``, or which side was not finite.

        ``"input"``: a data input is not finite. The graph is not run, so the state is
        as it was before, and the data outputs are set to NaN (every backend alike).
        ``"output"``: the inputs were finite but an output is not; the state may be
        too (see ``reset_nonfinite_state``). Either way the outputs must not be acted on.
        """
        if not _all_finite(self._input_checks):
            for y, _ in self._output_checks:
                y.fill(np.nan)
            return "input"
        self.run()
        return None if _all_finite(self._output_checks) else "output"

    def prewarm(self) -> None:
        """Run the graph once without committing its state, to bring weights and code
        back into the caches just before a deadline (pass it to the loop's ``prewarm``).

        The backend computes from the current inputs into its output buffers; the state
        inputs are untouched (state is copied only in ``run``), and the next real step
        overwrites the outputs, so nothing a caller sees changes.
        """
        self._run()

    def step(self, *inputs: np.ndarray, **named: np.ndarray) -> np.ndarray:
        """Copy the inputs in, step, and return the first data output.

        ``step(x)`` sets the first data input; a graph with several takes them by position
        (in ``input_names`` order) or by name, and an input left out keeps its last value. One value by
        position where the first data input is not the measurement (``forward(goal, obs)``) is refused: name it.
        A windowed input takes its whole window here (offline use); ``feed`` streams frames.
        The returned array is the backend's buffer: it is overwritten by the next step.
        A non-finite input does not raise: the graph is not run, the state is kept, and
        the output is all NaN. A step whose output is not finite zeroes the recurrent
        state if that became non-finite, so the next finite input gives a finite output.
        Check the result with ``np.isfinite`` before acting on it (a session does).
        """
        if len(inputs) == 1 and not named and len(self._data_names) == 1:
            try:
                np.copyto(self._x, inputs[0], casting="same_kind")
            except (ValueError, TypeError):
                raise ValueError(_shape_error(self.spec.data_inputs[0], self._x, np.shape(inputs[0]))) from None
            self._unset.clear()
        else:
            self._assign(inputs, named)
        if self.run_checked() == "output":
            self.reset_nonfinite_state()
        return self._y

    def feed(self, frame: np.ndarray, input: str | None = None) -> np.ndarray | None:
        """Stream one frame into a windowed input (the first one unless ``input`` names another).

        Returns the first data output when the window was due and the model ran (after
        the first ``length`` frames, then every ``hop`` frames), otherwise None. Other
        inputs keep the values given with ``set_input``.
        """
        name = input or next(iter(self._windows), None)
        if name is None or name not in self._windows:
            raise ValueError(f"feed() streams frames into a windowed input; "
                             f"{'this model has none' if not self._windows else f'windowed inputs: {list(self._windows)}'}"
                             " (use step())")
        window = self._windows[name]
        try:
            due = window.push(np.asarray(frame))
        except ValueError as exc:
            spec = self.spec.input(name)
            assert spec.window is not None  # only windowed inputs have a FrameWindow
            raise ValueError(f"input {name!r} ({spec.window.layout} window of {spec.window.length} frames, shape "
                             f"{spec.shape}): {exc}; the frame shape it takes is {spec.frame_shape}") from None
        if not due:
            return None
        self._unset.discard(name)
        if self._unset:
            raise ValueError(f"input(s) {sorted(self._unset)} have no value yet: set them with set_input() "
                             f"(the model's inputs: {self._data_names})")
        if self.run_checked() == "output":
            self.reset_nonfinite_state()
        return self._y

    def close(self) -> None:
        self.backend.close()


def _initial_state(t: TensorSpec, state_in: np.ndarray) -> np.ndarray | None:
    """A state input's initial value shaped like the backend's buffer (its batch), or None for zeros."""
    if t.initial is None:
        return None
    axis = t.batch_axis
    value = t.initial_value(state_in.shape[axis] if axis is not None else 1)
    if value.shape != state_in.shape:
        raise ValueError(f"state input {t.name!r}: initial value of shape {value.shape} for a buffer of "
                         f"{state_in.shape}")
    return value


def auto_variants(variants: dict[str, dict]) -> list[str]:
    """The variants an automatic choice may take: records with ``auto_choice`` that are within tolerance."""
    return [name for name, record in variants.items()
            if record.get("auto_choice") is True and record.get("within_tolerance") is True]


def _finite_checks(arrays) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(array, mask)`` pairs for the floating arrays among ``arrays`` (integers are always finite)."""
    return [(a, np.empty(a.shape, dtype=bool)) for a in arrays if a.dtype.kind in "fc"]


def _all_finite(checks: list[tuple[np.ndarray, np.ndarray]]) -> bool:
    for a, mask in checks:
        if not np.isfinite(a, out=mask).all():
            return False
    return True


def _shape_error(spec, buf: np.ndarray, got: tuple) -> str:
    axis = spec.batch_axis
    other_batch = (axis is not None and len(got) == buf.ndim and got[axis] != buf.shape[axis]
                   and all(g == b for i, (g, b) in enumerate(zip(got, buf.shape, strict=True)) if i != axis))
    hint = (f"; this model runs {buf.shape[axis]} at a time: for batches of {got[axis]}, load it with "
            f"Model(bundle, options=BackendOptions(batch={got[axis]})) (closedloop.runtime.BackendOptions)"
            if other_batch else "")
    return (f"input {spec.name!r} takes shape {tuple(buf.shape)} ({buf.size} value{'' if buf.size == 1 else 's'}; "
            f"manifest {spec.shape}), got shape {tuple(got)}; pass an array of that shape (batch first){hint}")
