"""How a prompt becomes token ids, and prompts a batch, the same way for data generation, benchmarks and demos."""

import torch


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Prompt token ids: through the tokenizer's chat template (non-thinking) when it has one, else plain text."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": text}]
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, enable_thinking=False)
        return list(encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "keys") else encoded)
    return tokenizer(text, add_special_tokens=True)["input_ids"]


def left_pad(rows: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id rows -> left-padded ids and attention mask `(n, longest)`, the batch `generate` takes."""
    width = max(len(row) for row in rows)
    ids = torch.tensor([[pad_token_id] * (width - len(row)) + row for row in rows])
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])
    return ids, mask


__all__ = ["encode_prompt", "left_pad"]
