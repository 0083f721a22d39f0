"""vLLM plugin for D3D block-diffusion drafters (entry point `vllm.general_plugins: d3d = d3d_vllm:register`).

Serve a target with a D3D drafter through vLLM's draft-model speculative decoding:
`speculative_config={"method": "draft_model", "model": DRAFTER, "parallel_drafting": True,
"num_speculative_tokens": K}` with `K <= block_size - 1`. Modules: `config` (the `d3d` config), `model` (the
drafter network in vLLM), `proposer` (the drafting step: a causal pass, then the non-causal block pass),
`patches` (where vLLM is told about D3D); `generate` is the worker of `d3d generate-data --engine vllm`.
"""


def register() -> None:
    """Register the D3D config and architecture and hook the D3D proposer into vLLM (runs in every vLLM process)."""
    from vllm import ModelRegistry

    from .config import register_config
    from .patches import apply

    register_config()
    ModelRegistry.register_model("D3DForBlockDiffusion", "d3d_vllm.model:D3DForBlockDiffusion")
    apply()
