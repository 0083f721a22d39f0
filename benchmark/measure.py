"""Decode a prompt set with one method and record what happened: time, tokens, rounds, cache hits, outputs."""

import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm
from transformers.generation.streamers import BaseStreamer

from modeling_d3d.speculative_d3d import synchronize


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
    """One method over one prompt set: totals and per-prompt outputs."""

    name: str
    seconds: float = 0.0
    new_tokens: int = 0
    rounds: int = 0
    cache_hits: int = 0
    lookups: int = 0
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else float("nan")

    @property
    def tau(self) -> float:
        """Tokens per target forward pass (1.0 for the target alone)."""
        return self.new_tokens / self.rounds if self.rounds else float("nan")

    @property
    def hit_rate(self) -> float | None:
        return self.cache_hits / self.lookups if self.lookups else None


def decode_one(target, prompt: torch.Tensor, max_new_tokens: int, run: MethodRun, **generate_kwargs) -> None:
    """Greedy-decode `prompt` `(1, L)` with `target.generate(**generate_kwargs)`; add time, tokens, rounds (counted by
    a streamer, the same way for every method) and, for D3D assistants, cache hits to `run`."""
    assistant = generate_kwargs.get("assistant_model")
    counter = RoundCounter()
    synchronize(target.device)
    start = time.perf_counter()
    output = target.generate(
        prompt.to(target.device), max_new_tokens=max_new_tokens, do_sample=False, streamer=counter, **generate_kwargs
    )
    if hasattr(assistant, "wait"):  # an async generator's last queued pass is charged to it, not to the next method
        assistant.wait()
    synchronize(target.device)
    run.seconds += time.perf_counter() - start
    new = output[0, prompt.shape[1] :].tolist()
    run.outputs.append(new)
    run.new_tokens += len(new)
    run.rounds += counter.rounds
    stats = getattr(assistant, "generation_stats", None)
    if stats is not None and len(new) > 1:
        stats.settle(output.cpu())
        run.cache_hits += stats.cache_hits
        run.lookups += sum(r.looked_up for r in stats.rounds_drafted)


def acceptance_length(target, drafter, prompts: list[torch.Tensor], max_new_tokens: int, desc: str = "tau") -> float:
    """Mean acceptance length τ of `drafter` (or a generator) for `target` over `prompts`, greedy."""
    run = MethodRun("d3d")
    for prompt in tqdm(prompts, desc=desc, leave=False):
        decode_one(target, prompt, max_new_tokens, run, assistant_model=drafter)
    return run.tau


__all__ = ["MethodRun", "RoundCounter", "acceptance_length", "decode_one"]
