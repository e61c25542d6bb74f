"""Fixtures for the export tests: the project's tiny reference models, and quick exports of them.

The session-wide ``gru_bundle`` / ``mlp_bundle`` (tests/conftest.py) are read-only; a test
that edits a bundle copies it first (``bundle_copy``).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture
def quiet() -> Callable[[str], None]:
    return lambda line: None


@pytest.fixture
def gru_module(tiny_models):
    return tiny_models["gru"]


@pytest.fixture
def mlp_module(tiny_models):
    return tiny_models["mlp"]


@pytest.fixture
def bundle_copy(tmp_path) -> Callable[[Path], Path]:
    def copy(src: Path) -> Path:
        dst = tmp_path / f"copy-of-{Path(src).name}"
        shutil.copytree(src, dst)
        return dst

    return copy
