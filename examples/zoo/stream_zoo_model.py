"""Export a zoo model, then stream it live from its emulated device for a few seconds.

    python examples/zoo/stream_zoo_model.py transformer            # full size, 3 s from sim://headstage
    python examples/zoo/stream_zoo_model.py goal_policy --size tiny
    python examples/zoo/stream_zoo_model.py all --seconds 2        # every model in turn

The neural decoders (lstm, gru, tcn, cnn, transformer) stream spike-count frames from
``sim://headstage`` and send decoder outputs back; the windowed ones fill their window from
single frames and run every ``hop`` frames. The policies (goal_policy, mlp) stream plant
measurements from ``sim://plant`` and send actuator commands; the goal policy's goal is held
from the session's config. Prints the export's report and the session summary.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from closedloop.sdk.zoo import ZOO, make_bundle, run_zoo_session


def stream(name: str, size: str, seconds: float, out: Path, backend: str) -> None:
    entry = ZOO[name]
    print(f"== {entry.describe(size)} ({entry.summary})")
    bundle = make_bundle(name, size, out / f"{name}-{size}", report=lambda line: print("  export: " + line))
    summary = run_zoo_session(name, size, bundle, seconds=seconds, backend=backend, status=False)
    print(summary.format())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", choices=[*sorted(ZOO), "all"], help="which zoo model (or all)")
    ap.add_argument("--size", choices=("tiny", "full"), default="full")
    ap.add_argument("--seconds", type=float, default=3.0, help="length of the live session (default 3)")
    ap.add_argument("--out", type=Path, default=Path("out/zoo"), help="where bundles are written (default out/zoo)")
    ap.add_argument("--backend", default="auto", help="runtime backend (default auto: the fastest here)")
    a = ap.parse_args(argv)
    for name in sorted(ZOO) if a.name == "all" else [a.name]:
        stream(name, a.size, a.seconds, a.out, a.backend)
    return 0


if __name__ == "__main__":
    sys.exit(main())
