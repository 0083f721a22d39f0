"""How a prompt becomes token ids, the same way for data generation, benchmarks and demos."""


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Prompt token ids: through the tokenizer's chat template (non-thinking) when it has one, else plain text."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": text}]
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, enable_thinking=False)
        return list(encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "keys") else encoded)
    return tokenizer(text, add_special_tokens=True)["input_ids"]


__all__ = ["encode_prompt"]
