"""Freed CPU memory is reused: a training-sized tensor allocated again, in a steady loop, no longer faults its pages\nback in."""

import platform
import subprocess
import sys

import pytest

FAULTS_OF_A_64_MB_TENSOR_ALLOCATED_AGAIN = """
import resource, sys, torch
from cli.host_memory import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
for _ in range(10):  # as a training loop does: 64 MiB allocated, used and freed, again and again
    torch.ones(16 * 2**20).sum()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    torch.ones(16 * 2**20).sum()
print(applied, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 5)
"""


def faults(mode: str) -> tuple[str, int]:
    result = subprocess.run([sys.executable, "-c", FAULTS_OF_A_64_MB_TENSOR_ALLOCATED_AGAIN, mode],
                            capture_output=True, text=True, timeout=120, check=True)
    applied, count = result.stdout.split()
    return applied, int(count)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting is glibc's")
def test_a_freed_tensor_is_reused_instead_of_faulted_in_again():
    pages = 16 * 2**20 * 4 // 4096
    assert faults("default")[1] > pages // 2  # glibc's default: mapped afresh, every page faulted in again
    applied, count = faults("keep")
    assert applied == "True" and count < pages // 20
