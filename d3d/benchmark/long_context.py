"""Long-context evaluation of selective prefill (paper, Appendix C, Tables 6-7) on text that ships with Python.

Task, *pydoc passage continuation*: a prompt of about `prompt_tokens` tokens concatenates `pydoc_data` topics (the
Python reference manual's help texts); one of them is a passage from a held-out topic (never in the quickstart's
training text). The prompt ends with a cue: 16 tokens from the middle of that passage. The model should continue
the cue as the passage does; the answer is in the prompt, far from its end, so only a model that reads the
prompt's context (and a selection that keeps the passage) can score. Score: ROUGE-L F1 x 100 of the generated
text against the passage's true continuation (`rouge_score`, the implementation Hugging Face `evaluate` wraps for
"rouge", with its default tokenizer).

Settings, as in the paper: the full prompt with the target alone (the 1.00x reference), the full prompt with D3D,
and retentions rho with D3D. Per setting: score, how often the kept chunks hold the whole answer span, time to
first token (TTFT: from the call to the first generated tokens, the probe included), decoding rate after the first
tokens, end-to-end latency, the speedup of each over the reference, and whether every output equals the target's
own greedy output on the prompt it read (the full prompt, or exactly the kept chunks).
"""

import random
import statistics
import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm
from transformers.generation.streamers import BaseStreamer

from modeling_d3d.prefill_d3d import DEFAULT_CHUNK_SIZE, d3d_generate
from modeling_d3d.streams_d3d import synchronize

CUE_TOKENS = 16
PASSAGE_TOKENS = 128
MAX_DISTRACTOR_TOKENS = 600


@dataclass
class LongContextExample:
    """prompt_ids: `(1, L)`; answer_span: `[start, end)` of the true continuation inside the prompt; reference: its
    text; needle: the held-out topic the passage comes from."""

    prompt_ids: torch.LongTensor
    answer_span: tuple[int, int]
    reference: str
    needle: str


def pydoc_continuation_examples(
    tokenizer, num_examples: int, prompt_tokens: int = 1536, answer_tokens: int = 32, seed: int = 0
) -> list[LongContextExample]:
    """Build the task (see the module docstring): needles from the held-out `pydoc_data` topics long enough for a
    passage, distractors from every other topic under `MAX_DISTRACTOR_TOKENS` that does not contain the cue, the
    passage at a random place among them, deterministic under `seed`."""
    from pydoc_data.topics import topics

    from d3d.common.corpus import split_topics

    if not 1 <= answer_tokens <= PASSAGE_TOKENS - CUE_TOKENS:
        raise ValueError(f"answer_tokens must be in 1..{PASSAGE_TOKENS - CUE_TOKENS}, got {answer_tokens}")
    rng = random.Random(seed)
    encoded = {name: tokenizer(text, add_special_tokens=False)["input_ids"] for name, text in sorted(topics.items())}
    separator = tokenizer("\n\n", add_special_tokens=False)["input_ids"]
    needles = [name for name in split_topics()[1] if len(encoded[name]) >= PASSAGE_TOKENS]
    if not needles:
        raise ValueError("No held-out pydoc topic is long enough for a passage with this tokenizer")
    cue_start = PASSAGE_TOKENS - CUE_TOKENS - answer_tokens
    examples = []
    for index in range(num_examples):
        needle = needles[index % len(needles)]
        offset = rng.randrange(len(encoded[needle]) - PASSAGE_TOKENS + 1)
        passage = encoded[needle][offset : offset + PASSAGE_TOKENS]
        cue = passage[cue_start : cue_start + CUE_TOKENS]
        answer = passage[cue_start + CUE_TOKENS :]
        cue_text = tokenizer.decode(cue)
        room = prompt_tokens - len(passage) - len(cue) - 2 * len(separator)
        distractors = [
            name for name in encoded
            if name != needle and len(encoded[name]) <= MAX_DISTRACTOR_TOKENS and cue_text not in topics[name]
        ]
        rng.shuffle(distractors)
        documents, used = [], 0
        for name in distractors:
            if used + len(encoded[name]) + len(separator) <= room:
                documents.append(encoded[name])
                used += len(encoded[name]) + len(separator)
        place = rng.randrange(len(documents) + 1)
        before = [token for document in documents[:place] for token in document + separator]
        after = [token for document in documents[place:] for token in document + separator]
        answer_start = len(before) + cue_start + CUE_TOKENS
        ids = before + passage + separator + after + cue
        examples.append(LongContextExample(
            torch.tensor([ids]), (answer_start, answer_start + len(answer)), tokenizer.decode(answer), needle
        ))
    return examples


class FirstTokenTimer(BaseStreamer):
    """Records when `generate` streams its first new tokens (its first `put` is the prompt) and how many."""

    def __init__(self):
        self.puts = 0
        self.first_at: float | None = None
        self.first_tokens = 0

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_at = time.perf_counter()
            self.first_tokens = value.numel()

    def end(self) -> None:
        return None


@dataclass
class SettingRun:
    """One setting over every example: per-example timings, scores, outputs and checks."""

    name: str
    retention: float | None
    ttft: list[float] = field(default_factory=list)
    total: list[float] = field(default_factory=list)
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    new_tokens: int = 0
    scores: list[float] = field(default_factory=list)
    answer_kept: list[bool] = field(default_factory=list)
    kept_fraction: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    prompts: list[torch.Tensor] = field(default_factory=list)
    taus: list[float] = field(default_factory=list)

    @property
    def decode_rate(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else float("nan")


def run_setting(target, drafter, example: LongContextExample, run: SettingRun, max_new_tokens: int, chunk_size: int) -> None:
    """Decode one example greedily in `run`'s setting (target alone when `run.retention` is None) and record it."""
    timer = FirstTokenTimer()
    ids = example.prompt_ids.to(target.device)
    synchronize(target.device)
    start = time.perf_counter()
    if run.retention is None:
        sequences = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, streamer=timer)
        prompt, kept_spans, tau = ids, [(0, ids.shape[1])], 1.0
    else:
        result = d3d_generate(
            target, drafter, ids, selective_prefill=run.retention, chunk_size=chunk_size,
            max_new_tokens=max_new_tokens, do_sample=False, streamer=timer,
        )
        sequences, prompt, tau = result.sequences, result.prompt_ids, result.round_record.tau
        kept_spans = result.selection.kept_spans if result.selection is not None else [(0, ids.shape[1])]
    synchronize(target.device)
    end = time.perf_counter()
    new = sequences[0, prompt.shape[1] :].tolist()
    first_at = timer.first_at if timer.first_at is not None else end
    run.ttft.append(first_at - start)
    run.total.append(end - start)
    run.decode_tokens += len(new) - timer.first_tokens
    run.decode_seconds += end - first_at
    run.new_tokens += len(new)
    run.outputs.append(new)
    run.prompts.append(prompt.cpu())
    run.taus.append(tau)
    answer_start, answer_end = example.answer_span
    run.answer_kept.append(any(start <= answer_start and answer_end <= end for start, end in kept_spans))
    run.kept_fraction.append(prompt.shape[1] / ids.shape[1])


def rouge_l(reference: str, prediction: str) -> float:
    """ROUGE-L F1 x 100 (`rouge_score`, default tokenizer)."""
    from rouge_score import rouge_scorer

    return 100 * rouge_scorer.RougeScorer(["rougeL"]).score(reference, prediction)["rougeL"].fmeasure


def matches_target(target, run: SettingRun, max_new_tokens: int) -> bool:
    """Whether every output equals the target's own greedy output on the prompt the target read."""
    for prompt, output in zip(run.prompts, run.outputs):
        reference = target.generate(prompt.to(target.device), max_new_tokens=max_new_tokens, do_sample=False)
        if reference[0, prompt.shape[1] :].tolist() != output:
            return False
    return True


def evaluate_selective_prefill(
    target,
    drafter,
    tokenizer,
    num_examples: int = 24,
    prompt_tokens: int = 1536,
    max_new_tokens: int = 32,
    retentions: tuple[float, ...] = (0.3, 0.2, 0.1),
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    seed: int = 0,
) -> dict:
    """Run every setting on the same examples, interleaved example by example (each warmed up first); returns
    everything `prefill.json` holds."""
    examples = pydoc_continuation_examples(tokenizer, num_examples + 1, prompt_tokens, max_new_tokens, seed)
    warmup, examples = examples[0], examples[1:]
    runs = [SettingRun("Full, target alone", None), SettingRun("Full + D3D", 1.0)]
    runs += [SettingRun(f"{round(100 * rho)}% + D3D", rho) for rho in retentions]
    for run in runs:
        run_setting(target, drafter, warmup, SettingRun("warmup", run.retention), max_new_tokens, chunk_size)
    for example in tqdm(examples, desc="long-context examples"):
        for run in runs:
            run_setting(target, drafter, example, run, max_new_tokens, chunk_size)
            run.scores.append(rouge_l(example.reference, tokenizer.decode(run.outputs[-1], skip_special_tokens=True)))
    reference = runs[0]
    rows = []
    for run in tqdm(runs, desc="checking outputs against the target"):
        rows.append({
            "setting": run.name,
            "retention": run.retention,
            "score": statistics.mean(run.scores),
            "answer_kept": statistics.mean(run.answer_kept),
            "kept_fraction": statistics.mean(run.kept_fraction),
            "ttft_seconds": statistics.mean(run.ttft),
            "decode_tokens_per_second": run.decode_rate,
            "e2e_seconds": statistics.mean(run.total),
            "new_tokens": run.new_tokens,
            "tau": statistics.mean(run.taus),
            "ttft_speedup": statistics.mean(reference.ttft) / statistics.mean(run.ttft),
            "decode_speedup": run.decode_rate / reference.decode_rate,
            "e2e_speedup": statistics.mean(reference.total) / statistics.mean(run.total),
            "matches_target": matches_target(target, run, max_new_tokens),
        })
    prompt_lengths = [example.prompt_ids.shape[1] for example in examples]
    return {
        "task": "pydoc passage continuation (ROUGE-L F1 x 100)",
        "examples": len(examples),
        "prompt_tokens": statistics.mean(prompt_lengths),
        "max_new_tokens": max_new_tokens,
        "chunk_size": chunk_size,
        "block_size": drafter.config.block_size,
        "seed": seed,
        "settings": rows,
    }


__all__ = [
    "FirstTokenTimer",
    "LongContextExample",
    "SettingRun",
    "evaluate_selective_prefill",
    "pydoc_continuation_examples",
    "rouge_l",
    "run_setting",
]
