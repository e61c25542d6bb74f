"""A certified neural observer for a plant of your own, from its model to a live 1 kHz session.

Workflow: write the plant's disturbance-extended model (``ObserverSystem``: ``x' = A x + B u + E d``,
``y = C x``) -> the observer's model with its state feedback (``ObserverModel.from_system``, ``u_max`` the
input limit) -> train the network ``N(r)`` (tiny settings here: seconds) -> certify it (the LMI) -> export the
bundle -> run it against the plant emulator, which simulates the same plant (registered below as
``sim://plant?model=own-msd``, loaded by the emulator with ``plugins=observer_own_plant``).

    python examples/observer_own_plant.py [OUT_DIR]

The plant: a mass-spring-damper (mass 0.5 kg, damping 0.4 N s/m, stiffness 1.5 N/m), position measured, a
force input, and an unknown constant force disturbance of 0.3 N from t = 0.5 s (the observer estimates it).
"""

import numpy as np

from closedloop.sim.plants import Plant, register_plant

M, C_DAMP, K_SPRING, D_FORCE = 0.5, 0.4, 1.5, 0.3
A = [[0.0, 1.0], [-K_SPRING / M, -C_DAMP / M]]
B = [[0.0], [1.0 / M]]
E = [[0.0], [1.0 / M]]  # the disturbance is a force, like the input
C = [[1.0, 0.0]]


# replace=True: this file is both the script (``__main__``) and the plug-in module the session imports, so the
# host process registers the plant twice; a plug-in module of your own needs no replace
@register_plant("own-msd", replace=True)
class OwnMassSpringDamper(Plant):
    """The true plant, for the emulator: the same model, with the disturbance inside ``f`` (the emulator
    integrates ``f`` as it is; ``disturbance(t)`` is the truth for scoring). ``t`` counts from streaming start."""

    def __init__(self) -> None:
        self.n_states, self.n_inputs, self.n_outputs, self.n_disturbances = 2, 1, 1, 1
        self.x0 = np.array([0.2, 0.0])
        self.u_low, self.u_high = np.array([-10.0]), np.array([10.0])

    def disturbance(self, t: float) -> np.ndarray:
        return np.array([D_FORCE if t >= 0.5 else 0.0])

    def f(self, x: np.ndarray, u: np.ndarray, t: float) -> np.ndarray:
        return np.asarray(A) @ x + np.asarray(B) @ u + np.asarray(E) @ self.disturbance(t)

    def h(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(C) @ x


def main() -> None:
    import os
    import sys
    import tempfile
    from pathlib import Path

    import torch

    from closedloop.runtime import SessionConfig, run_session
    from closedloop.sdk.observer.certify import certify
    from closedloop.sdk.observer.neural import NeuralObserver, ObserverModel, export_observer_bundle
    from closedloop.sdk.observer.systems import ObserverSystem
    from closedloop.sdk.observer.train import TrainConfig, train_observer

    if len(sys.argv) > 1 and sys.argv[1].startswith("-"):  # -h / --help: what it does; it takes one folder

        print(__doc__)

        sys.exit(0 if sys.argv[1] in ("-h", "--help") else 2)

    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp()) / "observer"
    system = ObserverSystem(
        name="own-msd", dt=1e-3, A=A, B=B, E=E, C=C, nonlinearity=None, poles_c=None, omega_o=5.0,
        nominal_x0=[0.2, 0.0], error_box=[0.5, 1.0, 1.0],  # |e| bounds: position, velocity, disturbance
        meas_noise_std=[0.001], process_noise_std=[0.0, 0.05, 0.5],  # the Kalman gain L is designed from these
    )
    model = ObserverModel.from_system(system, u_max=10.0)  # the command limit (and the LQR gain K's scale)
    torch.manual_seed(0)
    trained = train_observer(model, TrainConfig(hidden=(8, 8), stage1_steps=30, stage2_rounds=1, stage2_steps=10,
                                                polish_rounds=0))
    # local_vbar=None leaves out the local certificate of a nonlinearity (this plant is linear; it is the slow part)
    report = certify(model, trained.net, local_vbar=None, coverage_eps=0.05, coverage_beta=1e-2)
    print(report.summary())
    if not report.certified:
        raise SystemExit("not certified: nothing to deploy")
    bundle = export_observer_bundle(NeuralObserver(model, trained.net), report, out, overwrite=True,
                                    report=lambda s: None)
    # the emulator is another process: it imports this file as a module to find the plant
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    summary = run_session(bundle, SessionConfig(
        device="sim://plant?model=own-msd&plugins=observer_own_plant&rate=1000&noise=0.001&seed=1",
        duration_s=2.0, status=False, record=str(out.parent / "own.clrec")))
    print(summary.format())
    from closedloop.runtime.recording_view import view_recording

    state = view_recording(out.parent / "own.clrec")  # FAMILY_STATE: the estimate after every measurement
    d_hat = state.state.array()[-1, state.state_labels.index("disturbance/d1")]
    print(f"measurements used {summary.inputs_used}, commands {summary.commands_sent}; estimated disturbance at "
          f"the end {d_hat:.3f} N (true {D_FORCE} N); recording {out.parent / 'own.clrec'}")
    if not abs(d_hat - D_FORCE) < 0.1:  # 1.5 s after the step, the estimate has long settled
        raise SystemExit(f"the observer did not find the disturbance: {d_hat:.3f} N against {D_FORCE} N")


if __name__ == "__main__":
    main()
