"""`d3d bench-prefill`: selective prefill on a long-context task built from `pydoc_data`
(see `d3d.benchmark.long_context`).

Settings: the full prompt with the target alone (1.00x), the full prompt with D3D, and each retention with D3D;
score, time to first token, decoding rate and end-to-end speedups, and a check that every output is the target's own
greedy output on the prompt it read.
"""

import argparse
from pathlib import Path

from d3d.benchmark.long_context import evaluate_selective_prefill
from d3d.common import report
from modeling_d3d import D3DForBlockDiffusion
from modeling_d3d.prefill_d3d import DEFAULT_CHUNK_SIZE

from d3d.common import dtype
from .inputs import model_source, positive_int
from .loading import load_target


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, type=model_source)
    parser.add_argument("--drafter", required=True, type=model_source)
    parser.add_argument("--num-examples", type=positive_int, default=24)
    parser.add_argument("--prompt-tokens", type=positive_int, default=1536, help="prompt length (keep it within the models' context)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=32)
    parser.add_argument("--retentions", default="0.3,0.2,0.1", help="comma-separated retentions rho in (0, 1)")
    parser.add_argument("--chunk-size", type=positive_int, default=DEFAULT_CHUNK_SIZE)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, help="folder for prefill.json, prefill.md, prefill.png")
    dtype.add_argument(parser)


def run(args: argparse.Namespace) -> int:
    choice = dtype.choose_dtype(args.dtype)
    print(choice)
    target, tokenizer = load_target(args.target, choice.dtype)
    drafter = D3DForBlockDiffusion.from_pretrained(args.drafter, dtype=target.dtype).to(target.device).eval()
    drafter.check_compatibility(target, tokenizer)
    retentions = tuple(float(value) for value in args.retentions.split(","))
    results = {"dtype": choice.description, **evaluate_selective_prefill(
        target, drafter, tokenizer, args.num_examples, args.prompt_tokens, args.max_new_tokens, retentions,
        args.chunk_size, args.seed,
    )}
    table = report.write_prefill(results, Path(args.output)) if args.output else report.prefill_markdown(results)
    print(table)
    return 0 if all(row["matches_target"] for row in results["settings"]) else 1
