"""From sessions of trials to normalised, labelled, padded training batches.

Normalisation is per session and per channel, :math:`(x - \\mu) / \\sigma`, and is
computed only from the data that session has when it is decoded: a held-in
session's training trials (its non-evaluation trials), a held-out session's
calibration trials (FALCON: its first three sentences). Every method uses the same
statistics; they travel with a bundle as ``preprocess.mean`` / ``preprocess.std``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from closedloop.common.handwriting import Session, Trial

from .charset import BLANK, encode
from .fastctc import fast_ctc_loss

#: CPU float32 CTC through :mod:`closedloop.sdk.bci.fastctc` (6-8x faster than ``F.ctc_loss`` there, same
#: loss and weight gradients); False: always ``F.ctc_loss``.
USE_FAST_CTC = True

#: Floor on a channel's standard deviation, in spike counts per bin: keeps nearly
#: silent channels (or channels silent in three calibration sentences) from blowing up.
DEFAULT_STD_FLOOR = 0.3


@dataclass
class Normalization:
    """Per-channel mean and standard deviation of one session."""

    mean: np.ndarray
    std: np.ndarray

    @classmethod
    def from_trials(cls, trials: Sequence[Trial], std_floor: float = DEFAULT_STD_FLOOR) -> Normalization:
        if not trials:
            raise ValueError("normalisation needs at least one trial; a held-out session needs its calibration trials")
        x = np.concatenate([np.asarray(t.spikes, dtype=np.float64) for t in trials])
        return cls(x.mean(0).astype(np.float32), np.maximum(x.std(0), std_floor).astype(np.float32))

    def apply(self, spikes: np.ndarray) -> np.ndarray:
        return ((np.asarray(spikes, dtype=np.float32) - self.mean) / self.std).astype(np.float32)

    def as_preprocess(self) -> dict:
        """The bundle's ``preprocess`` block."""
        return {"mean": self.mean.tolist(), "std": self.std.tolist()}


def fit_indices(session: Session) -> list[int]:
    """Trials a session may learn from: held-in, every non-evaluation trial; held-out, its calibration trials."""
    if session.split == "held_out":
        return list(session.calibration)
    ev = set(session.evaluation)
    return [i for i in range(len(session.trials)) if i not in ev]


def session_normalization(session: Session, std_floor: float = DEFAULT_STD_FLOOR) -> Normalization:
    """The session's normalisation, from :func:`fit_indices` only."""
    idx = fit_indices(session)
    if not idx:
        raise ValueError(f"session {session.name!r} ({session.split}) has no trials to compute its normalisation from")
    return Normalization.from_trials([session.trials[i] for i in idx], std_floor)


@dataclass
class Example:
    """One normalised trial: ``x`` (T, C) float32, ``labels`` (L,) int64, its session's index."""

    x: np.ndarray
    labels: np.ndarray
    sentence: str
    session: int = 0


def make_examples(
    session: Session, indices: Sequence[int], normalization: Normalization, session_index: int = 0
) -> list[Example]:
    return [
        Example(normalization.apply(session.trials[i].spikes), np.asarray(encode(session.trials[i].sentence)),
                session.trials[i].sentence, session_index)
        for i in indices
    ]


@dataclass
class Batch:
    """Padded trials: ``x`` (B, T, C), lengths, concatenated targets, session indices."""

    x: torch.Tensor
    x_lens: torch.Tensor
    targets: torch.Tensor
    target_lens: torch.Tensor
    session: torch.Tensor

    def to(self, device: torch.device | str) -> Batch:
        return Batch(self.x.to(device), self.x_lens, self.targets, self.target_lens, self.session.to(device))


def collate(examples: Sequence[Example], device: torch.device | str = "cpu") -> Batch:
    t_max = max(e.x.shape[0] for e in examples)
    x = np.zeros((len(examples), t_max, examples[0].x.shape[1]), dtype=np.float32)
    for i, e in enumerate(examples):
        x[i, : e.x.shape[0]] = e.x
    return Batch(
        torch.from_numpy(x).to(device),
        torch.tensor([e.x.shape[0] for e in examples], dtype=torch.long),
        torch.from_numpy(np.concatenate([e.labels for e in examples])).long(),
        torch.tensor([len(e.labels) for e in examples], dtype=torch.long),
        torch.tensor([e.session for e in examples], dtype=torch.long, device=device),
    )


def iterate_batches(examples: Sequence[Example], batch_size: int, rng: np.random.Generator,
                    shortest_first_epochs: int = 0) -> Iterator[list[Example]]:
    """Endless shuffled batches of trials of similar length (less padding, same randomness).

    During the first ``shortest_first_epochs`` epochs the batches come shortest first
    instead of shuffled (SortaGrad, Amodei et al. 2016, Deep Speech 2: CTC training
    starts more reliably on short sequences).
    """
    n = len(examples)
    if n == 0:
        raise ValueError("no training trials")
    lengths = np.array([e.x.shape[0] for e in examples])
    epoch = 0
    while True:
        # sort by length with random tie-breaking noise, cut into batches, shuffle the batches
        order = np.argsort(lengths * rng.uniform(0.8, 1.2, n))
        chunks = [order[i: i + batch_size] for i in range(0, n, batch_size)]
        shuffled = rng.permutation(len(chunks))  # drawn every epoch: the random stream does not depend on the option
        for k in (range(len(chunks)) if epoch < shortest_first_epochs else shuffled):
            yield [examples[j] for j in chunks[k]]
        epoch += 1


def ctc_loss(logp: torch.Tensor, batch: Batch, reduction: str = "mean") -> torch.Tensor:
    """CTC loss of ``logp`` (B, T, 32) against the batch's sentences (per-target-length mean by default).

    On CPU (float32) :func:`closedloop.sdk.bci.fastctc.fast_ctc_loss` computes it; elsewhere ``F.ctc_loss``.
    Both are first-order only.
    """
    if USE_FAST_CTC and logp.device.type == "cpu" and logp.dtype == torch.float32:
        return fast_ctc_loss(logp, batch.targets, batch.x_lens, batch.target_lens, BLANK, reduction, True)
    return F.ctc_loss(
        logp.transpose(0, 1), batch.targets.to(logp.device), batch.x_lens.to(logp.device), batch.target_lens.to(logp.device),
        blank=BLANK, reduction=reduction, zero_infinity=True,
    )


def resolve_device(device: str) -> torch.device:
    """``"auto"``: CUDA when present, else CPU; anything else as given, checked to exist here.

    Raises ``ValueError`` naming the request when it is not a device string, or asks for a
    CUDA device this machine (or this PyTorch build) does not have, before any work starts.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is not a device: expected 'auto', 'cpu', 'cuda' or 'cuda:N'") from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = f"PyTorch {torch.__version__}" + ("" if torch.version.cuda else ", a CPU-only build")
            raise ValueError(f"device {device!r}: no CUDA GPU is available ({build}); use device 'cpu' or 'auto', "
                             "or install a CUDA build of PyTorch (the Makefile's TORCH_SPEC)")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"device {device!r}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}")
    elif dev.type != "cpu":
        raise ValueError(f"device {device!r}: the iBCI training runs on 'cpu' or 'cuda' (or 'auto')")
    return dev
