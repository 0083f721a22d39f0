"""The drafter side of lossless speculative decoding through `target.generate(..., assistant_model=drafter)`.

transformers' assisted-generation loop owns verification (greedy matching or Leviathan et al. rejection sampling
with residual resampling) and calls `assistant_model.generate` once per round. A D3D drafter answers that call with
one block-drafting pass, returning the `B - 1` proposals, the processed logits whose softmax is the proposal
distribution q, and its own cache (which holds accepted tokens only).
"""

import time
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig, LogitsProcessorList
from transformers.generation.utils import GenerateDecoderOnlyOutput


def assisted_generation_config(block_size: int) -> GenerationConfig:
    """What the assisted loop reads from the drafter: B-1 drafts a round, constant schedule, no confidence stop."""
    return GenerationConfig(
        num_assistant_tokens=block_size - 1,
        num_assistant_tokens_schedule="constant",
        assistant_confidence_threshold=0.0,
    )


@dataclass
class DraftRound:
    """One verification round: the prefix it started from, what the drafter proposed, and the tokens it added."""

    prefix_length: int
    drafted: list[int]
    draft_seconds: float
    added: list[int] | None = None
    verify_seconds: float | None = None
    looked_up: bool = False
    from_cache: bool = False
    hidden_seconds: float = 0.0


@dataclass
class SpeculativeStats:
    """What one speculative `generate` call did, as recorded by the drafter.

    The drafter sees a round's outcome when the next round starts; `settle(output)` closes the last one (and
    counts a final round in which the target added its token without a draft, as the assisted loop does when a
    single token remains). Until then the figures cover the rounds already decided.
    """

    prompt: list[int]
    budget_tokens: int | None = None
    rounds_drafted: list[DraftRound] = field(default_factory=list)
    undrafted_rounds: int = 0
    settled: bool = False
    _last_draft_end: float = field(default=0.0, repr=False)

    def start_round(self, input_ids: torch.Tensor) -> None:
        """Record the outcome of the previous round from the verified prefix `(1, L)` that starts this one."""
        if self.rounds_drafted:
            previous = self.rounds_drafted[-1]
            previous.added = input_ids[0, previous.prefix_length :].tolist()
            previous.verify_seconds = time.perf_counter() - self._last_draft_end

    def record_draft(self, prefix_length: int, drafted: torch.Tensor, seconds: float, **asynchronous) -> None:
        """Record a round's draft; `seconds` is the drafting time the target waited for. `asynchronous`: the
        `DraftRound` fields `looked_up`, `from_cache` and `hidden_seconds` of the asynchronous generator."""
        self.rounds_drafted.append(DraftRound(prefix_length, drafted.reshape(-1).tolist(), seconds, **asynchronous))
        self._last_draft_end = time.perf_counter()

    def settle(self, sequences: torch.Tensor) -> "SpeculativeStats":
        """Close the last round from the output `(1, length)` of the `generate` call; returns `self`."""
        if self.settled:
            return self
        output = sequences.reshape(-1).tolist()
        if output[: len(self.prompt)] != self.prompt:
            raise ValueError("These statistics belong to another generate call: the output does not start with its prompt")
        if self.rounds_drafted:
            last = self.rounds_drafted[-1]
            tail = output[last.prefix_length :]
            matched = next((i for i, (a, b) in enumerate(zip(last.drafted, tail)) if a != b), min(len(last.drafted), len(tail)))
            last.added = tail[: min(matched + 1, len(tail))]
            last.verify_seconds = time.perf_counter() - self._last_draft_end
            self.undrafted_rounds = len(tail) - len(last.added)
        else:
            self.undrafted_rounds = len(output) - len(self.prompt)
        self.settled = True
        return self

    @property
    def accepted_lengths(self) -> list[int]:
        """Tokens added per decided round, the target's own token included (each in `1..B`)."""
        decided = [len(r.added) for r in self.rounds_drafted if r.added is not None]
        return decided + [1] * self.undrafted_rounds

    @property
    def rounds(self) -> int:
        return len(self.accepted_lengths)

    @property
    def new_tokens(self) -> int:
        return sum(self.accepted_lengths)

    @property
    def tau(self) -> float:
        """Mean acceptance length: tokens added per verification round, including the target's token."""
        return self.new_tokens / self.rounds if self.rounds else float("nan")

    def histogram(self, block_size: int) -> list[int]:
        """`counts[n - 1]` = rounds that added `n` tokens, `n = 1..block_size`."""
        counts = [0] * block_size
        for length in self.accepted_lengths:
            counts[length - 1] += 1
        return counts

    @property
    def draft_seconds(self) -> float:
        """Drafting time the target waited for (exposed)."""
        return sum(r.draft_seconds for r in self.rounds_drafted)

    @property
    def hidden_draft_seconds(self) -> float:
        """Drafting time that ran while the target verified (asynchronous generator only)."""
        return sum(r.hidden_seconds for r in self.rounds_drafted)

    @property
    def cache_hits(self) -> int:
        """Rounds served from a prepared branch, with no drafting pass."""
        return sum(r.from_cache for r in self.rounds_drafted)

    @property
    def hit_rate(self) -> float:
        """Cache hits over the rounds that had prepared branches to look up."""
        lookups = sum(r.looked_up for r in self.rounds_drafted)
        return self.cache_hits / lookups if lookups else float("nan")

    @property
    def verify_seconds(self) -> float:
        """Time from each draft's return to the round's end: the target's verification and the loop around it."""
        return sum(r.verify_seconds for r in self.rounds_drafted if r.verify_seconds is not None)


class AssistantSession:
    """One `generate` call of a stand-in for the drafter (`AssistantFacade`): its statistics, and what transformers'
    assisted loop holds in the assistant's `past_key_values` slot. It reports no cached tokens, so transformers never
    crops it; the stand-in keeps the real drafter cache itself, following the verified sequence by token ids."""

    def __init__(self, prompt: torch.Tensor, budget_tokens: int | None = None):
        self.stats = SpeculativeStats(prompt=prompt[0].tolist(), budget_tokens=budget_tokens)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def crop(self, max_length: int) -> None:
        return None


class AssistantFacade:
    """What transformers' assisted loop reads from an assistant model, for objects that stand in for a D3D drafter
    (`self.drafter`) and keep the current `AssistantSession` in `self._session`."""

    drafter = None
    _session: AssistantSession | None = None

    @property
    def config(self):
        return self.drafter.config

    @property
    def generation_config(self):
        return self.drafter.generation_config

    @property
    def device(self) -> torch.device:
        return self.drafter.device

    def _supports_logits_to_keep(self) -> bool:
        return False

    @property
    def generation_stats(self) -> SpeculativeStats | None:
        """Statistics of the latest `generate` call, in the target's coordinates (`.settle(output)` closes its last
        round)."""
        return self._session.stats if self._session is not None else None


def synchronize(device: torch.device) -> None:
    """Wait for queued work on `device` (CUDA runs asynchronously), so wall-clock timings are real."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def crop_to_common_prefix(cache, cached_ids: list[int], prefix: list[int]) -> None:
    """Crop a drafter `cache` holding the tokens `cached_ids` (updated in place) to their longest common prefix with
    `prefix`: the one way a drafter cache kept outside transformers' loop follows the verified sequence."""
    common = 0
    for cached, wanted in zip(cached_ids, prefix):
        if cached != wanted:
            break
        common += 1
    if common < len(cached_ids):
        cache.crop(common - len(cached_ids))
        del cached_ids[common:]


def propose_for_assisted_generation(drafter, input_ids: torch.LongTensor, generation_config, logits_processor, **kwargs):
    """Answer one `assistant_model.generate` call of transformers' assisted loop with one block-drafting pass.

    input_ids: `(1, L)` the verified prefix; its last token (the target's newest) is the anchor.
    Returns a `GenerateDecoderOnlyOutput` with `sequences` `(1, L + n)`, `scores` (n tensors `(1, vocab)`, processed
    logits, q = softmax) and `past_key_values` (the drafter cache, extended by accepted tokens only).
    """
    past_key_values = kwargs.get("past_key_values")
    if past_key_values is None:
        drafter.generation_stats = SpeculativeStats(prompt=input_ids[0].tolist())
    return draft_round(
        drafter, input_ids, input_ids, past_key_values, drafter.generation_stats, generation_config.do_sample,
        logits_processor, kwargs.get("max_new_tokens"),
    )


def draft_round(
    drafter,
    input_ids: torch.LongTensor,
    drafter_ids: torch.LongTensor,
    past_key_values,
    stats: SpeculativeStats,
    do_sample: bool,
    logits_processor=None,
    max_new_tokens: int | None = None,
) -> GenerateDecoderOnlyOutput:
    """One synchronous round: draft a block from `drafter_ids` and answer the target's loop about `input_ids`.

    input_ids: `(1, L)` the verified prefix as the target holds it (statistics and the returned `sequences` use it);
    drafter_ids: `(1, L')` the same prefix as the drafter reads it, ending with the same anchor: `input_ids` itself
    for plain D3D, the full prompt followed by the same generated tokens under selective prefill. The logits
    processors see `drafter_ids`. past_key_values: the drafter cache, holding a prefix of `drafter_ids[:, :-1]`.
    Returns `sequences` `(1, L + n)`, `scores` (n tensors `(1, vocab)`, q = softmax) and the drafter cache.
    """
    stats.start_round(input_ids)
    device = drafter.model.embed_tokens.weight.device
    start = time.perf_counter()
    draft = drafter.draft_block(
        drafter_ids,
        past_key_values=past_key_values,
        logits_processor=LogitsProcessorList(logits_processor or []),
        do_sample=do_sample,
    )
    synchronize(device)
    keep = min(draft.tokens.shape[1], max_new_tokens or draft.tokens.shape[1])
    stats.record_draft(input_ids.shape[1], draft.tokens[:, :keep], time.perf_counter() - start)
    return GenerateDecoderOnlyOutput(
        sequences=torch.cat([input_ids.to(device), draft.tokens[:, :keep]], dim=1),
        scores=tuple(draft.logits[:, j] for j in range(keep)),
        past_key_values=draft.past_key_values,
    )


def check_compatibility(drafter, target, target_tokenizer=None, drafter_tokenizer=None) -> None:
    """Raise `ValueError` unless `drafter` can draft for `target`: same vocabulary size, a mask token, and (when
    tokenizers are given) the same tokenizer vocabulary with the mask token not among the target's special tokens."""
    drafter_vocab = drafter.config.vocab_size
    target_vocab = target.config.get_text_config().vocab_size
    if drafter_vocab != target_vocab:
        raise ValueError(
            f"Drafter vocabulary size {drafter_vocab} differs from the target's {target_vocab}: a D3D drafter must use "
            "the target's tokenizer and embedding size (initialise it with D3DForBlockDiffusion.from_backbone)"
        )
    if drafter.config.mask_token_id is None:
        raise ValueError("The drafter has no mask_token_id; it cannot draft blocks")
    if target_tokenizer is not None and drafter_tokenizer is not None:
        if target_tokenizer.get_vocab() != drafter_tokenizer.get_vocab():
            raise ValueError("The drafter's tokenizer differs from the target's; a D3D drafter must share it")
    if target_tokenizer is not None:
        drafter.config.check_mask_token(target_tokenizer)


__all__ = ["AssistantFacade", "AssistantSession", "DraftRound", "SpeculativeStats", "synchronize", "check_compatibility", "assisted_generation_config", "propose_for_assisted_generation", "draft_round", "crop_to_common_prefix"]
