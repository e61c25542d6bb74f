"""Per-step hooks for a live session: a shared-memory ring of step records and the observers that read it."""

from .hub import ObserverHub, SessionObserver
from .lsl_out import LslOutlets
from .ring import (
    FLAG_ACTED,
    FLAG_COMMAND,
    FLAG_DISCONNECTED,
    FLAG_SAFE,
    FLAG_WATCHDOG,
    CommandBatch,
    RunBatch,
    StepBatch,
    StepRing,
)

__all__ = [
    "CommandBatch",
    "FLAG_ACTED",
    "FLAG_COMMAND",
    "FLAG_DISCONNECTED",
    "FLAG_SAFE",
    "FLAG_WATCHDOG",
    "LslOutlets",
    "ObserverHub",
    "RunBatch",
    "SessionObserver",
    "StepBatch",
    "StepRing",
]
