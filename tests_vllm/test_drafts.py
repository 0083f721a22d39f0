"""vLLM runs the drafter the project trained: the D3D proposer's drafts, for 6 requests batched together, equal
`draft_block`'s (float32) for the same prefixes, token for token."""

import json
import subprocess
from itertools import pairwise

from conftest import HERE, PYTHON, REPO, run_main, vllm_env, write_json


def test_proposer_drafts_equal_draft_block(models, prompts, tmp_path):
    chosen = write_json(tmp_path / "prompts.json", prompts[:6])
    recorded, reference = tmp_path / "vllm.json", tmp_path / "reference.json"
    subprocess.run([PYTHON, str(HERE / "vllm_drafts.py"), str(models), str(chosen), str(recorded), "5"], check=True,
                   env={**vllm_env(), "PYTHONPATH": str(REPO)}, capture_output=True)
    run_main(str(HERE / "reference_drafts.py"), str(models / "drafter"), str(recorded), str(reference))
    results, expected = json.loads(recorded.read_text()), json.loads(reference.read_text())
    proposals = [proposal for result in results for proposal in result["proposals"]]
    assert len(proposals) >= 6 * 8
    assert all(len(proposal["drafts"]) == 5 for proposal in proposals)
    assert [[proposal["drafts"] for proposal in result["proposals"]] for result in results] == expected
    # Drafts were accepted on the way, so prefixes after partly rejected blocks were drafted for too.
    lengths = [[proposal["prefix_length"] for proposal in result["proposals"]] for result in results]
    assert any(later - earlier > 1 for row in lengths for earlier, later in pairwise(row))
