"""Fitting `d3d quickstart` to a time budget: what its stages cost on this machine, and the recipe scaled to fit.

The default recipe takes ~11 minutes on a 2-core CPU with native bf16 and far longer on older ones (a Zen 1 EPYC with
AVX2 only trains the target at 3.8 s a step, the whole command ~1.5 hours). Before its first training stage the
quickstart times a few steps of each training (`measure_unit_costs`: the recipe's own shapes, dtype and trainers,
random weights) and of the target's decoding, projects every stage (`projected_seconds`) and, where the projection
is over the budget, scales every step and prompt count by one factor (`fit`). The benchmark keeps its meaning (the
same methods, checks and columns) on fewer prompts.
"""

import math
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from datasets import Dataset
from transformers import PrinterCallback, Qwen3ForCausalLM, Trainer, TrainerCallback, TrainingArguments

from d3d.common.dtype import DtypeChoice
from d3d.common.prompts import left_pad
from d3d.trainer.d3d_trainer import D3DTrainer
from modeling_d3d import D3DForBlockDiffusion

from .pretrain import causal_lm_config, drafter_arguments, pretraining_arguments, with_labels
from .sizes import ModelSize, QuickstartSizes

PROBE_WARMUP, PROBE_STEPS = 2, 4  # untimed, then timed training steps per model (a process's first steps are slower)
PROBE_TOKENS = 16  # timed decoding steps of the target, after an untimed call
PROBE_REPEATS = 2  # timings of each decoding call, the fastest kept
# The benchmark and pruning stages in units of the target's one-row float32 decoding step, measured on the AMD EPYC
# with AVX512-BF16 (2026-12-05, docs/results.md): each method of the benchmark decodes every prompt (eager and
# compiled, a warm-up, the pass-cost measurements and compiles), pruning's evaluations decode the dev prompts once per
# candidate layer and stage.
BENCH_STEPS_PER_TOKEN = 12.0
PRUNE_STEPS_PER_TOKEN = 3.0
# What the probes do not see (a stage's model set-up, evaluations and saving, a process's slower first steps): the
# stages took 1.3x their projection without it on the AMD EPYC (2026-12-05).
OVERHEAD = 1.3
MIN_STEPS = 20  # no training is scaled below this many steps
MIN_BENCH_PROMPTS = 4  # nor a benchmark prompt set below this many prompts


@dataclass(frozen=True)
class UnitCosts:
    """Seconds per unit of each stage on this machine: a training step of each model; the target's prefill of
    `response_batch_size` prompts and each decoding step after it (the responses' dtype); one decoding step of one row
    in float32 (benchmark, pruning)."""

    target_step: float
    assistant_step: float
    drafter_step: float
    batch_prefill: float
    batch_token: float
    row_token: float


class _StepTimer(TrainerCallback):
    """The wall time of each optimizer step of a `Trainer` run (on CUDA, to the end of its kernels)."""

    def __init__(self):
        self.seconds: list[float] = []
        self._start = 0.0

    @staticmethod
    def _now() -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = self._now()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(self._now() - self._start)


def _timed_training(trainer_type: type[Trainer], model, args: TrainingArguments, dataset: Dataset, **kwargs) -> float:
    """The median seconds of a training step after `PROBE_WARMUP`: `trainer_type` (the stage's own trainer) runs
    `PROBE_WARMUP + PROBE_STEPS` steps under `args`, quietly."""
    timer = _StepTimer()
    args = replace(args, max_steps=PROBE_WARMUP + PROBE_STEPS, logging_strategy="no", disable_tqdm=True)
    trainer = trainer_type(model=model, args=args, train_dataset=dataset, callbacks=[timer], **kwargs)
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    if len(timer.seconds) <= PROBE_WARMUP:
        raise ValueError(f"{len(dataset)} training rows make no timed step of {args.per_device_train_batch_size}: "
                         "the corpus is too small for these sizes")
    return statistics.median(timer.seconds[PROBE_WARMUP:])


def _random_causal_lm(sizes: QuickstartSizes, size: ModelSize, tokenizer) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    return Qwen3ForCausalLM(causal_lm_config(tokenizer, sizes.vocab_size, size))


@torch.no_grad()
def _decoding_seconds(model, prompts: list[list[int]], pad_token_id: int) -> tuple[float, float]:
    """(seconds of the prefill and first token, seconds per later token) of `model`'s greedy decoding of `prompts`
    (left-padded rows, as the stages decode them), after an untimed call: the fastest of `PROBE_REPEATS` timings of
    one token and of `1 + PROBE_TOKENS` (a pause of the process in one timing would make later tokens look free or
    dear). Where even those say later tokens cost nothing, each is priced at the longer call's seconds per token (the
    prefill's share included: too high rather than free)."""
    input_ids, attention_mask = left_pad(prompts, pad_token_id)
    kwargs = {"attention_mask": attention_mask, "do_sample": False, "pad_token_id": pad_token_id, "eos_token_id": None}
    model.generate(input_ids, max_new_tokens=1, **kwargs)
    timings: dict[int, list[float]] = {1: [], 1 + PROBE_TOKENS: []}
    for _ in range(PROBE_REPEATS):
        for new_tokens, seconds in timings.items():
            start = time.perf_counter()
            model.generate(input_ids, max_new_tokens=new_tokens, **kwargs)
            seconds.append(time.perf_counter() - start)
    first, whole = min(timings[1]), min(timings[1 + PROBE_TOKENS])
    later = (whole - first) / PROBE_TOKENS
    return first, later if later > 0 else whole / (1 + PROBE_TOKENS)


def measure_unit_costs(sizes: QuickstartSizes, tokenizer, dataset: Dataset, prompts: list[list[int]],
                       choice: DtypeChoice) -> UnitCosts:
    """Time each stage's unit at the recipe's shapes (random weights): the target's and the assistant's pretraining
    steps on `dataset` (`input_ids` rows), the drafter's step on `prompts` (the responses' prompt ids) completed by
    text from `dataset`, the target's decoding of a batch of `prompts` and of one."""
    with tempfile.TemporaryDirectory() as scratch:
        def pretraining_step(size: ModelSize) -> float:
            rows = dataset.select(range(min(len(dataset), (PROBE_WARMUP + PROBE_STEPS) * size.batch_size)))
            args = pretraining_arguments(Path(scratch), PROBE_STEPS, size.batch_size, size.learning_rate, choice.bf16)
            return _timed_training(Trainer, _random_causal_lm(sizes, size, tokenizer), args, rows, data_collator=with_labels)

        target_step, assistant_step = pretraining_step(sizes.target), pretraining_step(sizes.assistant)
        drafter = D3DForBlockDiffusion.from_backbone(_random_causal_lm(sizes, sizes.assistant, tokenizer),
                                                     block_size=sizes.block_size, tokenizer=tokenizer)
        rows = (PROBE_WARMUP + PROBE_STEPS) * sizes.drafter_batch_size
        texts = dataset.select(range(min(len(dataset), rows)))["input_ids"]
        responses = Dataset.from_dict({"prompt": [prompts[i % len(prompts)] for i in range(rows)],
                                       "completion": [texts[i % len(texts)][: sizes.response_tokens] for i in range(rows)]})
        args = drafter_arguments(Path(scratch), sizes, PROBE_STEPS, choice)
        drafter_step = _timed_training(D3DTrainer, drafter, args, responses)
    target = _random_causal_lm(sizes, sizes.target, tokenizer).eval()
    batch = _decoding_seconds(target.to(choice.dtype), prompts[: sizes.response_batch_size], tokenizer.pad_token_id)
    _, row_token = _decoding_seconds(target.float(), prompts[:1], tokenizer.pad_token_id)
    return UnitCosts(target_step, assistant_step, drafter_step, *batch, row_token)


def projected_seconds(sizes: QuickstartSizes, costs: UnitCosts) -> dict[str, float]:
    """Each stage's projected seconds under `sizes` at `costs` (`OVERHEAD` included)."""
    batches = math.ceil(sizes.drafter_prompts / sizes.response_batch_size)
    bench_tokens = (sizes.bench_prompts + sizes.bench_pydoc_prompts) * sizes.bench_new_tokens
    dev_tokens = 2 * sizes.dev_prompts * sizes.response_tokens * (sizes.prune_stages + 1)
    stages = {
        "target": sizes.target.steps * costs.target_step,
        "assistant": sizes.assistant.steps * costs.assistant_step,
        "responses": batches * (costs.batch_prefill + sizes.response_tokens * costs.batch_token),
        "drafter": sizes.drafter_steps * costs.drafter_step,
        "pruning": sizes.prune_stages * sizes.recovery_steps * costs.drafter_step
        + PRUNE_STEPS_PER_TOKEN * dev_tokens * costs.row_token,
        "benchmark": BENCH_STEPS_PER_TOKEN * bench_tokens * costs.row_token,
    }
    return {stage: OVERHEAD * seconds for stage, seconds in stages.items()}


def scaled(sizes: QuickstartSizes, factor: float) -> QuickstartSizes:
    """`sizes` with every training step count, the responses and the benchmark's prompts times `factor` (each kept
    at its floor: `MIN_STEPS`, the dev prompts and a batch of responses, `MIN_BENCH_PROMPTS`); 1 leaves them as is."""
    def steps(count: int) -> int:
        return min(count, max(round(count * factor), MIN_STEPS))

    def prompts(count: int) -> int:
        return min(count, max(round(count * factor), MIN_BENCH_PROMPTS))

    responses = max(round(sizes.drafter_prompts * factor), 2 * sizes.dev_prompts + sizes.response_batch_size)
    return replace(
        sizes, target=replace(sizes.target, steps=steps(sizes.target.steps)),
        assistant=replace(sizes.assistant, steps=steps(sizes.assistant.steps)),
        drafter_prompts=min(sizes.drafter_prompts, responses), drafter_steps=steps(sizes.drafter_steps),
        recovery_steps=steps(sizes.recovery_steps), bench_prompts=prompts(sizes.bench_prompts),
        bench_pydoc_prompts=prompts(sizes.bench_pydoc_prompts),
    )


def fit(sizes: QuickstartSizes, costs: UnitCosts, seconds: float) -> tuple[QuickstartSizes, float]:
    """The largest scale (to 1 %) of `sizes` whose projection is within `seconds`, and that scale (1.0: unchanged;
    the smallest scale's sizes where even those are over)."""
    def fits(factor: float) -> bool:
        return sum(projected_seconds(scaled(sizes, factor), costs).values()) <= seconds

    if fits(1.0):
        return sizes, 1.0
    factor = next((percent / 100 for percent in range(99, 0, -1) if fits(percent / 100)), 0.01)
    return scaled(sizes, factor), factor


__all__ = ["UnitCosts", "fit", "measure_unit_costs", "projected_seconds", "scaled"]
