"""Entry point of the `d3d` command: one subcommand per module of this package.

Only the chosen command's module is imported (none for `d3d --help` or a command that does not exist), so `d3d bench`
runs with the inference install alone (no training extras such as `datasets`). Errors from bad input (`USER_ERRORS`)
print one line, `d3d COMMAND: error: MESSAGE`, and exit 2; `--debug` shows their traceback. Any other exception
(`RuntimeError`, a failed assertion: an internal invariant) is a bug: it prints `d3d COMMAND: internal error: ...`
with a hint to rerun with `--debug` for the traceback, and exits 1.
"""

import argparse
import importlib
import sys
from collections.abc import Collection

from .errors import UserError

COMMANDS = {
    "quickstart": ("quickstart", "the embedded default end to end: target, assistant, drafter, benchmark"),
    "demo": ("demo", "the target alone beside D3D on the quickstart's models (else tiny random ones), checked against the target"),
    "generate-data": ("generate_data", "regenerate responses with the target (resumable)"),
    "train": ("train", "train a D3D drafter for a target (diffusion + AR loss)"),
    "bench-train": ("bench_train", "the cost of a training step (time, tokens/s, peak memory) at real shapes"),
    "prune": ("prune", "acceptance-guided layer pruning with distillation recovery"),
    "bench": ("bench", "D3D beside its peers on the same prompts, in one process"),
    "push": ("push", "publish a drafter folder with its model card to the Hugging Face Hub"),
    "space": ("space", "the Gradio Space, served locally: the target alone beside D3D async, live"),
    "serve": ("serve", "vLLM's OpenAI-compatible server for a target with a D3D drafter (d3d_vllm plugin)"),
    "bench-prefill": ("bench_prefill", "selective prefill on a long-context task: score, TTFT, decode and E2E speedups"),
    "gpu-check": ("gpu_check", "the first thing to run on a GPU: identity, compile, timing and memory on random weights"),
}


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser, but a bad argument is one line, `d3d COMMAND: error: MESSAGE` (no usage block; `--help`
    shows it), as every input error of `d3d` is; it exits 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


# Raised on bad input: files that are not there or unreadable, values out of range, `UserError`.
USER_ERRORS = (UserError, ValueError, OSError)


def command_module(name: str):
    return importlib.import_module(f".{COMMANDS[name][0]}", __package__)


def build_parser(loaded: Collection[str] = tuple(COMMANDS)) -> argparse.ArgumentParser:
    """The `d3d` parser; only the commands in `loaded` get their own arguments (their modules are imported)."""
    parser = OneLineParser(prog="d3d", description="D3D: decoupled diffusion drafting for speculative decoding")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an input error too")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (_, help_text) in COMMANDS.items():
        if name in loaded:
            module = command_module(name)
            module.add_arguments(commands.add_parser(name, help=help_text, description=module.__doc__))
        else:
            commands.add_parser(name, help=help_text)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((arg for arg in argv if not arg.startswith("-")), None)
    try:
        args = build_parser([chosen] if chosen in COMMANDS else []).parse_args(argv)
    except SystemExit as stop:  # --help, or a bad argument (its line printed): the exit status
        return stop.code
    try:
        return command_module(args.command).run(args)
    except USER_ERRORS as error:
        if args.debug:
            raise
        print(f"d3d {args.command}: error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    except Exception as error:  # not the user's input: a bug in d3d
        if args.debug:
            raise
        print(f"d3d {args.command}: internal error (a bug in d3d, not your input): {type(error).__name__}: "
              f"{' '.join(str(error).split())}\nRun again with --debug for the traceback, and please report it.",
              file=sys.stderr)
        return 1

