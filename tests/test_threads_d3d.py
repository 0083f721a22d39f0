"""`threads_d3d.CPUWorkerPools`: a thread gives back its own OpenMP worker pool, and only its own."""

import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from cpu_pools import RELEASED, gone, needs_libgomp, pool_of_this_thread, task_ids
from modeling_d3d.threads_d3d import CPUWorkerPools, loaded_libgomps

WAIT = 60


@needs_libgomp
def test_a_thread_releases_its_own_pool_and_leaves_the_others(two_torch_threads):
    pools = CPUWorkerPools()
    with ThreadPoolExecutor(1) as worker:
        worker.submit(pools.release_own).result(WAIT)
        others = worker.submit(pool_of_this_thread).result(WAIT)
        pools.release_own()
        mine = pool_of_this_thread()
        assert mine and others, "each thread's first parallel kernel starts a pool"
        assert pools.release_own()
        assert gone(mine, timeout=RELEASED) and others <= task_ids()
        assert worker.submit(pools.release_own).result(WAIT)
        assert gone(others, timeout=RELEASED)
        assert pool_of_this_thread(), "the next parallel kernel starts a new pool"


@needs_libgomp
def test_a_second_libgomp_loaded_after_pytorchs_does_not_hide_it(tmp_path):
    """Another library's bundled copy (scikit-learn ships one) may be listed first in the process's maps: the pool of
    PyTorch's kernels is released all the same (in a fresh process, so the copy stays out of this one)."""
    torch_libgomp = next(path for path in loaded_libgomps() if Path(path).parent == Path(torch.__file__).parent / "lib")
    copy = tmp_path / "libgomp-0123abcd.so.1"
    shutil.copy(torch_libgomp, copy)
    script = f"""
import ctypes, sys, torch
sys.path[:0] = {[str(Path(__file__).parent), str(Path(__file__).parents[1])]!r}
ctypes.CDLL({str(copy)!r})
from cpu_pools import pool_of_this_thread, gone
from modeling_d3d.threads_d3d import CPUWorkerPools, loaded_libgomps
torch.set_num_threads(2)
pool = pool_of_this_thread()
assert pool, "a parallel kernel started a pool"
assert CPUWorkerPools().release_own() and gone(pool, timeout=5), "PyTorch's pool is released"
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
