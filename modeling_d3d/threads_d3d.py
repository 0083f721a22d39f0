"""What a thread that computes for another needs: the caller's grad and inference modes, and CPU worker pools
given back.

PyTorch's inference and grad modes are per thread, and tensors made under `torch.inference_mode()` (caches allocated
by a caller in it) can be updated in place only under it: a worker thread runs its job in the modes of the thread
that handed it over (`in_callers_modes`).

Threads that compute in bursts, or hand their work to another thread, give back their CPU worker pool.

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
from collections.abc import Callable

import torch

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t; libgomp releases the calling thread's pool for either kind


def loaded_libgomps() -> list[str]:
    """The paths of every libgomp this process has loaded (PyTorch's, whatever its file is called, and any other
    library's copy; not its offload plugins), or none."""
    paths = []
    try:
        with open("/proc/self/maps", "rb") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) < 6 or fields[5].rstrip().endswith(b"(deleted)"):
                    continue
                path = os.fsdecode(fields[5].rstrip())
                name = os.path.basename(path)
                if name.startswith("libgomp") and not name.startswith("libgomp-plugin") and path not in paths:
                    paths.append(path)
    except OSError:  # no /proc: not Linux
        pass
    return paths


class CPUWorkerPools:
    """The process's OpenMP runtimes, found once (a few hundred microseconds); `release_own` then costs
    microseconds. Where no libgomp is loaded (macOS's libomp, Windows, another backend) it does nothing."""

    def __init__(self):
        self._pauses = []
        for path in loaded_libgomps():
            try:  # the library already loaded, never a second copy
                self._pauses.append(ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY).omp_pause_resource_all)
            except (OSError, AttributeError):  # an old libgomp, without OpenMP 5.0's pause
                pass

    @property
    def available(self) -> bool:
        """Whether a loaded libgomp can release pools."""
        return bool(self._pauses)

    def release_own(self) -> bool:
        """Release the calling thread's pool in every loaded libgomp (`omp_pause_resource_all`: libgomp ends the
        pool's threads; nothing where the thread has none); False if there is no libgomp or one refused (inside a
        parallel region)."""
        results = [pause(OMP_PAUSE_SOFT) == 0 for pause in self._pauses]
        return bool(results) and all(results)


def in_callers_modes(job: Callable) -> Callable:
    """`job`, to be run on another thread, wrapped to run under the calling thread's inference and grad modes."""
    inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

    def run(*args, **kwargs):
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            return job(*args, **kwargs)

    return run


__all__ = ["CPUWorkerPools", "in_callers_modes", "loaded_libgomps"]
