"""A real vLLM OpenAI-compatible server on 127.0.0.1, called with the `openai` client: greedy completions with the
D3D drafter (started by `d3d serve`), one request at a time and 8 in flight, are identical to vLLM without
speculation; vLLM's acceptance counters (rounds, accepted drafts: τ) are exactly those of this project's drafts
(`draft_block`) on the same sequences (a block drafted causally, or over a cache pass 1 did not fill, drafts other
tokens: on these tiny models τ barely moves, 1.255 -> 1.246 for a causal block, 1.13 without pass 1, but the
counts differ);
a drafter with another vocabulary, or settings that cannot draft a D3D block, are refused at start."""

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import HERE, PYTHON, REPO, main_python, run_main, running, vllm_env, write_json

from d3d.benchmark.vllm_server import SERVER, free_port, spec_counters

# Both servers: no prefix caching (exactness is checked on computed tokens), eager mode, a short context.
VLLM_FLAGS = ["--no-enable-prefix-caching", "--enforce-eager", "--max-model-len", "256", "--seed", "0"]
MAX_TOKENS = 32
K = 5


def completions(base_url: str, prompts: list[list[int]], concurrency: int = 1) -> list[str]:
    """Greedy completions of `prompts`, `concurrency` requests in flight at a time (so vLLM batches them)."""
    import openai  # the vLLM environment's (the plugin's `test` extra)

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused")
    model = client.models.list().data[0].id

    def complete(prompt: list[int]) -> str:
        response = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0)
        return response.choices[0].text

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(complete, prompts))


@pytest.fixture(scope="module")
def plain(models, prompts, tmp_path_factory) -> list[str]:
    """vLLM alone: the reference completions."""
    port = free_port()
    command = [PYTHON, "-m", SERVER, "--model", str(models / "target"), "--port", str(port),
               "--dtype", "float32", *VLLM_FLAGS]
    with running(command, port, tmp_path_factory.mktemp("plain") / "server.log") as base_url:
        return completions(base_url, prompts)


def test_d3d_server_is_lossless_and_reports_acceptance(models, prompts, plain, tmp_path):
    port = free_port()
    command = [main_python(), "-m", "d3d", "serve", "--target", str(models / "target"),
               "--drafter", str(models / "drafter"), "--num-speculative-tokens", str(K), "--port", str(port),
               "--dtype", "float32", "--vllm-python", PYTHON, "--", *VLLM_FLAGS]
    log = tmp_path / "server.log"
    with running(command, port, log) as base_url:
        texts = completions(base_url, prompts)
        counters = spec_counters(base_url)
        batched = completions(base_url, prompts, concurrency=8)
    assert f"http://127.0.0.1:{port}/v1" in log.read_text()
    assert len(prompts) >= 20 and all(text for text in plain)
    assert texts == plain
    assert batched == plain
    drafts, accepted = counters["num_drafts"], counters["num_accepted_tokens"]
    assert drafts > 0 and accepted > 0
    reference_path = tmp_path / "reference_tau.json"
    run_main(str(HERE / "reference_tau.py"), str(models), str(write_json(tmp_path / "prompts.json", prompts)), str(K),
             str(MAX_TOKENS), str(reference_path))
    reference = json.loads(reference_path.read_text())
    tau = 1 + accepted / drafts
    print(f"\nD3D in vLLM on the tiny models: {int(drafts)} rounds, {int(accepted)} drafts accepted, "
          f"tau = {tau:.3f} tokens per target pass; draft_block on the same sequences: {reference['rounds']} rounds, "
          f"tau = {reference['tau']:.3f}")
    assert (int(drafts), int(accepted)) == (reference["rounds"], reference["accepted"])


@pytest.mark.parametrize(("drafter", "settings", "env", "message"), [
    ("wrong_vocab_drafter", {"parallel_drafting": True, "num_speculative_tokens": 5}, {},
     "Target and draft model should have the same vocabulary size"),
    ("drafter", {"parallel_drafting": False, "num_speculative_tokens": 5}, {}, "set parallel_drafting: true"),
    ("drafter", {"parallel_drafting": True, "num_speculative_tokens": 8}, {},
     "num_speculative_tokens must be 1..7 (block_size - 1), got 8"),
    ("drafter", {"parallel_drafting": True, "num_speculative_tokens": 5}, {"VLLM_USE_V2_MODEL_RUNNER": "1"},
     "D3D drafter: needs Model Runner V1"),
])
def test_bad_drafting_settings_are_refused_at_start(models, drafter, settings, env, message):
    """vLLM's own check (vocabulary) and the plugin's (a block of B: parallel drafting, K <= B-1; the V1 runner)."""
    spec = json.dumps({"method": "draft_model", "model": str(models / drafter), **settings})
    command = [PYTHON, "-m", SERVER, "--model", str(models / "target"), "--port", str(free_port()),
               "--speculative-config", spec, *VLLM_FLAGS]
    result = subprocess.run(command, capture_output=True, text=True, env={**vllm_env(), **env}, cwd=REPO,
                            timeout=300, check=False)
    assert result.returncode != 0
    assert message in result.stdout + result.stderr
