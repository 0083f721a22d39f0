"""The D3D proposer: vLLM's draft-model proposer with D3D's block layout in its single (parallel) drafting pass.

vLLM's parallel drafting (PARD) appends `[next token, M x (K-1)]` to each request, runs it causally and reads the
K drafts at those K positions, each predicting the position after it. A D3D drafter was trained differently: the
block `[anchor, M x (B-1)]` attends bidirectionally inside itself and causally over the prefix, and masked position
j predicts the token at anchor + j (its own position). So this proposer appends the full block of B slots (the
anchor is vLLM's next token), splits every request into two pseudo-requests sharing its block-table row (the
verified prefix, causal; the block, non-causal over prefix and block), and reads the drafts at masks 1..K.
"""

import numpy as np
import torch
from typing_extensions import override
from vllm.config import VllmConfig
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.spec_decode.draft_model import DraftModelProposer

from .config import check_drafting, d3d_config


class D3DProposer(DraftModelProposer):
    """Drafts `num_speculative_tokens` (<= B - 1) tokens per request from one D3D block pass."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner=None):
        super().__init__(vllm_config=vllm_config, device=device, runner=runner)
        config = d3d_config(self.speculative_config)
        check_drafting(config, self.num_speculative_tokens, self.parallel_drafting)
        self.d3d_block_size: int = config.block_size
        # The whole block is laid out whatever K is, so the drafts are those of the block the drafter was trained on.
        self.extra_slots_per_request = config.block_size
        self.net_num_new_slots_per_request = config.block_size

    @override
    def set_inputs_first_pass(
        self,
        target_token_ids: torch.Tensor,
        next_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        target_hidden_states: torch.Tensor,
        token_indices_to_sample: torch.Tensor | None,
        cad: CommonAttentionMetadata,
        num_rejected_tokens_gpu: torch.Tensor | None,
    ) -> tuple[int, torch.Tensor, CommonAttentionMetadata]:
        """vLLM's parallel-drafting layout with B new slots per request (`[prefix, anchor, M x (B-1), rejected]`),
        then the block-diffusion attention and the mask positions to sample."""
        num_tokens, block_indices, cad = super().set_inputs_first_pass(
            target_token_ids, next_token_ids, target_positions, target_hidden_states, token_indices_to_sample, cad,
            num_rejected_tokens_gpu,
        )
        blocks = block_indices.view(-1, self.d3d_block_size).long()
        anchor_positions = self.positions[blocks[:, 0]].to(torch.int32)
        drafts = blocks[:, 1 : 1 + self.num_speculative_tokens].reshape(-1).to(block_indices.dtype)
        return num_tokens, drafts, block_diffusion_metadata(cad, blocks[:, 0], anchor_positions, self.d3d_block_size)


def block_diffusion_metadata(
    cad: CommonAttentionMetadata, anchor_indices: torch.Tensor, anchor_positions: torch.Tensor, block_size: int
) -> CommonAttentionMetadata:
    """Split each request of `cad` at its anchor into two pseudo-requests on the same block-table row.

    The prefix pseudo-request (tokens before the anchor) is causal and sees the cache up to the anchor; the block
    pseudo-request (the anchor, its B - 1 masks and any trailing rejected slots, whose outputs are never read and
    whose KV is never written) is non-causal and sees the cache up to the block's end, so every block position
    attends to the whole prefix and the whole block. Per-request causality is the `causal` tensor the CPU attention
    backend accepts (`dynamic_causal`)."""
    num_reqs = cad.num_reqs
    anchor_indices = anchor_indices.to(cad.query_start_loc.dtype)
    query_start_loc = torch.stack([cad.query_start_loc[:-1], anchor_indices], dim=1).reshape(-1)
    query_start_loc = torch.cat([query_start_loc, cad.query_start_loc[-1:]])
    seq_lens = torch.stack([anchor_positions, anchor_positions + block_size], dim=1).reshape(-1).to(cad.seq_lens.dtype)
    causal = torch.tensor([1, 0], dtype=torch.int32, device=seq_lens.device).repeat(num_reqs)
    query_start_loc_cpu = query_start_loc.cpu()
    seq_lens_cpu = seq_lens.cpu()
    return cad.replace(
        query_start_loc=query_start_loc,
        query_start_loc_cpu=query_start_loc_cpu,
        seq_lens=seq_lens,
        seq_lens_cpu_upper_bound=seq_lens_cpu,
        num_reqs=2 * num_reqs,
        max_query_len=int((query_start_loc_cpu[1:] - query_start_loc_cpu[:-1]).max()),
        max_seq_len=int(seq_lens_cpu.max()),
        block_table_tensor=cad.block_table_tensor.repeat_interleave(2, dim=0),
        causal=causal,
        is_prefilling=None if cad.is_prefilling is None else cad.is_prefilling.repeat_interleave(2),
        req_idx=None if cad.req_idx is None else np.repeat(cad.req_idx, 2),
        _num_computed_tokens_cache=None,
        _token_to_req_indices_cache=None,
    )
