"""`d3d quickstart`: train a target, an AR assistant and a D3D drafter on Python's own text, then benchmark."""

import argparse
from pathlib import Path

from d3d.common.report import markdown
from d3d.quickstart.pipeline import MICRO, QuickstartSizes, run_quickstart

from d3d.common import dtype
from d3d.common.host_memory import keep_freed_memory_on_cpu


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", default="d3d-output", help="output folder (a rerun reuses finished stages)")
    parser.add_argument("--micro", action="store_true", help="tiny sizes: minutes, for tests")
    dtype.add_argument(parser)


def run(args: argparse.Namespace) -> int:
    keep_freed_memory_on_cpu()
    results = run_quickstart(Path(args.output), MICRO if args.micro else QuickstartSizes(), args.dtype)
    print(markdown(results))
    lossless = all(row["lossless"] for s in results["prompt_sets"].values() for row in s["methods"])
    return 0 if lossless else 1
