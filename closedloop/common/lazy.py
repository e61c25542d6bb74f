"""Package namespaces whose public names load on first use.

A package ``__init__`` that re-exports from heavy modules (torch, numba) would make every
``import`` of it pay for them; the CLI imports families to register their commands, and a
board imports the runtime without torch. :func:`lazy_exports` gives the package the
module-level ``__getattr__`` / ``__dir__`` (PEP 562) that import a name's module when the
name is first read.

>>> getattr_, dir_ = lazy_exports("pkg", {"dumps": "json", "sqrt": "math"})
>>> getattr_("sqrt")(9.0)
3.0
>>> getattr_("nope")
Traceback (most recent call last):
...
AttributeError: module 'pkg' has no attribute 'nope'
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``exports`` maps each public name to its module.

    A relative module name (``".workflow"``) is resolved against ``package``. The value is cached
    in the package's namespace after the first read.

    A public name may not also be a submodule's name: importing that submodule (which any
    sibling's ``from .name import ...`` does) binds the module object to the package attribute,
    and ``from package import name`` would then hand out the module instead of the function.
    Such a collision raises ``ValueError`` when the package is imported.
    """
    pkg = sys.modules.get(package)
    paths = getattr(pkg, "__path__", None) or ()
    clashes = sorted(set(exports) & {info.name for info in pkgutil.iter_modules(paths)})
    if clashes:
        raise ValueError(f"{package}: public name(s) {', '.join(clashes)} are also submodules of the package; "
                         "rename the module so the attribute is never shadowed by the import system")

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        pkg = sys.modules.get(package)
        if pkg is not None:
            setattr(pkg, name, value)
        return value

    def __dir__() -> list[str]:
        pkg = sys.modules.get(package)
        return sorted(set(vars(pkg) if pkg is not None else ()) | set(exports))

    return __getattr__, __dir__
