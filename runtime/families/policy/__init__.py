"""The ``policy`` runtime family: robot observations in, joint commands out (see ``docs/families.md``)."""

from .plugin import PolicyFamily, wilson_interval

__all__ = ["PolicyFamily", "wilson_interval"]
