"""What the process's C allocator does with freed memory: kept for reuse while training on a CPU, handed back before
a CPU memory measurement."""

import ctypes

import torch

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_MAX = -4
TRIM_ABOVE_2_GIB = 2**31 - 1  # the largest trim threshold mallopt takes


def _glibc():
    """The C library when it is glibc (it has `mallopt` and `malloc_trim`), else None."""
    try:
        libc = ctypes.CDLL(None)
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except (OSError, TypeError):  # Windows: no handle for the main program
        return None


def keep_freed_memory_on_cpu() -> bool:
    """Where the process trains on a CPU (no CUDA device) under glibc: allocate large blocks from the heap instead
    of mapping each one, and hand freed heap memory back to the system only above 2 GiB.

    A CPU training step allocates and frees the same large tensors (activations, logits, gradients) every step. By
    default glibc maps each one above its mmap threshold afresh and unmaps it when it is freed, so every step faults
    its working set back in, page by page, zeroed by the kernel: 70,000-79,000 page faults and 8 % of a quickstart
    target step on this project's CPU (docs/results.md, 2026-12-02). Afterwards the process's resident memory stays
    near its peak. Returns whether it applied (False, with nothing changed, on CUDA machines and other C libraries)."""
    libc = _glibc()
    if libc is None or torch.cuda.is_available():
        return False
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_ABOVE_2_GIB))


def release_freed_memory() -> bool:
    """Hand the heap's free pages back to the system (glibc `malloc_trim(0)`), so that the resident set is the
    memory in use; returns whether anything was released (False off glibc)."""
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False
