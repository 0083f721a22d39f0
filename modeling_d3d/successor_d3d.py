"""Asynchronous successor drafting (`SuccessorSource`): while the target verifies a round's block, a worker drafts
the next block for each likely verification outcome in ONE packed pass (`successor_layout`), and the next round is
served from the branch the verified tokens match, with no drafting pass of its own.
"""

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .acceptance_d3d import RowSampling, choose, context_free, drafts_from_logits, ends_row_only, process
from .caches_d3d import StaticKVCache
from .passes_d3d import CompiledPasses, PassLayout, PassLayoutBuilder, fixed_shapes, run_pass
from .shapes_d3d import successor_causal_width, successor_scratch_columns
from .sources_d3d import (BlockSource, DraftTiming, Proposal, block_pass_layout, catch_up, check_device,
                          commit_before_anchors)
from .streams_d3d import Clock, Fence, current_stream, handoff, move, seconds, side_stream, upload, use_stream
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
class PreparedBranches:
    """A row's successor branches: `base` = its context length when they were planned; `drafts`: the drafts the
    successor pass cached after that context (causally); `keys[key] = k` where `key`
    is what the verified tokens must add after `base`; tokens `(K, B - 1)` with `counts[k]` real ones; ranked
    `(K, B - 1, F + 1)` the drafter's top tokens per position (to plan the branches after them); logits `(K, B - 1,
    vocab)` processed, kept only when the row samples (q)."""

    base: int
    drafts: list[int]
    keys: dict[tuple[int, ...], int]
    tokens: torch.Tensor
    counts: list[int]
    ranked: torch.Tensor
    logits: torch.Tensor | None


def agreement(drafts: list[int], kept: list[int]) -> int:
    """How many leading `drafts` equal the tokens a row kept: the cached drafts that stay valid."""
    count = 0
    for draft, token in zip(drafts, kept):
        if draft != token:
            break
        count += 1
    return count


def plan_alternatives(drafts: torch.Tensor, ranked: torch.Tensor, coverage: int, fanout: int) -> torch.Tensor:
    """Branch planning: per row and rejection position `j < C - 1`, the `F` most probable drafter tokens other than
    the draft there. drafts `(rows, m)`; ranked `(rows, m, F + 1)` the drafter's top tokens per position, best first.
    Returns `(rows, C - 1, F)`; each is the anchor of a branch after the drafts before `j`."""
    positions = coverage - 1
    ranked = ranked[:, :positions]
    other = ranked != drafts[:, :positions, None]
    keep = other & (other.long().cumsum(-1) <= fanout)
    order = torch.sort(keep.long(), dim=-1, descending=True, stable=True).indices[..., :fanout]
    return ranked.gather(-1, order)


def successor_layout(contexts: list[list[int]], committed: list[int], drafts: list[list[int]],
                     anchors: list[list[tuple[int, int]]], block_size: int, mask_id: int,
                     fixed: bool = False, min_blocks: int = 0) -> tuple[PassLayout, int]:
    """ONE packed pass: per row `[padding, uncached tokens, drafts, block_1, ..., block_K]`. anchors[r] lists its
    blocks as `(token, j)`: the block `[token, M, ...]` sits at position `len(context) + j` and sees the context and
    the first `j` drafts (the full-acceptance branch is `(drafts[-1], len(drafts) - 1)`). Rows with fewer blocks
    repeat their last one, as do all rows up to `min_blocks` blocks. Blocks and padding go to scratch columns;
    `fixed`: the causal part at least `2B` wide (fixed shapes: with `min_blocks` the most a round plans, every pass
    has one width). Returns the layout and the blocks per row."""
    uncached = [len(context) - length + len(row_drafts)
                for context, length, row_drafts in zip(contexts, committed, drafts)]
    causal_width = successor_causal_width(uncached, block_size, fixed)
    blocks = max(min_blocks, *(len(row) for row in anchors))
    layout = PassLayoutBuilder(len(contexts), causal_width + blocks * block_size, mask_id)
    masks = [mask_id] * (block_size - 1)
    for row, (context, length, row_drafts, row_anchors) in enumerate(zip(contexts, committed, drafts, anchors)):
        pad = causal_width - uncached[row]
        layout.put_causal(row, pad, context[length:] + row_drafts, length)
        scratch = len(context) + len(row_drafts)
        for k in range(blocks):
            token, j = row_anchors[min(k, len(row_anchors) - 1)]
            layout.put_block(row, causal_width + k * block_size, [token] + masks, len(context) + j,
                             scratch + k * block_size)
        layout.put_padding(row, 0, pad, scratch + blocks * block_size, 2 * block_size)  # the room after the blocks
    return layout.build(), blocks


def successor_pass(drafter, cache: StaticKVCache, contexts: list[list[int]], committed: list[int],
                   drafts: list[list[int]], anchors: list[list[tuple[int, int]]], forward=None,
                   max_blocks: int = 0) -> torch.Tensor:
    """Raw logits `(rows, blocks, B - 1, vocab)` of every branch block's masked positions (see `successor_layout`;
    max_blocks: the most blocks a round may plan, every pass's count with a fixed-shape `forward`), in the drafter's
    dtype (no float32 copy of every block: callers rank them, or convert the rows they process). On return each row's
    cache holds its context and drafts (commit as far as verification accepts)."""
    block_size = drafter.config.block_size
    fixed = fixed_shapes(forward)
    layout, blocks = successor_layout(contexts, committed, drafts, anchors, block_size, drafter.config.mask_token_id,
                                      fixed, max_blocks if fixed else 0)
    logits = run_pass(drafter, cache, layout, blocks * block_size, forward=forward, float32=False)
    return logits.reshape(len(contexts), blocks, block_size, -1)[:, :, 1:]


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
        self.scratch_columns = successor_scratch_columns(block_size, self.max_blocks)
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

    def add(self, first_slot: int, contexts: list[list[int]]) -> None:
        self.wait()
        super().add(first_slot, contexts)
        for slot in range(first_slot, first_slot + len(contexts)):
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
        caught_up = 0.0
        if all(index is not None for index in found):
            first = self.branches[0]
            drafts = first.tokens.new_zeros(rows, width)
            ranked = first.ranked.new_zeros(rows, width, first.ranked.shape[-1])
            logits = torch.zeros(rows, width, self.drafter.config.vocab_size, device=drafts.device) if sampled else None
        else:  # a row served from its branches draws nothing here: its draws may not depend on its companions
            drafting = [s if index is None else RowSampling(s.logits_processor) for s, index in zip(sampling, found)]
            fixed = fixed_shapes(self.forward)
            caught_up = catch_up(self.drafter, self.cache, contexts, fixed)
            layout = block_pass_layout(contexts, self.cache.committed[:rows], self.block_size,
                                       self.drafter.config.mask_token_id, fixed)
            raw = run_pass(self.drafter, self.cache, layout, self.block_size - 1, forward=self.forward)
            commit_before_anchors(self.cache, contexts)
            drafts, processed = drafts_from_logits(raw, contexts, drafting, errors)
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
            self.cache.commit(r, len(contexts[r]) - 1)  # the successor pass cached its context before the anchor
        self.branches[:rows] = [None] * rows
        num_drafts = upload(torch.tensor(counts), drafts.device)
        # the worker's copies on the drafter's device (processed rows draft on the target's), made before the verify
        # pass is queued, then a fence: the worker stream waits for these, not for the verify pass
        worker_inputs = [move(t, self.device) for t in (drafts, num_drafts, ranked)]  # the worker reads them on the host
        drafted = Fence(self.device, "the drafts").record()
        handoff(worker_inputs, self._stream)
        exposed = time.perf_counter() - start
        self._pending = self._executor.submit(in_callers_modes(self._prepare), contexts, *worker_inputs, sampling,
                                              drafted)
        self._worker_ran = True
        return Proposal(drafts, num_drafts, logits, looked_up, [index is not None for index in found], exposed,
                        errors=errors, caught_up_seconds=caught_up)

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
        return PreparedBranches(len(context), draft_list, keys, tokens, counts, ranked_tokens,
                                processed if row_sampling.do_sample else None)

    def observe(self, contexts: list[list[int]], added: list[list[int]]) -> DraftTiming:
        """Join the worker; commit each row's context and the drafts it cached that the row kept (`agreement`: the
        drafts verification accepted, or none where the round verified other tokens); keep the branches. Returns the seconds
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
        for r, (context, row_added) in enumerate(zip(contexts, added)):
            cached = prepared[r].drafts if isinstance(prepared[r], PreparedBranches) else []
            self.cache.commit(r, len(context) + agreement(cached, row_added[:-1]))
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


__all__ = ["DEFAULT_COVERAGE", "DEFAULT_FANOUT", "PreparedBranches", "SuccessorSource", "agreement", "check_budget",
           "plan_alternatives",
           "successor_layout", "successor_pass"]
