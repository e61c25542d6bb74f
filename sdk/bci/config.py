"""JSON round-trips for the family's configuration dataclasses (nested dataclasses included)."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

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

    return replace_in(cfg, path.split("."))


def to_dict(obj: Any) -> dict:
    return dataclasses.asdict(obj)


def from_dict(cls: type[T], data: dict) -> T:
    """Build ``cls`` from ``data``; nested dataclass fields are rebuilt; unknown keys are refused by name."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{cls.__name__} has no field(s) {unknown}; known fields: {sorted(names)}")
    kwargs = {}
    for k, v in data.items():
        t = hints.get(k)
        if typing.get_origin(t) in (typing.Union, types.UnionType):  # X | None: the dataclass X when given one
            t = next((a for a in typing.get_args(t) if dataclasses.is_dataclass(a)), t)
        if dataclasses.is_dataclass(t) and isinstance(v, dict):
            v = from_dict(t, v)
        elif isinstance(v, list) and typing.get_origin(t) is tuple:
            v = tuple(v)
        kwargs[k] = v
    return cls(**kwargs)


class JsonConfig:
    """Mixin: ``to_json`` / ``from_json`` / ``save`` / ``load`` for a config dataclass."""

    def to_dict(self) -> dict:
        return to_dict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls: type[T], data: dict) -> T:
        return from_dict(cls, data)

    @classmethod
    def from_json(cls: type[T], text: str) -> T:
        return from_dict(cls, json.loads(text))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls: type[T], path: str | Path) -> T:
        return from_dict(cls, json.loads(Path(path).read_text()))
