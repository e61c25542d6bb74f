"""The ``closedloop`` command line: one subcommand per stage.

Subcommands register themselves with ``@command`` (name, help, argument setup), so
adding one is a function here or in a family's module, never an if/elif chain.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import numpy as np

_COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {}


def command(name: str, help: str, setup: Callable[[argparse.ArgumentParser], None] = lambda p: None):
    def deco(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        _COMMANDS[name] = (help, setup, fn)
        return fn

    return deco


def _inspect_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("bundle", help="bundle folder or zip")
    p.add_argument("--json", action="store_true", help="print the manifest and problems as JSON")


@command("inspect", "print a bundle's manifest and verify it", _inspect_args)
def _inspect(a: argparse.Namespace) -> int:
    from .inspect_bundle import inspect_bundle

    text, ok = inspect_bundle(a.bundle, as_json=a.json)
    print(text)
    return 0 if ok else 1


def _backends_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("bundle", nargs="?", help="also check which backends can run this bundle's main graph")


@command("backends", "list backends and whether each can run here", _backends_args)
def _backends(a: argparse.Namespace) -> int:
    from runtime import backend_report, load_bundle

    path = spec = None
    if a.bundle:
        b = load_bundle(a.bundle)
        path, spec = b.graph_path(), b.graph()
    for name, av in backend_report(path, spec).items():
        print(f"{name:<22} {'available' if av else 'unavailable':<12} {av.reason}")
    return 0


def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("bundle")
    p.add_argument("--backend", default="auto", help="backend name or 'auto' (fastest measured here)")
    p.add_argument("--variant", default=None, help="graph variant: fp32 (default), fp16, int8")
    p.add_argument("--duration", type=float, default=5.0, help="seconds to run")
    p.add_argument("--rate", type=float, default=None, help="loop rate in Hz (default: the bundle's)")
    p.add_argument("--overrun", choices=["skip", "hold", "stop"], default="skip")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


@command("run", "run a bundle in the real-time loop (synthetic input frames)", _run_args)
def _run(a: argparse.Namespace) -> int:
    from runtime import LoopConfig, Model, RealTimeLoop, get_family, load_bundle

    bundle = load_bundle(a.bundle)
    model = Model(bundle, backend=a.backend, variant=a.variant)
    fam = get_family(bundle.manifest.family)(bundle, model)
    rng = np.random.default_rng(a.seed)
    n_in = model.spec.data_inputs[0].concrete_shape(1)
    frames = rng.standard_normal((256, *n_in)).astype(np.float32)
    rate = a.rate or bundle.manifest.rate_hz
    choice = model.choice
    if choice.p99_us:
        print("backend auto-selection (p99 us): " + ", ".join(f"{k} {v:.1f}" for k, v in choice.p99_us.items()))
    for k, why in choice.skipped.items():
        print(f"  skipped {k}: {why}")
    print(f"running {bundle.manifest.name or a.bundle} on {model.backend_name} at {rate:g} Hz for {a.duration:g} s (Ctrl-C stops)")

    def step(k: int) -> None:
        fam.preprocess(frames[k & 255])
        model.run()
        fam.postprocess()

    summary = RealTimeLoop(LoopConfig(rate_hz=rate, duration_s=a.duration, overrun=a.overrun)).run(step)
    print(json.dumps(summary.to_dict(), indent=2) if a.json else summary.format())
    return 0


def _bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="a few seconds per part instead of the full run")
    p.add_argument("--out", default="bench/results", help="folder for spine.json and spine_latency.png")


@command("bench", "benchmark GRU and MLP steps on every backend, and the loop at 1 kHz and 50 Hz", _bench_args)
def _bench(a: argparse.Namespace) -> int:
    from .benchmark import SpineBenchConfig, run_spine_benchmark

    cfg = SpineBenchConfig.quick() if a.quick else SpineBenchConfig()
    cfg.out_dir = a.out
    run_spine_benchmark(cfg)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="closedloop", description="closed-loop deployment of neural models")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_, setup, fn) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        setup(p)
        p.set_defaults(func=fn)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, RuntimeError, OSError) as exc:
        # Typed errors carry a message that says what was wrong and what to do.
        print(f"closedloop {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
