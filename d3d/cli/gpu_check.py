"""`d3d gpu-check`: the checks of `d3d.benchmark.gpu_check` (its docstring is this command's description); with
`--vllm`, those of `d3d.benchmark.gpu_check_vllm`, run through the vLLM environment."""

import argparse
from pathlib import Path

from d3d.benchmark import gpu_check

from . import vllm_env

__doc__ = gpu_check.__doc__  # noqa: A001 (the command's --help shows the checks)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    gpu_check.add_arguments(parser)
    parser.add_argument("--vllm", action="store_true",
                        help="the vLLM checks instead: vLLM alone against vLLM + D3D at 1, 4 and 16 requests, "
                             "exactness, the attention backend, the non-causal block pass (with --smoke: tiny models "
                             "on a CPU)")
    parser.add_argument("--vllm-eager", action="store_true",
                        help="with --vllm: vLLM without CUDA graphs or compilation (its --enforce-eager)")
    vllm_env.add_argument(parser)


def run(args: argparse.Namespace) -> int:
    """First the versions found against the supported ranges (whatever follows), then the checks."""
    print(gpu_check.versions_line(), flush=True)
    if not args.vllm:
        if args.vllm_python is not None or args.vllm_eager:
            raise ValueError(f"{'--vllm-python' if args.vllm_python is not None else '--vllm-eager'} goes with --vllm")
        return gpu_check.run(args)
    given = [f"--{name.replace('_', '-')}" for name in ("only", *gpu_check.SIZE_OPTIONS) if getattr(args, name)]
    if given:
        raise ValueError(f"{', '.join(given)}: not options of the vLLM checks (--vllm)")
    gpu_check.require_cuda(args.smoke, "gpu-check --vllm")
    from d3d.benchmark import gpu_check_vllm

    budget_s = gpu_check.budget_seconds(args.budget_s, gpu_check_vllm.BUDGET_S)
    return gpu_check_vllm.run(Path(args.output), args.smoke, budget_s, vllm_env.vllm_python(args.vllm_python),
                              args.vllm_eager)
