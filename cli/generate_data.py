"""`d3d generate-data`: regenerate responses to a prompt set with the target (resumable)."""

import argparse

from trainer.data import generate_responses

from . import dtype
from .loading import load_target, read_prompts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="target model folder or Hub id")
    parser.add_argument("--prompts", required=True, help=".jsonl (field 'prompt') or .txt (one prompt per line)")
    parser.add_argument("--output", required=True, help="folder for responses.jsonl and the dataset (rerun resumes)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=256, help="length cap of each response")
    parser.add_argument("--sample", action="store_true", help="sample with the target's recommended settings (default greedy)")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    parser.add_argument("--seed", type=int, default=0)
    dtype.add_argument(parser)


def run(args: argparse.Namespace) -> int:
    prompts = read_prompts(args.prompts)[: args.limit]  # a wrong --prompts fails before the target loads
    if not prompts:
        raise ValueError(f"--prompts {args.prompts} holds no prompts")
    choice = dtype.choose_dtype(args.dtype)
    print(choice)
    target, tokenizer = load_target(args.target, choice.dtype)
    dataset = generate_responses(
        target, tokenizer, prompts, args.output, args.batch_size, args.max_new_tokens, args.sample, args.seed
    )
    print(f"{len(dataset)} responses in {args.output}")
    return 0
