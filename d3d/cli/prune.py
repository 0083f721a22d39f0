"""`d3d prune`: acceptance-guided progressive layer pruning of a trained drafter, with distillation recovery."""

import argparse
from pathlib import Path

import torch

from d3d.trainer.data import load_responses
from d3d.trainer.provenance import record_pruning
from d3d.trainer.pruning import MAX_NEW_TOKENS, MIN_TAU_FRACTION, prune
from modeling_d3d import D3DForBlockDiffusion

from d3d.common import dtype
from d3d.common.host_memory import keep_freed_memory_on_cpu
from .inputs import fraction, model_source, positive_int
from .loading import load_target
from .train import add_recipe_arguments, recipe_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, type=model_source)
    parser.add_argument("--drafter", required=True, type=model_source,
                        help="the trained drafter folder or Hub id (the fixed teacher)")
    parser.add_argument("--data", required=True, help="a `d3d generate-data` folder; its last 2 x --dev-size prompts are the dev sets")
    parser.add_argument("--output", required=True, help="stages, report and the chosen drafter/")
    parser.add_argument("--dev-size", type=positive_int, default=512, help="prompts in each of the two disjoint dev sets")
    parser.add_argument("--min-layers", type=positive_int, default=1)
    parser.add_argument("--min-tau-fraction", type=fraction, default=MIN_TAU_FRACTION,
                        help="stop once τ falls below this fraction of the unpruned drafter's")
    parser.add_argument("--recovery-steps", type=positive_int, default=10_000)
    parser.add_argument("--max-new-tokens", type=positive_int, default=MAX_NEW_TOKENS,
                        help="tokens decoded per dev prompt to measure τ and speedup")
    add_recipe_arguments(parser)


def run(args: argparse.Namespace) -> int:
    choice = dtype.choose_dtype(args.dtype)
    print(choice)
    keep_freed_memory_on_cpu()
    target, tokenizer = load_target(args.target, choice.dtype)
    drafter = D3DForBlockDiffusion.from_pretrained(args.drafter).to(target.device)
    data = load_responses(args.data)
    dev = min(args.dev_size, len(data) // 4)
    prompts = [torch.tensor([ids]) for ids in data[len(data) - 2 * dev :]["prompt"]]
    train = data.select(range(len(data) - 2 * dev))
    args.epochs = 1.0
    recovery = recipe_arguments(args, args.output, args.recovery_steps, choice)
    stages = prune(
        drafter, target, train, prompts[:dev], prompts[dev:], args.output, recovery,
        args.min_layers, args.min_tau_fraction, args.max_new_tokens,
    )
    tokenizer.save_pretrained(f"{args.output}/drafter")
    record_pruning(args.drafter, f"{args.output}/drafter")
    print((Path(args.output) / "pruning.md").read_text())
    return 0 if stages else 1
