"""Drafter sources: where the engine's candidates come from, behind one small interface.

A source owns the drafter, its `StaticKVCache` (whose `committed` lengths say what each slot's drafter cache holds)
and per-slot state; the engine owns the rows and their slots. The interface is `DrafterSource`:

- `allocate(slots, capacity)`, `add(slot, context)` (prefill), `move(from_slot, to_slot)` (a row changing slot);
- `propose(contexts, sampling) -> Proposal`: drafts for every row (the context ends with the anchor);
- `observe(contexts, accepted_drafts) -> DraftTiming`: how many of each row's drafts verification accepted (the
  contexts before the round);
- `wait()` (let background drafting end), `close()`.

`BlockSource` drafts one block per round, synchronously. `SuccessorSource` also prepares, on a worker thread while the
target verifies, the next block for each likely outcome (one packed pass), and serves the next round from it when
the verified tokens match a branch. Selective prefill is not a source of its own: a row's drafter context may
start with another prompt than the target's (the full one), which both sources read.
"""

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch
from transformers import LogitsProcessorList

from .caches_d3d import StaticKVCache
from .drafting_d3d import (block_pass, choose, context_free, ends_row_only, plan_alternatives, process,
                            successor_pass)
from .passes_d3d import CompiledPasses, prefill
from .streams_d3d import Clock, Fence, current_stream, handoff, seconds, side_stream, upload, use_stream
from .threads_d3d import CPUWorkerPools, in_callers_modes

DEFAULT_COVERAGE = 12
DEFAULT_FANOUT = 2


def check_budget(block_size: int, coverage: int, fanout: int) -> None:
    """Raise `ValueError` unless `coverage` is an integer in `1..block_size` and `fanout` an integer >= 0."""
    integers = all(isinstance(v, int) and not isinstance(v, bool) for v in (coverage, fanout))
    if not integers or not 1 <= coverage <= block_size or fanout < 0:
        raise ValueError(f"coverage must be an integer in 1..{block_size} and fanout an integer >= 0, got "
                         f"coverage={coverage!r}, fanout={fanout!r}")


@dataclass
class RowSampling:
    """How a row turns drafter logits into drafts: the target's processors, argmax or sampling, its generator.
    device: where the processors were built and the generator lives (the target's device; None: wherever the
    drafter's logits are). The processors hold tensors there (MinNewTokens' EOS ids, SuppressTokens' ids, ...), so
    a row that processes or samples has its drafter logits moved there first (a drafter on another GPU), and its
    drafts and q come out there, where verification reads them."""

    logits_processor: LogitsProcessorList = field(default_factory=LogitsProcessorList)
    do_sample: bool = False
    generator: torch.Generator | None = None
    device: torch.device | None = None

    @property
    def processes(self) -> bool:
        """Whether this row's drafter logits go through its processors or a draw (else: argmax of the raw ones)."""
        return bool(self.logits_processor) or self.do_sample


@dataclass
class Proposal:
    """One round's candidates. drafts `(rows, m)` long and num_drafts `(rows,)` (real drafts per row; the rest is
    padding); logits `(rows, m, vocab)` processed (q = softmax), None when no row samples; looked_up / hits: per row,
    whether prepared branches were searched and whether one served it; exposed_seconds: host seconds `propose` took
    (the engine times the drafting its target waited for with its own clock, `streams_d3d.Clock`); errors: rows
    whose own drafting step (their logits processors) failed, by row index (those rows end)."""

    drafts: torch.Tensor
    num_drafts: torch.Tensor
    logits: torch.Tensor | None
    looked_up: list[bool]
    hits: list[bool]
    exposed_seconds: float = 0.0
    errors: dict[int, BaseException] = field(default_factory=dict)


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

    def add(self, slot: int, context: list[int]) -> None:
        """Prefill a new row's context (all but its anchor) in `slot`."""

    def move(self, from_slot: int, to_slot: int) -> None:
        """A row changes slot (an earlier row left)."""

    def propose(self, contexts: list[list[int]], sampling: list["RowSampling"]) -> "Proposal":
        """Drafts for every row."""

    def observe(self, contexts: list[list[int]], accepted_drafts: list[int]) -> DraftTiming:
        """How many of each row's proposed drafts verification accepted; `contexts` as given to `propose`."""

    def wait(self) -> None:
        """Let background drafting end."""

    def release_cpu_workers(self) -> None:
        """With no rows left: the thread that drafts in the background, if any, gives back its CPU worker pool."""

    def close(self) -> None:
        """Release what the source holds (its worker)."""


def drafts_from_logits(raw: torch.Tensor, contexts: list[list[int]], sampling: list[RowSampling],
                       errors: dict[int, BaseException] | None = None):
    """Per row: its processors over raw block logits `(rows, m, vocab)` (context: its tokens), then argmax or a draw.
    Returns drafts `(rows, m)` and the processed logits `(rows, m, vocab)` (the raw ones when no row has
    processors). With `errors`, a row whose processing fails is drafted from its raw logits and its exception is
    put in `errors[row]` (that row ends; the others go on); without, the exception propagates. When a row processes,
    every row's results are on the processors' device (`RowSampling.device`)."""
    if not any(s.processes for s in sampling):
        return raw.argmax(-1), raw
    raw = raw.to(next((s.device for s in sampling if s.device is not None), raw.device))
    rows, drafts = [], []
    for r, (context, s) in enumerate(zip(contexts, sampling)):
        try:
            logits = process(s.logits_processor, context, raw[r])
            tokens = choose(logits, s.do_sample, s.generator)
        except BaseException as error:
            if errors is None or not ends_row_only(error):
                raise
            errors[r] = error
            logits, tokens = raw[r], raw[r].argmax(-1)
        rows.append(logits)
        drafts.append(tokens)
    return torch.stack(drafts), torch.stack(rows)


def check_device(drafter, device) -> None:
    """Raise `ValueError` unless `drafter` is on `device` (None: anywhere). A source never moves the model it is
    given: place it first, `drafter.to(device)`."""
    if device is None:
        return
    wanted, actual = torch.device(device), drafter.get_input_embeddings().weight.device
    if wanted.type != actual.type or (wanted.index is not None and wanted.index != actual.index):
        raise ValueError(f"The drafter is on {actual}, not {wanted}: move it there first (drafter.to({str(wanted)!r})); "
                         "D3D does not move a model it is given")


def check_max_drafts(block_size: int, max_drafts: int | None) -> int:
    """`max_drafts` checked (`ValueError` unless an integer in `1..B - 1`); None: `B - 1`."""
    if max_drafts is None:
        return block_size - 1
    if isinstance(max_drafts, bool) or not isinstance(max_drafts, int) or not 1 <= max_drafts <= block_size - 1:
        raise ValueError(f"max_drafts must be an integer in 1..{block_size - 1}, got {max_drafts!r}")
    return max_drafts


class BlockSource:
    """Synchronous block drafting: each round one block pass drafts `B - 1` tokens for every row, of which the
    engine verifies the first `max_drafts` (default all; fewer: a smaller block than the drafter's trained one).
    passes: the drafter's `passes_d3d.CompiledPasses` (compiled drafting passes, and the pool its cache comes from
    and returns to on `close`); None: eager."""

    scratch_blocks = 2  # the block and the padding of a block pass, beyond a row's context

    def __init__(self, drafter, passes: CompiledPasses | None = None, max_drafts: int | None = None):
        if drafter.config.mask_token_id is None:
            raise ValueError("The drafter has no mask_token_id; it cannot draft blocks")
        self.drafter, self.passes = drafter, passes
        self.forward = passes.forward("block") if passes is not None else None
        self.block_size = drafter.config.block_size
        self.max_drafts = check_max_drafts(self.block_size, max_drafts)
        self.cache: StaticKVCache | None = None

    @property
    def device(self) -> torch.device:
        return self.drafter.get_input_embeddings().weight.device

    @property
    def committed(self) -> list[int]:
        """Per slot, the tokens its drafter cache holds (the cache's own `committed`)."""
        return self.cache.committed

    def allocate(self, slots: int, capacity: int) -> None:
        """A cache for `slots` rows of contexts up to `capacity` tokens (plus this source's scratch columns)."""
        columns = capacity + self.scratch_blocks * self.block_size
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

    def add(self, slot: int, context: list[int]) -> None:
        prefill(self.drafter, self.cache, slot, context[:-1])

    def move(self, from_slot: int, to_slot: int) -> None:
        self.cache.move_row(from_slot, to_slot)

    def propose(self, contexts: list[list[int]], sampling: list[RowSampling]) -> Proposal:
        start = time.perf_counter()
        errors: dict[int, BaseException] = {}
        drafts, logits = self._draft_all(contexts, sampling, errors)
        rows = len(contexts)
        return Proposal(drafts, torch.full((rows,), self.max_drafts, device=drafts.device),
                        logits if any(s.do_sample for s in sampling) else None, [False] * rows, [False] * rows,
                        time.perf_counter() - start, errors=errors)

    def _draft_all(self, contexts: list[list[int]], sampling: list[RowSampling],
                   errors: dict[int, BaseException] | None = None):
        """One block pass for every row: drafts `(rows, B - 1)` and their processed logits (see
        `drafts_from_logits` for `errors`)."""
        raw = block_pass(self.drafter, self.cache, contexts, self.cache.committed[: len(contexts)], self.forward)
        for row, context in enumerate(contexts):
            self.cache.committed[row] = len(context) - 1
        return drafts_from_logits(raw, contexts, sampling, errors)

    def observe(self, contexts: list[list[int]], accepted_drafts: list[int]) -> DraftTiming:
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


@dataclass
class PreparedBranches:
    """A row's successor branches: `base` = its context length when they were planned; `keys[key] = k` where `key`
    is what the verified tokens must add after `base`; tokens `(K, B - 1)` with `counts[k]` real ones; ranked
    `(K, B - 1, F + 1)` the drafter's top tokens per position (to plan the branches after them); logits `(K, B - 1,
    vocab)` processed, kept only when the row samples (q)."""

    base: int
    keys: dict[tuple[int, ...], int]
    tokens: torch.Tensor
    counts: list[int]
    ranked: torch.Tensor
    logits: torch.Tensor | None


class SuccessorSource(BlockSource):
    """Asynchronous successor drafting. coverage `C` and fanout `F`: branches for the first `C - 1` rejection
    positions times the `F` most probable other drafter tokens, plus the full-acceptance branch (budget
    `B((C - 1)F + 2)` tokens a row). device: where the drafter runs (e.g. `"cuda:1"` beside a target on `cuda:0`),
    checked, never moved to (`check_device`); on CUDA the worker uses its own stream. worker_threads: torch threads of the worker (CPU-only machines).
    passes: compiled drafting passes (`BlockSource`); the successor pass has its own compiled forward, and runs on
    the passes' long-lived worker thread where they have one (fixed shapes: CUDA graphs, so each compiled function is
    only ever called from one thread), else on a worker of this source's own that ends when it closes.

    Each `propose` serves every row from its branches when the verified tokens match one (a hit: no drafting
    pass), drafts the others with one block pass, then queues the packed successor pass for the new drafts on the
    worker; `observe` joins it and commits what verification kept.
    """

    def __init__(self, drafter, coverage: int | None = None, fanout: int = DEFAULT_FANOUT, device=None,
                 worker_threads: int | None = None, passes: CompiledPasses | None = None,
                 max_drafts: int | None = None):
        block_size = drafter.config.block_size
        coverage = min(DEFAULT_COVERAGE, block_size) if coverage is None else coverage
        check_budget(block_size, coverage, fanout)
        if worker_threads is not None and (isinstance(worker_threads, bool) or not isinstance(worker_threads, int)
                                           or worker_threads < 1):
            raise ValueError(f"worker_threads must be an integer >= 1, got {worker_threads!r}")
        check_device(drafter, device)
        super().__init__(drafter, passes, max_drafts)
        self.coverage, self.fanout = coverage, fanout
        self.successor_forward = passes.forward("successor") if passes is not None else None
        self.max_blocks = (coverage - 1) * fanout + 1  # the most branch blocks a row's successor pass plans
        self.budget_tokens = block_size * ((coverage - 1) * fanout + 2)
        self.scratch_blocks = (coverage - 1) * fanout + 4
        self.branches: list[PreparedBranches | BaseException | None] = []  # an exception: that row's worker step failed
        self._closed = False
        self._pending: Future | None = None
        self._worker_ran = False  # a pass ran on the worker since its pool was last given back
        self._cpu_pools: CPUWorkerPools | None = None  # found when first needed
        self._stream = side_stream(self.device)
        self._clock = Clock(self.device)
        shared = passes.worker() if passes is not None else None  # last: nothing after it can fail and leave it
        self._owns_executor = shared is None
        self._executor = shared or ThreadPoolExecutor(max_workers=1, thread_name_prefix="d3d-drafter")
        if worker_threads:
            self._executor.submit(torch.set_num_threads, worker_threads).result()

    def allocate(self, slots: int, capacity: int) -> None:
        self.wait()
        super().allocate(slots, capacity)
        self.branches = [None] * slots

    def add(self, slot: int, context: list[int]) -> None:
        self.wait()
        super().add(slot, context)
        self.branches[slot] = None

    def move(self, from_slot: int, to_slot: int) -> None:
        self.wait()
        super().move(from_slot, to_slot)
        self.branches[to_slot] = self.branches[from_slot]

    def propose(self, contexts: list[list[int]], sampling: list[RowSampling]) -> Proposal:
        if self._closed:
            raise RuntimeError("This SuccessorSource is closed; create a new one")
        start = time.perf_counter()
        self.wait()
        rows, width, sampled = len(contexts), self.block_size - 1, any(s.do_sample for s in sampling)
        errors = {r: self.branches[r] for r in range(rows) if isinstance(self.branches[r], BaseException)}
        looked_up = [isinstance(self.branches[r], PreparedBranches) for r in range(rows)]
        found = [self._lookup(r, contexts[r]) for r in range(rows)]
        if all(index is not None for index in found):
            first = self.branches[0]
            drafts = first.tokens.new_zeros(rows, width)
            ranked = first.ranked.new_zeros(rows, width, first.ranked.shape[-1])
            logits = torch.zeros(rows, width, self.drafter.config.vocab_size, device=drafts.device) if sampled else None
        else:  # a row served from its branches draws nothing here: its draws may not depend on its companions
            drafting = [s if index is None else RowSampling(s.logits_processor) for s, index in zip(sampling, found)]
            drafts, processed = self._draft_all(contexts, drafting, errors)
            ranked = self._ranked(processed)
            logits = processed if sampled else None
        counts = [self.max_drafts] * rows
        for r, index in enumerate(found):
            if index is None:
                continue
            branch = self.branches[r]
            counts[r] = min(branch.counts[index], self.max_drafts)
            drafts[r], ranked[r] = branch.tokens[index], branch.ranked[index]
            if logits is not None and branch.logits is not None:
                logits[r] = branch.logits[index]
            self.cache.committed[r] = len(contexts[r]) - 1  # the successor pass cached its context before the anchor
        self.branches[:rows] = [None] * rows
        num_drafts = upload(torch.tensor(counts), drafts.device)
        # the worker's copies on the drafter's device (processed rows draft on the target's), made before the verify
        # pass is queued, then a fence: the worker stream waits for these, not for the verify pass
        worker_inputs = [t.to(self.device, non_blocking=True) for t in (drafts, num_drafts, ranked)]
        drafted = Fence(self.device, "the drafts").record()
        handoff(worker_inputs, self._stream)
        exposed = time.perf_counter() - start
        self._pending = self._executor.submit(in_callers_modes(self._prepare), contexts, *worker_inputs, sampling,
                                              drafted)
        self._worker_ran = True
        return Proposal(drafts, num_drafts, logits, looked_up, [index is not None for index in found], exposed,
                        errors=errors)

    def _ranked(self, logits: torch.Tensor) -> torch.Tensor:
        """`(..., F + 1)` the drafter's most probable tokens per position of processed `logits` `(..., vocab)`, the
        candidates `plan_alternatives` picks the next branches' anchors from."""
        return logits.topk(min(self.fanout + 1, logits.shape[-1]), dim=-1).indices

    def _lookup(self, row: int, context: list[int]) -> int | None:
        branch = self.branches[row]
        if not isinstance(branch, PreparedBranches):
            return None
        index = branch.keys.get(tuple(context[branch.base :]))
        return index if index is not None and branch.counts[index] > 0 else None

    def _prepare(self, contexts, drafts, num_drafts, ranked, sampling, drafted: Fence):
        """Worker: plan every row's branches and draft them in one packed pass, on the worker's stream after the
        drafts (`drafted`); returns them, the seconds taken and the fence of their work (already done)."""
        with use_stream(self._stream):
            drafted.wait()
            start = self._clock.mark()
            prepared = self._branches_for(contexts, drafts, num_drafts, ranked, sampling)
            end = self._clock.mark()
            done = Fence(self.device, "the successor branches").record()
        done.synchronize()  # this thread waits for its own stream, never the device
        return prepared, seconds(start, end), done

    @torch.no_grad()
    def _branches_for(self, contexts, drafts, num_drafts, ranked, sampling) -> list[PreparedBranches]:
        rows = len(contexts)
        alternatives = plan_alternatives(drafts, ranked, self.coverage, self.fanout).tolist()
        draft_lists = [d[:n] for d, n in zip(drafts.tolist(), num_drafts.tolist())]
        anchors, keys = [], []
        for r, row_drafts in enumerate(draft_lists):
            row_anchors, row_keys = [], {}
            for j in range(min(self.coverage - 1, len(row_drafts))):
                for token in alternatives[r][j]:
                    row_keys.setdefault(tuple(row_drafts[:j]) + (token,), len(row_anchors))
                    row_anchors.append((token, j))
            row_anchors.append((row_drafts[-1], len(row_drafts) - 1))
            anchors.append(row_anchors)
            keys.append(row_keys)
        raw = successor_pass(self.drafter, self.cache, contexts, self.cache.committed[:rows], draft_lists, anchors,
                             self.successor_forward, self.max_blocks)
        prepared = []
        for r in range(rows):
            try:
                prepared.append(self._row_branches(contexts[r], draft_lists[r], anchors[r], keys[r], raw[r], sampling[r]))
            except BaseException as error:  # this row's processors failed: it ends next round, the others go on
                if not ends_row_only(error):
                    raise
                prepared.append(error)
        return prepared

    def _row_branches(self, context: list[int], draft_list: list[int], anchors: list[tuple[int, int]],
                      keys: dict, raw: torch.Tensor, row_sampling: RowSampling) -> PreparedBranches:
        """One row's branches from its logits `raw` `(K, B - 1, vocab)` of the successor pass (the drafter's dtype).
        A row that neither processes nor samples ranks them as they are, on the drafter's device (argmax and top-k
        of bf16 logits equal those of their float32 copy); the others are processed in float32 where their
        processors live (`RowSampling.device`)."""
        blocks = len(anchors)
        processors = row_sampling.logits_processor
        if processors and not context_free(processors):  # each block's processors read its own prefix
            prefixes = [context + draft_list[:j] + [token] for token, j in anchors[:-1]] + [context + draft_list]
        else:
            prefixes = [None] * blocks
        if row_sampling.processes:
            raw = raw.to(row_sampling.device or raw.device).float()
            processed = torch.stack([process(processors, prefix, raw[k]) for k, prefix in enumerate(prefixes)])
            tokens = torch.stack([choose(block, row_sampling.do_sample, row_sampling.generator) for block in processed])
        else:
            processed, tokens = raw, raw.argmax(-1)
        keys.setdefault(tuple(draft_list) + (int(tokens[-1, 0]),), blocks - 1)
        tokens[-1] = torch.cat([tokens[-1, 1:], tokens.new_zeros(1)])  # full acceptance: after the guess
        processed[-1] = torch.cat([processed[-1, 1:], processed.new_zeros(1, processed.shape[-1])])
        ranked_tokens = self._ranked(processed)
        counts = [self.block_size - 1] * (blocks - 1) + [self.block_size - 2]
        return PreparedBranches(len(context), keys, tokens, counts, ranked_tokens,
                                processed if row_sampling.do_sample else None)

    def observe(self, contexts: list[list[int]], accepted_drafts: list[int]) -> DraftTiming:
        """Join the worker; commit each row's context and accepted drafts; keep the branches. Returns the seconds
        waited for the worker (drafting the target did not hide) and the worker's seconds hidden behind it."""
        if self._pending is None:
            return DraftTiming()
        start = time.perf_counter()
        pending, self._pending = self._pending, None
        prepared, worker_seconds, done = pending.result()
        waited = time.perf_counter() - start
        done.wait()  # the next round's work on this thread's stream reads the branches after the worker made them
        stream = current_stream(self.device)
        for branch in prepared:
            if isinstance(branch, PreparedBranches):
                handoff([branch.tokens, branch.ranked, branch.logits], stream)
        for r, (context, accepted) in enumerate(zip(contexts, accepted_drafts)):
            self.cache.committed[r] = len(context) + accepted
            self.branches[r] = prepared[r]
        return DraftTiming(waited, max(worker_seconds - waited, 0.0))

    def wait(self) -> None:
        """Let a running worker pass end and drop its branches (its error is raised here)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def release_cpu_workers(self) -> None:
        """The drafting worker gives back its OpenMP pool (`threads_d3d`), once its last pass has ended (`wait`);
        nothing to do if no pass ran since the last time."""
        self.wait()
        if self._worker_ran:
            self._worker_ran = False
            self._cpu_pools = self._cpu_pools or CPUWorkerPools()
            self._executor.submit(self._cpu_pools.release_own).result()  # after `wait`: no pass of this source queued

    def close(self) -> None:
        self._closed = True
        try:
            self.wait()
        finally:
            if self._owns_executor:
                self._executor.shutdown(wait=True, cancel_futures=True)
            self.release_cache()


__all__ = ["BlockSource", "DEFAULT_COVERAGE", "DEFAULT_FANOUT", "DraftTiming", "DrafterSource", "PreparedBranches",
           "Proposal", "RowSampling", "SuccessorSource", "check_budget", "check_device", "check_max_drafts", "drafts_from_logits"]
