"""Freed CPU memory is kept for reuse: a training-sized tensor, freed, stays in the C allocator's heap (ready for the
next step's allocation, so its pages are not unmapped and faulted in again), where by default it is unmapped; and
it can be handed back to the system. Read from glibc's own accounting (`mallinfo2`), not from page-fault counts,
which the kernel can raise for reasons outside the process (page migration, compaction)."""

import platform
import subprocess
import sys

import pytest

TENSOR_BYTES = 16 * 2**20 * 4  # one 64 MiB float32 tensor
HEAP_AFTER_A_64_MB_TENSOR_IS_FREED = """
import ctypes, sys, torch
from d3d.common.host_memory import keep_freed_memory_on_cpu, release_freed_memory


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
applied = keep_freed_memory_on_cpu() if sys.argv[1] == "keep" else None
for _ in range(3):  # as a training loop does: 64 MiB allocated, used and freed, again and again
    torch.ones(16 * 2**20).sum()
heap = libc.mallinfo2()
print(applied, heap.fordblks, heap.hblkhd, release_freed_memory())
"""


def heap_after_free(mode: str) -> tuple[str, int, int, str]:
    """(applied, free bytes kept in the heap, bytes in separately mapped blocks, released) after the loop."""
    result = subprocess.run([sys.executable, "-c", HEAP_AFTER_A_64_MB_TENSOR_IS_FREED, mode],
                            capture_output=True, text=True, timeout=120, check=True)
    applied, kept, mapped, released = result.stdout.split()
    return applied, int(kept), int(mapped), released


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting is glibc's")
def test_a_freed_tensor_is_kept_for_reuse_instead_of_unmapped_and_then_released():
    _, kept_by_default, _, _ = heap_after_free("default")
    assert kept_by_default < TENSOR_BYTES  # by default the tensor was mapped on its own and unmapped when freed
    applied, kept, mapped, released = heap_after_free("keep")
    assert applied == "True" and kept >= TENSOR_BYTES and mapped < TENSOR_BYTES
    assert released == "True"  # the kept 64 MiB is handed back on request
