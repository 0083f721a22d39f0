"""Run by the main environment: tiny models for the vLLM tests, built from configs (no downloads).

`python tests_vllm/build_models.py DIR` writes DIR/target (a Qwen3 causal LM, head_dim 64 as vLLM's CPU attention
needs, whose output norm keeps 2 channels so greedy decoding moves among a few tokens), DIR/drafter (a D3D
drafter from a noisy copy of the target: its drafts are often, not always, accepted) and DIR/wrong_vocab_drafter (a D3D drafter with a larger vocabulary), each with the same word-level tokenizer.
"""

import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from modeling_d3d import D3DForBlockDiffusion

VOCAB = 512
BLOCK_SIZE = 8


def tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    words = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab_size)}, unk_token="t2"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, bos_token="t0", eos_token="t1", unk_token="t2",
                                   pad_token="t3")


def qwen3(seed: int, vocab_size: int, channels: int | None = None) -> Qwen3ForCausalLM:
    """A random Qwen3; with `channels`, its output norm zeroes all hidden channels but the first `channels`."""
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=0, eos_token_id=1, pad_token_id=3)
    model = Qwen3ForCausalLM(config).float()
    with torch.no_grad():  # larger weights than the default init, so greedy paths are varied and ties are unlikely
        for parameter in model.parameters():
            parameter.mul_(8.0 if parameter.dim() > 1 else 1.0)
        if channels is not None:
            model.model.norm.weight[channels:] = 0.0
    return model


def noisy_copy(model: Qwen3ForCausalLM, seed: int, scale: float) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    copy = Qwen3ForCausalLM(model.config).float()
    copy.load_state_dict(model.state_dict())
    with torch.no_grad():
        for parameter in copy.parameters():
            parameter.add_(scale * parameter.std() * torch.randn_like(parameter))
    return copy


def save(model, vocab_size: int, folder: Path) -> None:
    model.save_pretrained(folder)
    tokenizer(vocab_size).save_pretrained(folder)


def main(out: Path) -> None:
    target = qwen3(0, VOCAB, channels=2)
    save(target, VOCAB, out / "target")
    drafter = D3DForBlockDiffusion.from_backbone(noisy_copy(target, 1, 0.1), block_size=BLOCK_SIZE)
    save(drafter, VOCAB, out / "drafter")
    save(D3DForBlockDiffusion.from_backbone(qwen3(2, VOCAB + 128), block_size=BLOCK_SIZE), VOCAB + 128,
         out / "wrong_vocab_drafter")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
