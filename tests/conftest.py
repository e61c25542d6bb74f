"""Shared fixtures: real small artefacts (tiny exported bundles) built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

_TESTS = Path(__file__).resolve().parent


def _files_that_start_ray() -> set[str]:
    """Test files (paths as in node ids, ``tests/...``) that declare ``pytestmark = pytest.mark.uses_ray``."""
    return {f"tests/{p.relative_to(_TESTS).as_posix()}" for p in _TESTS.rglob("test_*.py")
            if "pytestmark = pytest.mark.uses_ray" in p.read_text(encoding="utf-8")}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``make test`` runs the suite on pytest-xdist workers: each test file is one unit of work (its module
    fixtures are built once, on one worker), and every file marked ``uses_ray`` (it starts a Ray instance, or a
    benchmark that does) is in one shared unit, so that no two Ray instances run at once: a local instance sizes
    itself to every CPU of the machine, and the grid tests time and place cells on the CPUs they declared."""
    from xdist.scheduler import LoadScopeScheduling

    ray_files = _files_that_start_ray()

    class FileOrRayScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "uses_ray" if path in ray_files else path

    return FileOrRayScheduling(config, log)


@pytest.fixture(scope="session", autouse=True)
def _sb3_logs_in_pytests_own_temp(tmp_path_factory):
    """SB3's ``learn()`` with ``verbose=0`` makes an empty ``$TMPDIR/SB3-<date>`` folder per call unless
    ``SB3_LOGDIR`` says where; tests that drive SB3 directly put it in pytest's own (pruned) temp folder."""
    mp = pytest.MonkeyPatch()
    mp.setenv("SB3_LOGDIR", str(tmp_path_factory.mktemp("sb3_logs")))
    yield
    mp.undo()


@pytest.fixture(scope="session")
def autograd_nodes():
    """``names(out)``: the class names of the autograd nodes behind tensor ``out`` (which code a pass ran)."""

    def names(out) -> set[str]:
        seen, todo = set(), [out.grad_fn]
        while todo:
            fn = todo.pop()
            if fn is not None and fn not in seen:
                seen.add(fn)
                todo += [f for f, _ in fn.next_functions]
        return {type(fn).__name__ for fn in seen}

    return names


@pytest.fixture(scope="session")
def watchdog_rule():
    """``check(record, watchdog_s, input_type, trips)``: each watchdog trip of a recorded session had a real silence.

    On a loaded 2-core machine the host can starve an emulator process for a quarter second, and the
    watchdog then trips, as it should; tests of normal sessions assert this rule instead of "no trip".
    The times are the host's own: when each frame of ``input_type`` was complete in a received chunk
    (the RX records). Checks that the recording holds ``trips`` watchdog events, each at least
    ``watchdog_s`` after the last input before it, and that input resumed after each one (when input
    came back before the session ended).
    """

    def check(record, watchdog_s: float, input_type: type, trips: int) -> None:
        from closedloop.firmware_bridge import FrameParser
        from closedloop.runtime import RecordingReader, RecordType

        reader, parser = RecordingReader(record), FrameParser()
        arrived = [rec.host_ns for rec in reader.of_type(RecordType.RX)
                   if any(isinstance(f.message, input_type) for f in parser.feed(rec.payload))]
        events = [(rec.host_ns, rec.json()["event"]) for rec in reader.of_type(RecordType.EVENT)]
        tripped = [t for t, kind in events if kind == "watchdog"]
        assert len(tripped) == trips, (trips, events[:8])
        for t in tripped:
            before = [x for x in arrived if x < t]
            if before:  # (a trip before any input: the device never sent, silent since the start)
                silent_s = (t - before[-1]) / 1e9
                assert silent_s >= watchdog_s - 1e-3, (silent_s, watchdog_s, events[:8])
            if any(x > t + 50e6 for x in arrived):
                assert any(kind == "input_resumed" and u > t for u, kind in events), events[:8]

    return check


@pytest.fixture(scope="session")
def tiny_models():
    import torch

    from closedloop.sdk.models import GRUDecoder, MLPPolicy

    torch.manual_seed(0)
    return {
        "gru": GRUDecoder(n_inputs=12, n_hidden=16, n_layers=2, n_outputs=5).eval(),
        "mlp": MLPPolicy(n_obs=6, n_actions=3, hidden=(16, 16)).eval(),
    }


@pytest.fixture(scope="session")
def gru_bundle(tmp_path_factory, tiny_models):
    import torch

    from closedloop.export import export_bundle

    return export_bundle(
        tiny_models["gru"],
        tmp_path_factory.mktemp("bundles") / "gru",
        kind="recurrent",
        example_input=torch.zeros(1, 12),
        rate_hz=50.0,
        name="tiny-gru",
        variants=("fp16", "int8"),
        report=lambda s: None,
    )


@pytest.fixture(scope="session")
def mlp_bundle(tmp_path_factory, tiny_models):
    import torch

    from closedloop.export import export_bundle

    return export_bundle(
        tiny_models["mlp"],
        tmp_path_factory.mktemp("bundles") / "mlp",
        kind="feedforward",
        example_input=torch.zeros(1, 6),
        rate_hz=1000.0,
        name="tiny-mlp",
        postprocess={"low": [-0.5, -0.5, -0.5], "high": [0.5, 0.5, 0.5]},
        variants=(),
        report=lambda s: None,
    )


@pytest.fixture(scope="session")
def bytes_allocated():
    """``bytes_allocated(fn, calls)``: the bytes Python's allocator gained over ``calls`` calls of ``fn``
    (tracemalloc; what a hot path must keep near zero)."""
    import tracemalloc

    def measure(fn, calls: int) -> int:
        tracemalloc.start()
        try:
            before = tracemalloc.take_snapshot()
            for _ in range(calls):
                fn()
            after = tracemalloc.take_snapshot()
        finally:
            tracemalloc.stop()
        return sum(s.size_diff for s in after.compare_to(before, "filename") if s.size_diff > 0)

    return measure



@pytest.fixture(scope="session")
def bench_script():
    """``bench_script("NAME")``: ``bench/NAME.py`` as a module (the bench scripts are not a package), for tests
    of their parts."""
    import importlib.util
    from pathlib import Path

    def load(name: str):
        path = Path(__file__).resolve().parent.parent / "bench" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    return load


@pytest.fixture(scope="session")
def typing_bundle(tmp_path_factory):
    """A 12-channel handwriting decoder bundle (random weights, scaled so it types now and then on Poisson input)."""
    import numpy as np
    import torch

    from closedloop.sdk.bci.deploy import export_bci_bundle
    from closedloop.sdk.models import GRUDecoder

    torch.manual_seed(3)
    module = GRUDecoder(12, 16, 1, 32).eval()
    with torch.no_grad():  # a random decoder that types now and then on Poisson input
        module.readout.weight.mul_(10)
    c = 12  # channels
    return export_bci_bundle(module, tmp_path_factory.mktemp("typing") / "typing", n_channels=c, mean=np.full(c, 0.16),
                             std=np.full(c, 0.4), session_name="2023.04.17", variants=(), tensorrt=False,
                             report=lambda s: None)


@pytest.fixture(scope="session")
def observer_bundle(tmp_path_factory):
    """A certified neural observer of the flexible joint (small untrained network, scaled down until certified)."""
    from closedloop.sdk.observer.neural import example_observer_bundle

    return example_observer_bundle(tmp_path_factory.mktemp("o") / "fj")


@pytest.fixture
def acted_inputs():
    """A session observer that keeps, for every step that acted on a device frame, its ``inputs`` row (``rows``), its
    outputs, the family's ``state`` row and the input frame's sequence number (``seqs``); and ``n_in`` and the
    state ``labels`` from the session's info."""
    from closedloop.runtime.observe import FLAG_ACTED, SessionObserver

    class ActedInputs(SessionObserver):
        def __init__(self):
            self.rows, self.outputs, self.state, self.seqs = [], [], [], []
            self.n_in = self.labels = None

        def on_start(self, info):
            self.n_in, self.labels = info["n_in"], info["state"]

        def on_steps(self, batch):
            acted = (batch.flags & FLAG_ACTED) != 0
            self.rows.extend(batch.inputs[acted].copy())
            self.outputs.extend(batch.outputs[acted].copy())
            self.state.extend(batch.state[acted].copy())
            self.seqs.extend(batch.input_seq[acted].tolist())

    return ActedInputs()


class LockstepDevice:
    """The device end of a pty pair: answers the host's Hello (``kind``, ``rate_hz``), then sends each measurement
    and waits for the command it produced before sending the next (so every frame is acted on); ``replies`` holds
    each command's values (``ActuatorCommand.u``, ``JointCommand.values``), None where none came."""

    def __init__(self, n_channels: int, frames: list, kind: str = "plant", rate_hz: float = 100.0):
        import threading

        from closedloop.firmware_bridge import Link, open_pty_pair

        self.host, device = open_pty_pair()
        self.link = Link(device, role="device")
        self.n_channels, self.frames, self.kind, self.rate_hz = n_channels, frames, kind, rate_hz
        self.replies: list = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _wait(self, kinds, timeout_s: float = 5.0):
        while (f := self.link.recv(timeout_s)) is not None:
            if isinstance(f.message, kinds):
                return f.message
        return None

    def _serve(self) -> None:
        import numpy as np

        from closedloop.firmware_bridge import ActuatorCommand, Hello, JointCommand, PlantMeasurement

        if self._wait(Hello) is None:
            return
        self.link.send(Hello(kind=self.kind, name="lockstep", n_channels=self.n_channels, rate_hz=self.rate_hz))
        for y in self.frames:
            self.link.send(PlantMeasurement(y, np.zeros(0, np.float32)))
            reply = self._wait((ActuatorCommand, JointCommand))
            values = None if reply is None else (reply.u if isinstance(reply, ActuatorCommand) else reply.values)
            self.replies.append(None if values is None else values.copy())

    def close(self) -> None:
        self.thread.join(10.0)
        self.link.close()


@pytest.fixture
def lockstep():
    """``lockstep(n_channels, frames, kind="plant", rate_hz=100.0) -> (URL, device)``: a fresh lockstep device on a
    pty pair (closed after the test)."""
    from closedloop.firmware_bridge import register_transport

    devices = []

    def make(n_channels: int, frames: list, kind: str = "plant", rate_hz: float = 100.0):
        dev = LockstepDevice(n_channels, frames, kind, rate_hz)
        devices.append(dev)
        scheme = f"lockstep{len(devices)}"
        register_transport(scheme, lambda url, **_: dev.host, replace=True)
        return f"{scheme}://", dev

    yield make
    for dev in devices:
        dev.close()


@pytest.fixture
def pty_board():
    """``pty_board(serve) -> port path``: ``serve(board_end, stop)`` runs on a thread at the board's end of a fresh
    pty pair (a device of the test's own) until ``stop`` is set; the host opens the returned path. Stopped and both
    ends closed after the test."""
    import threading

    from closedloop.firmware_bridge import open_pty_pair

    started = []

    def start(serve) -> str:
        board_end, port_end = open_pty_pair()
        stop = threading.Event()
        thread = threading.Thread(target=serve, args=(board_end, stop), daemon=True)
        thread.start()
        started.append((board_end, port_end, stop, thread))
        return port_end.path

    yield start
    for board_end, port_end, stop, thread in started:
        stop.set()
        thread.join(2)
        board_end.close()
        port_end.close()
