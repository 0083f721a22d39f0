"""`d3d space`: serve the Gradio Space locally: for a prompt, the target alone beside D3D async, tokens coloured by
how they came, live τ, cache-hit rate, tokens/s and speedup. Needs the `space` extra (gradio).

Models: --target / --drafter, else $D3D_TARGET / $D3D_DRAFTER, else the quickstart's d3d-output/target and
d3d-output/drafter.
"""

import argparse

from space_app import loading

from . import dtype


def add_arguments(parser: argparse.ArgumentParser) -> None:
    loading.add_arguments(parser)
    dtype.add_argument(parser)


def run(args: argparse.Namespace) -> int:
    from space_app.app import serve  # gradio comes with the `space` extra: imported only when serving

    choice = dtype.choose_dtype(args.dtype, loading.devices(args)[0])
    print(choice)
    serve(args, choice.dtype)
    return 0
