"""`d3d gpu-check`: the first thing to run on a GPU machine. Random weights only (nothing is downloaded); at most
about 8 minutes on one H200; every check runs in its own try/except, so a failing check is recorded with its
traceback summary and the others go on. Results go to `OUTPUT/gpu_check.json` and `OUTPUT/gpu_check.md`, rewritten
after every check (a crash or the time-budget watchdog leaves what was done).

Checks, in the order they run (see docs/gpu-check.md for what each one means):
- environment: versions, devices, the inductor CUDA-graph and TF32 settings;
- identity-float32-{sync,async,cross-device}: tokens against `target.generate` at Qwen3-8B width (2 target layers,
  1 drafter layer), batches of 1 and 3 ragged rows, with and without min_new_tokens / suppress_tokens /
  repetition_penalty; at a mismatch the reference's top-2 margin;
- identity-bfloat16-{sync,async}: the same in bfloat16, each divergence with its margin (near-ties are expected);
- timing-8b, overlap-8b: Qwen3-8B shape (36 layers, bf16) with a 31-layer drafter: measured engine rounds,
  passes timed with CUDA events, and the round projected at the paper's tau 7.88 (labelled a projection);
- memory-server-8b: a server-sized engine (8 rows x 4096) with both models, allocation against an estimate;
- compile-{sync,async,back-to-back,new-prompts}: compile=True against eager, CUDA-graph skips and recompiles
  counted from PyTorch's own counters and logs.

`--smoke` runs the environment and float32 identity checks with tiny shapes (a CPU is enough; a test runs it).
"""

import argparse
import contextlib
import gc
import json
import logging
import os
import platform
import statistics
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

from modeling_d3d import D3DConfig, D3DForBlockDiffusion, speculative_generate

PAPER_TAU = 7.88  # the paper's accepted length per round for the pruned D3D-8B (the timing projection's input)
STATUSES = ("pass", "fail", "error", "skipped", "measured")


@dataclass(frozen=True)
class Shapes:
    """Every size the checks use. Identity checks: `hidden`..`vocab` with `target_layers` / `drafter_layers`; the
    8B checks: `full_target_layers` / `full_drafter_layers` at the same width; `prompt_lengths`: the ragged batch
    (batch 1 uses the first)."""

    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 12288
    vocab: int = 151_936
    target_layers: int = 2
    drafter_layers: int = 1
    block_size: int = 16
    prompt_lengths: tuple[int, ...] = (21, 9, 14)
    max_new_tokens: int = 32
    logit_scale: float = 4.0
    full_target_layers: int = 36
    full_drafter_layers: int = 31
    prefix: int = 512
    timing_rows: tuple[int, ...] = (1, 4)
    timing_new_tokens: int = 48
    server_rows: int = 8
    server_length: int = 4096
    coverage: int = 12
    fanout: int = 2


SMOKE_SHAPES = Shapes(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=512,
                      prompt_lengths=(11, 5, 8), max_new_tokens=20)


# ----------------------------------------------------------------------------------------------------------- models

def model_config(shapes: Shapes, layers: int, config_class=Qwen3Config, **extra):
    """A Qwen3-shaped config (sdpa attention, untied head as in Qwen3-8B, no EOS: checks set their own)."""
    config = config_class(
        vocab_size=shapes.vocab, hidden_size=shapes.hidden, intermediate_size=shapes.intermediate,
        num_hidden_layers=layers, num_attention_heads=shapes.heads, num_key_value_heads=shapes.kv_heads,
        head_dim=shapes.head_dim, max_position_embeddings=40_960, tie_word_embeddings=False, eos_token_id=None,
        **extra,
    )
    config._attn_implementation = "sdpa"
    return config


def build_models(shapes: Shapes, target_layers: int, drafter_layers: int, dtype: torch.dtype,
                 device: torch.device, seed: int = 0) -> tuple[Qwen3ForCausalLM, D3DForBlockDiffusion]:
    """A random target and a random drafter (mask token: the last id), built on `device` in `dtype`."""
    torch.manual_seed(seed)
    with torch.device(device):
        target = Qwen3ForCausalLM._from_config(model_config(shapes, target_layers), dtype=dtype).eval()
        drafter_config = model_config(shapes, drafter_layers, D3DConfig, block_size=shapes.block_size,
                                      mask_token_id=shapes.vocab - 1)
        drafter = D3DForBlockDiffusion._from_config(drafter_config, dtype=dtype).eval()
    return target, drafter


@torch.no_grad()
def scale_head(model, scale: float) -> None:
    """Multiply `model`'s output head by `scale` (logits and their margins grow by `scale`)."""
    model.lm_head.weight.mul_(scale)


@contextlib.contextmanager
def forced_head(model, token: int, bias: float = 1e4) -> Iterator[None]:
    """While inside: `model`'s head has a bias making `token` its argmax whatever the input (same weight, same cost).
    A drafter and a target both forced to one token accept every draft: what an all-hits round costs."""
    original = model.lm_head
    head = torch.nn.Linear(original.in_features, original.out_features, bias=True,
                           device=original.weight.device, dtype=original.weight.dtype)
    with torch.no_grad():
        head.weight = original.weight
        head.bias.zero_()
        head.bias[token] = bias
    model.lm_head = head
    try:
        yield
    finally:
        model.lm_head = original


def random_prompts(lengths: list[int], vocab: int, device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded random prompts `(rows, max length)` and their attention mask; ids avoid the mask token (last)."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, width - length:] = torch.randint(0, vocab - 1, (length,), generator=generator)
        mask[row, width - length:] = 1
    return ids.to(device), mask.to(device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------- check framework

@dataclass
class CheckResult:
    """One check: status (`STATUSES`), a one-line summary, its details, the traceback summary of an error."""

    name: str
    status: str
    seconds: float = 0.0
    summary: str = ""
    details: dict = field(default_factory=dict)
    error: str | None = None


class ModelCache:
    """The models the checks share, built on first use and dropped when the next check does not need them."""

    def __init__(self, shapes: Shapes, device: torch.device):
        self.shapes, self.device = shapes, device
        self.models: dict[str, tuple] = {}

    def get(self, kind: str) -> tuple:
        if kind not in self.models:
            self.models[kind] = self._build(kind)
        return self.models[kind]

    def keep_only(self, kinds: tuple[str, ...]) -> None:
        for kind in [k for k in self.models if k not in kinds]:
            del self.models[kind]
        release_memory()

    def _build(self, kind: str) -> tuple:
        s = self.shapes
        if kind in ("float32", "bfloat16"):
            dtype = torch.float32 if kind == "float32" else torch.bfloat16
            target, drafter = build_models(s, s.target_layers, s.drafter_layers, dtype, self.device)
            scale_head(target, s.logit_scale)
            return target, drafter
        if kind == "8b":
            return build_models(s, s.full_target_layers, s.full_drafter_layers, torch.bfloat16, self.device)
        raise RuntimeError(f"unknown model kind {kind!r}")


@dataclass
class Context:
    """What every check reads: sizes, device, the shared models, the time budget."""

    shapes: Shapes
    device: torch.device
    models: ModelCache
    deadline: float
    setups: dict = field(default_factory=dict)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()


@dataclass(frozen=True)
class Check:
    """A check: its function `(context) -> (status, summary, details)`, the models it uses, the seconds it needs at
    least (skipped when less is left), and whether it needs CUDA."""

    name: str
    function: Callable
    models: tuple[str, ...] = ()
    min_seconds: float = 5.0
    needs_cuda: bool = False


def error_summary(error: BaseException, lines: int = 6) -> str:
    """The exception and the last frames of its traceback, short enough for a table cell and the JSON."""
    frames = traceback.extract_tb(error.__traceback__)[-lines:]
    where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames))
    return f"{type(error).__name__}: {' '.join(str(error).split())[:600]} (at {where})"


def run_check(check: Check, context: Context) -> CheckResult:
    start = time.monotonic()
    if check.needs_cuda and context.device.type != "cuda":
        return CheckResult(check.name, "skipped", summary="needs CUDA")
    if context.remaining() < check.min_seconds:
        return CheckResult(check.name, "skipped", summary=f"time budget: {context.remaining():.0f} s left, "
                                                           f"needs about {check.min_seconds:.0f} s")
    try:
        context.models.keep_only(check.models)
        status, summary, details = check.function(context)
        result = CheckResult(check.name, status, summary=summary, details=details)
    except Exception as error:  # a failing check is recorded and the others go on (the point of this command)
        result = CheckResult(check.name, "error", summary=type(error).__name__, error=error_summary(error))
    result.seconds = round(time.monotonic() - start, 2)
    return result


def worst(statuses: list[str]) -> str:
    """The status of a check made of cases: error > fail > pass."""
    for status in ("error", "fail", "measured", "pass"):
        if status in statuses:
            return status
    return "skipped"


# ----------------------------------------------------------------------------------------------- identity checks

MODES = {
    "sync": {},
    "async": {"asynchronous": True},
    "cross-device": {"asynchronous": True, "drafter_device": "cpu", "coverage": 2, "fanout": 1},
}


def processor_settings(eos: int, suppress: list[int]) -> dict:
    """generate settings whose logits processors the engine must apply as generate does."""
    return {"eos_token_id": eos, "min_new_tokens": 6, "suppress_tokens": suppress, "repetition_penalty": 1.3}


def reference(target, ids, mask, settings: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's own greedy `generate`: sequences `(rows, P + n)` and processed scores `(rows, n, vocab)` (CPU)."""
    output = target.generate(ids, attention_mask=mask, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, **settings)
    return output.sequences.cpu(), torch.stack(output.scores, dim=1).float().cpu()


def decode(target, drafter, ids, mask, settings: dict, mode: str, compile: bool = False) -> torch.Tensor:
    """The engine through its front door; a drafter sent to the CPU comes back to the target's device."""
    device = drafter.device
    try:
        return drafter.generate_batch(target, ids, attention_mask=mask, do_sample=False, compile=compile,
                                      **MODES[mode], **settings).cpu()
    finally:
        if drafter.device != device:
            drafter.to(device)


def compare(reference_ids: torch.Tensor, scores: torch.Tensor, output: torch.Tensor, prompt_width: int,
            tie_tolerance: float | None = None) -> list[dict]:
    """Per row: the first generated position where `output` leaves the reference (None: identical), the reference's
    top-2 margin there and the score gap between the reference's token and the engine's (both in the reference's
    processed scores). With `tie_tolerance` (relative to the top score) each divergence is called a near-tie or not."""
    rows = []
    for r in range(reference_ids.shape[0]):
        expected, got = reference_ids[r, prompt_width:].tolist(), output[r, prompt_width:].tolist()
        index = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), None)
        if index is None and len(expected) != len(got):
            index = min(len(expected), len(got))
        row = {"row": r, "identical": index is None, "first_divergence": index}
        if index is not None and index < scores.shape[1]:
            step = scores[r, index]
            top = step.topk(2).values
            row["reference_top2_margin"] = float(top[0] - top[1])
            row["reference_token"] = expected[index] if index < len(expected) else None
            row["engine_token"] = got[index] if index < len(got) else None
            if row["engine_token"] is not None:
                row["score_gap"] = float(step.max() - step[row["engine_token"]])
            if tie_tolerance is not None:
                row["near_tie"] = row.get("score_gap", float("inf")) <= tie_tolerance * max(1.0, float(top[0].abs()))
        rows.append(row)
    return rows


def stats_summary(drafter) -> dict:
    record = drafter.generation_stats
    if record is None:
        return {}
    return {"rounds": record.rounds, "tau": round(record.tau, 3), "accepted": dict(sorted(record.accepted.items()))}


@dataclass
class AcceptanceSetup:
    """How a random pair is made to accept some drafts and not others: the drafter always proposes `token`; the
    target's head gets `bias` on it, tuned so that the target produces it at about `fraction` of its greedy
    positions (runs of it end at unpredictable places: rounds accept 0..B-1 drafts)."""

    token: int
    bias: float
    fraction: float

    @contextlib.contextmanager
    def applied(self, target, drafter) -> Iterator[None]:
        with forced_head(target, self.token, self.bias), forced_head(drafter, self.token):
            yield


def token_fraction(target, ids, mask, settings: dict, token: int, bias: float) -> float:
    with forced_head(target, token, bias):
        sequences, _ = reference(target, ids, mask, settings)
    return float((sequences[:, ids.shape[1]:] == token).float().mean())


def calibrate(target, ids, mask, settings: dict, goal: float = 0.75, steps: int = 8) -> AcceptanceSetup:
    """Bisect the bias on the target's most frequent greedy token until it makes about `goal` of the tokens."""
    sequences, scores = reference(target, ids, mask, settings)
    token = int(sequences[:, ids.shape[1]:].reshape(-1).mode().values)
    low, high = 0.0, float(scores.max() - scores.min()) + 1.0
    bias, fraction = high, 1.0
    for _ in range(steps):
        middle = (low + high) / 2
        found = token_fraction(target, ids, mask, settings, token, middle)
        if abs(found - goal) < abs(fraction - goal):
            bias, fraction = middle, found
        if abs(found - goal) <= 0.1:
            break
        low, high = (middle, high) if found < goal else (low, middle)
    return AcceptanceSetup(token, bias, fraction)


@dataclass
class IdentitySetup:
    """What every mode of one dtype shares: the acceptance setup, the EOS of the processor cases, the references."""

    acceptance: AcceptanceSetup
    eos: int
    suppress: list[int]
    references: dict = field(default_factory=dict)


def identity_setup(context: Context, kind: str) -> IdentitySetup:
    """Built once per model kind (the modes reuse it): calibrate, pick an EOS that row 0 produces early (so rows end
    at different rounds), then the reference of every case."""
    if kind in context.setups:
        return context.setups[kind]
    s = context.shapes
    target, drafter = context.models.get(kind)
    ids, mask = random_prompts(list(s.prompt_lengths), s.vocab, context.device, seed=1)
    plain = {"max_new_tokens": s.max_new_tokens, "pad_token_id": 0}
    acceptance = calibrate(target, ids, mask, plain)
    with forced_head(target, acceptance.token, acceptance.bias):
        sequences, _ = reference(target, ids, mask, plain)
    generated = sequences[:, ids.shape[1]:]
    others = [t for t in generated[0].tolist() if t != acceptance.token] or [acceptance.token + 1]
    counts = Counter(generated.reshape(-1).tolist()).most_common()
    frequent = [t for t, _ in counts if t not in (acceptance.token, others[0])]
    setup = IdentitySetup(acceptance, others[0], frequent[:2] or [others[0] + 1])
    with acceptance.applied(target, drafter):
        for batch, with_processors in identity_cases(s):
            ids, mask = random_prompts(list(s.prompt_lengths[:batch]), s.vocab, context.device, seed=1)
            settings = {**plain, **(processor_settings(setup.eos, setup.suppress) if with_processors else {})}
            setup.references[(batch, with_processors)] = (ids, mask, settings, *reference(target, ids, mask, settings))
    context.setups[kind] = setup
    return setup


def identity_cases(shapes: Shapes) -> list[tuple[int, bool]]:
    """(rows, with processors): batch 1 and the ragged batch, plain and with processors."""
    return [(batch, processors) for batch in (1, len(shapes.prompt_lengths)) for processors in (False, True)]


def identity_mode(context: Context, kind: str, mode: str,
                  tie_tolerance: float | None = None) -> tuple[list[dict], dict]:
    """Every case of one mode against its reference (see `identity_setup`)."""
    target, drafter = context.models.get(kind)
    setup = identity_setup(context, kind)
    cases = []
    with setup.acceptance.applied(target, drafter):
        for batch, with_processors in identity_cases(context.shapes):
            case = {"case": f"rows={batch}{' +processors' if with_processors else ''}"}
            try:
                ids, mask, settings, expected, scores = setup.references[(batch, with_processors)]
                output = decode(target, drafter, ids, mask, settings, mode)
                case["rows"] = compare(expected, scores, output, ids.shape[1], tie_tolerance)
                case["round_record"] = stats_summary(drafter)
                ok = [row["identical"] or (tie_tolerance is not None and row.get("near_tie")) for row in case["rows"]]
                case["status"] = "pass" if all(ok) else "fail"
            except Exception as error:
                case.update(status="error", error=error_summary(error))
            cases.append(case)
    return cases, {"acceptance": asdict(setup.acceptance), "eos_with_processors": setup.eos,
                   "suppressed_with_processors": setup.suppress}


def identity_check(kind: str, mode: str, tie_tolerance: float | None = None) -> Callable:
    def check(context: Context):
        cases, extra = identity_mode(context, kind, mode, tie_tolerance)
        status = worst([case["status"] for case in cases])
        diverged = [(case["case"], row) for case in cases for row in case.get("rows", []) if not row["identical"]]
        summary = f"{sum(c['status'] == 'pass' for c in cases)}/{len(cases)} cases pass"
        if diverged:
            margins = ", ".join(f"{name} row {row['row']} @{row['first_divergence']}: margin "
                                f"{row.get('reference_top2_margin', float('nan')):.3g}" for name, row in diverged[:4])
            summary += f"; divergences: {margins}"
        errors = [case["case"] for case in cases if case["status"] == "error"]
        if errors:
            summary += f"; errors in: {', '.join(errors)}"
        return status, summary, {"mode": mode, "dtype": kind, "cases": cases, **extra}
    return check


# --------------------------------------------------------------------------------------------- environment check

def environment_check(context: Context):
    details = {
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "cuda_runtime": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
        "device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "check_device": str(context.device), "shapes": asdict(context.shapes),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "inductor_triton_cudagraphs": torch._inductor.config.triton.cudagraphs,
        "inductor_triton_cudagraph_trees": torch._inductor.config.triton.cudagraph_trees,
        "inductor_cudagraph_skip_dynamic_graphs": torch._inductor.config.triton.cudagraph_skip_dynamic_graphs,
        "dynamo_recompile_limit": torch._dynamo.config.recompile_limit,
    }
    if torch.cuda.is_available():
        details["devices"] = [
            {"name": torch.cuda.get_device_name(i),
             "capability": ".".join(map(str, torch.cuda.get_device_capability(i))),
             "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
            for i in range(torch.cuda.device_count())
        ]
    names = ", ".join(d["name"] for d in details.get("devices", [])) or "no CUDA device"
    return "pass", f"torch {torch.__version__}, transformers {transformers.__version__}, {names}", details


# ------------------------------------------------------------------------------------------------ compile checks

class CompileWatch:
    """What PyTorch compiled while inside: deltas of `torch._dynamo.utils.counters` (unique graphs, frames, CUDA-graph
    skips) and the recompile, recompile-limit and CUDA-graph-skip messages of dynamo's and inductor's logs."""

    MARKERS = {"recompiles": "Recompiling function", "limit_hits": "hit config.",
               "cudagraph_skips": "skipping cudagraphs"}

    def __init__(self):
        self.messages: dict[str, list[str]] = {key: [] for key in self.MARKERS}
        self.deltas: dict[str, dict[str, int]] = {}
        self._handler = logging.Handler()
        self._handler.emit = self._emit

    def _emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        for key, marker in self.MARKERS.items():
            if marker in message:
                self.messages[key].append(" ".join(message.split())[:400])

    def __enter__(self) -> "CompileWatch":
        counters = torch._dynamo.utils.counters
        self._before = {group: dict(values) for group, values in counters.items()}
        torch._logging.set_logs(recompiles=True, perf_hints=True)
        for name in ("torch._dynamo", "torch._inductor"):
            logging.getLogger(name).addHandler(self._handler)
        return self

    def __exit__(self, *exc_info) -> None:
        for name in ("torch._dynamo", "torch._inductor"):
            logging.getLogger(name).removeHandler(self._handler)
        torch._logging.set_logs()
        for group, values in torch._dynamo.utils.counters.items():
            before = self._before.get(group, {})
            changed = {key: value - before.get(key, 0) for key, value in values.items() if value != before.get(key, 0)}
            if changed:
                self.deltas[group] = changed

    @property
    def recompiles(self) -> int:
        return len(self.messages["recompiles"])

    @property
    def cudagraph_skips(self) -> int:
        return self.deltas.get("inductor", {}).get("cudagraph_skips", 0)

    def report(self) -> dict:
        return {"recompiles": self.recompiles, "cudagraph_skips": self.cudagraph_skips,
                "unique_graphs": self.deltas.get("stats", {}).get("unique_graphs", 0),
                "limit_hits": len(self.messages["limit_hits"]), "counter_deltas": self.deltas,
                "messages": {key: values[:8] for key, values in self.messages.items()}}


def finishing_rounds(drafter) -> list[int]:
    """The rounds (1-based) in which rows finished, from the round record's history."""
    record = drafter.generation_stats
    if record is None:
        return []
    return [i + 1 for i, (outcomes, _) in enumerate(record.history) for outcome in outcomes if outcome.finished]


def ragged_eos(generated: torch.Tensor, forced: int, fallback: int) -> int:
    """An EOS that ends row 0 early and the other rows later or never: the first token of row 0 (other than the
    forced one) that the other rows do not produce before that point, else row 0's first other token."""
    row0 = generated[0].tolist()
    for index, token in enumerate(row0):
        if token != forced and all(token not in row[: index + 1] for row in generated[1:].tolist()):
            return token
    return next((t for t in row0 if t != forced), fallback)


def compiled_call(context: Context, mode: str, lengths: list[int], seed: int) -> dict:
    """One compiled engine call on a batch that ends raggedly (EOS = a token row 0 produces early), against
    `target.generate` and the eager engine, with what PyTorch compiled meanwhile."""
    s = context.shapes
    target, drafter = context.models.get("float32")
    setup = identity_setup(context, "float32")
    ids, mask = random_prompts(lengths, s.vocab, context.device, seed=seed)
    plain = {"max_new_tokens": s.max_new_tokens, "pad_token_id": 0}
    with setup.acceptance.applied(target, drafter):
        first, _ = reference(target, ids, mask, plain)
        settings = {**plain, "eos_token_id": ragged_eos(first[:, ids.shape[1]:], setup.acceptance.token, setup.eos)}
        expected, scores = reference(target, ids, mask, settings)
        eager = decode(target, drafter, ids, mask, settings, mode)
        start = time.perf_counter()
        with CompileWatch() as watch:
            output = decode(target, drafter, ids, mask, settings, mode, compile=True)
            synchronize(context.device)
        seconds = time.perf_counter() - start
    rows = compare(expected, scores, output, ids.shape[1])
    return {"rows_in_batch": len(lengths), "seconds": round(seconds, 2),
            "identical_to_generate": all(row["identical"] for row in rows),
            "identical_to_eager_engine": torch.equal(eager, output), "rows": rows,
            "round_record": stats_summary(drafter), "finishing_rounds": finishing_rounds(drafter), **watch.report()}


def compile_verdict(calls: list[dict], cuda: bool, no_recompiles: bool) -> tuple[str, str]:
    """fail: a mismatch, a CUDA-graph skip on CUDA, a recompile limit hit, or (no_recompiles) any recompile."""
    problems = []
    for i, call in enumerate(calls, 1):
        if not (call["identical_to_generate"] and call["identical_to_eager_engine"]):
            problems.append(f"call {i} not identical")
        if cuda and call["cudagraph_skips"]:
            problems.append(f"call {i}: {call['cudagraph_skips']} cudagraph skips")
        if call["limit_hits"]:
            problems.append(f"call {i}: recompile limit hit (runs eager)")
        if no_recompiles and call["recompiles"]:
            problems.append(f"call {i}: {call['recompiles']} recompiles")
    counts = "; ".join(f"call {i}: {c['seconds']} s, {c['unique_graphs']} graphs, {c['recompiles']} recompiles, "
                       f"{c['cudagraph_skips']} cudagraph skips, rows finished in rounds {c['finishing_rounds']}"
                       for i, c in enumerate(calls, 1))
    return ("fail" if problems else "pass"), "; ".join(problems + [counts])


def compile_check(mode: str) -> Callable:
    def check(context: Context):
        if mode == "sync":  # the first compile check starts from nothing compiled
            torch._dynamo.reset()
        call = compiled_call(context, mode, list(context.shapes.prompt_lengths), seed=1)
        status, summary = compile_verdict([call], context.device.type == "cuda", no_recompiles=False)
        return status, summary, {"mode": mode, "calls": [call]}
    return check


def back_to_back_check(context: Context):
    """Two calls after the first (compile-sync's) on the same prompts: after a warm-up none may compile again."""
    lengths = list(context.shapes.prompt_lengths)
    calls = [compiled_call(context, "sync", lengths, seed=1) for _ in range(2)]
    status, summary = compile_verdict(calls, context.device.type == "cuda", no_recompiles=True)
    return status, summary, {"calls": calls}


def new_prompts_check(context: Context):
    """Warm calls on prompts of other lengths and batch sizes: a server's traffic; none may compile again."""
    lengths = [length + 37 for length in context.shapes.prompt_lengths]
    calls = [compiled_call(context, "sync", lengths, seed=3), compiled_call(context, "sync", lengths[:1], seed=4)]
    status, summary = compile_verdict(calls, context.device.type == "cuda", no_recompiles=True)
    return status, summary, {"calls": calls}


# -------------------------------------------------------------------------------------------- 8B timing checks

class PassClock:
    """Milliseconds of the work between `start()` and `stop()`: CUDA events on the current stream on CUDA (the host
    is not blocked in between), the host clock elsewhere."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.begin, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self.cuda:
            self.begin.record()
        else:
            self.started = time.perf_counter()

    def stop(self) -> float:
        if not self.cuda:
            return 1e3 * (time.perf_counter() - self.started)
        self.end.record()
        self.end.synchronize()
        return self.begin.elapsed_time(self.end)


@dataclass
class PassShape:
    """A forward pass to time: `rows` x `width` new tokens after a `prefix`-token cache, keeping `keep` logits."""

    rows: int
    width: int
    prefix: int
    keep: int


class PassTimer:
    """A model with a `prefix`-token DynamicCache per row count, passes of `width` tokens after it timed with CUDA
    events (the cache is cropped back after each). The mask is an explicit boolean 4D mask, as the engine passes."""

    def __init__(self, model, shape: PassShape, device: torch.device, seed: int = 0):
        self.model, self.shape, self.device = model, shape, device
        generator = torch.Generator().manual_seed(seed)
        vocab = model.config.vocab_size - 1
        prefix_ids = torch.randint(0, vocab, (shape.rows, shape.prefix), generator=generator).to(device)
        self.ids = torch.randint(0, vocab, (shape.rows, shape.width), generator=generator).to(device)
        self.positions = (shape.prefix + torch.arange(shape.width, device=device)).expand(shape.rows, -1)
        columns = torch.arange(shape.prefix + shape.width, device=device)
        self.mask = (columns[None, :] <= self.positions[0, :, None])[None, None].expand(shape.rows, 1, -1, -1)
        self.cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=prefix_ids, past_key_values=self.cache, use_cache=True, logits_to_keep=1)

    @torch.no_grad()
    def run(self) -> torch.Tensor:
        """One pass `(rows, keep, vocab)` float32 logits; the cache is back at the prefix after it."""
        output = self.model(input_ids=self.ids, position_ids=self.positions,
                            attention_mask={"full_attention": self.mask}, past_key_values=self.cache, use_cache=True,
                            logits_to_keep=self.shape.keep)
        self.cache.crop(-self.shape.width)
        return output.logits.float()

    def milliseconds(self, repeats: int = 8) -> float:
        """Median time of one pass (CUDA events on CUDA), after two warm-up passes."""
        timer = PassClock(self.device)
        times = []
        for i in range(repeats + 2):
            timer.start()
            self.run()
            elapsed = timer.stop()
            if i >= 2:
                times.append(elapsed)
        return statistics.median(times)


def pass_shapes(shapes: Shapes, rows: int, tau: float) -> dict[str, tuple[str, PassShape]]:
    """The engine's passes at the timing shape: target alone (1 token), verify (B), block draft (the tokens accepted
    last round + B), successor (2B causal + ((C-1)F + 1) blocks), each with its model."""
    b, p = shapes.block_size, shapes.prefix
    blocks = (shapes.coverage - 1) * shapes.fanout + 1
    return {
        "target_step": ("target", PassShape(rows, 1, p, 1)),
        "verify": ("target", PassShape(rows, b, p, b)),
        "block_draft": ("drafter", PassShape(rows, b + round(tau), p, b - 1)),
        "successor": ("drafter", PassShape(rows, 2 * b + blocks * b, p, blocks * b)),
    }


def record_split(record, seconds: float) -> dict:
    """ms per round (verify / exposed / hidden / host: the engine's own round record), tokens per row per round, and
    tokens/s over the call's wall time `seconds` (prefill included, as for `generate`)."""
    rounds = max(record.rounds, 1)
    return {"rounds": record.rounds, "tau": round(record.tau, 3),
            "verify_ms": round(1e3 * record.verify_seconds / rounds, 3),
            "exposed_draft_ms": round(1e3 * record.exposed_draft_seconds / rounds, 3),
            "hidden_draft_ms": round(1e3 * record.hidden_draft_seconds / rounds, 3),
            "host_ms": round(1e3 * record.host_seconds / rounds, 3),
            "round_ms": round(1e3 * record.seconds / rounds, 3),
            "tokens_per_s": round(record.new_tokens / seconds, 1)}


def timed_generate(function: Callable, device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    function()
    synchronize(device)
    return time.perf_counter() - start


def engine_tau(target, drafter, ids, mask, settings: dict, token: int, bias: float) -> float:
    """Tokens per row per round of the synchronous engine with `token` biased by `bias` (drafter forced to it)."""
    with forced_head(target, token, bias), forced_head(drafter, token):
        drafter.generate_batch(target, ids, attention_mask=mask, **settings)
    return drafter.generation_stats.tau


def calibrate_tau(target, drafter, ids, mask, settings: dict, token: int, goal: float = PAPER_TAU,
                  steps: int = 7) -> tuple[float, float]:
    """Bisect the target's bias on `token` until the engine accepts about `goal` tokens a round: (bias, tau)."""
    low, high = 0.0, 64.0
    best = (high, engine_tau(target, drafter, ids, mask, settings, token, high))
    if best[1] < goal:
        return best
    for _ in range(steps):
        middle = (low + high) / 2
        tau = engine_tau(target, drafter, ids, mask, settings, token, middle)
        if abs(tau - goal) < abs(best[1] - goal):
            best = (middle, tau)
        if abs(tau - goal) <= 0.4:
            break
        low, high = (middle, high) if tau < goal else (low, middle)
    return best


def timing_rows(context: Context, rows: int) -> dict:
    """Measured: `generate`, the engine alone, D3D sync/async with the random drafter (tau about 1) and with the
    acceptance forced to about tau 7.88 (biased heads); projected: the round from CUDA-event pass times at 7.88."""
    s, device = context.shapes, context.device
    target, drafter = context.models.get("8b")
    ids, mask = random_prompts([s.prefix] * rows, s.vocab, device, seed=5)
    n = s.timing_new_tokens
    settings = {"max_new_tokens": n, "do_sample": False, "pad_token_id": 0}
    target.generate(ids, attention_mask=mask, **{**settings, "max_new_tokens": 4})  # warm-up
    out = {"rows": rows, "prefix": s.prefix, "new_tokens": n}
    seconds = timed_generate(lambda: target.generate(ids, attention_mask=mask, **settings), device)
    out["generate_tokens_per_s"] = round(rows * n / seconds, 1)
    seconds = timed_generate(lambda: target.generate(ids, attention_mask=mask, custom_generate=speculative_generate,
                                                     **settings), device)
    out["engine_alone_tokens_per_s"] = round(rows * n / seconds, 1)
    measured = {}
    for mode in ("sync", "async"):
        seconds = timed_generate(lambda: drafter.generate_batch(target, ids, attention_mask=mask, **settings,
                                                                **MODES[mode]), device)
        measured[f"{mode}_random_drafter"] = record_split(drafter.generation_stats, seconds)
    token = 7
    forced = {**settings, "max_new_tokens": 8 * s.block_size}
    bias, tau = calibrate_tau(target, drafter, ids, mask, {**settings, "max_new_tokens": 4 * s.block_size}, token)
    out["forced_acceptance"] = {"label": "measured with biased heads on random weights", "token": token,
                                "bias": round(bias, 3), "calibrated_tau": round(tau, 3)}
    with forced_head(target, token, bias), forced_head(drafter, token):
        for mode in ("sync", "async"):
            seconds = timed_generate(lambda: drafter.generate_batch(target, ids, attention_mask=mask, **forced,
                                                                    **MODES[mode]), device)
            split = record_split(drafter.generation_stats, seconds)
            split["speedup_vs_generate"] = round(split["tokens_per_s"] / out["generate_tokens_per_s"], 2)
            measured[f"{mode}_forced_tau"] = split
    out["engine_measured"] = measured
    models = {"target": target, "drafter": drafter}
    passes = {name: round(PassTimer(models[model], shape, device).milliseconds(), 3)
              for name, (model, shape) in pass_shapes(s, rows, PAPER_TAU).items()}
    release_memory()
    out["pass_ms_cuda_events"] = passes
    host = measured["sync_forced_tau"]["host_ms"]
    rounds = {"sync": passes["block_draft"] + passes["verify"] + host,
              "async_all_hits": passes["verify"] + host,
              "async_all_misses": passes["block_draft"] + passes["verify"] + host}
    out["projection_tau_7_88"] = {
        "label": "projection: CUDA-event pass times + the engine's measured host ms a round, at the paper's tau 7.88",
        **{f"{name}_round_ms": round(ms, 3) for name, ms in rounds.items()},
        **{f"{name}_tokens_per_s": round(rows * PAPER_TAU / ms * 1e3, 1) for name, ms in rounds.items()},
        **{f"{name}_speedup_vs_generate": round(rows * PAPER_TAU / ms * 1e3 / out["generate_tokens_per_s"], 2)
           for name, ms in rounds.items()},
    }
    return out


def timing_check(context: Context):
    results = []
    for rows in context.shapes.timing_rows:
        if context.remaining() < 30:
            results.append({"rows": rows, "skipped": "time budget"})
            continue
        results.append(timing_rows(context, rows))
    summary = "; ".join(
        f"rows {r['rows']}: generate {r['generate_tokens_per_s']} tok/s, "
        f"engine alone {r['engine_alone_tokens_per_s']}, "
        f"forced tau {r['engine_measured']['sync_forced_tau']['tau']}: sync "
        f"{r['engine_measured']['sync_forced_tau']['tokens_per_s']} / async "
        f"{r['engine_measured']['async_forced_tau']['tokens_per_s']} tok/s measured; at tau 7.88 sync "
        f"{r['projection_tau_7_88']['sync_tokens_per_s']} / async "
        f"{r['projection_tau_7_88']['async_all_hits_tokens_per_s']}"
        f" tok/s (projection)" for r in results if "skipped" not in r)
    return "measured", summary, {"per_rows": results}


def overlap_check(context: Context):
    """The successor pass (C, F) submitted from a worker thread on its own stream, as the engine does, beside the
    verify pass on the default stream: overlap = (t_verify + t_successor - t_both) / min(t_verify, t_successor)."""
    s, device = context.shapes, context.device
    target, drafter = context.models.get("8b")
    rows = max(s.timing_rows)
    shapes = pass_shapes(s, rows, PAPER_TAU)
    verify = PassTimer(target, shapes["verify"][1], device)
    successor = PassTimer(drafter, shapes["successor"][1], device)
    alone = {"verify_ms": verify.milliseconds(), "successor_ms": successor.milliseconds()}
    side = torch.cuda.Stream(device)
    both = []
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpu-check-worker") as worker:
        for i in range(10):
            begin, side_done, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            begin.record()

            def on_side():
                with torch.cuda.stream(side):
                    side.wait_event(begin)
                    successor.run()
                    side_done.record(side)

            pending = worker.submit(on_side)
            verify.run()
            pending.result(timeout=120)
            torch.cuda.current_stream(device).wait_event(side_done)
            end.record()
            end.synchronize()
            if i >= 2:
                both.append(begin.elapsed_time(end))
    together = statistics.median(both)
    overlap = (alone["verify_ms"] + alone["successor_ms"] - together) / min(alone.values())
    details = {"rows": rows, "coverage": s.coverage, "fanout": s.fanout, **{k: round(v, 3) for k, v in alone.items()},
               "together_ms": round(together, 3), "overlap_fraction": round(overlap, 3)}
    verdict = "overlaps" if overlap >= 0.5 else "mostly serialised" if overlap < 0.2 else "partly overlaps"
    return "measured", (f"successor {alone['successor_ms']:.1f} ms beside verify {alone['verify_ms']:.1f} ms: "
                        f"{together:.1f} ms together, overlap {overlap:.0%} ({verdict})"), details


def cache_bytes(config, slots: int, columns: int) -> int:
    """Keys and values of a static cache: 2 x layers x slots x kv_heads x columns x head_dim elements."""
    return 2 * config.num_hidden_layers * slots * config.num_key_value_heads * columns * config.head_dim


def memory_check(context: Context):
    """A D3DBatchServer of `server_rows` x `server_length` (async, C and F) with both 8B-shaped models, one short
    request per row; peak allocation above the weights against caches + the successor pass's logits."""
    s, device = context.shapes, context.device
    target, drafter = context.models.get("8b")
    element = torch.finfo(target.dtype).bits // 8
    blocks = (s.coverage - 1) * s.fanout + 1
    estimate = {
        "target_cache": cache_bytes(target.config, s.server_rows, s.server_length + s.block_size) * element,
        "drafter_cache": cache_bytes(drafter.config, s.server_rows,
                                     s.server_length + 1 + (blocks + 3) * s.block_size) * element,
        # raw logits in the model dtype, then float32 twice (the float copy and the processed one)
        "successor_logits": s.server_rows * blocks * s.block_size * s.vocab * (element + 8),
    }
    weights = sum(p.numel() * p.element_size() for m in (target, drafter) for p in m.parameters())
    synchronize(device)
    release_memory()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    prompt_length = min(s.prefix, s.server_length // 2)
    ids, _ = random_prompts([prompt_length] * s.server_rows, s.vocab, "cpu", seed=6)
    with drafter.batch_server(target, max_batch_size=s.server_rows, asynchronous=True, coverage=s.coverage,
                              fanout=s.fanout, max_length=s.server_length) as server:
        handles = [server.submit(row.tolist(), max_new_tokens=2 * s.block_size) for row in ids]
        for handle in handles:
            handle.result(timeout=300)
        synchronize(device)
        held = torch.cuda.memory_allocated(device) - base
    peak = torch.cuda.max_memory_allocated(device) - base
    total = sum(estimate.values())
    gib = lambda n: round(n / 2**30, 2)  # noqa: E731
    details = {"weights_gib": gib(weights), "allocated_before_gib": gib(base), "held_by_server_gib": gib(held),
               "peak_above_weights_gib": gib(peak), "estimate_gib": {k: gib(v) for k, v in estimate.items()},
               "estimate_total_gib": gib(total), "peak_over_estimate": round(peak / total, 2),
               "device_total_gib": gib(torch.cuda.get_device_properties(device).total_memory)}
    status = "pass" if peak <= 1.5 * total else "fail"
    return status, (f"weights {gib(weights)} GiB; server peak {gib(peak)} GiB above them vs estimate {gib(total)} GiB "
                    f"(x{peak / total:.2f})"), details


# ---------------------------------------------------------------------------------------------------- the runner

BF16_TIE_TOLERANCE = 2 ** -5  # a bf16 divergence whose score gap is within this fraction of the top score: a near-tie


def all_checks() -> list[Check]:
    identity = [Check(f"identity-float32-{mode}", identity_check("float32", mode), ("float32",), 10,
                      needs_cuda=mode == "cross-device") for mode in MODES]
    bf16 = [Check(f"identity-bfloat16-{mode}", identity_check("bfloat16", mode, BF16_TIE_TOLERANCE), ("bfloat16",), 10)
            for mode in ("sync", "async")]
    full = [Check("timing-8b", timing_check, ("8b",), 90, True), Check("overlap-8b", overlap_check, ("8b",), 30, True),
            Check("memory-server-8b", memory_check, ("8b",), 40, True)]
    compiled = [Check("compile-sync", compile_check("sync"), ("float32",), 60, True),
                Check("compile-async", compile_check("async"), ("float32",), 60, True),
                Check("compile-back-to-back", back_to_back_check, ("float32",), 40, True),
                Check("compile-new-prompts", new_prompts_check, ("float32",), 40, True)]
    return [Check("environment", environment_check), *identity, *bf16, *full, *compiled]


SMOKE_CHECKS = ("environment", "identity-float32-sync", "identity-float32-async", "identity-float32-cross-device")


def markdown(results: list[CheckResult], header: dict) -> str:
    lines = [f"# d3d gpu-check ({header['started']}, {header['device']}{', smoke' if header['smoke'] else ''})", "",
             "| check | status | seconds | summary |", "|---|---|---|---|"]
    for result in results:
        text = result.error or result.summary
        lines.append(f"| {result.name} | {result.status} | {result.seconds} | {text.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


class Report:
    """The results so far, rewritten to `gpu_check.json` and `gpu_check.md` after every check (thread-safe: the
    watchdog may write the last state)."""

    def __init__(self, folder: Path, header: dict):
        self.folder, self.header = folder, header
        self.results: list[CheckResult] = []
        self.running: str | None = None
        self._lock = threading.Lock()

    def add(self, result: CheckResult) -> None:
        with self._lock:
            self.results.append(result)
            self.running = None
            self._write(self.results)

    def write_timed_out(self, seconds: float) -> None:
        with self._lock:
            results = list(self.results)
            if self.running:
                results.append(CheckResult(self.running, "error", summary=f"still running when the {seconds:.0f} s "
                                                                          "budget ran out; the process was ended"))
            self._write(results)

    def _write(self, results: list[CheckResult]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        payload = {**self.header, "checks": [asdict(r) for r in results]}
        (self.folder / "gpu_check.json").write_text(json.dumps(payload, indent=2, default=str))
        (self.folder / "gpu_check.md").write_text(markdown(results, self.header))


def run_checks(checks: list[Check], shapes: Shapes, device: torch.device, folder: Path, budget_s: float,
               smoke: bool) -> list[CheckResult]:
    """Run `checks` in order within `budget_s` seconds; a watchdog ends the process (results written) if a running
    check overruns the budget by a minute."""
    header = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": str(device), "smoke": smoke,
              "budget_s": budget_s}
    report = Report(folder, header)
    context = Context(shapes, device, ModelCache(shapes, device), time.monotonic() + budget_s)

    def overrun():
        report.write_timed_out(budget_s)
        print(f"gpu-check: over the {budget_s:.0f} s budget; results so far in {folder}", flush=True)
        os._exit(1)

    watchdog = threading.Timer(budget_s + 60, overrun)
    watchdog.daemon = True
    watchdog.start()
    try:
        for check in checks:
            print(f"gpu-check: {check.name} ...", flush=True)
            report.running = check.name
            result = run_check(check, context)
            report.add(result)
            print(f"gpu-check: {check.name}: {result.status} ({result.seconds} s) {result.summary}", flush=True)
    finally:
        watchdog.cancel()
        context.models.keep_only(())
    return report.results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter  # keep the docstring's list of checks
    parser.add_argument("--output", default="gpu-check", help="folder for gpu_check.json and gpu_check.md")
    parser.add_argument("--smoke", action="store_true",
                        help="only the environment and float32 identity checks, with tiny shapes (runs on a CPU)")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="seconds for all checks; a check that would start with less than it needs is skipped")
    parser.add_argument("--only", default=None, help="comma-separated check names to run (default: all)")
    for name, help_text in SIZE_OPTIONS.items():
        default = getattr(Shapes(), name)
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        parser.add_argument(f"--{name.replace('_', '-')}", default=None,
                            metavar="N[,N...]" if name == "timing_rows" else "N", help=f"{help_text} (default {shown})")


SIZE_OPTIONS = {  # Shapes fields settable from the command line (smaller GPUs, quicker runs)
    "max_new_tokens": "new tokens of the identity and compile checks",
    "full_target_layers": "layers of the 8B-shaped target",
    "full_drafter_layers": "layers of the 8B-shaped drafter",
    "prefix": "prompt tokens of the 8B timing checks",
    "timing_rows": "comma-separated batch sizes of the 8B timing check",
    "server_rows": "rows of the memory check's server",
    "server_length": "max_length of the memory check's server",
}


def size_overrides(args: argparse.Namespace) -> dict:
    """The `SIZE_OPTIONS` given, as `Shapes` fields; ValueError (exit 2) unless positive integers."""
    overrides = {}
    for name in SIZE_OPTIONS:
        text = getattr(args, name)
        if text is None:
            continue
        parts = text.split(",") if name == "timing_rows" else [text]
        if not all(part.strip().isdigit() and int(part) > 0 for part in parts):
            raise ValueError(f"--{name.replace('_', '-')} takes positive integers, got {text!r}")
        values = tuple(int(part) for part in parts)
        overrides[name] = values if name == "timing_rows" else values[0]
    return overrides


def choose_checks(only: str | None, smoke: bool) -> list[Check]:
    checks = [c for c in all_checks() if not smoke or c.name in SMOKE_CHECKS]
    if only is None:
        return checks
    wanted = [name.strip() for name in only.split(",") if name.strip()]
    known = {c.name for c in checks}
    unknown = [name for name in wanted if name not in known]
    if unknown:
        raise ValueError(f"unknown check(s) {', '.join(unknown)}; choose from {', '.join(sorted(known))}")
    return [c for c in checks if c.name in wanted]


def run(args: argparse.Namespace) -> int:
    """Returns 0 when no check failed or errored, 1 otherwise; raises ValueError (exit 2) without CUDA and --smoke."""
    if not args.smoke and not torch.cuda.is_available():
        raise ValueError("gpu-check needs a CUDA GPU (none is visible); on a CPU run `d3d gpu-check --smoke`")
    if args.budget_s <= 0:
        raise ValueError(f"--budget-s must be positive, got {args.budget_s}")
    shapes = replace(SMOKE_SHAPES if args.smoke else Shapes(), **size_overrides(args))
    checks = choose_checks(args.only, args.smoke)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    results = run_checks(checks, shapes, device, Path(args.output), args.budget_s, args.smoke)
    print((Path(args.output) / "gpu_check.md").read_text())
    return 0 if all(r.status in ("pass", "measured", "skipped") for r in results) else 1


if __name__ == "__main__":  # python -m benchmark.gpu_check ... is `d3d gpu-check ...`
    import sys

    from cli.main import main

    sys.exit(main(["gpu-check", *sys.argv[1:]]))
