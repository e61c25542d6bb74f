"""Neural headstage emulator: streams NEURAL_FRAME bins of spike counts from a pluggable source.

``sim://headstage?source=poisson&channels=192&rate=50&seed=1``.  Every tick (one
20 ms bin at the default 50 Hz) it sends one NEURAL_FRAME whose ``bin_index`` counts
bins since streaming started.  It accepts DECODER_OUTPUT from the host (a display on
the rig would show it): it counts them and keeps the decoded text, which a REPORT
carries and ``--verbose`` prints.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from closedloop.firmware_bridge import DecoderOutput, Hello, Message, NeuralFrame

from ..params import Param
from ..sources import NEURAL_SOURCES, make_source, source_class
from .base import Device, register_device

__all__ = ["Headstage"]

_MAX_REPORTED_TEXT = 2000


@register_device("headstage")
class Headstage(Device):
    """A multi-channel spike-count headstage."""

    KIND = "headstage"
    FLOAT_DATA = False  # spike counts
    PARAMS = (
        Param("rate", float, 50.0, "bins per second (50: 20 ms bins)", low=0.1, high=10_000.0),
        Param("channels", int, 192, "channels per NEURAL_FRAME", low=1, high=2045),
        Param("source", str, "poisson", "neural source (sim.sources registry)", choices=lambda: NEURAL_SOURCES),
    )

    @classmethod
    def extra_params(cls, raw: Mapping[str, str]) -> tuple[Param, ...]:
        return source_class(raw.get("source", "poisson")).PARAMS

    def __init__(self, params: Mapping[str, Any], log: Callable[[str], None] | None = None) -> None:
        super().__init__(params, log)
        p = self.params
        own = {spec.name: p[spec.name] for spec in source_class(p["source"]).PARAMS}
        self.source = make_source(p["source"], p["channels"], p["rate"], p["seed"], **own)
        self.decoder_outputs = 0
        self.decoded_text = ""
        self.last_decoded_bin: int | None = None

    def hello(self) -> Hello:
        return Hello(kind=self.KIND, name=f"headstage:{self.params['source']}",
                     n_channels=self.params["channels"], rate_hz=self.rate_hz)

    def start(self, t_s: float) -> None:
        self.source.reset(self.params["seed"])

    def tick(self, index: int, t_s: float) -> Sequence[Message]:
        return [NeuralFrame(index % 2**32, self.source.next_bin())]

    def on_message(self, message: Message, t_s: float) -> None:
        if not isinstance(message, DecoderOutput):
            super().on_message(message, t_s)
            return
        self.decoder_outputs += 1
        self.last_decoded_bin = message.bin_index
        if message.text:
            self.decoded_text += message.text
            if self.log is not None:
                self.log(f"decoded (bin {message.bin_index}): {message.text!r} -> {self.decoded_text[-80:]!r}")

    def report(self) -> dict[str, Any]:
        return {"decoder_outputs": self.decoder_outputs, "last_decoded_bin": self.last_decoded_bin,
                "decoded_text": self.decoded_text[-_MAX_REPORTED_TEXT:],
                "decoded_chars": len(self.decoded_text),
                # what the source is playing (e.g. the prompted sentence of a handwriting trial)
                "source": getattr(self.source, "report", dict)()}
