"""Machinery every layer shares: atomic writes, config dataclasses <-> JSON, the handwriting dataset types.

The bottom of the layering: modules here import only the standard library and numpy, and
every layer (``firmware_bridge``, ``runtime``, ``sim``, ``export``, ``sdk``) may import them.

- :mod:`.atomic`: files and folders written so a crash leaves the old or the new version.
- :mod:`.config`: ``JsonConfig``, the mixin that gives a config dataclass ``to_json`` /
  ``from_json`` / ``save`` / ``load`` and dotted overrides (``"drift.scale=0.5"``).
- :mod:`.handwriting`: FALCON H2's character set and the ``Session`` / ``Trial`` types that
  real recordings and the simulator both produce.
"""
