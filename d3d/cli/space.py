"""`d3d space`: serve the Gradio Space locally: for a prompt, the target alone beside D3D async, tokens coloured by
how they came, live τ, cache-hit rate, tokens/s and speedup. Needs the `space` extra (gradio).

Models: --target / --drafter, else $D3D_TARGET / $D3D_DRAFTER, else the quickstart's d3d-output/target and
d3d-output/drafter.
"""

import argparse

from d3d.space_app import loading

from d3d.common import dtype
from .errors import UserError
from .inputs import device, model_source, port, positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    loading.add_arguments(parser, port=port, count=positive_int, device=device)
    dtype.add_argument(parser)


def check_model_sources(args: argparse.Namespace) -> None:
    """Refuse (`UserError`) a target or drafter, from its argument, the environment or the default, that is neither a
    whole model folder nor a Hub id, before anything loads."""
    for option, source in zip(("--target", "--drafter"), loading.model_sources(args), strict=True):
        try:
            model_source(source)
        except argparse.ArgumentTypeError as error:
            raise UserError(f"{option} {source}: {error}") from error


def run(args: argparse.Namespace) -> int:
    check_model_sources(args)
    from d3d.space_app.app import serve  # gradio comes with the `space` extra: imported only when serving

    choice = dtype.choose_dtype(args.dtype, loading.devices(args)[0])
    print(choice)
    serve(args, choice.dtype)
    return 0
