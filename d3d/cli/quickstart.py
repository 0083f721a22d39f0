"""`d3d quickstart`: train a target, an AR assistant and a D3D drafter on Python's own text, then benchmark."""

import argparse
from pathlib import Path

from d3d.common.report import markdown
from d3d.quickstart.pipeline import MICRO, QuickstartSizes, run_quickstart

from d3d.common import dtype
from d3d.common.host_memory import keep_freed_memory_on_cpu

from .inputs import non_negative_float

# The README's first command within 30 minutes: installation (~2 min) and this, with room for the projection's error.
DEFAULT_BUDGET_MINUTES = 25.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", default="d3d-output", help="output folder (a rerun reuses finished stages)")
    parser.add_argument("--micro", action="store_true", help="tiny sizes: minutes, for tests (never scaled)")
    parser.add_argument("--time-budget", type=non_negative_float, default=DEFAULT_BUDGET_MINUTES, metavar="MINUTES",
                        help="the first run scales every step and prompt count down where the default recipe, timed on "
                             "this machine, would take longer (0: the default recipe whatever it takes; a rerun keeps "
                             f"the first run's recipe; default {DEFAULT_BUDGET_MINUTES:g})")
    dtype.add_argument(parser)


def run(args: argparse.Namespace) -> int:
    keep_freed_memory_on_cpu()
    budget = None if args.micro or args.time_budget == 0 else args.time_budget
    results = run_quickstart(Path(args.output), MICRO if args.micro else QuickstartSizes(), args.dtype, budget)
    print(markdown(results))
    lossless = all(row["lossless"] for s in results["prompt_sets"].values() for row in s["methods"])
    return 0 if lossless else 1
