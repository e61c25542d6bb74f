"""The certified neural observer under bit flips: state RMSE in closed loop, and whether its certificate holds."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import numpy as np

from .config import KEY, BitflipBenchConfig


class ObserverEvaluator:
    """The certified neural observer (van der Pol): state RMSE in closed-loop simulation, and whether the
    shipped certificate (LMI with the stored P, t, lam) still holds for the weights the backend holds."""

    name = "observer"
    metric = "state_rmse"
    extra = "certificate_holds"
    split_protected = True  # 20% of its weights are not protected
    precisions = (None,)
    targeted = False

    def __init__(self, cfg: BitflipBenchConfig, work: Path, report=print):
        import torch

        from closedloop.sdk.observer import (
            NeuralObserver,
            ObserverModel,
            TrainConfig,
            certify,
            export_observer_bundle,
            train_observer,
        )
        from closedloop.sdk.observer.systems import observer_system
        from closedloop.sdk.robust import finalize, protect, protect_bundle

        torch.set_num_threads(1)
        self.cfg, self.random_flips = cfg, cfg.observer_flips
        t0 = time.perf_counter()
        self.system = observer_system("van-der-pol")
        self.model = ObserverModel.from_system(self.system)
        tcfg = TrainConfig(hidden=(16, 16)) if not cfg.tiny else TrainConfig(
            hidden=(16, 16), stage1_steps=10, horizon=10, n_traj=4, n_points=64, stage2_rounds=3, stage2_steps=10,
            polish_rounds=1, polish_steps=4)
        net = train_observer(self.model, tcfg).net
        kw = {"local_vbar": None, "coverage_eps": None, "iters": 4 if cfg.tiny else 8}
        cert = certify(self.model, net, **kw)
        silent = lambda s: None  # noqa: E731
        self.bundles = {"unprotected": export_observer_bundle(NeuralObserver(self.model, net), cert,
                                                              work / "obs_unprotected", report=silent)}
        # Protected: the exported plain MLP, projected and distilled back to the certified network's map.
        plain = net.plain()
        plan = protect(plain, torch.zeros(1, self.model.n_y), kind="feedforward", k=cfg.k, key=KEY,
                       min_numel=cfg.observer_min_numel)
        opt = torch.optim.Adam(plain.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(0)
        ref = net.plain()
        for _ in range(40 if cfg.tiny else 600):
            r = torch.randn(256, self.model.n_y, generator=gen)
            loss = ((plain(r) - ref(r).detach()) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        finalize(plain, plan, KEY)
        pnet = copy.deepcopy(net)
        linears = [m for m in plain if isinstance(m, torch.nn.Linear)]
        with torch.no_grad():  # back into the ObserverNet, undoing its fixed in/out scalings
            for i, (raw, lin) in enumerate(zip(pnet.raw, linears, strict=True)):
                w = lin.weight.double()
                if i == 0:
                    w = w / pnet.in_scale.double()[None, :]
                if i == len(linears) - 1:
                    w = w / pnet.out_scale.double()[:, None]
                raw.copy_(w.float())
        pcert = certify(self.model, pnet, **kw)
        self.certified = {"unprotected": bool(cert.certified), "protected": bool(pcert.certified)}
        if not pcert.certified:
            raise RuntimeError(f"the protected observer did not certify (largest eigenvalue {pcert.max_eig:.3g}); "
                               "more distillation steps, a larger k or fewer protected layers")
        path = export_observer_bundle(NeuralObserver(self.model, pnet), pcert, work / "obs_protected", report=silent)
        self.bundles["protected"] = protect_bundle(path, plan, KEY, report=silent)
        self.plan_summary = plan.summary(plain)
        self.errors = np.array(self.system.error_box)[None, :] * np.array([[0.5], [-0.3]])
        report(f"observer: trained, protected (distilled) and certified both in {time.perf_counter() - t0:.0f} s; "
               f"rho {cert.rho:.5f} unprotected, {pcert.rho:.5f} protected")

    def evaluate(self, model, mem=None) -> dict[str, float]:
        import dataclasses
        from types import SimpleNamespace

        from closedloop.runtime.families.observer.certificate import check_bundle_certificate, mlp_from_onnx
        from closedloop.sdk.observer import NeuralObserver, observer_metrics, simulate

        base = model.bundle.onnx()
        onnx_model = dataclasses.replace(base, initializers={**base.initializers, **mem.current()})
        mlp = mlp_from_onnx(onnx_model)
        check = check_bundle_certificate(SimpleNamespace(manifest=model.bundle.manifest, onnx=lambda *a: onnx_model))
        lmi = check.check is not None and not check.check.problems
        obs = NeuralObserver(self.model, mlp.weights, mlp.activations)
        m, box = self.model, self.system.error_box
        rmse = []
        for i, e0 in enumerate(self.errors):
            plant = self.system.make_plant(dist_seed=i)
            x0 = self.system.nominal_x0
            z0 = np.r_[x0, plant.disturbance(0.0)]
            with np.errstate(all="ignore"):
                res = simulate(plant, obs, lambda t, zh: np.clip(-m.K @ zh, m.u_low, m.u_high), 0.5 if self.cfg.tiny
                               else 2.0, self.system.dt, self.system.meas_noise_std, seed=i, x0=x0, z0_hat=z0 - e0)
                v = observer_metrics(res, scale=box).state_rmse
            rmse.append(v if np.isfinite(v) else 1e6)
        # certificate_holds: the shipped LMI (stored P, t, lam, rho) still holds for these weights, i.e. the
        # stability guarantee survives; weights_as_certified: bit-identical to the certified weights.
        return {"state_rmse": float(np.mean(rmse)), "certificate_holds": float(lmi),
                "weights_as_certified": float(bool(check.fingerprint_ok))}

