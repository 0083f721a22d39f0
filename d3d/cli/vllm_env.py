"""The vLLM environment the vLLM-backed commands run in: its own virtual environment, since vLLM pins an older
transformers than this project (README: Serving with vLLM). `--vllm-python` names its python."""

import argparse
import shutil
import subprocess
from pathlib import Path

from .errors import UserError


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vllm-python", default=None,
                        help="python of the vLLM environment (default: the one beside `vllm` on PATH)")


def vllm_python(given: str | None) -> str:
    """The vLLM environment's python, checked to import the plugin."""
    if given is None:
        vllm = shutil.which("vllm")
        if vllm is None:
            raise UserError("no `vllm` on PATH: create the vLLM environment (README: Serving with vLLM) or pass "
                            "--vllm-python")
        given = str(Path(vllm).parent / "python")
    if shutil.which(given) is None:
        raise UserError(f"--vllm-python {given}: not an executable")
    check = subprocess.run([given, "-c", "import d3d_vllm, vllm"], capture_output=True, text=True, check=False)
    if check.returncode != 0:
        raise UserError(f"{given} cannot import vllm and the d3d_vllm plugin: pip install ./d3d_vllm into the vLLM "
                        "environment (README: Serving with vLLM)")
    return given
