"""Typed errors of the runtime.

Every error subclasses a built-in, so a caller may catch either ``BundleError`` or
``ValueError``. Messages name the bad value, what was expected and what to do.
"""

from __future__ import annotations


class BundleError(ValueError):
    """A bundle is missing, malformed, tampered with or does not match its manifest."""


class BackendUnavailableError(RuntimeError):
    """A requested backend cannot run here (library or hardware missing, graph unsupported)."""


class GraphUnsupportedError(BackendUnavailableError):
    """A backend cannot run this graph (an op or pattern it does not implement)."""
