"""Run by the vLLM environment (in-process engine): greedy generation with the D3D drafter, recording each proposal.

`python tests_vllm/vllm_drafts.py MODELS_DIR PROMPTS_JSON OUT_JSON K` writes, per prompt, the generated tokens and
every proposal the D3D proposer made for a prefix within them: `{"prefix_length": n, "drafts": [...]}`, where the drafts were proposed for
the first n tokens of prompt + output (the last of them the anchor).
"""

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process, so the proposer can be watched

from vllm import LLM, SamplingParams  # noqa: E402

from d3d_vllm.proposer import D3DProposer  # noqa: E402

RECORDED: list[dict] = []


def record(propose):
    def wrapper(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                next_token_ids, token_indices_to_sample, common_attn_metadata, sampling_metadata, *args, **kwargs):
        rejected = kwargs.get("num_rejected_tokens_gpu")
        verified = common_attn_metadata.seq_lens.clone()
        if rejected is not None:
            verified -= rejected
        drafts = propose(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                         next_token_ids, token_indices_to_sample, common_attn_metadata, sampling_metadata, *args,
                         **kwargs)
        for length, row in zip(verified.tolist(), drafts.tolist()):
            RECORDED.append({"prefix_length": length + 1, "drafts": row})
        return drafts

    return wrapper


def main(models: str, prompts_path: str, out_path: str, num_speculative_tokens: int) -> None:
    D3DProposer.propose = record(D3DProposer.propose)
    llm = LLM(model=f"{models}/target", dtype="float32", max_model_len=256, enforce_eager=True, max_num_seqs=1,
              enable_prefix_caching=False, seed=0,
              speculative_config={"method": "draft_model", "model": f"{models}/drafter", "parallel_drafting": True,
                                  "num_speculative_tokens": num_speculative_tokens})
    results = []
    for prompt in json.load(open(prompts_path)):
        RECORDED.clear()
        output = llm.generate([{"prompt_token_ids": prompt}],
                              SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
        tokens = list(output.outputs[0].token_ids)
        # The last proposals can be for a prefix max_tokens cut short: only those whose prefix is known are kept.
        known = [proposal for proposal in RECORDED if proposal["prefix_length"] <= len(prompt) + len(tokens)]
        results.append({"prompt": prompt, "output": tokens, "proposals": known})
    json.dump(results, open(out_path, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
