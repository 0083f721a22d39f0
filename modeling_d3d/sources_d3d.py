"""Drafter sources: where the engine's candidates come from, behind one small interface.

A source owns the drafter, its `StaticKVCache` (whose `committed` lengths say what each slot's drafter cache holds;
the source changes them only through `StaticKVCache.commit`) and per-slot state; the engine owns the rows and their
slots. The interface is `DrafterSource`:

- `allocate(slots, capacity)`, `add(slot, context)` (a new row: its drafter context is prefilled on its first block
  round, `catch_up`, so a batch that never drafts never pays it), `move(from_slot, to_slot)` (a row changing slot);
- `propose(contexts, sampling) -> Proposal`: drafts for every row (the context ends with the anchor);
- `observe(contexts, added) -> DraftTiming`: the tokens each row added this round (the contexts before the round);
- `wait()` (let background drafting end), `close()`.

`BlockSource` (here) drafts one block per round, synchronously. `successor_d3d.SuccessorSource` also prepares, on a worker thread while the
target verifies, the next block for each likely outcome (one packed pass), and serves the next round from it when
the verified tokens match a branch. Selective prefill is not a source of its own: a row's drafter context may
start with another prompt than the target's (the full one), which both sources read.
"""

import time
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch

from .acceptance_d3d import RowSampling, drafts_from_logits
from .caches_d3d import StaticKVCache
from .passes_d3d import CompiledPasses, PassLayout, PassLayoutBuilder, fixed_shapes, prefill, run_pass
from .shapes_d3d import block_causal_width, block_scratch_columns
from .streams_d3d import synchronize


@dataclass
class Proposal:
    """One round's candidates. drafts `(rows, m)` long and num_drafts `(rows,)` (real drafts per row; the rest is
    padding); logits `(rows, m, vocab)` processed (q = softmax), None when no row samples; looked_up / hits: per row,
    whether prepared branches were searched and whether one served it; exposed_seconds: host seconds `propose` took
    (the engine times the drafting its target waited for with its own clock, `streams_d3d.Clock`); caught_up_seconds:
    seconds `propose` first took to prefill rows that joined (`catch_up`, waited for on the device: not a drafting
    pass's cost, which the verify policy learns without them); errors: rows
    whose own drafting step (their logits processors) failed, by row index (those rows end); second `(rows, m)` and
    num_second `(rows,)`: a second branch of drafts after the same anchor (a tree round, `policy_d3d.BOTH`; greedy
    rows only, so no q), None in other rounds."""

    drafts: torch.Tensor
    num_drafts: torch.Tensor
    logits: torch.Tensor | None
    looked_up: list[bool]
    hits: list[bool]
    exposed_seconds: float = 0.0
    errors: dict[int, BaseException] = field(default_factory=dict)
    caught_up_seconds: float = 0.0
    second: torch.Tensor | None = None
    num_second: torch.Tensor | None = None


class DraftTiming(NamedTuple):
    """What `observe` reports of a round's drafting: seconds the target waited for (exposed) and seconds that ran
    while it verified (hidden)."""

    exposed: float = 0.0
    hidden: float = 0.0


class DrafterSource(Protocol):
    """Where the engine's candidates come from (`BlockSource`, `SuccessorSource`). Slots are the engine's: row `r` of
    every call is the row in slot `r`; contexts are drafter contexts (the last token is the anchor)."""

    drafter: torch.nn.Module
    block_size: int
    cache: StaticKVCache | None

    @property
    def device(self) -> torch.device: ...

    def allocate(self, slots: int, capacity: int) -> None:
        """Caches for `slots` rows of contexts up to `capacity` tokens."""

    def add(self, first_slot: int, contexts: list[list[int]]) -> None:
        """New rows in slots `first_slot..` (their contexts: all but the anchors to cache, now or on their first
        block round)."""

    def move(self, from_slot: int, to_slot: int) -> None:
        """A row changes slot (an earlier row left)."""

    def propose(self, contexts: list[list[int]], sampling: list["RowSampling"]) -> "Proposal":
        """Drafts for every row."""

    def observe(self, contexts: list[list[int]], added: list[list[int]]) -> DraftTiming:
        """The tokens each row added this round (its kept drafts, then the target's token; none for a row that
        ended); `contexts` as given to `propose`."""

    def wait(self) -> None:
        """Let background drafting end."""

    def release_cpu_workers(self) -> None:
        """With no rows left: the thread that drafts in the background, if any, gives back its CPU worker pool."""

    def close(self) -> None:
        """Release what the source holds (its worker)."""


def check_device(drafter, device) -> None:
    """Raise `ValueError` unless `drafter` is on `device` (None: anywhere). A source never moves the model it is
    given: place it first, `drafter.to(device)`."""
    if device is None:
        return
    wanted, actual = torch.device(device), drafter.get_input_embeddings().weight.device
    if wanted.type != actual.type or (wanted.index is not None and wanted.index != (actual.index or 0)):
        raise ValueError(f"The drafter is on {actual}, not {wanted}: move it there first (drafter.to({str(wanted)!r})); "
                         "D3D does not move a model it is given")


def check_max_drafts(block_size: int, max_drafts: int | None) -> int:
    """`max_drafts` checked (`ValueError` unless an integer in `1..B - 1`); None: `B - 1`."""
    if max_drafts is None:
        return block_size - 1
    if isinstance(max_drafts, bool) or not isinstance(max_drafts, int) or not 1 <= max_drafts <= block_size - 1:
        raise ValueError(f"max_drafts must be an integer in 1..{block_size - 1}, got {max_drafts!r}")
    return max_drafts


def block_pass_layout(contexts: list[list[int]], committed: list[int], block_size: int, mask_id: int,
                      fixed: bool = False) -> PassLayout:
    """The block pass: per row `[padding, uncached tokens before the anchor, anchor, M x (B - 1)]`, the block always in
    the last `B` input columns and written at its positions, the padding in scratch columns after it. The uncached
    part is as wide as `shapes_d3d.block_causal_width` says."""
    uncached = [len(context) - 1 - length for context, length in zip(contexts, committed)]
    if min(uncached) < 0:
        raise RuntimeError("A drafter cache holds more tokens than its row's prefix before the anchor")
    causal_width = block_causal_width(uncached, block_size, fixed)
    layout = PassLayoutBuilder(len(contexts), causal_width + block_size, mask_id)
    masks = [mask_id] * (block_size - 1)
    for row, (context, length) in enumerate(zip(contexts, committed)):
        pad, anchor = causal_width - uncached[row], len(context) - 1
        layout.put_causal(row, pad, context[length:anchor], length)
        layout.put_block(row, causal_width, [context[-1]] + masks, anchor, anchor)
        layout.put_padding(row, 0, pad, anchor + block_size, block_size)  # the room after the block
    return layout.build()


def catch_up(drafter, cache: StaticKVCache, contexts: list[list[int]], fixed: bool) -> float:
    """Before a block pass, rows are brought up to their anchors (`bring_up`): rows that joined (committed 0, more
    than `B` tokens before their anchor: a row's drafter context is prefilled on its first block round, not when it
    joins, so a request's first token waits for the target's prefill alone and a batch whose rounds never verify the
    drafter's block never runs it), and with `fixed` shapes rows more than `B` behind after rounds without the drafter
    (`policy_d3d`), so that the block pass keeps one shape (`shapes_d3d.block_causal_width`); elsewhere the block pass
    reads a row's missed tokens in its causal part. Returns the seconds the joined rows' prefill took, waited for on
    the device (0.0 when no row joined): a prefill's cost, not drafting's (a lag's catch-up is drafting's)."""
    block_size = drafter.config.block_size
    joined = [cache.committed[slot] == 0 and len(context) - 1 > block_size for slot, context in enumerate(contexts)]
    seconds = 0.0
    if any(joined):
        start = time.perf_counter()
        bring_up(drafter, cache, contexts, joined)
        synchronize(cache.device)  # once, on the first block round of rows that joined: a wait that times it
        seconds = time.perf_counter() - start
    if fixed:
        behind = [len(context) - 1 - cache.committed[slot] > block_size for slot, context in enumerate(contexts)]
        if any(behind):
            bring_up(drafter, cache, contexts, behind)
    return seconds


def bring_up(drafter, cache: StaticKVCache, contexts: list[list[int]], rows: list[bool]) -> None:
    """The rows marked in `rows` up to their anchors: the slots from the first marked to the last in `prefill`, each
    from its committed length (a row between them that is not marked keeps its cache)."""
    first, last = rows.index(True), len(rows) - 1 - rows[::-1].index(True)
    span = range(first, last + 1)
    prefill(drafter, cache, first, [contexts[slot][: -1 if rows[slot] else cache.committed[slot]] for slot in span],
            starts=[cache.committed[slot] for slot in span])


def commit_before_anchors(cache: StaticKVCache, contexts: list[list[int]]) -> None:
    """After a block pass: slot `r`'s cache holds `contexts[r]` before its anchor."""
    for slot, context in enumerate(contexts):
        cache.commit(slot, len(context) - 1)


class BlockSource:
    """Synchronous block drafting: each round one block pass drafts `B - 1` tokens for every row, of which the
    engine verifies the first `max_drafts` (default all; fewer: a smaller block than the drafter's trained one).
    passes: the drafter's `passes_d3d.CompiledPasses` (compiled drafting passes, and the pool its cache comes from
    and returns to on `close`); None: eager."""

    def __init__(self, drafter, passes: CompiledPasses | None = None, max_drafts: int | None = None):
        drafter.config.require_mask_token()
        self.drafter, self.passes = drafter, passes
        self.forward = passes.forward("block") if passes is not None else None
        self.block_size = drafter.config.block_size
        self.max_drafts = check_max_drafts(self.block_size, max_drafts)
        self.scratch_columns = block_scratch_columns(self.block_size)
        self.cache: StaticKVCache | None = None

    @property
    def device(self) -> torch.device:
        return self.drafter.get_input_embeddings().weight.device

    @property
    def committed(self) -> tuple[int, ...]:
        """Per slot, the tokens its drafter cache holds (the cache's own `committed`)."""
        return self.cache.committed

    def allocate(self, slots: int, capacity: int) -> None:
        """A cache for `slots` rows of contexts up to `capacity` tokens (plus this source's scratch columns)."""
        columns = capacity + self.scratch_columns
        self.release_cache()
        if self.passes is not None:
            self.cache = self.passes.caches.take(self.drafter.config, slots, columns, self.device, self.drafter.dtype)
        else:
            self.cache = StaticKVCache(self.drafter.config, slots, columns, self.device, self.drafter.dtype)

    def release_cache(self) -> None:
        """Return the cache to the pool it came from (compiled passes), if any."""
        if self.passes is not None and self.cache is not None:
            self.passes.caches.put(self.cache)
            self.cache = None

    def add(self, first_slot: int, contexts: list[list[int]]) -> None:
        """Nothing cached yet: the first block round prefills (`catch_up`)."""
        for slot in range(first_slot, first_slot + len(contexts)):
            self.cache.commit(slot, 0)

    def move(self, from_slot: int, to_slot: int) -> None:
        self.cache.move_row(from_slot, to_slot)

    def propose(self, contexts: list[list[int]], sampling: list[RowSampling]) -> Proposal:
        """One block pass for every row: drafts `(rows, B - 1)`, of which the first `max_drafts` are proposed."""
        start, rows, fixed = time.perf_counter(), len(contexts), fixed_shapes(self.forward)
        caught_up = catch_up(self.drafter, self.cache, contexts, fixed)
        layout = block_pass_layout(contexts, self.cache.committed[:rows], self.block_size, self.drafter.config.mask_token_id,
                                   fixed)
        raw = run_pass(self.drafter, self.cache, layout, self.block_size - 1, forward=self.forward)
        commit_before_anchors(self.cache, contexts)
        errors: dict[int, BaseException] = {}
        drafts, logits = drafts_from_logits(raw, contexts, sampling, errors)
        return Proposal(drafts, torch.full((rows,), self.max_drafts, device=drafts.device),
                        logits if any(s.do_sample for s in sampling) else None, [False] * rows, [False] * rows,
                        time.perf_counter() - start, errors=errors, caught_up_seconds=caught_up)

    def observe(self, contexts: list[list[int]], added: list[list[int]]) -> DraftTiming:
        """Nothing to do: the cache holds each row's tokens before its old anchor, a prefix of its new context; no
        drafting ran here or hid behind verification."""
        return DraftTiming()

    def wait(self) -> None:
        """Nothing runs in the background."""

    def release_cpu_workers(self) -> None:
        """Nothing runs in the background: the caller's thread is the caller's to release."""

    def close(self) -> None:
        """Return the cache to its pool (compiled passes)."""
        self.release_cache()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


__all__ = ["BlockSource", "DraftTiming", "DrafterSource", "Proposal", "block_pass_layout", "bring_up", "catch_up",
           "check_device", "check_max_drafts", "commit_before_anchors"]
