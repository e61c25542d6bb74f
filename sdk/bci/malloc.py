"""Keep freed memory inside a training process instead of handing it back to the system.

A training step on the benchmark's batches (16 trials x ~1,100 bins x 192 channels) makes and
frees tensors of 10-30 MB: the augmented input, the GRU's input gates, the backward pass's
buffers. glibc's allocator serves blocks that large with ``mmap`` and returns them with ``munmap``
(or trims them off the heap), so the next step's tensors are new pages that the kernel must
fault in and zero again: about 20,000 page faults and 60-70 ms of system time per step on
this project's 2-core VM, a tenth of the step (``getrusage`` over ten stage-1 steps; 1,000 faults
and 2-4 ms with this module's setting). :func:`retain_freed_memory` raises glibc's mmap and
trim thresholds (``mallopt``) so those blocks come from the heap and stay there for reuse.

The cost is that the process keeps its peak heap until it exits, which suits a training or
benchmark worker. Elsewhere (macOS, musl) it does nothing and says so. It changes no result:
the same arithmetic runs on memory that is reused instead of fresh.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
_applied = False


def retain_freed_memory(mmap_threshold: int = 64 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Serve blocks below ``mmap_threshold`` bytes from the heap and keep up to ``trim_threshold`` free bytes there.

    Returns whether the allocator took the setting (glibc only; False elsewhere). Calling it
    again is harmless.
    """
    global _applied
    if _applied:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    _applied = bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))
    return _applied
