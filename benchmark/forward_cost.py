"""What one round costs at real sizes: the target's verification pass against the drafter's block and packed passes.

Asynchronous D3D hides drafting completely when the packed successor pass (budget `B((C-1)F + 2)` tokens) takes no
longer than the target's verification of a block. This measures both on randomly initialised models of a real
shape (no download: only the timings matter, not the weights), for a grid of budgets, and prints a table:

    python -m benchmark.forward_cost --preset qwen3-8b --device cuda:0 --drafter-device cuda:1

Acceptance lengths need trained weights: this says nothing about tau, only about the cost of each pass.
"""

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import LogitsProcessorList, Qwen3Config, Qwen3ForCausalLM
from transformers.cache_utils import DynamicCache

from cli.dtype import DtypeChoice, add_argument, choose_dtype
from modeling_d3d import D3DForBlockDiffusion
from modeling_d3d.speculative_d3d import synchronize

# Shapes of the paper's models (Qwen3 configs); the drafter is D3D-8B pruned to 31 layers.
PRESETS = {
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "qwen3-32b": dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                      num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512),
}
DRAFTER_SHAPE = {"qwen3-8b": ("qwen3-8b", 31), "qwen3-32b": ("qwen3-8b", 31), "tiny": ("tiny", 2)}


def random_model(shape: dict, layers: int | None, device: str, dtype: torch.dtype) -> Qwen3ForCausalLM:
    """A Qwen3 causal LM of `shape` with random weights, built directly on `device`."""
    config = Qwen3Config(**{**shape, "num_hidden_layers": layers or shape["num_hidden_layers"]})
    with torch.device(device):
        return Qwen3ForCausalLM._from_config(config, dtype=dtype).eval()


def seconds(fn, repeats: int, device: torch.device) -> float:
    """Median wall-clock seconds of `fn()` over `repeats` calls after one warm-up, device work included."""
    fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


@torch.inference_mode()
def target_pass_seconds(target, prefix: torch.Tensor, n: int, repeats: int) -> float:
    """Time for the target to process `n` new tokens after a cached prefix `(1, L)`."""
    cache = DynamicCache(config=target.config)
    target(prefix, past_key_values=cache, use_cache=True)
    length = prefix.shape[1]
    block = prefix[:, -n:]
    positions = torch.arange(length, length + n, device=prefix.device)[None]

    def verify():
        target(block, past_key_values=cache, position_ids=positions, use_cache=True)
        cache.crop(-n)

    return seconds(verify, repeats, target.device)


@torch.inference_mode()
def drafter_pass_seconds(drafter, prefix: torch.Tensor, budgets: list[tuple[int, int]], repeats: int) -> dict:
    """Time of one block-drafting pass and of the packed successor pass for each `(C, F)`, after a cached prefix."""
    processors = LogitsProcessorList()
    cache = DynamicCache(config=drafter.config)
    draft = drafter.draft_block(prefix, cache, processors)
    cached = cache.get_seq_length()
    times = {"block": seconds(lambda: drafter.draft_block(prefix, cache, processors), repeats, drafter.device)}
    for coverage, fanout in budgets:
        def packed_pass():
            drafter.draft_successors(prefix, draft.tokens, draft.logits, cache, coverage, fanout, processors)
            cache.crop(cached - cache.get_seq_length())

        times[f"{coverage}x{fanout}"] = seconds(packed_pass, repeats, drafter.device)
    return times


def measure(preset: str, device: str, drafter_device: str, prefix_length: int, block_size: int,
            budgets: list[tuple[int, int]], repeats: int, choice: DtypeChoice) -> dict:
    dtype = choice.dtype
    shape = PRESETS[preset]
    target = random_model(shape, None, device, dtype)
    drafter_shape, drafter_layers = DRAFTER_SHAPE[preset]
    backbone = random_model(PRESETS[drafter_shape], drafter_layers, drafter_device, dtype)
    drafter = D3DForBlockDiffusion.from_backbone(backbone, block_size=block_size).to(drafter_device, dtype).eval()
    prefix = torch.randint(0, shape["vocab_size"] - 1, (1, prefix_length), generator=torch.Generator().manual_seed(0))
    result = {
        "preset": preset, "device": torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else "cpu",
        "dtype": choice.description,
        "prefix_length": prefix_length, "block_size": block_size,
        "target_seconds": {n: target_pass_seconds(target, prefix.to(device), n, repeats) for n in (1, block_size)},
        "drafter_seconds": drafter_pass_seconds(drafter, prefix.to(drafter_device), budgets, repeats),
        "budget_tokens": {f"{c}x{f}": block_size * ((c - 1) * f + 2) for c, f in budgets},
    }
    return result


def markdown(result: dict) -> str:
    """A table: each drafter pass's time against the target's verification of one block (ratio <= 1: hidden)."""
    block_size = result["block_size"]
    verify = result["target_seconds"][block_size]
    lines = [
        f"{result['preset']} on {result['device']} in {result['dtype']}, prefix {result['prefix_length']} tokens, B={block_size}: "
        f"target t(1) = {result['target_seconds'][1] * 1e3:.2f} ms, t(B) = {verify * 1e3:.2f} ms",
        "",
        "| drafter pass | tokens | ms | / target t(B) |",
        "|---|---|---|---|",
    ]
    for name, value in result["drafter_seconds"].items():
        tokens = block_size if name == "block" else result["budget_tokens"][name]
        label = "block drafting" if name == "block" else f"packed successors C×F={name}"
        lines.append(f"| {label} | {tokens} | {value * 1e3:.2f} | {value / verify:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-8b")
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--drafter-device", default=None, help="defaults to --device")
    parser.add_argument("--prefix-length", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--budgets", default="1x0,4x1,8x2,12x2,16x3", help="C×F grid, e.g. 4x1,12x2")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--output", default=None, help="write the result as JSON here")
    add_argument(parser)
    args = parser.parse_args(argv)
    budgets = [tuple(int(v) for v in item.split("x")) for item in args.budgets.split(",")]
    choice = choose_dtype(args.dtype, args.device)
    print(choice)
    result = measure(args.preset, args.device, args.drafter_device or args.device, args.prefix_length,
                     args.block_size, budgets, args.repeats, choice)
    print(markdown(result))
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
