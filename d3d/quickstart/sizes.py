"""Every size of the embedded default (`QuickstartSizes`) and the tests' micro ones (`MICRO`)."""

from dataclasses import dataclass, field, fields


@dataclass
class ModelSize:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    mlp: int
    steps: int
    batch_size: int
    learning_rate: float


@dataclass
class QuickstartSizes:
    """Every size of the embedded default (see the README for what the default ones cost)."""

    corpus_bytes: int = 10_000_000
    vocab_size: int = 4096
    sequence_length: int = 256
    # A deep, narrow target: on a CPU a shallow drafter is then much cheaper than a verification (README, Results).
    target: ModelSize = field(default_factory=lambda: ModelSize(128, 12, 2, 1, 384, 540, 16, 2e-3))
    # The AR assistant: a small causal LM of the target's family, the drafter's pretrained initialisation (as the
    # paper's D3D-1.7B drafter for Qwen3-32B starts from Qwen3-1.7B) and the HF assisted-generation baseline.
    assistant: ModelSize = field(default_factory=lambda: ModelSize(128, 2, 2, 1, 384, 400, 16, 2e-3))
    drafter_prompts: int = 1200
    response_tokens: int = 128
    response_batch_size: int = 64  # rows of the target's batched `generate` (~2x faster than 16 on a 2-core CPU)
    block_size: int = 16
    num_anchors: int = 8  # per 128-token response: 6 % of positions are anchors (paper: K = 128 of ~4k, 3 %)
    drafter_steps: int = 1200
    drafter_batch_size: int = 8
    drafter_learning_rate: float = 1e-3
    prune_stages: int = 1  # 2 -> 1 layer: the stage that decodes fastest through the engine is kept
    recovery_steps: int = 60
    dev_prompts: int = 8
    bench_prompts: int = 16
    bench_pydoc_prompts: int = 10
    bench_new_tokens: int = 128

    @classmethod
    def from_dict(cls, recorded: dict) -> "QuickstartSizes":
        """The sizes a `sizes.json` records (its other keys, such as the dtype and the time plan, ignored)."""
        known = {f.name for f in fields(cls)}
        values = {name: value for name, value in recorded.items() if name in known}
        models = {name: ModelSize(**values[name]) for name in ("target", "assistant") if name in values}
        return cls(**{**values, **models})


MICRO = QuickstartSizes(
    corpus_bytes=300_000, vocab_size=512, sequence_length=64,
    target=ModelSize(64, 2, 4, 2, 128, 30, 8, 3e-3), assistant=ModelSize(32, 2, 2, 1, 64, 10, 8, 3e-3),
    drafter_prompts=24, response_tokens=24, block_size=4, num_anchors=6, drafter_steps=20, drafter_batch_size=4,
    prune_stages=1, recovery_steps=4, dev_prompts=3, bench_prompts=2, bench_pydoc_prompts=2, bench_new_tokens=16,
)
