"""Batch-first drafting over a `StaticKVCache`: the block pass, branch planning and the packed successor pass (their
layouts, written with `passes_d3d.PassLayoutBuilder` and run through `passes_d3d.run_pass`), and turning logits into
drafts (`process`, `choose`).

Every function takes all rows at once (a single prompt is a batch of one). A row is described by its drafter
context (the tokens the drafter reads: its prompt, then the generated tokens; the last one is the anchor) and how
many of them its cache has committed. Causal tokens are written at the columns of their positions; blocks go to
scratch columns after them and are never committed, so a pass leaves the committed part valid up to what the caller
commits (rollback by length).
"""

import torch
from transformers import LogitsProcessorList
from transformers.generation import logits_process

from .caches_d3d import StaticKVCache
from .passes_d3d import PassLayout, PassLayoutBuilder, fixed_shapes, run_pass


CONTEXT_FREE_PROCESSORS = ("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper",
                           "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper", "TopHLogitsWarper")


def block_layout_for_rows(contexts: list[list[int]], committed: list[int], block_size: int, mask_id: int,
                          fixed: bool = False) -> PassLayout:
    """The block pass: per row `[padding, uncached tokens before the anchor, anchor, M x (B - 1)]`, the block always in
    the last `B` input columns and written at its positions, the padding in scratch columns after it. The uncached
    part is as wide as the widest row's, or with `fixed` at least `B` columns (its size after any round), so that the
    shape stays the same from round to round (compiled passes)."""
    uncached = [len(context) - 1 - done for context, done in zip(contexts, committed)]
    if min(uncached) < 0:
        raise RuntimeError("A drafter cache holds more tokens than its row's prefix before the anchor")
    causal_width = max([block_size if fixed else 0, *uncached])
    layout = PassLayoutBuilder(len(contexts), causal_width + block_size, mask_id)
    masks = [mask_id] * (block_size - 1)
    for row, (context, done) in enumerate(zip(contexts, committed)):
        pad, anchor = causal_width - uncached[row], len(context) - 1
        layout.put_causal(row, pad, context[done:anchor], done)
        layout.put_block(row, causal_width, [context[-1]] + masks, anchor, anchor)
        layout.put_padding(row, 0, pad, anchor + block_size)
    return layout.build()


def block_pass(drafter, cache: StaticKVCache, contexts: list[list[int]], committed: list[int], forward=None) -> torch.Tensor:
    """Draft the `B - 1` tokens after every row's anchor in one pass: raw logits `(rows, B - 1, vocab)` float32. On
    return each row's cache holds its whole prefix before the anchor (commit `len(context) - 1`)."""
    block_size = drafter.config.block_size
    layout = block_layout_for_rows(contexts, committed, block_size, drafter.config.mask_token_id, fixed_shapes(forward))
    return run_pass(drafter, cache, layout, block_size - 1, forward=forward)


def context_free(logits_processor: LogitsProcessorList | None) -> bool:
    """Whether every processor ignores the token ids (temperature, top-k, top-p, ...): then one batched call over
    every position gives what per-position calls with their own contexts give."""
    free = tuple(getattr(logits_process, name) for name in CONTEXT_FREE_PROCESSORS if hasattr(logits_process, name))
    return all(isinstance(processor, free) for processor in (logits_processor or []))


def ends_row_only(error: BaseException) -> bool:
    """Whether `error`, raised by a row's own code (its logits processors, stopping criteria), ends that row only:
    any exception but a Ctrl-C (`KeyboardInterrupt`), which stops the whole call. A `BaseException` that is not an
    `Exception` (a `SystemExit`, an `asyncio.CancelledError`, a class of the user's) is the row's failure too."""
    return not isinstance(error, KeyboardInterrupt)


def process(logits_processor: LogitsProcessorList | None, contexts: torch.Tensor | list, logits: torch.Tensor,
            growing: torch.Tensor | None = None) -> torch.Tensor:
    """Apply one row's processors to its logits `(n, vocab)`, position j with its own context: `contexts` (the row's
    tokens, 1-D) followed by `growing[:j]` when given (the drafts before j), else `contexts` alone."""
    if not logits_processor:
        return logits
    if context_free(logits_processor):
        return logits_processor(torch.zeros(logits.shape[0], 1, dtype=torch.long, device=logits.device), logits.clone())
    context = torch.as_tensor(contexts, dtype=torch.long, device=logits.device)
    rows = []
    for j in range(logits.shape[0]):
        ids = context if growing is None else torch.cat([context, growing[:j].to(logits.device)])
        rows.append(logits_processor(ids[None], logits[j : j + 1].clone()))
    return torch.cat(rows)


def choose(logits: torch.Tensor, do_sample: bool, generator: torch.Generator | None) -> torch.Tensor:
    """Tokens `(n,)` from processed logits `(n, vocab)`: argmax, or a draw from their softmax."""
    if not do_sample:
        return logits.argmax(-1)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


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
    uncached = [len(context) - done + len(row_drafts) for context, done, row_drafts in zip(contexts, committed, drafts)]
    causal_width = max([2 * block_size if fixed else 0, *uncached])
    blocks = max(min_blocks, *(len(row) for row in anchors))
    layout = PassLayoutBuilder(len(contexts), causal_width + blocks * block_size, mask_id)
    masks = [mask_id] * (block_size - 1)
    for row, (context, done, row_drafts, row_anchors) in enumerate(zip(contexts, committed, drafts, anchors)):
        pad = causal_width - uncached[row]
        layout.put_causal(row, pad, context[done:] + row_drafts, done)
        scratch = len(context) + len(row_drafts)
        for k in range(blocks):
            token, j = row_anchors[min(k, len(row_anchors) - 1)]
            layout.put_block(row, causal_width + k * block_size, [token] + masks, len(context) + j,
                             scratch + k * block_size)
        layout.put_padding(row, 0, pad, scratch + blocks * block_size)
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


__all__ = ["block_layout_for_rows", "block_pass", "choose", "context_free", "plan_alternatives", "process",
           "successor_layout", "successor_pass"]
