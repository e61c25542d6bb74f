"""docs/families.md is the map of each family's files across the layers: it must stay complete and true."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAP = ROOT / "docs" / "families.md"
# the folders that belong to one family, in every layer
FAMILY_FOLDERS = ["sdk/bci", "sdk/observer", "sdk/rl", "sdk/robust", "sdk/robust/bench", "runtime/families/bci",
                  "runtime/families/observer", "runtime/families/policy", "runtime/families/generic",
                  "runtime/protect", "sim/handwriting", "sim/sources", "sim/plants", "sim/manipulation",
                  "firmware_bridge/messages"]


def _named_paths() -> set[str]:
    return set(re.findall(r"`([\w./-]+\.(?:py|md))`", MAP.read_text()))


def test_every_file_of_a_family_is_on_the_map():
    named = _named_paths()
    missing = [str(p.relative_to(ROOT)) for folder in FAMILY_FOLDERS for p in sorted((ROOT / folder).glob("*.py"))
               if str(p.relative_to(ROOT)) not in named]
    assert not missing, f"docs/families.md does not list: {missing}"


def test_every_file_on_the_map_exists():
    gone = [p for p in _named_paths() if "*" not in p and not (ROOT / p).exists() and not (ROOT / "docs" / p).exists()]
    assert not gone, f"docs/families.md names files that are not there: {gone}"
