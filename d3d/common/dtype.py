"""The dtype every stage runs in: bfloat16 only where the hardware runs it natively and not slower than float32.

On a CPU without native bf16 (e.g. an AVX2-only EPYC) a bf16 matmul is emulated and can be ~50x slower than
float32, so "has bf16 autocast" is not enough: a CPU needs the instructions (AVX512-BF16 / AMX / Arm BF16) and a
short timed matmul at start that confirms it. `--dtype float32|bfloat16` overrides the choice.
"""

import argparse
import functools
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

CHOICES = ("auto", "float32", "bfloat16")
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})  # x86 AVX512-BF16 / AMX, Arm FEAT_BF16
MARGIN = 1.1  # bf16 may take at most this many times the float32 time


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype a run uses and why (printed once, recorded in the outputs)."""

    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def bf16(self) -> bool:
        """What `TrainingArguments(bf16=...)` takes: bf16 autocast exactly when the choice is bfloat16."""
        return self.dtype == torch.bfloat16

    @property
    def description(self) -> str:
        """What the outputs record, e.g. `"float32 (cpu without native bf16)"`."""
        return f"{self.name} ({self.reason})"

    def __str__(self) -> str:
        return f"dtype: {self.description}"


def add_argument(parser: argparse.ArgumentParser, note: str = "") -> None:
    """`--dtype {auto,float32,bfloat16}` (default auto); `note` is added to its help."""
    parser.add_argument("--dtype", choices=CHOICES, default="auto",
                        help="auto: bfloat16 where the hardware runs it natively and fast (CUDA with bf16, a CPU with "
                             "AVX512-BF16/AMX whose timed matmul confirms it), float32 elsewhere" + note)


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags (Linux `/proc/cpuinfo`: x86 `flags`, Arm `Features`); empty where unreadable."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    lines = (line.split(":", 1) for line in text.splitlines() if line.startswith(("flags", "Features")))
    return frozenset(flag for _, values in lines for flag in values.split())


def matmul_seconds(dtype: torch.dtype, repeats: int = 5) -> float:
    """Best-of-`repeats` CPU time of a 1024x256 @ 256x768 matmul in `dtype` (after one warm-up)."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(1024, 256, generator=generator).to(dtype)
    b = torch.randn(256, 768, generator=generator).to(dtype)
    a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return min(times)


@functools.lru_cache(maxsize=1)
def cpu_bf16_is_fast(rounds: int = 5) -> bool:
    """Whether a bf16 matmul takes at most `MARGIN` times the float32 one on this CPU (measured once a process): the
    two timed in alternation, the best of `rounds` each, so that load coming and going on a busy machine does not fall
    on one dtype only."""
    best = {torch.bfloat16: math.inf, torch.float32: math.inf}
    for _ in range(rounds):
        for kind in best:
            best[kind] = min(best[kind], matmul_seconds(kind))
    return best[torch.bfloat16] <= MARGIN * best[torch.float32]


def choose_dtype(requested: str = "auto", device: str | torch.device | None = None) -> DtypeChoice:
    """The dtype for `device` (default: CUDA when there is a GPU, else the CPU); `requested` other than auto wins."""
    if requested != "auto":
        return DtypeChoice(getattr(torch, requested), "--dtype")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return DtypeChoice(torch.bfloat16, "cuda with native bf16")
        return DtypeChoice(torch.float32, "cuda without native bf16")
    if device.type != "cpu":
        return DtypeChoice(torch.float32, f"{device.type}: bf16 not checked there")
    if not cpu_flags() & NATIVE_BF16_FLAGS:
        return DtypeChoice(torch.float32, "cpu without native bf16")
    if not cpu_bf16_is_fast():
        return DtypeChoice(torch.float32, "cpu with native bf16, but a timed bf16 matmul was slower than float32")
    return DtypeChoice(torch.bfloat16, "cpu with native bf16, confirmed by a timed matmul")


__all__ = ["CHOICES", "DtypeChoice", "add_argument", "choose_dtype", "cpu_bf16_is_fast", "cpu_flags", "matmul_seconds"]
