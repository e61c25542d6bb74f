"""A bundle's graph on a chosen backend, with recurrent state carried between steps.

``Model.step(x)`` is the streaming call: one bin in, one output out, state kept.
For a recurrent graph the state outputs are copied into the state inputs after
every step (in place, no allocation); ``reset()`` zeroes the state.

Backends disagree on a non-finite input (Numba propagates a NaN, ONNX Runtime's GRU
turns it into ordinary-looking numbers), so the model guards its own boundary:
``run_checked`` never runs the graph on a non-finite input and says when an output
is not finite, and ``reset_nonfinite_state`` keeps one bad step from poisoning every
later one. The checks write into preallocated masks: nothing is allocated per step.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .backends import BackendChoice, BackendOptions, create_backend
from .bundle import Bundle, load_bundle


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
        ``None``/``"fp32"``, or a variant the bundle holds (``"fp16"``, ``"int8"``).
    """

    def __init__(
        self,
        bundle: Bundle | str | Path,
        backend: str = "auto",
        graph: str = "main",
        variant: str | None = None,
        options: BackendOptions | None = None,
    ):
        self.bundle = bundle if isinstance(bundle, Bundle) else load_bundle(bundle)
        self.spec = self.bundle.graph(graph)
        self.graph_name, self.variant = graph, variant
        path = self.bundle.graph_path(graph, variant)
        self.backend, self.choice = create_backend(backend, path, self.spec, options)
        self.inputs = self.backend.inputs
        self.outputs = self.backend.outputs
        self._pairs = [(self.inputs[t.name], self.outputs[t.state_pair or ""]) for t in self.spec.state_inputs]
        self._x = self.inputs[self.spec.data_inputs[0].name]
        self._y = self.outputs[self.spec.data_outputs[0].name]
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
        """Zero the recurrent state (start of a trial or session)."""
        for state_in, _ in self._pairs:
            state_in.fill(0)

    def run(self) -> None:
        """One step on whatever is in ``inputs``; state carried forward."""
        self._run()
        for state_in, state_out in self._pairs:
            np.copyto(state_in, state_out)

    def reset_nonfinite_state(self) -> bool:
        """Zero the recurrent state if any of it is not finite; return whether it did."""
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

    def step(self, x: np.ndarray) -> np.ndarray:
        """Copy ``x`` into the first data input, step, and return the first data output.

        The returned array is the backend's buffer: it is overwritten by the next step.
        A non-finite ``x`` does not raise: the graph is not run, the state is kept, and
        the output is all NaN. A step whose output is not finite zeroes the recurrent
        state if that became non-finite, so the next finite ``x`` gives a finite output.
        Check the result with ``np.isfinite`` before acting on it (a session does).
        """
        np.copyto(self._x, x, casting="same_kind")
        if self.run_checked() == "output":
            self.reset_nonfinite_state()
        return self._y

    def close(self) -> None:
        self.backend.close()


def _finite_checks(arrays) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(array, mask)`` pairs for the floating arrays among ``arrays`` (integers are always finite)."""
    return [(a, np.empty(a.shape, dtype=bool)) for a in arrays if a.dtype.kind in "fc"]


def _all_finite(checks: list[tuple[np.ndarray, np.ndarray]]) -> bool:
    for a, mask in checks:
        if not np.isfinite(a, out=mask).all():
            return False
    return True
