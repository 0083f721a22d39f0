"""What one round costs at real sizes: the target's verification pass against the drafter's block and packed passes.

Asynchronous D3D hides drafting completely when the packed successor pass (budget `B((C-1)F + 2)` tokens) takes no
longer than the target's verification of a block. This measures both on randomly initialised models of a real
shape (no download: only the timings matter, not the weights), for a grid of budgets, and prints a table:

    python -m d3d.benchmark.forward_cost --preset qwen3-8b --device cuda:0 --drafter-device cuda:1

Acceptance lengths need trained weights: this says nothing about tau, only about the cost of each pass.
"""

import argparse
import json
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch
from transformers import Qwen3Config

from d3d.common.dtype import DtypeChoice, add_argument, choose_dtype
from d3d.common.measure import timed
from d3d.common.report import table
from modeling_d3d.acceptance_d3d import RowSampling
from modeling_d3d.engine_d3d import RowSettings, SpeculativeEngine
from modeling_d3d.generation_d3d import build_engine, make_source
from modeling_d3d.policy_d3d import SHORT_DRAFTS, tree_width
from modeling_d3d.successor_d3d import DEFAULT_FANOUT, SuccessorSource

from .random_models import random_causal_lm, random_drafter

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


def seconds(fn, repeats: int, device: torch.device) -> float:
    """Median wall-clock seconds of `fn()` over `repeats` calls after one warm-up, device work included."""
    return interleaved_seconds({"fn": (fn, device)}, repeats)["fn"]


def interleaved_seconds(calls: dict[str, tuple[Callable[[], object], torch.device]], repeats: int) -> dict[str, float]:
    """Median wall-clock seconds of each `fn()` (its device's work included) over `repeats` rounds that call every
    one in turn, after one warm-up call each: drift on the machine hits them all alike."""
    for fn, device in calls.values():
        timed(fn, device)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, (fn, device) in calls.items():
            times[name].append(timed(fn, device)[1])
    return {name: sorted(values)[len(values) // 2] for name, values in times.items()}


def random_prefix(model, length: int) -> list[int]:
    """`length` token ids drawn from `model`'s vocabulary, the same for every call (seed 0)."""
    vocab = model.config.get_text_config().vocab_size
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(0)).tolist()


def one_row_engine(target, drafter, prefix: list[int], max_length: int, compile: bool,
                   stack: ExitStack) -> SpeculativeEngine:
    """The engine `speculative_generate` builds for one prompt of up to `max_length` tokens (`build_engine`: the same
    sizes, compiled passes and pooled caches; drafter None: the target alone, else D3D sync), holding `prefix` as its
    row (the target prefilled whole, the row's first token, which its prefill decides, the anchor; the drafter
    prefilled on its first block pass, which a timer's warm-up call runs); closed when `stack` closes."""
    source = make_source(drafter, False, None, DEFAULT_FANOUT, None, None, compile)
    engine = build_engine(target, source, 1, max_length, compile, lookup=False)
    stack.callback(engine.close)
    engine.add(0, prefix, RowSettings(max_length - len(prefix)))
    return engine


def verify_pass(engine: SpeculativeEngine, width: int | None = None) -> Callable[[], object]:
    """The engine's verify pass over its row, `width` columns (None: its block), ready to time (every call verifies
    the same columns: nothing grows)."""
    return lambda: engine.verify(None, width)


def block_pass(engine: SpeculativeEngine) -> Callable[[], object]:
    """The engine's drafting pass for its row (its `BlockSource.propose`), ready to time."""
    row = engine.rows[0]
    return lambda: engine.source.propose([row.drafter_context], [row.sampling])


@torch.no_grad()
def engine_pass_seconds(target, drafter, prefix_length: int = 256, repeats: int = 50, compile: bool = False) -> dict:
    """t_T(1), t_T(B), t_T(2B-1), t_T(short) (the target's verify pass over 1 and B tokens, over a tree of two
    branches, and over a short round's `SHORT_DRAFTS + 1` tokens) and
    t_D(B) (the drafter's block pass), eager or compiled, as the engines of one prompt of `prefix_length + B` tokens
    run them (the target alone, and D3D sync; its cache has room for a tree's columns) after a random
    `prefix_length`-token prefix, timed in alternation (`interleaved_seconds`)."""
    prefix = random_prefix(target, prefix_length)
    block_size = drafter.config.block_size
    max_length = prefix_length + block_size
    with ExitStack() as stack:
        alone = one_row_engine(target, None, prefix, max_length, compile, stack)
        d3d = one_row_engine(target, drafter, prefix, max_length, compile, stack)
        return interleaved_seconds({
            "t_target_1": (verify_pass(alone), target.device),
            "t_target_b": (verify_pass(d3d), target.device),
            "t_target_tree": (verify_pass(d3d, tree_width(block_size)), target.device),
            "t_target_short": (verify_pass(d3d, SHORT_DRAFTS + 1), target.device),
            "t_drafter_b": (block_pass(d3d), drafter.device),
        }, repeats)


@torch.no_grad()
def successor_pass_seconds(drafter, prefix: list[int], budgets: list[tuple[int, int]], repeats: int,
                           block_seconds: float) -> dict:
    """Per `(C, F)`, the engine's packed successor pass after a committed prefix, eager: `SuccessorSource` propose +
    observe after a miss (its context grows a token a call), less the block pass (`block_seconds`)."""
    sampling = [RowSampling()]
    times = {}
    for coverage, fanout in budgets:
        with SuccessorSource(drafter, coverage, fanout) as source:
            source.allocate(1, len(prefix) + 2 * repeats + 4)
            source.add(0, [prefix])
            context = list(prefix)

            def round_trip():
                source.propose([context], sampling)
                source.observe([context], [[]])
                source.branches[0] = None  # the next call drafts again, as after a miss
                context.append(context[-1])

            times[f"{coverage}x{fanout}"] = max(seconds(round_trip, repeats, drafter.device) - block_seconds, 0.0)
    return times


def measure(preset: str, device: str, drafter_device: str, prefix_length: int, block_size: int,
            budgets: list[tuple[int, int]], repeats: int, choice: DtypeChoice) -> dict:
    dtype = choice.dtype
    shape = PRESETS[preset]
    target = random_causal_lm(Qwen3Config(**shape), device, dtype)
    drafter_shape, drafter_layers = DRAFTER_SHAPE[preset]
    drafter_config = Qwen3Config(**{**PRESETS[drafter_shape], "num_hidden_layers": drafter_layers})
    drafter = random_drafter(drafter_config, drafter_device, dtype, block_size)
    passes = engine_pass_seconds(target, drafter, prefix_length, repeats)
    successors = successor_pass_seconds(drafter, random_prefix(target, prefix_length), budgets, repeats,
                                        passes["t_drafter_b"])
    return {
        "preset": preset, "device": torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else "cpu",
        "dtype": choice.description,
        "prefix_length": prefix_length, "block_size": block_size,
        "target_seconds": {1: passes["t_target_1"], block_size: passes["t_target_b"]},
        "drafter_seconds": {"block": passes["t_drafter_b"], **successors},
        "budget_tokens": {f"{c}x{f}": block_size * ((c - 1) * f + 2) for c, f in budgets},
    }


def markdown(result: dict) -> str:
    """A table: each drafter pass's time against the target's verification of one block (ratio <= 1: hidden)."""
    block_size = result["block_size"]
    verify = result["target_seconds"][block_size]
    lines = [
        f"{result['preset']} on {result['device']} in {result['dtype']}, prefix {result['prefix_length']} tokens, B={block_size}: "
        f"target t(1) = {result['target_seconds'][1] * 1e3:.2f} ms, t(B) = {verify * 1e3:.2f} ms",
        "",
    ] + table(["drafter pass", "tokens", "ms", "/ target t(B)"],
              [["block drafting" if name == "block" else f"packed successors C×F={name}",
                block_size if name == "block" else result["budget_tokens"][name], f"{value * 1e3:.2f}",
                f"{value / verify:.2f}"] for name, value in result["drafter_seconds"].items()])
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
