"""`d3d demo`: speculative decoding with a D3D drafter on tiny random Qwen3 models, checked against the target.

It needs no download and no training: it shows the mechanics (the engine: one drafting pass per round, lossless
output, statistics). Random models agree rarely, so expect tau near 1; trained drafters are what make it fast.
"""

import argparse
import time

import torch
from tqdm import tqdm
from transformers import Qwen3Config, Qwen3ForCausalLM

from modeling_d3d import D3DForBlockDiffusion


def tiny_qwen3(seed: int, vocab_size: int) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    )
    return Qwen3ForCausalLM(config).eval()


def run_demo(prompts: int, max_new_tokens: int, block_size: int, vocab_size: int, seed: int) -> bool:
    """Decode `prompts` random prompts with the target alone and with a D3D drafter; print a table.

    Returns whether every speculative output was token-identical to the target's greedy output.
    """
    target = tiny_qwen3(seed, vocab_size)
    drafter = D3DForBlockDiffusion.from_backbone(tiny_qwen3(seed + 1, vocab_size), block_size=block_size).eval()
    drafter.check_compatibility(target)
    generator = torch.Generator().manual_seed(seed)
    totals = {"target": 0.0, "d3d": 0.0}
    identical, new_tokens, rounds = True, 0, 0
    for _ in tqdm(range(prompts), desc="demo prompts"):
        prompt = torch.randint(0, vocab_size, (1, int(torch.randint(4, 40, (1,), generator=generator))), generator=generator)
        start = time.perf_counter()
        reference = target.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False)
        totals["target"] += time.perf_counter() - start
        start = time.perf_counter()
        speculative = drafter.generate_batch(target, prompt, max_new_tokens=max_new_tokens, do_sample=False)
        totals["d3d"] += time.perf_counter() - start
        stats = drafter.generation_stats  # the engine's RoundRecord of this call
        identical &= torch.equal(reference, speculative)
        new_tokens += stats.new_tokens
        rounds += stats.rounds
    print(f"| method | tok/s | tau | identical to target |\n|---|---|---|---|")
    print(f"| target alone (greedy) | {new_tokens / totals['target']:.1f} | 1.00 | - |")
    print(f"| D3D drafter, B={block_size} | {new_tokens / totals['d3d']:.1f} | {new_tokens / rounds:.2f} | {identical} |")
    return identical


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--vocab-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    identical = run_demo(args.prompts, args.max_new_tokens, args.block_size, args.vocab_size, args.seed)
    return 0 if identical else 1
