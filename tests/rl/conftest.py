"""Fixtures for the RL tests: one thread per process, small environments."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("pybullet")
pytest.importorskip("gymnasium")
torch.set_num_threads(1)
