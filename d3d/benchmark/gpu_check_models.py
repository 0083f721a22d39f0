"""What the GPU checks share (`d3d.benchmark.gpu_check`): their sizes, random Qwen3-shaped models, heads forced towards
a token, random prompts, the models cache and the context every check reads."""

import contextlib
import gc
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from modeling_d3d import D3DForBlockDiffusion

from .random_models import random_causal_lm, random_drafter

PAPER_TAU = 7.88  # the paper's accepted length per round for the pruned D3D-8B (the timing projection's input)


@dataclass(frozen=True)
class Shapes:
    """Every size the checks use. Identity checks: `hidden`..`vocab` with `target_layers` / `drafter_layers`; the
    8B checks: `full_target_layers` / `full_drafter_layers` at the same width; `prompt_lengths`: the ragged batch
    (batch 1 uses the first)."""

    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 12288
    vocab: int = 151_936
    target_layers: int = 2
    drafter_layers: int = 1
    block_size: int = 16
    prompt_lengths: tuple[int, ...] = (21, 9, 14)
    max_new_tokens: int = 32
    logit_scale: float = 4.0
    full_target_layers: int = 36
    full_drafter_layers: int = 31
    prefix: int = 512
    timing_rows: tuple[int, ...] = (1,)
    timing_new_tokens: int = 48
    server_rows: int = 8
    server_length: int = 4096
    coverage: int = 12
    fanout: int = 2


SMOKE_SHAPES = Shapes(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=512,
                      prompt_lengths=(11, 5, 8), max_new_tokens=20, full_target_layers=4, full_drafter_layers=3,
                      prefix=64)


def model_config(shapes: Shapes, layers: int) -> Qwen3Config:
    """A Qwen3-shaped config (sdpa attention, untied head as in Qwen3-8B, no EOS: checks set their own)."""
    config = Qwen3Config(
        vocab_size=shapes.vocab, hidden_size=shapes.hidden, intermediate_size=shapes.intermediate,
        num_hidden_layers=layers, num_attention_heads=shapes.heads, num_key_value_heads=shapes.kv_heads,
        head_dim=shapes.head_dim, max_position_embeddings=40_960, tie_word_embeddings=False, eos_token_id=None,
    )
    config._attn_implementation = "sdpa"
    return config


def build_models(shapes: Shapes, target_layers: int, drafter_layers: int, dtype: torch.dtype,
                 device: torch.device, seed: int = 0) -> tuple[Qwen3ForCausalLM, D3DForBlockDiffusion]:
    """A random target and a random drafter (mask token: the last id), built on `device` in `dtype`."""
    target = random_causal_lm(model_config(shapes, target_layers), device, dtype, seed)
    drafter = random_drafter(model_config(shapes, drafter_layers), device, dtype, shapes.block_size, shapes.vocab - 1)
    return target, drafter


@torch.no_grad()
def scale_head(model, scale: float) -> None:
    """Multiply `model`'s output head by `scale` (logits and their margins grow by `scale`)."""
    model.lm_head.weight.mul_(scale)


@contextlib.contextmanager
def forced_head(model, token: int, bias: float = 1e4) -> Iterator[None]:
    """While inside: `model`'s head has a bias making `token` its argmax whatever the input (same weight, same cost).
    A drafter and a target both forced to one token accept every draft: what an all-hits round costs."""
    original = model.lm_head
    head = torch.nn.Linear(original.in_features, original.out_features, bias=True,
                           device=original.weight.device, dtype=original.weight.dtype)
    with torch.no_grad():
        head.weight = original.weight
        head.bias.zero_()
        head.bias[token] = bias
    model.lm_head = head
    try:
        yield
    finally:
        model.lm_head = original


def random_prompts(lengths: list[int], vocab: int, device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded random prompts `(rows, max length)` and their attention mask; ids avoid the mask token (last)."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, width - length:] = torch.randint(0, vocab - 1, (length,), generator=generator)
        mask[row, width - length:] = 1
    return ids.to(device), mask.to(device)


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class ModelCache:
    """The models the checks share, built on first use and dropped when the next check does not need them."""

    def __init__(self, shapes: Shapes, device: torch.device):
        self.shapes, self.device = shapes, device
        self.models: dict[str, tuple] = {}

    def get(self, kind: str) -> tuple:
        if kind not in self.models:
            self.models[kind] = self._build(kind)
        return self.models[kind]

    def keep_only(self, kinds: tuple[str, ...]) -> None:
        for kind in [k for k in self.models if k not in kinds]:
            del self.models[kind]
        release_memory()

    def _build(self, kind: str) -> tuple:
        s = self.shapes
        if kind in ("float32", "bfloat16"):
            dtype = torch.float32 if kind == "float32" else torch.bfloat16
            target, drafter = build_models(s, s.target_layers, s.drafter_layers, dtype, self.device)
            scale_head(target, s.logit_scale)
            return target, drafter
        if kind == "8b":
            return build_models(s, s.full_target_layers, s.full_drafter_layers, torch.bfloat16, self.device)
        raise RuntimeError(f"unknown model kind {kind!r}")


@dataclass
class Context:
    """What every check reads: sizes, device, the shared models, the time budget."""

    shapes: Shapes
    device: torch.device
    models: ModelCache
    deadline: float
    setups: dict = field(default_factory=dict)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()


def error_summary(error: BaseException, lines: int = 6) -> str:
    """The exception and the last frames of its traceback, short enough for a table cell and the JSON."""
    frames = traceback.extract_tb(error.__traceback__)[-lines:]
    where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames))
    return f"{type(error).__name__}: {' '.join(str(error).split())[:600]} (at {where})"


def worst(statuses: list[str]) -> str:
    """The status of a check made of cases: error > fail > pass."""
    for status in ("error", "fail", "measured", "pass"):
        if status in statuses:
            return status
    return "skipped"
