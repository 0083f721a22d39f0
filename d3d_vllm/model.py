"""The D3D drafter network in vLLM: vLLM's own Qwen3 causal LM under the drafter's architecture name.

The weights of a saved D3D drafter have Qwen3ForCausalLM's names, so loading is vLLM's; the block-diffusion mask is
not in the network but in the attention metadata the proposer builds (`d3d_vllm.proposer`)."""

from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM


class D3DForBlockDiffusion(Qwen3ForCausalLM):
    """A D3D drafter (`architectures: ["D3DForBlockDiffusion"]`, `model_type: d3d`) run by vLLM's Qwen3 code."""
