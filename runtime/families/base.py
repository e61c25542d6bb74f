"""The family plug-in interface: what a model family adds to a session.

A family (BCI decoder, observer, RL policy, ...) owns the steps around the model:
``preprocess`` turns the newest device frame into the model's input buffer,
``postprocess`` turns the model's outputs into the command to send, ``safe_output``
is what the actuators get when the session must stop acting, ``live_metrics`` feeds
the status line, and ``problems`` runs family-specific checks at bundle load (an
observer re-checks its stability certificate there). All per-step methods work in
preallocated buffers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import numpy as np

if TYPE_CHECKING:
    from ..bundle import Bundle
    from ..model import Model


class FamilyPlugin:
    """Base class; subclasses register with ``@register_family``."""

    name: ClassVar[str]

    def __init__(self, bundle: Bundle, model: Model):
        self.bundle = bundle
        self.model = model

    @classmethod
    def problems(cls, bundle: Bundle) -> list[str]:
        """Family-specific reasons to refuse this bundle (empty if none)."""
        return []

    def reset(self) -> None:
        """Start of a session or trial: clear per-session state."""
        self.model.reset()

    def preprocess(self, frame: np.ndarray) -> None:
        """Write the model input for this step from the newest device frame."""
        raise NotImplementedError

    def postprocess(self) -> np.ndarray:
        """Return the command for this step (a preallocated array)."""
        raise NotImplementedError

    def safe_output(self) -> np.ndarray:
        """The command that puts actuators in a safe state."""
        raise NotImplementedError

    def live_metrics(self) -> dict[str, float]:
        return {}
