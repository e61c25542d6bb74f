"""Typed device parameters, parsed the same way from a ``sim://`` URL and from the command line.

Every emulator declares its parameters as :class:`Param` specs (name, type, default,
bounds, help).  :func:`parse_params` turns the raw strings of a URL query
(``sim://plant?rate=1000&noise=0.001``) or of ``--rate 1000 --noise 0.001`` into typed
values, and refuses an unknown or malformed parameter with a :class:`ParamError` that
names it and lists the allowed ones.  The parameters every device shares (the seed, the
signing key, and fault injection) are defined here once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Param", "ParamError", "parse_params", "COMMON_PARAMS", "FAULT_PARAMS", "format_params_help",
           "parse_key", "import_plugins"]


class ParamError(ValueError):
    """A device parameter is unknown, malformed or out of range."""


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Param:
    """One device parameter.

    Parameters
    ----------
    name : str
        As written in a URL query and (with ``--``) on the command line.
    kind : type
        ``int``, ``float``, ``str`` or ``bool``.
    default : Any
        Value when the parameter is not given (``None``: "not set").
    help : str
        One line for ``python -m closedloop.sim NAME --help`` and the docs.
    low, high : float, optional
        Inclusive bounds for numbers.
    choices : callable, optional
        Returns the allowed strings (read when checking, so a registry can grow).
    """

    name: str
    kind: type
    default: Any
    help: str
    low: float | None = None
    high: float | None = None
    choices: Callable[[], Iterable[str]] | None = None

    def convert(self, raw: str, where: str) -> Any:
        """``raw`` as this parameter's type, or a :class:`ParamError` naming it."""
        text = str(raw).strip()
        if self.kind is bool:
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise ParamError(f"{where}: parameter {self.name}={raw!r} is not a boolean; write 1 or 0")
        if self.kind in (int, float):
            try:
                value = int(text) if self.kind is int else float(text)
            except ValueError:
                raise ParamError(f"{where}: parameter {self.name}={raw!r} is not {_article(self.kind)} "
                                 f"({self.help})") from None
            if self.kind is float and not math.isfinite(value):
                raise ParamError(f"{where}: parameter {self.name}={raw!r} must be a finite number")
            if (self.low is not None and value < self.low) or (self.high is not None and value > self.high):
                raise ParamError(f"{where}: parameter {self.name}={raw!r} is outside {self._range()}")
            return value
        if self.choices is not None:
            allowed = sorted(self.choices())
            if text not in allowed:
                raise ParamError(f"{where}: parameter {self.name}={raw!r} is not one of {', '.join(allowed)}")
        return text

    def _range(self) -> str:
        lo = "-inf" if self.low is None else f"{self.low:g}"
        hi = "inf" if self.high is None else f"{self.high:g}"
        return f"[{lo}, {hi}]"


def _article(kind: type) -> str:
    return "an integer" if kind is int else "a number"


def parse_params(where: str, specs: Sequence[Param], raw: Mapping[str, str]) -> dict[str, Any]:
    """Typed values of ``raw`` for ``specs``, defaults filled in.

    ``where`` names the device in error messages (``"sim://plant"``).  Hyphens in
    names are read as underscores (``--delay-ms`` is ``delay_ms``).

    Raises
    ------
    ParamError
        Naming the first unknown, malformed or out-of-range parameter.
    """
    by_name = {p.name: p for p in specs}
    values = {p.name: p.default for p in specs}
    for key, text in raw.items():
        name = key.replace("-", "_")
        spec = by_name.get(name)
        if spec is None:
            raise ParamError(f"{where}: unknown parameter {key!r}; allowed: {', '.join(sorted(by_name))}")
        values[name] = spec.convert(text, where)
    return values


def parse_key(text: str | None, where: str = "device") -> bytes | None:
    """The shared signing secret from its hex form (``None`` or ``""``: unsigned link)."""
    if not text:
        return None
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ParamError(f"{where}: parameter key must be hex (e.g. secrets.token_hex(32)); got "
                         f"{len(text)} characters that are not hex") from None
    if len(key) < 16:
        raise ParamError(f"{where}: parameter key is {len(key)} bytes; use at least 16 random bytes "
                         "(32 hex digits)")
    return key


def import_plugins(text: str | None, where: str = "device") -> None:
    """Import the comma-separated modules in ``text`` so their registrations run (in this process)."""
    import importlib

    for module in filter(None, (m.strip() for m in (text or "").split(","))):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ParamError(f"{where}: parameter plugins names module {module!r}, which cannot be imported "
                             f"({exc}); check the name and that it is on PYTHONPATH") from None


def format_params_help(specs: Sequence[Param]) -> str:
    """A table of parameters for ``--help`` and docs."""
    lines = []
    for p in specs:
        default = "unset" if p.default is None else repr(p.default)
        lines.append(f"  --{p.name:<16} {p.kind.__name__:<6} default {default:<12} {p.help}")
    return "\n".join(lines)


#: Parameters of every device.
COMMON_PARAMS: tuple[Param, ...] = (
    Param("seed", int, 0, "seed of every random draw (data, noise and faults)", low=0),
    Param("key", str, "", "hex shared secret: sign and verify every frame (Link shared_secret)"),
    Param("plugins", str, "", "comma-separated modules to import first (they register plants, sources, ...)"),
)

#: Fault injection, applied to every frame the device writes.
FAULT_PARAMS: tuple[Param, ...] = (
    Param("drop", float, 0.0, "probability that a frame is not sent (host sees a sequence gap)", 0.0, 1.0),
    Param("corrupt", float, 0.0, "probability that one bit of a frame's wire bytes is flipped", 0.0, 1.0),
    Param("duplicate", float, 0.0, "probability that a frame is sent twice", 0.0, 1.0),
    Param("delay_ms", float, 0.0, "extra latency added to every frame (order is kept)", 0.0, 10_000.0),
    Param("jitter_ms", float, 0.0, "uniform +- jitter on delay_ms", 0.0, 10_000.0),
    Param("glitch", float, 0.0, "probability that a data frame carries one value too few or too many (a firmware "
                                "bug the CRC cannot see)", 0.0, 1.0),
    Param("nonfinite", float, 0.0, "probability that one value of a data frame is NaN or +-inf (a sensor driver's "
                                   "fault; devices with float data: plant, panda)", 0.0, 1.0),
    Param("silence_at", float, None, "go silent this many seconds after streaming starts", 0.0),
    Param("silence_s", float, 1.0, "how long the silence lasts", 0.0),
    Param("disconnect_at", float, None, "close the port this many seconds after streaming starts", 0.0),
    Param("disconnect_s", float, 1.0, "reopen the port after this many seconds", 0.0),
    Param("reset_at", float, None, "restart the device this many seconds after streaming starts, port kept open "
          "(seq 0, HELLO once a second until a host HELLO)", 0.0),
    Param("reset_s", float, 0.5, "how long the restarting device is silent before its first HELLO", 0.0),
)
