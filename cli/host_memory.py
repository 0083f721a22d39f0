"""Freed CPU memory kept for reuse by the process's C allocator, for the commands that train on a CPU."""

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_MAX = -4
NEVER_TRIM = 2**31 - 1


def keep_freed_memory() -> bool:
    """Make glibc's malloc serve every allocation from its heap and keep freed heap memory for reuse.

    A CPU training step allocates and frees the same large tensors (activations, logits, gradients) every step. By
    default glibc maps each one above its mmap threshold afresh and unmaps it when it is freed, so every step faults
    its whole working set back in, page by page, zeroed by the kernel: ~75,000 page faults and 8-12 % of a quickstart
    target step on this project's CPU (docs/results.md). Afterwards the process's resident memory stays at its peak.
    Returns whether it applied: False, with nothing changed, where the C library has no `mallopt` (not glibc)."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))
