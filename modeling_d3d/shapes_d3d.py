"""The one compiled-shape policy: which pass shapes a compiled engine may see, so that nothing compiles or records
again after the warm-up.

Two regimes (`fixed_by_default`): with *fixed shapes* (CUDA graphs, "reduce-overhead") every pass of a kind keeps
one shape, so caches and widths are bucketed and padded here; elsewhere (inductor on CPUs, eager) lengths and row
counts are dynamic dimensions and passes are only as wide as their rows need.
"""

import torch

COMPILE_LENGTH_BUCKET = 256  # cache lengths of fixed-shape engines are multiples of this (one graph per bucket)
DYNAMIC_LENGTH_BUCKET = 64  # cache lengths of other compiled engines are multiples of this (pooled caches reused)
EAGER_CUDA_KV_BUCKET = 128  # eager passes on CUDA attend over a multiple of this many columns (`attended_columns`)


def fixed_by_default(device: torch.device | str) -> bool:
    """Whether compiled passes on `device` use fixed shapes when not told: on CUDA (graphs), nowhere else."""
    return torch.device(device).type == "cuda"


def engine_size(rows: int, max_length: int, fixed: bool) -> tuple[int, int]:
    """Slots and length of an engine with compiled passes: at least 2 slots (PyTorch specialises a dimension of
    size 1, so a one-slot cache would compile once more); with fixed shapes (CUDA graphs attend over the whole cache
    and every slot) slots rounded up to a power of two and the length to a multiple of `COMPILE_LENGTH_BUCKET`, so
    calls of other batch sizes and prompt lengths replay a recorded graph (one per bucket pair); otherwise (dynamic
    dimensions, nothing recompiles) the length rounded up to a multiple of `DYNAMIC_LENGTH_BUCKET`, so that calls of
    nearby lengths reuse one pooled cache instead of each keeping its own (`caches_d3d.CachePool`)."""
    if not fixed:
        return max(rows, 2), -(-max_length // DYNAMIC_LENGTH_BUCKET) * DYNAMIC_LENGTH_BUCKET
    return max(1 << (rows - 1).bit_length(), 2), -(-max_length // COMPILE_LENGTH_BUCKET) * COMPILE_LENGTH_BUCKET


def attended_columns(needed: int, capacity: int, device: torch.device | str, compiled: bool = False) -> int:
    """Cache columns a pass with dynamic shapes (eager, or compiled without fixed shapes) attends over when it needs
    `needed`: on CUDA rounded up to a multiple of `EAGER_CUDA_KV_BUCKET` (at most `capacity`; the mask hides the extra
    columns), elsewhere exactly `needed`; compiled, at least 2 (PyTorch specialises a size of 1: a one-token prompt's
    first pass would compile once more). Passes with fixed shapes attend over every column.

    Attention kernels that build a plan per shape (cuDNN's SDPA, which torch >= 2.5 prefers on compute capability 9.0+
    GPUs) would otherwise build one every decoding step, each step's length being new: on an H200 with torch 2.11
    that cost 40-80 ms a step at 8 layers of Qwen3-8B, against 9-13 ms for the step itself (docs/results.md,
    2026-12-04). On CPUs no kernel builds plans, and the exact length keeps the plain step's mask-free path (eager)
    and attends over no column a compiled pass does not need (a cache sized for a wider engine costs nothing more)."""
    if compiled:
        needed = min(max(needed, 2), capacity)
    if torch.device(device).type != "cuda":
        return needed
    return min(capacity, -(-needed // EAGER_CUDA_KV_BUCKET) * EAGER_CUDA_KV_BUCKET)


def block_causal_width(uncached: list[int], block_size: int, fixed: bool) -> int:
    """Input columns before the block of a block pass: the widest row's uncached tokens; with fixed shapes at least
    `B`, what a row has uncached after any round that ran the drafter (it accepted at most `B` tokens)."""
    return max([block_size if fixed else 0, *uncached])


def successor_causal_width(uncached: list[int], block_size: int, fixed: bool) -> int:
    """Input columns before the branch blocks of a successor pass: the widest row's uncached tokens and drafts; with
    fixed shapes at least `2B` (at most `B` accepted tokens plus `B - 1` drafts)."""
    return max([2 * block_size if fixed else 0, *uncached])


def block_scratch_columns(block_size: int) -> int:
    """Drafter cache columns a block pass uses beyond a row's context: its block (`B`) and its padding (`B` columns,
    the fixed causal width, `block_causal_width`; more padding, for another row far behind, writes them in turn)."""
    return 2 * block_size


def successor_scratch_columns(block_size: int, max_blocks: int) -> int:
    """Drafter cache columns a successor pass uses beyond a row's context: its drafts (`B - 1`), `max_blocks` branch
    blocks of `B`, and padding (`2B` columns, the fixed causal width, `successor_causal_width`; more padding writes
    them in turn): `(max_blocks + 3) B` covers them and a block pass's `block_scratch_columns`."""
    return (max_blocks + 3) * block_size


__all__ = ["COMPILE_LENGTH_BUCKET", "DYNAMIC_LENGTH_BUCKET", "EAGER_CUDA_KV_BUCKET", "attended_columns",
           "block_causal_width", "block_scratch_columns", "engine_size", "fixed_by_default", "successor_causal_width",
           "successor_scratch_columns"]
