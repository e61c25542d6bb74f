"""The family packages' lazily loaded names: each resolves to what it names, never to a submodule."""

from __future__ import annotations

import importlib
import sys
import types

import pytest

from closedloop.common.lazy import lazy_exports

PACKAGES = ["closedloop", "closedloop.sdk.bci", "closedloop.sdk.rl", "closedloop.sdk.robust"]


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_name_is_the_object_not_a_module(package):
    # reading the names in turn imports their modules, which is what binds a same-named submodule over a name
    pkg = importlib.import_module(package)
    for name in pkg.__all__:
        if name.startswith("__"):
            continue
        value = getattr(pkg, name)
        assert not isinstance(value, types.ModuleType), f"{package}.{name} is the module {value.__name__}"


def test_a_public_name_that_is_also_a_submodule_is_refused(tmp_path, monkeypatch):
    root = tmp_path / "clashpkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "protect.py").write_text("def protect():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    importlib.import_module("clashpkg")
    try:
        with pytest.raises(ValueError, match="protect are also submodules"):
            lazy_exports("clashpkg", {"protect": ".protect"})
        getattr_, _ = lazy_exports("clashpkg", {"run_protect": ".other"})  # no clash: accepted
        assert callable(getattr_)
    finally:
        sys.modules.pop("clashpkg", None)
