"""Shared fixtures for the firmware_bridge tests: a hypothesis strategy for every message type.

Tests run with ``--import-mode=importlib``, so helpers are handed out as fixtures; a
``@given`` test draws from the session-scoped ``messages`` strategy with ``st.data()``.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from hypothesis import strategies as st

from closedloop.firmware_bridge import (
    ActuatorCommand,
    DecoderOutput,
    DeviceState,
    Heartbeat,
    Hello,
    JointCommand,
    JointMode,
    JointState,
    NeuralFrame,
    PlantMeasurement,
    Severity,
    Status,
    UnknownMessage,
)


@pytest.fixture(scope="session")
def cc() -> str:
    """The host C compiler; tests of the C implementation skip, saying so, without one."""
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        pytest.skip("no C compiler (cc/gcc/clang) on PATH: the C implementation was not checked")
    return compiler


f32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


def f32_arrays(min_size: int = 0, max_size: int = 24, elements: st.SearchStrategy = f32) -> st.SearchStrategy:
    return st.lists(elements, min_size=min_size, max_size=max_size).map(lambda v: np.array(v, dtype="<f4"))


@st.composite
def hellos(draw: st.DrawFn) -> Hello:
    n = draw(st.integers(0, 8))
    low = np.array(draw(st.lists(finite_f32, min_size=n, max_size=n)), dtype="<f4")
    high = low + np.array(draw(st.lists(st.floats(0, 100, width=32), min_size=n, max_size=n)), dtype="<f4")
    high = np.maximum(low, high)  # float32 rounding can not break low <= high
    return Hello(kind=draw(st.text(max_size=20)), name=draw(st.text(max_size=40)),
                 protocol_version=draw(st.integers(0, 255)), n_channels=draw(st.integers(0, 65535)),
                 rate_hz=draw(finite_f32), command_low=low, command_high=high)


@st.composite
def joint_commands(draw: st.DrawFn) -> JointCommand:
    mode = draw(st.sampled_from(list(JointMode)))
    size = st.sampled_from([3, 7]) if mode is JointMode.END_EFFECTOR else st.integers(0, 12)
    n = draw(size)
    return JointCommand(mode, draw(f32_arrays(n, n)))


@st.composite
def joint_states(draw: st.DrawFn) -> JointState:
    n = draw(st.integers(0, 12))
    pose = draw(st.none() | f32_arrays(7, 7))
    return JointState(draw(f32_arrays(n, n)), draw(f32_arrays(n, n)), pose)


MESSAGES = st.one_of(
    hellos(),
    st.builds(Heartbeat, st.sampled_from(list(DeviceState))),
    st.builds(Status, st.integers(0, 65535), st.sampled_from(list(Severity)), st.text(max_size=60)),
    st.builds(NeuralFrame, st.integers(0, 2**32 - 1),
              st.lists(st.integers(0, 65535), max_size=256).map(lambda v: np.array(v, dtype=np.uint16))),
    st.builds(DecoderOutput, st.integers(0, 2**32 - 1), st.text(max_size=30), st.none() | f32_arrays(1, 40)),
    st.builds(PlantMeasurement, f32_arrays(), f32_arrays()),
    st.builds(ActuatorCommand, f32_arrays()),
    joint_states(),
    joint_commands(),
    st.builds(UnknownMessage, st.integers(0xE0, 0xFE), st.binary(max_size=64)),
)


@pytest.fixture(scope="session")
def messages() -> st.SearchStrategy:
    """Strategy producing any message, of every registered type plus unknown ones."""
    return MESSAGES
