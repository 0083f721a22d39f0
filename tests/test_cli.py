import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cli.main import main
from conftest import tiny_target, word_tokenizer

ROOT = Path(__file__).parents[1]


def test_demo_runs_and_reports_lossless_output(capsys):
    assert main(["demo", "--prompts", "2", "--max-new-tokens", "20", "--block-size", "4", "--vocab-size", "6"]) == 0
    table = capsys.readouterr().out
    assert "| D3D drafter, B=4 |" in table and table.rstrip().endswith("| True |")


def test_bench_needs_no_training_extras():
    """`d3d bench --help` imports neither `datasets` nor the trainer (inference installs lack them)."""
    code = "import sys; from cli.main import main\ntry:\n    main(['bench', '--help'])\nexcept SystemExit:\n    pass\nprint(sorted(m for m in ('datasets', 'trainer') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[1])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def d3d(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python -m cli.main ARGS` in a fresh process, from `cwd`, with the project importable."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd, env=env)


def assert_one_line_error(result: subprocess.CompletedProcess, command: str, message: str) -> None:
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [result.stderr.strip()] and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"d3d {command}: error: ") and message in result.stderr


def test_a_missing_drafter_folder_is_one_line_and_exit_2(tmp_path):
    assert_one_line_error(d3d("push", "no-such-drafter", "me/repo", cwd=tmp_path), "push", "no such folder: no-such-drafter")


def test_bad_prompts_fail_before_any_model_loads(tmp_path):
    result = d3d("bench", "--target", "no/such-target", "--drafter", "no/such-drafter", "--prompts", "humaneval,missing.jsonl",
                 cwd=tmp_path)
    assert_one_line_error(result, "bench", "'missing.jsonl' is neither humaneval, pydoc nor a file")
    result = d3d("bench", "--target", "t", "--drafter", "d", "--concurrency", "1,4", "--async-budget", "4x1.5", cwd=tmp_path)
    assert_one_line_error(result, "bench", "'4x1.5' is not a list of CxF budgets")


def test_missing_training_data_fails_before_the_target_loads(tmp_path):
    result = d3d("train", "--target", "no/such-target", "--data", "no-data", "--output", "out", cwd=tmp_path)
    assert_one_line_error(result, "train", "no dataset in no-data: run `d3d generate-data --output no-data` first")


def test_debug_shows_the_traceback(tmp_path):
    result = d3d("--debug", "push", "no-such-drafter", "me/repo", cwd=tmp_path)
    assert result.returncode == 1 and "Traceback" in result.stderr and "FileNotFoundError" in result.stderr


@pytest.fixture(scope="module")
def broken(tmp_path_factory) -> dict[str, Path]:
    """A whole tiny target, one with a truncated model.safetensors, one with a corrupt config.json, a data file."""
    root = tmp_path_factory.mktemp("inputs")
    tiny_target(0).save_pretrained(root / "target")
    word_tokenizer().save_pretrained(root / "target")
    for name in ("truncated", "corrupt"):
        shutil.copytree(root / "target", root / name)
    weights = root / "truncated" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    (root / "corrupt" / "config.json").write_text('{"model_type": "qwen3", "vocab_size": ')
    (root / "prompts.txt").write_text("w1 w2\nw3 w4\n")
    return root


BAD_INPUTS = {  # name: (arguments with {root}, the command's one line contains)
    "bench, truncated weights": ("bench --target {root}/truncated --drafter {root}/target",
                                 "{root}/truncated/model.safetensors is not a whole safetensors file"),
    "prune, truncated weights": ("prune --target {root}/target --drafter {root}/truncated --data d --output o",
                                 "{root}/truncated/model.safetensors is not a whole"),
    "generate-data, truncated weights": ("generate-data --target {root}/truncated --prompts {root}/prompts.txt --output o",
                                         "{root}/truncated/model.safetensors is not a whole"),
    "bench-prefill, truncated weights": ("bench-prefill --target {root}/truncated --drafter {root}/target",
                                         "{root}/truncated/model.safetensors is not a whole"),
    "train --init, truncated weights": ("train --target {root}/target --init {root}/truncated --data d --output o",
                                        "argument --init: {root}/truncated/model.safetensors is not a whole"),
    "train, corrupt config": ("train --target {root}/corrupt --data d --output o",
                              "{root}/corrupt/config.json is not valid JSON"),
    "serve, corrupt config": ("serve --target {root}/corrupt --drafter {root}/target",
                              "{root}/corrupt/config.json is not valid JSON"),
    "push, corrupt config": ("push {root}/corrupt me/repo --dry-run {root}/out",
                             "{root}/corrupt/config.json is not valid JSON"),
    "a local folder that is not there": ("bench --target {root}/no-such-target --drafter {root}/target",
                                         "argument --target: no such folder: {root}/no-such-target"),
    "generate-data --batch-size -2": ("generate-data --target {root}/target --prompts p --output o --batch-size -2",
                                      "argument --batch-size: must be an integer >= 1, got '-2'"),
    "generate-data --batch-size 0": ("generate-data --target {root}/target --prompts p --output o --batch-size 0",
                                     "argument --batch-size: must be an integer >= 1, got '0'"),
    "generate-data --limit -3": ("generate-data --target {root}/target --prompts p --output o --limit -3",
                                 "argument --limit: must be an integer >= 1, got '-3'"),
    "train --max-steps 0": ("train --target {root}/target --data d --output o --max-steps 0",
                            "argument --max-steps: must be an integer >= 1, got '0'"),
    "bench --max-new-tokens past the positions": (
        "bench --target {root}/target --drafter {root}/target --max-new-tokens 100000",
        "--max-new-tokens 100000 does not fit the target's 512 positions"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_and_exit_2_before_any_model_loads(broken, capsys, monkeypatch, case):
    arguments, message = (text.format(root=broken) for text in BAD_INPUTS[case])
    loads = []
    monkeypatch.setattr("transformers.PreTrainedModel.from_pretrained", lambda *a, **k: loads.append(a))
    assert main(arguments.split()) == 2
    error = capsys.readouterr().err
    assert error.splitlines() == [error.strip()] and "Traceback" not in error, error
    assert error.startswith(f"d3d {arguments.split()[0]}: error: ") and message in error, error
    assert not loads
