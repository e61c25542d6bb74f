"""Checks on loaded handwriting sessions that the commands run before they use them: dead data and the loader's notes.

A file can be a valid FALCON H2 file and still hold nothing to decode: a session whose counts are all zero (a
disconnected headstage, an export that wrote zeros) or channels that stay at zero throughout. Training on such a
session, calibrating on it or scoring it gives numbers that mean nothing, so ``bci-data`` shows it, ``bci-train``
refuses a held-in session without counts, ``calibrate`` refuses calibration sentences without counts and
``evaluate`` warns about a scored session without them. Lives beside :mod:`closedloop.sdk.bci.nwb` (which reads
the files) and is used by :mod:`closedloop.sdk.bci.cli` and :mod:`closedloop.sdk.bci.workflow`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["session_counts", "silent_channels", "has_no_counts", "data_warnings", "check_training_sessions",
           "where"]


def session_counts(session: Any, trials: Sequence[int] | None = None) -> np.ndarray:
    """Each channel's total count over ``trials`` (indices; None: every trial) of ``session``."""
    idx = range(len(session.trials)) if trials is None else trials
    totals = np.zeros(session.n_channels, dtype=np.int64)
    for i in idx:
        totals += session.trials[i].spikes.sum(axis=0, dtype=np.int64)
    return totals


def silent_channels(session: Any, trials: Sequence[int] | None = None) -> list[int]:
    """The channels with no count at all in ``trials`` (None: every trial) of ``session``."""
    return [int(c) for c in np.flatnonzero(session_counts(session, trials) == 0)]


def has_no_counts(session: Any, trials: Sequence[int] | None = None) -> bool:
    """True when ``trials`` (None: every trial) of ``session`` hold no count on any channel."""
    idx = range(len(session.trials)) if trials is None else trials
    return bool(len(idx)) and not session_counts(session, trials).any()


def where(session: Any) -> str:
    """``session NAME (file, file)``: which session, and the files it came from, for a message."""
    files = session.meta.get("files") or []
    return f"session {session.name}" + (f" ({', '.join(str(f) for f in files)})" if files else "")


def _channels(chs: list[int]) -> str:
    return ", ".join(str(c) for c in chs[:8]) + (" ..." if len(chs) > 8 else "")


def data_warnings(sessions: Sequence[Any]) -> list[str]:
    """What a person should know about ``sessions`` before using them: the loader's notes (an eval_mask set on part of
    a trial), a session with no counts at all, and channels silent throughout a session."""
    out = [w for s in sessions for w in s.meta.get("warnings", [])]
    for s in sessions:
        if not s.trials:
            continue
        counts = session_counts(s)  # once a session: a long recording's every bin is summed here
        if not counts.any():
            out.append(f"{where(s)} holds no counts at all (every bin of every channel is 0): nothing in it can be "
                       "decoded; check the recording and the export that wrote the file")
            continue
        silent = [int(c) for c in np.flatnonzero(counts == 0)]
        if silent:
            out.append(f"{where(s)}: {len(silent)} of {s.n_channels} channels are silent throughout (no count in any "
                       f"bin: channel(s) {_channels(silent)}); a decoder gets nothing from them, so check the array's "
                       "connection or the export if that is not expected")
    return out


def check_training_sessions(sessions: Sequence[Any]) -> list[str]:
    """``bci-train``'s data check: raises ValueError for a held-in session with no counts (a decoder would train on
    it as if it were data), else returns :func:`data_warnings`."""
    dead = [s for s in sessions if s.split == "held_in" and s.trials and has_no_counts(s)]
    if dead:
        raise ValueError("; ".join(where(s) for s in dead) + f": {len(dead)} held-in session(s) hold no counts at "
                         "all (every bin of every channel is 0), and a decoder trained on them learns nothing from "
                         "them; fix or remove those files (closedloop bci-data lists what each file holds)")
    return data_warnings(sessions)
