"""What the Space loads and where from: command-line arguments, else environment variables, else the quickstart's
output folder. Read when the app starts (never at import); no Gradio here, so `d3d --help` does not need it."""

import argparse
import os
from collections.abc import Callable

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

DEFAULT_TARGET = "d3d-output/target"
DEFAULT_DRAFTER = "d3d-output/drafter"
DEFAULT_QUEUE_SIZE = 16


def add_arguments(parser: argparse.ArgumentParser, port: Callable[[str], int] = int,
                  count: Callable[[str], int] = int, device: Callable[[str], str] = str) -> None:
    """The Space's options; `port`, `count` (of requests) and `device` check those values as they are parsed
    (`d3d space` passes `d3d.cli.inputs`' checks; the Space itself, with no project to import, plain conversions)."""
    parser.add_argument("--target", help=f"target folder or Hub id (else $D3D_TARGET, else {DEFAULT_TARGET})")
    parser.add_argument("--drafter", help=f"D3D drafter folder or Hub id (else $D3D_DRAFTER, else {DEFAULT_DRAFTER})")
    parser.add_argument("--device", type=device,
                        help="the target's device (default: cuda:0 when there is a GPU, else cpu)")
    parser.add_argument("--drafter-device", type=device,
                        help="the drafter's device (default: cuda:1 with two GPUs, else --device)")
    parser.add_argument("--host", help="address to serve on (default: $GRADIO_SERVER_NAME, else 127.0.0.1)")
    parser.add_argument("--port", type=port, help="port (default: $GRADIO_SERVER_PORT, else the first free from 7860)")
    parser.add_argument("--concurrency", type=count, default=2, help="requests decoding at once (they share the hardware)")
    parser.add_argument(
        "--queue-size", type=count, default=DEFAULT_QUEUE_SIZE, help="requests waiting at most; more are refused"
    )


def model_sources(args: argparse.Namespace) -> tuple[str, str]:
    """(target, drafter): each from its argument, else `D3D_TARGET` / `D3D_DRAFTER`, else the quickstart folder."""
    target = args.target or os.environ.get("D3D_TARGET") or DEFAULT_TARGET
    drafter = args.drafter or os.environ.get("D3D_DRAFTER") or DEFAULT_DRAFTER
    return target, drafter


def devices(args: argparse.Namespace) -> tuple[str, str]:
    """(target device, drafter device): the drafter on a second GPU when there is one, as D3D async is meant to run."""
    gpus = torch.cuda.device_count()
    target = args.device or ("cuda:0" if gpus else "cpu")
    drafter = args.drafter_device or ("cuda:1" if gpus > 1 and args.device is None else target)
    return target, drafter


def load_models(target_source: str, drafter_source: str, target_device: str = "cpu", drafter_device: str = "cpu",
                dtype: torch.dtype | None = None):
    """(target, drafter, tokenizer): the target causal LM and its tokenizer, the drafter through its remote code
    (`trust_remote_code`, as a Hub user loads it), checked to fit the target.

    dtype: `d3d space` passes `d3d.common.dtype.choose_dtype`'s; as a Space's root (the project not importable) None
    means bfloat16 on CUDA with native bf16, else float32 (the same rule without the CPU bf16 check)."""
    if dtype is None:
        cuda_bf16 = target_device.startswith("cuda") and torch.cuda.is_bf16_supported()
        dtype = torch.bfloat16 if cuda_bf16 else torch.float32
    target = AutoModelForCausalLM.from_pretrained(target_source, dtype=dtype).to(target_device).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_source)
    drafter = AutoModel.from_pretrained(drafter_source, trust_remote_code=True, dtype=dtype).to(drafter_device).eval()
    drafter.check_compatibility(target, tokenizer)
    return target, drafter, tokenizer


__all__ = ["DEFAULT_DRAFTER", "DEFAULT_QUEUE_SIZE", "DEFAULT_TARGET", "add_arguments", "devices", "load_models", "model_sources"]
