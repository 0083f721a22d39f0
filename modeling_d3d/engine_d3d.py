"""The one decoding loop: batch-first speculative decoding over static caches.

`SpeculativeEngine.step()` runs one round for every row (`rounds()` steps until every row has left):

    source.propose(rows) -> verify (one target pass) -> accept (on the device) -> stop -> source.observe -> advance

Rows live in cache slots `0..rows-1` of a preallocated `StaticKVCache` per model; a round writes the target's
`[anchor, drafts]` at each row's own columns and commits what it accepts by moving the row's length (nothing is
cropped, concatenated or gathered). When rows leave, the rows after them move up in order to fill slots
`0..rows-1` (one row copy per moved row, `StaticKVCache.move_row`). A row that joins is prefilled whole, and the
logits of its last prompt token decide its first token, as `generate`'s prefill does (`add_rows`; the next `step`
reports those tokens before any pass). A row's committed length lives in its cache
(`StaticKVCache.committed[slot]`, the target's and the drafter's each, changed only by `StaticKVCache.commit`). Without a
source the engine decodes the target alone, one token per round, through the same loop. Every round is written to
one `RoundRecord`, which the benchmark, the Space, the model card and the server read.
"""

import time
from collections import Counter, deque
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList
from transformers.generation.stopping_criteria import (EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria,
                                                       StopStringCriteria)

from .acceptance_d3d import (RowProcessors, RowSampling, block_verify, ends_row_only, greedy_accept, process,
                             rejection_sample)
from .caches_d3d import StaticKVCache
from .lookup_d3d import LookupSource
from .masking_d3d import ENGINE_ATTENTION
from .network_d3d import check_vocabulary
from .passes_d3d import CompiledPasses, PassLayout, compiled_passes, prefill, run_pass
from .policy_d3d import (BLOCK, BOTH, LOOKUP, NOTHING, RoundPlan, VerifyPolicy, apply_plan, check_policy_width,
                         tree_width)
from .sources_d3d import DrafterSource, DraftTiming, Proposal
from .streams_d3d import Clock, seconds, synchronize


# stopping criteria that read the token ids only (never the scores): the engine evaluates them on host ids
HOST_CRITERIA = (StopStringCriteria, MaxTimeCriteria)
VERIFICATIONS = {"block": block_verify, "token": rejection_sample}  # how sampled rows judge drafts (see the engine)


@dataclass
class RowSettings:
    """How one row is decoded: at most `max_new_tokens`, stopping after any of `eos_token_ids` or when a
    `stopping_criteria` entry fires (checked after every token, as `generate` does, so speculative rounds stop
    exactly where the target alone stops); greedy or sampled through `logits_processor` (the target's processing,
    applied to the drafter's and the target's logits); `seed` fixes this row's random draws."""

    max_new_tokens: int
    do_sample: bool = False
    eos_token_ids: frozenset[int] = frozenset()
    logits_processor: LogitsProcessorList = field(default_factory=LogitsProcessorList)
    stopping_criteria: StoppingCriteriaList = field(default_factory=StoppingCriteriaList)
    seed: int | None = None

    def __post_init__(self):
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        self.logits_processor = RowProcessors(self.logits_processor)  # called every round: signatures read once
        # EOS and the length limit are the engine's own; the rest are checked token by token.
        self.stopping_criteria = StoppingCriteriaList(
            c for c in self.stopping_criteria if not isinstance(c, (EosTokenCriteria, MaxLengthCriteria))
        )


@dataclass
class Row:
    """One sequence: the target's prompt, the drafter's (the same, or the full prompt under selective prefill), the
    tokens generated so far, and its generators. Its target cache slot has committed every token before the anchor
    (`len(tokens) - 1`: the engine's `cache.committed[slot]`)."""

    key: Hashable
    prompt: list[int]
    drafter_prompt: list[int]
    settings: RowSettings
    sampling: RowSampling
    verify_rng: torch.Generator
    generated: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def last_token(self) -> int:
        """The anchor of the next round: the newest token."""
        return self.generated[-1] if self.generated else self.prompt[-1]

    @property
    def drafter_context(self) -> list[int]:
        return self.drafter_prompt + self.generated


@dataclass
class RoundOutcome:
    """What one round did to one row: the tokens it added, how many of them were accepted drafts (the rest is the
    target's own token), whether they came from a prepared branch, whether the row finished, or the error that ended
    it; verified: what the row verified (`policy_d3d`: nothing, the drafter's block, a lookup, or both); long: its
    lookup was verified whole, past a block's drafts (`RoundPlan.long`); short: only its lookup's first drafts were,
    in a pass narrower than a block (`VerifyPolicy.short_width`); branch: of both, the one whose drafts it
    kept (`BLOCK` or `LOOKUP`), and what each matched (`branches`)."""

    key: Hashable
    added: list[int]
    finished: bool
    accepted_drafts: int = 0
    from_branch: bool = False
    error: BaseException | None = None
    verified: str = BLOCK
    long: bool = False
    short: bool = False
    branch: str | None = None
    branches: tuple[int, int] | None = None


@dataclass
class RoundTiming:
    """Seconds of one round: verify (the target pass), exposed drafting (the target waited for it), hidden drafting
    (ran while the target verified), host (everything else in the round). verify + exposed + host = the round.
    On CUDA verify and the exposed drafting before it are device time between events on the target's stream
    (`streams_d3d.Clock`, read after the round's one read: no synchronization added); elsewhere the host clock."""

    verify: float
    exposed_draft: float
    hidden_draft: float
    host: float

    @property
    def total(self) -> float:
        return self.verify + self.exposed_draft + self.host


@dataclass
class RoundRecord:
    """The only round record: totals over every round of an engine, and the latest rounds (bounded, for servers).

    rounds: engine rounds (the first tokens of rows that joined together, decided by their prefill, are a round
    of their own, with no pass and no time: the prefill's is in `prefill_seconds`); row_rounds: rounds summed over
    rows; new_tokens; accepted[n]: row rounds that added n
    tokens; verified[kind]: row rounds that verified nothing, the drafter's block, a lookup or both (`policy_d3d`);
    long_lookups: of the lookups, those verified whole past a block's drafts (`RoundPlan.long`, a pass of a tree's
    width); short_lookups: of the lookups, those of which only the first drafts were verified (a short round);
    lookups / branch_hits: rows that searched prepared branches / were served by one; seconds: verify,
    exposed and hidden drafting, host, and prefill; compilations: graphs PyTorch compiled during the rounds (the
    delta of `torch._dynamo.utils.counters["stats"]["unique_graphs"]`, process-wide: another thread's compiles
    in the same rounds count too; 0 after the warm-up of compiled passes, see docs/architecture.md)."""

    keep: int = 100_000
    rounds: int = 0
    row_rounds: int = 0
    new_tokens: int = 0
    accepted: Counter = field(default_factory=Counter)
    verified: Counter = field(default_factory=Counter)
    long_lookups: int = 0
    short_lookups: int = 0
    lookups: int = 0
    branch_hits: int = 0
    verify_seconds: float = 0.0
    exposed_draft_seconds: float = 0.0
    hidden_draft_seconds: float = 0.0
    host_seconds: float = 0.0
    prefill_seconds: float = 0.0
    compilations: int = 0
    history: deque = field(default_factory=deque)

    def __post_init__(self):
        self.history = deque(self.history, maxlen=self.keep)

    def add(self, outcomes: list[RoundOutcome], looked_up: int, timing: RoundTiming) -> None:
        self.rounds += 1
        for outcome in outcomes:
            if outcome.error is None:
                self.row_rounds += 1
                self.new_tokens += len(outcome.added)
                self.accepted[len(outcome.added)] += 1
                self.verified[outcome.verified] += 1
                self.long_lookups += outcome.long
                self.short_lookups += outcome.short
                self.branch_hits += outcome.from_branch
        self.lookups += looked_up
        self.verify_seconds += timing.verify
        self.exposed_draft_seconds += timing.exposed_draft
        self.hidden_draft_seconds += timing.hidden_draft
        self.host_seconds += timing.host
        self.history.append((outcomes, timing))

    @property
    def tau(self) -> float:
        """Tokens added per row per round, the target's own token included."""
        return self.new_tokens / self.row_rounds if self.row_rounds else float("nan")

    @property
    def hit_rate(self) -> float | None:
        return self.branch_hits / self.lookups if self.lookups else None

    @property
    def seconds(self) -> float:
        """Round time: verify + exposed drafting + host."""
        return self.verify_seconds + self.exposed_draft_seconds + self.host_seconds

    def histogram(self, block_size: int) -> list[int]:
        """`counts[n - 1]` = row rounds that added `n` tokens, `n = 1..block_size`."""
        return [self.accepted.get(n, 0) for n in range(1, block_size + 1)]


def compiled_graphs() -> int:
    """Graphs PyTorch has compiled in this process so far (dynamo's `unique_graphs` counter)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def check_target(target) -> None:
    """Raise `ValueError` unless the engine can run `target`: on one device, decoder-only, full attention in every
    layer, sdpa or eager attention."""
    devices = sorted({str(device) for device in (getattr(target, "hf_device_map", None) or {}).values()})
    if len(devices) > 1:
        raise ValueError(f"The target is split over devices {', '.join(devices)} (its hf_device_map, e.g. from "
                         "device_map=\"auto\" on a node with several GPUs); the D3D engine keeps the target and its "
                         "cache on one device: load it with device_map=\"cuda:0\" (it must fit one GPU), and give "
                         "the drafter another with drafter.to(\"cuda:1\") and drafter_device=\"cuda:1\"")
    config = target.config.get_text_config()
    if target.config.is_encoder_decoder:
        raise ValueError("The D3D engine decodes decoder-only targets")
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or []):
        raise ValueError("The D3D engine needs a target with full attention in every layer (no sliding windows)")
    if (target.config._attn_implementation or "sdpa") not in ENGINE_ATTENTION:
        raise ValueError(f"The D3D engine runs {' or '.join(ENGINE_ATTENTION)} attention, not "
                         f"{target.config._attn_implementation!r}")


class SpeculativeEngine:
    """Batch-first speculative decoding: rows join (`add`), each `step` runs one round for all of them, and rows
    leave when they finish, fail or are `remove`d. Greedy rows are token-identical to the target decoding them alone;
    sampled rows follow the target's distribution.

    target: a causal LM; source: a drafter source (`sources_d3d.BlockSource`, `SuccessorSource`) or None (the target
    alone, one token a round, unless `lookup`); lookup: a `lookup_d3d.LookupSource` (prompt lookup, no model); policy:
    a `policy_d3d.VerifyPolicy`, the one chooser of what each row verifies each round (None: the drafter's block
    every round, or with `lookup` alone a default policy); max_rows: cache slots; max_length: the longest prompt + new tokens a row may reach
    (caches are sized for it); compile: `torch.compile` the target's verify pass ("reduce-overhead" on CUDA, i.e.
    CUDA graphs, with fixed shapes; inductor with dynamic lengths on CPUs; give the source compiled passes too,
    see `generation_d3d.make_source`), through the target's `passes_d3d.compiled_passes` (kept on the target with
    the cache, reused by the next engine of the same size: `close` returns it); passes: those to use instead (e.g.
    `CompiledPasses(target, fixed=True, compile=False)`: the fixed-shape path, eager); verification: how sampled
    rows judge their drafts, "block" (`acceptance_d3d.block_verify`, never fewer kept in expectation) or "token"
    (`rejection_sample`, token by token, the paper's rule). Not thread-safe: one caller drives it
    (`serving_d3d.D3DBatchServer` for many).
    """

    def __init__(self, target, source: DrafterSource | None = None, max_rows: int = 1, max_length: int = 2048, compile: bool = False,
                 keep_rounds: int = 100_000, passes: CompiledPasses | None = None, lookup: LookupSource | None = None,
                 policy: VerifyPolicy | None = None, verification: str = "block"):
        check_target(target)
        if verification not in VERIFICATIONS:
            raise ValueError(f"verification must be one of {sorted(VERIFICATIONS)}, got {verification!r}")
        self.verify_sampled = VERIFICATIONS[verification]
        if source is not None:
            check_vocabulary(source.drafter, target)
        if max_rows < 1 or max_length < 2:
            raise ValueError(f"max_rows must be >= 1 and max_length >= 2, got {max_rows}, {max_length}")
        if lookup is not None and source is not None and lookup.block_size != source.block_size:
            raise ValueError(f"The lookup's block size {lookup.block_size} differs from the drafter's {source.block_size}")
        self.target, self.source, self.lookup = target, source, lookup
        self.vocab_size = target.config.get_text_config().vocab_size  # read once: a config read is slow, per round
        self.width = next((s.block_size for s in (source, lookup) if s is not None), 1)
        self.policy = policy if policy is not None or lookup is None else VerifyPolicy(self.width)
        if self.policy is not None and self.width > 1:
            check_policy_width(self.policy, self.width)
        # greedy rows may verify the drafter's block and a lookup in one pass (`policy_d3d.BOTH`), and lookup rows
        # their whole continuation in a pass as wide (`RoundPlan.long`)
        self.trees = source is not None and lookup is not None and self.policy is not None
        widest = tree_width(self.width) if self.trees else self.width
        if lookup is not None and lookup.max_drafts > widest - 1:
            raise ValueError(f"The lookup proposes up to {lookup.max_drafts} drafts; this engine verifies at most "
                             f"{widest - 1} (its widest pass less the anchor)")
        self.max_rows, self.max_length = max_rows, max_length
        self.device = target.get_input_embeddings().weight.device
        self.passes = passes if passes is not None or not compile else compiled_passes(target)
        self.forward = self.prefill_forward = None
        if self.passes is not None:  # with dynamic shapes, a prefill compiled for every length (`prefill`)
            kinds = ("verify",) if self.passes.fixed_shapes else ("verify", "prefill")
            forwards = self.passes.forwards_of(kinds)
            self.forward, self.prefill_forward = forwards[0], forwards[1] if len(forwards) > 1 else None
        shape = (target.config, max_rows, max_length + (tree_width(self.width) if self.trees else self.width),
                 self.device, target.dtype)
        self.cache = self.passes.caches.take(*shape) if self.passes is not None else StaticKVCache(*shape)
        for each in (source, lookup):
            if each is not None:
                each.allocate(max_rows, max_length + 1)
        self.clock = Clock(self.device)
        self.rows: list[Row] = []
        self.pending: list[RoundOutcome] = []  # the first tokens of rows that joined, decided by their prefill
        self.round_record = RoundRecord(keep=keep_rounds)

    def __len__(self) -> int:
        return len(self.rows)

    def check_request(self, prompt: list[int], settings: RowSettings, drafter_prompt: list[int] | None = None) -> None:
        """Raise `ValueError` unless `prompt` can be decoded with `settings` by this engine."""
        vocab = self.vocab_size
        for name, ids in (("prompt", prompt), ("drafter prompt", drafter_prompt)):
            if ids is None:
                continue
            if not ids:
                raise ValueError(f"A {name} needs at least one token")
            if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
                raise ValueError(f"{name.capitalize()} token ids must be integers in 0..{vocab - 1}")
        longest = max(len(prompt), len(drafter_prompt or prompt)) + settings.max_new_tokens
        if longest > self.max_length:
            raise ValueError(f"prompt ({max(len(prompt), len(drafter_prompt or prompt))} tokens) + max_new_tokens "
                             f"({settings.max_new_tokens}) exceeds this engine's max_length {self.max_length}")

    @torch.no_grad()
    def add(self, key: Hashable, prompt: list[int], settings: RowSettings, drafter_prompt: list[int] | None = None) -> None:
        """Prefill `prompt` in the target and decide the row's first token from its last logits, as `generate` does
        (reported by the next `step`), give the drafter source the drafter's prompt and that token (the prompt is the
        same unless given: selective prefill; it prefills on the row's first block round), and join the batch
        (`add_rows` of one request)."""
        self.add_rows([(key, prompt, settings, drafter_prompt)])

    @torch.no_grad()
    def add_rows(self, requests: list[tuple[Hashable, list[int], RowSettings, list[int] | None]]) -> None:
        """`add` for each request `(key, prompt, settings, drafter_prompt)`, every one checked before any joins; the
        new rows take their slots shortest prompt first, so that rows of similar lengths share a prefill pass
        (`passes_d3d.prefill`), whose logits of each row's last prompt token decide its first token (processed,
        accepted and stopped as a round's, `_accept`: one device-to-host read); the next `step` reports those tokens
        (a round of its own, before any pass; a row whose first token ends it leaves then). Each row's random draws
        are seeded in the order of `requests`. No request: nothing runs (no device synchronisation)."""
        if not requests:
            return
        keys = [key for key, *_ in requests]
        for key, prompt, settings, drafter_prompt in requests:
            self.check_request(prompt, settings, drafter_prompt)
            if drafter_prompt is not None and drafter_prompt[-1] != prompt[-1]:
                raise ValueError("The drafter's prompt must end with the target's last prompt token (both go on from it)")
            if keys.count(key) > 1 or any(row.key == key for row in self.rows):
                raise ValueError(f"A row with key {key!r} is already in the batch")
        if len(self.rows) + len(requests) > self.max_rows:
            asked = f" ({len(self.rows)}, and {len(requests)} more asked)" if len(requests) > 1 else ""
            raise ValueError(f"The engine holds {self.max_rows} rows already{asked}")
        rows = sorted((self._new_row(*request) for request in requests), key=lambda row: len(row.prompt))
        start, first = time.perf_counter(), len(self.rows)
        logits = prefill(self.target, self.cache, first, [row.prompt for row in rows], last_logits=True,
                         forward=self.prefill_forward)
        firsts = self._accept(None, logits, [NOTHING] * len(rows), rows=rows, first_slot=first)
        for each in (self.source, self.lookup):
            if each is not None:
                each.add(first, [row.drafter_context for row in rows])
        synchronize(self.device)
        self.round_record.prefill_seconds += time.perf_counter() - start
        self.rows.extend(rows)  # with their first tokens, together: rows that failed to join report nothing
        self.pending += firsts

    def _new_row(self, key: Hashable, prompt: list[int], settings: RowSettings, drafter_prompt: list[int] | None) -> Row:
        """A checked request's `Row`, its generators seeded from `settings.seed` (None: a draw from torch's)."""
        seed = settings.seed if settings.seed is not None else int(torch.randint(2**62, (1,)))
        return Row(  # the row's processors were built on the target's device: its drafter logits are processed there
            key, list(prompt), list(drafter_prompt or prompt), settings,
            RowSampling(settings.logits_processor, settings.do_sample,
                        torch.Generator(device=self.device).manual_seed(2 * seed), self.device),
            torch.Generator(device=self.device).manual_seed(2 * seed + 1),
        )

    def remove(self, keys: set[Hashable]) -> None:
        """Drop the rows whose key is in `keys` (cancelled requests)."""
        self.pending = [outcome for outcome in self.pending if outcome.key not in keys]
        self._keep([i for i, row in enumerate(self.rows) if row.key not in keys])

    def _keep(self, indices: list[int]) -> None:
        """Keep the rows `indices` (in order), packing them into slots `0..len-1` (one row copy per moved row)."""
        kept = sorted(set(indices))
        for to_slot, from_slot in enumerate(kept):
            if to_slot != from_slot:
                self.cache.move_row(from_slot, to_slot)
                for each in (self.source, self.lookup):
                    if each is not None:
                        each.move(from_slot, to_slot)
        if self.policy is not None:
            for i in set(range(len(self.rows))) - set(kept):
                self.policy.forget(id(self.rows[i]))
        self.rows = [self.rows[i] for i in kept]

    @torch.no_grad()
    def step(self) -> list[RoundOutcome]:
        """One round for every row (or, after rows joined, the round of their first tokens, `add_rows`); finished and
        failed rows leave. An exception of a per-row step (its logits
        processors, criteria; any but a Ctrl-C, see `acceptance_d3d.ends_row_only`) ends that row only, with the error
        in its outcome; an exception of a batched pass propagates (call `reset` before going on)."""
        if self.pending:  # the first tokens of rows that joined (their prefill's round): reported before any pass
            outcomes, self.pending = self.pending, []
            ended = {outcome.key for outcome in outcomes if outcome.finished}
            self._keep([i for i, row in enumerate(self.rows) if row.key not in ended])
            self.round_record.add(outcomes, 0, RoundTiming(0.0, 0.0, 0.0, 0.0))  # its time: the prefill's
            return outcomes
        if not self.rows:
            return []
        start = self.clock.mark()
        graphs_before = compiled_graphs()
        keys = [id(row) for row in self.rows]  # the policy's keys: rows of engines sharing it never mix
        contexts = [row.drafter_context for row in self.rows]  # before the round
        # 1. plan: what each row verifies (nothing, the drafter's block, a lookup continuation, or both)
        lookups, matches = (self.lookup.propose(contexts) if self.lookup is not None
                            else ([[] for _ in keys], [0] * len(keys)))
        plan = self.plan(keys, lookups, matches)
        # 2. propose: the drafter's block for every row when any row verifies one, then the plan applied
        proposal = None
        if plan.drafter:
            proposal = self.source.propose(contexts, [row.sampling for row in self.rows])
        plan, proposal = apply_plan(plan, proposal, lookups, self.vocab_size,
                                    any(row.settings.do_sample for row in self.rows), self.device, self.width)
        # 3. verify: ONE target pass over every row's [anchor, drafts] (and a tree's second branch)
        verify_start = self.clock.mark()
        logits = self.verify(proposal, plan.width)
        verify_end = self.clock.mark()
        # 4-6. process, accept, stop and commit (the round's one device-to-host read)
        outcomes = self._accept(proposal, logits, plan.choices, plan.long)
        accept_end = self.clock.mark()
        # 7. observe: the drafter source learns what each row kept (and joins its background drafting)
        drafting = DraftTiming()
        if plan.drafter:
            drafting = self.source.observe(contexts, [outcome.added for outcome in outcomes])
        verify_seconds = seconds(verify_start, verify_end)
        # exposed: the target's stream waited for the drafts before verifying, then for the worker
        exposed = (seconds(start, verify_start) if proposal is not None else 0.0) + drafting.exposed
        if self.policy is not None:  # drafting's cost, without the drafter's prefill of rows that joined; the
            # verification's, with the acceptance after its pass (processing and drawing over every verified column:
            # a sampled wide round's is a large part of its cost on a CPU, and a policy blind to it verifies drafts
            # that do not pay)
            drafter_seconds = max(exposed - proposal.caught_up_seconds, 0.0) if proposal is not None else exposed
            self.policy.observe(keys, plan, [outcome.accepted_drafts for outcome in outcomes],
                                seconds(verify_start, accept_end), drafter_seconds,
                                [outcome.branches for outcome in outcomes])
        # 8. finished and failed rows leave
        self._keep([i for i, outcome in enumerate(outcomes) if not outcome.finished])
        total = time.perf_counter() - start.host
        timing = RoundTiming(verify_seconds, exposed, drafting.hidden, max(total - verify_seconds - exposed, 0.0))
        self.round_record.add(outcomes, sum(proposal.looked_up) if proposal is not None else 0, timing)
        self.round_record.compilations += compiled_graphs() - graphs_before
        return outcomes

    def rounds(self) -> Iterator[list[RoundOutcome]]:
        """`step` until every row has left, yielding each round's outcomes: the loop of the `generate` front doors and
        the Space. A row's error ends the decoding: it is raised (the batch server ends that row only instead,
        `serving_d3d`)."""
        while self.rows:
            outcomes = self.step()
            for outcome in outcomes:
                if outcome.error is not None:
                    raise outcome.error
            yield outcomes

    def plan(self, keys: list[Hashable], lookups: list[list[int]], matches: list[int]) -> RoundPlan:
        """What this round verifies per row (`lookups` and their `matches`: `lookup_d3d`): the policy's choice;
        without a policy, the drafter's block (or nothing, the target alone)."""
        if self.policy is not None:
            greedy = [not row.settings.do_sample for row in self.rows]
            plan = self.policy.plan(keys, lookups, self.source is not None, greedy, self.trees, matches)
            if any(choice == BOTH and not (self.trees and g) for choice, g in zip(plan.choices, greedy)):
                raise RuntimeError("The verify policy chose both proposals for a row that samples, or in an engine "
                                   "that verifies no trees (it needs a drafter and a lookup): a tree's better branch "
                                   "is chosen by greedy matching, exact for greedy rows only")
            return plan
        if self.source is None:
            return RoundPlan([NOTHING] * len(keys), False, 1)
        return RoundPlan([BLOCK] * len(keys), True, self.width)

    def verify(self, proposal: Proposal | None, width: int | None = None) -> torch.Tensor:
        """One target pass over `[anchor, drafts]` per row, `width` columns (None: the engine's block; `proposal`
        None: the drafts' columns zero, as `d3d bench` times the pass; a tree's width: `[anchor, drafts, second]`,
        the second branch beside the first, `PassLayout.branched`, unless the proposal has no second branch: a long
        lookup round's `[anchor, drafts]`, causal): logits `(rows, width, vocab)` float32; the cache
        gains the columns, committed as far as `step` accepts."""
        width = self.width if width is None else width
        padding = [0] * (width - 1)  # the drafts' columns, filled on the device
        ids = torch.tensor([[row.last_token, *padding] for row in self.rows], dtype=torch.long)
        starts = torch.tensor(self.cache.committed[: len(self.rows)], dtype=torch.long)
        tail = proposal.drafts if proposal is not None and width > 1 else None
        layout = PassLayout.causal(ids, starts)
        if width > self.width and (proposal is None or proposal.second is not None):  # a tree (else a long lookup)
            layout = PassLayout.branched(ids, starts, self.width)
            if proposal is not None:
                tail = torch.cat([proposal.drafts, proposal.second], dim=1)
        return run_pass(self.target, self.cache, layout, width, forward=self.forward, tail=tail)

    def _accept(self, proposal: Proposal | None, logits: torch.Tensor, choices: list[str],
                long: list[bool] | None = None, rows: list[Row] | None = None, first_slot: int = 0) -> list[RoundOutcome]:
        """Steps 4-6 of a round over the target's logits `(rows, width, vocab)` (a tree round's: both branches,
        `verify`) for rows that verified `choices` (`long`: `RoundPlan.long`): the batch's rows, or `rows` in slots
        `first_slot..` (rows joining, `add_rows`). Returns the outcomes (a failed row's: no tokens, finished, its
        error)."""
        rows = self.rows if rows is None else rows
        failed: dict[int, BaseException] = dict(proposal.errors) if proposal is not None else {}
        if proposal is not None:
            drafts, num_drafts = proposal.drafts.to(self.device), proposal.num_drafts.to(self.device)
        else:
            drafts = torch.zeros(len(rows), 0, dtype=torch.long, device=self.device)
            num_drafts = torch.zeros(len(rows), dtype=torch.long, device=self.device)
        tree = proposal is not None and proposal.second is not None
        if tree:  # the second branch follows the same anchor: its logits are column 0's and its own columns
            logits, second = logits[:, : self.width], torch.cat([logits[:, :1], logits[:, self.width :]], dim=1)
        # 4. process: each row's logits processors over the target's logits it verifies (a row whose processors
        # fail leaves)
        width = logits.shape[1]  # a row verifies 1 column, or a block's, or (a long lookup) all of them
        short = 1 < width < self.width  # a short round: lookups' first drafts
        logits = self._process(rows, logits, drafts, failed, [1 if c == NOTHING else width if long and long[r]
                                                        else min(width, self.width) for r, c in enumerate(choices)])
        # 5. accept: greedy matching, rejection sampling for sampled rows; then the round's one device-to-host read
        sampled = [r for r, row in enumerate(rows) if row.settings.do_sample and r not in failed]
        mixed = 0 < len(sampled) < len(rows)
        if len(sampled) < len(rows):  # greedy rows (and failed ones, whose tokens are never read)
            accepted, tokens = greedy_accept(drafts, num_drafts, logits)
        if sampled:
            index = torch.tensor(sampled, device=self.device) if mixed else slice(None)
            q = (proposal.logits.to(self.device)[index] if proposal is not None
                 else logits.new_zeros(len(sampled), 0, logits.shape[-1]))
            drawn = self.verify_sampled(drafts[index], num_drafts[index], q, logits[index],
                                        [rows[r].verify_rng for r in sampled])
            if mixed:
                accepted[index], tokens[index] = drawn
            else:
                accepted, tokens = drawn
        columns = [accepted[:, None], tokens]
        if tree:  # 5b. a tree's rows (greedy) keep the branch that kept more
            accepted, tokens, logits, branches = self._better_branch(proposal, second, accepted, tokens, logits,
                                                                     failed, [c == BOTH for c in choices])
            columns = [accepted[:, None], tokens, branches]
        host = torch.cat(columns, dim=1).cpu().tolist()
        # 6. stop and commit: each row cut where the target alone stops; the target's cache commits what it keeps
        outcomes = []
        for r, row in enumerate(rows):
            error = failed.get(r)
            if error is None:
                try:
                    added = host[r][1 : host[r][0] + 2]
                    if max(added) >= self.vocab_size:  # a draw from p without mass (`acceptance_d3d.draw`)
                        raise RuntimeError("A row's sampling distribution has no mass: the target's probabilities are "
                                           "NaN or all zero (its logits processors left every score -inf?)")
                    added, finished = self._stop(row, added, logits[r])
                except BaseException as raised:  # this row's tokens or criteria failed: it leaves, the others go on
                    if not ends_row_only(raised):
                        raise
                    error = raised
            if error is not None:
                outcomes.append(RoundOutcome(row.key, [], True, error=error, verified=choices[r]))
                continue
            branch = branches = None
            if choices[r] == BOTH:
                took_second, *branches = host[r][-3:]
                branch = LOOKUP if took_second else BLOCK
                if took_second:  # its accepted drafts' keys and values go to the columns of their positions
                    start = self.cache.committed[first_slot + r]
                    self.cache.move_columns(first_slot + r, start + self.width, start + 1, len(added) - 1)
            row.generated += added
            self.cache.commit(first_slot + r, self.cache.committed[first_slot + r] + len(added))
            outcomes.append(RoundOutcome(
                row.key, added, finished, accepted_drafts=min(host[r][0], len(added)),
                from_branch=proposal is not None and proposal.hits[r] and branch != LOOKUP, verified=choices[r],
                long=bool(long and long[r]), short=short and choices[r] == LOOKUP, branch=branch,
                branches=tuple(branches) if branches else None))
        return outcomes

    def _better_branch(self, proposal: Proposal, second: torch.Tensor, accepted: torch.Tensor, tokens: torch.Tensor,
                       logits: torch.Tensor, failed: dict[int, BaseException],
                       trees: list[bool]) -> tuple[torch.Tensor, ...]:
        """Each row's better branch of a tree round: the second (`proposal.second`, the target's logits `second`
        `(rows, B, vocab)`, processed here for the rows that verify one, `trees[r]`) where its greedy match keeps more
        drafts than the first's `accepted` (rows without a second branch keep the first). Returns accepted `(rows,)`,
        tokens `(rows, B)` and logits `(rows, B, vocab)` of the kept branches, and per row `[took the second, first
        kept, second kept]`."""
        drafts = proposal.second.to(self.device)
        second = self._process(self.rows, second, drafts, failed, [second.shape[1] if tree else 0 for tree in trees])
        kept, kept_tokens = greedy_accept(drafts, proposal.num_second.to(self.device), second)
        take = kept > accepted
        branches = torch.stack([take.long(), accepted, kept], dim=1)
        return (torch.where(take, kept, accepted), torch.where(take[:, None], kept_tokens, tokens),
                torch.where(take[:, None, None], second, logits), branches)

    def _process(self, rows: list[Row], logits: torch.Tensor, drafts: torch.Tensor, failed: dict[int, BaseException],
                 columns: list[int]) -> torch.Tensor:
        """Each of `rows`' logits processors over the first `columns[r]` of its logits `(width, vocab)` (the ones it
        verifies; the rest, padding, left as they are: no processor sees a context it did not verify), position j
        with the row's tokens and the drafts before j as context; a row whose processing fails is put in `failed`
        (its logits are left as they are)."""
        if not any(row.settings.logits_processor.acting_from(len(row.tokens)) for row in rows):
            return logits  # no processor, or only length rules past their length (`acceptance_d3d.identity_from`)
        processed = []
        for r, row in enumerate(rows):
            count = columns[r]
            if count == 0:
                processed.append(logits[r])
                continue
            try:
                done = process(row.settings.logits_processor, row.tokens, logits[r, :count], drafts[r])
                processed.append(done if count == logits.shape[1] else torch.cat([done, logits[r, count:]]))
            except BaseException as error:  # this row's processing failed: it leaves, the others go on
                if not ends_row_only(error):
                    raise
                failed[r] = error
                processed.append(logits[r])
        return torch.stack(processed)

    @staticmethod
    def _stop(row: Row, added: list[int], logits: torch.Tensor) -> tuple[list[int], bool]:
        """Cut `added` where the target alone would stop: the length limit, the first EOS, or the first token after
        which a stopping criterion fires (each checked with the sequence up to that token). Returns the tokens kept
        and whether the row ends."""
        settings = row.settings
        added = added[: settings.max_new_tokens - len(row.generated)]
        tokens = None
        if settings.stopping_criteria:  # criteria that only read the ids run on the host: no device read per token
            host = all(isinstance(c, HOST_CRITERIA) for c in settings.stopping_criteria)
            tokens = torch.tensor([row.tokens + added], device="cpu" if host else logits.device)
        start = len(row.tokens)
        for index, token in enumerate(added):  # the first stop wins, EOS or criterion, as in generate's own loop
            if token in settings.eos_token_ids:
                return added[: index + 1], True
            if tokens is not None and bool(
                    settings.stopping_criteria(tokens[:, : start + index + 1], logits[index : index + 1]).any()):
                return added[: index + 1], True
        return added, len(row.generated) + len(added) >= settings.max_new_tokens

    def reset(self) -> None:
        """Drop every row (after a failed batched pass, whose cache writes cannot be trusted); the caches stay."""
        if self.source is not None:
            try:
                self.source.wait()
            except Exception:  # the failed round's worker pass: its branches are dropped with the rows
                pass
        if self.policy is not None:
            for row in self.rows:
                self.policy.forget(id(row))
        self.rows, self.pending = [], []

    def close(self) -> None:
        """Stop the source's worker, if any; return the caches to their pools (compiled passes)."""
        try:
            if self.source is not None:
                self.source.close()
        finally:
            if self.passes is not None and self.cache is not None:
                self.passes.caches.put(self.cache)
                self.cache = None


__all__ = ["Row", "RowSettings", "RoundOutcome", "RoundRecord", "RoundTiming", "SpeculativeEngine", "check_target", "compiled_graphs"]
