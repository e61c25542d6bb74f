"""The :class:`Plant` interface, a fixed-step RK4 integrator, and the plant registry.

A plant is a continuous-time system ``dx/dt = f(x, u, t)``, ``y = h(x)`` with box limits
on its input ``u``; the plant emulator integrates it at its own internal rate and
streams ``y``.  Plants are registered by name (``register_plant``), so adding one
(X-29A, flexible-joint robot, Van der Pol, cart-pole) is one class in this package and
one decorator; ``sim://plant?model=NAME`` selects it, and the class's own ``PARAMS``
become URL parameters of that plant.

Two optional hooks: a plant driven by an unknown input reports it through
:meth:`Plant.disturbance` (so observers can be scored against it), and a plant whose
truth comes from a physics engine (the PyBullet cart-pole) defines
``advance(x, u, t, dt) -> x_next``; :func:`rk4_step` then hands the step to the engine,
so the plant emulator and the simulation harness step every plant the same way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import numpy as np

from ..params import Param
from ..registry import registrar

__all__ = ["Plant", "PLANTS", "register_plant", "plant_class", "make_plant", "rk4_step", "UnknownPlantError"]

P = TypeVar("P", bound=type["Plant"])


class UnknownPlantError(KeyError):
    """No plant is registered under the requested name."""

    def __str__(self) -> str:
        return str(self.args[0])


class Plant(ABC):
    """A continuous-time plant.

    Subclasses set ``n_states``, ``n_inputs``, ``n_outputs``, ``x0``, ``u_low`` and
    ``u_high`` in ``__init__`` (which receives the plant's ``PARAMS`` as keyword
    arguments) and implement :meth:`f` and :meth:`h`.  ``f`` is free of any step size:
    the integrator owns time.
    """

    #: Plant-specific parameters (become ``sim://plant?model=NAME&PARAM=...``).
    PARAMS: ClassVar[tuple[Param, ...]] = ()
    #: Registry name, set by :func:`register_plant`.
    NAME: ClassVar[str] = ""

    n_states: int
    n_inputs: int
    n_outputs: int
    #: Channels of the unknown input ``d(t)`` (0: none); see :meth:`disturbance`.
    n_disturbances: int = 0
    x0: np.ndarray
    u_low: np.ndarray
    u_high: np.ndarray

    @abstractmethod
    def f(self, x: np.ndarray, u: np.ndarray, t: float) -> np.ndarray:
        """State derivative at state ``x``, input ``u`` and time ``t`` (seconds)."""

    @abstractmethod
    def h(self, x: np.ndarray) -> np.ndarray:
        """Measured outputs at state ``x`` (before measurement noise)."""

    def disturbance(self, t: float) -> np.ndarray:
        """The unknown input ``d(t)`` acting on the plant at time ``t``, shape ``(n_disturbances,)``."""
        return np.zeros(self.n_disturbances)

    def check(self) -> None:
        """Raise ``ValueError`` when the declared sizes disagree with ``x0``, ``f`` or ``h``."""
        name = type(self).__name__
        x0 = np.asarray(self.x0, dtype=float)
        if x0.shape != (self.n_states,):
            raise ValueError(f"{name}.x0 has shape {x0.shape}; expected ({self.n_states},)")
        for label, arr in (("u_low", self.u_low), ("u_high", self.u_high)):
            if np.shape(arr) != (self.n_inputs,):
                raise ValueError(f"{name}.{label} has shape {np.shape(arr)}; expected ({self.n_inputs},)")
        if np.any(np.asarray(self.u_low) > 0) or np.any(np.asarray(self.u_high) < 0):
            raise ValueError(f"{name}: zero input must lie within [u_low, u_high] (it is the safe input)")
        dx = np.asarray(self.f(x0, np.zeros(self.n_inputs), 0.0))
        if dx.shape != (self.n_states,):
            raise ValueError(f"{name}.f returned shape {dx.shape}; expected ({self.n_states},)")
        y = np.asarray(self.h(x0))
        if y.shape != (self.n_outputs,):
            raise ValueError(f"{name}.h returned shape {y.shape}; expected ({self.n_outputs},)")


#: Plant classes by name.
PLANTS: dict[str, type[Plant]] = {}


def register_plant(name: str, *, replace: bool = False) -> Callable[[P], P]:
    """Class decorator: make ``sim://plant?model=NAME`` build this plant."""
    return registrar(PLANTS, "plant name", name, replace)


def plant_class(name: str) -> type[Plant]:
    """The plant class registered as ``name``."""
    try:
        return PLANTS[name]
    except KeyError:
        raise UnknownPlantError(f"no plant named {name!r}; registered plants: {', '.join(PLANTS)} "
                                "(add one with sim.plants.register_plant)") from None


def make_plant(name: str, **params: Any) -> Plant:
    """Build and check the plant ``name`` with its parameters (defaults for those not given)."""
    cls = plant_class(name)
    values = {p.name: p.default for p in cls.PARAMS}
    values.update(params)
    plant = cls(**values)
    plant.check()
    return plant


def rk4_step(plant: Plant, x: np.ndarray, u: np.ndarray, t: float, dt: float) -> np.ndarray:
    """One classical Runge-Kutta step of ``dt`` seconds with ``u`` held constant (zero-order hold).

    A physics-backed plant (one that defines ``advance(x, u, t, dt)``) is stepped by its
    engine instead: its ``f`` is then only a model, not the truth.
    """
    advance = getattr(plant, "advance", None)
    if advance is not None:
        return advance(x, u, t, dt)
    k1 = plant.f(x, u, t)
    k2 = plant.f(x + 0.5 * dt * k1, u, t + 0.5 * dt)
    k3 = plant.f(x + 0.5 * dt * k2, u, t + 0.5 * dt)
    k4 = plant.f(x + dt * k3, u, t + dt)
    return x + (dt / 6.0) * (k1 + 2.0 * k2 + 2.0 * k3 + k4)
