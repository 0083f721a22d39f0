"""`d3d gpu-check`: the smoke run on a CPU (its float32 identity checks pass), the refusal without CUDA, and a
corrupted engine output caught by the identity check with its margin."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers

from d3d.benchmark import gpu_check, gpu_check_identity
from d3d.benchmark.gpu_check_models import SMOKE_SHAPES, Context, ModelCache
from d3d.benchmark.gpu_check_speed import timing_check
from d3d.cli.main import main

ROOT = Path(__file__).parents[1]


def d3d(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    paths = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])  # keeps a transformers there
    environment = {**os.environ, "PYTHONPATH": paths, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "d3d", *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd, env=environment)


def test_smoke_run_writes_every_check_and_identity_passes(tmp_path):
    result = d3d("gpu-check", "--smoke", "--output", "tmp", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    in_range = [f"{name} {version} (in the supported {name}>=" for name, version in
                (("torch", torch.__version__), ("transformers", transformers.__version__))]
    first = result.stdout.splitlines()[0]
    assert first.startswith("d3d gpu-check: ") and all(part in first for part in in_range), first
    report = json.loads((tmp_path / "tmp" / "gpu_check.json").read_text())
    statuses = {check["name"]: check["status"] for check in report["checks"]}
    assert list(statuses) == list(gpu_check.SMOKE_CHECKS)
    assert all(status in gpu_check.STATUSES for status in statuses.values())
    assert statuses["environment"] == "pass"
    assert statuses["identity-float32-sync"] == statuses["identity-float32-async"] == "pass"
    assert statuses["identity-float32-cross-device"] == "pass"  # on a CPU: the drafter on the CPU beside the target
    assert statuses["overlap-8b"] == "measured"  # the worker thread's pass beside the verify pass (CUDA: streams)
    for check in report["checks"][1:4]:
        cases = check["details"]["cases"]
        assert [case["case"] for case in cases] == ["rows=1", "rows=1 +processors", "rows=3", "rows=3 +processors"]
        accepted = {int(n) for case in cases for n in case["round_record"]["accepted"]}
        assert len(accepted) > 2  # rounds accepted different numbers of drafts, not only the target's token
    table = (tmp_path / "tmp" / "gpu_check.md").read_text()
    assert "| identity-float32-sync | pass |" in table


def test_order_and_budget_run_every_check():
    """The compile checks run on the float32 models right after the float32 identity checks, before the 8B ones (not
    last, where a short budget skipped them), and every check's least time (measured on one H200) fits the default
    budget, so none is skipped for time; with the watchdog's minute the run ends within the device tool's 10-minute
    call."""
    checks = gpu_check.all_checks()
    names = [check.name for check in checks]
    assert names[:8] == ["environment", "identity-float32-sync", "identity-float32-async",
                         "identity-float32-cross-device", "compile-sync", "compile-async", "compile-back-to-back",
                         "compile-new-prompts"]
    assert sum(check.min_seconds for check in checks) <= gpu_check.DEFAULT_BUDGET_S <= 10 * 60 - 60 - 60


def test_versions_line_says_what_is_outside_the_supported_ranges(monkeypatch):
    monkeypatch.setattr(transformers, "__version__", "5.16.0")
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    assert gpu_check.versions_line() == (
        "d3d gpu-check: torch 2.11.0+cu130 (in the supported torch>=2.4); transformers 5.16.0 (NOT in the supported "
        "transformers>=5.17,<5.24); compile-async expects the engine's refusal (compiled asynchronous drafting on "
        "CUDA needs torch>=2.13)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_cuda_and_smoke_one_line_and_exit_2(tmp_path, capsys):
    assert main(["gpu-check", "--output", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == ("d3d gpu-check: error: gpu-check needs a CUDA GPU (none is visible); "
                                               "on a CPU run `d3d gpu-check --smoke`")
    assert not (tmp_path / "out").exists()
    assert main(["gpu-check", "--help"]) == 0
    help_text = capsys.readouterr().out
    assert "--smoke" in help_text and "identity-float32" in help_text


def test_identity_check_reports_a_corrupted_token_with_its_margin(monkeypatch, one_torch_thread):
    """The check is not blind: an engine output with one token changed fails, at that position, with the
    reference's top-2 margin and the score gap of the wrong token."""
    decode = gpu_check_identity.decode

    def corrupted(*args, **kwargs):
        output = decode(*args, **kwargs)
        output[0, -2] = (output[0, -2] + 1) % SMOKE_SHAPES.vocab
        return output

    monkeypatch.setattr(gpu_check_identity, "decode", corrupted)
    device = torch.device("cpu")
    context = Context(SMOKE_SHAPES, device, ModelCache(SMOKE_SHAPES, device), time.monotonic() + 600)
    check = next(c for c in gpu_check.all_checks() if c.name == "identity-float32-sync")
    result = gpu_check.run_check(check, context)
    assert result.status == "fail", result
    first_case = result.details["cases"][0]
    row = first_case["rows"][0]
    assert row["identical"] is False and row["first_divergence"] == SMOKE_SHAPES.max_new_tokens - 2
    assert row["reference_top2_margin"] >= 0 and row["score_gap"] > 0
    assert "margin" in result.summary


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_vllm_checks_without_cuda_or_without_vllm_one_line_and_exit_2(tmp_path, capsys):
    """`--vllm` refuses, one line each: no CUDA without --smoke, a python that cannot import vLLM, options of the
    other checks; `--vllm-python` without `--vllm`. The smoke run itself is tests_vllm/test_gpu_check_vllm.py."""
    out = str(tmp_path / "out")
    refusals = {
        ("--vllm",): "gpu-check --vllm needs a CUDA GPU (none is visible); on a CPU run `d3d gpu-check --vllm --smoke`",
        ("--vllm", "--smoke", "--vllm-python", sys.executable):
            f"{sys.executable} cannot import vllm and the d3d_vllm plugin: pip install ./d3d_vllm into the vLLM "
            "environment (README: Serving with vLLM)",
        ("--vllm", "--smoke", "--only", "environment", "--prefix", "8"):
            "--only, --prefix: not options of the vLLM checks (--vllm)",
        ("--vllm-python", sys.executable): "--vllm-python goes with --vllm",
        ("--vllm-eager",): "--vllm-eager goes with --vllm",
        ("--vllm", "--smoke", "--budget-s", "0"): "--budget-s must be positive, got 0.0",
    }
    for args, message in refusals.items():
        assert main(["gpu-check", "--output", out, *args]) == 2
        assert capsys.readouterr().err.strip() == f"d3d gpu-check: error: {message}"
    assert not (tmp_path / "out").exists()


def test_timing_check_runs_at_smoke_shapes_and_reports_the_timed_calls():
    """`timing-8b` (CUDA-only in the command, so no smoke run reaches it) at smoke shapes on this CPU: each row of the
    report is the timed call's own round record (its 48 tokens, not the 4-token warm-up's), with the verify policy's
    and the forced-acceptance runs beside it."""
    device = torch.device("cpu")
    context = Context(SMOKE_SHAPES, device, ModelCache(SMOKE_SHAPES, device), time.monotonic() + 600)
    status, summary, details = timing_check(context)
    assert status == "measured" and summary.startswith("rows 1: generate ")
    (rows,) = details["per_rows"]
    measured = rows["engine_measured"]
    n = SMOKE_SHAPES.timing_new_tokens
    for name in ("sync_random_drafter", "async_random_drafter", "sync_random_drafter_policy"):
        assert round(measured[name]["rounds"] * measured[name]["tau"]) == n, name  # the timed call's tokens
    assert measured["sync_forced_tau"]["tau"] > 2 and rows["generate_tokens_per_s"] > 0
    assert set(rows["pass_ms_cuda_events"]) == {"target_step", "verify", "block_draft", "successor"}
