"""`d3d gpu-check`: the checks of `benchmark.gpu_check` (its docstring is this command's description)."""

from benchmark import gpu_check

__doc__ = gpu_check.__doc__  # noqa: A001 (the command's --help shows the checks)
add_arguments, run = gpu_check.add_arguments, gpu_check.run
