"""One class-registration decorator for sim's registries (devices, plants, panda tasks)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

C = TypeVar("C", bound=type)


def registrar(table: dict[str, type], kind: str, name: str, replace: bool = False) -> Callable[[C], C]:
    """Class decorator registering ``cls`` as ``table[name]`` and setting ``cls.NAME``.

    A name already taken by another class is refused unless ``replace``; ``kind`` names
    the registry in that error (e.g. ``"plant name"``).
    """

    def deco(cls: C) -> C:
        if name in table and table[name] is not cls and not replace:
            raise ValueError(f"{kind} {name!r} is already registered to {table[name].__name__}; "
                             "pick another name or pass replace=True")
        cls.NAME = name
        table[name] = cls
        return cls

    return deco
