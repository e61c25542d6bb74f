"""A DECODER_OUTPUT answers the bin it decoded: its ``bin_index`` is the input frame's, also when one loop step
decodes several frames that arrived together (docs/protocol.md, DECODER_OUTPUT)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from closedloop.export import export_bundle
from closedloop.firmware_bridge import (
    DecoderOutput,
    Hello,
    Link,
    NeuralFrame,
    encode_frame,
    open_pty_pair,
    register_transport,
)
from closedloop.runtime import Session, SessionConfig
from closedloop.sdk.models import GRUDecoder

N_CH, RATE_HZ = 6, 50.0


@pytest.fixture(scope="module")
def decoder_bundle(tmp_path_factory):
    torch.manual_seed(1)
    return export_bundle(
        GRUDecoder(N_CH, 8, 1, 4).eval(), tmp_path_factory.mktemp("bins") / "dec", kind="recurrent",
        example_input=torch.zeros(1, N_CH), rate_hz=RATE_HZ, name="bins",
        extra={"session": {"input": "neural_frame", "command": "decoder_output"}},
        variants=(), tensorrt=False, report=lambda s: None,
    )


def test_each_decoder_output_carries_the_bin_index_of_the_frame_it_decoded(decoder_bundle):
    host, device = open_pty_pair()
    link = Link(device, role="device")
    bins = [5000 + 3 * k for k in range(12)]  # the device's own numbering: not the host's steps
    got: list[int] = []

    def serve():
        while (f := link.recv(5.0)) is not None and not isinstance(f.message, Hello):
            pass
        link.send(Hello(kind="headstage", name="bins", n_channels=N_CH, rate_hz=RATE_HZ))
        link.recv(0.1)
        seq = link.next_seq
        for burst in (bins[:4], bins[4:5], bins[5:12]):  # bursts: one step decodes several frames
            wire = b"".join(encode_frame(NeuralFrame(bin_index=b, counts=np.full(N_CH, i % 3, np.uint16)),
                                         seq + i, int(time.monotonic() * 1e6)) for i, b in enumerate(burst))
            seq += len(burst)
            link.transport.write(wire)
            end = time.monotonic() + 0.2
            while (left := end - time.monotonic()) > 0:
                f = link.recv(left)
                if f is not None and isinstance(f.message, DecoderOutput):
                    got.append(int(f.message.bin_index))

    register_transport("binstest", lambda url, **_: host, replace=True)
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    cfg = SessionConfig(device="binstest://", backend="onnxruntime", duration_s=10.0, status=False, watchdog_s=30.0)
    with Session(decoder_bundle, cfg) as s:
        s.start()
        threading.Thread(target=lambda: (thread.join(10.0), s.stop()), daemon=True).start()
        summary = s.run()
    link.close()
    assert summary.inputs_used == len(bins)
    assert got[: len(bins)] == bins  # one output per frame, each naming its frame's bin
