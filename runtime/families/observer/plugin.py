"""The ``observer`` family: plant measurements in, a certified state/disturbance estimate and a command out.

At load, ``problems`` re-checks the bundle's stability certificate from the bundle's own
weights (``closedloop.runtime.families.observer.certificate.check_bundle_certificate``: the ONNX initializers and the
stored ``P``, ``t``, ``lam``, ``rho``), and refuses a bundle whose graph is not the
certified network, whose weights changed after certification, or whose LMI fails, naming
the violated margin. Per measurement (a ``PlantMeasurement`` with ``y_k`` and the applied ``u_k``; every one in order,
``consume = "all"``, a command only for the newest of a step) a fused Numba kernel runs the observer and the
controller::

    r = y - Cd z_hat
    z_hat <- Ad z_hat + Bd u + Fd f(z_hat, y) + L r + N(r)      (N evaluated in the kernel)
    u_cmd  = clip(-K z_hat, u_low, u_high)

from the same float32 weights the certificate was checked on (float64 arithmetic). The
output error ``r`` is also written to the model's input, so the backend's run of the
graph gives the recorded output ``N(r)``. Manifest fields (written by
``closedloop.sdk.observer.neural.export_observer_bundle``, documented in ``docs/observer.md``):
``extra.observer`` (``Ad, Bd, Cd, L, Fd, nonlinearity, K, u_low, u_high, z0, dt``),
``manifest.certificate``, ``postprocess.low/high``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from closedloop.runtime.families.base import FamilyPlugin, limit_order_problems
from closedloop.runtime.families.observer.certificate import (
    CertificateError,
    check_bundle_certificate,
    known_nonlinearity,
    mlp_from_onnx,
)
from closedloop.runtime.families.registry import register_family

if TYPE_CHECKING:
    from closedloop.firmware_bridge import Message
    from closedloop.runtime.bundle import Bundle
    from closedloop.runtime.model import Model

BLOCK = "observer"
_ACT_CODES = {"tanh": 1, "relu": 2}


class ObserverArrays:
    """The observer's matrices from ``extra.observer``, float64 and contiguous, shape-checked."""

    def __init__(self, obs: dict[str, Any]):
        def mat(key: str, shape: tuple[int | None, ...]) -> np.ndarray:
            if key not in obs:
                raise CertificateError(f"extra.observer.{key} is missing")
            a = np.ascontiguousarray(np.asarray(obs[key], dtype=np.float64))
            if a.ndim != len(shape) or any(s is not None and s != d for s, d in zip(shape, a.shape, strict=True)):
                raise CertificateError(f"extra.observer.{key} has shape {a.shape}, expected {shape}")
            if not np.all(np.isfinite(a)):
                raise CertificateError(f"extra.observer.{key} holds non-finite values")
            return a

        self.Ad = mat("Ad", (None, None))
        nz = self.Ad.shape[0]
        self.Cd = mat("Cd", (None, nz))
        ny = self.Cd.shape[0]
        self.Bd = mat("Bd", (nz, None))
        nu = self.Bd.shape[1]
        self.L = mat("L", (nz, ny))
        self.Fd = mat("Fd", (nz, None)) if "Fd" in obs else np.zeros((nz, 0))
        self.K = mat("K", (nu, nz))
        self.u_low = mat("u_low", (nu,))
        self.u_high = mat("u_high", (nu,))
        self.z0 = mat("z0", (nz,)) if "z0" in obs else np.zeros(nz)
        nl, params = known_nonlinearity(obs.get("nonlinearity"))
        nx = self.Fd.shape[1]
        self.nl_code = nl.code
        self.nl_E = np.ascontiguousarray(np.asarray(params.get("E", np.zeros((nx, 0))), dtype=np.float64).reshape(nx, -1))
        c = self.nl_E.shape[1]
        self.nl_H = np.ascontiguousarray(np.asarray(params.get("H", np.zeros((c, nz))), dtype=np.float64).reshape(c, nz))
        self.nl_index = np.ascontiguousarray(np.asarray(params.get("index", np.zeros(c)), dtype=np.int64).reshape(c))
        self.nl_a = np.ascontiguousarray(np.asarray(params.get("a", np.zeros(c)), dtype=np.float64).reshape(c))
        self.nl_b = np.ascontiguousarray(np.asarray(params.get("b", np.zeros(c)), dtype=np.float64).reshape(c))
        if self.nl_index.size and (self.nl_index.min() < 0 or self.nl_index.max() >= ny):
            raise CertificateError(f"nonlinearity output index {self.nl_index.tolist()} is outside 0..{ny - 1}")
        self.nz, self.ny, self.nu = nz, ny, nu
        n_x = obs.get("n_x", nz)  # the plant's states come first in z, its disturbances after them
        if isinstance(n_x, bool) or not isinstance(n_x, int) or not 0 <= n_x <= nz:
            raise CertificateError(f"extra.observer.n_x is {n_x!r}; it must be a whole number of the extended "
                                   f"state's {nz} values that are the plant's states (the rest are disturbances)")
        self.n_x = n_x


def pack_network(weights: list[np.ndarray], activations: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Flatten ``(out, in)`` weights row-major for the kernel: ``(flat, dims, activation codes)``."""
    flat = np.ascontiguousarray(np.concatenate([np.asarray(w, dtype=np.float64).ravel() for w in weights]))
    dims = np.array([weights[0].shape[1]] + [w.shape[0] for w in weights], dtype=np.int64)
    acts = np.array([_ACT_CODES[a] for a in activations] or [0], dtype=np.int64)
    return flat, dims, acts


def _sample_time_problems(bundle: Bundle, obs: dict[str, Any]) -> list[str]:
    """The observer's matrices are discretised at ``dt``, its certificate holds at the certificate's ``dt``, and the
    session runs at the manifest's rate (and refuses a device streaming at another): all three must agree, or the
    estimate steps by the wrong time outside what the certificate covers."""
    dt = obs.get("dt")
    if not isinstance(dt, (int, float)) or not dt > 0:
        return [f"observer: extra.{BLOCK}.dt is {dt!r}; it must be the sample period (seconds) the matrices were "
                "discretised at: re-export the bundle"]
    out = []
    rate = bundle.manifest.rate_hz
    if abs(rate * dt - 1.0) > 1e-6:
        out.append(f"observer: the bundle runs at {rate:g} Hz but its matrices are discretised at dt = {dt:g} s "
                   f"({1 / dt:g} Hz); export it at rate_hz = 1/dt")
    cert = bundle.manifest.certificate or {}
    cdt = cert.get("dt")
    if isinstance(cdt, (int, float)) and abs(cdt - dt) > 1e-9 * max(1.0, dt):
        out.append(f"observer: the certificate holds at dt = {cdt:g} s but the observer is discretised at dt = {dt:g} "
                   "s; certify the observer that is deployed (closedloop certify)")
    return out


@register_family
class ObserverFamily(FamilyPlugin):
    """Certified neural observer + state feedback, one fused kernel call per measurement."""

    name = "observer"
    default_input = "plant_measurement"
    default_command = "actuator_command"
    # every measurement in order: the certified update steps the estimate one sample period (dt) per measurement,
    # so one skipped after a late step would move it by the wrong time; one command a step, from the newest
    consume = "all"
    command_each_frame = False

    @classmethod
    def problems(cls, bundle: Bundle) -> list[str]:
        obs = bundle.manifest.extra.get(BLOCK)
        if not isinstance(obs, dict):
            return [f"observer: manifest extra.{BLOCK} is missing; it holds the observer's model (see docs/observer.md)"]
        out: list[str] = []
        try:
            arr = ObserverArrays(obs)
            spec = bundle.graph()
            n_in, n_out = spec.data_inputs[0].shape[-1], spec.data_outputs[0].shape[-1]
            if n_in != arr.ny or n_out != arr.nz:
                out.append(f"observer: the graph maps {n_in} -> {n_out} values; the observer needs N: r ({arr.ny}) -> "
                           f"correction ({arr.nz})")
            out += [f"observer: {p}" for p in limit_order_problems(arr.u_low, arr.u_high, f"extra.{BLOCK}.u_low",
                                                                    f"extra.{BLOCK}.u_high")]
        except (CertificateError, IndexError) as exc:
            out.append(f"observer: {exc}")
        out += _sample_time_problems(bundle, obs)
        result = check_bundle_certificate(bundle)
        out += [f"observer certificate: {p}" for p in result.problems]
        return out

    def __init__(self, bundle: Bundle, model: Model):
        super().__init__(bundle, model)
        arr = ObserverArrays(bundle.manifest.extra[BLOCK])
        mlp = mlp_from_onnx(bundle.onnx())
        self.arrays = arr
        self._w, self._dims, self._acts = pack_network(mlp.weights, mlp.activations)
        width = int(self._dims.max())
        self._buf_a, self._buf_b = np.zeros(width), np.zeros(width)
        self.z_hat = arr.z0.copy()
        self.r = np.zeros(arr.ny)
        self._y, self._u = np.zeros(arr.ny), np.zeros(arr.nu)
        self._f = np.zeros(arr.Fd.shape[1])
        self._z_next = np.zeros(arr.nz)
        self.u_cmd = np.zeros(arr.nu)
        self._cmd = np.zeros(arr.nu, dtype=np.float32)
        self._sent = np.zeros(arr.nu, dtype=np.float32)  # the last command the session sent (on_command_sent)
        self._safe = np.clip(np.zeros(arr.nu), arr.u_low, arr.u_high).astype(np.float32)
        # published each step (state_vector): the estimate after the update, then the measurement it predicted
        self._state = np.zeros(arr.nz + arr.ny)
        self._state_z, self._state_y = self._state[:arr.nz], self._state[arr.nz:]
        self._x = model.inputs[model.spec.data_inputs[0].name]
        self._kernel = _kernel()
        self.step(self._y, self._u)  # compile (or load from Numba's cache) before the loop
        # through a gap in the measurements (frames lost on the link, refused ones) the estimate is carried by the
        # model alone, one sample period at a time, for at most MAX_PREDICT_S of them
        rate_hz = float(bundle.manifest.rate_hz)  # 1 / dt (problems() checks it)
        self._period_us = 1e6 / rate_hz
        self._max_predict = max(1, int(round(MAX_PREDICT_S * rate_hz)))
        self._y_pred, self._u_pred = np.zeros(arr.ny), np.zeros(arr.nu)
        self.reset()

    def reset(self) -> None:
        """Start of a session: the estimate back to ``z0``, the command to ``-K z0`` (clipped)."""
        super().reset()
        self._reset_estimate()
        self._last_t_us: int | None = None  # device time of the last measurement that entered the update
        self.predicted_steps = 0  # sample periods the estimate was carried by the model alone (gaps)
        self.gaps = 0  # gaps in the measurements (periods without one, by the device's clock)
        self.gap_steps_beyond = 0  # periods of gaps longer than MAX_PREDICT_S, not predicted
        # whether the device's clock counts microseconds at the bundle's rate: known once two measurements in a row
        # are one period apart; a device whose first intervals never are (another unit) gets no prediction
        self._clock_ok: bool | None = None
        self._clock_checks = 0

    def recover_nonfinite(self) -> bool:
        """A non-finite measurement never reaches the estimate (``_advance`` holds it); should the estimate or the
        command still turn non-finite (a network that diverged), every later step would stay so: restart at ``z0``."""
        reset = super().recover_nonfinite()
        if np.isfinite(self.z_hat).all() and np.isfinite(self._cmd).all():
            return reset
        self._reset_estimate()
        return True

    def _reset_estimate(self) -> None:
        self.z_hat[:] = self.arrays.z0
        np.clip(-(self.arrays.K @ self.z_hat), self.arrays.u_low, self.arrays.u_high, out=self.u_cmd)
        self._cmd[:] = self.u_cmd
        self._sent[:] = self._cmd  # before a first command: the one the estimate at z0 asks for
        self.r[:] = 0.0

    def _predict(self, missing: int) -> None:
        """``missing`` sample periods passed without a measurement (by the device's clock): carry the estimate
        through them on the model alone, with the input the device says it applied at the measurement after the gap
        (what it held through it; the last command sent where the device reports none). The update is run with
        the measurement it predicts (``y = C z``), so the residual is 0 and so is the bias-free network's correction
        and the gain's: what remains is the model's own step. The certificate bounds how the error then shrinks
        again, not how it grows through the gap (docs/observer.md, "Lost measurements")."""
        self.gaps += 1
        n = min(missing, self._max_predict)
        self.gap_steps_beyond += missing - n
        self.predicted_steps += n
        np.copyto(self._u_pred, self._u)  # the frame after the gap's u: from the recorded frames alone, so replay agrees
        for _ in range(n):
            np.matmul(self.arrays.Cd, self.z_hat, out=self._y_pred)
            self.step(self._y_pred, self._u_pred)

    def step(self, y: np.ndarray, u: np.ndarray) -> np.ndarray:
        """One observer + controller step on float64 ``y``, ``u``; returns ``z_hat_{k+1}`` (the live buffer)."""
        a = self.arrays
        self._kernel(self.z_hat, y, u, a.Ad, a.Bd, a.Cd, a.L, a.Fd, a.nl_code, a.nl_E, a.nl_H, a.nl_index, a.nl_a,
                     a.nl_b, self._w, self._dims, self._acts, self._buf_a, self._buf_b, self.r, self._f,
                     self._z_next, a.K, a.u_low, a.u_high, self.u_cmd)
        return self.z_hat

    # --- per step ------------------------------------------------------------------------

    @property
    def frame_vector(self) -> np.ndarray:
        """The plant's measured outputs ``y`` of this step: what observers, recordings of steps and the monitor get
        as the step's input (this family reads ``y`` and ``u`` in ``on_message``, not through the base class)."""
        return self._y

    @property
    def state_vector(self) -> np.ndarray:
        """``z_hat`` after this step's update (the plant's states, then its disturbances), then the measurement
        the observer predicted for this step, ``C z_hat`` before the update (``y - r``)."""
        return self._state

    def state_labels(self) -> list[str]:
        a = self.arrays
        return ([f"state/x{i + 1}" for i in range(a.n_x)] + [f"disturbance/d{i + 1}" for i in range(a.nz - a.n_x)]
                + [f"predicted/y{i + 1}" for i in range(a.ny)])

    def on_message(self, message: Message) -> None:
        y, u = getattr(message, "y", None), getattr(message, "u", None)
        if y is None or u is None:
            raise ValueError(f"observer: expected a PlantMeasurement, got {type(message).__name__}")
        if y.size != self._y.size or (u.size != 0 and u.size != self._u.size):  # per step: no tuple to build
            raise ValueError(
                f"observer: the device's PLANT_MEASUREMENT carries {y.size} outputs (y) and {u.size} applied inputs "
                f"(u); this observer takes {self._y.size} outputs and {self._u.size} applied inputs, or none (nu = 0: "
                "the last command sent is taken as applied)")
        np.copyto(self._y, y, casting="unsafe")
        if u.size:
            np.copyto(self._u, u, casting="unsafe")
        else:  # the device does not report what it applied: the last command sent, as for a frame of outputs only
            np.copyto(self._u, self._sent, casting="unsafe")
        self._advance()

    def preprocess(self, frame: np.ndarray) -> None:
        """A frame of outputs only: the input is taken to be the last command sent."""
        np.copyto(self._y, frame.reshape(-1), casting="unsafe")
        np.copyto(self._u, self._sent, casting="unsafe")
        self._advance()

    def on_command_sent(self, values: np.ndarray) -> None:
        # not the last computed: a step catching up computes a command per measurement and sends the newest only
        np.copyto(self._sent, values.reshape(-1)[: self._sent.size], casting="unsafe")

    def _advance(self) -> None:
        # A measurement with a NaN or an infinity never enters the update: the estimate keeps its value (the frame
        # counts as one not received), and the model's input is made non-finite so that the session refuses this
        # run (counted, the safe command sent). Summing is the cheap check: any NaN or inf makes the sum one.
        if not math.isfinite(float(self._y.sum()) + float(self._u.sum())):
            self._x.fill(np.nan)
            return
        t = self.frame_time_us
        if t is not None:
            if self._last_t_us is not None:
                missing = int(round((t - self._last_t_us) / self._period_us)) - 1
                if self._clock_ok is None:
                    self._clock_checks += 1
                    if missing == 0:
                        self._clock_ok = True
                    elif self._clock_checks >= CLOCK_CHECKS:
                        self._clock_ok = False
                if missing > 0 and self._clock_ok:
                    self._predict(missing)
            self._last_t_us = t
        self.step(self._y, self._u)
        np.copyto(self._state_z, self.z_hat)
        np.subtract(self._y, self.r, out=self._state_y)  # C z_hat before the update: y - r
        np.copyto(self._x.reshape(-1), self.r, casting="unsafe")  # the graph then computes N(r) for the record
        np.copyto(self._cmd, self.u_cmd, casting="unsafe")

    def postprocess(self) -> np.ndarray:
        return self._cmd

    def safe_output(self) -> np.ndarray:
        return self._safe

    def command_limits(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        return self.arrays.u_low.astype(np.float32), self.arrays.u_high.astype(np.float32)

    def live_metrics(self) -> dict[str, float | str]:
        return {"|r|": float(np.sqrt(self.r @ self.r)), "u": float(self._cmd[0]) if self._cmd.size else 0.0}

    def summary_metrics(self) -> dict[str, float | str | list[float]]:
        return {**self.live_metrics(), "measurement_gaps": self.gaps, "predicted_steps": self.predicted_steps,
                "gap_steps_not_predicted": self.gap_steps_beyond,
                "device_clock": {True: "microseconds at the bundle's rate", False: "not one period between "
                                 f"measurements in the first {CLOCK_CHECKS}: no prediction through gaps",
                                 None: "not yet known"}[self._clock_ok]}


def _kernel() -> Any:
    """The compiled kernel (Numba imported only when an observer is built)."""
    global _OBSERVER_STEP
    if _OBSERVER_STEP is None:
        _OBSERVER_STEP = _compile()
    return _OBSERVER_STEP


#: the longest gap in the measurements the estimate is carried through on the model alone (seconds); beyond it the
#: estimate jumps to the next measurement's time unpredicted (a session's watchdog has long sent the safe command)
MAX_PREDICT_S = 1.0
#: intervals between a session's first measurements in which one must be a single period for the device's clock
#: to be taken as microseconds at the bundle's rate (docs/protocol.md); otherwise gaps are not predicted through
CLOCK_CHECKS = 8

_OBSERVER_STEP = None
# fastmath without nnan/ninf (as in runtime.kernels): a NaN measurement must show up as a
# NaN estimate, which the runtime's guards catch, not as a plausible number.
_FASTMATH = {"reassoc", "contract", "arcp", "nsz", "afn"}


def _compile() -> Any:
    from numba import njit

    @njit(cache=True, fastmath=_FASTMATH, nogil=True, error_model="numpy")
    def observer_step(z, y, u, Ad, Bd, Cd, L, Fd, nl_code, nl_E, nl_H, nl_index, nl_a, nl_b,
                      w, dims, acts, buf_a, buf_b, r, f, z_next, K, u_low, u_high, u_cmd):  # pragma: no cover
        nz, ny, nu, nx = z.shape[0], y.shape[0], u.shape[0], Fd.shape[1]
        for i in range(ny):
            acc = y[i]
            for j in range(nz):
                acc -= Cd[i, j] * z[j]
            r[i] = acc
        for i in range(ny):
            buf_a[i] = r[i]
        n_layers = dims.shape[0] - 1
        off = 0
        for layer in range(n_layers):
            n_in, n_out = dims[layer], dims[layer + 1]
            src = buf_a if layer % 2 == 0 else buf_b
            dst = buf_b if layer % 2 == 0 else buf_a
            for o in range(n_out):
                acc = 0.0
                base = off + o * n_in
                for k in range(n_in):
                    acc += w[base + k] * src[k]
                if layer < n_layers - 1:
                    if acts[layer] == 1:
                        acc = np.tanh(acc)
                    elif acts[layer] == 2:
                        acc = max(acc, 0.0)
                dst[o] = acc
            off += n_in * n_out
        out = buf_b if (n_layers - 1) % 2 == 0 else buf_a
        for i in range(nx):
            f[i] = 0.0
        n_ch = nl_H.shape[0]
        if nl_code != 0:
            for c in range(n_ch):
                q = 0.0
                for j in range(nz):
                    q += nl_H[c, j] * z[j]
                if nl_code == 1:
                    g = np.sin(q)
                else:
                    yc = y[nl_index[c]]
                    g = (nl_a[c] + nl_b[c] * yc * yc) * q
                for i in range(nx):
                    f[i] += nl_E[i, c] * g
        for i in range(nz):
            acc = out[i]
            for j in range(nz):
                acc += Ad[i, j] * z[j]
            for j in range(nu):
                acc += Bd[i, j] * u[j]
            for j in range(nx):
                acc += Fd[i, j] * f[j]
            for j in range(ny):
                acc += L[i, j] * r[j]
            z_next[i] = acc
        for i in range(nz):
            z[i] = z_next[i]
        for i in range(K.shape[0]):
            acc = 0.0
            for j in range(nz):
                acc -= K[i, j] * z[j]
            u_cmd[i] = min(max(acc, u_low[i]), u_high[i])

    return observer_step
