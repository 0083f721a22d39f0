"""Batch-first drafting over a `StaticKVCache`: the block pass, branch planning and the packed successor pass.

Every function takes all rows at once (a single prompt is a batch of one). A row is described by its drafter
context (the tokens the drafter reads: its prompt, then the generated tokens; the last one is the anchor) and how
many of them its cache has committed. Causal tokens are written at the columns of their positions; blocks go to
scratch columns after them and are never committed, so a pass leaves the committed part valid up to what the caller
commits (rollback by length).
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList
from transformers.generation import logits_process

from .caches_d3d import StaticKVCache
from .masking_d3d import interval_mask


CONTEXT_FREE_PROCESSORS = ("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper",
                           "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper", "TopHLogitsWarper")


@dataclass
class PassLayout:
    """Inputs of one pass over rows `0..rows-1`, all `(rows, width)` long on the host: ids, rotary positions, cache
    columns written, and the visibility of each query (see `masking_d3d.interval_mask`)."""

    ids: torch.Tensor
    positions: torch.Tensor
    write_index: torch.Tensor
    prefix_end: torch.Tensor
    own_start: torch.Tensor
    own_end: torch.Tensor

    @classmethod
    def empty(cls, rows: int, width: int, fill_id: int) -> "PassLayout":
        zeros = lambda: torch.zeros(rows, width, dtype=torch.long)  # noqa: E731
        return cls(torch.full((rows, width), fill_id, dtype=torch.long), zeros(), zeros(), zeros(), zeros(), zeros())

    @classmethod
    def causal(cls, ids: torch.Tensor, starts: torch.Tensor) -> "PassLayout":
        """Every row causal: ids `(rows, width)` at positions `starts[r]..` `(rows,)`, each written at the cache
        column of its position and seeing its prefix (`put_causal` for all rows at once)."""
        positions = starts[:, None] + torch.arange(ids.shape[1])
        return cls(ids, positions, positions.clone(), positions + 1, torch.zeros_like(positions),
                   torch.zeros_like(positions))

    def put_causal(self, row: int, column: int, tokens: list[int], start: int) -> None:
        """Tokens at positions `start..` written at the cache columns of their positions, each seeing its prefix."""
        span = slice(column, column + len(tokens))
        positions = torch.arange(start, start + len(tokens))
        self.ids[row, span] = torch.tensor(tokens, dtype=torch.long)
        self.positions[row, span] = positions
        self.write_index[row, span] = positions
        self.prefix_end[row, span] = positions + 1

    def put_block(self, row: int, column: int, tokens: list[int] | torch.Tensor, anchor_position: int,
                  cache_column: int, size: int) -> None:
        """A block `[anchor, M, ...]` of `size` tokens in scratch columns `cache_column..`, seeing the prefix before
        its anchor and itself."""
        span = slice(column, column + size)
        self.ids[row, span] = torch.as_tensor(tokens, dtype=torch.long)
        self.positions[row, span] = torch.arange(anchor_position, anchor_position + size)
        self.write_index[row, span] = torch.arange(cache_column, cache_column + size)
        self.prefix_end[row, span] = anchor_position
        self.own_start[row, span] = cache_column
        self.own_end[row, span] = cache_column + size

    def put_padding(self, row: int, columns: slice, cache_column: int) -> None:
        """Unused input columns: written to scratch columns from `cache_column`, each seeing only itself."""
        count = columns.stop - columns.start
        if count <= 0:
            return
        scratch = torch.arange(cache_column, cache_column + count)
        self.write_index[row, columns] = scratch
        self.own_start[row, columns] = scratch
        self.own_end[row, columns] = scratch + 1

    def kv_length(self) -> int:
        """Columns the pass must attend over: every column it writes or a query sees."""
        return int(torch.maximum(self.write_index.max() + 1, self.prefix_end.max()))


@torch.no_grad()
def run_pass(model, cache: StaticKVCache, layout: PassLayout, logits_to_keep: int, first_row: int = 0,
             forward=None) -> torch.Tensor:
    """One forward of `model` (a target or a drafter) over `layout` on cache rows `first_row..`; returns the float32
    logits of the last `logits_to_keep` input columns, `(rows, logits_to_keep, vocab)`. `forward`: a compiled
    `model.forward` (`CompiledForward`) to use instead; with fixed shapes it attends over every cache column (else,
    as eager passes, over the columns in use only)."""
    device = cache.device
    rows = layout.ids.shape[0]
    kv_length = cache.capacity if fixed_shapes(forward) else layout.kv_length()
    cache.plan(rows, layout.write_index, kv_length, first_row)
    mask = interval_mask(
        model.config, layout.prefix_end.to(device), layout.own_start.to(device), layout.own_end.to(device), kv_length,
        model.dtype,
    )
    output = (forward or model)(
        input_ids=layout.ids.to(device), position_ids=layout.positions.to(device),
        attention_mask={"full_attention": mask}, past_key_values=cache, use_cache=True, logits_to_keep=logits_to_keep,
    )
    return output.logits.float()


@dataclass
class CompiledForward:
    """A compiled `model.forward`. With `fixed_shapes` (CUDA graphs, "reduce-overhead") every pass of a kind has one
    shape: it attends over every cache column and drafting widths are padded to their largest round. Without
    (inductor on CPUs), passes keep their eager shapes and the compiler marks the changing lengths dynamic after
    the first change, so one compilation serves every length."""

    function: Callable
    fixed_shapes: bool

    def __call__(self, **kwargs):
        return self.function(**kwargs)


def compiled_forward(model) -> CompiledForward:
    """`model.forward` compiled: CUDA graphs with fixed shapes on CUDA, inductor with dynamic lengths elsewhere, its
    wrapper code in C++ (`cpp_wrapper`: the kernels are the same, the per-call Python that launches them is gone)."""
    if model.device.type == "cuda":
        return CompiledForward(torch.compile(model.forward, mode="reduce-overhead", dynamic=False), True)
    return CompiledForward(torch.compile(model.forward, options={"cpp_wrapper": True}), False)


def fixed_shapes(forward) -> bool:
    """Whether passes through `forward` (None: eager) must keep one shape."""
    return getattr(forward, "fixed_shapes", False)


def prefill(model, cache: StaticKVCache, slot: int, tokens: list[int]) -> None:
    """Commit `tokens` (a prompt without its last token) to cache row `slot`, alone."""
    if not tokens:
        return
    layout = PassLayout.causal(torch.tensor([tokens]), torch.zeros(1, dtype=torch.long))
    run_pass(model, cache, layout, 1, first_row=slot)


def block_layout_for_rows(contexts: list[list[int]], committed: list[int], block_size: int, mask_id: int,
                          fixed: bool = False) -> PassLayout:
    """The block pass: per row `[padding, uncached tokens before the anchor, anchor, M x (B - 1)]`, the block always in
    the last `B` input columns. The uncached part is as wide as the widest row's, or with `fixed` at least `B`
    columns (its size after any round), so that the shape stays the same from round to round (compiled passes)."""
    uncached = [len(context) - 1 - done for context, done in zip(contexts, committed)]
    if min(uncached) < 0:
        raise ValueError("A drafter cache holds more tokens than its row's prefix before the anchor")
    causal_width = max([block_size if fixed else 0, *uncached])
    fields = [], [], [], [], [], []  # ids, positions, write_index, prefix_end, own_start, own_end: one list per row
    for context, done, count in zip(contexts, committed, uncached):
        pad, anchor = causal_width - count, len(context) - 1
        block, scratch = range(anchor, anchor + block_size), range(anchor + block_size, anchor + block_size + pad)
        causal = range(done, anchor)
        rows = (
            [mask_id] * pad + context[done:anchor] + [context[-1]] + [mask_id] * (block_size - 1),
            [0] * pad + [*causal, *block],
            [*scratch, *causal, *block],  # padding in scratch columns after the block, the rest at its positions
            [0] * pad + [p + 1 for p in causal] + [anchor] * block_size,
            [*scratch] + [0] * count + [anchor] * block_size,
            [c + 1 for c in scratch] + [0] * count + [anchor + block_size] * block_size,
        )
        for values, row in zip(fields, rows):
            values.append(row)
    return PassLayout(*torch.tensor(fields, dtype=torch.long))


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
                     fixed: bool = False) -> tuple[PassLayout, int]:
    """ONE packed pass: per row `[padding, uncached tokens, drafts, block_1, ..., block_K]`. anchors[r] lists its
    blocks as `(token, j)`: the block `[token, M, ...]` sits at position `len(context) + j` and sees the context and
    the first `j` drafts (the full-acceptance branch is `(drafts[-1], len(drafts) - 1)`). Rows with fewer blocks
    repeat their last one. Blocks and padding go to scratch columns; `fixed`: the causal part at least `2B` wide
    (fixed shapes). Returns the layout and the blocks per row."""
    uncached = [len(context) - done + len(row_drafts) for context, done, row_drafts in zip(contexts, committed, drafts)]
    causal_width = max([2 * block_size if fixed else 0, *uncached])
    blocks = max(len(row) for row in anchors)
    layout = PassLayout.empty(len(contexts), causal_width + blocks * block_size, mask_id)
    masks = [mask_id] * (block_size - 1)
    for row, (context, done, row_drafts, row_anchors) in enumerate(zip(contexts, committed, drafts, anchors)):
        pad = causal_width - uncached[row]
        layout.put_causal(row, pad, context[done:] + row_drafts, done)
        scratch = len(context) + len(row_drafts)
        for k in range(blocks):
            token, j = row_anchors[min(k, len(row_anchors) - 1)]
            column = causal_width + k * block_size
            layout.put_block(row, column, [token] + masks, len(context) + j, scratch + k * block_size, block_size)
        layout.put_padding(row, slice(0, pad), scratch + blocks * block_size)
    return layout, blocks


def successor_pass(drafter, cache: StaticKVCache, contexts: list[list[int]], committed: list[int],
                   drafts: list[list[int]], anchors: list[list[tuple[int, int]]], forward=None) -> torch.Tensor:
    """Raw logits `(rows, blocks, B - 1, vocab)` of every branch block's masked positions (see `successor_layout`).
    On return each row's cache holds its context and drafts (commit as far as verification accepts)."""
    block_size = drafter.config.block_size
    layout, blocks = successor_layout(contexts, committed, drafts, anchors, block_size, drafter.config.mask_token_id,
                                      fixed_shapes(forward))
    logits = run_pass(drafter, cache, layout, blocks * block_size, forward=forward)
    return logits.reshape(len(contexts), blocks, block_size, -1)[:, :, 1:]


__all__ = [
    "CompiledForward", "PassLayout", "block_layout_for_rows", "compiled_forward", "fixed_shapes", "block_pass", "choose", "context_free", "plan_alternatives",
    "prefill", "process", "run_pass", "successor_layout", "successor_pass",
]
