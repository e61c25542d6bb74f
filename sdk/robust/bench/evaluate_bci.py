"""The iBCI decoder under bit flips: CER/WER of greedy CTC decoding through the runtime.

A small GRU decoder is trained on the synthetic handwriting recording, then fine-tuned three
ways for the same number of steps (unconstrained, constrained keyed, constrained unkeyed) and
exported; the unprotected bundle gets a plain per-tensor int8 variant for comparison.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from .config import KEY, BitflipBenchConfig


@dataclass
class BciData:
    examples: list = field(default_factory=list)  # training examples (held-in, non-evaluation trials)
    eval_sets: list = field(default_factory=list)  # per session: (normalised x list, references)


def _bci_data(cfg: BitflipBenchConfig) -> BciData:
    from closedloop.sdk.bci.data import make_examples, session_normalization
    from closedloop.sdk.bci.train import held_in_examples
    from closedloop.sim.handwriting import HandwritingConfig, generate_recording

    # Short sentences (the tiny writing config) over all of FALCON's held-in days: CTC needs hundreds of
    # training sentences to get anywhere (on 3 sessions x 36 sentences it stalled near 68% CER).
    full = HandwritingConfig()
    hw = replace(HandwritingConfig.tiny(0), n_channels=cfg.n_channels, trials_per_session=cfg.trials_per_session,
                 held_in_dates=full.held_in_dates[: cfg.sessions], held_out_dates=full.held_out_dates[:1])
    sessions = generate_recording(hw)
    held_in = [s for s in sessions if s.split == "held_in"]
    out = BciData(held_in_examples(sessions))
    for s in held_in[: cfg.eval_sessions]:
        ex = make_examples(s, s.evaluation, session_normalization(s))
        out.eval_sets.append(([e.x for e in ex], [e.sentence for e in ex]))
    return out


def _train(module, examples, steps, lr, seed, what):
    from closedloop.sdk.bci.train import BackboneConfig, TrainConfig, fit_ctc

    cfg = TrainConfig(backbone=BackboneConfig(module.n_hidden, module.n_layers, 0.0), steps=steps, batch_size=8,
                      lr=lr, seed=seed, device="cpu", progress=False)
    fit_ctc(module, lambda x, b: module(x)[0], examples, cfg, what)
    return module.eval()


def plain_int8(path: Path, module, example_input, kind: str) -> None:
    """The unprotected baseline's int8 variant: the same weight-only int8 graph, plain per-tensor rounding."""
    from closedloop.export.writer import write_bundle
    from closedloop.runtime import load_bundle
    from closedloop.sdk.robust.protection import probe_onnx_layout
    from closedloop.sdk.robust.quantize import int8_weight_only

    b = load_bundle(path)
    tensors, _ = probe_onnx_layout(module, example_input, kind)
    inits = b.onnx("main").initializers
    q = {}
    for t in tensors:
        w = inits[t.onnx_name]
        s = float(np.abs(w).max()) / 127.0
        q[t.onnx_name] = (np.clip(np.round(w / s), -127, 127).astype(np.int8), s)
    files = {rel: (b.root / rel).read_bytes() for rel in b.manifest.files}
    files["main.int8.onnx"] = int8_weight_only(files["main.onnx"], q)
    b.manifest.graphs["main"].variants["int8"] = {"file": "main.int8.onnx", "quantizer": "plain weight-only int8"}
    write_bundle(path, b.manifest, files, overwrite=True)


class BciEvaluator:
    """CER/WER of greedy CTC decoding on held-in evaluation trials, run through the runtime."""

    name = "bci"
    metric = "CER"
    extra = "WER"
    precisions = (None, "int8")
    targeted = True

    def __init__(self, cfg: BitflipBenchConfig, work: Path, report=print):
        import torch

        from closedloop.sdk.bci.models import GRUBackbone
        from closedloop.sdk.robust import finalize, protect, protect_bundle

        torch.set_num_threads(1)
        self.cfg, self.report = cfg, report
        self.random_flips = cfg.random_flips
        t0 = time.perf_counter()
        self.data = _bci_data(cfg)
        torch.manual_seed(0)
        base = GRUBackbone(cfg.n_channels, cfg.hidden, 1, 0.0)
        _train(base, self.data.examples, cfg.train_steps, 1e-2, 0, "bitflip: base")
        report(f"bci: trained the base decoder ({cfg.n_channels} ch, GRU {cfg.hidden}) in {time.perf_counter() - t0:.0f} s")
        ex = torch.zeros(1, cfg.n_channels)
        models = {"unprotected": copy.deepcopy(base), "protected": copy.deepcopy(base),
                  "protected_unkeyed": copy.deepcopy(base)}
        plans = {}
        for name, m in models.items():
            key = KEY if name == "protected" else None
            if name != "unprotected":
                plans[name] = (protect(m, ex, kind="recurrent", k=cfg.k, key=key), key)
            _train(m, self.data.examples, cfg.finetune_steps, 3e-3, 1, f"bitflip: fine-tune {name}")
            if name != "unprotected":
                finalize(m, *plans[name])
        self.bundles = {}
        for name, m in models.items():
            path = self._export(m, work / name)
            if name in plans:
                protect_bundle(path, plans[name][0], plans[name][1], report=lambda s: None)
            else:
                plain_int8(path, m, torch.zeros(1, cfg.n_channels), "recurrent")
            self.bundles[name] = path
        self.plan_summary = plans["protected"][0].summary(models["protected"])
        self.clean_cost = self._clean_cost(base, models, ex)
        report(f"bci: bundles ready in {time.perf_counter() - t0:.0f} s; protected {self.plan_summary['protected_fraction']:.1%} "
               f"of the weights ({', '.join(self.plan_summary['protected_tensors'])})")

    def _clean_cost(self, base, models, ex) -> dict:
        """Clean CER (torch, full sequences) of unconstrained and constrained fine-tunes over several seeds.

        One fine-tune per model and seed differs from the next by a few percent relative CER, as much as the
        constraints cost, so the cost is read from the mean over seeds (the deployed pair is seed 1).
        """
        from closedloop.sdk.robust import finalize, protect

        cfg = self.cfg
        out = {"seeds": [1, *cfg.clean_cost_seeds], "unprotected": [self._torch_cer(models["unprotected"])],
               "protected": [self._torch_cer(models["protected"])]}
        for seed in cfg.clean_cost_seeds:
            for name in ("unprotected", "protected"):
                m = copy.deepcopy(base)
                plan = protect(m, ex, kind="recurrent", k=cfg.k, key=KEY) if name == "protected" else None
                _train(m, self.data.examples, cfg.finetune_steps, 3e-3, seed, f"bitflip: clean cost {name} {seed}")
                if plan is not None:
                    finalize(m, plan, KEY)
                out[name].append(self._torch_cer(m))
        mu, mp = float(np.mean(out["unprotected"])), float(np.mean(out["protected"]))
        out |= {"unprotected_mean": mu, "protected_mean": mp, "relative": mp / mu - 1,
                "per_seed_relative": [p / u - 1 for u, p in zip(out["unprotected"], out["protected"], strict=True)]}
        self.report(f"bci: clean CER over fine-tuning seeds {out['seeds']}: unconstrained "
                    + ", ".join(f"{v:.4f}" for v in out["unprotected"]) + " (mean "
                    f"{mu:.4f}), constrained " + ", ".join(f"{v:.4f}" for v in out["protected"])
                    + f" (mean {mp:.4f}): {out['relative']:+.1%}")
        return out

    def _torch_cer(self, module) -> float:
        import torch

        from closedloop.sdk.bci.decoding import greedy_decode
        from closedloop.sdk.bci.metrics import falcon_metrics

        preds, refs = [], []
        with torch.no_grad():
            for xs, sentences in self.data.eval_sets:
                preds.append([greedy_decode(module(torch.as_tensor(x)[None])[0][0].numpy()) for x in xs])
                refs.append(sentences)
        return float(falcon_metrics(preds, refs)["CER"])

    def _export(self, module, out: Path) -> Path:
        from closedloop.export import export_bundle

        return export_bundle(module, out, kind="recurrent", example_input=__import__("torch").zeros(1, self.cfg.n_channels),
                             rate_hz=50.0, variants=("fp16",), tensorrt=False, report=lambda s: None)

    def evaluate(self, model, mem=None) -> dict[str, float]:
        from closedloop.sdk.bci.decoding import greedy_decode
        from closedloop.sdk.bci.metrics import falcon_metrics

        preds, refs = [], []
        for xs, sentences in self.data.eval_sets:
            p = []
            for x in xs:
                model.reset()
                out = np.stack([np.array(model.step(x[t])[0], dtype=np.float32) for t in range(x.shape[0])])
                p.append(greedy_decode(np.nan_to_num(out, nan=-1e30)))
            preds.append(p)
            refs.append(sentences)
        m = falcon_metrics(preds, refs)
        return {"CER": float(m["CER"]), "WER": float(m["WER"])}

    def attack_data(self) -> np.ndarray:
        xs = [x for s in self.data.eval_sets for x in s[0]][: self.cfg.attack_batch]
        steps = min(self.cfg.attack_steps, min(x.shape[0] for x in xs))
        return np.stack([x[:steps] for x in xs])


