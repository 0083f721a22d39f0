"""The one attention rule of D3D, shared by packed training, block drafting and the packed successor pass.

The rule, in one encoding (`sees`): query `q` may attend to key (or cache column) `kv` iff

    kv < prefix_end[q]   or   own_start[q] <= kv < own_end[q]

- a *causal* token (prompt, response or accepted tokens) at index `t`: `prefix_end = t + 1`, its own range empty
  (`own_start = own_end = 0`): it sees every key up to itself;
- a token of a diffusion block `[anchor, M, ..., M]`: `prefix_end` = the index of the block's anchor (it sees the
  causal prefix before the anchor) and `[own_start, own_end)` = its block's indices (bidirectional in the block).

Training and the model's own passes describe tokens by role instead: `block_ids` (-1: causal, `k >= 0`: block `k`)
and `visible_prefix` (a causal token: its index + 1; a block token: its anchor's index), as `block_layout` lays them
out: causal tokens first, then blocks each in consecutive indices. `block_intervals` derives the rule's fields from
them (`prefix_end = visible_prefix`; `own_*` = the span of the token's block), so both masks come from `sees`:
`create_block_diffusion_mask` over the tokens' indices, `interval_mask` over the cache columns of the engine's
passes (whose `passes_d3d.PassLayout` carries `prefix_end`, `own_start`, `own_end` directly, blocks in scratch
columns).
"""

from collections.abc import Callable

import torch
from transformers import PreTrainedConfig
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

CAUSAL_BLOCK_ID = -1
# The one list of attention implementations: those that take the block mask (training, the reference pass), and
# those the engine's explicit static-cache masks are built for (`interval_mask`).
MASK_CAPABLE_ATTENTION = ("sdpa", "eager", "flex_attention")
ENGINE_ATTENTION = ("sdpa", "eager")


def sees(kv_idx, prefix_end, own_start, own_end):
    """The rule: key / column `kv_idx` is visible to a query with these fields (tensors broadcast)."""
    return (kv_idx < prefix_end) | ((kv_idx >= own_start) & (kv_idx < own_end))


def block_intervals(block_ids: torch.Tensor, visible_prefix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rule's fields `(prefix_end, own_start, own_end)`, each `(batch, length)`, of tokens described by role,
    `block_ids` and `visible_prefix` `(batch, length)` laid out as `block_layout` does (each block in consecutive
    indices, after the causal tokens it may see)."""
    length = block_ids.shape[1]
    index = torch.arange(length, device=block_ids.device).expand_as(block_ids)
    starts_run = torch.ones_like(block_ids, dtype=torch.bool)
    starts_run[:, 1:] = block_ids[:, 1:] != block_ids[:, :-1]
    ends_run = torch.ones_like(block_ids, dtype=torch.bool)
    ends_run[:, :-1] = block_ids[:, :-1] != block_ids[:, 1:]
    run_start = torch.where(starts_run, index, 0).cummax(dim=-1).values
    run_end = torch.where(ends_run, index + 1, length).flip(-1).cummin(dim=-1).values.flip(-1)
    in_block = block_ids != CAUSAL_BLOCK_ID
    return visible_prefix, torch.where(in_block, run_start, 0), torch.where(in_block, run_end, 0)


def block_diffusion_mask_function(block_ids: torch.Tensor, visible_prefix: torch.Tensor) -> Callable:
    """Mask function in the `transformers.masking_utils` convention (`True` = may attend): `sees` over the fields
    `block_intervals` derives.

    block_ids, visible_prefix: `(batch, kv_length)`, indexed by absolute position over cache + input.
    """
    prefix_end, own_start, own_end = block_intervals(block_ids, visible_prefix)

    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        return sees(kv_idx, prefix_end[batch_idx, q_idx], own_start[batch_idx, q_idx], own_end[batch_idx, q_idx])

    return inner_mask


def block_layout(
    num_causal: int, block_starts: torch.Tensor, block_size: int, past_length: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Roles of the tokens `[causal x num_causal, block_0, ..., block_{K-1}]` that follow `past_length` cached tokens.

    block_starts: `(batch, K)` absolute index of each block's anchor; the block sees the causal tokens before it and
    its position ids continue from it (`start, start + 1, ...`).
    Returns `block_ids`, `visible_prefix`, `position_ids`, each `(batch, num_causal + K * block_size)`.
    """
    batch, num_blocks = block_starts.shape
    device = block_starts.device
    causal_positions = torch.arange(past_length, past_length + num_causal, device=device).expand(batch, -1)
    offsets = torch.arange(block_size, device=device)
    block_positions = (block_starts[:, :, None] + offsets).reshape(batch, -1)
    position_ids = torch.cat([causal_positions, block_positions], dim=1)

    block_of_token = torch.arange(num_blocks, device=device).repeat_interleave(block_size).expand(batch, -1)
    causal_ids = torch.full((batch, num_causal), CAUSAL_BLOCK_ID, device=device, dtype=torch.long)
    block_ids = torch.cat([causal_ids, block_of_token], dim=1)

    visible_prefix = torch.cat(
        [causal_positions + 1, block_starts.repeat_interleave(block_size, dim=1)], dim=1
    )
    return block_ids, visible_prefix, position_ids


def create_block_diffusion_mask(
    config: PreTrainedConfig,
    inputs_embeds: torch.Tensor,
    block_ids: torch.Tensor,
    visible_prefix: torch.Tensor,
    past_length: int = 0,
    attention_mask: torch.Tensor | None = None,
):
    """The attention mask for the configured attention backend (boolean for sdpa, additive float for eager).

    inputs_embeds: `(batch, q_length, hidden)`, only for batch size, dtype and device.
    block_ids, visible_prefix: `(batch, q_length)` roles of the new tokens (cached tokens are always causal).
    attention_mask: optional 2D padding mask `(batch, past_length + q_length)`, 1 for real tokens.
    """
    implementation = config._attn_implementation or "sdpa"
    if implementation not in MASK_CAPABLE_ATTENTION:
        raise ValueError(
            f"D3D block diffusion needs an arbitrary attention mask; attn_implementation={implementation!r} cannot "
            f"take one. Use one of {MASK_CAPABLE_ATTENTION}."
        )
    batch, q_length = block_ids.shape
    cached = torch.full((batch, past_length), CAUSAL_BLOCK_ID, dtype=torch.long, device=block_ids.device)
    full_block_ids = torch.cat([cached, block_ids], dim=1)
    cached_prefix = torch.arange(1, past_length + 1, device=block_ids.device).expand(batch, -1)
    full_visible = torch.cat([cached_prefix, visible_prefix], dim=1)
    return ALL_MASK_ATTENTION_FUNCTIONS[implementation](
        batch_size=batch,
        q_length=q_length,
        kv_length=past_length + q_length,
        q_offset=past_length,
        kv_offset=0,
        mask_function=block_diffusion_mask_function(full_block_ids, full_visible),
        attention_mask=attention_mask.bool() if attention_mask is not None else None,
        allow_is_causal_skip=False,
        dtype=inputs_embeds.dtype,
        device=inputs_embeds.device,
        config=config,
    )


def interval_mask(
    config: PreTrainedConfig,
    prefix_end: torch.Tensor,
    own_start: torch.Tensor,
    own_end: torch.Tensor,
    kv_length: int,
    dtype: torch.dtype,
):
    """The rule (`sees`) in the cache columns of a `caches_d3d.StaticKVCache`, for the engine's passes.

    Query `(r, j)` sees column `c` iff `c < prefix_end[r, j]` (its causal prefix: causal columns hold the token at
    that position) or `own_start[r, j] <= c < own_end[r, j]` (its own block, placed in scratch columns). All three
    `(rows, width)` long. Returns `(rows, 1, width, kv_length)`: boolean for sdpa, additive for eager.
    """
    implementation = config._attn_implementation or "sdpa"
    if implementation not in ENGINE_ATTENTION:
        raise ValueError(f"The D3D engine builds explicit masks for {' or '.join(ENGINE_ATTENTION)} attention, not "
                         f"{implementation!r}")
    # built in its final shape, never as a view: a compiled pass given a view guards on the viewed tensor's sizes too,
    # which it does not mark dynamic (one more compile at the first new cache size)
    columns = torch.arange(kv_length, device=prefix_end.device)
    visible = sees(columns, prefix_end[:, None, :, None], own_start[:, None, :, None], own_end[:, None, :, None])
    if implementation == "sdpa":
        return visible
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, torch.finfo(dtype).min)


__all__ = ["CAUSAL_BLOCK_ID", "ENGINE_ATTENTION", "MASK_CAPABLE_ATTENTION", "block_diffusion_mask_function", "block_intervals", "block_layout",
           "create_block_diffusion_mask", "interval_mask", "sees"]
