"""Entry point of the `d3d` command."""

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="d3d", description="D3D: decoupled diffusion drafting for speculative decoding")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="speculative decoding on tiny random models, checked against the target")
    demo.add_argument("--prompts", type=int, default=8)
    demo.add_argument("--max-new-tokens", type=int, default=64)
    demo.add_argument("--block-size", type=int, default=16)
    demo.add_argument("--vocab-size", type=int, default=16)
    demo.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from .demo import run_demo

        identical = run_demo(args.prompts, args.max_new_tokens, args.block_size, args.vocab_size, args.seed)
        return 0 if identical else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
