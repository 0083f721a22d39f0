"""The `d3d` config in vLLM's environment (transformers < 5.20 there): Qwen3 fields plus the block-diffusion ones."""

from transformers import AutoConfig, Qwen3Config


class D3DConfig(Qwen3Config):
    """Just what vLLM reads from a D3D drafter's config.json: the Qwen3 backbone, `block_size` (B: one anchor and
    B - 1 masks per drafting pass) and `mask_token_id`. The project's `modeling_d3d.D3DConfig` validates them when
    the drafter is built; here they are only checked to be usable for drafting."""

    model_type = "d3d"

    block_size: int = 16
    mask_token_id: int | None = None


def register_config() -> None:
    """Let `AutoConfig` (and so vLLM) read `model_type: d3d` without remote code."""
    AutoConfig.register("d3d", D3DConfig, exist_ok=True)


def d3d_config(speculative_config) -> D3DConfig | None:
    """The drafter's config when `speculative_config` drafts with a D3D model, else None."""
    draft = getattr(speculative_config, "draft_model_config", None)
    if speculative_config is None or draft is None or speculative_config.method != "draft_model":
        return None
    hf_config = draft.hf_config
    return hf_config if getattr(hf_config, "model_type", None) == "d3d" else None


def check_drafting(config: D3DConfig, num_speculative_tokens: int, parallel_drafting: bool) -> None:
    """Raise `ValueError` (one line) unless vLLM's speculative settings can draft with this D3D config."""
    if config.mask_token_id is None or not 0 <= config.mask_token_id < config.vocab_size:
        raise ValueError(f"D3D drafter: mask_token_id {config.mask_token_id} is not a vocabulary id")
    if not 1 <= num_speculative_tokens <= config.block_size - 1:
        raise ValueError(
            f"D3D drafter: num_speculative_tokens must be 1..{config.block_size - 1} (block_size - 1), "
            f"got {num_speculative_tokens}"
        )
    if not parallel_drafting:
        raise ValueError("D3D drafter: set parallel_drafting: true in the speculative config (one pass drafts a block)")


def check_attention_backends(backends: list) -> None:
    """Raise `ValueError` (one line) unless every attention backend of the drafter runs a non-causal pass."""
    causal_only = sorted({backend.get_name() for backend in backends if not backend.supports_non_causal()})
    if causal_only:
        raise ValueError(
            f"D3D drafter: attention backend {', '.join(causal_only)} cannot run the non-causal block pass; choose "
            "one that can (FLASH_ATTN, FLASHINFER, FLEX_ATTENTION, TRITON_ATTN; CPU_ATTN on CPUs) with the "
            "speculative config's attention_backend"
        )
