"""Configuration of the D3D block-diffusion drafter: a Qwen3 decoder plus the block-diffusion settings."""

from transformers import Qwen3Config


class D3DConfig(Qwen3Config):
    r"""
    Configuration of [`D3DForBlockDiffusion`]: every field of [`Qwen3Config`] plus

    block_size (`int`, defaults to 16):
        Tokens per diffusion block `B`: one anchor followed by `B - 1` mask tokens, so one drafting pass proposes
        `B - 1` tokens.
    mask_token_id (`int`, *optional*):
        The reserved vocabulary token used as `[M]`. Required before drafting or training; it must lie inside the
        vocabulary and must not be a special or added token of the tokenizer (see [`D3DConfig.check_mask_token`]).
    """

    model_type = "d3d"

    block_size: int = 16
    mask_token_id: int | None = None

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self.check_block_diffusion()

    def check_block_diffusion(self) -> None:
        """Raise `ValueError` unless the block size, mask id and attention layout are usable for block diffusion."""
        if not isinstance(self.block_size, int) or self.block_size < 2:
            raise ValueError(f"block_size must be an integer >= 2 (one anchor and at least one mask), got {self.block_size}")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is outside the vocabulary (valid ids: 0..{self.vocab_size - 1})"
            )
        if any(layer_type != "full_attention" for layer_type in self.layer_types):
            raise ValueError("D3D needs full attention in every layer; sliding-window layers are not supported")

    def require_mask_token(self) -> int:
        """`mask_token_id`; `ValueError` (the one message) when it is unset."""
        if self.mask_token_id is None:
            raise ValueError("This drafter has no mask_token_id; set config.mask_token_id "
                             "(D3DForBlockDiffusion.from_backbone chooses one) before drafting or training")
        return self.mask_token_id

    def check_mask_token(self, tokenizer) -> None:
        """Raise `ValueError` if `mask_token_id` is unset or is one of `tokenizer`'s special or added tokens."""
        self.require_mask_token()
        special_ids = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
        if self.mask_token_id in special_ids:
            token = tokenizer.convert_ids_to_tokens(self.mask_token_id)
            raise ValueError(
                f"mask_token_id {self.mask_token_id} ({token!r}) is a special or added token of the tokenizer; "
                "choose a reserved, unused ordinary token"
            )


__all__ = ["D3DConfig"]
