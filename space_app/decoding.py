"""What the Space shows, without Gradio: decode live through the D3D engine, tell how each token came, keep statistics.

Both columns run `SpeculativeEngine` step by step (the target alone: the engine without a drafter source; D3D async:
with a `SuccessorSource`). Each round returns a `RoundOutcome` per row, saying how many of its tokens were accepted
drafts and whether a prepared branch served them, which colours the tokens; the engine's `RoundRecord` gives the
statistics. Nothing is reconstructed after the fact.

Only what a Hub user has is used here: the target, the loaded drafter and the tokenizer; the engine comes from the
drafter's own (remote) code, so the folder runs as a Space on its own.
"""

import importlib
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import NamedTuple

import torch
from transformers import GenerationConfig

DRAFT, CACHE, LOOKUP, TARGET = "draft", "cache", "lookup", "target"
MAX_NEW_TOKENS = 512
MAX_FANOUT = 8
MAX_TEMPERATURE = 2.0


@dataclass(frozen=True)
class Settings:
    """One request's settings. block_size `b`: the drafter proposes `b - 1` tokens a round (`2 <= b <= B`, the
    drafter's trained block size); coverage `C` and fanout `F`: the asynchronous budget; temperature 0 is greedy;
    lookup: prompt lookup beside the drafter (the hybrid, as every front door decodes by default: each round verifies
    the proposal expected to keep more; off with the policy);
    policy: the verify policy (`policy_d3d`: each round verifies what is expected to pay, nothing included; off: the
    drafter's block every round, the paper's rule)."""

    block_size: int
    coverage: int
    fanout: int
    temperature: float
    max_new_tokens: int
    lookup: bool = True
    policy: bool = True


def default_settings(drafter, max_new_tokens: int = 128) -> Settings:
    """What the page opens with: the drafter's trained block size, its engine's default coverage (at most B) and
    fanout, greedy, prompt lookup where the drafter's code has it (as the front doors decode by default)."""
    modules, block_size = engine_modules(drafter), drafter.config.block_size
    return Settings(block_size, min(modules.sources.DEFAULT_COVERAGE, block_size), modules.sources.DEFAULT_FANOUT, 0.0,
                    max_new_tokens, lookup=modules.policy is not None)


def check_settings(settings: Settings, trained_block_size: int) -> None:
    """Raise `ValueError`, with a message for the user, unless every setting is in range."""
    problems = []
    if not 2 <= settings.block_size <= trained_block_size:
        problems.append(f"block size must be in 2..{trained_block_size} (the drafter's trained block size)")
    if not 1 <= settings.coverage <= trained_block_size:
        problems.append(f"coverage C must be in 1..{trained_block_size}")
    if not 0 <= settings.fanout <= MAX_FANOUT:
        problems.append(f"fanout F must be in 0..{MAX_FANOUT}")
    if not 0 <= settings.temperature <= MAX_TEMPERATURE:
        problems.append(f"temperature must be in 0..{MAX_TEMPERATURE} (0 is greedy)")
    if not 1 <= settings.max_new_tokens <= MAX_NEW_TOKENS:
        problems.append(f"max new tokens must be in 1..{MAX_NEW_TOKENS}")
    if settings.lookup and not settings.policy:
        problems.append("prompt lookup needs the verify policy (it decides when a lookup is worth verifying)")
    if problems:
        raise ValueError("; ".join(problems))


def whole_number(name: str, value: float) -> int:
    """`value` as an int; `ValueError` naming the setting unless it is a whole number."""
    if value is None or float(value) != int(value):
        raise ValueError(f"{name} must be a whole number, got {value}")
    return int(value)


def encode_prompt(tokenizer, prompt: str | None) -> torch.LongTensor:
    """`(1, L)` ids of a non-empty prompt: through the chat template (non-thinking) when the tokenizer has one."""
    if not prompt or not prompt.strip():
        raise ValueError("Enter a prompt")
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, enable_thinking=False)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    else:
        ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    return torch.tensor([list(ids)], dtype=torch.long)


class EngineModules(NamedTuple):
    """The drafter's own (remote-code) modules the Space runs."""

    engine: ModuleType
    sources: ModuleType
    settings: ModuleType
    threads: ModuleType | None  # None: a drafter saved before `threads_d3d` existed
    policy: ModuleType | None  # None: a drafter saved before `policy_d3d` (prompt lookup) existed


def engine_modules(drafter) -> EngineModules:
    """The drafter's own `engine_d3d`, `successor_d3d` (as `sources`), `settings_d3d`, `threads_d3d` and `policy_d3d`
    modules (its remote code when loaded from the Hub)."""
    package = type(drafter).__module__.rpartition(".")[0]
    engine, sources, settings = (importlib.import_module(f"{package}.{name}_d3d")
                                 for name in ("engine", "successor", "settings"))
    optional = [importlib.import_module(f"{package}.{name}_d3d")
                if importlib.util.find_spec(f"{package}.{name}_d3d") is not None else None
                for name in ("threads", "policy")]
    return EngineModules(engine, sources, settings, *optional)


def served_by_branch(outcome) -> bool:
    """Whether a prepared branch served this round (`RoundOutcome.from_branch`; `from_cache` in drafter code saved
    before 2026-12-03)."""
    return getattr(outcome, "from_branch", getattr(outcome, "from_cache", False))


def round_record_of(engine):
    """The engine's `RoundRecord` (`engine.round_record`; `engine.record` in drafter code saved before
    2026-12-03)."""
    return getattr(engine, "round_record", None) or engine.record


def rounds_of(engine) -> Iterator[list]:
    """The engine's rounds until its row has left, each round's `RoundOutcome`s (`engine.rounds()`); drafter code
    saved before 2026-12-03 has no `rounds`: its `step` is driven here the same way (an error of the row raised)."""
    if hasattr(engine, "rounds"):
        yield from engine.rounds()
        return
    while len(engine):
        outcomes = engine.step()
        for outcome in outcomes:
            if outcome.error is not None:
                raise outcome.error
        yield outcomes


def kept_lookup(outcome) -> bool:
    """Whether a round's accepted drafts (a `RoundOutcome`'s) came from prompt lookup: verified alone, or the branch a
    tree kept (`branch`; drafter code saved before trees has none)."""
    return outcome.verified == "lookup" or getattr(outcome, "branch", None) == "lookup"


def token_kinds(outcome) -> list[str]:
    """How each token of one round (a `RoundOutcome`) came: its accepted drafts, `LOOKUP` when they came from a
    prompt-lookup continuation (verified alone or as the kept branch of a tree), else `CACHE` when a prepared branch
    served it, else `DRAFT`; then the target's own token, `TARGET` (none when the length limit cut the round inside
    the drafts)."""
    kind = LOOKUP if kept_lookup(outcome) else CACHE if served_by_branch(outcome) else DRAFT
    return [kind] * outcome.accepted_drafts + [TARGET] * (len(outcome.added) - outcome.accepted_drafts)


@dataclass
class Round:
    """One engine round of the Space's row: its tokens, their kinds, and how its draft was served: `cache hit`,
    `drafting pass`, or `no draft` (the target alone)."""

    tokens: list[int]
    kinds: list[str]
    served: str


class Detokenizer:
    """The text each new token adds, so that `"".join(texts) == tokenizer.decode(ids)` once `finish` has run. A token
    that ends inside a multi-byte character (or after which the decoded text does not extend what was shown) adds
    nothing until a later one completes it; `finish` gives what is still pending."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""

    def add(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd") or not text.startswith(self.text):
            return ""
        piece, self.text = text[len(self.text) :], text
        return piece

    def finish(self) -> str:
        text = self.tokenizer.decode(self.ids)
        piece, self.text = text[len(self.text) :], text
        return piece


@dataclass
class LiveDecode:
    """One column of the Space: the tokens so far (with kinds and texts), its rounds, and the engine's `RoundRecord`
    (`round_record`), from which every statistic is read."""

    tokenizer: object
    round_record: object
    tokens: list[int] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    rounds: list[Round] = field(default_factory=list)
    done: bool = False

    def __post_init__(self):
        self._detokenizer = Detokenizer(self.tokenizer)

    def extend(self, outcome, drafting: bool) -> None:
        """Add one round's `RoundOutcome`; `drafting`: whether a drafter proposed drafts for it."""
        served = ("prompt lookup" if kept_lookup(outcome) else "cache hit" if served_by_branch(outcome)
                  else "drafting pass" if drafting and outcome.verified in ("block", "both") else "no draft")
        round_ = Round(list(outcome.added), token_kinds(outcome), served)
        self.rounds.append(round_)
        self.tokens += round_.tokens
        self.kinds += round_.kinds
        self.texts += [self._detokenizer.add(token) for token in round_.tokens]

    def finish(self) -> None:
        if self.texts:
            self.texts[-1] += self._detokenizer.finish()
        self.done = True

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def accepted_lengths(self) -> list[int]:
        """Tokens added per round, the target's own token included."""
        return [len(round_.tokens) for round_ in self.rounds]

    @property
    def tau(self) -> float:
        return self.round_record.tau

    @property
    def hit_rate(self) -> float:
        """Rounds served from a prepared branch over the rounds that looked one up (the engine's record)."""
        rate = self.round_record.hit_rate
        return float("nan") if rate is None else rate

    @property
    def seconds(self) -> float:
        """The engine's time: prefill and every round so far (hidden drafting excluded: it ran meanwhile)."""
        return self.round_record.prefill_seconds + self.round_record.seconds

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds else float("nan")


def row_settings(drafter, target, prompt_ids: torch.LongTensor, settings: Settings):
    """The engine's `RowSettings` for `settings`, from the target's generation config as `generate` builds them
    (the drafter's own `settings_d3d.row_settings`): greedy at temperature 0, else sampling at `temperature`."""
    config = GenerationConfig.from_dict(target.generation_config.to_dict())
    sampling = {"do_sample": False} if settings.temperature == 0 else {"do_sample": True, "temperature": settings.temperature}
    config.update(max_new_tokens=settings.max_new_tokens, **sampling)
    return engine_modules(drafter).settings.row_settings(target, config, prompt_ids[0].tolist())


def check_prompt_length(target, prompt_ids: torch.LongTensor, max_new_tokens: int) -> None:
    """Raise `ValueError` when the prompt `(1, L)` leaves no room for `max_new_tokens` in the target's positions."""
    positions = getattr(target.config.get_text_config(), "max_position_embeddings", None)
    if positions is not None and prompt_ids.shape[1] + max_new_tokens > positions:
        raise ValueError(
            f"The prompt has {prompt_ids.shape[1]} tokens; with {max_new_tokens} new tokens it exceeds the "
            f"target's {positions} positions"
        )


def prepare_request(target, drafter, tokenizer, prompt: str | None, settings: Settings) -> torch.LongTensor:
    """The prompt's ids `(1, L)`; `ValueError` for an empty prompt, out-of-range settings, or a prompt that leaves
    no room for `max_new_tokens` in the target's positions."""
    check_settings(settings, drafter.config.block_size)
    prompt_ids = encode_prompt(tokenizer, prompt)
    check_prompt_length(target, prompt_ids, settings.max_new_tokens)
    return prompt_ids


def compare_live(
    target, drafter, tokenizer, prompt_ids: torch.LongTensor, settings: Settings
) -> Iterator[tuple[LiveDecode, LiveDecode | None]]:
    """The target alone, then D3D async, on the same prompt `(1, L)` and settings: one after the other, so that
    neither slows the other down. Yields `(target_alone, d3d)` as rounds arrive, `d3d` being `None` until its turn.

    Each call makes its own engines (closed at the end): concurrent calls share only the weights. At the end the
    thread that ran the last round gives back its CPU worker pool (`threads_d3d`): the next request may run on
    another of the server's threads, which an idle pool would slow. (Gradio resumes a generator on its most recently
    idle worker thread, so a request's rounds normally stay on one thread; one that ran only earlier rounds keeps
    its pool until it ends, after 10 idle seconds.)
    """
    threads = engine_modules(drafter).threads
    try:
        for alone in decode_live(target, drafter, tokenizer, prompt_ids, settings, draft=False):
            yield alone, None
        for d3d in decode_live(target, drafter, tokenizer, prompt_ids, settings):
            yield alone, d3d
    finally:
        if threads is not None:
            threads.CPUWorkerPools().release_own()


def warm_up(target, drafter, tokenizer, prompt: str) -> tuple[LiveDecode, LiveDecode]:
    """Decode `prompt` both ways (the target alone, then D3D async) at the page's defaults for two blocks, so that
    the first visitor's timings and speedup do not include one-time costs (the first pass of each shape, kernel and
    allocator set-up), which would fall on the target alone, decoded first. Returns the finished
    `(target_alone, d3d)`. D3D drafts every round here (the policy off), so the drafter's passes are warmed too."""
    settings = replace(default_settings(drafter, max_new_tokens=2 * drafter.config.block_size),
                       lookup=False, policy=False)
    alone = d3d = None
    for alone, d3d in compare_live(target, drafter, tokenizer, prepare_request(target, drafter, tokenizer, prompt,
                                                                               settings), settings):
        pass
    return alone, d3d


def decode_live(target, drafter, tokenizer, prompt_ids: torch.LongTensor, settings: Settings,
                draft: bool = True) -> Iterator[LiveDecode]:
    """Decode `prompt_ids` `(1, L)` with the drafter's `SpeculativeEngine`, one round per step: with `drafter`
    through a `SuccessorSource` (coverage, fanout; `block_size - 1` drafts a round; with `settings.lookup` prompt
    lookup beside it; with `settings.policy` the verify policy chooses each round what is verified), or the target alone
    (`draft=False`). Yields the `LiveDecode` after every round, finished (`done`) on the last yield. Closing the
    iterator stops after the current round; an error of a round reaches the consumer."""
    modules = engine_modules(drafter)
    source, chooser = None, {}
    if draft:
        source = modules.sources.SuccessorSource(drafter, settings.coverage, settings.fanout,
                                                 max_drafts=settings.block_size - 1)
        if modules.policy is not None:  # the verify policy, as every front door runs it
            lookup, policy = modules.policy.make_chooser(settings.block_size - 1 if settings.lookup else False,
                                                         settings.policy, drafter.config.block_size)
            chooser = {"lookup": lookup, "policy": policy}
        elif settings.lookup:
            source.close()
            raise ValueError("This drafter's code predates prompt lookup: save it again with this project")
    engine = modules.engine.SpeculativeEngine(target, source, max_length=prompt_ids.shape[1] + settings.max_new_tokens,
                                              **chooser)
    live = LiveDecode(tokenizer, round_record_of(engine))
    try:
        engine.add(0, prompt_ids[0].tolist(), row_settings(drafter, target, prompt_ids, settings))
        for outcomes in rounds_of(engine):
            for outcome in outcomes:
                live.extend(outcome, drafting=source is not None)
            yield live
        live.finish()
        yield live
    finally:
        engine.close()


__all__ = [
    "CACHE", "DRAFT", "LOOKUP", "TARGET", "MAX_FANOUT", "MAX_NEW_TOKENS", "MAX_TEMPERATURE", "Detokenizer", "EngineModules",
    "LiveDecode", "Round", "Settings", "check_prompt_length", "check_settings", "compare_live", "decode_live",
    "default_settings", "encode_prompt", "engine_modules", "prepare_request", "rounds_of", "row_settings",
    "token_kinds", "warm_up", "whole_number",
]
