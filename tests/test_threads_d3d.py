"""`threads_d3d.CPUWorkerPools`: a thread gives back its own OpenMP worker pool, and only its own."""

from concurrent.futures import ThreadPoolExecutor

from cpu_pools import gone, needs_libgomp, pool_of_this_thread, task_ids, two_torch_threads  # noqa: F401 (fixture)
from modeling_d3d.threads_d3d import CPUWorkerPools

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
        assert gone(mine, timeout=0) and others <= task_ids()
        assert worker.submit(pools.release_own).result(WAIT)
        assert gone(others, timeout=0)
        assert pool_of_this_thread(), "the next parallel kernel starts a new pool"
