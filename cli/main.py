"""Entry point of the `d3d` command: one subcommand per module of this package."""

import argparse
import sys

from . import bench, bench_prefill, demo, generate_data, prune, quickstart, train

COMMANDS = {
    "quickstart": (quickstart, "the embedded default end to end: target, assistant, drafter, benchmark"),
    "demo": (demo, "speculative decoding on tiny random models, checked against the target"),
    "generate-data": (generate_data, "regenerate responses with the target (resumable)"),
    "train": (train, "train a D3D drafter for a target (diffusion + AR loss)"),
    "prune": (prune, "acceptance-guided layer pruning with distillation recovery"),
    "bench": (bench, "D3D beside its peers on the same prompts, in one process"),
    "bench-prefill": (bench_prefill, "selective prefill on a long-context task: score, TTFT, decode and E2E speedups"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="d3d", description="D3D: decoupled diffusion drafting for speculative decoding")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        module.add_arguments(commands.add_parser(name, help=help_text, description=module.__doc__))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return COMMANDS[args.command][0].run(args)


if __name__ == "__main__":
    sys.exit(main())
