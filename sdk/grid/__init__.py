"""Grids of independent cells on Ray, a cluster, or in-process (docs/grid.md), and ``closedloop validate``."""

from .runner import (
    Cell,
    Done,
    GridRunner,
    append_record,
    grid,
    ray_available,
    read_results,
    resolve_backend,
    run_grid,
)

__all__ = ["Cell", "Done", "GridRunner", "append_record", "grid", "ray_available", "read_results", "resolve_backend",
           "run_grid"]
