"""The boards ``closedloop package`` builds for: their Python, platform tags and tested constraints.

A target names what pip needs to fetch wheels for a machine that is not this one
(``--platform`` / ``--python-version`` / ``--implementation`` / ``--abi``) and the constraints
file, kept in ``constraints/``, that pins versions with a wheel for it. ``host`` is this
machine: its interpreter, its platform, and the versions installed here.
"""

from __future__ import annotations

import platform
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

CONSTRAINTS_DIR = Path(__file__).resolve().parent / "constraints"


class PackageError(ValueError):
    """A package that cannot be built as asked; the message says what was wrong and what to do."""


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    python_version: str  # "3.10"
    machine: str  # "aarch64"
    glibc: str  # "2.35"
    # pip --platform values, newest first; empty for the host (pip uses this interpreter's own tags)
    platforms: tuple[str, ...] = ()

    @property
    def foreign(self) -> bool:
        return bool(self.platforms)

    @property
    def abi(self) -> str:
        return "cp" + self.python_version.replace(".", "")

    def pip_args(self) -> list[str]:
        """What pip download / pip install --dry-run need to resolve for this target."""
        if not self.foreign:
            return []
        args = [a for p in self.platforms for a in ("--platform", p)]
        return args + ["--python-version", self.python_version, "--implementation", "cp", "--abi", self.abi]

    def supported_tags(self) -> set[str]:
        """Every wheel tag (``cp310-cp310-manylinux_2_28_aarch64``, ``py3-none-any``, ...) that installs here."""
        from packaging import tags

        if not self.foreign:
            return {str(t) for t in tags.sys_tags()}
        version = tuple(int(p) for p in self.python_version.split("."))
        found = set(tags.cpython_tags(version, abis=[self.abi], platforms=list(self.platforms)))
        found |= set(tags.compatible_tags(version, self.abi, platforms=list(self.platforms)))
        return {str(t) for t in found}

    def constraints_text(self) -> str:
        """The pins for this target: the file in constraints/ for a board; for the host, what is installed here."""
        if not self.foreign:
            lines = sorted({f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions()
                            if d.metadata["Name"] and d.metadata["Name"].lower() != "closedloop"}, key=str.lower)
            return (f"# host: the versions installed in {sys.prefix} (Python {self.python_version}, "
                    f"{self.machine}), where this package was built\n" + "\n".join(lines) + "\n")
        return (CONSTRAINTS_DIR / f"{self.name}.txt").read_text()


def _manylinux(machine: str, newest_minor: int) -> tuple[str, ...]:
    return tuple(f"manylinux_2_{m}_{machine}" for m in range(newest_minor, 16, -1)) + (f"manylinux2014_{machine}",)


def _host() -> Target:
    glibc = platform.libc_ver()[1] or "unknown"
    return Target("host", f"this machine ({platform.machine()}, CPython {sys.version_info[0]}.{sys.version_info[1]}, "
                          f"glibc {glibc})", f"{sys.version_info[0]}.{sys.version_info[1]}", platform.machine(), glibc)


TARGETS: dict[str, Target] = {
    "jetson-jp6": Target("jetson-jp6", "NVIDIA Jetson on JetPack 6 (Ubuntu 22.04: aarch64, CPython 3.10, glibc 2.35)",
                         "3.10", "aarch64", "2.35", _manylinux("aarch64", 35)),
}


def target_names() -> list[str]:
    return ["host", *TARGETS]


def get_target(name: str) -> Target:
    if name == "host":
        return _host()
    if name not in TARGETS:
        raise PackageError(f"unknown target {name!r}: the known targets are {', '.join(target_names())}")
    return TARGETS[name]
