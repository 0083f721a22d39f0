"""The torch and transformers versions D3D supports, and the one combination that needs a newer torch.

One place for the ranges: `setup.cfg`, the Hub front door's requirements (`hub_generate_d3d.REQUIREMENTS`) and
`d3d gpu-check`'s report read them from here (a test checks `setup.cfg` against them). Torch and the standard
library only: this module ships to the Hub with the model code.

- transformers `TRANSFORMERS_RANGE`: the oldest release the decoding tests pass with (CI runs them under it too)
  to the newest they pass with; the upper bound is exclusive.
- torch `TORCH_RANGE`; compiled passes with asynchronous drafting on CUDA need `COMPILED_ASYNC_TORCH`: the
  successor pass is compiled "reduce-overhead" (CUDA graph trees) and called on the drafter's worker thread, and
  CUDA graph trees are per thread only from torch 2.13 (in 2.11 and 2.12 `torch/_inductor/cudagraph_trees.py`'s
  `get_obj` asserts when a graph is called from another thread than the one that imported the module).
"""

import torch

TORCH_RANGE = ((2, 4), None)
TRANSFORMERS_RANGE = ((5, 17), (5, 24))
COMPILED_ASYNC_TORCH = (2, 13)


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string: "2.11.0+cu130" -> (2, 11); ValueError if it has no such prefix."""
    major, _, rest = version.partition(".")
    minor = rest[: len(rest) - len(rest.lstrip("0123456789"))]
    if not major.isdigit() or not minor:
        raise ValueError(f"not a version: {version!r}")
    return int(major), int(minor)


def requirement(name: str, bounds: tuple) -> str:
    """A pip requirement for `bounds` (lowest, exclusive highest or None): "transformers>=5.17,<5.24"."""
    low, high = bounds
    text = f"{name}>={low[0]}.{low[1]}"
    return text if high is None else f"{text},<{high[0]}.{high[1]}"


def supported(version: str, bounds: tuple) -> bool:
    """Whether `version` lies in `bounds` (lowest inclusive, highest exclusive or None)."""
    low, high = bounds
    found = release(version)
    return found >= low and (high is None or found < high)


def check_torch(version: str | None = None) -> None:
    """ImportError (one line) unless `version` (default: this torch) is in `TORCH_RANGE`: for the import of the
    compiled path."""
    version = version or torch.__version__
    if not supported(version, TORCH_RANGE):
        raise ImportError(f"D3D needs {requirement('torch', TORCH_RANGE)}; this is torch {version}")


def check_compiled_async(device, version: str | None = None) -> None:
    """ValueError (one line) when compiled passes with asynchronous drafting on a CUDA `device` need a newer torch
    than `version` (default: this torch); elsewhere nothing (on CPUs no CUDA graphs are recorded)."""
    version = version or torch.__version__
    if torch.device(device).type == "cuda" and release(version) < COMPILED_ASYNC_TORCH:
        need = ".".join(map(str, COMPILED_ASYNC_TORCH))
        raise ValueError(f"compile=True with asynchronous=True on CUDA needs torch>={need} (CUDA graph trees are per "
                         f"thread from {need}; this is torch {version}): upgrade torch, or use compile=True "
                         "synchronously, or asynchronous=True without compile")


__all__ = ["COMPILED_ASYNC_TORCH", "TORCH_RANGE", "TRANSFORMERS_RANGE", "check_compiled_async", "check_torch",
           "release", "requirement", "supported"]
