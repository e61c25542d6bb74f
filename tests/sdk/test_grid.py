"""The grid runner: in-process, on a local Ray instance, on a two-node loopback cluster, with a worker
killed mid-cell and a driver killed mid-grid (docs/grid.md)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from closedloop.sdk.grid import Cell, grid, read_results, run_grid

pytestmark = pytest.mark.uses_ray  # starts Ray instances (tests/conftest.py)


def square(config: dict, seed: int) -> dict:
    if config.get("fail"):
        raise ValueError(f"cell {config['x']} was told to fail")
    if config.get("sleep"):
        time.sleep(config["sleep"])
    return {"y": config["x"] ** 2 + seed}


def die_once(config: dict, seed: int) -> dict:
    """Kill this worker the first time (the marker file says whether it already died), or every time."""
    marker = Path(config["marker"])
    if config.get("always") or not marker.exists():
        marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)
    return {"survived": True}


def _by_value() -> None:
    # Ray's workers cannot import this test module by name (pytest's importlib mode): ship the functions by value
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def test_in_process_grid_records_every_cell_and_a_failing_cell_with_its_error(tmp_path):
    cells = grid([0, 1], x=[1, 2, 3]) + [Cell({"x": 9, "fail": True})]
    out = tmp_path / "r.jsonl"
    recs = run_grid(square, cells, results=out, backend="inprocess", progress=False)
    assert [r["key"] for r in recs] == [c.key for c in cells]
    assert [r["result"]["y"] for r in recs[:-1]] == [c.config["x"] ** 2 + c.seed for c in cells[:-1]]
    assert recs[-1]["status"] == "failed" and "ValueError: cell 9 was told to fail" in recs[-1]["error"]
    assert "Traceback" in recs[-1]["error"] and recs[-1]["pid"] == os.getpid()  # where it failed, and how
    lines = out.read_text().splitlines()
    assert len(lines) == len(cells) and all(json.loads(line)["key"] for line in lines)
    # a rerun runs only the failed cell again; the finished ones come back from the file
    recs2 = run_grid(square, cells, results=out, backend="inprocess", progress=False)
    assert len(out.read_text().splitlines()) == len(cells) + 1
    assert [r["started"] for r in recs2[:-1]] == [r["started"] for r in recs[:-1]]


def numpy_result(config: dict, seed: int) -> dict:
    import numpy as np

    return {"n": np.int64(config["x"]), "ok": np.bool_(True), "v": np.arange(2) * seed, "f": np.float32(0.5),
            "pair": (1, 2), "tags": {"b", "a"}}


def test_numpy_values_and_tuples_are_stored_as_json_and_a_file_of_another_function_is_refused(tmp_path):
    import numpy as np

    out = tmp_path / "r.jsonl"
    cells = grid(np.arange(2), x=[np.int64(3)])  # NumPy seeds and config values too
    recs = run_grid(numpy_result, cells, results=out, backend="inprocess", progress=False)
    assert [r["status"] for r in recs] == ["ok", "ok"]
    stored = read_results(out)
    assert stored[cells[1].key]["result"] == {"n": 3, "ok": True, "v": [0, 1], "f": 0.5, "pair": [1, 2],
                                              "tags": ["a", "b"]}
    assert stored[cells[1].key]["fn"] == f"{__name__}.numpy_result" and stored[cells[1].key]["seed"] == 1
    # the same cells with another function would take numpy_result's records for theirs: refused, saying so
    with pytest.raises(ValueError, match=r"holds cells of .*numpy_result; this grid runs .*square"):
        run_grid(square, cells, results=out, backend="inprocess", progress=False)


def test_cells_with_the_same_key_are_refused():
    with pytest.raises(ValueError, match="two cells have the key"):
        run_grid(square, [Cell({"x": 1}), Cell({"x": 1})], backend="inprocess", progress=False)


def test_a_torn_last_line_is_ignored_and_cut_off_before_the_next_record(tmp_path):
    out = tmp_path / "r.jsonl"
    cells = grid([0], x=[1, 2])
    run_grid(square, cells[:1], results=out, backend="inprocess", progress=False)
    with open(out, "a") as f:
        f.write('{"key": "torn", "sta')  # a driver killed in the middle of a write
    run_grid(square, cells, results=out, backend="inprocess", progress=False)
    assert set(read_results(out)) == {c.key for c in cells}
    # the torn line was cut off, not left in the middle of the file: every line is a whole record
    assert all(json.loads(line)["key"] for line in out.read_text().splitlines())


def test_resume_after_the_driver_is_killed_skips_the_finished_cells(tmp_path):
    out, ran = tmp_path / "r.jsonl", tmp_path / "ran.txt"
    driver = textwrap.dedent(f"""
        import sys, time
        from closedloop.sdk.grid import grid, run_grid
        def cell(config, seed):
            with open({str(ran)!r}, "a") as f:
                f.write(str(config["x"]) + "\\n")
            time.sleep(0.25)
            return config["x"]
        run_grid(cell, grid([0], x=list(range(12))), results={str(out)!r}, backend="inprocess", progress=False)
        """)
    p = subprocess.Popen([sys.executable, "-c", driver])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (not out.exists() or len(out.read_text().splitlines()) < 3):
        time.sleep(0.05)
    p.kill()
    p.wait()
    done_before = set(read_results(out))
    assert 3 <= len(done_before) < 12
    first_run = ran.read_text().split()
    assert subprocess.run([sys.executable, "-c", driver], timeout=60).returncode == 0
    again = ran.read_text().split()[len(first_run):]
    recs = read_results(out)
    assert len(recs) == 12 and all(r["status"] == "ok" for r in recs.values())
    # only the unfinished cells ran again (the one cut off mid-cell among them)
    assert set(map(int, again)) == set(range(12)) - {r["config"]["x"] for k, r in recs.items() if k in done_before}


def test_one_local_worker_runs_in_this_process_and_starts_no_ray(tmp_path):
    # auto with one worker and no address: no one-CPU Ray instance to start; the cells run here, in order
    recs = run_grid(square, grid([0], x=[1, 2]), results=tmp_path / "r.jsonl", workers=1, progress=False)
    assert [(r["node"], r["pid"], r["result"]["y"]) for r in recs] == [("local", os.getpid(), 1), ("local", os.getpid(), 4)]
    if "ray" in sys.modules:
        assert not sys.modules["ray"].is_initialized()


ray = pytest.importorskip("ray", reason="the Ray tests need the [scale] extra (pip install 'closedloop[scale]')")


def test_a_tiny_grid_on_a_local_ray_instance(tmp_path):
    _by_value()
    cells = grid([0, 1], x=[1, 2]) + [Cell({"x": 5, "fail": True})]
    recs = run_grid(square, cells, results=tmp_path / "r.jsonl", workers=2, progress=False)
    assert [r["result"]["y"] for r in recs[:-1]] == [c.config["x"] ** 2 + c.seed for c in cells[:-1]]
    assert all(len(r["node"]) == 56 for r in recs)  # a Ray node id, not the in-process "local"
    # a cell that raised on a worker keeps where it ran and its traceback
    bad = recs[-1]
    assert bad["status"] == "failed" and "ValueError: cell 5 was told to fail" in bad["error"]
    assert "Traceback" in bad["error"] and bad["pid"] > 0 and bad["pid"] != os.getpid() and bad["host"]
    assert not ray.is_initialized()  # the runner shut down the instance it started


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def loopback_cluster():
    """A Ray head and a worker node on 127.0.0.1, one CPU each; the worker has the resource ``second_node``.

    ``ray start --block`` keeps each node's processes under one process group that is ended by its id
    afterwards (``ray stop`` would stop every Ray on the machine).
    """
    ray_cli = str(Path(sys.executable).with_name("ray"))
    port = _free_port()
    # a short folder: Ray's socket paths (TEMP/session_DATE_PID/sockets/plasma_store.N) must fit AF_UNIX's 107
    # bytes, which pytest's own temp folders (.../pytest-N/popen-gw0/ray0 under xdist) overrun
    tmp = Path(tempfile.mkdtemp(prefix="clray-", dir="/tmp"))
    logs = {name: open(tmp / f"{name}.log", "w") for name in ("head", "worker")}  # closed at the end

    def log_tail(name: str) -> str:
        logs[name].flush()
        return (tmp / f"{name}.log").read_text(errors="replace")[-1500:]

    # Ray 2.60's default token authentication refused the driver's connection to a `ray start` head here
    # ("Missing authorization header"): off for this loopback cluster of the test's own processes
    auth = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    env = os.environ | {"RAY_USAGE_STATS_ENABLED": "0"}
    common = ["--num-cpus=1", "--block", "--disable-usage-stats"]
    nodes = [subprocess.Popen([ray_cli, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
                               "--include-dashboard=false", f"--temp-dir={tmp}", *common],
                              start_new_session=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or nodes[0].poll() is not None:
                    pytest.fail("the Ray head node did not start")
                time.sleep(0.2)
        nodes.append(subprocess.Popen([ray_cli, "start", f"--address={address}", "--node-ip-address=127.0.0.1",
                                       '--resources={"second_node": 1}', *common],
                                      start_new_session=True, env=env, stdout=logs["worker"],
                                      stderr=subprocess.STDOUT))
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
        while sum(1 for n in ray.nodes() if n["Alive"]) < 2:
            if time.monotonic() > deadline:
                pytest.fail(f"the Ray worker node did not join the head:\n{log_tail('worker')}")
            time.sleep(0.2)
        _by_value()
        yield address
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if auth is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = auth
        for p in reversed(nodes):
            with __import__("contextlib").suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in reversed(nodes):
            try:
                p.wait(timeout=3)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for f in logs.values():
            f.close()
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_grid_on_a_two_node_loopback_cluster_places_cells_on_both_nodes(loopback_cluster, tmp_path):
    second = {n["NodeID"] for n in ray.nodes() if n["Alive"] and "second_node" in n["Resources"]}
    head = {n["NodeID"] for n in ray.nodes() if n["Alive"]} - second
    cells = grid([0], x=list(range(6)), sleep=[0.3])
    recs = run_grid(square, cells, results=tmp_path / "r.jsonl", address=loopback_cluster, progress=False)
    assert all(r["status"] == "ok" for r in recs)
    nodes = {r["node"] for r in recs}
    assert nodes == head | second and len(nodes) == 2, (nodes, head, second)
    assert ray.is_initialized()  # a connection the runner found stays for its owner


def test_a_killed_worker_is_retried_once_then_its_cell_fails_with_the_error(loopback_cluster, tmp_path):
    cells = [Cell({"marker": str(tmp_path / "once")}, name="dies-once"),
             Cell({"marker": str(tmp_path / "always"), "always": True}, name="dies-always")]
    recs = run_grid(die_once, cells, results=tmp_path / "r.jsonl", address=loopback_cluster, retries=1,
                    progress=False)
    assert recs[0]["status"] == "ok" and recs[0]["result"] == {"survived": True}
    assert recs[1]["status"] == "failed" and "WorkerCrashedError" in recs[1]["error"], recs[1]
    assert json.loads((tmp_path / "r.jsonl").read_text().splitlines()[-1])["status"] in ("ok", "failed")


def awkward(config: dict, seed: int):
    kind = config["kind"]
    if kind == "object":
        return {"model": object()}
    if kind == "int_keys":
        return {1: 0.5, 2: 0.7}
    if kind == "exit":
        sys.exit(4)
    return {"ok": True}


def test_a_result_json_cannot_hold_or_a_sys_exit_fails_its_cell_and_the_grid_goes_on(tmp_path):
    out = tmp_path / "r.jsonl"
    cells = grid([0], kind=["ok", "object", "int_keys", "exit", "ok2"])
    recs = run_grid(awkward, cells, results=out, backend="inprocess", progress=False)
    assert [r["status"] for r in recs] == ["ok", "failed", "ok", "failed", "ok"]
    assert "result['model'] is a builtins.object, which JSON cannot store" in recs[1]["error"]
    assert "the cell called sys.exit(4)" in recs[3]["error"]
    # JSON's keys are strings: the same on the first run as from the file on a rerun
    assert recs[2]["result"] == {"1": 0.5, "2": 0.7} == read_results(out)[cells[2].key]["result"]
    assert len(out.read_text().splitlines()) == 5


def test_cell_configs_are_json_values_and_numpy_values_give_the_stored_configs_key():
    import hashlib

    import numpy as np

    with pytest.raises(TypeError, match=r"config\['a'\] is a builtins.object"):
        Cell({"a": object()})
    with pytest.raises(TypeError, match="grid axis a='ab' is a str, not a list of values"):
        grid([0], a="ab")
    a, b = grid(np.arange(2), n=np.arange(10, 12)), grid([0, 1], n=[10, 11])
    assert [c.key for c in a] == [c.key for c in b]
    # the key is what the stored record's config and seed give again (docs/grid.md's formula)
    c = a[3]
    text = json.dumps({"config": {"n": 11}, "seed": 1}, sort_keys=True, default=str)
    assert c.key == hashlib.sha256(text.encode()).hexdigest()[:16]
    # the seed varies fastest, then the last axis; the first axis slowest
    assert [(c.config["p"], c.config["q"], c.seed) for c in grid([0, 1], p=[1, 2], q=["x", "y"])][:4] == [
        (1, "x", 0), (1, "x", 1), (1, "y", 0), (1, "y", 1)]


def test_two_scripts_cell_functions_of_one_name_do_not_share_a_results_file(tmp_path):
    out = tmp_path / "shared.jsonl"
    for script, value in (("train_a.py", "A"), ("train_b.py", "B")):
        (tmp_path / script).write_text(textwrap.dedent(f"""
            from closedloop.sdk.grid import grid, run_grid
            def fit(config, seed):
                return {{"script": {value!r}}}
            print(run_grid(fit, grid([0], x=[1]), results={str(out)!r}, backend="inprocess", progress=False))
            """))
    a = subprocess.run([sys.executable, str(tmp_path / "train_a.py")], capture_output=True, text=True, timeout=60)
    assert a.returncode == 0 and "'script': 'A'" in a.stdout
    b = subprocess.run([sys.executable, str(tmp_path / "train_b.py")], capture_output=True, text=True, timeout=60)
    assert b.returncode != 0 and "holds cells of train_a.py:fit; this grid runs train_b.py:fit" in b.stderr
    with pytest.raises(ValueError, match="a lambda has no name"):
        run_grid(lambda c, s: 1, grid([0], x=[1]), results=tmp_path / "l.jsonl", backend="inprocess", progress=False)


def test_a_second_driver_on_a_results_file_in_use_is_refused(tmp_path):
    import threading

    out = tmp_path / "r.jsonl"
    first = threading.Thread(target=run_grid, args=(square, grid([0], x=[1], sleep=[1.5])),
                             kwargs={"results": out, "backend": "inprocess", "progress": False})
    first.start()
    time.sleep(0.5)
    try:
        with pytest.raises(RuntimeError, match="is being written by another run of this grid"):
            run_grid(square, grid([0], x=[2]), results=out, backend="inprocess", progress=False)
    finally:
        first.join()
    assert run_grid(square, grid([0], x=[2]), results=out, backend="inprocess", progress=False)[0]["status"] == "ok"


def test_sigterm_ends_an_in_process_driver_with_143_and_a_rerun_resumes(tmp_path):
    out = tmp_path / "r.jsonl"
    driver = textwrap.dedent(f"""
        import time
        from closedloop.sdk.grid import grid, run_grid
        def slow(config, seed):
            time.sleep(0.3)
            return config["x"]
        try:
            run_grid(slow, grid([0], x=list(range(20))), results={str(out)!r}, backend="inprocess", progress=False)
        except BaseException as exc:
            print("left through", type(exc).__name__, flush=True)
            raise
        """)
    p = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (not out.exists() or len(out.read_text().splitlines()) < 2):
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    stdout, _ = p.communicate(timeout=30)
    assert p.returncode == 143 and "left through Terminated" in stdout
    assert 2 <= len(read_results(out)) < 20
