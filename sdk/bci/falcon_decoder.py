"""A ``falcon_challenge`` decoder that runs a closedloop bundle: FALCON H2 scoring of deployed models.

The FALCON evaluator drives a ``falcon_challenge.interface.BCIDecoder``: ``reset`` once
per data file (not between trials), ``predict`` once per 20 ms bin with an array of
shape (1, 192), and ``on_done`` at each trial's last bin, whose return value is the
trial's decoded sentence. ``FalconBundleDecoder`` answers those calls with the very
code a live session runs (``runtime.Model`` and the ``bci_handwriting`` family: the
same normalisation, model step and streaming greedy CTC), so a score measured here is
the score of the deployed bundle. There is no torch in this path.

Each FALCON session needs its own calibrated bundle (its alignment layer and its
normalisation). Give one bundle for every file, or a mapping from a session key (a
substring of the data file's name, or a date in any of the forms ``2023.04.17``,
``2023-04-17``, ``20230417``, which matches the file of that day whichever form its name
uses, or ``"*"`` for any other) to a bundle; ``reset`` picks the bundle by the file name
it is given.

``falcon_challenge`` is optional: without it the class derives from a local base
with the same methods, so the adapter also runs where only the runtime is installed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

try:  # the package pulls in dandi, hydra and torch; the interface module itself needs none of them
    from falcon_challenge.interface import BCIDecoder as _Base

    HAVE_FALCON_CHALLENGE = True
except ImportError:
    HAVE_FALCON_CHALLENGE = False

    class _Base:  # type: ignore[no-redef]
        """Stand-in for ``falcon_challenge.interface.BCIDecoder`` (same methods)."""

        def __init__(self, task_config: Any = None, batch_size: int = 1):
            self._task_config = task_config
            self.batch_size = batch_size

        def reset(self, dataset_tags: Sequence[str] = ("",)) -> None:
            raise NotImplementedError

        def predict(self, neural_observations: np.ndarray) -> np.ndarray:
            raise NotImplementedError

        def observe(self, neural_observations: np.ndarray) -> None:
            self.predict(neural_observations)

        def on_done(self, dones: np.ndarray) -> Any:
            raise NotImplementedError

        def set_batch_size(self, batch_size: int) -> None:
            self.batch_size = batch_size


__all__ = ["HAVE_FALCON_CHALLENGE", "FalconBundleDecoder", "h2_task_config"]

ANY_SESSION = "*"


def h2_task_config() -> Any:
    """``FalconConfig(task=FalconTask.h2)`` when falcon_challenge is installed, else None."""
    if not HAVE_FALCON_CHALLENGE:
        return None
    from falcon_challenge.config import FalconConfig, FalconTask

    return FalconConfig(task=FalconTask.h2)


class _Loaded:
    """One bundle on its backend, with the decoder family around it."""

    def __init__(self, path: str | Path, backend: str):
        from closedloop.runtime import Model, get_family, load_bundle

        self.bundle = load_bundle(path)
        self.model = Model(self.bundle, backend=backend)
        self.family = get_family(self.bundle.manifest.family)(self.bundle, self.model)
        if self.bundle.manifest.family != "bci_handwriting":
            raise ValueError(f"bundle {path} is family {self.bundle.manifest.family!r}; the FALCON H2 adapter runs "
                             "'bci_handwriting' bundles (sdk.bci.export_bci_bundle)")


class FalconBundleDecoder(_Base):
    """FALCON H2 decoder backed by one or more ``bci_handwriting`` bundles.

    Parameters
    ----------
    bundles
        A bundle path, or ``{session key: bundle path}`` (see the module docstring).
    backend
        Runtime backend (``"auto"`` times the available ones and keeps the fastest).
    task_config
        Passed to ``BCIDecoder`` (default ``FalconConfig(task=FalconTask.h2)``).
    batch_size
        Must be 1: H2 is evaluated one bin of one trial at a time.
    """

    def __init__(
        self,
        bundles: str | Path | Mapping[str, str | Path],
        *,
        backend: str = "auto",
        task_config: Any = None,
        batch_size: int = 1,
    ):
        if batch_size != 1:
            raise ValueError(f"batch_size {batch_size}: FALCON H2 evaluates with batch size 1")
        super().__init__(task_config if task_config is not None else h2_task_config(), batch_size)
        self._paths = {ANY_SESSION: bundles} if isinstance(bundles, str | Path) else dict(bundles)
        if not self._paths:
            raise ValueError("no bundles given; pass a bundle path or {session key: bundle path}")
        self.backend = backend
        self._loaded: dict[str, _Loaded] = {}
        self._active: _Loaded | None = None
        self.session_key: str | None = None
        self.trials_done = 0

    def set_batch_size(self, batch_size: int) -> None:
        if batch_size != 1:
            raise ValueError(f"batch_size {batch_size}: FALCON H2 evaluates with batch size 1")
        self.batch_size = 1

    def _key_for(self, tag: str) -> str:
        from .nwb import parse_falcon_name

        name = Path(str(tag)).name
        day = parse_falcon_name(name).date  # DANDI's ses-20230417 and FALCON's 2023.04.17 name the same day
        hits = [k for k in self._paths if k != ANY_SESSION and (
            k == str(tag) or k in name or (day is not None and parse_falcon_name(k).date == day))]
        if len(hits) > 1:
            raise ValueError(f"data file {name!r} matches several session keys {hits}; use longer keys")
        if hits:
            return hits[0]
        if ANY_SESSION in self._paths:
            return ANY_SESSION
        raise ValueError(f"no bundle for data file {name!r}: session keys are {sorted(self._paths)}; add its key "
                         f"(part of the file name) or a {ANY_SESSION!r} entry")

    def reset(self, dataset_tags: Sequence[str] = ("",)) -> None:
        """A new data file: pick its session's bundle and clear all decoding state."""
        key = self._key_for(dataset_tags[0])
        if key not in self._loaded:
            self._loaded[key] = _Loaded(self._paths[key], self.backend)
        self._active = self._loaded[key]
        self.session_key = key
        self._active.family.reset()

    @property
    def family(self) -> Any:
        """The active ``bci_handwriting`` family (``reset`` must have been called)."""
        if self._active is None:
            raise RuntimeError("FalconBundleDecoder: call reset(dataset_tags) before predict/on_done")
        return self._active.family

    def predict(self, neural_observations: np.ndarray) -> np.ndarray:
        """One bin, shape (1, channels): normalise, step, decode. Returns the (1, outputs) log-probabilities."""
        fam = self.family
        obs = np.asarray(neural_observations)
        if obs.ndim != 2 or obs.shape[0] != 1 or obs.shape[1] != fam.n_channels:
            raise ValueError(f"neural_observations has shape {obs.shape}; expected (1, {fam.n_channels})")
        fam.decode_bin(obs[0])
        return fam.log_probs

    def on_done(self, dones: np.ndarray) -> str:
        """At a trial's last bin: return the trial's sentence and reset for the next trial."""
        if not bool(np.asarray(dones).reshape(-1)[0]):
            return ""
        self.trials_done += 1
        return self.family.end_trial()

    def close(self) -> None:
        for loaded in self._loaded.values():
            loaded.model.close()
        self._loaded.clear()
        self._active = None
