"""Training speed of the handwriting decoder on one CPU thread: PyTorch's nn.GRU and F.ctc_loss against
sdk.bci.fastgru and sdk.bci.fastctc.

    python bench/bench_bci_gru.py        # a few minutes; writes bench/results/bci_gru/bci_gru_speed.{json,md,png}

Times, over trials of 1076 bins (the benchmark recording's mean trial, 21.5 s) and the
benchmark's 192 -> 1 x 128 GRU + read-out:

* one GRU training step (forward, a CTC-shaped loss, backward to every weight) on stage 1's
  batch of 16 trials and a calibration batch of 2, through ``nn.GRU`` and through the
  backbone's own backward pass (what ``GRUBackbone`` runs while training on CPU);
* a frozen GRU behind a trained input (a calibration step: the gradient reaches the input only);
* the fine-tuning baseline's cross-validation step, 9 fits of 2 trials each (3 learning
  rates x 3 leave-one-out folds): one ``nn.GRU`` copy after another
  against :func:`closedloop.sdk.bci.fastgru.stacked_backbone`, all 9 in one batch;
* the CTC loss and its gradient for 16 trials of 60 characters: ``F.ctc_loss`` against
  :func:`closedloop.sdk.bci.fastctc.fast_ctc_loss`;
* a whole stage-1 step as ``closedloop.sdk.bci.train.fit_ctc`` runs it (drift augmentation, model, CTC
  loss, backward, clipping, Adam) with ``nn.GRU`` + ``F.ctc_loss`` against both fast paths.

Each GRU row is also timed with fastgru's recurrence as a torch loop
(``fastgru.use_compiled = False``) against its compiled Numba kernels (the default).

Each figure is the median of ``--reps`` timed steps after one warm-up step, the sides of a
row timed in turn, on an idle machine.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

from closedloop.common.atomic import atomic_write_bytes, atomic_write_text
from closedloop.sdk.bci import data, fastgru
from closedloop.sdk.bci.benchmark import TURNOVER_AUGMENTATION
from closedloop.sdk.bci.data import Example, collate, ctc_loss
from closedloop.sdk.bci.fastgru import stacked_backbone
from closedloop.sdk.bci.models import GRUBackbone


def _median_s(first, second, reps: int, loop: bool = True) -> tuple[float, float, float | None]:
    """Median seconds of ``first()``, of ``second()`` and (``loop``) of ``second()`` with fastgru's torch-loop
    recurrence (``fastgru.use_compiled = False``), timed in turn, rep after rep (a busy
    neighbour slows all alike).
    """

    def torch_loop() -> None:
        fastgru.use_compiled = False
        try:
            second()
        finally:
            fastgru.use_compiled = True

    fns = (first, second, torch_loop) if loop else (first, second)
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, out in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    medians = [float(np.median(t)) for t in times]
    return medians[0], medians[1], medians[2] if loop else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--bins", type=int, default=1076)
    ap.add_argument("--out", default="bench/results/bci_gru", help="results folder (default bench/results/bci_gru)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    bb = GRUBackbone(192, 128, 1).eval()
    params = list(bb.parameters())

    def nn_gru_step(x: torch.Tensor, w: torch.Tensor) -> None:
        logp = torch.log_softmax(bb.readout(bb.gru(x)[0]), -1)
        torch.autograd.grad((logp * w).sum(), params)

    def fast_step(x: torch.Tensor, w: torch.Tensor) -> None:
        torch.autograd.grad((bb(x)[0] * w).sum(), params)

    rows = []

    def add_row(case: str, times: tuple[float, float, float | None]) -> None:
        ref, new, loop = times
        rows.append({"case": case, "reference_s": ref, "fast_s": new, "torch_loop_s": loop})

    for batch in (16, 2):
        x, w = torch.randn(batch, a.bins, 192), torch.randn(batch, a.bins, 32)
        times = _median_s(lambda x=x, w=w: nn_gru_step(x, w), lambda x=x, w=w: fast_step(x, w), a.reps)
        add_row(f"one GRU, batch {batch}", times)

    x, w = torch.randn(2, a.bins, 192, requires_grad=True), torch.randn(2, a.bins, 32)
    frozen = GRUBackbone(192, 128, 1).eval().requires_grad_(False)

    def frozen_step(fast: bool) -> None:
        GRUBackbone.use_fastgru = fast
        torch.autograd.grad((frozen(x)[0] * w).sum(), x)

    times = _median_s(lambda: frozen_step(False), lambda: frozen_step(True), a.reps)
    GRUBackbone.use_fastgru = True
    add_row("frozen GRU, input gradient, batch 2", times)

    n_fits = 9
    x, w = torch.randn(n_fits, 2, a.bins, 192), torch.randn(n_fits, 2, a.bins, 32)
    stacked = {k: v.detach().expand(n_fits, *v.shape).clone().requires_grad_() for k, v in bb.named_parameters()}

    def sequential() -> None:
        for i in range(n_fits):
            nn_gru_step(x[i], w[i])

    def batched() -> None:
        torch.autograd.grad((stacked_backbone(stacked, x, 1) * w).sum(), list(stacked.values()))

    times = _median_s(sequential, batched, a.reps)
    add_row(f"{n_fits} fine-tuning fits of batch 2", times)

    rng = np.random.default_rng(0)
    examples = [Example(rng.standard_normal((a.bins, 192)).astype(np.float32), rng.integers(1, 31, 60), "")
                for _ in range(16)]
    batch = collate(examples)
    logits = torch.randn(16, a.bins, 32, requires_grad=True)

    def ctc_step(fast: bool) -> None:
        data.USE_FAST_CTC = fast
        torch.autograd.grad(ctc_loss(torch.log_softmax(logits, -1), batch), logits)

    times = _median_s(lambda: ctc_step(False), lambda: ctc_step(True), a.reps, loop=False)
    add_row("CTC loss + gradient, 16 x 60 characters", times)

    model = GRUBackbone(192, 128, 1, 0.1).train()
    opt = torch.optim.Adam(model.parameters(), 3e-3)
    augment, gen = TURNOVER_AUGMENTATION, torch.Generator().manual_seed(0)

    def stage1_step(fast: bool) -> None:
        GRUBackbone.use_fastgru = data.USE_FAST_CTC = fast
        loss = ctc_loss(model(augment(batch.x, gen, per="trial"))[0], batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
        opt.step()

    times = _median_s(lambda: stage1_step(False), lambda: stage1_step(True), a.reps)
    GRUBackbone.use_fastgru = data.USE_FAST_CTC = True
    add_row("stage-1 step, batch 16", times)
    for r in rows:
        r["speedup"] = r["reference_s"] / r["fast_s"]

    def loop_cells(r: dict) -> str:
        if r["torch_loop_s"] is None:
            return "| - | - "
        return f"| {r['torch_loop_s']:.3f} | {r['torch_loop_s'] / r['fast_s']:.2f}x "

    table = ("| training step | nn.GRU / F.ctc_loss (s) | fastgru / fastctc (s) | speed-up | fastgru, torch-loop "
             "recurrence (s) | compiled recurrence's speed-up |\n| --- | --- | --- | --- | --- | --- |\n"
             + "\n".join(f"| {r['case']} | {r['reference_s']:.3f} | {r['fast_s']:.3f} | {r['speedup']:.2f}x "
                          + loop_cells(r) + "|" for r in rows))
    print(table)
    out = Path(a.out)
    doc = {"command": "python bench/bench_bci_gru.py", "bins": a.bins, "reps": a.reps, "threads": 1, "rows": rows,
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                       "loadavg": os.getloadavg()}}
    atomic_write_text(out / "bci_gru_speed.json", json.dumps(doc, indent=2))
    atomic_write_text(out / "bci_gru_speed.md", table + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    pos = np.arange(len(rows))
    ax.bar(pos - 0.27, [r["reference_s"] for r in rows], 0.27, label="nn.GRU / F.ctc_loss")
    ax.bar(pos, [r["torch_loop_s"] or 0.0 for r in rows], 0.27, label="fastgru, torch-loop recurrence")
    ax.bar(pos + 0.27, [r["fast_s"] for r in rows], 0.27, label="closedloop.sdk.bci.fastgru (compiled) / fastctc")
    ax.set_xticks(pos, [r["case"] for r in rows], fontsize=7, rotation=20, ha="right")
    ax.set_ylabel("seconds per training step (1 thread)")
    ax.legend()
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, dpi=120, format="png")
    atomic_write_bytes(out / "bci_gru_speed.png", png.getvalue())
    print(f"wrote {out / 'bci_gru_speed.json'}, .md and .png")


if __name__ == "__main__":
    main()
