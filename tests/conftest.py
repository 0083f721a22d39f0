"""Tiny Qwen3 targets and D3D drafters built from configs (no downloads)."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
from transformers.generation.streamers import BaseStreamer

from modeling_d3d import D3DForBlockDiffusion


def tiny_qwen3_config(vocab_size: int = 96, layers: int = 2, attn: str = "sdpa", **overrides) -> Qwen3Config:
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        eos_token_id=None,
        **overrides,
    )
    config._attn_implementation = attn
    return config


def tiny_target(seed: int = 0, **config_kwargs) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(tiny_qwen3_config(**config_kwargs)).eval()


def tiny_drafter(seed: int = 1, block_size: int = 4, **config_kwargs) -> D3DForBlockDiffusion:
    return D3DForBlockDiffusion.from_backbone(tiny_target(seed, **config_kwargs), block_size=block_size).eval()


def word_tokenizer(num_words: int = 90, words: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """Word-level tokenizer: ids 0..num_words-1 are words `w0`.. (the last ones replaced by `words`), then `<eos>` and
    `<pad>` as special tokens."""
    names = [f"w{i}" for i in range(num_words - len(words))] + list(words)
    vocab = {name: i for i, name in enumerate(names)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>")


def left_pad(prompts: list[torch.Tensor], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`(L_i,)` prompts -> left-padded ids and attention mask `(n, max L_i)`, as for `target.generate`."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt) :], mask[i, width - len(prompt) :] = prompt, 1
    return ids, mask


class RecordingStreamer(BaseStreamer):
    """Keeps every chunk a streamer receives, and whether it was ended."""

    def __init__(self):
        self.chunks: list[list[int]] = []
        self.ended = False

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models run fastest on one thread; on a shared two-core machine two threads stall each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def two_torch_threads():
    """Two CPU threads per parallel kernel (so a kernel starts an OpenMP pool even on a one-core machine), restored
    after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def drafter() -> D3DForBlockDiffusion:
    return tiny_drafter()


def always_predicts(model: torch.nn.Module, token: int) -> torch.nn.Module:
    """Give `model` an output head whose argmax is `token` whatever the input (a biased, zero-weight head)."""
    vocab_size, hidden_size = model.lm_head.weight.shape
    head = torch.nn.Linear(hidden_size, vocab_size, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
        head.bias[token] = 10.0
    model.lm_head = head
    return model


HIDE_PROJECT = textwrap.dedent(
    """
    import importlib.abc, sys

    class RefuseProject(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {"modeling_d3d", "d3d", "trainer", "hub_upload", "space_app"}:
                raise ModuleNotFoundError(f"{name} is hidden in this test")
            return None

    sys.meta_path.insert(0, RefuseProject())
    try:
        import modeling_d3d
        raise SystemExit("the project was importable")
    except ModuleNotFoundError:
        pass
    """
)


def run_without_project(code: str, *args: str, cwd, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `code` in a fresh Python process in which this project cannot be imported (as a Hub user would), offline
    unless `env` says otherwise (e.g. `HF_ENDPOINT` of a mock Hub); with this process's PYTHONPATH, where a run
    under another transformers (`.ci/lowest_transformers`) puts it."""
    paths = {"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {}
    return subprocess.run(
        [sys.executable, "-c", HIDE_PROJECT + textwrap.dedent(code), *args],
        cwd=cwd,
        env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HOME": str(cwd), **paths, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


def demo_table(out: str) -> dict[str, dict[str, str]]:
    """The rows of the table `d3d demo` prints: method -> {column: cell}."""
    lines = [line.strip("|").split("|") for line in out.splitlines() if line.startswith("| ")]
    header, *rows = ([cell.strip() for cell in line] for line in lines)
    return {row[0]: dict(zip(header[1:], row[1:])) for row in rows}


def run_leaving_no_process(command: list[str], timeout: float, **popen_kwargs) -> subprocess.CompletedProcess:
    """Run `command` to its end and return its output. If it runs past `timeout` seconds, it and every process it
    started are killed (a launcher's workers may run in sessions of their own, so killing its process group would
    leave them behind), then the test fails with the end of its output."""
    import psutil  # accelerate's dependency: only the launches that need it reach here

    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen_kwargs)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        launcher = psutil.Process(process.pid)
        started = launcher.children(recursive=True)  # before any dies and its children lose their parent
        for each in [launcher, *started]:
            try:
                each.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs([launcher, *started], timeout=60)
        stdout, stderr = process.communicate(timeout=60)
        pytest.fail(f"still running after {timeout} s, killed with the {len(started)} process(es) it started: "
                    f"{' '.join(command)}\n{stdout[-2000:]}\n{stderr[-4000:]}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
