"""Two-stage training of the certified neural observer: point-guided Lyapunov pre-training, then LMI fine-tuning.

Stage 1 trains ``N`` on simulated trajectories for accuracy, with a hinge that asks the
quadratic Lyapunov function of the linear part to decrease at error states sampled from
the prescribed box (at all scales, and at the vertices of the nonlinearity's sector).
Stage 2 solves the certificate's SDP at the current weights; while it is infeasible (or
its margin too small) it keeps ``P`` and the multipliers of the last solve and pushes the
weights with a penalty on the largest eigenvalue of the LMI matrix, built in torch by the
same ``closedloop.runtime.families.observer.certificate.LMIData`` the runtime checks, then re-solves. It stops at the
first certificate (from the SDP, or from the fixed ``(P, t, lam)`` once the pushed
weights satisfy it). Everything is timed.

Notes
-----
Error dynamics (sign convention of ``closedloop.runtime.families.observer.certificate``):
``e+ = (Ad - L Cd) e - N(Cd e) + Gf p`` with ``p_j = s_j (H e)_j``, ``s_j`` in the sector
``[lo_j, hi_j]``. ``V(e+)`` is convex in ``s``, so the worst case over the sector is at a
vertex: the hinge takes the largest ratio over the vertices,

    loss_lyap = mean over samples of max_vertices relu(V(e+) / V(e) - (rho^2 - point_margin)),

and the accuracy loss is the mean squared error, each component divided by its box
half-width, over closed-loop trajectories of the model (``u = clip(-K z_hat)``, noisy ``y``).
Stage 2 loss: ``keep_weight * keep + barrier_weight * relu(max eig Mn(W; P, t, lam) + 2 margin)``,
``Mn`` the normalised LMI matrix (differentiable through ``torch.linalg.eigvalsh``) and
``keep`` the mean squared change of ``N(r)`` (per ``out_scale``) from the stage-1 network on
output errors ``r = Cd e`` of sampled errors: it keeps stage 1's accuracy at a fraction of a
rollout's cost. Once certified, ``polish_steps`` accuracy steps with a log barrier on
``-(max eig Mn + margin)`` (``P, t, lam`` fixed; a step leaving the certified set is undone)
recover accuracy the push cost, and the certificate still holds at the end.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from closedloop.common.config import JsonConfig
from closedloop.runtime.families.observer.certificate import lft_from_weights, lmi_data

from .lmi import LMISolution, best_decay_rate, lyapunov_matrix, solve_lmi
from .network import TORCH_OPS, ObserverNet
from .neural import ObserverModel

_F64 = torch.float64


@dataclass
class TrainConfig(JsonConfig):
    """Settings of both stages (serialisable; stored in the bundle's provenance)."""

    hidden: tuple[int, ...] = (16, 16)
    activation: str = "tanh"
    init_gain: float = 0.1
    rho: float | None = None  # target decay per step; None: the linear part's best + rho_slack of the gap to 1
    rho_slack: float = 0.5  # larger: slower certified decay, more room for the network (accuracy)
    margin: float = 1e-4  # required LMI margin: V(e+) <= (rho^2 - margin) V(e)
    point_margin: float = 1e-3  # hinge margin at sampled points (relative to V)
    n_points: int = 256
    n_traj: int = 16
    horizon: int = 40
    lyap_weight: float = 1.0
    stage1_steps: int = 150
    lr: float = 3e-3
    stage2_rounds: int = 8
    stage2_steps: int = 40
    stage2_lr: float = 1e-2
    barrier_weight: float = 100.0
    keep_weight: float = 1.0  # stage 2: stay close to the stage-1 network on sampled output errors
    polish_steps: int = 40  # after the certificate: accuracy steps that keep it (P, t, lam fixed) ...
    polish_rounds: int = 3  # ... in rounds, each from a fresh SDP solve (more slack to move in)
    polish_barrier: float = 1e-4
    seed: int = 0



@dataclass
class TrainResult:
    """The trained network, its certificate (None if none was reached) and the record of training."""

    net: ObserverNet
    certificate: LMISolution | None
    rho: float
    P_stage1: np.ndarray | None  # the hinge's Lyapunov matrix (None for the direct approach)
    times: dict[str, float]
    history: list[dict[str, float]] = field(default_factory=list)
    config: TrainConfig = field(default_factory=TrainConfig)

    @property
    def certified(self) -> bool:
        return self.certificate is not None and self.certificate.feasible


class _Problem:
    """Torch views of one observer model for the losses (float64)."""

    def __init__(self, model: ObserverModel, cfg: TrainConfig):
        self.model, self.cfg = model, cfg
        t = lambda a: torch.as_tensor(np.asarray(a, dtype=float), dtype=_F64)  # noqa: E731
        em = model.error_model()
        self.em = em
        self.A_L, self.Cd, self.Gf, self.H = t(em.luenberger), t(em.Cd), t(em.Gf), t(em.H)
        self.Ad, self.Bd, self.L, self.K = t(model.Ad), t(model.Bd), t(model.L), t(model.K)
        self.box = t(model.error_box)
        self.u_low, self.u_high = t(model.u_low), t(model.u_high)
        self.noise = t(model.meas_noise_std if model.meas_noise_std.size else np.zeros(model.n_y))
        q = model.process_noise_std if model.process_noise_std.size else np.zeros(model.n_z)
        self.w_std = t(q * np.sqrt(model.dt))  # per-sample process noise of the truth
        self.truth_step = model.truth_step
        self.f = _torch_nonlinearity(model)
        npch = em.Gf.shape[1]
        verts = list(itertools.product(*[(lo, hi) for lo, hi in zip(em.f_lo, em.f_hi, strict=True)]))[:16]
        self.vertices = t(np.array(verts, dtype=float).reshape(len(verts), npch)) if npch else None

    def sample_errors(self, n: int, gen: torch.Generator) -> torch.Tensor:
        """Uniform directions in the box, radii log-uniform in [1e-2, 1] of it: the global certificate needs every scale."""
        u = torch.rand(n, self.box.numel(), generator=gen, dtype=_F64) * 2 - 1
        scale = 10 ** (-2 * torch.rand(n, 1, generator=gen, dtype=_F64))
        return u * self.box * scale

    def lyapunov_hinge(self, net: ObserverNet, e: torch.Tensor, P: torch.Tensor, rho: float) -> torch.Tensor:
        base = e @ self.A_L.T - net(e @ self.Cd.T)
        Ve = ((e @ P) * e).sum(-1)
        if self.vertices is None:
            ratios = (((base @ P) * base).sum(-1) / Ve)[None]
        else:
            q = e @ self.H.T
            nxt = base[None] + (self.vertices[:, None, :] * q[None]) @ self.Gf.T
            ratios = ((nxt @ P) * nxt).sum(-1) / Ve[None]
        worst = ratios.max(0).values
        return torch.relu(worst - (rho ** 2 - self.cfg.point_margin)).mean()

    def trajectory_loss(self, net: ObserverNet, gen: torch.Generator) -> torch.Tensor:
        """Mean squared error (per box half-width) over closed-loop rollouts, relative to ``N = 0``.

        1.0 is the Luenberger observer on the same initial states and noise; the ratio keeps
        the loss on one scale whatever the plant's units and the linear observer's peaking.
        """
        m, n = self.model, self.cfg.n_traj
        z0 = (torch.rand(n, m.n_z, generator=gen, dtype=_F64) * 2 - 1) * self.box
        e0 = (torch.rand(n, m.n_z, generator=gen, dtype=_F64) * 2 - 1) * self.box
        noise = torch.randn(self.cfg.horizon, n, m.n_y, generator=gen, dtype=_F64) * self.noise
        w = torch.randn(self.cfg.horizon, n, m.n_z, generator=gen, dtype=_F64) * self.w_std
        with torch.no_grad():
            ref = self._rollout(None, z0, e0, noise, w)
        return self._rollout(net, z0, e0, noise, w) / ref

    def _rollout(self, net: ObserverNet | None, z: torch.Tensor, e0: torch.Tensor, noise: torch.Tensor,
                 w: torch.Tensor) -> torch.Tensor:
        zh = z - e0
        total = torch.zeros((), dtype=_F64)
        for k in range(self.cfg.horizon):
            y_true = z @ self.Cd.T
            y = y_true + noise[k]
            u = torch.clamp(-(zh @ self.K.T), self.u_low, self.u_high).detach()
            r = y - zh @ self.Cd.T
            if self.truth_step is not None:  # the full model (e.g. the cart-pole's nonlinear one)
                z_next = self.truth_step(z, u) + w[k]
            else:
                z_next = z @ self.Ad.T + u @ self.Bd.T + self.f(z, y_true) + w[k]
            zh = zh @ self.Ad.T + u @ self.Bd.T + self.f(zh, y) + r @ self.L.T
            if net is not None:
                zh = zh + net(r)
            z = z_next
            total = total + (((z - zh) / self.box) ** 2).mean()
        return total / self.cfg.horizon

    def lmi_max_eig(self, net: ObserverNet, sol: LMISolution, rho: float) -> torch.Tensor:
        data = lmi_data(self.em, net.torch_lft(), ops=TORCH_OPS)
        M = data.normalised_matrix(sol.P, sol.t, sol.lam, rho, TORCH_OPS)
        return torch.linalg.eigvalsh(M)[-1]


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """Run torch on one thread: these networks are tiny, and on a loaded 2-core machine a second
    intra-op thread makes every op wait for the slower core (10x slower steps measured)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _torch_nonlinearity(model: ObserverModel) -> Any:
    """``Fd f(z, y)`` in torch with the constant matrices converted once (the rollout's hot path)."""
    spec = model.nonlinearity
    if spec.get("name", "none") == "none":
        return lambda z, y: 0.0
    E, H, Fd = (torch.as_tensor(np.asarray(spec[k] if k != "Fd" else model.Fd, dtype=float), dtype=_F64)
                for k in ("E", "H", "Fd"))
    G = (Fd @ E).T
    if spec["name"] == "sin":
        return lambda z, y: torch.sin(z @ H.T) @ G
    idx = list(np.asarray(spec["index"], dtype=int))
    a, b = (torch.as_tensor(np.asarray(spec[k], dtype=float), dtype=_F64) for k in ("a", "b"))
    return lambda z, y: ((a + b * y[..., idx] ** 2) * (z @ H.T)) @ G


def target_rho(model: ObserverModel, margin: float = 1e-4, slack: float = 0.5) -> tuple[float, LMISolution | None]:
    """A reachable decay target: the best rate certified for the linear part alone (``N = 0``),
    moved ``slack`` of the way to 1 to leave room for the network."""
    em = model.error_model()
    zero = lft_from_weights([np.zeros((model.n_z, model.n_y))], [])
    search = best_decay_rate(em, zero, margin=margin, iters=10)
    if search.best is None:
        raise ValueError(f"{model.name}: the linear observer (N = 0) has no certificate even at rho = 1; the gain L "
                         "does not stabilise the error dynamics against the nonlinearity's sector; re-place L")
    rho = search.best.rho + slack * (1.0 - search.best.rho)
    return float(rho), solve_lmi(em, zero, rho, margin=margin)


def _initial_net(model: ObserverModel, cfg: TrainConfig) -> ObserverNet:
    r_scale = np.abs(model.Cd) @ model.error_box
    out_scale = np.abs(model.L) @ r_scale  # the size of the Luenberger correction per state
    return ObserverNet(model.n_y, model.n_z, cfg.hidden, cfg.activation, cfg.init_gain,
                       in_scale=1.0 / np.maximum(r_scale, 1e-12), out_scale=np.maximum(out_scale, 1e-12))


def train_stage1(model: ObserverModel, cfg: TrainConfig, net: ObserverNet | None = None, *,
                 rho: float | None = None) -> TrainResult:
    """Point-guided Lyapunov pre-training (accuracy + hinge at sampled error states).

    ``rho`` default: ``cfg.rho``, else ``target_rho(model)``; ``P`` is the linear part's
    certificate at that rate (its SDP solution, so it covers the nonlinearity's sector).
    """
    with single_thread():
        return _stage1(model, cfg, net, rho)


def _stage1(model: ObserverModel, cfg: TrainConfig, net: ObserverNet | None, rho: float | None) -> TrainResult:
    t0 = time.perf_counter()
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    linear = None
    if rho is None:
        rho, linear = (cfg.rho, None) if cfg.rho is not None else target_rho(model, cfg.margin, cfg.rho_slack)
    t_target = time.perf_counter() - t0
    if linear is not None and linear.P is not None:
        P1 = linear.P / np.linalg.eigvalsh(linear.P)[0]  # robust to the nonlinearity's sector
    else:
        P1 = lyapunov_matrix(model.error_model().luenberger, rho)
    net = net or _initial_net(model, cfg)
    prob = _Problem(model, cfg)
    P_t = torch.as_tensor(P1, dtype=_F64)
    opt = torch.optim.Adam(net.parameters(), lr=cfg.lr)
    history = []
    for step in range(cfg.stage1_steps):
        acc = prob.trajectory_loss(net, gen)
        lyap = prob.lyapunov_hinge(net, prob.sample_errors(cfg.n_points, gen), P_t, rho)
        loss = acc + cfg.lyap_weight * lyap
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 0 or step == cfg.stage1_steps - 1:
            history.append({"stage": 1, "step": step, "accuracy": acc.item(), "lyapunov_hinge": lyap.item()})
    with torch.no_grad():
        history.append({"stage": 1, "final_accuracy": prob.trajectory_loss(net, torch.Generator().manual_seed(7)).item()})
    times = {"target_rho_s": t_target, "stage1_s": time.perf_counter() - t0 - t_target}
    return TrainResult(net, None, float(rho), P1, times, history, cfg)


def train_stage2(result: TrainResult, model: ObserverModel) -> TrainResult:
    """LMI fine-tuning until the certificate holds at ``result.rho`` with ``cfg.margin``."""
    with single_thread():
        return _stage2(result, model)


def _stage2(result: TrainResult, model: ObserverModel) -> TrainResult:
    cfg, net, rho = result.config, result.net, result.rho
    t0 = time.perf_counter()
    em = model.error_model()
    prob = _Problem(model, cfg)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    opt = torch.optim.Adam(net.parameters(), lr=cfg.stage2_lr)
    ref = copy.deepcopy(net).requires_grad_(False)
    out_scale = net.out_scale.to(_F64)
    n_sdp, sdp_s, n_grad, shrinks = 0, 0.0, 0, 0
    cert: LMISolution | None = None
    prev: LMISolution | None = None
    for rnd in range(cfg.stage2_rounds + 40):
        sol = solve_lmi(em, net.lft(), rho, margin=cfg.margin)
        n_sdp += 1
        sdp_s += sol.solve_time_s
        result.history.append({"stage": 2, "round": rnd, "sdp_max_eig": sol.max_eig, "sdp_s": sol.solve_time_s})
        if sol.feasible:
            cert = sol
            break
        # An inaccurate solve can return a poor (P, t, lam): keep whichever of the last two
        # gives the smaller largest eigenvalue at the current weights.
        if prev is not None and prev.P is not None:
            again = _recheck(em, net, prev, rho)
            if again < sol.max_eig:
                sol = dataclasses.replace(prev, max_eig=again)
        prev = sol
        if rnd >= cfg.stage2_rounds or sol.P is None or not np.isfinite(sol.max_eig):
            # Fallback that always ends: N = 0 is certified at this rho, so shrinking N gets there.
            with torch.no_grad():
                net.raw[-1].mul_(0.5)
            shrinks += 1
            continue
        lmax = prob.lmi_max_eig(net, sol, rho)
        for _ in range(cfg.stage2_steps):
            if lmax.item() <= -cfg.margin:
                break
            r = prob.sample_errors(cfg.n_points, gen) @ prob.Cd.T
            keep = (((net(r) - ref(r)) / out_scale) ** 2).mean()
            loss = cfg.keep_weight * keep + cfg.barrier_weight * torch.relu(lmax + 2 * cfg.margin)
            opt.zero_grad()
            loss.backward()
            opt.step()
            n_grad += 1
            lmax = prob.lmi_max_eig(net, sol, rho)
        result.history.append({"stage": 2, "round": rnd, "fixed_pt_max_eig": lmax.item()})
        # The pushed weights may already satisfy the fixed (P, t, lam): that is a certificate too.
        fixed = _fixed_check(em, net, sol, rho, cfg.margin)
        if fixed is not None:
            cert = fixed
            break
    polished = 0
    for _ in range(cfg.polish_rounds if cert is not None and cfg.polish_steps else 0):
        polished += _polish(net, prob, cert, rho, cfg, gen)
        cert = _fixed_check(em, net, cert, rho, cfg.margin) or cert
        fresh = solve_lmi(em, net.lft(), rho, margin=cfg.margin)
        n_sdp += 1
        sdp_s += fresh.solve_time_s
        if not fresh.feasible:
            break
        cert = fresh
    result.certificate = cert
    with torch.no_grad():
        result.history.append({"stage": 2, "final_accuracy": prob.trajectory_loss(net, torch.Generator().manual_seed(7)).item()})
    result.times.update({"stage2_s": time.perf_counter() - t0, "stage2_sdp_s": sdp_s,
                         "stage2_sdp_solves": float(n_sdp), "stage2_grad_steps": float(n_grad),
                         "stage2_shrinks": float(shrinks), "polish_accepted": float(polished)})
    return result


def _polish(net: ObserverNet, prob: _Problem, sol: LMISolution, rho: float, cfg: TrainConfig,
            gen: torch.Generator) -> int:
    """Recover accuracy inside the certified set: accuracy + log barrier on ``-(max eig Mn + margin)``
    with ``(P, t, lam)`` fixed; a step that leaves the set is undone and the step size halved."""
    opt = torch.optim.Adam(net.parameters(), lr=cfg.stage2_lr)
    good = copy.deepcopy(net.state_dict())
    accepted = 0
    for _ in range(cfg.polish_steps):
        slack = -(prob.lmi_max_eig(net, sol, rho) + cfg.margin)
        if slack.item() <= 0:
            break
        loss = prob.trajectory_loss(net, gen) - cfg.polish_barrier * torch.log(slack)
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            ok = prob.lmi_max_eig(net, sol, rho).item() <= -cfg.margin
        if ok:
            good = copy.deepcopy(net.state_dict())
            accepted += 1
        else:
            net.load_state_dict(good)
            for group in opt.param_groups:
                group["lr"] *= 0.5
    net.load_state_dict(good)
    return accepted


def _recheck(em: Any, net: ObserverNet, sol: LMISolution, rho: float) -> float:
    from closedloop.runtime.families.observer.certificate import check_certificate

    return check_certificate(em, net.lft(), sol.P, sol.t, sol.lam, rho, sol.margin).max_eig


def _fixed_check(em: Any, net: ObserverNet, sol: LMISolution, rho: float, margin: float) -> LMISolution | None:
    from closedloop.runtime.families.observer.certificate import check_certificate

    chk = check_certificate(em, net.lft(), sol.P, sol.t, sol.lam, rho, margin)
    if not chk.passed:
        return None
    return LMISolution(True, rho, margin, chk.max_eig, sol.P, sol.t, sol.lam, "fixed", sol.solver,
                       "fixed (P, t, lam) of the last solve", 0.0, None)


def train_observer(model: ObserverModel, cfg: TrainConfig | None = None) -> TrainResult:
    """Both stages; ``result.times`` holds ``stage1_s``, ``stage2_s`` and ``total_s``.

    Examples
    --------
    >>> from closedloop.sdk.observer.systems import observer_system
    >>> model = ObserverModel.from_system(observer_system("flexible-joint"))
    >>> cfg = TrainConfig(hidden=(6,), stage1_steps=5, horizon=5, n_traj=4, n_points=32)
    >>> train_observer(model, cfg).certified
    True
    """
    cfg = cfg or TrainConfig()
    t0 = time.perf_counter()
    result = train_stage2(train_stage1(model, cfg), model)
    result.times["total_s"] = time.perf_counter() - t0
    return result
