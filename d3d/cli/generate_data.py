"""`d3d generate-data`: regenerate responses to a prompt set with the target (resumable), with transformers or, for
large prompt sets, vLLM's offline batched engine (`--engine vllm`, run in the vLLM environment)."""

import argparse

from d3d.trainer.data import generate_responses

from d3d.common import dtype

from . import vllm_env
from .inputs import model_source, positive_int
from .loading import load_target, read_prompts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, type=model_source, help="target model folder or Hub id")
    parser.add_argument("--prompts", required=True, help=".jsonl (field 'prompt') or .txt (one prompt per line)")
    parser.add_argument("--output", required=True, help="folder for responses.jsonl and the dataset (rerun resumes)")
    parser.add_argument("--engine", choices=("transformers", "vllm"), default="transformers",
                        help="who generates: transformers in this process, or vLLM's offline engine")
    parser.add_argument("--batch-size", type=positive_int, default=8, help="prompts per batch (and per written chunk)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=256, help="length cap of each response")
    parser.add_argument("--sample", action="store_true", help="sample with the target's recommended settings (default greedy)")
    parser.add_argument("--limit", type=positive_int, default=None, help="use only the first N prompts")
    parser.add_argument("--seed", type=int, default=0)
    dtype.add_argument(parser)
    vllm_env.add_argument(parser)


def run(args: argparse.Namespace) -> int:
    prompts = read_prompts(args.prompts)[: args.limit]  # a wrong --prompts fails before the target loads
    if not prompts:
        raise ValueError(f"--prompts {args.prompts} holds no prompts")
    choice = dtype.choose_dtype(args.dtype)
    print(choice)
    if args.engine == "vllm":
        from d3d.trainer.vllm_data import generate_responses_with_vllm

        dataset = generate_responses_with_vllm(
            args.target, prompts, args.output, vllm_env.vllm_python(args.vllm_python), args.batch_size,
            args.max_new_tokens, args.sample, args.seed, choice.name,
        )
    else:
        target, tokenizer = load_target(args.target, choice.dtype)
        dataset = generate_responses(
            target, tokenizer, prompts, args.output, args.batch_size, args.max_new_tokens, args.sample, args.seed
        )
    print(f"{len(dataset)} responses in {args.output}")
    return 0
