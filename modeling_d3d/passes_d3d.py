"""One forward pass over rows of a `StaticKVCache`, for the target (verify, prefill) and the drafter alike.

A `PassLayout` says, per row and input column, the token, its rotary position, the cache column it is written to
and what it sees (`masking_d3d.interval_mask`); `run_pass` plans the cache, builds the mask and runs the model (or
its `compiled_forward`); `prefill` commits a prompt to one slot.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .caches_d3d import StaticKVCache
from .masking_d3d import interval_mask
from .streams_d3d import upload


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
             forward=None, tail: torch.Tensor | None = None, float32: bool = True) -> torch.Tensor:
    """One forward of `model` (a target or a drafter) over `layout` on cache rows `first_row..`; returns the logits of
    the last `logits_to_keep` input columns, `(rows, logits_to_keep, vocab)`, float32 (or the model's dtype with
    `float32=False`, for callers that only rank them). `forward`: a compiled `model.forward` (`CompiledForward`) to
    use instead; with fixed shapes it attends over every cache column (else, as eager passes, over the columns in use
    only). tail: `(rows, n)` token ids already on a device (a verify pass's drafts), put in the last `n` input
    columns on the device, so they never go through the host.

    The layout goes to the device in one copy (`streams_d3d.upload`), queued without blocking the host."""
    device = cache.device
    rows = layout.ids.shape[0]
    kv_length = cache.capacity if fixed_shapes(forward) else layout.kv_length()
    fields = upload(torch.stack([layout.ids, layout.positions, layout.write_index, layout.prefix_end,
                                 layout.own_start, layout.own_end]), device)
    ids, positions, write_index, prefix_end, own_start, own_end = fields.unbind(0)
    if tail is not None:
        ids[:, ids.shape[1] - tail.shape[1]:] = tail.to(device, non_blocking=True)
    cache.plan(rows, write_index, kv_length, first_row)
    mask = interval_mask(model.config, prefix_end, own_start, own_end, kv_length, model.dtype)
    output = (forward or model)(
        input_ids=ids, position_ids=positions, attention_mask={"full_attention": mask}, past_key_values=cache,
        use_cache=True, logits_to_keep=logits_to_keep,
    )
    return output.logits.float() if float32 else output.logits


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
    """Commit `tokens` (a prompt without its last token) to cache row `slot`, alone: `cache.committed[slot]` becomes
    their count."""
    if tokens:
        run_pass(model, cache, PassLayout.causal(torch.tensor([tokens]), torch.zeros(1, dtype=torch.long)), 1,
                 first_row=slot)
    cache.committed[slot] = len(tokens)


__all__ = ["CompiledForward", "PassLayout", "compiled_forward", "fixed_shapes", "prefill", "run_pass"]
