"""The direct approach, the baseline of the training-time comparison: the LMI enforced at every training step.

Each step solves the certificate's SDP at the current weights (full form, the target
``rho``), then takes one gradient step on the stage-1 accuracy loss plus the same
penalty on the largest eigenvalue of the LMI matrix (with that step's ``P`` and
multipliers) that stage 2 of ``closedloop.sdk.observer.train`` uses. It trains for the same number
of steps as stage 1, then keeps stepping (penalty only) until a solve certifies, so both
approaches end with a certificate and their wall-clock times compare like for like.
"""

from __future__ import annotations

import time

import torch

from .lmi import solve_lmi
from .neural import ObserverModel
from .train import TrainConfig, TrainResult, _initial_net, _Problem, single_thread, target_rho


def train_direct(model: ObserverModel, cfg: TrainConfig | None = None, *, max_extra_steps: int = 200) -> TrainResult:
    """Train with the certificate's SDP solved at every step; ``times`` as in ``train_observer``.

    ``times["total_s"]`` is the wall clock to a certified network (or to giving up after
    ``stage1_steps + max_extra_steps`` steps; then ``result.certified`` is False).
    """
    cfg = cfg or TrainConfig()
    with single_thread():
        t0 = time.perf_counter()
        torch.manual_seed(cfg.seed)
        gen = torch.Generator().manual_seed(cfg.seed)
        rho = cfg.rho if cfg.rho is not None else target_rho(model, cfg.margin, cfg.rho_slack)[0]
        t_target = time.perf_counter() - t0
        net = _initial_net(model, cfg)
        em = model.error_model()
        prob = _Problem(model, cfg)
        opt = torch.optim.Adam(net.parameters(), lr=cfg.lr)
        history: list[dict[str, float]] = []
        cert = None
        sdp_s, n_sdp = 0.0, 0
        for step in range(cfg.stage1_steps + max_extra_steps):
            sol = solve_lmi(em, net.lft(), rho, margin=cfg.margin)
            sdp_s += sol.solve_time_s
            n_sdp += 1
            training = step < cfg.stage1_steps
            if sol.feasible and not training:
                cert = sol
                break
            loss = prob.trajectory_loss(net, gen) if training else torch.zeros((), dtype=torch.float64)
            if sol.P is not None and not sol.feasible:
                loss = loss + cfg.barrier_weight * torch.relu(prob.lmi_max_eig(net, sol, rho) + 2 * cfg.margin)
            if loss.requires_grad:
                opt.zero_grad()
                loss.backward()
                opt.step()
            if step % 10 == 0:
                history.append({"stage": 0, "step": step, "loss": loss.item(), "sdp_max_eig": sol.max_eig})
        with torch.no_grad():
            history.append({"stage": 0, "final_accuracy": prob.trajectory_loss(net, torch.Generator().manual_seed(7)).item()})
        times = {"target_rho_s": t_target, "sdp_s": sdp_s, "sdp_solves": float(n_sdp),
                 "total_s": time.perf_counter() - t0}
    return TrainResult(net, cert, float(rho), None, times, history, cfg)
