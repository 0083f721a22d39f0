"""`d3d generate-data --engine vllm` writes the same resumable records as the transformers path, and greedy, the
same responses."""

import json
import subprocess

from conftest import PYTHON, REPO, main_python, vllm_env


def generate_data(models, prompts_file, output, *extra) -> str:
    command = [main_python(), "-m", "d3d", "generate-data", "--target", str(models / "target"), "--prompts",
               str(prompts_file), "--output", str(output), "--max-new-tokens", "24", "--dtype", "float32",
               "--batch-size", "5", *extra]
    return subprocess.run(command, check=True, capture_output=True, text=True, env=vllm_env(), cwd=REPO).stdout


def records(output) -> list[dict]:
    return [json.loads(line) for line in (output / "responses.jsonl").read_text().splitlines()]


def test_vllm_engine_matches_transformers_greedy_and_resumes(models, prompts, tmp_path):
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("".join(" ".join(f"t{token}" for token in prompt) + "\n" for prompt in prompts[:12]))
    generate_data(models, prompts_file, tmp_path / "transformers")
    generate_data(models, prompts_file, tmp_path / "vllm", "--engine", "vllm", "--vllm-python", PYTHON)
    expected, got = records(tmp_path / "transformers"), records(tmp_path / "vllm")
    assert len(got) == 12 and all(record["completion"] for record in got)
    assert [(r["index"], r["prompt"], r["completion"]) for r in got] == [
        (r["index"], r["prompt"], r["completion"]) for r in expected]
    assert all(record["settings"]["engine"] == "vllm" for record in got)
    # A rerun reuses every record (and starts no vLLM worker).
    rerun = generate_data(models, prompts_file, tmp_path / "vllm", "--engine", "vllm", "--vllm-python", PYTHON)
    assert "reused 12 of 12 rows" in rerun
    assert records(tmp_path / "vllm") == got
