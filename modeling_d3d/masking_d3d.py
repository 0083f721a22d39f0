"""The one attention rule of D3D, shared by packed training, block drafting and the packed successor pass.

Every token of a forward pass is either *causal* (block id -1: prompt, response or accepted tokens) or belongs to
diffusion block `k >= 0` (`[anchor, M, ..., M]`). The rule, for a query `q` and a key `kv` (absolute indices over
cache + input):

- causal query: sees causal keys `kv <= q`, never a block;
- block-`k` query: sees causal keys `kv < visible_prefix[q]` (the prefix before its anchor) and every key of
  block `k` (bidirectional), nothing else.
"""

from collections.abc import Callable

import torch
from transformers import PreTrainedConfig
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

CAUSAL_BLOCK_ID = -1
_MASK_CAPABLE_ATTENTION = ("sdpa", "eager", "flex_attention")


def block_diffusion_mask_function(block_ids: torch.Tensor, visible_prefix: torch.Tensor) -> Callable:
    """Mask function in the `transformers.masking_utils` convention (`True` = may attend).

    block_ids, visible_prefix: `(batch, kv_length)`, indexed by absolute position over cache + input.
    """

    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        q_block = block_ids[batch_idx, q_idx]
        kv_block = block_ids[batch_idx, kv_idx]
        kv_is_causal = kv_block == CAUSAL_BLOCK_ID
        q_is_causal = q_block == CAUSAL_BLOCK_ID
        causal_sees = q_is_causal & kv_is_causal & (kv_idx <= q_idx)
        block_sees_prefix = ~q_is_causal & kv_is_causal & (kv_idx < visible_prefix[batch_idx, q_idx])
        block_sees_itself = ~q_is_causal & (kv_block == q_block)
        return causal_sees | block_sees_prefix | block_sees_itself

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
    if implementation not in _MASK_CAPABLE_ATTENTION:
        raise ValueError(
            f"D3D block diffusion needs an arbitrary attention mask; attn_implementation={implementation!r} cannot "
            f"take one. Use one of {_MASK_CAPABLE_ATTENTION}."
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
    """The same rule in the cache columns of a `caches_d3d.StaticKVCache`, for the engine's passes.

    Query `(r, j)` sees column `c` iff `c < prefix_end[r, j]` (its causal prefix: causal columns hold the token at
    that position) or `own_start[r, j] <= c < own_end[r, j]` (its own block, placed in scratch columns). A causal
    token at position `t` has `prefix_end = t + 1` and an empty own range; a block token sees the prefix before its
    anchor and its block. All three `(rows, width)` long. Returns `(rows, 1, width, kv_length)`: boolean for sdpa,
    additive for eager.
    """
    implementation = config._attn_implementation or "sdpa"
    if implementation not in ("sdpa", "eager"):
        raise ValueError(f"The D3D engine builds explicit masks for sdpa or eager attention, not {implementation!r}")
    columns = torch.arange(kv_length, device=prefix_end.device)[None, None, :]
    visible = (columns < prefix_end[..., None]) | ((columns >= own_start[..., None]) & (columns < own_end[..., None]))
    visible = visible[:, None]
    if implementation == "sdpa":
        return visible
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, torch.finfo(dtype).min)


__all__ = ["CAUSAL_BLOCK_ID", "block_diffusion_mask_function", "block_layout", "create_block_diffusion_mask", "interval_mask"]
