import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from conftest import demo_table, tiny_target, word_tokenizer
from d3d.cli.demo import RANDOM_NOTE, SPEEDUP_NOTE
from d3d.cli.main import main
from d3d.quickstart.sizes import MICRO

ROOT = Path(__file__).parents[1]


def test_demo_without_trained_models_says_so_in_one_line_and_runs_random_ones(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # no d3d-output/ here
    assert main(["demo", "--prompts", "2", "--max-new-tokens", "20", "--block-size", "4", "--vocab-size", "6"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == RANDOM_NOTE and SPEEDUP_NOTE in out.splitlines()
    rows = demo_table(out)
    assert list(rows) == ["target alone: generate (baseline)", "D3D sync, B=4", "D3D async, B=4 C=4 F=2"]
    assert rows["target alone: generate (baseline)"]["speedup"] == "1.00x"
    assert all(row["identical"] == "True" for row in rows.values())


def test_demo_refuses_half_given_models_and_random_only_settings(tmp_path):
    assert_one_line_error(d3d("demo", "--target", "t", cwd=tmp_path), "demo", "give both --target and --drafter")
    assert_one_line_error(d3d("demo", "--random", "--target", "t", "--drafter", "d", cwd=tmp_path), "demo",
                          "--random runs random models")
    assert_one_line_error(d3d("demo", "--target", "t", "--drafter", "d", "--block-size", "4", cwd=tmp_path), "demo",
                          "apply to random models only")


def test_bench_needs_no_training_extras():
    """`d3d bench --help` imports neither `datasets` nor the trainer (inference installs lack them)."""
    code = ("import sys; from d3d.cli.main import main\n"
            "try:\n    main(['bench', '--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('datasets', 'd3d.trainer') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_an_unknown_command_imports_no_command_module():
    """`d3d generate --help` (no such command) and `d3d --help` answer without importing any command's module (each
    pulls in torch and transformers)."""
    code = ("import sys; from d3d.cli.main import COMMANDS, main\n"
            "for argv in (['generate', '--help'], ['--help']):\n"
            "    assert main(argv) in (0, 2), argv\n"
            "print(sorted(name for name in (f'd3d.cli.{module}' for module, _ in COMMANDS.values())"
            " if name in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"
    assert "invalid choice: 'generate'" in result.stderr


def d3d(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python -m d3d ARGS` in a fresh process, from `cwd`, with the project importable."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "d3d", *args], capture_output=True, text=True, timeout=300,
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
    assert_one_line_error(result, "bench", "'missing.jsonl' is neither humaneval, pydoc, repetitive nor a file")
    result = d3d("bench", "--target", "org/t", "--drafter", "org/d", "--concurrency", "1,4", "--async-budget", "4x1.5", cwd=tmp_path)
    assert_one_line_error(result, "bench", "'4x1.5' is not a list of CxF budgets")


def test_missing_training_data_fails_before_the_target_loads(tmp_path):
    result = d3d("train", "--target", "no/such-target", "--data", "no-data", "--output", "out", cwd=tmp_path)
    assert_one_line_error(result, "train", "no dataset in no-data: run `d3d generate-data --output no-data` first")


def test_debug_shows_the_traceback(tmp_path):
    result = d3d("--debug", "push", "no-such-drafter", "me/repo", cwd=tmp_path)
    assert result.returncode == 1 and "Traceback" in result.stderr and "FileNotFoundError" in result.stderr



def test_an_internal_error_is_reported_as_a_bug_with_a_debug_hint_not_as_a_user_error(monkeypatch, capsys):
    """An internal invariant (RuntimeError, AssertionError) is not dressed as bad input: exit 1, `internal error`,
    a hint to rerun with --debug; with --debug, the exception itself."""
    import d3d.cli.demo
    import torch
    from transformers import Qwen3Config

    from modeling_d3d.caches_d3d import StaticKVCache

    config = Qwen3Config(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=4)

    def broken_run(args):  # a real internal invariant failing inside a command: a pass that does not fit its cache
        StaticKVCache(config, 1, 4, "cpu", torch.float32).plan(2, torch.zeros(2, 1, dtype=torch.long), 2)

    monkeypatch.setattr(d3d.cli.demo, "run", broken_run)
    assert main(["demo"]) == 1
    error = capsys.readouterr().err
    assert error.startswith("d3d demo: internal error") and "RuntimeError" in error and "--debug" in error
    assert "Traceback" not in error and ": error:" not in error

    def failed_assertion(args):
        assert False, "rows out of order"

    monkeypatch.setattr(d3d.cli.demo, "run", failed_assertion)
    assert main(["demo"]) == 1 and "AssertionError: rows out of order" in capsys.readouterr().err
    with pytest.raises(AssertionError, match="rows out of order"):
        main(["--debug", "demo"])


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
    (root / "micro").mkdir()
    (root / "micro" / "sizes.json").write_text(json.dumps({"dtype": "float32", **asdict(MICRO), "scale": 1.0}))
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
    "space --port -1": ("space --port -1", "argument --port: must be a port, 1..65535, got '-1'"),
    "space --device bogus": ("space --device bogus", "argument --device: must be a device such as cpu, cuda or cuda:1"),
    "space --drafter-device bogus": ("space --drafter-device bogus", "argument --drafter-device: must be a device"),
    "space --concurrency 0": ("space --concurrency 0", "argument --concurrency: must be an integer >= 1, got '0'"),
    "space, truncated drafter": ("space --target {root}/target --drafter {root}/truncated",
                                 "--drafter {root}/truncated: {root}/truncated/model.safetensors is not a whole"),
    "train --min-learning-rate -1": ("train --target {root}/target --data d --output o --min-learning-rate -1",
                                     "argument --min-learning-rate: must be a number >= 0, got '-1'"),
    "train --gamma -1": ("train --target {root}/target --data d --output o --gamma -1",
                         "argument --gamma: must be a number > 0, got '-1'"),
    "prune --min-tau-fraction 2": ("prune --target {root}/target --drafter {root}/target --data d --output o "
                                   "--min-tau-fraction 2", "argument --min-tau-fraction: must be a number from 0 to 1"),
    "push to an invalid repo id": ("push {root}/target a/b/c", "argument repo_id: must be a Hub repository id"),
    "a bare name that is no folder": ("bench --target no-such-model --drafter {root}/target",
                                      "argument --target: no such folder: no-such-model (and not a Hub id"),
    "serve --max-model-len 0": ("serve --target {root}/target --drafter {root}/target --max-model-len 0",
                                "argument --max-model-len: must be an integer >= 1, got '0'"),
    "quickstart --time-budget -5": ("quickstart --output {root}/qs --time-budget -5",
                                    "argument --time-budget: must be a number >= 0, got '-5'"),
    "quickstart into a folder of other sizes": ("quickstart --output {root}/micro",
                                                "{root}/micro holds a quickstart of other sizes"),
    "quickstart --time-budget inf": ("quickstart --output {root}/qs --time-budget inf",
                                     "argument --time-budget: must be a number >= 0, got 'inf'"),
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


def test_the_cli_defaults_are_the_library_defaults(tmp_path):
    """A setting's default has one owner: `d3d train` / `d3d prune` without the option run as the library does."""
    import inspect

    from d3d.cli.main import build_parser
    from d3d.trainer.d3d_trainer import D3DTrainingArguments
    from d3d.trainer.pruning import prune

    folder = str(tmp_path)
    parser = build_parser()
    trained = parser.parse_args(["train", "--target", folder, "--data", folder, "--output", folder])
    pruned = parser.parse_args(["prune", "--target", folder, "--drafter", folder, "--data", folder, "--output", folder])
    library = inspect.signature(prune).parameters
    assert trained.gamma == D3DTrainingArguments.__dataclass_fields__["gamma"].default
    assert (pruned.min_tau_fraction, pruned.max_new_tokens) == (
        library["min_tau_fraction"].default, library["max_new_tokens"].default)
