"""Type-check the deployed layers: mypy on ``closedloop.runtime`` and ``closedloop.firmware_bridge``.

Run from anywhere (``make lint`` and ``tests/test_typing.py`` do)::

    python tools/typecheck.py                 # exit status and report are mypy's
    python tools/typecheck.py --no-incremental  # extra arguments go to mypy

mypy's options are pyproject.toml's ``[tool.mypy]``. mypy finds a package by its folder, but
here the folders (``runtime/``, ``firmware_bridge/``) install under other names
(``closedloop.runtime``, ...: setup.py's ``package_dir``), which mypy cannot read from an
editable install. So this script lays a tree of links, ``build/typecheck/closedloop/`` holding
what ``closedloop/`` holds plus ``runtime`` and ``firmware_bridge``, which mypy reads through
``mypy_path``, and prints mypy's report with the repository's own paths.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "build" / "typecheck"  # pyproject's [tool.mypy] mypy_path
LAYERS = ("runtime", "firmware_bridge")  # the layers checked (a layer imports no layer above it)


def links() -> dict[str, Path]:
    """What the tree's ``closedloop/`` holds -> the repository's file or folder it stands for."""
    own = {p.name: p for p in (ROOT / "closedloop").iterdir() if p.name != "__pycache__"}
    return {**own, **{layer: ROOT / layer for layer in LAYERS}}


def build_tree() -> None:
    """Lay ``build/typecheck/closedloop/`` (idempotent; copies where links are not allowed)."""
    package = TREE / "closedloop"
    package.mkdir(parents=True, exist_ok=True)
    wanted = links()
    for stale in package.iterdir():  # a file since removed from closedloop/
        if stale.name not in wanted and (stale.is_symlink() or stale.is_file()):
            stale.unlink(missing_ok=True)
    for name, source in wanted.items():
        link = package / name
        if link.is_symlink() and link.resolve() == source.resolve():
            continue
        if link.is_symlink() or link.is_file():
            link.unlink()
        elif link.is_dir():
            shutil.rmtree(link)
        try:
            link.symlink_to(os.path.relpath(source, package), target_is_directory=source.is_dir())
        except FileExistsError:  # a concurrent run laid it
            pass
        except OSError:  # no symlinks here (Windows without the privilege): a copy does
            if source.is_dir():
                shutil.copytree(source, link, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(source, link)


def main(argv: list[str]) -> int:
    build_tree()
    proc = subprocess.run([sys.executable, "-m", "mypy", *argv], cwd=ROOT, capture_output=True, text=True)
    report = proc.stdout + proc.stderr
    tree = TREE.relative_to(ROOT).as_posix() + "/closedloop/"
    for layer in LAYERS:  # report the repository's paths, not the tree's
        report = report.replace(f"{tree}{layer}/", f"{layer}/")
    sys.stdout.write(report.replace(tree, "closedloop/"))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
