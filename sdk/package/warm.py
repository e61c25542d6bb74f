"""Fill the Numba cache for bundles, so a session's first start compiles nothing.

``python -m closedloop.sdk.package.warm [BUNDLE...]`` (install.sh runs it with the service's
``NUMBA_CACHE_DIR``; ``make test`` runs it without bundles before the tests): the plan runner,
which every model's steps go through, is compiled first; then every graph of every bundle, and
each of its variants, is loaded on the Numba backend and run once. The compiled kernels land in
the cache that the service reads.
Numba keys its cache on the installed source files, so warm in the venv the service runs.

The wire protocol's C scanner library (``closedloop.firmware_bridge.c_library``) is built here
too, into ``$CLOSEDLOOP_CACHE_DIR``: a session against a device parses and encodes frames with
it, and one that finds it missing compiles it (about a second) or, with no compiler on the
board, falls back to the slower Python parser.
"""

from __future__ import annotations

import os
import sys
import time


def warm(paths: list[str], report=print, trust: str | None = None) -> int:
    """Load and run each bundle's graphs on Numba; return how many graph variants were compiled. With ``trust`` (a
    key file or folder) each bundle must be signed by one of its keys, as the service will check."""
    from closedloop.runtime import Model, load_bundle
    from closedloop.runtime.errors import BackendUnavailableError

    done = 0
    for path in paths:
        bundle = load_bundle(path, trust=[trust] if trust else None)  # a bundle that does not verify: ValueError
        t0 = time.perf_counter()
        for graph, spec in bundle.manifest.graphs.items():
            for variant in [None, *spec.variants]:
                try:
                    model = Model(bundle, backend="numba", graph=graph, variant=variant)
                except BackendUnavailableError as exc:  # a graph Numba cannot run: the session uses another backend
                    report(f"  {path} graph {graph} {variant or 'fp32'}: not on Numba ({exc})")
                    continue
                model.prewarm()
                model.close()
                done += 1
        # and a short session on synthetic frames: what a session compiles beyond the graph's kernels
        import contextlib
        import io

        from closedloop.sdk.cli import main as cli_main

        with contextlib.redirect_stdout(io.StringIO()):  # its summary is not the install's to print
            rc = cli_main(["run", str(path), "--backend", "numba", "--duration", "0.3", "--quiet", "--json",
                           *(["--trust", trust] if trust else [])])
        if rc != 0:
            report(f"  {path}: the warm-up session did not end cleanly; the first real session may compile")
        report(f"warmed {path} on Numba in {time.perf_counter() - t0:.1f} s")
    return done


def build_scanner(report=print) -> bool:
    """Build (or find) the C scanner library in the cache a session reads; say where, or why not."""
    from closedloop.firmware_bridge.c_library import CParserUnavailableError, library_path, load_scanner

    try:
        found = load_scanner()
    except CParserUnavailableError as exc:
        report(f"C scanner library: not available ({exc}); sessions use the Python frame parser")
        return False
    report(f"C scanner library: {'built' if found.built_now else 'found'} {found.path} (cache {library_path().parent})")
    return True


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    trust = None
    if argv[:1] == ["--trust"] and len(argv) > 1:
        trust, argv = argv[1], argv[2:]
    if any(a.startswith("-") for a in argv):
        print("usage: python -m closedloop.sdk.package.warm [--trust KEYS] [BUNDLE...]", file=sys.stderr)
        return 2
    from closedloop.runtime import load_bundle

    for path in argv:  # every bundle verifies (checksums, and with --trust a trusted signature), Numba or not
        try:
            load_bundle(path, trust=[trust] if trust else None)
        except ValueError as exc:
            print(f"warm: {exc}", file=sys.stderr)
            return 2
    build_scanner()
    try:
        import numba  # noqa: F401
    except ImportError:
        print("Numba is not installed (an --ort-only install): nothing to warm", file=sys.stderr)
        return 0
    from closedloop.runtime.backends._numba_plan import compile_plan_runner

    print(f"Numba cache: {os.environ.get('NUMBA_CACHE_DIR') or '(NUMBA_CACHE_DIR unset: beside the sources)'}")
    seconds = compile_plan_runner()
    print(f"plan runner ready in {seconds:.1f} s (compiled, or loaded from the cache)")
    try:
        warm(argv, trust=trust)
    except ValueError as exc:  # a bundle that does not verify (checksums, signature) or cannot load
        print(f"warm: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
