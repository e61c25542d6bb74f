"""Configuration dataclasses <-> JSON, with dotted overrides: one helper for every family.

A config is a (possibly nested) dataclass. :class:`JsonConfig` gives it ``to_dict`` /
``to_json`` / ``from_dict`` / ``from_json`` / ``save`` / ``load`` and :meth:`JsonConfig.with_overrides`;
unknown keys are refused by name, nested dataclasses are rebuilt from their type hints and
JSON lists become tuples where a field holds a tuple, so a run is reproduced from its record.

>>> from dataclasses import dataclass, field
>>> @dataclass
... class Inner(JsonConfig):
...     scale: float = 1.0
>>> @dataclass
... class Outer(JsonConfig):
...     steps: int = 10
...     sizes: tuple[int, ...] = (64, 64)
...     inner: Inner = field(default_factory=Inner)
>>> cfg = Outer.from_json('{"steps": 5, "sizes": [32], "inner": {"scale": 0.5}}')
>>> cfg
Outer(steps=5, sizes=(32,), inner=Inner(scale=0.5))
>>> cfg.with_overrides(["inner.scale=2", "steps=7"])
Outer(steps=7, sizes=(32,), inner=Inner(scale=2.0))
>>> Outer.from_dict({"stepz": 3})
Traceback (most recent call last):
...
ValueError: Outer: unknown field(s) ['stepz']; known fields: ['inner', 'sizes', 'steps']
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

from .atomic import atomic_write_bytes

T = TypeVar("T")


def override(cfg: T, assignment: str) -> T:
    """A copy of dataclass ``cfg`` with one dotted setting replaced: ``"meta.drift.fresh_p=0.1"``.

    The value is read as JSON (numbers, booleans, lists; anything else as plain text) and cast
    to the type the field holds; nested dataclasses are replaced along the path, so their
    ``__post_init__`` checks run again. Unknown names are refused with the names there are.
    """
    path, eq, text = assignment.partition("=")
    if not eq or not path or not text:
        raise ValueError(f"expected SECTION.FIELD=VALUE, got {assignment!r}")
    try:
        value: Any = json.loads(text)
    except json.JSONDecodeError:
        value = text

    def replace_in(obj: Any, parts: list[str]) -> Any:
        names = sorted(f.name for f in dataclasses.fields(obj)) if dataclasses.is_dataclass(obj) else []
        if parts[0] not in names:
            raise ValueError(f"{path}: no setting {parts[0]!r} in {type(obj).__name__}; settings there: {names}")
        old = getattr(obj, parts[0])
        if len(parts) > 1:
            new = replace_in(old, parts[1:])
        elif isinstance(old, tuple):
            new = tuple(value)
        else:
            new = value if old is None else type(old)(value)
        return dataclasses.replace(obj, **{parts[0]: new})

    return typing.cast(T, replace_in(cfg, path.split(".")))


def to_dict(obj: Any) -> dict[str, Any]:
    """The dataclass ``obj`` as plain JSON-ready data (nested dataclasses become dicts)."""
    return dataclasses.asdict(obj)


def from_dict(cls: type[T], data: dict[str, Any], where: str | None = None) -> T:
    """Build ``cls`` from ``data``; nested dataclass fields are rebuilt; unknown keys are refused by name."""
    where = where or cls.__name__
    if not isinstance(data, dict):
        raise TypeError(f"{where}: expected a JSON object, got {type(data).__name__}")
    hints = _field_types(cls)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; known fields: {sorted(names)}")
    kwargs = {}
    for k, v in data.items():
        t = hints.get(k)
        if typing.get_origin(t) in (typing.Union, types.UnionType):  # X | None: X (a dataclass, a tuple) when given one
            given = [a for a in typing.get_args(t) if a is not type(None)]
            t = next((a for a in given if dataclasses.is_dataclass(a)), given[0] if len(given) == 1 else t)
        if isinstance(t, type) and dataclasses.is_dataclass(t) and isinstance(v, dict):
            v = from_dict(t, v, f"{where}.{k}")
        elif isinstance(v, list) and typing.get_origin(t) is tuple:
            v = tuple(v)
        if not (v is None and type(None) in typing.get_args(hints.get(k))):  # an optional field may be null
            _check_scalar(f"{where}.{k}", t, v)
        kwargs[k] = v
    return cls(**kwargs)


_SCALAR_NAMES = {int: "a whole number", float: "a number", str: "a string", bool: "true or false"}


def _check_scalar(where: str, t: Any, v: Any) -> None:
    """A JSON value of the wrong kind for a plain ``int``/``float``/``str``/``bool`` field is refused by name
    (``"total_steps": "abc"`` failed deep inside a run); other fields are checked by their class."""
    if t not in _SCALAR_NAMES:
        return
    ok = (isinstance(v, bool) if t is bool else
          isinstance(v, int) and not isinstance(v, bool) if t is int else
          isinstance(v, int | float) and not isinstance(v, bool) if t is float else isinstance(v, str))
    if not ok:
        raise ValueError(f"{where}: {json.dumps(v, default=repr)} is not {_SCALAR_NAMES[t]}")


def _field_types(cls: type) -> dict[str, Any]:
    """Each field's type: from the type hints, or, where those cannot be resolved (a class defined
    inside a function), from the field's default value."""
    try:
        return typing.get_type_hints(cls)
    except NameError:
        pass
    types_: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            continue
        types_[f.name] = tuple[Any, ...] if isinstance(default, tuple) else type(default)
    return types_


class JsonConfig:
    """Mixin for a config dataclass: JSON round-trips, atomic ``save``, ``load`` and dotted overrides."""

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls: type[T], data: dict[str, Any]) -> T:
        return from_dict(cls, data)

    @classmethod
    def from_json(cls: type[T], text: str) -> T:
        return from_dict(cls, json.loads(text))

    def save(self, path: str | Path) -> Path:
        """Write the config as JSON, atomically (a crash leaves the old file or the new one)."""
        return atomic_write_bytes(path, (self.to_json() + "\n").encode())

    @classmethod
    def load(cls: type[T], path: str | Path) -> T:
        return from_dict(cls, json.loads(Path(path).read_text()))

    def with_overrides(self: T, assignments: Iterable[str]) -> T:
        """A copy with each ``"SECTION.FIELD=VALUE"`` applied in order (see :func:`override`)."""
        cfg = self
        for assignment in assignments:
            cfg = override(cfg, assignment)
        return cfg
