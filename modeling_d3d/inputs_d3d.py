"""The front doors' check of the prompts they take: one clear `ValueError` naming the shapes, never a raw error from
deep inside nor an attention mask silently ignored."""

import torch


def check_prompts(input_ids, attention_mask=None, one_prompt: bool = False) -> None:
    """Raise `ValueError` unless `input_ids` is `(batch, P)` token ids with P >= 1 (`one_prompt`: `(1, L)`, `(L,)`
    or a list of ids) and `attention_mask`, when given, has exactly its shape."""
    shape = tuple(torch.as_tensor(input_ids).shape)
    if one_prompt and not (len(shape) == 1 or (len(shape) == 2 and shape[0] == 1)):
        raise ValueError(f"This takes one prompt: input_ids of shape (1, L), (L,) or a list of ids; got shape {shape}")
    if not one_prompt and (len(shape) != 2 or shape[0] < 1):
        raise ValueError(f"input_ids must be a batch of prompts of shape (batch, P), left-padded; got shape {shape}")
    if shape[-1] < 1:
        raise ValueError(f"A prompt needs at least one token; got input_ids of shape {shape}")
    if attention_mask is not None and tuple(torch.as_tensor(attention_mask).shape) != shape:
        raise ValueError(f"attention_mask of shape {tuple(torch.as_tensor(attention_mask).shape)} does not match "
                         f"input_ids of shape {shape} (one 0 or 1 per token, 0 at the left padding)")


__all__ = ["check_prompts"]
