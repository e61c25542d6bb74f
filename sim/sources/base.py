"""The :class:`NeuralSource` interface and its registry: where a headstage's spike counts come from.

A source yields one bin of spike counts per call (``next_bin``), one count per
channel.  The headstage emulator asks the registry for a source by name
(``sim://headstage?source=NAME``); the source's own ``PARAMS`` become URL parameters.
Shipped: ``poisson``.  A synthetic handwriting source registers itself the same way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import numpy as np

from ..params import Param

__all__ = ["NeuralSource", "NEURAL_SOURCES", "register_source", "source_class", "make_source",
           "UnknownSourceError"]

S = TypeVar("S", bound=type["NeuralSource"])


class UnknownSourceError(KeyError):
    """No neural source is registered under the requested name."""

    def __str__(self) -> str:
        return str(self.args[0])


class NeuralSource(ABC):
    """Binned spike counts, one bin per :meth:`next_bin` call.

    Parameters
    ----------
    n_channels : int
        Channels per bin.
    rate_hz : float
        Bins per second (a 20 ms bin is 50 Hz).
    seed : int
        Seed of every random draw.
    **params
        The source's own ``PARAMS``.
    """

    PARAMS: ClassVar[tuple[Param, ...]] = ()
    NAME: ClassVar[str] = ""

    def __init__(self, n_channels: int, rate_hz: float, seed: int = 0, **params: Any) -> None:
        self.n_channels = int(n_channels)
        self.rate_hz = float(rate_hz)
        self.seed = seed

    @property
    def bin_s(self) -> float:
        return 1.0 / self.rate_hz

    @abstractmethod
    def next_bin(self) -> np.ndarray:
        """Counts of the next bin: uint16 array of shape ``(n_channels,)``."""

    @abstractmethod
    def reset(self, seed: int | None = None) -> None:
        """Start again from bin 0 (with a new seed if given)."""


#: Source classes by name.
NEURAL_SOURCES: dict[str, type[NeuralSource]] = {}


def register_source(name: str, *, replace: bool = False) -> Callable[[S], S]:
    """Class decorator: make ``sim://headstage?source=NAME`` use this source."""

    def deco(cls: S) -> S:
        if name in NEURAL_SOURCES and NEURAL_SOURCES[name] is not cls and not replace:
            raise ValueError(f"neural source {name!r} is already registered to "
                             f"{NEURAL_SOURCES[name].__name__}; pick another name or pass replace=True")
        cls.NAME = name
        NEURAL_SOURCES[name] = cls
        return cls

    return deco


def source_class(name: str) -> type[NeuralSource]:
    """The source class registered as ``name``."""
    try:
        return NEURAL_SOURCES[name]
    except KeyError:
        raise UnknownSourceError(f"no neural source named {name!r}; registered: "
                                 f"{', '.join(sorted(NEURAL_SOURCES))} (add one with "
                                 "closedloop.sim.sources.register_source)") from None


def make_source(name: str, n_channels: int, rate_hz: float, seed: int = 0, **params: Any) -> NeuralSource:
    """Build the source ``name``; its ``PARAMS`` not given take their defaults."""
    cls = source_class(name)
    values = {p.name: p.default for p in cls.PARAMS}
    values.update(params)
    return cls(n_channels, rate_hz, seed, **values)
