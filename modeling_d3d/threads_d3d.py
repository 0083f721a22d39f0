"""Threads that compute in bursts, or hand their work to another thread, give back their CPU worker pool.

With GNU OpenMP (libgomp: the parallel backend of PyTorch's CPU kernels in its Linux wheels, MKL and oneDNN
included), every thread that has run a parallel CPU kernel keeps a pool of worker threads until it ends. While the
process's pooled threads outnumber its cores, libgomp spins only briefly before a worker sleeps (its "throttled"
spin count), so every parallel kernel of every thread then pays futex wake-ups: on a 2-core CPU the batch server's
scheduler decoded at 2.2x the time a token while the thread that had built the server held a pool
(docs/results.md). Releasing a pool is cheap (that thread's next parallel kernel makes a new one) and changes no
result.
"""

import ctypes
import os

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t; libgomp releases the calling thread's pool for either kind


def loaded_libgomp() -> str | None:
    """The path of the libgomp this process has loaded (PyTorch's, whatever its file is called), or None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and os.path.basename(fields[5].strip()).startswith("libgomp"):
                    return fields[5].strip()
    except OSError:  # no /proc: not Linux
        pass
    return None


class CPUWorkerPools:
    """The process's OpenMP worker pools, found once (a few hundred microseconds); `release_own` then costs
    microseconds. Where no libgomp is loaded (macOS's libomp, Windows, another backend) it does nothing."""

    def __init__(self):
        self._pause = None
        path = loaded_libgomp()
        if path is not None:
            try:  # the library already loaded, never a second copy
                self._pause = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY).omp_pause_resource_all
            except (OSError, AttributeError):  # an old libgomp, without OpenMP 5.0's pause
                pass

    def release_own(self) -> bool:
        """Release the calling thread's pool (`omp_pause_resource_all`: libgomp ends the pool's threads); False if
        there is no libgomp or it refused (inside a parallel region)."""
        return self._pause is not None and self._pause(OMP_PAUSE_SOFT) == 0


__all__ = ["CPUWorkerPools", "loaded_libgomp"]
