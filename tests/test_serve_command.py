"""`d3d serve` refuses bad input before starting vLLM: one line on stderr and exit 2 (the server itself is tested in
tests_vllm/, in the vLLM environment)."""

import json
import sys

import pytest

from d3d.cli.main import main


def folder(path, **config):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture
def models(tmp_path):
    return {
        "target": folder(tmp_path / "target", model_type="qwen3", vocab_size=512),
        "drafter": folder(tmp_path / "drafter", model_type="d3d", vocab_size=512, block_size=8, mask_token_id=511),
        "wrong_vocab": folder(tmp_path / "wrong_vocab", model_type="d3d", vocab_size=640, block_size=8),
        "not_d3d": folder(tmp_path / "not_d3d", model_type="qwen3", vocab_size=512),
    }


def error_of(capsys, *args) -> str:
    assert main(["serve", *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("d3d serve: error: ")
    return lines[0]


@pytest.mark.parametrize(("drafter", "extra", "message"), [
    ("wrong_vocab", [], "vocabulary size 640 differs from the target's 512"),
    ("not_d3d", [], "not a D3D drafter"),
    ("drafter", ["--num-speculative-tokens", "8"], "must be 1..7"),
    ("drafter", ["--port", "70000"], "argument --port: must be a port, 1..65535, got '70000'"),
    ("drafter", ["--max-model-len", "0"], "argument --max-model-len: must be an integer >= 1, got '0'"),
    ("missing", [], "no such folder"),
    ("empty", [], "no config.json there"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, models, tmp_path, drafter, extra, message):
    path = models.get(drafter, str(tmp_path / drafter))
    if drafter == "empty":
        (tmp_path / drafter).mkdir()
    assert message in error_of(capsys, "--target", models["target"], "--drafter", path, *extra)


def test_no_vllm_environment_is_one_line_and_exit_2(capsys, models, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert "no `vllm` on PATH" in error_of(capsys, "--target", models["target"], "--drafter", models["drafter"])
    # This environment's python has neither vLLM nor the plugin.
    message = error_of(capsys, "--target", models["target"], "--drafter", models["drafter"], "--vllm-python",
                       sys.executable)
    assert "cannot import vllm and the d3d_vllm plugin" in message
