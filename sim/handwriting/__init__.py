"""Synthetic handwriting iBCI recordings in the structure of FALCON H2.

``generate_recording(HandwritingConfig())`` gives 21 held-in and 5 held-out sessions
on FALCON H2's dates (192 channels, 20 ms bins, one prompted sentence per trial) with
drift across days; ``HandwritingConfig.tiny()`` is a seconds-free version for tests.
The data model (:class:`Session`, :class:`Trial`) is shared with the NWB loader in
``closedloop.sdk.bci.nwb``, which reads real FALCON H2 files into the same types.
See ``docs/handwriting_data.md``.
"""

from closedloop.common.handwriting import BIN_S, CHARSET, N_CHANNELS, Session, Trial, falcon_splits

from .config import (
    DRIFT_COMPONENTS,
    FALCON_H2_HELD_IN_DATES,
    FALCON_H2_HELD_OUT_DATES,
    DriftConfig,
    HandwritingConfig,
    PopulationConfig,
    WritingConfig,
)
from .generator import generate_recording, generate_session, idle_counts, iter_trials, session_name
from .kinematics import TrialKinematics, trial_kinematics
from .population import ChannelParams, session_channel_params
from .templates import CHAR_STROKES, char_path, char_velocity
from .vocabulary import VOCABULARY, make_sentence

__all__ = ["BIN_S", "CHARSET", "N_CHANNELS", "Session", "Trial", "falcon_splits",
           "HandwritingConfig", "WritingConfig", "PopulationConfig", "DriftConfig", "DRIFT_COMPONENTS",
           "FALCON_H2_HELD_IN_DATES", "FALCON_H2_HELD_OUT_DATES",
           "generate_recording", "generate_session", "idle_counts", "iter_trials", "session_name",
           "TrialKinematics", "trial_kinematics", "ChannelParams", "session_channel_params",
           "CHAR_STROKES", "char_path", "char_velocity", "VOCABULARY", "make_sentence"]
