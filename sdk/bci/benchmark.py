"""The iBCI handwriting benchmark: synthetic FALCON H2-like data, every method, several seeds.

``run_bci_benchmark(BciBenchConfig())`` generates the default synthetic recording
(fixed data seed), runs :func:`closedloop.sdk.bci.evaluate.run_harness`'s work for every model seed
(split into training and scoring tasks shared out over worker processes, one thread each:
:func:`run_seeds`), aggregates the seeds and
writes ``bci.json``, ``bci.md`` and ``bci_wer_vs_days.png``. Before it starts it
measures this machine's GRU throughput and prints the estimated run time.
``BciBenchConfig.tiny()`` is the one-minute version.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import pickle
import platform
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from closedloop.common.atomic import atomic_write_bytes
from closedloop.common.config import JsonConfig
from closedloop.sdk.grid import append_record, read_results

from . import fastctc
from .augment import DriftAugmentation
from .baselines import TrainedModels, get_method
from .calibrate import CalibrationConfig
from .data import collate, ctc_loss, resolve_device
from .evaluate import HarnessConfig, build_lexicon, harness_needs, resolve_needs, run_harness, train_models
from .malloc import retain_freed_memory
from .meta import MetaConfig
from .models import GRUBackbone
from .report import markdown_table, summarize, write_results
from .train import BackboneConfig, TrainConfig, held_in_examples

# the stage-1 default (noise, offsets, gains, a wandering offset) plus unit turnover: dead and new units
TURNOVER_AUGMENTATION = replace(TrainConfig().augmentation, dropout_p=0.1, fresh_p=0.1)


@dataclass
class BciBenchConfig(JsonConfig):
    """Data, harness and seeds of the benchmark: sized for 2 CPU cores in under 45 minutes (docs/bci_methods.md)."""

    data_seed: int = 0
    data_tiny: bool = False
    seeds: tuple[int, ...] = (0, 1, 2)
    jobs: int = 0  # parallel worker processes (one thread each) sharing the seeds' tasks; 0: one per core
    harness: HarnessConfig = field(default_factory=lambda: HarnessConfig(
        # stage 1 (the pooled backbone every calibrated method shares): the drift augmentation also silences
        # channels (10%) and gives channels a new unit (10%), the two ways unit turnover changes a Utah array
        # from day to day, at lr 3e-3 (docs/bci_methods.md, "Stage-1 turnover augmentation")
        train=TrainConfig(backbone=BackboneConfig(128, 1, 0.1), steps=800, batch_size=16, lr=3e-3,
                          augmentation=TURNOVER_AUGMENTATION),
        # the session_layers baseline trains with the same recipe (session_train unset): the turnover augmentation
        # helps it too, and a baseline gets the same effort as the method (docs/bci_methods.md). The drift reference
        # (the same kind of decoder, the yardstick the generator was calibrated with) keeps its calibration recipe:
        # 800 steps at lr 5e-3 without turnover, the first epoch shortest first (TrainConfig default); at 600
        # steps and lr 1e-2 its held-in CER over seeds 0-2 is 19.0 +- 8.9% (runs that do not converge); see
        # bench/results/bci_drift/ and docs/handwriting_data.md. The benchmark does not train it (reference=False:
        # 11 more minutes per run); bench/calibrate_bci_drift.py measures and records it, and bench_bci.py
        # --reference adds it to a run
        reference_train=TrainConfig(backbone=BackboneConfig(128, 1, 0.1), steps=800, batch_size=16, lr=5e-3),
        reference=False,
        meta=MetaConfig(inner_steps=3, n_support=3, n_query=3, tasks_per_step=4, meta_steps=60),
        # 40 / 18 steps: with 20 / 9, cross-validation chose the largest step count in most alignment and two-stage fits
        calibration=CalibrationConfig(steps=40, eval_every=8, folds=3, meta_max_steps=18),
        beam_width=16, progress=False,
    ))
    out_dir: str = "bench/results/bci"
    stem: str = "bci"
    ablate: str = ""  # a drift component switched off in the data (docs/handwriting_data.md), or "all"
    data_dir: str = ""  # a folder of FALCON H2-layout NWB files to run on instead of the generator (bench_bci.py --data)
    # each finished task (trained models, a scoring result) is kept under out_dir/cells/<stem>/ as it ends, so a rerun
    # of the same configuration on the same data continues where a killed run stopped; False starts afresh
    resume: bool = True

    @classmethod
    def tiny(cls) -> BciBenchConfig:
        """About a minute on 2 cores: 16 channels, 3 + 2 sessions, small models, few steps."""
        return cls(data_tiny=True, stem="bci_tiny", harness=HarnessConfig(
            train=TrainConfig(backbone=BackboneConfig(32, 1, 0.0), steps=60, batch_size=8, lr=1e-2,
                              augmentation=DriftAugmentation(noise_std=0.2, offset_std=0.1, gain_std=0.1)),
            meta=MetaConfig(inner_steps=2, n_query=2, tasks_per_step=2, meta_steps=15),
            calibration=CalibrationConfig(steps=8, eval_every=2, folds=3),
            beam_width=8, progress=False,
        ))


def load_data_folder(folder: str | os.PathLike) -> list:
    """A user's FALCON H2-layout folder as the benchmark's sessions, held-in / held-out from the file names.

    Raises ``ValueError`` naming what is missing: no NWB files, no held-in or held-out session, or
    held-out sessions without evaluation trials (FALCON's own held-out evaluation data stay on its server).
    """
    from .nwb import load_falcon_h2_dir

    path = os.fspath(folder)
    if not os.path.isdir(path):
        raise ValueError(f"--data {path}: not a folder; give the folder holding the FALCON H2-layout NWB files")
    try:
        sessions = load_falcon_h2_dir(path)
    except FileNotFoundError as exc:
        raise ValueError(f"--data {path}: no FALCON H2 files: {exc}") from exc
    held_in = [s.name for s in sessions if s.split == "held_in"]
    held_out = [s for s in sessions if s.split == "held_out"]
    if not held_in or not held_out:
        raise ValueError(f"--data {path}: {len(held_in)} held-in and {len(held_out)} held-out sessions; the benchmark "
                         "trains on held-in sessions and scores held-out ones, told apart by the file names "
                         "('held-in' / 'held-out', as DANDI 000950 and `closedloop generate-data` name them)")
    if not any(s.evaluation for s in held_out):
        raise ValueError(f"--data {path}: no held-out session has evaluation trials (files named '-minival' or "
                         "'_eval'); FALCON's own held-out evaluation data stay on its server: score those with "
                         "sdk.bci.falcon_decoder")
    return sessions


def generate_data(config: BciBenchConfig) -> list:
    from closedloop.sim.handwriting import HandwritingConfig, generate_recording

    if config.data_dir:  # a user's recordings: no generator (and nothing to ablate)
        if config.ablate:
            raise ValueError(f"--ablate {config.ablate} switches off a component of the generator; --data "
                             f"{config.data_dir} is recorded data")
        return load_data_folder(config.data_dir), None

    hw = HandwritingConfig.tiny(config.data_seed) if config.data_tiny else HandwritingConfig(seed=config.data_seed)
    if config.ablate:
        hw = hw.ablate(config.ablate)
    return generate_recording(hw), hw


def measure_bins_per_s(sessions: list, config: HarnessConfig, reps: int = 2) -> float:
    """Training throughput (bins per second, forward + backward) of the configured backbone on this machine."""
    torch.set_num_threads(1)
    device = resolve_device(config.device)
    ex = held_in_examples(sessions)[: config.train.batch_size]
    bc = config.train.backbone
    bb = GRUBackbone(ex[0].x.shape[1], bc.n_hidden, bc.n_layers).to(device)
    batch = collate(ex, device)

    def sync() -> None:  # CUDA runs asynchronously: time finished work only
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    ctc_loss(bb(batch.x)[0], batch).backward()  # warm-up: allocator, kernels, cuDNN plans
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        ctc_loss(bb(batch.x)[0], batch).backward()
    sync()
    return reps * float(batch.x_lens.sum()) / (time.perf_counter() - t0)


def estimate_seconds(sessions: list, config: BciBenchConfig, bins_per_s: float) -> dict:
    """Bins pushed through the GRU (forward + backward) by each part, over this machine's throughput."""
    h = config.harness
    mean_bins = float(np.mean([t.n_bins for s in sessions for t in s.trials]))
    held_out = [s for s in sessions if s.split == "held_out"]
    n_eval = sum(len(s.evaluation) for s in held_out)
    n_eval_all = sum(len(s.evaluation) for s in sessions)
    m, c, n = h.meta, h.calibration, h.n_calibration
    folds = min(c.folds, n)
    per_step = (folds * 3 * (n - 1) + n) * mean_bins  # leave-one-out fits on every grid value + the final fit
    # fine-tuning fits its cross-validation copies as one batch (baselines.finetune_batch): per seed 390 s on the
    # 2-core AMD VM, against 1,210 s for one fit after another (docs/bci_methods.md, "Nine runs")
    adam_methods = sum(x in h.methods for x in ("session_layers", "alignment")) + 0.35 * ("finetune" in h.methods)
    st, rt = h.session_recipe(), h.reference_recipe()
    needs = harness_needs(h)
    session_steps = st.steps * st.batch_size if "session_layers" in needs else 0
    reference_steps = rt.steps * rt.batch_size if "reference" in needs else 0
    parts = {
        "stage 1 + session layers": (h.train.steps * h.train.batch_size + session_steps + reference_steps) * mean_bins,
        "meta-learning": m.meta_steps * m.tasks_per_step * (m.inner_steps * m.n_support + m.n_query) * mean_bins
        * (3 if m.second_order else 1),
        "calibration": len(held_out) * per_step * (adam_methods * c.steps + (c.meta_max_steps or 2 * m.inner_steps)),
        "decoding": (len(h.methods) * n_eval + n_eval_all) * mean_bins / 3,
    }
    per_seed = {k: v / bins_per_s for k, v in parts.items()}
    per_seed["calibration"] *= 1.3  # validation passes, model copies and small batches, as measured on 2 cores
    per_seed["beam search"] = 0.06 * (len(h.methods) * n_eval + n_eval_all) if h.beam_width else 0.0
    cores = os.cpu_count() or 1
    n_tasks = len(config.seeds) * len(plan_seed(h).train)  # training tasks that can run side by side
    jobs = min(config.jobs or cores, n_tasks)
    # the seeds' tasks shared out over the workers, each slowed down when more workers than cores share the machine
    factor = len(config.seeds) / min(jobs, cores)
    return {"per_seed_s": per_seed, "total_s": factor * sum(per_seed.values()), "jobs": jobs,
            "cores": cores, "bins_per_s": bins_per_s}


#: which training task trains each thing a method needs (meta-learning needs the stage-1 backbone first)
_TRAINED_BY = {"backbone": "backbone", "meta": "backbone", "session_layers": "session_layers", "reference": "reference"}
#: the order training tasks start in: the longest chain (stage 1, meta-learning, four methods' calibration) first
_TRAIN_ORDER = ("backbone", "session_layers", "reference")


@dataclass(frozen=True)
class SeedPlan:
    """One seed's work as separate tasks, so that parallel workers can share it out.

    ``train`` maps a training task to what it trains (:func:`closedloop.sdk.bci.evaluate.train_models`'s
    needs); ``score`` lists scoring tasks: the training tasks whose models they need, the
    methods they calibrate and score, and whether they also score the drift reference.
    """

    train: dict[str, frozenset[str]]
    score: tuple[tuple[tuple[str, ...], tuple[str, ...], bool], ...]


def plan_seed(config: HarnessConfig) -> SeedPlan:
    """Split one seed's :func:`~closedloop.sdk.bci.evaluate.run_harness` into training tasks and scoring tasks.

    Each training function seeds itself and calibration draws no random numbers, so the
    tasks give the same results as one ``run_harness`` call (``tests/sdk/test_bci_harness.py``).
    """
    train: dict[str, set[str]] = {}
    for need in harness_needs(config):
        train.setdefault(_TRAINED_BY[need], set()).add(need)
    groups: dict[tuple[str, ...], list[str]] = {}
    for m in config.methods:
        keys = tuple(sorted({_TRAINED_BY[n] for n in resolve_needs(set(get_method(m).needs), config)}))
        groups.setdefault(keys, []).append(m)
    ref_keys = tuple(sorted({_TRAINED_BY[n] for n in resolve_needs({"reference"}, config)})) if config.reference else None
    if ref_keys is not None:
        groups.setdefault(ref_keys, [])
    order = sorted(train, key=_TRAIN_ORDER.index)
    return SeedPlan({k: frozenset(train[k]) for k in order},
                    tuple((keys, tuple(ms), keys == ref_keys) for keys, ms in groups.items()))


@functools.lru_cache(maxsize=1)  # per worker process: the recording and lexicon, read once
def _load(data_path: str) -> tuple:
    with open(data_path, "rb") as f:
        sessions, words = pickle.load(f)
    return sessions, build_lexicon(sessions, words)


def _seed_config(harness_dict: dict, seed: int, **changes) -> HarnessConfig:
    return replace(HarnessConfig.from_dict(harness_dict), seed=seed, **changes)


def _train_task(data_path: str, harness_dict: dict, seed: int, key: str, needs: frozenset[str]) -> dict:
    """Training task ``key``: train ``needs`` for one seed; the models go back to the driver for the scoring tasks."""
    torch.set_num_threads(1)
    retain_freed_memory()
    sessions, _ = _load(data_path)
    cfg = _seed_config(harness_dict, seed).seeded()
    fastctc.counts.update(batches=0, fallback_batches=0)
    t0 = time.perf_counter()
    torch.manual_seed(cfg.seed)  # as run_harness does before training
    models = train_models(sessions, cfg, set(needs))
    return {"key": key, "models": models, "fast_ctc": dict(fastctc.counts), "wall_s": time.perf_counter() - t0}


def _score_task(data_path: str, harness_dict: dict, seed: int, methods: tuple[str, ...], reference: bool,
                models: TrainedModels) -> dict:
    """Calibrate and score ``methods`` (and the drift reference) for one seed with already trained models."""
    torch.set_num_threads(1)
    retain_freed_memory()
    sessions, lexicon = _load(data_path)
    fastctc.counts.update(batches=0, fallback_batches=0)
    run = run_harness(sessions, _seed_config(harness_dict, seed, methods=methods, reference=reference),
                      lexicon=lexicon, models=models)
    run["fast_ctc"] = dict(fastctc.counts)
    return run


def merge_models(parts: Sequence[TrainedModels]) -> TrainedModels:
    """One :class:`TrainedModels` holding what each of ``parts`` trained."""
    out = TrainedModels()
    for p in parts:
        for f in ("backbone", "meta", "session_model", "reference_model"):
            if getattr(p, f) is not None:
                setattr(out, f, getattr(p, f))
        out.held_in_days |= p.held_in_days
        out.logs |= p.logs
    return out


def merge_seed(config: HarnessConfig, trained: Sequence[dict], scored: Sequence[dict]) -> dict:
    """One seed's ``run_harness`` result from its tasks' results.

    ``wall_s`` is the seed's compute time: every task's seconds added up (they may have run
    at different times, on different workers). ``fast_ctc`` adds up the tasks' CTC counts.
    """
    run = dict(scored[0])
    by_method = {m: v for part in scored for m, v in part["methods"].items()}
    run["methods"] = {m: by_method[m] for m in config.methods}
    for key in ("train_s", "logs"):
        run[key] = {k: v for part in scored for k, v in part[key].items()}
    run["training_warnings"] = list(dict.fromkeys(w for part in scored for w in part["training_warnings"]))
    for key in ("meta", "reference"):
        for part in scored:
            if key in part:
                run[key] = part[key]
    run["config"] = config.seeded().to_dict()
    run["wall_s"] = sum(t["wall_s"] for t in trained) + sum(part["wall_s"] for part in scored)
    run["fast_ctc"] = {k: sum(p["fast_ctc"][k] for p in [*trained, *scored]) for k in ("batches", "fallback_batches")}
    return run


class TaskStore:
    """Finished tasks of :func:`run_seeds` kept on disk, so a rerun skips them (``bench_bci.py`` resumes).

    Each task's result (a training task's models, a scoring task's run) is written atomically to
    ``<folder>/<key>.pt`` (``torch.save``), then one line is appended to ``<folder>/cells.jsonl``
    (``{"key", "kind", "seed", "task", "file", "wall_s", "status": "ok"}``, the grid runner's
    results format). A task's key hashes its kind, seed and what it trains or scores, the harness
    configuration and the data's SHA-256, so a changed configuration or recording never reuses
    a stored result. A task counts as done when its line is there and its file loads.
    """

    def __init__(self, folder: str | os.PathLike, harness: dict, data_sha256: str):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.index = self.folder / "cells.jsonl"
        self._base = {"harness": harness, "data": data_sha256}
        self._records = read_results(self.index)

    def key(self, kind: str, args: tuple) -> str:
        seed = args[0]
        what = {"train": args[1]} if kind == "train" else {"methods": list(args[1]), "reference": bool(args[2])}
        text = json.dumps({**self._base, "kind": kind, "seed": seed, **what}, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:20]

    def load(self, kind: str, args: tuple) -> dict | None:
        """The stored result of this task, or None where it has not finished in an earlier run."""
        key = self.key(kind, args)
        rec = self._records.get(key)
        if rec is None or rec.get("status") != "ok" or not (self.folder / rec["file"]).is_file():
            return None
        try:
            return torch.load(self.folder / rec["file"], map_location="cpu", weights_only=False)
        except Exception:  # noqa: BLE001  (a damaged file: run the task again)
            return None

    def save(self, kind: str, args: tuple, result: dict, task: str) -> None:
        key = self.key(kind, args)
        buf = io.BytesIO()
        torch.save(result, buf)
        atomic_write_bytes(self.folder / f"{key}.pt", buf.getvalue())
        rec = {"key": key, "kind": kind, "seed": args[0], "task": task, "file": f"{key}.pt",
               "wall_s": round(float(result.get("wall_s", 0.0)), 3), "status": "ok"}
        append_record(self.index, rec)
        self._records[key] = rec


def run_seeds(data_path: str, harness: HarnessConfig, seeds: Sequence[int], workers: int,
              report: Callable[[str], None] | None = None, store: TaskStore | None = None,
              progress: bool = False) -> list[dict]:
    """Every seed's result, its training and scoring tasks shared out over ``workers`` processes (one thread each).

    ``report`` gets a line as each task ends (what it did and how long it took). With ``store``
    each task's result is kept as it ends, and tasks stored by an earlier run are not run again.
    ``progress`` draws a tqdm bar of the tasks on stderr, as the grid runner's grids do.

    A task starts as soon as a worker is free and what it needs is trained, longest chain first:
    every seed's stage-1 backbone (then meta-learning), then the session-layer decoders, then
    the scoring tasks. Compared with one process per seed, no core idles while the last seed
    finishes alone, and no more processes run than there are workers.
    """
    plan = plan_seed(harness)
    hd = harness.to_dict()
    ready: list[tuple[tuple, str, tuple]] = []  # (priority, kind, args)
    for i, seed in enumerate(seeds):
        for j, (key, needs) in enumerate(plan.train.items()):
            ready.append(((0, j, i), "train", (seed, key, needs)))
    trained: dict[int, dict[str, dict]] = {s: {} for s in seeds}
    scored: dict[int, list[dict]] = {s: [] for s in seeds}
    waiting = {(s, g): group for s in seeds for g, group in enumerate(plan.score)}

    def release(seed: int) -> None:  # scoring tasks whose models are all trained
        for (s, g), (keys, methods, reference) in list(waiting.items()):
            if s == seed and all(k in trained[s] for k in keys):
                del waiting[(s, g)]
                models = merge_models([trained[s][k]["models"] for k in keys])
                ready.append(((1, g, seeds.index(s)), "score", (s, methods, reference, models)))

    n_tasks = len(seeds) * (len(plan.train) + len(plan.score))
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=n_tasks, desc="iBCI tasks", unit="task", leave=True)

    resumed = 0

    def finish(kind: str, args: tuple, result: dict, stored: bool = False) -> None:
        seed = args[0]
        if kind == "train":
            trained[seed][result["key"]] = result
            what = "trained " + " + ".join(sorted(result["models"].logs))
        else:
            scored[seed].append(result)
            what = "scored " + " + ".join([*args[1], *(["drift reference"] if args[2] else [])])
        if store is not None and not stored:
            store.save(kind, args, result, what)
        if kind == "train":
            release(seed)  # may queue scoring tasks: after the store holds this one
        if bar is not None:
            bar.update(1)
        if report is not None:
            done_tasks = sum(map(len, trained.values())) + sum(map(len, scored.values()))
            how = f"stored by an earlier run ({result['wall_s']:.0f} s then)" if stored else f"in {result['wall_s']:.0f} s"
            report(f"[{done_tasks}/{n_tasks}] seed {seed}: {what} {how}")

    def task(kind: str, args: tuple) -> tuple:
        return (_train_task if kind == "train" else _score_task), (data_path, hd, *args)

    def next_ready() -> tuple[str, tuple] | None:
        """The next task to run; tasks an earlier run stored are finished from the store on the way."""
        nonlocal resumed
        while ready:
            ready.sort(key=lambda r: r[0])
            _, kind, args = ready.pop(0)
            result = store.load(kind, args) if store is not None else None
            if result is None:
                return kind, args
            resumed += 1
            finish(kind, args, result, stored=True)  # may queue the scoring tasks it unblocks
        return None

    try:
        if workers <= 1:
            while (nxt := next_ready()) is not None:
                kind, args = nxt
                fn, task_args = task(kind, args)
                finish(kind, args, fn(*task_args))
        else:
            _run_on_pool(workers, ready, next_ready, task, finish)
    finally:
        if bar is not None:
            bar.close()
    if report is not None and resumed:
        report(f"{resumed} of {n_tasks} tasks were stored by an earlier run and not run again ({store.folder})")
    return [merge_seed(replace(harness, seed=s), list(trained[s].values()), scored[s]) for s in seeds]


def _run_on_pool(workers: int, ready: list, next_ready: Callable, task: Callable, finish: Callable) -> None:
    """Keep ``workers`` workers of the grid runner (sdk.grid: a local Ray instance, or in-process without
    Ray) busy with ``ready`` tasks until none is left or running; a task's error ends the run with it."""
    from closedloop.sdk.grid import GridRunner

    with GridRunner(workers=workers) as runner:  # SIGTERM leaves through its close(): no worker outlives us
        while ready or len(runner):
            while ready and len(runner) < workers:
                nxt = next_ready()
                if nxt is None:  # the rest came from the store
                    break
                kind, args = nxt
                fn, task_args = task(kind, args)
                runner.submit(fn, *task_args, tag=(kind, args))
            if not len(runner):
                continue
            done = runner.next_done()
            if done.error is not None:
                raise done.exception if done.exception is not None else RuntimeError(done.error)
            finish(*done.tag, done.result)  # may add the scoring tasks it unblocks to ``ready``


def _print_now(line: str) -> None:
    print(line, flush=True)  # progress shows up in a log file as it happens


def run_bci_benchmark(config: BciBenchConfig, report: Callable[[str], None] = _print_now) -> dict:
    """Run the benchmark; write results under ``config.out_dir``; return the summary."""
    from closedloop.sim.handwriting import VOCABULARY

    t0 = time.perf_counter()
    words = [] if config.data_dir else list(VOCABULARY)  # a user's folder: the lexicon is its sentences' words
    retain_freed_memory()  # as the workers do (sdk.bci.malloc), so the throughput measured is theirs
    sessions, hw = generate_data(config)
    held_in = [s for s in sessions if s.split == "held_in"]
    report(f"data: {len(held_in)} held-in + {len(sessions) - len(held_in)} held-out sessions, {sessions[0].n_channels} "
           f"channels, {sum(len(s.trials) for s in sessions)} trials, "
           f"{np.mean([t.n_bins for s in sessions for t in s.trials]):.0f} bins per trial "
           f"(generated in {time.perf_counter() - t0:.0f} s)")
    est = estimate_seconds(sessions, config, measure_bins_per_s(sessions, config.harness))
    report(f"estimated time: {est['total_s'] / 60:.1f} min ({est['jobs']} worker process(es) on {est['cores']} cores, "
           f"{est['bins_per_s']:.0f} training bins/s per worker; per seed: "
           + ", ".join(f"{k} {v:.0f} s" for k, v in est["per_seed_s"].items()) + ")")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "data.pkl")
        data = pickle.dumps((sessions, words))
        with open(path, "wb") as f:
            f.write(data)
        store = None
        if config.resume:
            store = TaskStore(Path(config.out_dir) / "cells" / config.stem, config.harness.to_dict(),
                              hashlib.sha256(data).hexdigest())
            report(f"finished tasks are kept in {store.folder} (a rerun continues from them; --fresh ignores them)")
        runs = run_seeds(path, config.harness, list(config.seeds), est["jobs"], report, store, progress=True)
    for run in runs:
        for warning in run.get("training_warnings", []):
            report(f"warning (seed {run['seed']}): {warning}")
    summary = summarize(runs)
    wall = time.perf_counter() - t0
    extra = {"benchmark": {"wall_s": wall, "estimated_s": est["total_s"], "estimate": est,
                           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                       "torch": torch.__version__, "device": runs[0]["device"]},
                           "data_config": json.loads(hw.to_json()) if hw is not None else
                           {"folder": config.data_dir, "sessions": [s.name for s in sessions]},
                           "bench_config": config.to_dict()}}
    paths = write_results(summary, runs, config.out_dir, config.stem, extra)
    report(markdown_table(summary))
    report(f"wall time {wall / 60:.1f} min (estimated {est['total_s'] / 60:.1f}); wrote "
           + ", ".join(str(p) for p in paths.values()))
    return summary
