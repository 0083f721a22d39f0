"""Batched speculative decoding with a D3D drafter: many sequences at once, each accepting its own number of tokens.

transformers' assisted generation refuses batches; this is a native loop, one round at a time for every row:

1. **draft**: one batched block-drafting pass of the drafter (`draft_pass`): per row, the tokens its cache lacks, then
   the block `[anchor, M, ..., M]`, rows right-aligned with left padding, the block rule of `masking_d3d` combined
   with the padding mask; then each row's logits processors and argmax or sampling (`propose`) give drafts and q;
2. **verify**: one batched target pass over `[last token, drafts]` per row (`verify_pass`), padding-aware;
3. **accept**: per row, its own logits processors on the target logits (each position with its own context, as
   transformers' assisted loop does), then the longest matching prefix plus the target's token (`greedy_accept`) or
   rejection sampling with residual resampling (`rejection_sample`); truncated at the row's EOS or length;
4. **update caches**: both caches are one padded batch cache each, with a validity mask `(rows, columns)`: the
   verified columns a row rejects are marked invalid and `compact` right-aligns every row's valid columns (one gather
   per layer), so ragged acceptance costs no recomputation. Finished rows leave (`select_rows`); new rows are
   prefilled alone and join between rounds (`join_rows`), never recomputing the others' prefixes.

`D3DAsyncBatchDecoder` adds asynchronous drafting: while the target verifies, a worker thread runs one packed
successor pass for every row (`successor_pass`); next round a row whose verified tokens match a prepared branch takes
its draft with no drafting pass.

Key and value tensors carry their rotary positions, so moving cache columns is exact; position ids are given per
row. The target must use full attention in every layer (sliding windows cannot be compacted this way).
"""

import threading
import time
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessorList
from transformers.cache_utils import DynamicCache

from .async_d3d import DEFAULT_COVERAGE, DEFAULT_FANOUT, check_budget
from .masking_d3d import CAUSAL_BLOCK_ID
from .modeling_d3d import propose
from .speculative_d3d import check_compatibility, synchronize


@dataclass
class RowSettings:
    """How one row is decoded: at most `max_new_tokens` new tokens, stopping after any of `eos_token_ids`; greedy or
    sampled through `logits_processor` (the target's processing, applied to the drafter's and the target's logits);
    `seed` fixes this row's random draws (drafting and acceptance), independently of the other rows."""

    max_new_tokens: int
    do_sample: bool = False
    eos_token_ids: frozenset[int] = frozenset()
    logits_processor: LogitsProcessorList = field(default_factory=LogitsProcessorList)
    seed: int | None = None

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class BatchRow:
    """One sequence of the batch: `tokens` (prompt + accepted), how many of them the drafter cache holds, and its
    random generators (one on each model's device)."""

    key: Hashable
    tokens: list[int]
    prompt_length: int
    settings: RowSettings
    draft_rng: torch.Generator
    verify_rng: torch.Generator
    drafter_cached: int = 0
    rounds: int = 0

    @property
    def new_tokens(self) -> list[int]:
        return self.tokens[self.prompt_length :]


@dataclass
class RoundOutcome:
    """What one round did to one row: the tokens it added, whether the row finished, or the error that ended it."""

    key: Hashable
    added: list[int]
    finished: bool
    error: Exception | None = None


@dataclass
class BatchStats:
    """Totals over the rounds of a decoder (bounded memory, for long-running servers): `accepted[n]` counts row
    rounds that added n tokens; `tau` is tokens added per row per round (the target's token included); `hit_rate`:
    rows served from a prepared branch over rows that had branches to look up (asynchronous drafting)."""

    rounds: int = 0
    row_rounds: int = 0
    new_tokens: int = 0
    accepted: Counter = field(default_factory=Counter)
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    lookups: int = 0
    cache_hits: int = 0

    @property
    def tau(self) -> float:
        return self.new_tokens / self.row_rounds if self.row_rounds else float("nan")

    @property
    def hit_rate(self) -> float | None:
        return self.cache_hits / self.lookups if self.lookups else None


# --- cache operations: a batch cache is a DynamicCache plus a validity mask `(rows, columns)` --------------------------


def _layer_tensors(layer) -> tuple[torch.Tensor, torch.Tensor] | None:
    return (layer.keys, layer.values) if layer.is_initialized and layer.keys.dim() == 4 else None


def _set_layer(layer, keys: torch.Tensor, values: torch.Tensor) -> None:
    layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values


def select_rows(cache: DynamicCache, valid: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Keep the rows `index` `(n,)` of `cache` in place; returns their validity mask `(n, columns)`."""
    for layer in cache.layers:
        tensors = _layer_tensors(layer)
        if tensors is not None:
            _set_layer(layer, tensors[0][index.to(tensors[0].device)], tensors[1][index.to(tensors[1].device)])
    return valid[index.to(valid.device)]


def compact(cache: DynamicCache, valid: torch.Tensor) -> torch.Tensor:
    """Right-align every row's valid columns, in order, and drop columns no row needs; returns the new mask.

    valid: `(rows, columns)` bool. The result has `max(valid.sum(1))` columns; padding stays on the left.
    """
    rows, columns = valid.shape
    counts = valid.sum(1, keepdim=True)
    width = int(counts.max()) if rows else 0
    if width == columns and torch.equal(valid, torch.arange(columns) >= columns - counts):
        return valid
    order = torch.sort(valid.to(torch.int8), dim=1, stable=True).indices[:, columns - width :]
    for layer in cache.layers:
        tensors = _layer_tensors(layer)
        if tensors is not None:
            keys, values = tensors
            index = order.to(keys.device)[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[3])
            _set_layer(layer, keys.gather(2, index), values.gather(2, index))
    return valid.gather(1, order)


def join_rows(cache: DynamicCache, valid: torch.Tensor, other: DynamicCache, other_valid: torch.Tensor) -> torch.Tensor:
    """Append the rows of `other` to `cache` (in place), left-padding the narrower to the common width; returns the
    joined validity mask `(rows + other_rows, width)`."""
    width = max(valid.shape[1], other_valid.shape[1])
    for layer, other_layer in zip(cache.layers, other.layers):
        mine, theirs = _layer_tensors(layer), _layer_tensors(other_layer)
        if mine is None and theirs is None:
            continue
        template = mine if mine is not None else theirs
        parts = []
        for tensors, rows, columns in ((mine, valid.shape[0], valid.shape[1]), (theirs, other_valid.shape[0], other_valid.shape[1])):
            if tensors is None:
                tensors = tuple(t.new_zeros(rows, t.shape[1], columns, t.shape[3]) for t in template)
            parts.append(tuple(torch.nn.functional.pad(t, (0, 0, width - columns, 0)) for t in tensors))
        _set_layer(layer, torch.cat([parts[0][0], parts[1][0]]), torch.cat([parts[0][1], parts[1][1]]))
    masks = [torch.nn.functional.pad(mask, (width - mask.shape[1], 0)) for mask in (valid, other_valid.to(valid.device))]
    return torch.cat(masks)


# --- the round: draft, verify, accept -----------------------------------------------------------------------------------


@torch.no_grad()
def draft_pass(drafter, cache: DynamicCache, valid: torch.Tensor, rows: list[BatchRow]) -> tuple[torch.Tensor, torch.Tensor]:
    """One block-drafting pass for every row; returns raw logits `(rows, B - 1, vocab)` float32 and the new validity
    mask. Per row the input is its uncached tokens before the anchor (right-aligned, left padding), then the block;
    the cache ends holding each row's `tokens[:-1]` (padding columns invalid), never the block."""
    block_size = drafter.config.block_size
    device = drafter.model.embed_tokens.weight.device
    uncached = [row.tokens[row.drafter_cached : -1] for row in rows]
    width = max(len(u) for u in uncached)
    batch, past = len(rows), valid.shape[1]
    ids = torch.full((batch, width + block_size), drafter.config.mask_token_id, dtype=torch.long)
    new_valid = torch.zeros(batch, width + block_size, dtype=torch.bool)
    new_valid[:, width:] = True
    position_ids = torch.zeros(batch, width + block_size, dtype=torch.long)
    for i, (row, tokens) in enumerate(zip(rows, uncached)):
        ids[i, width - len(tokens) : width] = torch.tensor(tokens, dtype=torch.long)
        ids[i, width] = row.tokens[-1]
        new_valid[i, width - len(tokens) : width] = True
        position_ids[i, width - len(tokens) :] = torch.arange(row.drafter_cached, len(row.tokens) - 1 + block_size)
    block_ids = torch.tensor([CAUSAL_BLOCK_ID] * width + [0] * block_size).expand(batch, -1)
    visible_prefix = torch.cat([torch.arange(past + 1, past + width + 1), torch.full((block_size,), past + width)])
    logits = drafter(
        input_ids=ids.to(device),
        attention_mask=torch.cat([valid, new_valid.to(valid.device)], dim=1).to(device),
        position_ids=position_ids.to(device),
        block_ids=block_ids.to(device),
        visible_prefix=visible_prefix.expand(batch, -1).to(device),
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=block_size - 1,
    ).logits.float()
    cache.crop(-block_size)
    for row, tokens in zip(rows, uncached):
        row.drafter_cached += len(tokens)
    return logits, torch.cat([valid, new_valid[:, :width].to(valid.device)], dim=1)


@torch.no_grad()
def verify_pass(target, cache: DynamicCache, valid: torch.Tensor, rows: list[BatchRow], drafts: torch.Tensor) -> torch.Tensor:
    """One target pass over `[last token, drafts]` per row; drafts `(rows, n)`. Returns raw logits `(rows, n + 1,
    vocab)` float32; the cache gains `n + 1` columns per row, which the caller marks valid as far as accepted."""
    device = target.get_input_embeddings().weight.device
    anchors = torch.tensor([[row.tokens[-1]] for row in rows], dtype=torch.long)
    ids = torch.cat([anchors, drafts.cpu()], dim=1)
    lengths = torch.tensor([len(row.tokens) - 1 for row in rows])
    position_ids = lengths[:, None] + torch.arange(ids.shape[1])
    attention_mask = torch.cat([valid, valid.new_ones(ids.shape)], dim=1)
    return target(
        input_ids=ids.to(device),
        attention_mask=attention_mask.to(device),
        position_ids=position_ids.to(device),
        past_key_values=cache,
        use_cache=True,
    ).logits.float()


@torch.no_grad()
def successor_pass(
    drafter,
    cache: DynamicCache,
    valid: torch.Tensor,
    contexts: list[list[int]],
    cached: list[int],
    drafts: list[torch.Tensor],
    draft_logits: list[torch.Tensor],
    coverage: int,
    fanout: int,
    sampling: list[tuple[LogitsProcessorList, bool, torch.Generator]],
) -> tuple[torch.Tensor, list[dict]]:
    """ONE packed pass preparing, for every row, the next block for each likely outcome of verifying its drafts (the
    batched form of `D3DForBlockDiffusion.draft_successors`).

    Per row: contexts[i] (its tokens, last = anchor), cached[i] of them in the cache, drafts[i] `(n,)` and their
    processed logits `(n, vocab)`; sampling[i] = (logits processors, do_sample, generator). Branches: for each of the
    first `coverage - 1` draft positions j, the `fanout` most probable drafter tokens other than draft j as anchors
    after drafts[:j]; and the full-acceptance branch anchored on the last draft (its first prediction guesses the
    target's token). Rows are right-aligned (left padding), each row's blocks padded to the largest count with copies
    of its full-acceptance block. The cache gains each row's uncached tokens and drafts (the caller invalidates the
    rejected ones). Returns the new validity mask and per row `{key: (tokens (m,), processed logits (m, vocab))}`,
    key = the tokens the verified prefix must add after contexts[i]; a row whose processing fails gets no branches.
    """
    block_size = drafter.config.block_size
    device = drafter.model.embed_tokens.weight.device
    causal = [context[start:] + d.tolist() for context, start, d in zip(contexts, cached, drafts)]
    width, past = max(len(tokens) for tokens in causal), valid.shape[1]
    plans = []  # per row: (key or None for full acceptance, anchor token, visible prefix column, anchor position)
    for context, start, tokens, row_drafts, logits in zip(contexts, cached, causal, drafts, draft_logits):
        first_draft = past + width - len(tokens) + len(context) - start
        ranked = logits.topk(min(fanout + 1, logits.shape[-1]), dim=-1).indices.tolist()
        listed = row_drafts.tolist()
        plan = []
        for j in range(min(coverage - 1, len(listed))):
            for token in [t for t in ranked[j] if t != listed[j]][:fanout]:
                plan.append((tuple(listed[:j]) + (token,), token, first_draft + j, len(context) + j))
        plan.append((None, listed[-1], first_draft + len(listed) - 1, len(context) + len(listed) - 1))
        plans.append(plan)
    blocks = max(len(plan) for plan in plans)
    rows, length = len(contexts), width + blocks * block_size
    ids = torch.full((rows, length), drafter.config.mask_token_id, dtype=torch.long)
    new_valid = torch.ones(rows, length, dtype=torch.bool)
    new_valid[:, :width] = False
    position_ids = torch.zeros(rows, length, dtype=torch.long)
    block_ids = torch.full((rows, length), CAUSAL_BLOCK_ID, dtype=torch.long)
    visible_prefix = torch.arange(past + 1, past + length + 1).repeat(rows, 1)
    offsets = torch.arange(block_size)
    for i, (tokens, start, plan) in enumerate(zip(causal, cached, plans)):
        ids[i, width - len(tokens) : width] = torch.tensor(tokens)
        new_valid[i, width - len(tokens) : width] = True
        position_ids[i, width - len(tokens) : width] = torch.arange(start, start + len(tokens))
        for k in range(blocks):
            _, anchor, column, position = plan[min(k, len(plan) - 1)]
            columns = slice(width + k * block_size, width + (k + 1) * block_size)
            ids[i, columns.start] = anchor
            position_ids[i, columns] = position + offsets
            block_ids[i, columns] = k
            visible_prefix[i, columns] = column
    logits = drafter(
        input_ids=ids.to(device),
        attention_mask=torch.cat([valid, new_valid], dim=1).to(device),
        position_ids=position_ids.to(device),
        block_ids=block_ids.to(device),
        visible_prefix=visible_prefix.to(device),
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=blocks * block_size,
    ).logits.float()
    cache.crop(-blocks * block_size)
    logits = logits.reshape(rows, blocks, block_size, -1)[:, :, 1:]
    branches = []
    for i, (context, row_drafts, plan) in enumerate(zip(contexts, drafts, plans)):
        processors, do_sample, generator = sampling[i]
        prepared = {}
        try:
            for k, (key, anchor, _, _) in enumerate(plan):
                prefix = context + (list(key) if key is not None else row_drafts.tolist())
                tokens, processed = propose(logits[i, k][None], torch.tensor([prefix], device=logits.device),
                                            processors, do_sample, generator)
                if key is None:
                    prepared[tuple(row_drafts.tolist()) + (int(tokens[0, 0]),)] = (tokens[0, 1:], processed[0, 1:])
                else:
                    prepared[key] = (tokens[0], processed[0])
        except Exception:  # this row misses next round; its own drafting then reports the error
            prepared = {}
        branches.append(prepared)
    return torch.cat([valid, new_valid[:, :width]], dim=1), branches


def process_target_logits(
    logits_processor: LogitsProcessorList, context: list[int], drafts: torch.Tensor, logits: torch.Tensor
) -> torch.Tensor:
    """The target's processors on its logits `(n + 1, vocab)` over `[last token, drafts (n,)]`: position j sees the
    context plus the first j drafts (as in transformers' assisted loop)."""
    if not logits_processor:
        return logits
    ids = torch.cat([torch.tensor(context, device=logits.device), drafts.to(logits.device)])[None]
    return torch.cat(
        [logits_processor(ids[:, : len(context) + j], logits[j : j + 1].clone()) for j in range(logits.shape[0])]
    )


def greedy_accept(drafts: torch.Tensor, target_logits: torch.Tensor) -> list[int]:
    """Longest prefix of `drafts` `(n,)` equal to the target's argmax, then the target's own token; target_logits
    `(n + 1, vocab)` processed."""
    choices = target_logits.argmax(-1)
    accepted = int((drafts.to(choices.device) == choices[:-1]).long().cumprod(0).sum())
    return drafts[:accepted].tolist() + [int(choices[accepted])]


def rejection_sample(
    drafts: torch.Tensor, draft_logits: torch.Tensor, target_logits: torch.Tensor, generator: torch.Generator | None
) -> list[int]:
    """Leviathan et al.: accept draft j with probability min(1, p/q), at the first rejection sample from
    norm(max(0, p - q)), after full acceptance sample a bonus token from p. drafts `(n,)`, draft_logits `(n, vocab)`
    (q = softmax), target_logits `(n + 1, vocab)` (p = softmax), all processed; the tokens are distributed as p."""
    device = target_logits.device
    drafts, q = drafts.to(device), draft_logits.to(device).softmax(-1)
    p = target_logits.softmax(-1)
    positions = torch.arange(drafts.shape[0], device=device)
    ratio = p[positions, drafts] / q[positions, drafts]
    draws = torch.rand(drafts.shape[0], generator=generator, device=device)
    accepted = int((draws <= ratio).long().cumprod(0).sum())
    distribution = p[accepted]
    if accepted < drafts.shape[0]:
        residual = (p[accepted] - q[accepted]).clamp(min=0)
        distribution = residual if residual.sum() > 0 else distribution
    token = torch.multinomial(distribution / distribution.sum(), 1, generator=generator)
    return drafts[:accepted].tolist() + [int(token)]


def finish(row: BatchRow, added: list[int]) -> tuple[list[int], bool]:
    """Cut `added` at the row's length limit and after its first EOS; returns the tokens kept and whether it ends."""
    added = added[: row.settings.max_new_tokens - len(row.new_tokens)]
    for index, token in enumerate(added):
        if token in row.settings.eos_token_ids:
            return added[: index + 1], True
    return added, len(row.new_tokens) + len(added) >= row.settings.max_new_tokens


class D3DBatchDecoder:
    """Synchronous batched speculative decoding: rows join (`add`), every `step` runs one round for all of them, and
    rows leave when they finish, fail or are `remove`d. Greedy rows are token-identical to the target decoding them
    alone; sampled rows follow the target's distribution. Not thread-safe: one caller drives it (see
    `serving_d3d.D3DBatchServer` for many callers)."""

    def __init__(self, target, drafter):
        check_compatibility(drafter, target)
        layer_types = getattr(target.config.get_text_config(), "layer_types", None) or []
        if any(kind != "full_attention" for kind in layer_types) or target.config.is_encoder_decoder:
            raise ValueError("Batched D3D decoding needs a decoder-only target with full attention in every layer")
        self.target, self.drafter = target, drafter
        self.rows: list[BatchRow] = []
        self.stats = BatchStats()
        self._target_cache, self._target_valid = self._empty(target)
        self._drafter_cache, self._drafter_valid = self._empty(drafter)

    @staticmethod
    def _empty(model) -> tuple[DynamicCache, torch.Tensor]:
        return DynamicCache(config=model.config), torch.zeros(0, 0, dtype=torch.bool)

    def __len__(self) -> int:
        return len(self.rows)

    @torch.no_grad()
    def add(self, key: Hashable, prompt: list[int], settings: RowSettings) -> None:
        """Prefill `prompt` (all but its last token) in both models, alone, and join the batch."""
        self.check_request(prompt, settings)
        if any(row.key == key for row in self.rows):
            raise ValueError(f"A row with key {key!r} is already in the batch")
        seed = settings.seed if settings.seed is not None else int(torch.randint(2**62, (1,)))
        start = time.perf_counter()
        target_cache, drafter_cache = self._prefill(self.target, prompt), self._prefill(self.drafter, prompt)
        ones = torch.ones(1, len(prompt) - 1, dtype=torch.bool)
        self._target_valid = join_rows(self._target_cache, self._target_valid, target_cache, ones)
        self._drafter_valid = join_rows(self._drafter_cache, self._drafter_valid, drafter_cache, ones)
        self.rows.append(BatchRow(
            key, list(prompt), len(prompt), settings,
            draft_rng=torch.Generator(device=self.drafter.device).manual_seed(2 * seed),
            verify_rng=torch.Generator(device=self.target.device).manual_seed(2 * seed + 1),
            drafter_cached=len(prompt) - 1,
        ))
        self.stats.prefill_seconds += time.perf_counter() - start

    def check_request(self, prompt: list[int], settings: RowSettings) -> None:
        """Raise `ValueError` unless `prompt` can be decoded with `settings` (not empty, within both models'
        positions and vocabulary)."""
        if not prompt:
            raise ValueError("A prompt needs at least one token")
        if not all(0 <= token < self.drafter.config.vocab_size for token in prompt):
            raise ValueError(f"Prompt token ids must lie in 0..{self.drafter.config.vocab_size - 1}")
        limits = [getattr(m.config.get_text_config(), "max_position_embeddings", None) for m in (self.target, self.drafter)]
        limit = min((limit for limit in limits if limit is not None), default=None)
        if limit is not None and len(prompt) + settings.max_new_tokens + self.drafter.config.block_size > limit:
            raise ValueError(f"prompt ({len(prompt)}) + max_new_tokens + block size exceeds max_position_embeddings {limit}")

    @staticmethod
    def _prefill(model, prompt: list[int]) -> DynamicCache:
        cache = DynamicCache(config=model.config)
        if len(prompt) > 1:
            device = model.get_input_embeddings().weight.device
            ids = torch.tensor([prompt[:-1]], device=device)
            model(input_ids=ids, position_ids=torch.arange(ids.shape[1], device=device)[None], past_key_values=cache,
                  use_cache=True, logits_to_keep=1)
        return cache

    def remove(self, keys: set[Hashable]) -> None:
        """Drop the rows whose key is in `keys` (cancelled requests) and their cache rows."""
        self._keep([i for i, row in enumerate(self.rows) if row.key not in keys])

    def _keep(self, indices: list[int]) -> None:
        if len(indices) == len(self.rows):
            return
        index = torch.tensor(indices, dtype=torch.long)
        self.rows = [self.rows[i] for i in indices]
        self._target_valid = compact(self._target_cache, select_rows(self._target_cache, self._target_valid, index))
        self._drafter_valid = compact(self._drafter_cache, select_rows(self._drafter_cache, self._drafter_valid, index))

    def reset(self) -> None:
        """Drop every row (after a failure of a batched pass, whose caches can no longer be trusted)."""
        self.rows = []
        self._target_cache, self._target_valid = self._empty(self.target)
        self._drafter_cache, self._drafter_valid = self._empty(self.drafter)

    @torch.no_grad()
    def step(self) -> list[RoundOutcome]:
        """One round for every row; finished and failed rows leave the batch. An exception of a per-row step (its
        logits processors, sampling) ends that row only, with the error in its outcome; an exception of a batched
        pass propagates (call `reset` before going on)."""
        if not self.rows:
            return []
        outcomes: list[RoundOutcome] = []
        start = time.perf_counter()
        drafts, draft_logits = self._draft(outcomes)
        synchronize(self.drafter.device)
        self.stats.draft_seconds += time.perf_counter() - start
        if not self.rows:
            return outcomes

        start = time.perf_counter()
        worker = self._start_successors(drafts, draft_logits)
        padded = torch.nn.utils.rnn.pad_sequence([d.cpu() for d in drafts], batch_first=True)
        target_logits = verify_pass(self.target, self._target_cache, self._target_valid, self.rows, padded)
        accepted = torch.zeros(len(self.rows), padded.shape[1] + 1, dtype=torch.bool)
        added_drafts, survivors = [], []
        for i, row in enumerate(self.rows):
            n = drafts[i].shape[0]
            try:
                p = process_target_logits(row.settings.logits_processor, row.tokens, drafts[i], target_logits[i, : n + 1])
                if row.settings.do_sample:
                    added = rejection_sample(drafts[i], draft_logits[i], p, row.verify_rng)
                else:
                    added = greedy_accept(drafts[i], p)
            except Exception as error:
                outcomes.append(RoundOutcome(row.key, [], True, error))
                added_drafts.append(0)
                continue
            added_drafts.append(len(added) - 1)
            added, finished = finish(row, added)
            row.tokens += added
            row.rounds += 1
            accepted[i, : len(added)] = True
            self.stats.accepted[len(added)] += 1
            self.stats.new_tokens += len(added)
            self.stats.row_rounds += 1
            outcomes.append(RoundOutcome(row.key, added, finished))
            if not finished:
                survivors.append(i)
        self.stats.rounds += 1
        self._target_valid = compact(self._target_cache, torch.cat([self._target_valid, accepted], dim=1))
        self._finish_successors(worker, drafts, added_drafts)
        self._keep(survivors)
        synchronize(self.target.device)
        self.stats.verify_seconds += time.perf_counter() - start
        return outcomes

    def _draft(self, outcomes: list[RoundOutcome]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """One drafting pass for every row, then each row's proposal; rows whose processing fails leave (with their
        error in `outcomes`). Returns per remaining row drafts `(n,)` and processed logits `(n, vocab)`."""
        raw, self._drafter_valid = draft_pass(self.drafter, self._drafter_cache, self._drafter_valid, self.rows)
        return self._propose(raw, range(len(self.rows)), outcomes)

    def _propose(
        self,
        raw: torch.Tensor | None,
        indices: range | list[int],
        outcomes: list[RoundOutcome],
        ready: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Drafts and q for the rows `indices` from raw block logits `(rows, B - 1, vocab)`; the rows in `ready` keep
        the (drafts, q) given there."""
        drafts, draft_logits, kept = [], [], []
        for i, row in enumerate(self.rows):
            if ready is not None and i in ready:
                tokens, logits = ready[i]
            elif i in indices:
                try:
                    tokens, logits = propose(raw[i : i + 1], torch.tensor([row.tokens], device=raw.device),
                                             row.settings.logits_processor, row.settings.do_sample, row.draft_rng)
                except Exception as error:  # this row's processing failed: it leaves, the others go on
                    outcomes.append(RoundOutcome(row.key, [], True, error))
                    continue
                tokens, logits = tokens[0], logits[0]
            drafts.append(tokens)
            draft_logits.append(logits)
            kept.append(i)
        self._keep(kept)
        return drafts, draft_logits

    def _start_successors(self, drafts: list[torch.Tensor], draft_logits: list[torch.Tensor]):
        """Synchronous drafting prepares nothing while the target verifies (see `D3DAsyncBatchDecoder`)."""
        return None

    def _finish_successors(self, worker, drafts: list[torch.Tensor], accepted_drafts: list[int]) -> None:
        """Nothing to wait for: the drafter cache already holds each row's tokens before its anchor."""


class D3DAsyncBatchDecoder(D3DBatchDecoder):
    """Batched D3D with asynchronous drafting: while the target verifies a round, a worker thread runs ONE packed
    successor pass for every row (`successor_pass`, budget `B((C - 1)F + 2)` tokens per row). Next round each row
    looks its verified tokens up among its branches: when every row hits, no drafting pass runs; otherwise one
    batched drafting pass runs over all rows and the rows that missed take its drafts (on an accelerator a pass for a
    few rows costs about as long as one for all). coverage `C` (default min(12, B)) and fanout `F` (default 2) as in `D3DAssistedGenerator`."""

    def __init__(self, target, drafter, coverage: int | None = None, fanout: int = DEFAULT_FANOUT):
        super().__init__(target, drafter)
        block_size = drafter.config.block_size
        self.coverage = min(DEFAULT_COVERAGE, block_size) if coverage is None else coverage
        self.fanout = fanout
        check_budget(block_size, self.coverage, fanout)
        self._branches: dict[Hashable, tuple[int, dict]] = {}
        self._worker: threading.Thread | None = None

    def add(self, key: Hashable, prompt: list[int], settings: RowSettings) -> None:
        self._branches.pop(key, None)  # branches of an earlier row with this key
        super().add(key, prompt, settings)

    def reset(self) -> None:
        if self._worker is not None:  # a round that failed while the worker ran: let it end before going on
            self._worker.join()
        super().reset()
        self._branches = {}

    def _draft(self, outcomes: list[RoundOutcome]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        ready = {}
        for i, row in enumerate(self.rows):
            prepared = self._branches.get(row.key)
            if prepared is None:  # joined since the last round
                continue
            base, branches = prepared
            self.stats.lookups += 1
            branch = branches.get(tuple(row.tokens[base:]))
            if branch is not None and branch[0].shape[0] > 0:
                ready[i] = branch
                self.stats.cache_hits += 1
        self._branches = {}
        missing = [i for i in range(len(self.rows)) if i not in ready]
        raw = None
        if missing:
            raw, self._drafter_valid = draft_pass(self.drafter, self._drafter_cache, self._drafter_valid, self.rows)
        return self._propose(raw, missing, outcomes, ready)

    def _start_successors(self, drafts: list[torch.Tensor], draft_logits: list[torch.Tensor]):
        """Start the successor pass on a worker thread, on snapshots of the rows (the verifier changes them)."""
        contexts = [list(row.tokens) for row in self.rows]
        arguments = (
            self.drafter, self._drafter_cache, self._drafter_valid, contexts, [row.drafter_cached for row in self.rows],
            drafts, draft_logits, self.coverage, self.fanout,
            [(row.settings.logits_processor, row.settings.do_sample, row.draft_rng) for row in self.rows],
        )
        result: dict = {}

        def work() -> None:
            try:
                result["value"] = successor_pass(*arguments)
                synchronize(self.drafter.device)
            except Exception as error:  # raised on the scheduler's thread by _finish_successors
                result["error"] = error

        self._worker = threading.Thread(target=work, name="d3d-batch-drafter", daemon=True)
        self._worker.start()
        return self._worker, result, contexts

    def _finish_successors(self, worker, drafts: list[torch.Tensor], accepted_drafts: list[int]) -> None:
        """Wait for the successor pass; drop each row's rejected drafts from the drafter cache; keep the branches."""
        thread, result, contexts = worker
        thread.join()
        if "error" in result:
            raise result["error"]
        valid, branches = result["value"]
        for i, row in enumerate(self.rows):
            rejected = drafts[i].shape[0] - accepted_drafts[i]
            if rejected:
                valid[i, valid.shape[1] - rejected :] = False
            row.drafter_cached = len(contexts[i]) + accepted_drafts[i]
            self._branches[row.key] = (len(contexts[i]), branches[i])
        self._drafter_valid = compact(self._drafter_cache, valid)


# generate settings whose processors depend on the prompt's length or are built per padded batch.
LENGTH_DEPENDENT_SETTINGS = ("min_length", "min_new_tokens", "forced_eos_token_id", "begin_suppress_tokens",
                             "exponential_decay_length_penalty")


def check_length_dependent_settings(generation_config, batch_size: int, padded: bool) -> None:
    """Raise `ValueError` for settings `generate` builds processors for that a padded batch would get wrong: it builds
    them for the padded width (or, for `repetition_penalty`, per padded row), while each row is processed on its own
    tokens. `D3DBatchServer` builds them per request and takes them all."""
    used = [name for name in LENGTH_DEPENDENT_SETTINGS if getattr(generation_config, name, None)]
    if padded and used:
        raise ValueError(f"{', '.join(used)} depend(s) on the prompt length, which left padding changes: decode these "
                         "prompts with D3DBatchServer (processors built per request) or one at a time")
    if batch_size > 1 and generation_config.repetition_penalty not in (None, 1.0):
        raise ValueError("repetition_penalty is built per padded row by generate; for batches use D3DBatchServer "
                         "(processors built per request)")


def batched_speculative_generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria,
    generation_config,
    synced_gpus: bool = False,
    streamer=None,
    drafter=None,
    asynchronous: bool = False,
    coverage: int | None = None,
    fanout: int = DEFAULT_FANOUT,
    **model_kwargs,
) -> torch.LongTensor:
    """`target.generate(input_ids, attention_mask=..., custom_generate=batched_speculative_generate, drafter=drafter)`.

    input_ids: `(batch, P)` left-padded prompts with their `attention_mask`. Each row is decoded as if alone (same
    `max_new_tokens`, its own EOS), with generate's logits processors and `do_sample`; rows that finish leave the
    batch. `asynchronous=True` prepares successor blocks on a worker thread while the target verifies
    (`D3DAsyncBatchDecoder`, with `coverage` and `fanout`). Returns `(batch, P + longest)` sequences, finished rows
    padded with `pad_token_id` after their EOS (as `generate` pads). The decoder's statistics go to `drafter.batch_stats`. Stopping criteria other than EOS and
    length are not applied; streamers are not supported (use `D3DBatchServer` to receive tokens as they come).
    """
    if drafter is None:
        raise ValueError("batched_speculative_generate needs drafter=<a D3DForBlockDiffusion>")
    if streamer is not None:
        raise ValueError("Streamers take one sequence; use serving_d3d.D3DBatchServer to stream many requests")
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    check_length_dependent_settings(generation_config, input_ids.shape[0], bool((attention_mask == 0).any()))
    eos = generation_config.eos_token_id
    eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
    max_new_tokens = generation_config.max_length - input_ids.shape[1]
    decoder = D3DAsyncBatchDecoder(model, drafter, coverage, fanout) if asynchronous else D3DBatchDecoder(model, drafter)
    for index in range(input_ids.shape[0]):
        prompt = input_ids[index][attention_mask[index].bool()].tolist()
        decoder.add(index, prompt, RowSettings(max_new_tokens, bool(generation_config.do_sample), eos_ids, logits_processor))
    generated: dict[int, list[int]] = {index: [] for index in range(input_ids.shape[0])}
    while len(decoder):
        for outcome in decoder.step():
            if outcome.error is not None:
                raise outcome.error
            generated[outcome.key] += outcome.added
    drafter.batch_stats = decoder.stats
    pad = generation_config.pad_token_id if generation_config.pad_token_id is not None else next(iter(eos_ids), 0)
    longest = max(len(tokens) for tokens in generated.values())
    tail = torch.full((input_ids.shape[0], longest), pad, dtype=input_ids.dtype)
    for index, tokens in generated.items():
        tail[index, : len(tokens)] = torch.tensor(tokens, dtype=input_ids.dtype)
    return torch.cat([input_ids, tail.to(input_ids.device)], dim=1)


__all__ = [
    "BatchRow", "BatchStats", "D3DAsyncBatchDecoder", "D3DBatchDecoder", "RoundOutcome", "RowSettings",
    "batched_speculative_generate", "check_length_dependent_settings", "compact", "draft_pass", "finish", "greedy_accept", "join_rows", "process_target_logits", "rejection_sample",
    "select_rows", "successor_pass", "verify_pass",
]
