"""``bench/bench_bci.py --data FOLDER``: the benchmark on a user's FALCON H2-layout folder instead of the generator.

A tiny toy recording is written in that layout; the split comes from the file names, and a folder without
FALCON files is refused before anything is trained.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from closedloop.sdk.bci.benchmark import BciBenchConfig, load_data_folder, run_bci_benchmark
from closedloop.sdk.bci.toy import toy_recording

pytest.importorskip("pynwb")
from closedloop.sdk.bci.nwb import write_falcon_h2_dir  # noqa: E402

DATES = ("2022-05-18", "2022-06-22", "2023-02-28", "2023-04-17", "2023-10-09")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    ss = toy_recording(n_channels=8, n_held_in=3, n_held_out=2, n_trials=8, seed=2)
    for s, d in zip(ss, DATES, strict=True):
        s.name, s.meta["date"] = d.replace("-", "."), d
        for t in s.trials:
            t.spikes = t.spikes.astype(np.uint8)
    path = tmp_path_factory.mktemp("falcon") / "data"
    write_falcon_h2_dir(ss, path)
    return path, ss


def test_the_benchmark_runs_its_methods_on_a_falcon_folder_split_by_file_names(folder, tmp_path):
    path, ss = folder
    sessions = load_data_folder(path)
    assert [(s.name, s.split) for s in sessions] == [(s.name, s.split) for s in ss]
    cfg = BciBenchConfig.tiny()
    cfg = dataclasses.replace(cfg, data_dir=str(path), seeds=(0,), jobs=1, out_dir=str(tmp_path), stem="t",
                              harness=dataclasses.replace(cfg.harness, methods=("zero_shot", "session_layers"),
                                                          train=dataclasses.replace(cfg.harness.train, steps=10),
                                                          device="cpu"))
    run_bci_benchmark(cfg, report=lambda s: None)
    result = json.loads(next(tmp_path.glob("t*.json")).read_text())
    text = json.dumps(result)
    assert '"folder": "' + str(path) in text  # the data named as the user's folder, not a generator config
    held_out = [s.name for s in ss if s.split == "held_out"]
    run = result["runs"][0] if "runs" in result else result
    assert sorted(run["methods"]) == ["session_layers", "zero_shot"]
    assert sorted(run["sessions"]) == sorted(held_out)  # scored: the held-out files' sessions only
    for m in run["methods"].values():
        assert 0.0 <= m["mean"]["greedy"]["CER"] <= 2.0


def test_a_folder_without_falcon_files_is_refused_saying_what_it_needs(folder, tmp_path):
    (tmp_path / "notes.txt").write_text("no recordings here")
    with pytest.raises(ValueError, match="no FALCON H2 files"):
        load_data_folder(tmp_path)
    only_in = tmp_path / "only_in"
    only_in.mkdir()
    for f in sorted(folder[0].rglob("*held-in*.nwb")):
        (only_in / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ValueError, match=r"3 held-in and 0 held-out sessions.*file names"):
        load_data_folder(only_in)
    with pytest.raises(ValueError, match="not a folder"):
        load_data_folder(tmp_path / "notes.txt")
