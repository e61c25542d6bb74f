"""Neural state/disturbance observers with Lyapunov certificates, their plant models and baselines.

``systems`` holds the observer's model of each plant (extended state, discretisation,
linear gain); ``baselines`` the classical observers; ``simulate`` and ``metrics`` the
harness that scores any observer with the ``reset(z0_hat)`` / ``update(y, u)`` interface.
"""

from .baselines import BASELINES, ExtendedKalmanFilter, HighGainObserver, LinearESO, Luenberger, make_baseline
from .metrics import MonteCarloResult, ObserverMetrics, monte_carlo, observer_metrics, sample_box
from .simulate import Observer, SimResult, simulate
from .systems import (
    SYSTEMS,
    ObserverSystem,
    array_module,
    default_poles,
    observer_system,
    place_observer_gain,
    register_system,
)

__all__ = ["ObserverSystem", "observer_system", "register_system", "SYSTEMS", "place_observer_gain",
           "default_poles", "array_module",
           "Luenberger", "HighGainObserver", "LinearESO", "ExtendedKalmanFilter", "BASELINES", "make_baseline",
           "Observer", "SimResult", "simulate",
           "ObserverMetrics", "observer_metrics", "MonteCarloResult", "monte_carlo", "sample_box"]
