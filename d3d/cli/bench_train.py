"""`d3d bench-train`: the cost of a D3D training step (forward + backward of the losses) on random drafters of real
shapes: step time, packed positions per second and peak memory, for the full-logits losses (the baseline: every
position's float32 logits) beside the hidden-state losses `d3d train` uses; with `--project`, per-device memory of the
paper's 8B recipe projected from the measured per-position figures."""

import argparse
from dataclasses import replace
from pathlib import Path

import torch

from d3d.benchmark.train_cost import (LOSS_PATHS, SHAPES, TrainShape, cost_table, layer_activation_bytes, projection,
                                      projection_table, step_costs, write)
from d3d.common import dtype
from d3d.quickstart.sizes import QuickstartSizes


def quickstart_shape() -> TrainShape:
    """The default quickstart's drafter (its assistant's shape, tied head) and training batch, 32-token prompts."""
    sizes = QuickstartSizes()
    a = sizes.assistant
    return TrainShape(a.hidden, a.mlp, a.layers, a.heads, a.kv_heads, a.hidden // a.heads, sizes.vocab_size, True,
                      32, sizes.response_tokens, sizes.num_anchors, sizes.block_size, sizes.drafter_batch_size)


def drafter_shapes() -> dict[str, TrainShape]:
    """The shapes `--shapes` names: train_cost's and the quickstart's drafter."""
    return {**SHAPES, "quickstart": quickstart_shape()}


def parse_ints(text: str | None, flag: str) -> list[int] | None:
    """`"1,2"` -> `[1, 2]` (positive ints); `ValueError` for anything else."""
    if text is None:
        return None
    if not all(item.strip().isdigit() and int(item) > 0 for item in text.split(",")):
        raise ValueError(f"{flag} {text!r} is not a list of positive ints such as 1,2")
    return [int(item) for item in text.split(",")]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", default="quickstart,qwen3-8b-vocab",
                        help=f"comma-separated drafter shapes: {', '.join(drafter_shapes())}")
    parser.add_argument("--layers", default=None, help="e.g. 1,2: measure each shape at these depths (default: its own)")
    parser.add_argument("--loss-paths", default=",".join(LOSS_PATHS), help=f"comma-separated: {', '.join(LOSS_PATHS)}")
    parser.add_argument("--gradient-checkpointing", choices=("no", "yes", "both"), default="no",
                        help="measure with gradient checkpointing (the hidden-states path only: checkpointing the "
                             "decoder does not change what the logits cost)")
    parser.add_argument("--repeats", type=int, default=3, help="steps per row: one warm-up, the median of the rest")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--project", default=None, metavar="SHAPE",
                        help="project the paper's 8B recipe from SHAPE: per-layer activations counted (the storages a "
                             "layer saves for backward), logits from SHAPE's two loss paths' peaks")
    parser.add_argument("--output", default=None, help="folder for bench-train.json and bench-train.md")
    dtype.add_argument(parser)


def run(args: argparse.Namespace) -> int:
    known = drafter_shapes()
    shapes = args.shapes.split(",")
    paths = args.loss_paths.split(",")
    unknown = [name for name in shapes if name not in known] + [path for path in paths if path not in LOSS_PATHS]
    if unknown:
        raise ValueError(f"unknown shape or loss path: {', '.join(unknown)}")
    layers = parse_ints(args.layers, "--layers")
    if args.repeats < 1:
        raise ValueError("--repeats must be >= 1")
    if args.project is not None and args.project not in shapes:
        raise ValueError("--project SHAPE needs SHAPE among --shapes")
    checkpointing = {"no": [False], "yes": [True], "both": [False, True]}[args.gradient_checkpointing]
    choice = dtype.choose_dtype(args.dtype, args.device)
    print(choice)
    costs = []
    for name in shapes:
        for depth in layers or [known[name].layers]:
            shape = replace(known[name], layers=depth)
            for with_checkpointing in checkpointing:  # checkpointing the decoder leaves the logits' cost alone
                measured = [p for p in paths if not with_checkpointing or p == "hidden-states"]
                if not measured:
                    continue
                rows = step_costs(name, shape, measured, args.device, choice.dtype, args.repeats, with_checkpointing,
                                  autocast=choice.bf16)
                costs += rows
                print("\n".join(cost_table(rows).splitlines()[2:]), flush=True)
    print(f"\n{choice}, device {args.device}\n\n{cost_table(costs)}")
    projected = None
    if args.project is not None:
        measured = [cost for cost in costs if cost.shape == args.project]
        layer_bytes = layer_activation_bytes(known[args.project], args.device, choice.dtype, choice.bf16)
        projected = projection(measured, layer_bytes, known[args.project], choice.dtype.itemsize)
        print("\n" + projection_table(projected))
    if args.output:
        write(costs, projected, Path(args.output))
    return 0
