"""Small protected bundles (keyed and unkeyed) shared by the robustness tests."""

from __future__ import annotations

import pytest
import torch

KEY = bytes(range(32))


def _bundle(path, key, n_channels=12):
    from closedloop.sdk.robust.demo import make_protected_decoder

    torch.set_num_threads(1)
    return make_protected_decoder(path, key, n_channels=n_channels)


@pytest.fixture(scope="session")
def keyed_bundle(tmp_path_factory):
    return _bundle(tmp_path_factory.mktemp("robust") / "keyed", KEY)


@pytest.fixture(scope="session")
def unkeyed_bundle(tmp_path_factory):
    return _bundle(tmp_path_factory.mktemp("robust") / "unkeyed", None)
