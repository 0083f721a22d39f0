"""Run by the vLLM environment (in-process engine): greedy generation with the D3D drafter, recording each proposal.

`python tests_vllm/vllm_drafts.py MODELS_DIR PROMPTS_JSON OUT_JSON K` generates for all prompts in one batch and
writes, per prompt, the generated tokens and every proposal the D3D proposer made for a prefix within them:
`{"prefix_length": n, "drafts": [...]}`, the K drafts proposed for the first n tokens of prompt + output (the last
of them the anchor).
"""

import json
import os
import sys
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process, so the proposer can be watched

from vllm import LLM, SamplingParams

from d3d_vllm.proposer import D3DProposer

RECORDED: list[dict] = []
RUNNERS: list = []  # the model runner that built the proposer: its input batch names each row's request


def remember_runner(init):
    """`D3DProposer.__init__`, keeping the runner it is given."""

    def wrapper(self, vllm_config, device, runner=None):
        RUNNERS.append(runner)
        init(self, vllm_config, device, runner)

    return wrapper


def record(propose):
    """`D3DProposer.propose`, recording each row's drafts with its request and prefix length (verified tokens + 1)."""

    def wrapper(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                next_token_ids, token_indices_to_sample, common_attn_metadata, sampling_metadata, *args, **kwargs):
        rejected = kwargs.get("num_rejected_tokens_gpu")
        verified = common_attn_metadata.seq_lens.clone()
        if rejected is not None:
            verified -= rejected
        drafts = propose(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                         next_token_ids, token_indices_to_sample, common_attn_metadata, sampling_metadata, *args,
                         **kwargs)
        request_ids = RUNNERS[-1].input_batch.req_ids
        for request_id, length, row in zip(request_ids, verified.tolist(), drafts.tolist()):
            RECORDED.append({"request_id": request_id, "prefix_length": length + 1, "drafts": row})
        return drafts

    return wrapper


def same_request(engine_id: str, request_id: str) -> bool:
    """The engine core's request id is the caller's plus a random suffix."""
    return engine_id == request_id or engine_id.startswith(f"{request_id}-")


def main(models: str, prompts_path: str, out_path: str, num_speculative_tokens: int) -> None:
    D3DProposer.__init__ = remember_runner(D3DProposer.__init__)
    D3DProposer.propose = record(D3DProposer.propose)
    prompts = json.loads(Path(prompts_path).read_text())
    llm = LLM(model=f"{models}/target", dtype="float32", max_model_len=256, enforce_eager=True,
              max_num_seqs=len(prompts), enable_prefix_caching=False, seed=0,
              speculative_config={"method": "draft_model", "model": f"{models}/drafter", "parallel_drafting": True,
                                  "num_speculative_tokens": num_speculative_tokens})
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts],
                           SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    results = []
    for prompt, output in zip(prompts, outputs):
        tokens = list(output.outputs[0].token_ids)
        # The last proposals can be for a prefix max_tokens cut short: only those whose prefix is known are kept.
        known = [{"prefix_length": proposal["prefix_length"], "drafts": proposal["drafts"]} for proposal in RECORDED
                 if same_request(proposal["request_id"], output.request_id)
                 and proposal["prefix_length"] <= len(prompt) + len(tokens)]
        results.append({"prompt": prompt, "output": tokens, "proposals": known})
    Path(out_path).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
