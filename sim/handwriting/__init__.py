"""Synthetic handwriting iBCI recordings in the structure of FALCON H2."""

from .types import BIN_S, CHARSET, N_CHANNELS, Session, Trial, falcon_splits

__all__ = ["BIN_S", "CHARSET", "N_CHANNELS", "Session", "Trial", "falcon_splits"]
