"""`d3d bench`: D3D beside its peers in one process, on the same prompts, methods interleaved prompt by prompt.

Methods: the target alone (greedy, the 1.0x reference); Hugging Face assisted generation with an AR assistant;
prompt-lookup decoding; D3D synchronous; D3D asynchronous at the default (C, F) and at the best (C, F) of a sweep
measured first on a few prompts. Every method is warmed up first and every output is checked against the target's.
"""

import platform
import statistics
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers.cache_utils import DynamicCache

from modeling_d3d.async_d3d import DEFAULT_FANOUT, D3DAssistedGenerator
from modeling_d3d.speculative_d3d import synchronize

from .measure import MethodRun, decode_one

PROMPT_LOOKUP_TOKENS = 10


@dataclass
class Method:
    name: str
    generate_kwargs: dict


@torch.no_grad()
def target_forward_seconds(target, tokens: int, prefix_length: int = 256, repeats: int = 20) -> float:
    """Median time for the target to process `tokens` new tokens over a cached `prefix_length`-token prefix."""
    prefix = torch.randint(0, target.config.vocab_size, (1, prefix_length), device=target.device)
    new = torch.randint(0, target.config.vocab_size, (1, tokens), device=target.device)
    cache = DynamicCache(config=target.config)
    target(prefix, past_key_values=cache, use_cache=True)
    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        target(new, past_key_values=cache, use_cache=True)
        synchronize(target.device)
        times.append(time.perf_counter() - start)
        cache.crop(-tokens)
    return statistics.median(times[2:])


def sweep_budgets(target, drafter, prompts, max_new_tokens: int, grid: list[tuple[int, int]]) -> list[dict]:
    """tokens/s and hit rate of D3D async for each (C, F) on `prompts` (the paper picks the budget by speed)."""
    rows = []
    for coverage, fanout in tqdm(grid, desc="(C, F) sweep"):
        with D3DAssistedGenerator(drafter, coverage=coverage, fanout=fanout) as generator:
            decode_one(target, prompts[0], max_new_tokens, MethodRun("warmup"), assistant_model=generator)
            run = MethodRun(f"async C={coverage} F={fanout}")
            for prompt in prompts:
                decode_one(target, prompt, max_new_tokens, run, assistant_model=generator)
        rows.append({"coverage": coverage, "fanout": fanout, "budget": generator.budget_tokens,
                     "tokens_per_second": run.tokens_per_second, "tau": run.tau, "hit_rate": run.hit_rate})
    return rows


def run_methods(target, methods: list[Method], prompts: list[torch.Tensor], max_new_tokens: int) -> list[MethodRun]:
    """Decode every prompt with every method, interleaved so machine drift hits all alike; warm each up first."""
    runs = [MethodRun(method.name) for method in methods]
    for method in methods:
        decode_one(target, prompts[0], max_new_tokens, MethodRun("warmup"), **method.generate_kwargs)
    for prompt in tqdm(prompts, desc="benchmark prompts"):
        for method, run in zip(methods, runs):
            decode_one(target, prompt, max_new_tokens, run, **method.generate_kwargs)
    return runs


def summarize(runs: list[MethodRun], t1: float, tb: float) -> list[dict]:
    """One row per method: tokens/s, speedup over the first (the target alone), τ, hit rate, lossless, and for D3D
    the ideal bound τ·t(1)/t(B) (every round verifies a B-token block at the cost t(B))."""
    reference = runs[0]
    rows = []
    for run in runs:
        rows.append({
            "method": run.name,
            "tokens_per_second": run.tokens_per_second,
            "speedup": run.tokens_per_second / reference.tokens_per_second,
            "tau": run.tau,
            "hit_rate": run.hit_rate,
            "lossless": run.outputs == reference.outputs,
            "identical_outputs": sum(a == b for a, b in zip(run.outputs, reference.outputs)),
            "ideal_speedup": run.tau * t1 / tb if run.name.startswith("D3D") else None,
            "new_tokens": run.new_tokens,
            "seconds": run.seconds,
        })
    return rows


def hardware(target_device: torch.device, drafter_device: torch.device) -> str:
    """Where the numbers were measured, e.g. `"NVIDIA H200 (target), NVIDIA H200 (drafter)"` or `"CPU, 2 cores"`."""

    def name(device: torch.device) -> str:
        if device.type == "cuda":
            return torch.cuda.get_device_name(device)
        return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"

    target, drafter = name(target_device), name(drafter_device)
    return target if target == drafter else f"{target} (target), {drafter} (drafter)"


def benchmark(
    target,
    drafter,
    prompt_sets: dict[str, list[torch.Tensor]],
    max_new_tokens: int = 128,
    assistant=None,
    sweep_grid: list[tuple[int, int]] | None = None,
    sweep_prompts: int = 4,
) -> dict:
    """Run the whole comparison; returns everything `bench.json` holds."""
    block_size = drafter.config.block_size
    default_coverage = min(12, block_size)
    grid = sweep_grid or sorted({(default_coverage, DEFAULT_FANOUT), (1, 0), (2, 1), (4, 1), (max(block_size // 2, 1), 1)})
    first_set = next(iter(prompt_sets.values()))
    sweep = sweep_budgets(target, drafter, first_set[:sweep_prompts], max_new_tokens, grid)
    best = max(sweep, key=lambda row: row["tokens_per_second"])
    t1, tb = target_forward_seconds(target, 1), target_forward_seconds(target, block_size)
    results = {"hardware": hardware(target.device, drafter.device), "max_new_tokens": max_new_tokens,
               "block_size": block_size, "t1_seconds": t1, "tb_seconds": tb,
               "sweep": sweep, "best_budget": {"coverage": best["coverage"], "fanout": best["fanout"]}, "prompt_sets": {}}
    with D3DAssistedGenerator(drafter, coverage=default_coverage, fanout=DEFAULT_FANOUT) as default_async, \
            D3DAssistedGenerator(drafter, coverage=best["coverage"], fanout=best["fanout"]) as best_async:
        methods = [Method("target alone", {})]
        if assistant is not None:
            methods.append(Method("HF assisted, AR assistant", {"assistant_model": assistant}))
        methods += [
            Method(f"prompt lookup ({PROMPT_LOOKUP_TOKENS})", {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS}),
            Method("D3D sync", {"assistant_model": drafter}),
            Method(f"D3D async C={default_coverage} F={DEFAULT_FANOUT}", {"assistant_model": default_async}),
            Method(f"D3D async C={best['coverage']} F={best['fanout']} (best)", {"assistant_model": best_async}),
        ]
        for name, prompts in prompt_sets.items():
            runs = run_methods(target, methods, prompts, max_new_tokens)
            results["prompt_sets"][name] = {"prompts": len(prompts), "methods": summarize(runs, t1, tb)}
    return results


__all__ = ["benchmark", "run_methods", "summarize", "sweep_budgets", "target_forward_seconds"]
