"""The ``lsl://NAME?type=...`` transport: a Lab Streaming Layer stream as a device.

An LSL inlet behind the transport interface, so a session reads any LSL source (an
amplifier's EEG, a spike sorter's counts, a motion tracker) exactly as it reads a
board: the transport plays the device's side of the protocol in bytes. It answers
the host's HELLO with a device HELLO built from the stream's info, turns every
pulled sample into the device's data frame (``NEURAL_FRAME`` for a ``headstage``,
``PLANT_MEASUREMENT`` for a ``plant``) encoded by :func:`~closedloop.firmware_bridge.frame.encode_frame`,
and parses what the host writes (commands are counted and dropped: an LSL stream
takes no input). Every data frame's ``timestamp_us`` is the sample's LSL timestamp on
the source's clock; a ``STATUS(LSL_CLOCK)`` once a second carries the inlet's
``time_correction()`` and this host's LSL and monotonic clocks read together, so a
recording keeps every clock it needs (docs/lsl.md). A stream that stops gets a
``STATUS(LSL_STREAM_LOST)`` (the session's watchdog trips on the silence) and
frames resume when it returns.

pylsl, whose wheel carries liblsl, is imported here only: ``pip install 'closedloop[lsl]'``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import unquote

import numpy as np

from ..c_parser import make_parser
from ..errors import DeviceNotConnectedError
from ..frame import encode_frame
from ..messages import Hello, Message, NeuralFrame, PlantMeasurement, Severity, Status
from .base import Transport, split_device_url

__all__ = ["LslParams", "LslStats", "LslTransport", "LslStreamNotFoundError", "open_lsl", "import_pylsl",
           "STATUS_LSL_CLOCK", "STATUS_LSL_STREAM_LOST", "STATUS_LSL_STREAM_BACK", "STATUS_LSL_NOT_COUNTS",
           "STATUS_LSL_STREAM", "STATUS_LSL_STREAM_CHANGED",
           "NEURAL_TYPES"]

log = logging.getLogger("closedloop.lsl")

#: STATUS codes this transport sends (the emulators' codes stop below 50, docs/devices.md).
STATUS_LSL_CLOCK = 50
STATUS_LSL_STREAM_LOST = 51
STATUS_LSL_STREAM_BACK = 52
STATUS_LSL_NOT_COUNTS = 53
STATUS_LSL_STREAM = 54  # which stream this is (name, type, channels, rate, source id, host, uid), at each HELLO
STATUS_LSL_STREAM_CHANGED = 55  # the stream came back as another (channels, format, rate or type differ)
STATUS_LSL_CHANNELS = 56  # the stream's channel descriptions (label, unit, type), JSON in parts, at each HELLO
STATUS_LSL_OTHER_SOURCE = 57  # while the stream is lost, another source of its name is on the network: not taken
STATUS_LSL_BAD_TIMESTAMP = 58  # the source stamped a sample with a time that is not finite, or before 0
_REQUEST_REPORT, _REPORT = 1, 2

#: Stream types (lower case) that open as a ``headstage`` (spike counts) when the URL gives no ``kind``; any other,
#: voltages such as EEG, ECoG or LFP among them, is a ``plant`` (float32 values as they are).
NEURAL_TYPES = frozenset({"spikes", "spikecounts", "neural"})
_KINDS = ("headstage", "plant")
_MAX_CHUNK = 256  # samples pulled per call; a session at the stream's rate finds one or two


class LslStreamNotFoundError(DeviceNotConnectedError, LookupError):
    """No LSL stream of that name (and type / source id) answered within the timeout."""


def import_pylsl() -> Any:
    """pylsl, or an ImportError that says how to install it (its wheel carries liblsl)."""
    try:
        import pylsl  # type: ignore[import-untyped]
    except ImportError as exc:
        raise ImportError(f"lsl:// and --lsl-out need pylsl ({exc}); install it with "
                          "pip install 'closedloop[lsl]'") from None
    except RuntimeError as exc:  # pylsl raises this when it cannot load liblsl
        raise ImportError(f"pylsl is installed but cannot load liblsl ({exc}); reinstall it with "
                          "pip install --force-reinstall 'closedloop[lsl]' (the wheel carries liblsl), or set "
                          "PYLSL_LIB to a liblsl.so") from None
    _quiet_liblsl(pylsl)
    return pylsl


# liblsl's own configuration files, in the order it reads them (LSLAPICFG first): where one exists, it decides
_LSL_CONFIGS = ("lsl_api.cfg", "~/lsl_api/lsl_api.cfg", "/etc/lsl_api/lsl_api.cfg")
_liblsl_configured = False


def _quiet_liblsl(pylsl: Any) -> None:
    """Keep liblsl's INFO lines ("Loaded default config", ...) off stderr: warnings and errors only, unless the
    user has a liblsl configuration (``LSLAPICFG`` or an ``lsl_api.cfg``: it is left to decide, multicast settings
    and all) or asked closedloop for debug logging (``-vv``). liblsl reads its configuration once, before its first
    use, so this runs once, before anything else touches LSL."""
    global _liblsl_configured
    if _liblsl_configured:
        return
    _liblsl_configured = True
    if os.environ.get("LSLAPICFG") or any(os.path.exists(os.path.expanduser(p)) for p in _LSL_CONFIGS):
        return
    if logging.getLogger("closedloop").isEnabledFor(logging.DEBUG):
        return
    try:
        pylsl.set_config_content("[log]\nlevel = -1\n")  # loguru verbosity: -1 warnings, -2 errors, 0 info
    except (AttributeError, NotImplementedError):  # a liblsl before 1.17.7 has no way to set it from here
        pass


@dataclass(frozen=True)
class LslParams:
    """What ``lsl://NAME?...`` asks for. Every parameter but the name is optional."""

    name: str
    type: str = ""  # the stream's type must equal this too
    source_id: str = ""  # and its source id
    kind: str = ""  # headstage or plant; empty: from the stream type (NEURAL_TYPES)
    timeout_s: float = 5.0  # to find the stream and get the first clock offset
    buffer_s: int = 2  # the inlet keeps at most this many seconds of samples
    lost_s: float = 0.5  # a stream silent this long is reported lost (STATUS(LSL_STREAM_LOST))
    clock_s: float = 1.0  # a STATUS(LSL_CLOCK) this often

    _NUMBERS = {"timeout": "timeout_s", "buffer_s": "buffer_s", "lost_s": "lost_s", "clock_s": "clock_s"}

    @classmethod
    def from_url(cls, url: str) -> LslParams:
        """Parse ``lsl://NAME?type=EEG&kind=headstage&timeout=5``.

        >>> LslParams.from_url("lsl://BioSemi?type=EEG&timeout=2")
        LslParams(name='BioSemi', type='EEG', source_id='', kind='', timeout_s=2.0, buffer_s=2, lost_s=0.5, clock_s=1.0)
        """
        scheme, name, q = split_device_url(url)
        name = unquote(name)  # lsl://OpenBCI%232 is the stream "OpenBCI#2" ('#', '?', '&' and '%' are the URL's own)
        if scheme != "lsl" or not name:
            raise ValueError(f"{url!r} is not an LSL device URL; expected lsl://NAME?type=...&kind=... "
                             "with NAME the stream's name")
        allowed = {"type", "source_id", "kind", *cls._NUMBERS}
        unknown = sorted(set(q) - allowed)
        if unknown:
            raise ValueError(f"lsl:// does not take {unknown}; it takes {sorted(allowed)} (docs/lsl.md)")
        kw: dict[str, Any] = {"name": name, "type": q.get("type", ""), "source_id": q.get("source_id", ""),
                              "kind": q.get("kind", "").lower()}
        if kw["kind"] and kw["kind"] not in _KINDS:
            raise ValueError(f"lsl:// kind={q['kind']!r}: expected one of {list(_KINDS)}")
        for key, attr in cls._NUMBERS.items():
            if key in q:
                try:
                    value = int(q[key]) if attr == "buffer_s" else float(q[key])
                except ValueError:
                    raise ValueError(f"lsl:// {key}={q[key]!r} is not a number") from None
                if not value > 0:
                    raise ValueError(f"lsl:// {key}={q[key]!r} must be > 0")
                kw[attr] = value
        return cls(**kw)

    def predicate(self) -> str:
        """The XPath query liblsl resolves (``name='X' and type='Y'``)."""
        parts = [f"name='{self.name}'"]
        if self.type:
            parts.append(f"type='{self.type}'")
        if self.source_id:
            parts.append(f"source_id='{self.source_id}'")
        return " and ".join(parts)


@dataclass
class LslStats:
    """Counters of one LSL transport (also in the STATUS(REPORT) it answers with)."""

    samples: int = 0
    frames_sent: int = 0
    host_hellos: int = 0
    commands: dict[str, int] = field(default_factory=dict)  # what the host wrote, by message name
    clipped_values: int = 0  # headstage: values outside 0..65535 (or NaN) before rounding
    rounded_values: int = 0  # headstage: float values in range that were not whole numbers
    losses: int = 0  # times the stream went silent for lost_s
    inlets_reopened: int = 0  # a new inlet after liblsl gave the stream up, or on a restarted source
    streams_changed: int = 0  # reopened on a stream of another layout (channels, format, rate, type)
    other_sources: int = 0  # streams of the name from another source seen while the stream was lost (not taken)
    bad_timestamps: int = 0  # samples stamped NaN/inf (the last good time used) or before 0 (recorded as 0)


_PENDING = object()  # a channel description being fetched

_FORMATS = {1: "float32", 2: "float64", 3: "string", 4: "int32", 5: "int16", 6: "int8", 7: "int64"}


def _describe(info: Any) -> str:
    fmt = _FORMATS.get(int(info.channel_format()), f"format {info.channel_format()}")
    return (f"{info.name()!r} (type {info.type()!r}, {info.channel_count()} {fmt} channels at "
            f"{info.nominal_srate():g} Hz, source_id {info.source_id()!r}, host {info.hostname()!r})")


def _same_source(a: Any, b: Any) -> bool:
    """Whether stream ``a`` can be the source ``b`` was: the same source id, and where the source gives none, the
    same host (two amplifiers under one name are told apart by their source ids; without one, by their hosts)."""
    return a.source_id() == b.source_id() and (bool(a.source_id()) or a.hostname() == b.hostname())


#: After a first stream answers, how long to listen for a second one with the same name (a duplicate).
DUPLICATE_WAIT_S = 0.5


def _resolve(pylsl: Any, params: LslParams) -> Any:
    t0 = time.monotonic()
    found = pylsl.resolve_bypred(params.predicate(), 1, params.timeout_s)
    if found:
        # two sources under one name (a second amplifier, a stale test outlet): which one answers first is chance,
        # so listen a moment longer and refuse rather than pick one
        more = pylsl.resolve_bypred(params.predicate(), 2, min(DUPLICATE_WAIT_S, params.timeout_s))
        streams = {i.uid(): i for i in [*found, *more]}
        if len(streams) > 1:
            listing = "; ".join(_describe(i) for i in streams.values())
            ids = sorted({i.source_id() for i in streams.values()})
            hint = (f"name one with source_id= (lsl://{params.name}?source_id={ids[0]})" if len(ids) == len(streams)
                    and all(ids) else "give each source its own name or source id")
            raise LslStreamNotFoundError(
                f"{len(streams)} LSL streams match {params.predicate()}: {listing}. Which one answers first is "
                f"chance, so none is taken: {hint} (docs/lsl.md)")
        return found[0]
    searched = time.monotonic() - t0  # liblsl's resolution can take longer than the timeout asked
    others = pylsl.resolve_streams(wait_time=min(1.0, params.timeout_s))
    listing = "; ".join(_describe(i) for i in others) or "none"
    raise LslStreamNotFoundError(
        f"no LSL stream matching {params.predicate()} answered in {searched:.1f} s of searching (timeout="
        f"{params.timeout_s:g} s); streams on the "
        f"network: {listing}. Check the name (and type=/source_id=), that the source is running, and that "
        "multicast reaches this machine (docs/lsl.md)")


def channel_descriptions(info: Any) -> dict[str, list[str]] | None:
    """``{"label": [...], "unit": [...], "type": [...]}`` from a full stream info's ``desc/channels/channel``
    elements (the XML meta-data convention of LSL's stream types), one string per channel ("" where a field is
    missing); None when the stream describes no channels or not one per channel."""
    fields = ("label", "unit", "type")
    out: dict[str, list[str]] = {f: [] for f in fields}
    ch = info.desc().child("channels").child("channel")
    while not ch.empty():
        for f in fields:
            out[f].append(ch.child_value(f))
        ch = ch.next_sibling()
    n = len(out["label"])
    if n == 0 or n != int(info.channel_count()):
        return None
    return out


def channel_status_texts(desc: dict[str, list[str]], limit: int = 3900) -> list[str]:
    """``desc`` as JSON texts of at most ``limit`` bytes, each ``{"first": i, "count": n, "of": N, "label": [...],
    "unit": [...], "type": [...]}`` for channels ``i .. i+n-1`` of ``N``: one STATUS text holds at most 4,000 bytes,
    so a long description goes in consecutive parts (each string cut to 200 characters, so a channel always fits)."""
    total = len(desc["label"])

    def part(a: int, b: int) -> str:
        fields = {k: [x[:200] for x in v[a:b]] for k, v in desc.items()}
        return json.dumps({"first": a, "count": b - a, "of": total, **fields}, ensure_ascii=False,
                          separators=(",", ":"))

    texts, first = [], 0
    while first < total:
        end = first + 1
        while end < total and len(part(first, end + 1).encode()) <= limit:
            end += 1
        texts.append(part(first, end))
        first = end
    return texts


def _layout(info: Any) -> tuple[int, int, float, str]:
    """What a session's frames depend on: channel count, channel format, nominal rate, type."""
    return (int(info.channel_count()), int(info.channel_format()), float(info.nominal_srate()), str(info.type()))


class LslTransport(Transport):
    """An LSL inlet that speaks the device side of the protocol. Open it with ``open_transport("lsl://NAME")``.

    Attributes
    ----------
    params : LslParams
    info : pylsl.StreamInfo
        The stream's info as resolved.
    kind : str
        ``headstage`` (NEURAL_FRAME) or ``plant`` (PLANT_MEASUREMENT).
    stats : LslStats
    time_correction_s : float
        The latest ``inlet.time_correction()``: add it to a sample's timestamp for this host's LSL clock.
    """

    def __init__(self, url: str, params: LslParams, pylsl: Any, info: Any):
        super().__init__(url)
        self.params = params
        self._lsl = pylsl
        self.info = info
        self.n_channels = int(info.channel_count())
        self.rate_hz = float(info.nominal_srate())
        if info.channel_format() == pylsl.cf_string:
            raise ValueError(f"LSL stream {_describe(info)} carries strings (markers); lsl:// reads numeric "
                             "streams only")
        self.kind = params.kind or ("headstage" if info.type().lower() in NEURAL_TYPES else "plant")
        self.stats = LslStats()
        # what the host writes (a command every step at the stream's rate): the C-backed parser where it builds,
        # about twice as fast as the Python one on these short frames, with the same frames and checks
        self._parser = make_parser()
        self._out = bytearray(b"\x00")  # a leading delimiter ends any partial bytes the host holds
        self._seq = 0
        self._bin = 0
        self._streaming = False
        self._counts = np.zeros(self.n_channels, dtype="<u2")
        self._said_not_counts = False
        self._empty = np.zeros(0, dtype=np.float32)
        self._is_lost = False
        self._last_ts_us = 0  # the last finite, non-negative sample time (a bad one's stand-in)
        self._said_other = ""  # the uid of another source last said (while lost), so each is said once
        self._need_channels = False  # the stream came back: its channel descriptions are to be read again
        self._channel_fetch: threading.Thread | None = None
        self._fetched: Any = None
        self._last_sample_s = 0.0
        self._next_clock_s = 0.0
        self._resolver: Any = None  # a ContinuousResolver while the stream is lost: a restarted source shows there
        self._inlet_dead = False  # liblsl gave the inlet up (LostError): only a new inlet brings samples back
        self.inlet = self._new_inlet(info)
        try:
            self.inlet.open_stream(timeout=params.timeout_s)
            self.time_correction_s = float(self.inlet.time_correction(timeout=params.timeout_s))
            # the resolved info has no meta-data; the inlet's full one has the channels, if the source gave them
            self.channels = channel_descriptions(self.inlet.info(timeout=params.timeout_s))
            self._channel_texts = channel_status_texts(self.channels) if self.channels is not None else []
        except Exception as exc:  # pylsl's TimeoutError / LostError
            self.inlet.close_stream()
            raise DeviceNotConnectedError(f"LSL stream {_describe(info)} was found but did not connect within "
                                          f"{params.timeout_s:g} s ({exc!r}); is the source still running?") from None
        self._buf = np.zeros((_MAX_CHUNK, self.n_channels), dtype=self.inlet.np_dtype)

    def _new_inlet(self, info: Any) -> Any:
        # recover=True: liblsl reconnects by itself to a stream with a source id that comes back
        return self._lsl.StreamInlet(info, max_buflen=self.params.buffer_s, recover=True)

    # --- the device's messages ----------------------------------------------------------

    def hello(self) -> Hello:
        """The device HELLO this stream answers with (no command dims: an LSL stream takes none)."""
        return Hello(kind=self.kind, name=f"lsl:{self.info.name()}"[:255], n_channels=self.n_channels,
                     rate_hz=self.rate_hz)

    def _source_now_us(self) -> int:
        """Now on the source's clock, the clock every frame of this device carries."""
        return max(0, round((self._lsl.local_clock() - self.time_correction_s) * 1e6))

    def _emit(self, message: Message, timestamp_us: int | None = None) -> None:
        ts = self._source_now_us() if timestamp_us is None else timestamp_us
        self._out += encode_frame(message, self._seq, ts)
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        self.stats.frames_sent += 1

    def _status(self, code: int, severity: Severity, text: str) -> None:
        self._emit(Status(code=code, severity=severity, text=text))

    def clock_reading(self) -> dict[str, float | int]:
        """The clocks read together: this host's LSL clock and monotonic clock, and the inlet's correction."""
        t0 = time.monotonic_ns()
        local = self._lsl.local_clock()
        t1 = time.monotonic_ns()
        return {"time_correction_s": self.time_correction_s, "local_clock_s": local,
                "monotonic_ns": (t0 + t1) // 2, "read_ns": t1 - t0}

    def _clock_status(self, now_s: float) -> None:
        try:  # after the first estimate this returns the latest one without waiting
            self.time_correction_s = float(self.inlet.time_correction(timeout=0.0))
        except Exception:  # noqa: BLE001  (lost or not re-estimated yet: keep the last value)
            pass
        self._next_clock_s = now_s + self.params.clock_s
        self._status(STATUS_LSL_CLOCK, Severity.DEBUG, json.dumps(self.clock_reading()))

    # --- samples -> frames ----------------------------------------------------------------

    def _frames_from(self, samples: np.ndarray, stamps: np.ndarray) -> None:
        n = len(stamps)
        self.stats.samples += n
        for i in range(n):
            t = float(stamps[i])
            if not (t >= 0.0 and math.isfinite(t)):  # a source's clock gone wrong: one sample, never the session
                ts_us = self._bad_timestamp(t)
            else:
                ts_us = round(t * 1e6)
                self._last_ts_us = ts_us
            x = samples[i]
            if self.kind == "headstage":
                if x.dtype.kind == "f":
                    bad = ~(x >= -0.5) | (x >= 65535.5)  # NaN or outside after rounding
                    whole = np.rint(np.nan_to_num(x, nan=0.0))
                    rounded = int(np.count_nonzero((whole != x) & ~bad))
                    if rounded:
                        self.stats.rounded_values += rounded
                    if bad.any():
                        self.stats.clipped_values += int(bad.sum())
                    if (rounded or bad.any()) and not self._said_not_counts:
                        self._not_counts(x)
                    np.copyto(self._counts, np.clip(whole, 0, 65535), casting="unsafe")
                elif x.size and (x.min() < 0 or x.max() > 65535):
                    self.stats.clipped_values += int(((x < 0) | (x > 65535)).sum())
                    if not self._said_not_counts:
                        self._not_counts(x)
                    np.copyto(self._counts, np.clip(x, 0, 65535), casting="unsafe")
                else:  # the usual case, counts in range: no temporary array
                    np.copyto(self._counts, x, casting="unsafe")
                msg: Message = NeuralFrame(bin_index=self._bin, counts=self._counts)
                self._bin = (self._bin + 1) & 0xFFFFFFFF
            else:
                msg = PlantMeasurement(y=x.astype(np.float32), u=self._empty)
            self._emit(msg, ts_us)

    def _bad_timestamp(self, t: float) -> int:
        """A frame's time for a sample stamped ``t`` that is not finite (the last good time) or before 0 (0: the
        frame header's time is unsigned); counted, and said once, because the device clock is then not the
        source's."""
        self.stats.bad_timestamps += 1
        if self.stats.bad_timestamps == 1:
            text = (f"LSL stream {self.params.name!r} stamped a sample {t!r} (its clock is wrong: not finite, or before "
                    "LSL's zero); such samples get the last good time, or 0, as their device time, and are counted in "
                    "the REPORT's bad_timestamps; the host's read times are exact")
            log.warning(text)
            self._status(STATUS_LSL_BAD_TIMESTAMP, Severity.WARNING, text)
        return self._last_ts_us if not math.isfinite(t) else 0

    def _not_counts(self, sample: np.ndarray) -> None:
        """Once per transport: a headstage stream whose values are not spike counts (EEG in microvolts, say) is
        being rounded and clipped into 0..65535, which no decoder of such data expects: say so, loudly."""
        self._said_not_counts = True
        shown = ", ".join(f"{v:g}" for v in sample[:4].tolist())
        text = (f"LSL stream {self.params.name!r} (type {self.info.type()!r}) is read as a headstage, whose frames "
                f"carry counts in 0..65535, but its samples are not counts (first values: {shown}): they are rounded "
                f"and clipped, which destroys signals such as EEG in microvolts. Open it with kind=plant "
                f"(lsl://{self.params.name}?kind=plant) to pass every value as float32; the counters rounded_values "
                "and clipped_values in the REPORT say how many were changed")
        log.warning(text)
        self._status(STATUS_LSL_NOT_COUNTS, Severity.WARNING, text)

    def _pull(self, timeout: float) -> int:
        try:
            if timeout > 0:
                _, stamps = self.inlet.pull_chunk(timeout=timeout, max_samples=_MAX_CHUNK, dest_obj=self._buf,
                                                  min_samples=1, as_numpy=True)
            else:
                _, stamps = self.inlet.pull_chunk(timeout=0.0, max_samples=_MAX_CHUNK, dest_obj=self._buf,
                                                  as_numpy=True)
        except self._lsl.util.LostError:
            self._stream_gone("liblsl lost it; without a source id it cannot reconnect by itself, so the network is watched for it")
            return 0
        n = len(stamps)
        if n:
            self._frames_from(self._buf, stamps)
        return n

    def _stream_gone(self, why: str) -> None:
        """The inlet gave up: watch the network for the stream and open a new inlet when it is back."""
        self._inlet_dead = True
        self._watch()
        self._mark_lost(why)

    def _mark_lost(self, why: str) -> None:
        if not self._is_lost:
            self._is_lost = True
            self.stats.losses += 1
            gone = f"is gone ({why})" if why else f"sent no sample for {self.params.lost_s:g} s"
            text = (f"LSL stream {self.params.predicate()} {gone}; the session's watchdog sends the safe command, "
                    "and frames resume when the stream returns")
            log.warning(text)
            self._status(STATUS_LSL_STREAM_LOST, Severity.WARNING, text)

    def _watch(self) -> None:
        """Look on the network for the stream (again): a ContinuousResolver, read each step by ``_try_reopen``."""
        if self._resolver is None:
            self._resolver = self._lsl.ContinuousResolver(pred=self.params.predicate(), forget_after=1.0)

    def _try_reopen(self) -> None:
        # another outlet than the one this inlet is on (a restarted source: a new uid); the inlet's own stream,
        # back after a pause, resumes by itself
        results = [i for i in self._resolver.results() if i.uid() != self.info.uid()]
        found = [i for i in results if _same_source(i, self.info)]
        other = next((i for i in results if not _same_source(i, self.info)), None)
        if other is not None and not found and other.uid() != self._said_other:
            # a second amplifier under the same name, a test outlet: never switched to in the middle of a session
            self._said_other = other.uid()
            self.stats.other_sources += 1
            text = (f"LSL stream {self.params.name!r} is lost, and another source of that name is on the network: "
                    f"{_describe(other)}; it is not taken, since it is not the source this session started with "
                    f"({_describe(self.info)}); the session waits for that one (name it with source_id= to be sure)")
            log.warning(text)
            self._status(STATUS_LSL_OTHER_SOURCE, Severity.WARNING, text)
        if not found:
            return
        self.inlet.close_stream()
        info, old = found[0], self.info
        self.inlet = self._new_inlet(info)
        self.info = info
        self._resolver = None
        self._inlet_dead = False
        self.stats.inlets_reopened += 1
        if _layout(info) != _layout(old):
            # Never reshape the new stream's samples into the old frames (a 64-channel source in a 96-value
            # frame would leave 32 stale values): say what changed and answer as the device it is now. The
            # session checks that HELLO against the bundle and ends as for any device that came back as another.
            self.n_channels, self.rate_hz = int(info.channel_count()), float(info.nominal_srate())
            self._counts = np.zeros(self.n_channels, dtype="<u2")
            self._buf = np.zeros((_MAX_CHUNK, self.n_channels), dtype=self.inlet.np_dtype)
            self.stats.streams_changed += 1
            text = f"LSL stream {self.params.name!r} came back as another stream: {_describe(old)} is now {_describe(info)}"
            log.warning(text)
            self._status(STATUS_LSL_STREAM_CHANGED, Severity.WARNING, text)
            self._emit(self.hello())
        self._status(STATUS_LSL_STREAM, Severity.INFO, _describe(info) + f", uid {info.uid()!r}")
        self._need_channels = True  # the restarted source may describe its channels anew (another montage)

    def _read_channels_again(self) -> None:
        """After the stream came back (a new inlet, or liblsl's own recovery of a restarted source), its channel
        descriptions as the source now gives them: fetched on a thread of their own (a fresh inlet's full info,
        which can take a while: never on the loop's thread), then sent again, and said where they differ."""
        if self._channel_fetch is None:
            self._fetched = _PENDING
            self._channel_fetch = threading.Thread(target=self._fetch_channels, args=(self.info,), daemon=True,
                                                   name="closedloop-lsl-channels")
            self._channel_fetch.start()
            return
        fetched = self._fetched
        if fetched is _PENDING:
            return
        self._channel_fetch, self._need_channels = None, False
        if not isinstance(fetched, dict):
            return  # the source gave no description, or it could not be read: the last one stands
        if self.channels is not None and fetched != self.channels:
            pairs = [(i, a, b) for i, (a, b) in enumerate(zip(self.channels["label"], fetched["label"], strict=False))
                     if a != b]
            example = f", e.g. channel {pairs[0][0]} {pairs[0][1]!r} -> {pairs[0][2]!r}" if pairs else ""
            text = (f"LSL stream {self.params.name!r} came back with other channel descriptions ({len(pairs)} labels "
                    f"differ{example}): the frames from here on are the new channels'")
            log.warning(text)
            self._status(STATUS_LSL_STREAM_CHANGED, Severity.WARNING, text)
        self.channels = fetched
        self._channel_texts = channel_status_texts(fetched)
        for text in self._channel_texts:
            self._status(STATUS_LSL_CHANNELS, Severity.INFO, text)

    def _fetch_channels(self, info: Any) -> None:
        """On its own thread: the channel descriptions of this source's stream now on the network, or None."""
        fetched: Any = None
        try:
            streams = [i for i in self._lsl.resolve_bypred(self.params.predicate(), 1, self.params.timeout_s)
                       if _same_source(i, info)]
            if streams:
                inlet = self._lsl.StreamInlet(streams[0])
                try:
                    fetched = channel_descriptions(inlet.info(timeout=self.params.timeout_s))
                finally:
                    inlet.close_stream()
        except Exception:  # noqa: BLE001  (the source went again, a timeout: the last description stands)
            fetched = None
        self._fetched = fetched

    # --- Transport ----------------------------------------------------------------------------

    def _read(self, max_bytes: int, timeout: float | None) -> bytes:
        now = self._lsl.local_clock()
        if self._streaming and not self._out:
            if self._resolver is not None:
                self._try_reopen()
            if self._need_channels:
                self._read_channels_again()
            if not self._inlet_dead:
                got = self._pull(0.0)
                if not got and timeout != 0:
                    got = self._pull(0.1 if timeout is None else timeout)
                now = self._lsl.local_clock()
                if got:
                    self._last_sample_s = now
                    self._resolver = None  # samples again: nothing to look for
                    if self._is_lost:
                        self._is_lost = False
                        back = f"LSL stream {self.params.predicate()} is back"
                        log.info(back)  # routine: the loss was the warning
                        self._need_channels = True  # a restarted source (liblsl's own recovery) may describe anew
                        self._status(STATUS_LSL_STREAM_BACK, Severity.INFO, back)
                elif now - self._last_sample_s > self.params.lost_s:
                    self._mark_lost("")
                    # liblsl's own recovery takes back only a source of the same id and layout: watch the network
                    # too, so a source restarted with another layout (or without an id) is seen and named
                    self._watch()
            if now >= self._next_clock_s:
                self._clock_status(now)
        elif not self._out and timeout != 0:
            time.sleep(0.05 if timeout is None else min(timeout, 0.05))  # nothing to say until the host's HELLO
        data = bytes(self._out[:max_bytes])
        del self._out[:max_bytes]
        return data

    def _write(self, data: bytes) -> int:
        for f in self._parser.feed(data):
            m = f.message
            if isinstance(m, Hello):
                self._on_host_hello()
            elif isinstance(m, Status) and int(m.code) == _REQUEST_REPORT:
                self._status(_REPORT, Severity.INFO, json.dumps(self.report()))
            else:
                name = type(m).__name__
                self.stats.commands[name] = self.stats.commands.get(name, 0) + 1
        return len(data)

    def _on_host_hello(self) -> None:
        self.stats.host_hellos += 1
        if not self._streaming:
            self.inlet.flush()  # samples from before the session are not part of it
            self._streaming = True
            self._last_sample_s = self._lsl.local_clock()
        self._emit(self.hello())
        # which stream answered, in the recording (a device_status event): name alone may not tell two sources apart
        self._status(STATUS_LSL_STREAM, Severity.INFO, _describe(self.info) + f", uid {self.info.uid()!r}")
        for text in self._channel_texts:
            self._status(STATUS_LSL_CHANNELS, Severity.INFO, text)
        self._clock_status(self._lsl.local_clock())

    def report(self) -> dict[str, Any]:
        """What the STATUS(REPORT) carries: the stream, the parameters, the counters and the clocks."""
        return {"device": "lsl", "kind": self.kind, "stream": _describe(self.info), "params": asdict(self.params),
                "streaming": self._streaming, "lost": self._is_lost, **asdict(self.stats),
                "clock": self.clock_reading()}

    def _close(self) -> None:
        try:
            self.inlet.close_stream()
        except Exception:  # noqa: BLE001  (closing a lost inlet)
            pass
        self._resolver = None


def open_lsl(url: str, **_options: Any) -> LslTransport:
    """Resolve ``lsl://NAME?...`` on the network and open an inlet on it (the ``closedloop.transports`` entry point).

    Raises
    ------
    ValueError
        A malformed URL or parameter, or a string (marker) stream.
    LslStreamNotFoundError
        No stream matched within ``timeout``; the message lists the streams that answered.
    ImportError
        pylsl is not installed.
    """
    params = LslParams.from_url(url)
    pylsl = import_pylsl()
    return LslTransport(url, params, pylsl, _resolve(pylsl, params))
