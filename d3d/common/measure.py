"""Decode a prompt set with one method and record what happened: time, tokens, rounds, branch hits, outputs, and for
engine methods (`custom_generate=speculative_generate`) the round split read from the engine's `RoundRecord`; and
`timed`, the one timer of the benchmarks."""

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from tqdm.auto import tqdm
from transformers.generation.streamers import BaseStreamer

from modeling_d3d.engine_d3d import RoundRecord
from modeling_d3d.generation_d3d import speculative_generate
from modeling_d3d.streams_d3d import synchronize

T = TypeVar("T")


class RoundCounter(BaseStreamer):
    """Counts the target's verification rounds: `generate` puts the prompt once, then each round's new tokens."""

    def __init__(self):
        self.puts = 0

    def put(self, value) -> None:
        self.puts += 1

    def end(self) -> None:
        return None

    @property
    def rounds(self) -> int:
        return max(self.puts - 1, 0)


@dataclass
class MethodRun:
    """One method over one prompt set: totals and per-prompt outputs. `verify_seconds` / `exposed_draft_seconds`
    are summed from the engine's round records (None for methods outside the engine), as are `compilations`
    (graphs PyTorch compiled during the rounds) and `verified` (rounds by what they verified: `policy_d3d`'s
    nothing, block, lookup; one prompt a call, so row rounds are rounds; `long_lookups` / `short_lookups`: of the
    lookups, those verified whole past a block's drafts / only their first drafts, in a short round)."""

    name: str
    seconds: float = 0.0
    new_tokens: int = 0
    rounds: int = 0
    branch_hits: int = 0
    lookups: int = 0
    verify_seconds: float | None = None
    exposed_draft_seconds: float | None = None
    compilations: int = 0
    verified: Counter = field(default_factory=Counter)
    long_lookups: int = 0
    short_lookups: int = 0
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else float("nan")

    @property
    def tau(self) -> float:
        """τ over the prompt set: tokens per row round (`RoundRecord.tau`; one prompt a call, so a round is one
        target forward pass, also for methods outside the engine; 1.0 for the target alone)."""
        return self.new_tokens / self.rounds if self.rounds else float("nan")

    @property
    def hit_rate(self) -> float | None:
        return self.branch_hits / self.lookups if self.lookups else None

    def ms_per_round(self, seconds: float | None = None) -> float | None:
        """Milliseconds per round of `seconds` (default: the whole wall-clock time, prefill included)."""
        seconds = self.seconds if seconds is None else seconds
        return 1000 * seconds / self.rounds if self.rounds else None

    def add_record(self, record: RoundRecord) -> None:
        """Add one engine call's round record: rounds, lookups, hits, what rounds verified and the verify / exposed
        drafting seconds."""
        self.rounds += record.rounds
        self.lookups += record.lookups
        self.branch_hits += record.branch_hits
        self.verify_seconds = (self.verify_seconds or 0.0) + record.verify_seconds
        self.exposed_draft_seconds = (self.exposed_draft_seconds or 0.0) + record.exposed_draft_seconds
        self.compilations += record.compilations
        self.verified.update(record.verified)
        self.long_lookups += record.long_lookups
        self.short_lookups += record.short_lookups


def timed(fn: Callable[[], T], device: torch.device | str | None = None) -> tuple[T, float]:
    """`fn()` and its wall-clock seconds, `device`'s queued work included (synchronized before and after): the one
    timer of the benchmarks."""
    if device is not None:
        synchronize(device)
    start = time.perf_counter()
    result = fn()
    if device is not None:
        synchronize(device)
    return result, time.perf_counter() - start


def decode_one(target, prompt: torch.Tensor, max_new_tokens: int, run: MethodRun, sampling: dict | None = None,
               **generate_kwargs) -> None:
    """Decode `prompt` `(1, L)` with `target.generate(**generate_kwargs)`, greedy or with `sampling` (`do_sample`,
    `temperature`, `top_p`, `top_k`), and add to `run`: time, tokens and
    rounds, read from the engine's `RoundRecord` for `custom_generate` calls and counted by a streamer otherwise;
    branch hits for D3D (the round record of the engine, or of an `assistant_model=` adapter)."""
    engine = "custom_generate" in generate_kwargs
    assistant = generate_kwargs.get("assistant_model")
    record = RoundRecord()
    extra = {"round_record": record} if engine else {"streamer": (counter := RoundCounter())}

    def generate() -> torch.Tensor:
        output = target.generate(prompt.to(target.device), max_new_tokens=max_new_tokens,
                                 **(sampling or {"do_sample": False}), **generate_kwargs, **extra)
        source = getattr(assistant, "source", None)
        if hasattr(source, "wait"):  # an async adapter's last queued pass is charged to it, not to the next method
            source.wait()
        return output

    output, seconds = timed(generate, target.device)
    run.seconds += seconds
    new = output[0, prompt.shape[1] :].tolist()
    run.outputs.append(new)
    run.new_tokens += len(new)
    if engine:
        run.add_record(record)
        return
    run.rounds += counter.rounds
    settle = getattr(assistant, "settle", None)
    if settle is not None and len(new) > 1:
        stats = settle(output.cpu())
        if stats is not None:
            run.branch_hits += stats.branch_hits
            run.lookups += stats.lookups


def acceptance_length(target, drafter, prompts: list[torch.Tensor], max_new_tokens: int, desc: str = "tau") -> float:
    """Mean acceptance length τ of `drafter` for `target` over `prompts`, greedy, through the engine, the drafter's
    block verified every round (`policy=False`: the drafter's own acceptance, not the verify policy's choices)."""
    run = MethodRun("d3d")
    for prompt in tqdm(prompts, desc=desc, leave=False):
        decode_one(target, prompt, max_new_tokens, run, custom_generate=speculative_generate, drafter=drafter,
                   policy=False)
    return run.tau


__all__ = ["MethodRun", "RoundCounter", "acceptance_length", "decode_one", "timed"]
