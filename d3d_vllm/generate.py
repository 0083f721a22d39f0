"""Offline batched generation with vLLM for `d3d generate-data --engine vllm` (run in the vLLM environment).

`python -m d3d_vllm.generate --model TARGET --max-tokens N [--sample --seed S] [--dtype D]` reads one JSON line per
batch on stdin, `{"indices": [...], "prompts": [[ids], ...]}`, and answers each with one JSON line on stdout: the
generated ids of every prompt. Sampling starts from the target's own settings (vLLM reads its generation config:
temperature, top_p, top_k, repetition penalty...); greedy sets temperature 0, sampling seeds prompt i with seed + i.
vLLM's logs go to stderr so stdout carries only the answers.
"""

import argparse
import json
import os
import sys


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m d3d_vllm.generate")
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-tokens", type=int, required=True)
    parser.add_argument("--sample", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    from vllm import LLM

    llm = LLM(model=args.model, dtype=args.dtype, seed=args.seed)
    defaults = llm.get_default_sampling_params()
    for line in sys.stdin:
        batch = json.loads(line)
        params = [defaults.clone() for _ in batch["indices"]]
        for index, param in zip(batch["indices"], params):
            param.max_tokens = args.max_tokens
            if args.sample:
                param.seed = args.seed + index
            else:
                param.temperature = 0.0
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in batch["prompts"]], params, use_tqdm=False)
        answers.write(json.dumps([list(output.outputs[0].token_ids) for output in outputs]) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
