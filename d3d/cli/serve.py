"""`d3d serve`: vLLM's OpenAI-compatible server for a target, drafting with a D3D drafter (the `d3d_vllm` plugin).

vLLM lives in its own environment (it pins an older transformers than this project): `--vllm-python` names that
environment's python, by default the one beside a `vllm` on PATH; the plugin must be installed there
(`pip install ./d3d_vllm`, see the README). Arguments after `--` go to vLLM's server unchanged.
"""

import argparse
import json
import subprocess
from pathlib import Path

from d3d.benchmark.vllm_server import d3d_speculative_config, server_command

from . import vllm_env
from .errors import UserError
from .inputs import model_folder, port, positive_int

DTYPES = ("auto", "float32", "bfloat16", "float16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, type=model_folder, help="target model folder (a Qwen3 causal LM)")
    parser.add_argument("--drafter", required=True, type=model_folder, help="D3D drafter folder saved by this project")
    parser.add_argument("--num-speculative-tokens", type=int, default=None,
                        help="drafts verified per round, 1..block_size-1 (default block_size-1)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=port, default=8000)
    parser.add_argument("--dtype", choices=DTYPES, default="auto", help="vLLM's --dtype for target and drafter")
    parser.add_argument("--max-model-len", type=positive_int, default=None, help="vLLM's --max-model-len")
    vllm_env.add_argument(parser)
    parser.add_argument("vllm_args", nargs=argparse.REMAINDER, help="-- then extra arguments of vLLM's server (as `vllm serve` takes)")


def read_config(folder: str, role: str) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise UserError(f"--{role} {folder}: no config.json there (a saved model folder is needed)")
    return json.loads(path.read_text())


def speculative_config(drafter: str, target_config: dict, num_speculative_tokens: int | None) -> dict:
    """vLLM's `--speculative-config` for this drafter, after checking it can draft for the target."""
    config = read_config(drafter, "drafter")
    if config.get("model_type") != "d3d":
        raise UserError(f"--drafter {drafter}: model_type is {config.get('model_type')!r}, not a D3D drafter ('d3d')")
    if config.get("vocab_size") != target_config.get("vocab_size"):
        raise UserError(f"--drafter {drafter}: vocabulary size {config.get('vocab_size')} differs from the "
                        f"target's {target_config.get('vocab_size')}; a D3D drafter must share the target's tokenizer")
    block_size = config.get("block_size", 16)
    tokens = block_size - 1 if num_speculative_tokens is None else num_speculative_tokens
    if not 1 <= tokens <= block_size - 1:
        raise UserError(f"--num-speculative-tokens must be 1..{block_size - 1} (block_size - 1), got {tokens}")
    return d3d_speculative_config(str(Path(drafter).resolve()), tokens)


def serve_command(args: argparse.Namespace) -> list[str]:
    """The vLLM server's command line for `args` (every input checked first)."""
    target_config = read_config(args.target, "target")
    spec = speculative_config(args.drafter, target_config, args.num_speculative_tokens)
    length = [] if args.max_model_len is None else ["--max-model-len", str(args.max_model_len)]
    extra = ["--dtype", args.dtype, *length, *(arg for arg in args.vllm_args if arg != "--")]
    return server_command(vllm_env.vllm_python(args.vllm_python), str(Path(args.target).resolve()), args.port, spec,
                          extra, args.host)


def run(args: argparse.Namespace) -> int:
    command = serve_command(args)
    spec = json.loads(command[command.index("--speculative-config") + 1])
    print(f"d3d serve: {args.target} with the D3D drafter {args.drafter} ({spec['num_speculative_tokens']} drafts a "
          f"round), OpenAI-compatible API at http://{args.host}:{args.port}/v1", flush=True)
    return subprocess.run(command, check=False).returncode
