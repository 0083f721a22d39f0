"""Observing OpenMP worker pools: a pool's threads are the process's threads (`/proc/self/task`) that a thread's
first parallel CPU kernel starts and that end when the pool is released."""

import os
import time

import pytest
import torch

from modeling_d3d.threads_d3d import CPUWorkerPools

needs_libgomp = pytest.mark.skipif(not CPUWorkerPools().available,
                                   reason="PyTorch's CPU kernels here do not run on a libgomp that can release pools")
RELEASED = 5.0  # seconds: a joined thread may stay listed in /proc/self/task for a moment


def task_ids() -> set[int]:
    """Native ids of this process's threads."""
    return {int(name) for name in os.listdir("/proc/self/task")}


def parallel_kernel() -> None:
    """A CPU kernel large enough to run in parallel (over PyTorch's grain size) on the calling thread."""
    torch.zeros(1 << 22).add_(1)


def pool_of_this_thread() -> set[int]:
    """Run a parallel kernel here and return the pool threads it started (empty if this thread had a pool)."""
    before = task_ids()
    parallel_kernel()
    return task_ids() - before


def gone(ids: set[int], timeout: float = 30.0) -> bool:
    """Whether none of the threads `ids` is alive, waiting up to `timeout` seconds for them to end."""
    deadline = time.monotonic() + timeout
    while ids & task_ids():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
