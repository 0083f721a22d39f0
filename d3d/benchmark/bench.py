"""`d3d bench`: every decoding method in one process, on the same prompts, interleaved prompt by prompt.

Methods: the target's own `generate` (the 1.0x reference); the target alone through the engine, eager and compiled
(its loop overhead, and the compiled baseline); Hugging Face assisted generation with an AR assistant; prompt
lookup (transformers' loop, the ecosystem's reference, and the engine's own `lookup=True`, no drafter); D3D
synchronous through the engine, eager and compiled (the drafter alone, `lookup=False`, the verify policy on:
`policy_d3d`), and with the policy off (the drafter's whole block every round, the paper's rule); the hybrid (D3D +
the engine's lookup, one chooser per row: what every front door runs by default); for sampled runs D3D sync with
token-wise verification too (the engine's default is block verification); D3D asynchronous (the drafter alone)
through the engine at the default (C, F) and at the best (C, F) of a sweep measured first on a few prompts (the
best also compiled); D3D through `assistant_model=drafter` (transformers' assisted loop driving the engine's source:
what that path costs). Every method is warmed up first (for compiled methods this first call is the compile time,
reported) and every output is checked against the target's own: token for token when greedy; sampled
(`sampling`), by a distribution check (`identity.sampled_consistency`), with the ceiling τ of a perfect argmax
drafter on the target's own outputs beside it (`identity.ceiling_tau`: what the target's entropy allows).

Speedups are over the fastest target-alone baseline and over plain `generate`. The ideal bounds use the engine's own
passes on a 256-token prefix: the run's tokens times t_T(1) over the passes its rounds ran, at those costs: sync,
a round that verified the drafter's block t_T(B) + t_D(B) (it waits for its draft), a lookup t_T(B) (one verified
whole past a block's drafts, t_T(2B-1)), both (a tree) t_T(2B-1) + t_D(B), nothing t_T(1); async, drafting fully hidden (t_T(B) for one proposal, t_T(2B-1) for both).
With the drafter's block every round these are the paper's τ·t_T(1)/(t_T(B) + t_D(B)) and τ·t_T(1)/t_T(B). The
fraction reached is the speedup over the target alone through the engine in the same mode (eager or compiled: the
t_T(1) the bound assumes) divided by the bound.
"""

import platform
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from d3d.common.measure import MethodRun, decode_one, timed
from modeling_d3d.generation_d3d import speculative_generate
from modeling_d3d.policy_d3d import BLOCK, BOTH, LOOKUP, NOTHING
from modeling_d3d.successor_d3d import DEFAULT_COVERAGE, DEFAULT_FANOUT

from .forward_cost import engine_pass_seconds
from .identity import ceiling_tau, checks_exactly, classify, effective_sampling, sampled_consistency

PROMPT_LOOKUP_TOKENS = 10
PASS_PREFIX_LENGTH = 256
COMPILE_CHOICES = ("auto", "none", "both")


@dataclass
class Method:
    """A decoding method: `target.generate(**generate_kwargs)`. baseline: the target alone (a speedup reference);
    drafting: "sync" or "async" for D3D methods (which ideal bounds apply), None otherwise; compiled: the engine's
    compiled verify pass."""

    name: str
    generate_kwargs: dict = field(default_factory=dict)
    baseline: bool = False
    drafting: str | None = None
    compiled: bool = False


def compile_modes(choice: str, device: torch.device) -> list[bool]:
    """Which modes to measure: `none` eager only, `both` eager and compiled, `auto` both on CUDA (CUDA graphs compile
    in seconds) and eager only on CPUs (inductor compiles take minutes)."""
    if choice not in COMPILE_CHOICES:
        raise ValueError(f"compile must be one of {', '.join(COMPILE_CHOICES)}, got {choice!r}")
    both = choice == "both" or (choice == "auto" and device.type == "cuda")
    return [False, True] if both else [False]


def engine_kwargs(drafter=None, compiled: bool = False, coverage: int | None = None, fanout: int | None = None,
                  **chooser) -> dict:
    """`generate` arguments of the engine: the target alone (`drafter=None`), D3D sync, or async at (C, F);
    `chooser`: `lookup=` (default False: the drafter alone, not the front doors' hybrid), `policy=`
    (`policy_d3d.make_chooser`), `verification=`."""
    kwargs = {"custom_generate": speculative_generate, "drafter": drafter, "compile": compiled, "lookup": False,
              **chooser}
    if coverage is not None:
        kwargs.update(asynchronous=True, coverage=coverage, fanout=fanout)
    return kwargs


def suffix(compiled: bool) -> str:
    return ", compiled" if compiled else ""


def build_methods(drafter, assistant, default: tuple[int, int], best: tuple[int, int], modes: list[bool],
                  sampled: bool = False) -> list[Method]:
    """The comparison's methods, plain `generate` first; sampled: D3D sync with token-wise verification too (the
    engine's default for sampled rows is block verification)."""
    methods = [Method("target generate", baseline=True)]
    methods += [Method(f"target alone, engine{suffix(c)}", engine_kwargs(compiled=c), baseline=True, compiled=c)
                for c in modes]
    if assistant is not None:
        methods.append(Method("HF assisted, AR assistant", {"assistant_model": assistant}))
    methods.append(Method(f"prompt lookup ({PROMPT_LOOKUP_TOKENS})", {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS}))
    methods += [Method(f"lookup, engine{suffix(c)}", engine_kwargs(None, c, lookup=True), compiled=c) for c in modes]
    methods += [Method(f"D3D sync{suffix(c)}", engine_kwargs(drafter, c), drafting="sync", compiled=c) for c in modes]
    if sampled:
        methods.append(Method("D3D sync, token-wise verification", engine_kwargs(drafter, False, verification="token"),
                              drafting="sync"))
    methods.append(Method("D3D sync, fixed block", engine_kwargs(drafter, False, policy=False), drafting="sync"))
    methods += [Method(f"D3D + lookup (hybrid){suffix(c)}", engine_kwargs(drafter, c, lookup=True), drafting="sync",
                       compiled=c) for c in modes]
    # the default (C, F) eager, and the sweep's best in every mode (eager once only: when the best is the default,
    # the default's row is the best's)
    same = best == default
    methods.append(Method(f"D3D async C={default[0]} F={default[1]}{' (default, best)' if same else ''}",
                          engine_kwargs(drafter, False, *default), drafting="async"))
    methods += [Method(f"D3D async C={best[0]} F={best[1]} (best){suffix(c)}", engine_kwargs(drafter, c, *best),
                       drafting="async", compiled=c) for c in modes if c or not same]
    methods.append(Method("D3D sync, assistant_model=drafter", {"assistant_model": drafter}, drafting="sync"))
    return methods


def select(methods: list[Method], names: list[str] | None) -> list[Method]:
    """The baselines and the methods whose names contain one of `names` (None: every method)."""
    return [m for m in methods if names is None or m.baseline or any(name in m.name for name in names)]


def sweep_budgets(target, drafter, prompts, max_new_tokens: int, grid: list[tuple[int, int]],
                  sampling: dict | None = None) -> list[dict]:
    """tokens/s, τ and hit rate of D3D async through the engine (eager) for each (C, F) on `prompts`."""
    rows = []
    for coverage, fanout in tqdm(grid, desc="(C, F) sweep"):
        kwargs = engine_kwargs(drafter, False, coverage, fanout)
        decode_one(target, prompts[0], max_new_tokens, MethodRun("warmup"), sampling, **kwargs)
        run = MethodRun(f"async C={coverage} F={fanout}")
        for prompt in prompts:
            decode_one(target, prompt, max_new_tokens, run, sampling, **kwargs)
        budget = drafter.config.block_size * ((coverage - 1) * fanout + 2)
        rows.append({"coverage": coverage, "fanout": fanout, "budget": budget,
                     "tokens_per_second": run.tokens_per_second, "tau": run.tau, "hit_rate": run.hit_rate})
    return rows


def run_methods(target, methods: list[Method], prompts: list[torch.Tensor], max_new_tokens: int,
                sampling: dict | None = None) -> tuple[list[MethodRun], list[float]]:
    """Decode every prompt with every method, interleaved so machine drift hits all alike, after one warm-up call
    each. Returns the runs and each method's warm-up seconds (for compiled methods: the compile time)."""
    runs = [MethodRun(method.name) for method in methods]
    warmups = [timed(lambda m=method: decode_one(target, prompts[0], max_new_tokens, MethodRun("warmup"), sampling,
                                                 **m.generate_kwargs))[1] for method in methods]
    for prompt in tqdm(prompts, desc="benchmark prompts"):
        for method, run in zip(methods, runs):
            decode_one(target, prompt, max_new_tokens, run, sampling, **method.generate_kwargs)
    return runs, warmups


def ideal_bounds(run: MethodRun, passes: dict) -> tuple[float, float]:
    """(sync, async) ideal speedups of `run`: its tokens at t_T(1) each over its rounds' passes (module docstring);
    rounds the engine did not record (transformers' loop) verified the drafter's block; a long lookup (past a block's
    drafts) costs a pass of the tree's width, a short one (its first drafts) a short round's pass."""
    t1, tb, tt, ts, td = (passes[name] for name in ("t_target_1", "t_target_b", "t_target_tree", "t_target_short",
                                                    "t_drafter_b"))
    verified = run.verified if run.verified else Counter({BLOCK: run.rounds})
    narrow, block, both, long, short = (verified[NOTHING], verified[BLOCK], verified[BOTH], run.long_lookups,
                                        run.short_lookups)
    lookup = verified[LOOKUP] - long - short
    alone, looked_up = run.new_tokens * t1, long * tt + short * ts
    return (alone / (narrow * t1 + lookup * tb + looked_up + block * (tb + td) + both * (tt + td)),
            alone / (narrow * t1 + (lookup + block) * tb + looked_up + both * tt))


def round_split(run: MethodRun) -> dict:
    """ms per round: the whole (wall clock / rounds), and for engine methods verify, exposed drafting (with the
    drafter's prefill of a row, on its first block round) and the rest (host work, the target's prefill,
    `generate`'s setup), which add up to the whole."""
    total = run.ms_per_round()
    if run.verify_seconds is None or total is None:
        return {"ms_per_round": total, "verify_ms_per_round": None, "exposed_draft_ms_per_round": None,
                "overhead_ms_per_round": None}
    verify, exposed = run.ms_per_round(run.verify_seconds), run.ms_per_round(run.exposed_draft_seconds)
    return {"ms_per_round": total, "verify_ms_per_round": verify, "exposed_draft_ms_per_round": exposed,
            "overhead_ms_per_round": total - verify - exposed}


def summarize(methods: list[Method], runs: list[MethodRun], warmups: list[float], passes: dict[str, dict]) -> list[dict]:
    """One row per method: tokens/s, speedups, τ, hit rate, lossless, the round split, the ideal bounds (D3D) and
    the fraction of each reached. `passes`: the engine pass times by mode (`eager`, `compiled`)."""
    reference = runs[0]
    fastest = max(run.tokens_per_second for method, run in zip(methods, runs) if method.baseline)
    engine_alone = {method.compiled: run.tokens_per_second for method, run in zip(methods, runs)
                    if method.baseline and run.verify_seconds is not None}
    rows = []
    for method, run, warmup in zip(methods, runs, warmups):
        speedup = run.tokens_per_second / fastest
        same_mode = run.tokens_per_second / engine_alone.get(method.compiled, fastest)
        ideal_sync = ideal_async = None
        if method.drafting is not None:
            ideal_sync, ideal_async = ideal_bounds(run, passes["compiled" if method.compiled else "eager"])
        rows.append({
            "method": method.name,
            "engine": run.verify_seconds is not None,
            "compiled": method.compiled,
            "tokens_per_second": run.tokens_per_second,
            "speedup": speedup,
            "speedup_vs_generate": run.tokens_per_second / reference.tokens_per_second,
            "tau": run.tau,
            "hit_rate": run.hit_rate,
            "lossless": run.outputs == reference.outputs,
            "identical_outputs": sum(a == b for a, b in zip(run.outputs, reference.outputs)),
            **round_split(run),
            "ideal_sync_speedup": ideal_sync,
            "ideal_async_speedup": ideal_async,
            "ideal_sync_fraction": same_mode / ideal_sync if ideal_sync else None,
            "ideal_async_fraction": same_mode / ideal_async if ideal_async else None,
            "warmup_seconds": warmup,
            "compilations": run.compilations,
            "new_tokens": run.new_tokens,
            "rounds": run.rounds,
            "verified": dict(run.verified),  # row rounds by what they verified (nothing, block, lookup, both)
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


def measure_passes(target, drafter, modes: list[bool]) -> dict[str, dict]:
    """The engine's pass times by mode, each with the seconds its measurement took (compiling included)."""
    passes = {}
    for compiled in modes:
        start = time.perf_counter()
        entry = engine_pass_seconds(target, drafter, PASS_PREFIX_LENGTH, compile=compiled)
        passes["compiled" if compiled else "eager"] = {**entry, "measure_seconds": time.perf_counter() - start}
    return passes


def benchmark(
    target,
    drafter,
    prompt_sets: dict[str, list[torch.Tensor]],
    max_new_tokens: int = 128,
    assistant=None,
    sweep_grid: list[tuple[int, int]] | None = None,
    sweep_prompts: int = 4,
    compile: str = "auto",
    sampling: dict | None = None,
    methods_named: list[str] | None = None,
) -> dict:
    """Run the whole comparison, greedy or with `sampling` (`generate`'s `do_sample`, `temperature`, `top_p`,
    `top_k`; those left out made explicit as `generate` would set them, `identity.effective_sampling`);
    methods_named: only the methods whose names contain one of these (the target-alone baselines always run; the
    async sweep only when an async method is kept). Returns everything `bench.json` holds."""
    modes = compile_modes(compile, target.device)
    sampling = effective_sampling(target, sampling) if sampling else None  # what generate samples with, explicit
    block_size = drafter.config.block_size
    default = (min(DEFAULT_COVERAGE, block_size), DEFAULT_FANOUT)
    grid = sweep_grid or sorted({default, (1, 0), (2, 1), (4, 1), (max(block_size // 2, 1), 1)})
    sweeping = any("async" in m.name for m in select(build_methods(drafter, assistant, default, default, modes,
                                                                   bool(sampling)), methods_named))
    first_set = next(iter(prompt_sets.values()))
    sweep = sweep_budgets(target, drafter, first_set[:sweep_prompts], max_new_tokens, grid, sampling) if sweeping else []
    best_row = max(sweep, key=lambda row: row["tokens_per_second"], default={"coverage": default[0],
                                                                              "fanout": default[1]})
    best = (best_row["coverage"], best_row["fanout"])
    passes = measure_passes(target, drafter, modes)
    results = {"hardware": hardware(target.device, drafter.device), "max_new_tokens": max_new_tokens,
               "identity": "exact" if checks_exactly(target) else "up to near-ties",
               "block_size": block_size, "compile": compile, "modes": ["compiled" if c else "eager" for c in modes],
               "pass_prefix_length": PASS_PREFIX_LENGTH, "passes": passes, "sweep": sweep,
               "best_budget": {"coverage": best[0], "fanout": best[1]}, "sampling": sampling, "prompt_sets": {}}
    methods = select(build_methods(drafter, assistant, default, best, modes, sampled=bool(sampling)), methods_named)
    for name, prompts in prompt_sets.items():
        runs, warmups = run_methods(target, methods, prompts, max_new_tokens, sampling)
        rows = summarize(methods, runs, warmups, passes)
        for row, run in zip(rows, runs):
            if sampling:  # sampled outputs differ from the reference's draws: a distribution check instead
                check = sampled_consistency(target, prompts, runs[0].outputs, run.outputs, sampling)
                row.update(check, lossless=check["consistent"], divergences=int(not check["consistent"]))
            else:
                row.update(classify(target, prompts, runs[0].outputs, run.outputs))
        results["prompt_sets"][name] = {"prompts": len(prompts), "methods": rows, "ceiling_tau": ceiling_tau(
            target, prompts, runs[0].outputs, block_size, sampling or {})}
    return results


__all__ = ["COMPILE_CHOICES", "Method", "benchmark", "build_methods", "compile_modes", "ideal_bounds", "select",
           "round_split", "run_methods", "summarize", "sweep_budgets"]
