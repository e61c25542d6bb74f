"""The certified neural observer: its deployable model, ``reset``/``update``, and export to a bundle.

``ObserverModel`` is everything the deployed observer runs besides the network: the
discrete extended-state model ``(Ad, Bd, Cd, Fd)`` at ``dt``, the gain ``L``, the known
nonlinearity as a *named* runtime nonlinearity (``closedloop.runtime.families.observer.certificate.NONLINEARITIES``, so
the runtime's Numba kernel and the certificate's sector both know it), the controller
gain ``K`` and the input limits. ``NeuralObserver`` runs it with a trained ``ObserverNet``
in numpy (the same float32 weights the bundle stores) behind the harness interface
``reset(z0_hat)`` / ``update(y, u) -> z_hat`` of ``closedloop.sdk.observer.simulate``.

Notes
-----
Predictor form, as in ``closedloop.sdk.observer.systems`` (sign convention of ``closedloop.runtime.families.observer.certificate``)::

    r_k       = y_k - Cd z_hat_k
    z_hat_k+1 = Ad z_hat_k + Bd u_k + Fd f(z_hat_k, y_k) + L r_k + N(r_k)

The controller is state feedback on the estimate, ``u = clip(-K z_hat, u_low, u_high)`` with
``K = [K_x, K_d]``: ``K_x`` the discrete LQR gain of the plant part with Bryson's rule
(``Q = diag(1 / error_box_x^2)``, ``R = diag(1 / u_max^2)``, ``R = I`` without limits) and ``K_d = pinv(B) E`` the
least-squares cancellation of the estimated disturbance (exact when it is matched).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import scipy.linalg as sla

from closedloop.runtime.families.observer.certificate import (
    ErrorModel,
    known_nonlinearity,
    observer_error_model,
)

from .network import ObserverNet, numpy_forward

if TYPE_CHECKING:
    from .certify import CertificateReport
    from .systems import ObserverSystem

FAMILY = "observer"
DEFAULT_U_MAX = 1e6  # "no limit" that still serialises as JSON


def nonlinearity_for(system: ObserverSystem, y_max: float | None = None) -> dict[str, Any]:
    """The runtime nonlinearity spec matching ``system.f``, checked against it on random states.

    flexible-joint: ``"sin"``; van-der-pol: ``"output_scaled"`` (``-mu y^2 x2`` with the
    measured ``y = x1``, certified while ``|y| <= y_max``, default 2.5: the limit cycle's
    amplitude 2 plus a quarter); linear plants: ``"none"``. The cart-pole's full
    nonlinearity has no sector bound: its observer uses the linearised model (``"none"``)
    and its certificate covers the linearised error dynamics.
    """
    nx, nz = system.n_x, system.n_z
    if system.nonlinearity is None or system.name == "cartpole":
        return {"name": "none"}
    if system.name == "flexible-joint":
        E = np.zeros((nx, 1))
        E[3, 0] = -3.33
        H = np.zeros((1, nz))
        H[0, 2] = 1.0
        spec = {"name": "sin", "E": E.tolist(), "H": H.tolist()}
    elif system.name == "van-der-pol":
        mu = float(system.plant_params.get("mu", 1.0))
        E = np.zeros((nx, 1))
        E[1, 0] = 1.0
        H = np.zeros((1, nz))
        H[0, 1] = 1.0
        ymax = float(y_max if y_max is not None else 2.5)
        spec = {"name": "output_scaled", "E": E.tolist(), "H": H.tolist(), "index": [0], "a": [0.0], "b": [-mu],
                "y_max": [ymax]}
    else:
        raise ValueError(
            f"plant {system.name!r} has a nonlinearity f(x, u) that the runtime must run as one of its own forms: "
            "give it to ObserverModel.from_system(system, nonlinearity={'name': 'sin', 'E': E, 'H': H}) for "
            "f = E sin(H z) (E shape (n_x, c), H shape (c, n_z)), or {'name': 'output_scaled', 'E', 'H', 'index', "
            "'a', 'b', 'y_max'} for f = E ((a + b y[index]^2) * (H z)) (docs/observer_plants.md, step 2)")
    check_nonlinearity(spec, system)
    return spec


def check_nonlinearity(spec: dict[str, Any], system: ObserverSystem) -> None:
    """Refuse a runtime nonlinearity spec that is malformed or does not reproduce ``system.f`` on random states
    (the certified observer would run another model than the one it was trained and certified on)."""
    nx, nz = system.n_x, system.n_z
    name = spec.get("name", "none")
    if name == "none":
        if system.nonlinearity is not None and system.name != "cartpole":
            raise ValueError(f"nonlinearity 'none' for plant {system.name!r}, whose f is not zero: the runtime would "
                             "run a linear model; give the nonlinearity's form (docs/observer_plants.md, step 2)")
        return
    if name not in ("sin", "output_scaled"):
        raise ValueError(f"nonlinearity {name!r}: the runtime knows 'sin', 'output_scaled' and 'none'")
    try:
        E, H = np.asarray(spec["E"], dtype=float), np.asarray(spec["H"], dtype=float)
    except KeyError as exc:
        raise ValueError(f"nonlinearity {name!r} needs {exc.args[0]!r}") from None
    if E.ndim != 2 or H.ndim != 2 or E.shape[0] != nx or H.shape[1] != nz or E.shape[1] != H.shape[0]:
        raise ValueError(f"nonlinearity {name!r}: E has shape {E.shape} and H {H.shape}; they must be (n_x, c) = "
                         f"({nx}, c) and (c, n_z) = (c, {nz}), c the number of channels")
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (16, nx))
    z = np.hstack([x, np.zeros((16, nz - nx))])
    got = eval_nonlinearity(spec, z, z @ system.Cd.T)
    want = system.f(x, np.zeros((16, system.n_u)))
    if not np.allclose(got, want, atol=1e-9):
        diff = float(np.max(np.abs(np.asarray(got) - np.asarray(want))))
        raise ValueError(f"runtime nonlinearity {name!r} as given does not reproduce {system.name}'s f (largest "
                         f"difference {diff:.3g} on 16 random states): the bundle would run another model than the "
                         "one it was trained and certified on; give the E and H that make them agree")


def eval_nonlinearity(spec: dict[str, Any], z: Any, y: Any) -> Any:
    """``f(z, y)`` of a runtime nonlinearity spec on batches ``(..., n_z)``; numpy or torch."""
    name = spec.get("name", "none")
    xp = np if isinstance(z, np.ndarray) else __import__("torch")
    if name == "none":
        return None
    E = np.asarray(spec["E"], dtype=float)
    H = np.asarray(spec["H"], dtype=float)
    E, H = (m if xp is np else xp.as_tensor(m, dtype=z.dtype) for m in (E, H))
    q = z @ H.T
    if name == "sin":
        return xp.sin(q) @ E.T
    if name == "output_scaled":
        idx = list(np.asarray(spec["index"], dtype=int))
        a = np.asarray(spec["a"], dtype=float)
        b = np.asarray(spec["b"], dtype=float)
        if xp is not np:
            a, b = (xp.as_tensor(v, dtype=z.dtype) for v in (a, b))
        return ((a + b * y[..., idx] ** 2) * q) @ E.T
    raise ValueError(f"unknown nonlinearity {name!r}")


def _plant_u_max(name: str) -> float:
    """The plant's default input limit (its ``u_max`` parameter), so the bundle's limits match the device's."""
    try:
        from closedloop.sim.plants import plant_class

        return float(next(p.default for p in plant_class(name).PARAMS if p.name == "u_max"))
    except (KeyError, StopIteration, ImportError):
        return DEFAULT_U_MAX


def _lqr_gain(system: ObserverSystem, u_max: float) -> np.ndarray:
    nx = system.n_x
    A, B = system.Ad[:nx, :nx], system.Bd[:nx]
    Q = np.diag(1.0 / np.maximum(system.error_box[:nx], 1e-9) ** 2)
    u_scale = u_max if u_max < DEFAULT_U_MAX else 1.0  # no limit: unit input weight
    R = np.eye(B.shape[1]) / max(u_scale, 1e-9) ** 2
    X = sla.solve_discrete_are(A, B, Q, R)
    Kx = np.linalg.solve(R + B.T @ X @ B, B.T @ X @ A)
    Kd = np.linalg.pinv(system.B) @ system.E
    return np.hstack([Kx, Kd])


@dataclass
class ObserverModel:
    """The observer's runtime model: matrices at ``dt``, gain, nonlinearity, controller, limits."""

    name: str
    dt: float
    Ad: np.ndarray
    Bd: np.ndarray
    Cd: np.ndarray
    L: np.ndarray
    Fd: np.ndarray
    n_x: int
    nonlinearity: dict[str, Any]
    error_box: np.ndarray
    K: np.ndarray
    u_low: np.ndarray
    u_high: np.ndarray
    meas_noise_std: np.ndarray = field(default_factory=lambda: np.zeros(0))
    process_noise_std: np.ndarray = field(default_factory=lambda: np.zeros(0))
    #: ``truth_step(z, u) -> z+``: the full model a training rollout's truth follows (numpy or torch,
    #: batched; default the observer's own model). Training only: not in the manifest.
    truth_step: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def from_system(cls, system: ObserverSystem, *, u_max: float | None = None, K: np.ndarray | None = None,
                    nonlinearity: dict[str, Any] | None = None) -> ObserverModel:
        """Build it from ``closedloop.sdk.observer.systems.ObserverSystem`` (``u_max``: default the plant's limit)."""
        if u_max is None:
            u_max = _plant_u_max(system.name)
        spec = nonlinearity or nonlinearity_for(system)
        if nonlinearity is not None:
            check_nonlinearity(spec, system)
        try:
            K = _lqr_gain(system, u_max) if K is None else np.asarray(K, dtype=float)
        except (np.linalg.LinAlgError, ValueError):
            K = np.zeros((system.n_u, system.n_z))
        nu = system.n_u
        return cls(system.name, float(system.dt), system.Ad.copy(), system.Bd.copy(), system.Cd.copy(),
                   system.L.copy(), system.Fd.copy(), system.n_x, spec, system.error_box.copy(), K,
                   np.full(nu, -u_max), np.full(nu, u_max), system.meas_noise_std.copy(),
                   system.process_noise_std.copy(), system.step)

    @property
    def n_z(self) -> int:
        return int(self.Ad.shape[0])

    @property
    def n_y(self) -> int:
        return int(self.Cd.shape[0])

    def error_model(self) -> ErrorModel:
        """The certificate's error model, built exactly as the runtime builds it from the manifest."""
        return observer_error_model(self.manifest_block())

    def f(self, z: Any, y: Any) -> Any:
        """``Fd f(z, y)`` for batches (numpy or torch); zeros for ``"none"``."""
        out = eval_nonlinearity(self.nonlinearity, z, y)
        if out is None:
            return z * 0
        Fd = self.Fd if isinstance(z, np.ndarray) else __import__("torch").as_tensor(self.Fd, dtype=z.dtype)
        return out @ Fd.T

    def manifest_block(self) -> dict[str, Any]:
        """``manifest.extra["observer"]``: what the runtime family reads."""
        known_nonlinearity(self.nonlinearity)  # fail early on an unknown name
        return {"system": self.name, "dt": self.dt, "n_x": self.n_x, "Ad": self.Ad.tolist(), "Bd": self.Bd.tolist(),
                "Cd": self.Cd.tolist(), "L": self.L.tolist(), "Fd": self.Fd.tolist(),
                "nonlinearity": dict(self.nonlinearity), "K": self.K.tolist(),
                "controller": "u = clip(-K z_hat, u_low, u_high); K = [discrete LQR (Bryson), pinv(B) E]",
                "u_low": self.u_low.tolist(), "u_high": self.u_high.tolist(),
                "error_box": self.error_box.tolist(), "z0": [0.0] * self.n_z}


def _numpy_nonlinearity(model: ObserverModel) -> Any:
    """``Fd f(z, y)`` for one state, with the spec's arrays converted once (``update`` is timed)."""
    spec = model.nonlinearity
    if spec.get("name", "none") == "none":
        return lambda z, y: 0.0
    E, H = np.asarray(spec["E"], dtype=float), np.asarray(spec["H"], dtype=float)
    G = model.Fd @ E
    if spec["name"] == "sin":
        return lambda z, y: G @ np.sin(H @ z)
    idx = np.asarray(spec["index"], dtype=int)
    a, b = np.asarray(spec["a"], dtype=float), np.asarray(spec["b"], dtype=float)
    return lambda z, y: G @ ((a + b * y[idx] ** 2) * (H @ z))


class NeuralObserver:
    """Plant model + ``L`` + the network, in numpy (float64 arithmetic on the float32 weights).

    Examples
    --------
    >>> from closedloop.sdk.observer.systems import observer_system
    >>> model = ObserverModel.from_system(observer_system("flexible-joint"))
    >>> obs = NeuralObserver(model, ObserverNet(1, 5, hidden=(8,)))
    >>> obs.reset(np.zeros(5))
    >>> obs.update(np.array([0.1]), np.array([0.0])).shape
    (5,)
    """

    def __init__(self, model: ObserverModel, net: ObserverNet | Sequence[np.ndarray],
                 activations: Sequence[str] | None = None):
        self.model = model
        if isinstance(net, ObserverNet):
            self.net: ObserverNet | None = net
            self.weights = net.weights()
            self.activations = list(net.activations)
        else:
            self.net = None
            self.weights = [np.asarray(w, dtype=np.float32) for w in net]
            self.activations = list(activations or ["tanh"] * (len(self.weights) - 1))
        self.z_hat = np.zeros(model.n_z)
        self._f = _numpy_nonlinearity(model)

    def reset(self, z0_hat: np.ndarray) -> None:
        self.z_hat = np.array(z0_hat, dtype=float).reshape(self.model.n_z)

    def correction(self, r: np.ndarray) -> np.ndarray:
        """``N(r)``."""
        return numpy_forward(self.weights, self.activations, r)

    def update(self, y: np.ndarray, u: np.ndarray) -> np.ndarray:
        """One step: read ``y_k, u_k``, return ``z_hat_{k+1}`` (a copy)."""
        m, z = self.model, self.z_hat
        y = np.asarray(y, dtype=float).reshape(-1)
        u = np.asarray(u, dtype=float).reshape(-1)
        r = y - m.Cd @ z
        self.z_hat = m.Ad @ z + m.Bd @ u + self._f(z, y) + m.L @ r + self.correction(r)
        return self.z_hat.copy()

    def command(self, z_hat: np.ndarray | None = None) -> np.ndarray:
        """``u = clip(-K z_hat, u_low, u_high)`` for the current (or a given) estimate."""
        z = self.z_hat if z_hat is None else np.asarray(z_hat, dtype=float)
        return np.clip(-self.model.K @ z, self.model.u_low, self.model.u_high)


def export_observer_bundle(observer: NeuralObserver, certificate: CertificateReport, out: str | Path, *,
                           name: str = "", provenance: dict[str, Any] | None = None, overwrite: bool = False,
                           zip: bool = False, report: Any = print) -> Path:
    """Write the observer bundle: graph ``N`` (ONNX, input ``r``, output ``correction``) + manifest.

    The manifest's ``extra.observer`` holds the model (``ObserverModel.manifest_block``),
    ``manifest.certificate`` the certificate (``CertificateReport.to_manifest``),
    ``postprocess.low/high`` the input limits; the family is ``"observer"``. The graph goes
    through ``closedloop.export.export_bundle`` (parity with torch, provenance) and the bundle is then
    written with the observer's blocks by ``closedloop.export.writer.write_bundle``, which verifies it
    with the runtime (so the certificate is re-checked from the written files).
    """
    import dataclasses
    import tempfile

    import torch

    from closedloop.export import export_bundle
    from closedloop.export.writer import write_bundle
    from closedloop.runtime.manifest import MANIFEST_NAME, Manifest

    if observer.net is None:
        raise ValueError("export needs the observer's torch ObserverNet (NeuralObserver(model, net))")
    if not certificate.certified:
        raise ValueError(f"the observer is not certified (largest eigenvalue {certificate.max_eig:.4g}, margin "
                         f"{certificate.margin:.3g}); run stage 2 (sdk.observer.train) before exporting")
    m = observer.model
    with tempfile.TemporaryDirectory(prefix="closedloop-observer-") as tmp:
        graph_path = export_bundle(
            observer.net.plain(), Path(tmp) / "graph", kind="feedforward", example_input=torch.zeros(1, m.n_y),
            rate_hz=1.0 / m.dt, family="generic", name=name or f"observer-{m.name}", variants=(), tensorrt=False,
            input_name="r", output_name="correction", report=report,
            provenance={"observer": {"system": m.name, **(provenance or {})}},
        )
        base = Manifest.from_json((graph_path / MANIFEST_NAME).read_text())
        files = {rel: (graph_path / rel).read_bytes() for rel in base.files}
    manifest = dataclasses.replace(
        base, family=FAMILY,
        postprocess={"low": m.u_low.tolist(), "high": m.u_high.tolist()},
        certificate=certificate.to_manifest(),
        extra={"observer": m.manifest_block(),
               "session": {"input": "plant_measurement", "command": "actuator_command"}},
    )
    path = write_bundle(out, manifest, files, overwrite=overwrite, zip=zip)
    report(f"wrote observer bundle {path} (certified rho {certificate.rho:.6g}, margin {certificate.margin:.3g})")
    return path


def example_observer_bundle(out: str | Path) -> Path:
    """A small certified flexible-joint observer (untrained, 6-6 hidden), exported to ``out``.

    What the benchmarks and the monitor's screenshots run at 1 kHz: certified in seconds, no training.
    """
    import torch

    from .certify import certify
    from .systems import observer_system
    from .train import TrainConfig, _initial_net

    model = ObserverModel.from_system(observer_system("flexible-joint"))
    torch.manual_seed(0)
    net = _initial_net(model, TrainConfig(hidden=(6, 6), init_gain=0.1)).scale_(0.5)
    report = certify(model, net, rho=0.999, local_vbar=None, coverage_eps=0.05, coverage_beta=1e-2)
    if not report.certified:
        raise RuntimeError("the example observer's LMI certificate did not hold")
    return Path(export_observer_bundle(NeuralObserver(model, net), report, Path(out), report=lambda s: None))
