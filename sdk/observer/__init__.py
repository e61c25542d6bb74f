"""Neural state/disturbance observers with Lyapunov certificates, their plant models and baselines.

``systems`` holds the observer's model of each plant (extended state, discretisation,
linear gain); ``baselines`` the classical observers; ``simulate`` and ``metrics`` the
harness that scores any observer with the ``reset(z0_hat)`` / ``update(y, u)`` interface;
``network`` / ``lmi`` / ``train`` / ``certify`` / ``neural`` the certified neural observer
(two-stage training, the SDP certificate, export to a bundle); ``direct`` the
certify-at-every-step training baseline.
"""

from .baselines import BASELINES, ExtendedKalmanFilter, HighGainObserver, LinearESO, Luenberger, make_baseline
from .certify import CertificateReport, certify
from .direct import train_direct
from .lmi import best_decay_rate, solve_lmi
from .metrics import MonteCarloResult, ObserverMetrics, monte_carlo, observer_metrics, sample_box
from .network import ObserverNet
from .neural import NeuralObserver, ObserverModel, export_observer_bundle
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
from .train import TrainConfig, TrainResult, train_observer

__all__ = ["ObserverSystem", "observer_system", "register_system", "SYSTEMS", "place_observer_gain",
           "default_poles", "array_module",
           "Luenberger", "HighGainObserver", "LinearESO", "ExtendedKalmanFilter", "BASELINES", "make_baseline",
           "Observer", "SimResult", "simulate",
           "ObserverMetrics", "observer_metrics", "MonteCarloResult", "monte_carlo", "sample_box",
           "ObserverNet", "solve_lmi", "best_decay_rate", "certify", "CertificateReport", "TrainConfig",
           "TrainResult", "train_observer", "train_direct", "ObserverModel", "NeuralObserver",
           "export_observer_bundle"]
