"""Models with random weights, built directly on their device: what the speed and GPU checks time (only shapes and
costs matter there, not weights). The one builder of random models in the benchmarks."""

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from modeling_d3d import D3DForBlockDiffusion


def random_causal_lm(config: Qwen3Config, device: torch.device | str, dtype: torch.dtype,
                     seed: int | None = None) -> Qwen3ForCausalLM:
    """A Qwen3 causal LM of `config` with random weights (`torch.manual_seed(seed)` first unless None), on
    `device` in `dtype`, in eval mode."""
    if seed is not None:
        torch.manual_seed(seed)
    with torch.device(device):
        return Qwen3ForCausalLM._from_config(config, dtype=dtype).eval()


def random_drafter(config: Qwen3Config, device: torch.device | str, dtype: torch.dtype, block_size: int,
                   mask_token_id: int | None = None, seed: int | None = None) -> D3DForBlockDiffusion:
    """A D3D drafter on a random Qwen3 backbone of `config` (`random_causal_lm`), block `block_size`, mask token
    `mask_token_id` (None: the drafter's default), on `device` in `dtype`, in eval mode."""
    backbone = random_causal_lm(config, device, dtype, seed)
    return D3DForBlockDiffusion.from_backbone(backbone, block_size=block_size, mask_token_id=mask_token_id).eval()


__all__ = ["random_causal_lm", "random_drafter"]
