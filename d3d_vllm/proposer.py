"""The D3D proposer: vLLM's draft-model proposer drafting a D3D block in two passes per drafting step.

A D3D drafter attends causally over the verified prefix and bidirectionally inside the block `[anchor, M x (B-1)]`,
masked position j predicting the token at anchor + j (its own position). GPU attention backends take causality as
one flag for the whole batch, so each drafting step is two passes, each uniform in causality:

1. **causal**, over the tokens the target just ran (the previous anchor and drafts, or a prompt chunk), at their
   positions: writes the drafter's causal K/V of the newly verified tokens. Rejected drafts ride along (the batch
   keeps vLLM's padded layout); their K/V lands in slots at and past the anchor that pass 2 overwrites before
   reading. Its outputs are not read.
2. **non-causal**, over the block of every request (B query tokens each, the anchor being vLLM's next token):
   each block position sees the whole cached prefix and the whole block; the drafts are read at masks 1..K. The
   block's K/V (the anchor's included, which is not the causal one) is scratch: the next step's pass 1 writes the
   causal K/V over those slots.
"""

import torch
from typing_extensions import override
from vllm.config import VllmConfig
from vllm.config.utils import replace
from vllm.forward_context import set_forward_context
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.spec_decode.draft_model import DraftModelProposer
from vllm.v1.spec_decode.utils import PADDING_SLOT_ID

from .config import check_attention_backends, check_drafting, d3d_config


class D3DProposer(DraftModelProposer):
    """Drafts `num_speculative_tokens` (<= B - 1) tokens per request from one D3D block, in two passes."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner=None):
        super().__init__(vllm_config=vllm_config, device=device, runner=runner)
        config = d3d_config(self.speculative_config)
        check_drafting(config, self.num_speculative_tokens, self.parallel_drafting)
        if self.use_heterogeneous_vocab:
            raise ValueError("D3D drafter: use_heterogeneous_vocab is not supported (the drafter shares the target's "
                             "vocabulary)")
        self.d3d_block_size: int = config.block_size
        self.mask_token_id: int = config.mask_token_id
        self.block_offsets = torch.arange(config.block_size, device=device, dtype=torch.int64)
        # Where each request's block starts in the block pass (B per request): query starts and draft indices.
        self.block_starts = torch.arange(self.max_batch_size + 1, device=device, dtype=torch.int64) * config.block_size

    @override
    def _create_draft_vllm_config(self) -> VllmConfig:
        """The drafter's layers select an attention backend that can run the non-causal block pass (as DFlash's)."""
        base = super()._create_draft_vllm_config()
        return replace(base, attention_config=replace(base.attention_config, use_non_causal=True))

    @override
    def initialize_attn_backend(
        self, kv_cache_config: KVCacheConfig, kernel_block_sizes: list[int] | None = None
    ) -> None:
        """vLLM's, then refuse (one line) an attention backend that cannot run a non-causal pass."""
        super().initialize_attn_backend(kv_cache_config, kernel_block_sizes)
        check_attention_backends([group.backend for group in self.draft_attn_groups])

    @override
    def propose(
        self,
        num_speculative_tokens: int,
        target_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        target_hidden_states: torch.Tensor,
        next_token_ids: torch.Tensor,
        token_indices_to_sample: torch.Tensor | None,
        common_attn_metadata: CommonAttentionMetadata,
        sampling_metadata: SamplingMetadata,
        mm_embed_inputs: tuple[list[torch.Tensor], torch.Tensor] | None = None,
        num_rejected_tokens_gpu: torch.Tensor | None = None,
        slot_mappings=None,
    ) -> torch.Tensor:
        """Drafts `[batch, num_speculative_tokens]`: pass 1 over `target_token_ids` `[num_tokens]` (the target's
        query tokens, rejected ones included) with the target's `common_attn_metadata`, then pass 2 over the
        blocks `[batch * B]` starting at each request's anchor `next_token_ids` `[batch]`."""
        self.num_speculative_tokens = num_speculative_tokens
        self._last_draft_probs = None
        cad = common_attn_metadata
        num_tokens = target_token_ids.shape[0]
        self.input_ids[:num_tokens] = target_token_ids
        self._set_positions(num_tokens, target_positions)
        self._forward(num_tokens, cad, mm_embed_inputs, causal=True)
        if num_speculative_tokens == 0:  # vLLM's dynamic speculation chose none: pass 1 kept the cache in step
            return torch.empty(cad.num_reqs, 0, device=self.device, dtype=torch.int64)

        verified = cad.seq_lens if num_rejected_tokens_gpu is None else cad.seq_lens - num_rejected_tokens_gpu
        block_cad = self._set_block_inputs(next_token_ids, verified, cad)
        hidden_states = self._forward(block_cad.num_actual_tokens, block_cad, None, causal=False)
        masks = self.block_starts[: cad.num_reqs, None] + self.block_offsets[1 : 1 + num_speculative_tokens]
        drafts, probs = self._sample_draft_tokens(hidden_states[masks.view(-1)], sampling_metadata)
        if probs is not None:
            self._last_draft_probs = probs.view(-1, num_speculative_tokens, probs.shape[-1]).contiguous()
        return drafts.view(-1, num_speculative_tokens)

    def _set_block_inputs(
        self, next_token_ids: torch.Tensor, anchor_positions: torch.Tensor, cad: CommonAttentionMetadata
    ) -> CommonAttentionMetadata:
        """Write every request's block `[anchor, M x (B-1)]` (anchors `next_token_ids` `[batch]`) at positions
        `anchor_positions[r] + 0..B-1` into the input buffers; return the blocks' non-causal metadata (B queries
        per request, each seeing the cache up to its block's end). Positions past `max_model_len` are clamped and
        their K/V not written (no draft there is ever verified)."""
        batch, block_size = cad.num_reqs, self.d3d_block_size
        num_tokens = batch * block_size
        positions = anchor_positions.to(torch.int64)[:, None] + self.block_offsets  # [batch, B]
        clamped = positions.clamp(max=self.max_model_len - 1)
        block_table = cad.block_table_tensor[:batch]
        block_numbers = block_table.gather(1, clamped // self.block_size).to(torch.int64)
        slots = block_numbers * self.block_size + clamped % self.block_size
        slots.masked_fill_(positions >= self.max_model_len, PADDING_SLOT_ID)
        block_ids = self.input_ids[:num_tokens].view(batch, block_size)
        block_ids.fill_(self.mask_token_id)
        block_ids[:, 0] = next_token_ids
        self._set_positions(num_tokens, clamped.view(-1))
        upper_bound = cad.seq_lens_cpu_upper_bound
        return CommonAttentionMetadata(
            query_start_loc=self.block_starts[: batch + 1].to(torch.int32),
            query_start_loc_cpu=torch.from_numpy(self.token_arange_np[: batch + 1] * block_size),
            seq_lens=(positions[:, -1] + 1).clamp(max=self.max_model_len).to(cad.seq_lens.dtype),
            seq_lens_cpu_upper_bound=None if upper_bound is None
            else (upper_bound + block_size).clamp(max=self.max_model_len),
            num_reqs=batch,
            num_actual_tokens=num_tokens,
            max_query_len=block_size,
            max_seq_len=min(cad.max_seq_len + block_size, self.max_model_len),
            block_table_tensor=block_table,
            slot_mapping=slots.view(-1),
            causal=False,
        )

    def _forward(
        self,
        num_tokens: int,
        cad: CommonAttentionMetadata,
        mm_embed_inputs: tuple[list[torch.Tensor], torch.Tensor] | None,
        causal: bool,
    ) -> torch.Tensor:
        """The drafter's last hidden states `[num_tokens (padded), hidden]` over the first `num_tokens` of the input
        buffers, attending as `cad` says (`causal` False: checked in what the backend built, as vLLM's DFlash
        does), padded to vLLM's CUDA graph sizes as its own drafting passes are."""
        per_group, per_layer = self.build_per_group_and_layer_attn_metadata(cad)
        if not causal and any(getattr(metadata, "causal", None) is not False for metadata in per_group):
            raise RuntimeError("D3D drafter: the attention backend built a causal metadata for the block pass")
        cudagraph_mode, num_input_tokens, num_tokens_across_dp = self._determine_batch_execution_and_padding(
            num_tokens
        )
        model_kwargs, slot_mapping_size = self.build_model_inputs_first_pass(
            num_tokens, num_input_tokens, mm_embed_inputs
        )
        with set_forward_context(
            per_layer,
            self.vllm_config,
            num_tokens=num_input_tokens,
            num_tokens_across_dp=num_tokens_across_dp,
            cudagraph_runtime_mode=cudagraph_mode,
            slot_mapping=self._get_slot_mapping(slot_mapping_size, cad.slot_mapping),
        ):
            return self.model(**model_kwargs)
