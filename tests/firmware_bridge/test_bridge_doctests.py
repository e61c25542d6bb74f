"""The examples in firmware_bridge docstrings run and give what they show."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["closedloop.firmware_bridge.crc", "closedloop.firmware_bridge.cobs", "closedloop.firmware_bridge.parser",
           "closedloop.firmware_bridge.transports.base", "closedloop.firmware_bridge.transports.spy"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
