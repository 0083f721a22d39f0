"""Observing OpenMP worker pools: a pool's threads are the process's threads (`/proc/self/task`) that a thread's
first parallel CPU kernel starts and that end when the pool is released."""

import os
import time

import pytest
import torch

from modeling_d3d.threads_d3d import loaded_libgomp

needs_libgomp = pytest.mark.skipif(loaded_libgomp() is None, reason="PyTorch's CPU kernels here do not run on libgomp")


@pytest.fixture
def two_torch_threads():
    """Two CPU threads per parallel kernel (so a kernel starts a pool even on a one-core machine), restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


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
