"""Run by the vLLM environment (in-process engine): greedy generation with the D3D drafter, recording each proposal.

`python tests_vllm/vllm_drafts.py MODELS_DIR PROMPTS_JSON OUT_JSON K` (this checkout on PYTHONPATH) generates for all
prompts in one batch and writes, per prompt, the generated tokens and every proposal the D3D proposer made for a
prefix within them: `{"prefix_length": n, "drafts": [...]}`, the K drafts proposed for the first n tokens of
prompt + output (the last of them the anchor), as `d3d.benchmark.vllm_drafts.DraftRecorder` records them.
"""

import json
import os
import sys
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process, so the proposer can be watched

from vllm import LLM, SamplingParams

from d3d.benchmark.vllm_drafts import DraftRecorder


def main(models: str, prompts_path: str, out_path: str, num_speculative_tokens: int) -> None:
    recorder = DraftRecorder()
    recorder.install()
    recorder.recording = True
    prompts = json.loads(Path(prompts_path).read_text())
    llm = LLM(model=f"{models}/target", dtype="float32", max_model_len=256, enforce_eager=True,
              max_num_seqs=len(prompts), enable_prefix_caching=False, seed=0,
              speculative_config={"method": "draft_model", "model": f"{models}/drafter", "parallel_drafting": True,
                                  "num_speculative_tokens": num_speculative_tokens})
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts],
                           SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    Path(out_path).write_text(json.dumps(recorder.results(prompts, outputs)))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
