"""Fixtures of the vLLM tests. They run in the vLLM environment (`VLLM/bin/python -m pytest tests_vllm`) and call the
main environment's python (`D3D_MAIN_PYTHON`, default `.venv/bin/python` of this repository) to build the tiny
models and the reference drafts; without vLLM or without that python they are skipped, saying why."""

import json
import os
import random
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO))

from d3d.benchmark import vllm_server

# vLLM on a small CPU machine: a 1 GiB KV cache, no thread pinning, one thread (the tests run under `taskset -c N`).
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false"}

try:
    import vllm  # noqa: F401, I001  (first: its absence is the usual reason)
    import d3d_vllm  # noqa: F401
    import openai  # noqa: F401

    MISSING = None
except ImportError as error:
    MISSING = (f"vLLM environment absent ({error}): run these tests with the vLLM environment's python "
               "(README: Serving with vLLM)")


def pytest_collection_modifyitems(config, items) -> None:
    for item in items if MISSING else []:
        item.add_marker(pytest.mark.skip(reason=MISSING))


def main_python() -> str:
    path = os.environ.get("D3D_MAIN_PYTHON", str(REPO / ".venv" / "bin" / "python"))
    if not Path(path).is_file():
        pytest.skip(f"the main environment's python {path} is absent: set D3D_MAIN_PYTHON")
    return path


def run_main(*args: str) -> None:
    """Run a script of this folder with the main environment (this checkout first on its path)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([main_python(), *args], check=True, env=env, cwd=REPO, capture_output=True)


def vllm_env() -> dict:
    return {**os.environ, **VLLM_ENV}


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> Path:
    """target, drafter and wrong_vocab_drafter folders (see build_models.py)."""
    folder = tmp_path_factory.mktemp("models")
    run_main(str(HERE / "build_models.py"), str(folder))
    return folder


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    """24 prompts of 4..12 random ordinary token ids."""
    rng = random.Random(0)
    return [[rng.randrange(4, 500) for _ in range(rng.randrange(4, 13))] for _ in range(24)]


@contextmanager
def running(command: list[str], port: int, log: Path):
    """`vllm_server.running` with the vLLM environment's variables, from the repository root."""
    with vllm_server.running(command, port, log, vllm_env(), REPO) as base_url:
        yield base_url


def write_json(path: Path, value) -> Path:
    path.write_text(json.dumps(value))
    return path


PYTHON = sys.executable
