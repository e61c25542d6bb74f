"""The examples in closedloop's docstrings run and give what they show.

Walks every module of the five layers (``closedloop.firmware_bridge``, ``.runtime``, ``.sim``,
``.export``, ``.sdk``) and of the ``closedloop`` root package, imports it, and runs its
examples with ``doctest.testmod`` (ELLIPSIS): one test per module that has examples. A module
that does not import is a failing test too, never silently left out, unless what it lacks is
an optional library that is not installed (torch, pybullet, ...): then it is skipped, saying
which. ``__main__`` modules are not imported (importing one runs the CLI).
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import traceback
from pathlib import Path

import pytest

import closedloop

PACKAGES = ("closedloop.firmware_bridge", "closedloop.runtime", "closedloop.sim", "closedloop.export",
            "closedloop.sdk")
# closedloop itself and the deployed footprint (pyproject's dependencies): a module that cannot
# import one of these is broken, not missing an optional extra
REQUIRED = {"closedloop", "numpy", "numba", "llvmlite", "onnxruntime", "serial"}


def _module_names() -> list[str]:
    names = {"closedloop", *PACKAGES}
    # the root package's own folder (closedloop/common, ...); installed, it also holds the layers
    roots = [([str(Path(closedloop.__file__).parent)], "closedloop.")]
    for package in PACKAGES:
        try:
            roots.append((importlib.import_module(package).__path__, package + "."))
        except Exception:  # noqa: BLE001 - reported by its own test
            pass
    for path, prefix in roots:
        # a package that fails to import is still listed (and then fails its test), only not descended into
        for info in pkgutil.walk_packages(path, prefix, onerror=lambda name: None):
            if not info.name.endswith(".__main__"):
                names.add(info.name)
    return sorted(names)


def _optional_missing(exc: BaseException) -> str | None:
    """The optional library whose absence made this import fail (None: something else did)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, ModuleNotFoundError) and e.name and e.name.split(".")[0] not in REQUIRED:
            return e.name
        e = e.__cause__ or e.__context__
    return None


def _cases() -> list:
    cases = []
    finder = doctest.DocTestFinder()
    for name in _module_names():
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - becomes a failing (or skipped) test
            missing = _optional_missing(exc)
            problem = ("skip", f"needs {missing}, which is not installed") if missing else (
                "fail", "".join(traceback.format_exception(exc)))
            cases.append(pytest.param(name, problem, id=name))
            continue
        if any(test.examples for test in finder.find(module)):
            cases.append(pytest.param(name, None, id=name))
    return cases


@pytest.mark.parametrize(("name", "problem"), _cases())
def test_docstring_examples(name: str, problem: tuple[str, str] | None) -> None:
    if problem is not None:
        kind, detail = problem
        if kind == "skip":
            pytest.skip(f"{name} {detail}")
        pytest.fail(f"{name} does not import:\n{detail}")
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed (output above)"
