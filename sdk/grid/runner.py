"""One grid runner for every sweep: benchmark grids and simulator-in-the-loop batches.

A grid is a list of independent :class:`Cell` s (a config dict and a seed, with a stable
key). :func:`run_grid` runs a function on each cell on a local Ray instance (this machine's
cores), on a Ray cluster given its address, or in this process one cell after another with one
worker or where Ray (the ``[scale]`` extra) is not installed. Each finished cell is appended as one JSON line
to a results file, so a rerun skips what is done; a cell whose worker dies is retried once and
then reported as failed with the error. :class:`GridRunner` is the lower level under it, for
grids whose tasks depend on each other (the iBCI benchmark's training and scoring tasks).
It sits in ``sdk/`` and is never imported by the runtime: the deployed footprint has no Ray.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("closedloop.grid")

def ray_available() -> bool:
    """Whether Ray (``pip install 'closedloop[scale]'``) can be imported here."""
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class Cell:
    """One independent unit of a grid: ``config`` (JSON values) and ``seed``.

    ``key`` is stable across runs (a hash of the config and seed unless given), so a rerun
    recognises the cells a results file already holds.
    """

    config: dict[str, Any]
    seed: int = 0
    name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.config, dict):
            raise TypeError(f"Cell config is a {type(self.config).__name__}; give a dict of JSON values")
        problem = json_problem(jsonable(self.config), "config")
        if problem:
            raise TypeError(f"Cell {problem}: a cell's config must be JSON values (dicts with string keys, lists, "
                            "numbers, strings, booleans, None; NumPy values are converted), so that its key is the "
                            "same on every run and its record can be read back")
        if isinstance(self.seed, bool) or not isinstance(jsonable(self.seed), int):
            raise TypeError(f"Cell seed {self.seed!r} is a {type(self.seed).__name__}; give an int")

    @property
    def key(self) -> str:
        if self.name is not None:
            return self.name
        # NumPy values as the numbers they are: the key is the one the stored record's config gives again
        text = json.dumps({"config": jsonable(self.config), "seed": jsonable(self.seed)}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def grid(seeds: Iterable[int], **axes: Sequence[Any]) -> list[Cell]:
    """Every combination of ``axes`` (name -> values) for every seed, as cells: the seed varies fastest, then the
    last axis, and the first axis slowest.

    >>> [(c.config, c.seed) for c in grid([0, 1], method=["a"])]
    [({'method': 'a'}, 0), ({'method': 'a'}, 1)]
    """
    import itertools

    for n, values in axes.items():
        if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__iter__"):
            raise TypeError(f"grid axis {n}={values!r} is a {type(values).__name__}, not a list of values: give "
                            f"{n}=[{values!r}] for one value")
    seeds = list(seeds)
    names = list(axes)
    return [Cell(dict(zip(names, values, strict=True)), seed)
            for values in itertools.product(*(axes[n] for n in names)) for seed in seeds]


@dataclass
class Done:
    """A finished task: its tag, its result or the error that ended it, and where it ran."""

    tag: Any
    result: Any = None
    error: str | None = None
    node: str = ""
    host: str = ""
    pid: int = 0
    started: float = 0.0
    wall_s: float = 0.0
    #: the exception itself (the cell's own, unwrapped from Ray's), for callers that re-raise it
    exception: BaseException | None = field(default=None, repr=False)


def _where() -> tuple[str, str, int]:
    node = os.environ.get("CLOSEDLOOP_GRID_NODE", "local")
    try:
        import ray

        if ray.is_initialized():
            node = ray.get_runtime_context().get_node_id()
    except ImportError:
        pass
    return node, socket.gethostname(), os.getpid()


def _call(fn: Callable, args: tuple) -> tuple[Any, str, str, int, float, float, tuple | None]:
    """Run ``fn(*args)`` where a worker picked it up: the result, where and when it ran, and the error if it
    raised (its text with the traceback, and the exception where it can travel back), so that a cell that raised on
    a worker keeps its node, host, pid and traceback in its record."""
    node, host, pid = _where()
    started = time.time()
    t0 = time.perf_counter()
    try:
        try:
            result = fn(*args)
        except SystemExit as exc:
            if isinstance(exc, Terminated):  # the driver's SIGTERM (in-process): the grid ends, not the cell
                raise
            raise RuntimeError(f"the cell called sys.exit({exc.code!r}); a cell returns its result or raises") from None
    except Exception as exc:  # a cell's failure is its record, never the grid's end
        import pickle

        text = _error_text(exc) + "\n" + traceback.format_exc(limit=3)
        try:
            pickle.dumps(exc)
            own: BaseException | None = exc
        except Exception:  # noqa: BLE001  (an exception that cannot be pickled travels as its text only)
            own = None
        return None, node, host, pid, started, time.perf_counter() - t0, (text, own)
    return result, node, host, pid, started, time.perf_counter() - t0, None


class Terminated(SystemExit):
    """SIGTERM reached the driver while a runner was open: ``SystemExit(143)``, never taken for a cell's own exit."""


def _error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) < 4000 else text[:4000] + " ..."


def _check_listening(address: str, timeout_s: float = 5.0) -> None:
    """A ``HOST:PORT`` cluster address where nothing listens is refused at once (Ray itself retries for minutes,
    printing only its own connection errors); other forms (``auto``, ``ray://...``) are left to Ray."""
    host, sep, port = address.rpartition(":")
    if not sep or "/" in address or not port.isdigit() or not host:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise RuntimeError(f"address {address}: nothing answers there ({exc.strerror or exc}); start the head with "
                           f"`ray start --head --port {port}` on {host}, or check the address it printed") from None


def resolve_backend(backend: str, workers: int | None, address: str | None) -> str:
    """What ``backend="auto"`` means for these ``workers`` and ``address``: in this process for one worker and no
    address (a one-CPU Ray instance would add its start-up and hide the cells' output and errors in worker logs,
    and buy nothing) or where Ray is not installed, Ray otherwise. Any other ``backend`` is returned as given."""
    if backend != "auto":
        return backend
    local_one = workers == 1 and not address
    return "ray" if ray_available() and not local_one else "inprocess"


@dataclass
class GridRunner:
    """Tasks submitted one by one and collected as they finish, on Ray or in this process.

    ``backend``: ``"auto"`` (in-process for one worker and no address; otherwise Ray if it is
    installed, else in-process), ``"ray"`` or ``"inprocess"``. ``address`` joins a running Ray
    cluster (``ray start --head``); without it a local Ray instance with ``workers`` CPUs
    (default: all of them) is started and shut down at :meth:`close`. ``retries``: how many times a task whose worker died is run again.
    Use it as a context manager.

    While a Ray runner is open (in the main thread), SIGTERM raises ``SystemExit(143)``, so that
    ``kill PID`` on the driver leaves through :meth:`close`, which ends its workers and the
    local Ray instance, even when the signal lands while Ray is still starting.
    """

    address: str | None = None
    workers: int | None = None
    retries: int = 1
    backend: str = "auto"
    _queue: list = field(default_factory=list, init=False, repr=False)
    _pending: dict = field(default_factory=dict, init=False, repr=False)
    _started_ray: bool = field(default=False, init=False, repr=False)
    _remote: Any = field(default=None, init=False, repr=False)
    _previous_sigterm: Any = field(default=None, init=False, repr=False)
    _terminated: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "ray", "inprocess"):
            raise ValueError(f"backend {self.backend!r}: expected 'auto', 'ray' or 'inprocess'")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"workers={self.workers}: expected 1 or more (or None for every CPU)")
        if self.retries < 0:
            raise ValueError(f"retries={self.retries}: expected 0 or more")
        self.backend = resolve_backend(self.backend, self.workers, self.address)
        if self.backend == "inprocess" and self.address:
            raise ValueError(f"address {self.address!r} needs Ray, which is not installed: "
                             "pip install 'closedloop[scale]'")
        if self.backend == "ray":
            self._start_ray()
        else:
            self._own_sigterm()

    def _start_ray(self) -> None:
        try:
            import ray
        except ImportError:
            raise RuntimeError("backend 'ray' needs Ray: pip install 'closedloop[scale]'") from None
        self._own_sigterm()
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                                      "configure_logging": False}
            if self.address:
                _check_listening(self.address)
            try:
                if self.address:
                    ray.init(address=self.address, **kwargs)
                else:
                    # "local": a fresh instance, never a cluster that `ray start` left on this machine
                    ray.init(address="local", num_cpus=self.workers or os.cpu_count() or 1, **kwargs)
            except BaseException as exc:  # a signal or an error mid-start: what it started goes with it
                ray.shutdown()
                self._restore_sigterm()
                if isinstance(exc, SystemExit) and exc.code == signal.SIGTERM:  # Ray's handler: sys.exit(15)
                    raise SystemExit(128 + signal.SIGTERM) from None
                raise
            self._started_ray = True
            self._own_sigterm()  # ray.init puts its own handler (sys.exit(15), skipping close()) in place
        # SPREAD: on a cluster, cells go to every node rather than filling the driver's first
        self._remote = ray.remote(_call).options(num_cpus=1, max_retries=self.retries, retry_exceptions=False,
                                                 scheduling_strategy="SPREAD")

    def _own_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def stop(signum: int, frame: object) -> None:
            self._terminated = True
            raise Terminated(128 + signum)

        previous = signal.signal(signal.SIGTERM, stop)
        if self._previous_sigterm is None:
            self._previous_sigterm = previous

    def _restore_sigterm(self) -> None:
        if self._previous_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None

    @property
    def nodes(self) -> int:
        """How many nodes the tasks may run on (1 in-process)."""
        if self.backend != "ray":
            return 1
        import ray

        return sum(1 for n in ray.nodes() if n.get("Alive"))

    def submit(self, fn: Callable, *args: Any, tag: Any = None) -> None:
        """Start ``fn(*args)`` (in-process: when :meth:`next_done` asks for it); ``tag`` comes back with it."""
        if self.backend == "ray":
            self._pending[self._remote.remote(fn, args)] = tag
        else:
            self._queue.append((fn, args, tag))

    def __len__(self) -> int:
        """Tasks submitted and not yet collected."""
        return len(self._pending) + len(self._queue)

    def next_done(self) -> Done:
        """The next task to finish (in-process: the next one run); an error is returned, not raised."""
        if not len(self):
            raise RuntimeError("next_done() with no task running: submit one first")
        if self.backend != "ray":
            fn, args, tag = self._queue.pop(0)
            result, node, host, pid, started, wall, err = _call(fn, args)
            return Done(tag, result, err[0] if err else None, node, host, pid, started, wall, err[1] if err else None)
        import ray

        ready: list = []
        try:
            while not ready:  # a timeout, so that Ctrl-C and SIGTERM reach the driver promptly
                ready, _ = ray.wait(list(self._pending), num_returns=1, timeout=1.0)
        except SystemExit:
            if self._terminated:  # Ray's wait turns the handler's SystemExit(143) into SystemExit(1)
                raise SystemExit(128 + signal.SIGTERM) from None
            raise
        ref = ready[0]
        tag = self._pending.pop(ref)
        try:
            result, node, host, pid, started, wall, err = ray.get(ref)
        except Exception as exc:  # WorkerCrashedError (its worker died: where is unknown), or Ray's own failure
            cause = getattr(exc, "cause", None)
            own = cause if isinstance(cause, BaseException) else exc
            return Done(tag, None, _error_text(own), exception=own)
        return Done(tag, result, err[0] if err else None, node, host, pid, started, wall, err[1] if err else None)

    def close(self) -> None:
        if self.backend == "ray":
            import ray

            for ref in self._pending:
                ray.cancel(ref, force=True)
            self._pending.clear()
            try:
                if self._started_ray:
                    ray.shutdown()
                    self._started_ray = False
            finally:
                self._restore_sigterm()
        else:
            self._restore_sigterm()
        self._queue.clear()

    def __enter__(self) -> GridRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_results(path: str | os.PathLike) -> dict[str, dict]:
    """The records of a results file by cell key (the last line of a key wins); a torn last line is ignored."""
    records: dict[str, dict] = {}
    p = Path(path)
    if not p.exists():
        return records
    lines = p.read_text().splitlines()
    bad = []
    for n, line in enumerate(lines, 1):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            bad.append(n)
            continue
        if isinstance(rec, dict) and "key" in rec:
            records[rec["key"]] = rec
        elif line.strip():
            bad.append(n)
    # a driver killed mid-write leaves one torn last line (the next append cuts it off); anything else is damage
    if bad and bad != [len(lines)]:
        log.warning("results file %s: %d line(s) that are not records were skipped (line %s): the file was "
                    "changed by something other than the grid runner", p, len(bad), ", ".join(map(str, bad[:5])))
    return records


def jsonable(value: Any) -> Any:
    """``value`` with NumPy scalars and arrays, tuples and sets as JSON values (numbers, lists); the rest as is.

    >>> import numpy as np
    >>> jsonable({"n": np.int64(3), "ok": np.bool_(True), "x": np.arange(2), "t": (1, 2)})
    {'n': 3, 'ok': True, 'x': [0, 1], 't': [1, 2]}
    """
    if isinstance(value, dict):  # keys as JSON writes them (1 -> "1", True -> "true"): the same on a rerun's read
        return {k if isinstance(k, str) else _json_key(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        items = [jsonable(v) for v in value]
        try:
            return sorted(items)
        except TypeError:
            return items
    if type(value).__module__ == "numpy":
        tolist = getattr(value, "tolist", None)  # a NumPy scalar or array: Python numbers, nested lists
        if tolist is not None:
            return tolist()
    return value


def _json_key(k: Any) -> Any:
    k = jsonable(k)
    return json.dumps(k) if isinstance(k, (int, float, bool)) or k is None else k  # other keys: json_problem names


def json_problem(value: Any, where: str) -> str | None:
    """Where ``value`` (after ``jsonable``) holds something JSON cannot store, as ``where[...]: what``; None if
    nothing. NaN and infinities are allowed (docs/grid.md)."""
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                return f"{where}: key {k!r} is a {type(k).__name__} (JSON keys are strings)"
            p = json_problem(v, f"{where}[{k!r}]")
            if p:
                return p
        return None
    if isinstance(value, list):
        for i, v in enumerate(value):
            p = json_problem(v, f"{where}[{i}]")
            if p:
                return p
        return None
    if value is None or isinstance(value, (str, int, float, bool)):
        return None
    return f"{where} is a {type(value).__module__}.{type(value).__qualname__}"


def append_record(path: str | os.PathLike, record: dict) -> None:
    """One line, one ``write`` on an ``O_APPEND`` descriptor, flushed to disk: a kill leaves whole lines.

    Raises ``TypeError`` naming the part (config, seed or result) that JSON cannot hold.
    """
    try:
        line = json.dumps(record, allow_nan=True) + "\n"
    except TypeError as exc:
        part = next((k for k in ("config", "seed", "result") if k in record and not _dumps_ok(record[k])), "record")
        raise TypeError(f"cell {record['key']}: its {part} cannot be stored as JSON in {path} ({exc}); give and "
                        "return dicts, lists, numbers, strings, booleans and None (NumPy values are converted), or "
                        "pass results=None") from None
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        _drop_torn_tail(fd)
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def _drop_torn_tail(fd: int) -> None:
    """A last line without its newline is one a killed run did not finish: cut it off, so that the file keeps
    whole lines only (a complete record that lacks only its newline gets one)."""
    size = os.lseek(fd, 0, os.SEEK_END)
    if not size or os.pread(fd, 1, size - 1) == b"\n":
        return
    start = max(0, size - (1 << 20))
    while True:  # the last newline before the end (lines can be long: read back in 1 MiB pieces)
        chunk = os.pread(fd, size - start, start)
        i = chunk.rfind(b"\n")
        if i >= 0 or start == 0:
            cut = start + i + 1 if i >= 0 else 0
            break
        start = max(0, start - (1 << 20))
    tail = os.pread(fd, size - cut, cut)
    try:
        json.loads(tail)
    except ValueError:
        os.ftruncate(fd, cut)
        log.warning("results file: dropped a torn last line (%d bytes) left by a run that was killed mid-write",
                    size - cut)
        return
    os.write(fd, b"\n")


def _dumps_ok(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=True)
    except (TypeError, ValueError):
        return False
    return True


def fn_name(fn: Callable) -> str:
    """``module.qualname`` of a cell function, as records store it; a script's own function is named by the
    script's file, ``train.py:fit`` (every script's module is ``__main__``: two scripts' ``fit`` are two functions)."""
    module = getattr(fn, "__module__", "?")
    qualname = getattr(fn, "__qualname__", type(fn).__name__)
    if module == "__main__":
        main_file = getattr(sys.modules.get("__main__"), "__file__", None)
        if main_file:
            return f"{os.path.basename(main_file)}:{qualname}"
    return f"{module}.{qualname}"


def _same_fn(stored: str, name: str) -> bool:
    """Whether records of ``stored`` are this function's: the same name, or a script's function recorded before
    records named its script (``__main__.fit`` for ``train.py:fit``)."""
    return stored == name or (":" in name and stored == "__main__." + name.split(":", 1)[1])


@contextlib.contextmanager
def _results_lock(path: Path):
    """One driver at a time per results file: a second one is refused while the first runs (both would run every
    cell the file does not hold yet, and append twice). An advisory ``flock`` on Linux and macOS; elsewhere none."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"results file {path} is being written by another run of this grid (its lock is "
                               "held); wait for it to end, or give this run a results file of its own") from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run_grid(fn: Callable[[dict, int], Any], cells: Sequence[Cell], results: str | os.PathLike | None = None,
             address: str | None = None, workers: int | None = None, retries: int = 1, progress: bool = True,
             backend: str = "auto", desc: str = "grid") -> list[dict]:
    """Run ``fn(cell.config, cell.seed)`` for every cell; one record per cell, in the cells' order.

    A record is ``{"key", "fn", "config", "seed", "status": "ok" | "failed", "result" | "error",
    "node", "host", "pid", "started", "wall_s"}`` (docs/grid.md). With ``results`` (a ``.jsonl`` path)
    each record is appended as its cell finishes, and cells already there with status ``ok`` are
    not run again (their stored record is returned); failed cells are run again. A results file whose
    records name another ``fn`` is refused. NumPy values in a result (and tuples, sets) are stored as JSON
    numbers and lists. See :class:`GridRunner` for ``address``, ``workers``, ``retries`` and ``backend``.
    """
    keys = [c.key for c in cells]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"two cells have the key {dup!r}: give each cell a distinct config, seed or name")
    path = Path(results) if results is not None else None
    name = fn_name(fn)
    if path is not None and "<lambda>" in name:
        raise ValueError(f"{name}: a lambda has no name that tells its records from another lambda's in {path}; "
                         "define the cell function with def")
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()  # there from the start: an interrupted start-up still leaves the file a rerun names
    with _results_lock(path) if path is not None else contextlib.nullcontext():
        return _run_grid(fn, name, cells, keys, path, address, workers, retries, progress, backend, desc)


def _run_grid(fn: Callable, name: str, cells: Sequence[Cell], keys: list[str], path: Path | None,
              address: str | None, workers: int | None, retries: int, progress: bool, backend: str,
              desc: str) -> list[dict]:
    stored = read_results(path) if path else {}
    others = sorted({r["fn"] for r in stored.values() if r.get("fn") is not None and not _same_fn(r["fn"], name)})
    if others:
        raise ValueError(f"results file {path} holds cells of {', '.join(others)}; this grid runs {name}, whose "
                         "results would be taken for theirs: give it a results file of its own")
    done = {k: r for k, r in stored.items() if r.get("status") == "ok"}
    todo = [c for c in cells if c.key not in done]
    out: dict[str, dict] = dict(done)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(cells), initial=len(cells) - len(todo), desc=desc, unit="cell", leave=True)
    try:
        if todo:
            with GridRunner(address=address, workers=workers, retries=retries, backend=backend) as runner:
                for cell in todo:
                    runner.submit(fn, cell.config, cell.seed, tag=cell)
                while len(runner):
                    d = runner.next_done()
                    cell = d.tag
                    error, result = d.error, None
                    if error is None:
                        result = jsonable(d.result)
                        problem = json_problem(result, "result")
                        if problem:  # the cell's own failure, recorded as such: the grid goes on
                            error = (f"TypeError: its {problem}, which JSON cannot store; return dicts with string "
                                     "keys, lists, numbers, strings, booleans and None (NumPy values are converted)")
                    rec = {"key": cell.key, "fn": name, "config": jsonable(cell.config), "seed": jsonable(cell.seed),
                           "status": "failed" if error else "ok"}
                    rec |= {"error": error} if error else {"result": result}
                    rec |= {"node": d.node, "host": d.host, "pid": d.pid, "started": d.started,
                            "wall_s": round(d.wall_s, 4)}
                    if path is not None:
                        append_record(path, rec)
                    out[cell.key] = rec
                    if bar is not None:
                        bar.update(1)
                    if error:
                        said = f"{desc}: cell {cell.key} failed: {error.splitlines()[0]}"
                        bar.write(said) if bar is not None else log.warning(said)
    finally:
        if bar is not None:
            bar.close()
    return [out[k] for k in keys]
