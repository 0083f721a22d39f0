"""Run by the main environment: τ of this project's drafts (`draft_block`, float32) on the target's greedy
sequences, counted as vLLM counts it, for comparison with vLLM's own counters.

`python tests_vllm/reference_tau.py MODELS_DIR PROMPTS_JSON K MAX_TOKENS OUT_JSON` writes `{"rounds": r,
"accepted": a, "tau": 1 + a / r}`: per prompt, the prefill gives the first token, then each round drafts K tokens
for the sequence so far, accepts the longest prefix of them the target's greedy continuation agrees with and adds
the target's next token, until MAX_TOKENS are out (vLLM drafts K each round and counts what its sampler accepted,
even past MAX_TOKENS) or the target ends the sequence.
"""

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from modeling_d3d import D3DForBlockDiffusion


def main(models: str, prompts_path: str, k: int, max_tokens: int, out_path: str) -> None:
    target = AutoModelForCausalLM.from_pretrained(f"{models}/target", dtype=torch.float32).eval()
    drafter = D3DForBlockDiffusion.from_pretrained(f"{models}/drafter", dtype=torch.float32).eval()
    rounds = accepted = 0
    for prompt in json.loads(Path(prompts_path).read_text()):
        with torch.no_grad():
            sequence = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_tokens + k + 1,
                                       pad_token_id=target.config.pad_token_id)[0].tolist()
        length, out = len(prompt) + 1, 1
        while out < max_tokens and length < len(sequence):
            drafts = drafter.draft_block(torch.tensor([sequence[:length]])).tokens[0, :k].tolist()
            agreed = 0
            while agreed < k and length + agreed < len(sequence) and drafts[agreed] == sequence[length + agreed]:
                agreed += 1
            rounds, accepted = rounds + 1, accepted + agreed
            length, out = length + agreed + 1, out + agreed + 1
    Path(out_path).write_text(json.dumps({"rounds": rounds, "accepted": accepted, "tau": 1 + accepted / rounds}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
