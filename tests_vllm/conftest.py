"""Fixtures of the vLLM tests. They run in the vLLM environment (`VLLM/bin/python -m pytest tests_vllm`) and call the
main environment's python (`D3D_MAIN_PYTHON`, default `.venv/bin/python` of this repository) to build the tiny
models and the reference drafts; without vLLM or without that python they are skipped, saying why."""

import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
# vLLM on a small CPU machine: a 1 GiB KV cache, no thread pinning, one thread (the tests run under `taskset -c N`).
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false"}
START_TIMEOUT = 300

try:
    import vllm  # noqa: F401

    import d3d_vllm  # noqa: F401
except ImportError as error:
    pytest.skip(f"vLLM environment absent ({error}): run these tests with the vLLM environment's python "
                "(README: Serving with vLLM)", allow_module_level=True)


def main_python() -> str:
    path = os.environ.get("D3D_MAIN_PYTHON", str(REPO / ".venv" / "bin" / "python"))
    if not Path(path).is_file():
        pytest.skip(f"the main environment's python {path} is absent: set D3D_MAIN_PYTHON", allow_module_level=True)
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


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def running(command: list[str], port: int, log: Path):
    """Start a server command, wait until its /health answers, yield its base URL, then stop it."""
    with log.open("w") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=vllm_env(), cwd=REPO,
                                   start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if process.poll() is not None:
                raise AssertionError(f"server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"server not up after {START_TIMEOUT} s:\n{log.read_text()[-3000:]}")
                time.sleep(1)
        yield f"http://127.0.0.1:{port}"
    finally:
        if process.poll() is None:
            os.killpg(process.pid, 15)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()


def spec_metrics(base_url: str) -> dict[str, float]:
    """vLLM's own speculative-decoding counters from /metrics (summed over label sets)."""
    text = urllib.request.urlopen(f"{base_url}/metrics", timeout=10).read().decode()
    counters: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:spec_decode_num_") and "_total" in line:
            name = line.split("{")[0].split(" ")[0]
            counters[name] = counters.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return counters


def write_json(path: Path, value) -> Path:
    path.write_text(json.dumps(value))
    return path


PYTHON = sys.executable
