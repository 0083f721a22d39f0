"""Run by the main environment: this project's own drafts (`draft_block`, float32) for the prefixes vLLM drafted for.

`python tests_vllm/reference_drafts.py DRAFTER VLLM_DRAFTS_JSON OUT_JSON` writes, for every proposal recorded by
`vllm_drafts.py`, the first K tokens `D3DForBlockDiffusion.draft_block` proposes for the same prefix.
"""

import json
import sys
from pathlib import Path

import torch

from modeling_d3d import D3DForBlockDiffusion


def main(drafter_path: str, recorded_path: str, out_path: str) -> None:
    drafter = D3DForBlockDiffusion.from_pretrained(drafter_path, dtype=torch.float32).eval()
    reference = []
    for result in json.loads(Path(recorded_path).read_text()):
        sequence = result["prompt"] + result["output"]
        drafts = []
        for proposal in result["proposals"]:
            prefix = torch.tensor([sequence[: proposal["prefix_length"]]])
            tokens = drafter.draft_block(prefix).tokens[0, : len(proposal["drafts"])]
            drafts.append(tokens.tolist())
        reference.append(drafts)
    Path(out_path).write_text(json.dumps(reference))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
