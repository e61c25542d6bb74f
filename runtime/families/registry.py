"""Registry of family plug-ins, keyed by the bundle's ``family`` field."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import BundleError
from .base import FamilyPlugin

if TYPE_CHECKING:
    from ..bundle import Bundle

_FAMILIES: dict[str, type[FamilyPlugin]] = {}


def register_family(cls: type[FamilyPlugin]) -> type[FamilyPlugin]:
    if cls.name in _FAMILIES and _FAMILIES[cls.name] is not cls:
        raise ValueError(f"family {cls.name!r} is already registered by {_FAMILIES[cls.name].__qualname__}")
    _FAMILIES[cls.name] = cls
    return cls


def family_names() -> list[str]:
    return sorted(_FAMILIES)


def get_family(name: str) -> type[FamilyPlugin]:
    try:
        return _FAMILIES[name]
    except KeyError:
        raise BundleError(
            f"family {name!r} is not known to this runtime (known: {', '.join(family_names())}); "
            "upgrade closedloop or check the bundle's 'family' field"
        ) from None


def family_problems(bundle: Bundle) -> list[str]:
    try:
        cls = get_family(bundle.manifest.family)
    except BundleError as exc:
        return [str(exc)]
    return cls.problems(bundle)
