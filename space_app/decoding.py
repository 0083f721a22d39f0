"""What the Space shows, without Gradio: decode live through a streamer, tell how each token came, keep statistics.

transformers' `generate` puts the prompt into its streamer once, then each round's new tokens: one token a round for
the target alone; for assisted generation the accepted drafts followed by the target's own token. The drafter records
each round's draft (`DraftRound`: what it proposed, whether a prepared branch served it) before the target verifies
it, so when the round's tokens arrive the draft they were checked against is already known.

Only what a Hub user has is used here: the target, the loaded drafter (through `drafter.async_generator`) and the
tokenizer; nothing is imported from the rest of this project, so the folder runs as a Space on its own.
"""

import copy
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

DRAFT, CACHE, TARGET = "draft", "cache", "target"
MAX_NEW_TOKENS = 512
MAX_FANOUT = 8
MAX_TEMPERATURE = 2.0


@dataclass(frozen=True)
class Settings:
    """One request's settings. block_size `b`: the drafter proposes `b - 1` tokens a round (`2 <= b <= B`, the
    drafter's trained block size); coverage `C` and fanout `F`: the asynchronous budget; temperature 0 is greedy."""

    block_size: int
    coverage: int
    fanout: int
    temperature: float
    max_new_tokens: int


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


def token_kinds(added: list[int], drafted: list[int], from_cache: bool) -> list[str]:
    """How each token of one round came: the accepted drafts (the longest run of `added[:-1]` equal to `drafted`),
    `CACHE` when a prepared branch served the round else `DRAFT`, then the target's own token(s), `TARGET`."""
    accepted = 0
    for token, draft in zip(added[:-1], drafted):
        if token != draft:
            break
        accepted += 1
    return [CACHE if from_cache else DRAFT] * accepted + [TARGET] * (len(added) - accepted)


@dataclass
class Round:
    """One verification round as it reached the streamer: its tokens, their kinds, where its draft came from, and
    when it arrived (seconds since `generate` started)."""

    tokens: list[int]
    kinds: list[str]
    drafted: bool
    looked_up: bool
    from_cache: bool
    seconds: float

    @property
    def served(self) -> str:
        """`cache hit`, `drafting pass`, or `no draft` (the target alone, or a last round left one token)."""
        return "cache hit" if self.from_cache else "drafting pass" if self.drafted else "no draft"


class RoundStreamer(BaseStreamer):
    """Receives `generate`'s puts on the generating thread and queues one `Round` per verification round.

    assistant: the `D3DAssistedGenerator` of the call (`None` for the target alone); its statistics give the draft a
    round was verified against. The consumer reads `rounds()` on another thread.
    """

    def __init__(self, assistant=None):
        self.assistant = assistant
        self.queue: queue.Queue = queue.Queue()
        self.prefix_length: int | None = None
        self.start = time.perf_counter()

    def put(self, value: torch.Tensor) -> None:
        tokens = value.reshape(-1).tolist()
        if self.prefix_length is None:
            self.prefix_length = len(tokens)
            return
        stats = getattr(self.assistant, "generation_stats", None)
        drafted = stats.rounds_drafted[-1] if stats is not None and stats.rounds_drafted else None
        if drafted is None or drafted.prefix_length != self.prefix_length:  # the target alone, or an undrafted round
            round_ = Round(tokens, [TARGET] * len(tokens), False, False, False, time.perf_counter() - self.start)
        else:
            kinds = token_kinds(tokens, drafted.drafted, drafted.from_cache)
            round_ = Round(tokens, kinds, True, drafted.looked_up, drafted.from_cache, time.perf_counter() - self.start)
        self.prefix_length += len(tokens)
        self.queue.put(round_)

    def end(self) -> None:
        self.queue.put(None)

    def fail(self, error: BaseException) -> None:
        self.queue.put(error)

    def rounds(self) -> Iterator[list[Round]]:
        """Batches of rounds as they come (at least one each; all that queued up meanwhile), until `end`."""
        while True:
            batch = [self.queue.get()]
            while not self.queue.empty():
                batch.append(self.queue.get())
            done = batch[-1] is None or isinstance(batch[-1], BaseException)
            rounds = [item for item in batch if isinstance(item, Round)]
            if rounds:
                yield rounds
            if isinstance(batch[-1], BaseException):
                raise batch[-1]
            if done:
                return


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
    """One column of the Space: the tokens so far (with kinds and texts) and its statistics."""

    tokenizer: object
    tokens: list[int] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    rounds: list[Round] = field(default_factory=list)
    done: bool = False

    def __post_init__(self):
        self._detokenizer = Detokenizer(self.tokenizer)

    def extend(self, rounds: list[Round]) -> None:
        for round_ in rounds:
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
        return len(self.tokens) / len(self.rounds) if self.rounds else float("nan")

    @property
    def hit_rate(self) -> float:
        """Rounds served from a prepared branch over the rounds that looked one up."""
        lookups = sum(round_.looked_up for round_ in self.rounds)
        return sum(round_.from_cache for round_ in self.rounds) / lookups if lookups else float("nan")

    @property
    def seconds(self) -> float:
        """From the start of `generate` to the latest round."""
        return self.rounds[-1].seconds if self.rounds else 0.0

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds else float("nan")


class StopOnEvent(StoppingCriteria):
    """Stops `generate` at the end of the current round once `event` is set (the user went away)."""

    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class DraftLength:
    """A D3D generator seen by the assisted loop as asking for `drafts` tokens a round instead of `B - 1`.

    transformers reads the draft length from the assistant's generation config; this gives one request its own copy
    and passes everything else to `generator`.
    """

    def __init__(self, generator, drafts: int):
        self.generator = generator
        self.generation_config = copy.deepcopy(generator.generation_config)
        self.generation_config.num_assistant_tokens = drafts

    def __getattr__(self, name: str):
        return getattr(self.generator, name)


def generate_kwargs(settings: Settings) -> dict:
    """The sampling arguments of `generate` for `settings` (greedy at temperature 0)."""
    if settings.temperature == 0:
        return {"do_sample": False, "max_new_tokens": settings.max_new_tokens}
    return {"do_sample": True, "temperature": settings.temperature, "max_new_tokens": settings.max_new_tokens}


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

    Each call makes its own asynchronous generator (closed at the end): concurrent calls share only the weights.
    """
    for alone in decode_live(target, tokenizer, prompt_ids, settings):
        yield alone, None
    with drafter.async_generator(coverage=settings.coverage, fanout=settings.fanout) as generator:
        assistant = DraftLength(generator, settings.block_size - 1)
        for d3d in decode_live(target, tokenizer, prompt_ids, settings, assistant):
            yield alone, d3d


def decode_live(target, tokenizer, prompt_ids: torch.LongTensor, settings: Settings, assistant=None) -> Iterator[LiveDecode]:
    """Decode `prompt_ids` `(1, L)` with `target.generate` on a thread (assisted by `assistant` when given); yield the
    `LiveDecode` each time rounds arrive, finished (`done`) on the last yield. Closing the iterator stops `generate`
    after its current round."""
    live = LiveDecode(tokenizer)
    streamer = RoundStreamer(assistant)
    stop = threading.Event()

    def work() -> None:
        try:
            target.generate(
                prompt_ids.to(target.device), streamer=streamer, assistant_model=assistant,
                stopping_criteria=StoppingCriteriaList([StopOnEvent(stop)]), **generate_kwargs(settings),
            )
        except BaseException as error:  # handed to the consumer, which raises it
            streamer.fail(error)

    thread = threading.Thread(target=work, name="d3d-space-generate", daemon=True)
    thread.start()
    try:
        for rounds in streamer.rounds():
            live.extend(rounds)
            yield live
        live.finish()
        yield live
    finally:
        stop.set()
        thread.join()


__all__ = [
    "CACHE", "DRAFT", "TARGET", "MAX_FANOUT", "MAX_NEW_TOKENS", "MAX_TEMPERATURE", "Detokenizer", "DraftLength",
    "LiveDecode", "Round", "RoundStreamer", "Settings", "StopOnEvent", "check_prompt_length", "check_settings",
    "compare_live", "decode_live", "encode_prompt", "generate_kwargs", "prepare_request", "token_kinds", "whole_number",
]
