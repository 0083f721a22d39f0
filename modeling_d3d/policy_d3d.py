"""The one chooser: per row and round, what a round verifies: nothing (a plain target step), the drafter's block, a
lookup continuation (`lookup_d3d`), or both (a two-branch tree: the block and the lookup continuation each follow the
anchor, and the row keeps the branch that keeps more; greedy rows only).

A round's cost is shared by its rows: one target pass, 1 column wide when no row verifies drafts, `short_drafts + 1`
wide when rows verify only the first few drafts of their lookups (a *short* round: where lookups keep little, as when
sampling, a few free drafts in a pass little dearer than a plain step pay where a block's width does not), `B` wide when
rows verify one proposal each, `2B - 1` wide (`tree_width`) when any row verifies both, plus one drafter pass when any
row verifies the drafter's block. Where trees are verified, a round as wide as a tree may instead verify lookups
longer than a block whole (a *long* round, `RoundPlan.long`: causal, no tree in it; where the text repeats, a lookup
that keeps all of a block's drafts often keeps more), priced by how often lookups of the same match length keep a
whole block's drafts and what long ones then kept beyond them (`VerifyPolicy.expected_long_lookup`).
`VerifyPolicy.plan` picks, before the round, the kind of round with the most expected tokens per second
(`RoundPlan`): expected tokens from each row's acceptance so far (accepted drafts per round, for the drafter's blocks
and for lookups, smoothed, each blended with the same pooled over rows: for blocks pooled per row age, `age_bucket`
(the first rounds of an answer are a regime of their own: a drafter may keep little there and much later, or the
reverse); for lookups pooled per match length, `match_bucket`, which predicts what a lookup keeps; for both, the
better of the two plus what trees kept beyond the branch expected to keep more, pooled over rows), seconds from the
rounds this engine has run (smoothed, per batch size; a cost not measured yet, or only by its first pass (a warm-up), is taken as the
cheapest it can be, so the round that measures it is tried). A row that has not verified the drafter's block for
`probe_every` rounds verifies it again (its acceptance may have changed), and likewise a lookup it found, so an
engine never stops learning.

Lossless whatever it decides: the decision reads past rounds and the proposals' own contents (lookup drafts are a
function of the text), never the target's logits of this round nor the drafter's sampled tokens (which would change
which draws are verified, and so their distribution). A tree is dropped for a row when one branch's drafts begin
with the other's (`untangled`: a function of the drafts, which are the argmax for the greedy rows that verify trees).
`tests/test_policy_d3d.py` shows a chooser that peeks failing the χ² test.
"""

from collections.abc import Hashable
from dataclasses import dataclass, field, replace

import torch

from .lookup_d3d import LookupSource, one_hot_logits
from .sources_d3d import Proposal

NOTHING, BLOCK, LOOKUP, BOTH = "nothing", "block", "lookup", "both"
# the pools of lookups that kept every one of a block's drafts, and of what long ones then kept beyond them
# (`VerifyPolicy.expected_long_lookup`); of what lookups kept of their first `short_drafts` (`expected_short_lookup`)
FULL, LONG, SHORT = "full", "long", "short"
SHORT_DRAFTS = 3  # the drafts a short lookup round verifies (`VerifyPolicy.short_drafts`; docs/results.md, 2026-12-06)
OUTLIER = 2.0  # a measured pass above this many times its estimate is counted as this many (see `_measure`)
NARROWEST_FIRST = ("narrow", "short", "wide")  # passes of one proposal, none priced above a wider one (`cost`)
SCALED = ("short", "wide", "tree")  # target passes whose cost is kept relative to a plain step's (`_measure`)
WARM_UP_PASSES = 1  # the first passes of a kind at a batch size, whose one-time costs are not its cost (`_measure`)
AGE_POOL_ROWS = 4  # a young age bucket's pooled block estimate follows about this many latest rows (`age_smoothing`)
OLDEST_AGE = 5  # the open-ended age bucket: rows of 2 ** (OLDEST_AGE - 1) rounds and more (`age_bucket`)


@dataclass
class RoundPlan:
    """What one round verifies: `choices[r]` per row (`NOTHING`, `BLOCK`, `LOOKUP`, `BOTH`); `drafter`: whether the
    drafter's pass runs; `width`: the verify pass's columns (1; `B` when any row verifies drafts; a short round's
    `VerifyPolicy.short_width()` when rows verify only their lookups' first drafts; `tree_width(B)` when any row
    verifies both, or a long lookup); `alone[r]`: the one proposal (`BLOCK` or `LOOKUP`) row `r` would
    have verified without a tree, what `observe` measures a tree's gain against; `matches[r]`: its lookup's match
    (`lookup_d3d`), whose bucket learns what the lookup kept (None: not recorded); `long[r]`: whether `LOOKUP` row
    `r` verifies its whole continuation, up to `tree_width(B) - 1` drafts, in a causal pass of the tree's width
    (a *long* round: no row verifies both; None: no row does)."""

    choices: list[str]
    drafter: bool
    width: int
    alone: list[str] | None = field(default=None, compare=False)  # what the round verifies is the rest
    matches: list[int] | None = field(default=None, compare=False)
    long: list[bool] | None = None


@dataclass
class RowHistory:
    """One row's smoothed accepted drafts per round when it verified the drafter's block, a lookup, and of a lookup's
    first `short_drafts` (learnt from every lookup it verified), the rounds since it last verified the block and a
    whole lookup, and the rounds it has taken part in (its age, `age_bucket`)."""

    block: float
    lookup: float
    short: float
    since_block: int = 0
    since_lookup: int = 0
    rounds: int = 0


@dataclass
class VerifyPolicy:
    """Maximises expected tokens per second (see the module docstring). block_size: the verify width `B`; smoothing:
    the weight of the newest observation in every average; probe_every: rounds a row may go without verifying the
    drafter's block, or a lookup it found (each doubled after a probe of its kind that kept nothing, up to 8x, and
    reset by one that kept a draft: `interval`, `lookup_interval`);
    costs: seconds per kind of pass (`"narrow"`, `"short"`, `"wide"`, `"tree"`, `"drafter"`; a short pass not given
    costs a wide one, a tree not given a wide one) to use instead of measured ones (then
    decisions do not depend on timing: reproducible rounds); pooling: the weight of the drafter's pooled acceptance
    (`priors`: the mean over every row and round, its start counted as one round, moving by at least
    `pool_smoothing` a round once many were seen; `block_priors[age_bucket(rounds)]` at the row's age) in a row's
    expected drafts from its block, the rest its own average (a row's few latest rounds say little: a hard stretch of
    text does not make a good drafter worth skipping; `priors[BOTH]`: the drafts a tree kept beyond the branch
    expected to keep more, pooled the same way),
    and of the lookup's pooled acceptance at the lookup's match length (`lookup_priors[match_bucket(match)]`) in its
    expected drafts from a lookup (and from its first `short_drafts`, `short_priors`); short_drafts: the drafts a short
    round verifies of each lookup (`SHORT_DRAFTS`; no short round where they would fill a block). What
    it learns (costs; `priors`, where new rows start) carries over from call to call when it is kept (`policy_for`)."""

    block_size: int
    smoothing: float = 0.25
    probe_every: int = 16
    costs: dict[str, float] | None = None
    pooling: float = 0.5
    pool_smoothing: float = 0.03
    short_drafts: int = SHORT_DRAFTS
    measured: dict[tuple[str, int], float] = field(default_factory=dict)
    levels: dict[tuple[str, int], float] = field(default_factory=dict)
    pass_counts: dict[tuple[str, int], int] = field(default_factory=dict)
    history: dict = field(default_factory=dict)
    priors: dict[str, float] = field(default_factory=dict)
    pooled_rounds: dict = field(default_factory=dict)
    block_priors: dict[int, float] = field(default_factory=dict)
    lookup_priors: dict[int, float] = field(default_factory=dict)
    full_priors: dict[int | None, float] = field(default_factory=dict)
    long_priors: dict[int | None, float] = field(default_factory=dict)
    short_priors: dict[int | None, float] = field(default_factory=dict)
    interval: int = 0
    lookup_interval: int = 0

    def __post_init__(self):
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {self.smoothing!r}")
        if not 0 <= self.pooling <= 1 or not 0 < self.pool_smoothing <= 1:
            raise ValueError(f"pooling must be in [0, 1] and pool_smoothing in (0, 1], got {self.pooling!r}, "
                             f"{self.pool_smoothing!r}")
        if isinstance(self.short_drafts, bool) or not isinstance(self.short_drafts, int) or self.short_drafts < 0:
            raise ValueError(f"short_drafts must be an integer >= 0, got {self.short_drafts!r}")
        if isinstance(self.probe_every, bool) or not isinstance(self.probe_every, int) or self.probe_every < 1:
            raise ValueError(f"probe_every must be an integer >= 1, got {self.probe_every!r}")
        half = (self.block_size - 1) / 2
        self.priors = self.priors or {BLOCK: half, LOOKUP: half, BOTH: 1.0, FULL: 0.0, LONG: half,
                                      SHORT: min(half, self.short_drafts)}
        self.interval = self.interval or self.probe_every
        self.lookup_interval = self.lookup_interval or self.probe_every

    def cost(self, kind: str, rows: int) -> float:
        """Seconds of a pass of `kind` over `rows` rows: given, measured, or (not measured yet) the cheapest it can be:
        a narrow pass and a drafter pass free, a short or wide pass as a narrow one, a tree as a wide one. So the first
        round at a batch size is a plain step, which measures the narrow pass (were it priced as a wide one, a
        drafter that keeps a few tokens would win every round and the narrow pass never be measured, however dear
        wide rounds are: at 16 rows on a CPU they cost 4-5 narrow ones). A kind's first pass at a batch size is a
        warm-up (`_measure`): until its second, the kind counts as not measured. A narrow pass never counts as
        dearer than a short or wide one, nor a short one than a wide one: a slow narrow round (a pause of the
        process) would otherwise make every round draft."""
        if self.costs is not None:
            if kind in ("tree", "short") and kind not in self.costs:  # not given: a wide pass (a tree: as when not
                return self.costs["wide"]  # measured; a short one: never chosen over a wide lookup)
            return self.costs[kind]
        if not self._known(kind, rows):
            if kind in ("short", "wide"):
                return self.measured[("narrow", rows)] if self._known("narrow", rows) else 1.0
            return self.cost("wide", rows) if kind == "tree" else 0.0
        if kind in NARROWEST_FIRST:  # never dearer than a wider pass
            wider = NARROWEST_FIRST[NARROWEST_FIRST.index(kind):]
            return min(self._seconds(k, rows) for k in wider if self._known(k, rows))
        return self._seconds(kind, rows)

    def _seconds(self, kind: str, rows: int) -> float:
        """The measured cost of `kind` at `rows`; a wider target pass's (`SCALED`) at the plain step's present
        level: as measured, times the plain step's estimate now over what it was then (`levels`, `_measure`)."""
        seconds, level = self.measured[(kind, rows)], self.levels.get((kind, rows))
        return seconds if level is None else seconds * self.measured[("narrow", rows)] / level

    def _known(self, kind: str, rows: int) -> bool:
        """Whether passes of `kind` at `rows` were measured past their warm-up."""
        return self.pass_counts.get((kind, rows), 0) > WARM_UP_PASSES

    def row(self, key) -> RowHistory:
        """`key`'s history; a new row starts from the priors of a row's first round (at first optimistic: half a
        block accepted)."""
        if key not in self.history:
            self.history[key] = RowHistory(block=self.block_prior(0), lookup=self.priors[LOOKUP],
                                           short=self.priors[SHORT])
        return self.history[key]

    def expected_block(self, history: RowHistory) -> float:
        """The drafts a row with `history` is expected to keep from the drafter's block: its own average and the
        pooled one at its age, weighted by `pooling`."""
        return (1 - self.pooling) * history.block + self.pooling * self.block_prior(age_bucket(history.rounds))

    def block_prior(self, bucket: int) -> float:
        """The pooled drafts kept by blocks of rows whose age is in `bucket` (`age_bucket`); a bucket not seen yet
        starts at the pool over every block."""
        return self.block_priors.get(bucket, self.priors[BLOCK])

    def expected_lookup(self, history: RowHistory, found: list[int], match: int | None) -> float:
        """The drafts a row with `history` is expected to keep from the lookup continuation `found` (0 when none)
        whose match is `match`: its own average and the pooled one at that match length (None: over every lookup),
        weighted by `pooling`, at most `len(found)`."""
        if not found:
            return 0.0
        pooled = self.priors[LOOKUP] if match is None else self.lookup_prior(match_bucket(match))
        return min((1 - self.pooling) * history.lookup + self.pooling * pooled, len(found))

    def lookup_prior(self, bucket: int) -> float:
        """The pooled drafts kept by lookups whose match is in `bucket` (`match_bucket`); a bucket not seen yet starts
        at the pool over every lookup."""
        return self.lookup_priors.get(bucket, self.priors[LOOKUP])

    def short_width(self) -> int | None:
        """Columns of a short round's verify pass (`short_drafts` and the anchor); None: no short round (none
        asked for, or it would be as wide as a block)."""
        width = self.short_drafts + 1
        return width if 1 < width < self.block_size else None

    def expected_short_lookup(self, history: RowHistory, found: list[int], match: int | None) -> float:
        """The drafts a row with `history` is expected to keep of the first `short_drafts` of its lookup continuation
        `found` (0 when none): as `expected_lookup`, from what lookups kept of their first `short_drafts`
        (`history.short`, `short_priors`)."""
        if not found:
            return 0.0
        bucket = None if match is None else match_bucket(match)
        pooled = self.short_priors.get(bucket, self.priors[SHORT])
        return min((1 - self.pooling) * history.short + self.pooling * pooled, len(found), self.short_drafts)

    def expected_long_lookup(self, short: float, found: list[int], match: int | None) -> float:
        """The drafts a row expected to keep `short` of its lookup's first `B - 1` drafts is expected to keep of the
        whole continuation `found` in a long round: plus, pooled over lookups whose match is in the same bucket (None:
        any), the fraction that kept all `B - 1` (`full_priors`, learnt from every verified lookup, starting from
        `priors[FULL]`, at first 0: where lookups keep little, as in sampled decoding, no long round is tried) times
        what long lookups that kept them kept beyond (`long_priors`, starting from `priors[LONG]`, at first
        optimistic: where lookups keep whole blocks, long rounds are tried), at most `len(found)`."""
        bucket = None if match is None else match_bucket(match)
        full = self.full_priors.get(bucket, self.priors[FULL])
        return min(short + full * self.long_priors.get(bucket, self.priors[LONG]), len(found))

    def plan(self, keys: list, lookups: list[list[int]], drafter: bool, greedy: list[bool] | None = None,
             trees: bool = False, matches: list[int] | None = None) -> RoundPlan:
        """The round for rows `keys` with lookup continuations `lookups` (empty: none found) and their `matches`
        (`lookup_d3d`; None: not known); `drafter`: whether the engine has a drafter source; `greedy`: per row,
        whether it decodes greedily; `trees`: whether the engine verifies both proposals of a greedy row in one pass
        (`BOTH`)."""
        rows, branch = len(keys), self.block_size - 1  # the drafts of one proposal
        matches = matches or [None] * rows
        history = [self.row(key) for key in keys]
        lookup_gain = [self.expected_lookup(h, found[:branch], match)
                       for h, found, match in zip(history, lookups, matches)]
        block_gain = [self.expected_block(h) if drafter else 0.0 for h in history]
        narrow, wide, tree = self.cost("narrow", rows), self.cost("wide", rows), self.cost("tree", rows)
        # long lookups (where trees are verified, a pass of the tree's width is compiled and measured): a row whose
        # continuation goes past a block's drafts may verify it whole
        long = [trees and len(found) > branch for found in lookups]
        long_gain = [self.expected_long_lookup(gain, found, match) if is_long else gain
                     for gain, found, match, is_long in zip(lookup_gain, lookups, matches, long)]
        # options: (tokens per second, order: the higher wins a tie, a long or short lookup round loses one to a
        # lookup round of a block; choices; long rows; short); from order 1.5 on, the rounds with the drafter
        options = [(rate(rows, narrow), 0, [NOTHING] * rows, None, False)]
        alone = None
        if any(lookups):
            looked = [LOOKUP if found else NOTHING for found in lookups]
            options.append((rate(rows + sum(lookup_gain), wide), 1, looked, None, False))
            if any(long):
                options.append((rate(rows + sum(long_gain), tree), 0.5, looked, long, False))
            if self.short_width() is not None:  # each lookup's first few drafts, in a pass little wider than a step
                short_gain = [min(self.expected_short_lookup(h, found, match), gain)  # at most the whole lookup's
                              for h, found, match, gain in zip(history, lookups, matches, lookup_gain)]
                options.append((rate(rows + sum(short_gain), self.cost("short", rows)), 0.75, looked, None, True))
        if drafter:
            gains = [max(b, g) for b, g in zip(block_gain, lookup_gain)]
            choices = alone = [LOOKUP if g > b else BLOCK for b, g in zip(block_gain, lookup_gain)]
            drafting = self.cost("drafter", rows) if BLOCK in choices else 0.0
            options.append((rate(rows + sum(gains), wide + drafting), 2, choices, None, False))
            if any(long):  # each row the better of its block and its whole lookup, in a long round
                choices = [LOOKUP if g > b else BLOCK for b, g in zip(block_gain, long_gain)]
                drafting = self.cost("drafter", rows) if BLOCK in choices else 0.0
                options.append((rate(rows + sum(map(max, block_gain, long_gain)), tree + drafting), 1.5, choices,
                                long, False))
            branched = [trees and bool(found) and g for found, g in zip(lookups, greedy or [False] * rows)]
            if any(branched):  # a tree for every greedy row with a lookup: the better branch, and a bit more
                tree_gains = [gain + self.priors[BOTH] if b else gain for gain, b in zip(gains, branched)]
                options.append((rate(rows + sum(tree_gains), tree + self.cost("drafter", rows)), 3,
                                [BOTH if b else choice for b, choice in zip(branched, alone)], None, False))
            probes = [h.since_block >= self.interval for h in history]
            if any(probes):  # the best round that drafts, with every probing row verifying the drafter's block
                _, _, best, best_long, _ = max((option for option in options if option[1] >= 1.5),
                                               key=lambda option: option[:2])
                options = [(0.0, 4, [BLOCK if probe and choice != BOTH else choice
                                     for probe, choice in zip(probes, best)], best_long, False)]
        _, _, choices, long_rows, short = max(options, key=lambda option: option[:2])
        # a row that found a continuation but has not verified one (more than its first few drafts) for
        # `lookup_interval` rounds verifies it (its estimate, learnt only from verified lookups, would otherwise never
        # come back up), in a round of a block's width
        probing = [bool(found) and h.since_lookup >= self.lookup_interval and (choice == NOTHING or short)
                   for choice, found, h in zip(choices, lookups, history)]
        choices = [LOOKUP if probe else choice for choice, probe in zip(choices, probing)]
        return self.round_of(choices, alone, matches, long_rows, short and not any(probing))

    def round_of(self, choices: list[str], alone: list[str] | None = None, matches: list[int] | None = None,
                 long: list[bool] | None = None, short: bool = False) -> RoundPlan:
        """The `RoundPlan` of per-row `choices` (and `alone`, `matches`, `long`: `RoundPlan`'s; `long` kept for the
        `LOOKUP` rows of a round where no row verifies both; `short`: lookups verify their first `short_drafts`, in a
        round where no row verifies the drafter's block): its drafter pass and verify width."""
        long = kept_long(choices, long)
        return RoundPlan(choices, BLOCK in choices or BOTH in choices,
                         verify_width(choices, self.block_size, long is not None,
                                      self.short_width() if short else None), alone, matches, long)

    def observe(self, keys: list, plan: RoundPlan, accepted_drafts: list[int], verify_seconds: float,
                drafter_seconds: float, branches: list[tuple[int, int] | None] | None = None) -> None:
        """What the round of `plan` kept per row (`accepted_drafts`, for rows that went on; `branches[r]`: what a
        `BOTH` row's block and lookup each matched) and what its passes cost (`verify_seconds`: the verify pass and
        the acceptance after it, which grows with the verified columns; `drafter_seconds`: the drafting the round
        waited for)."""
        rows, rate, branch, short_width = len(keys), self.smoothing, self.block_size - 1, self.short_width()
        kind = pass_kind(plan.width, self.block_size, short_width)
        self._measure(kind, rows, verify_seconds)
        if plan.drafter:
            self._measure("drafter", rows, drafter_seconds)
        for r, (key, choice, accepted, both, match, long) in enumerate(zip(keys, plan.choices, accepted_drafts,
                                                                          branches or [None] * rows,
                                                                          plan.matches or [None] * rows,
                                                                          plan.long or [False] * rows)):
            history = self.row(key)
            looked_up = accepted if choice == LOOKUP else both[1] if choice == BOTH and both is not None else None
            if looked_up is not None and short_width is not None:  # what it kept of its first `short_drafts`
                kept = min(looked_up, self.short_drafts)
                history.short += rate * (kept - history.short)
                self._pool_match(self.short_priors, SHORT, match, kept)
            if looked_up is not None and kind == "short":  # a short lookup says nothing of the drafts after them
                history.since_block += 1
                history.since_lookup += 1
                continue
            if looked_up is not None:  # whether the lookup kept a whole block's drafts
                self._pool_match(self.full_priors, FULL, match, float(looked_up >= branch))
            if long:  # a long lookup: its first `B - 1` drafts learn as a lookup's, the pool what it kept beyond them
                if accepted >= branch:
                    self._pool_match(self.long_priors, LONG, match, accepted - branch)
                accepted = min(accepted, branch)
            if choice == BOTH and both is not None:  # both verified: each kind learns, the pool what a tree adds
                # over the one branch this row would have verified alone (the plan's; not recorded: the one expected
                # to keep more)
                alone = (plan.alone[r] if plan.alone is not None
                         else BLOCK if self.expected_block(history) >= history.lookup else LOOKUP)
                self._pool(BOTH, max(both) - (both[0] if alone == BLOCK else both[1]))
                for kind, kept in zip((BLOCK, LOOKUP), both):
                    setattr(history, kind, getattr(history, kind) + rate * (kept - getattr(history, kind)))
                    self._pool(kind, kept, match, history.rounds)
                history.since_block = history.since_lookup = 0
                continue
            if choice == BLOCK and history.since_block >= self.interval:  # a probe: back off while they keep nothing
                self.interval = self._backoff(self.interval, accepted)
            if choice == LOOKUP and history.since_lookup >= self.lookup_interval:  # a lookup probe: the same
                self.lookup_interval = self._backoff(self.lookup_interval, accepted)
            history.since_block = 0 if choice == BLOCK else history.since_block + 1
            history.since_lookup = 0 if choice == LOOKUP else history.since_lookup + 1
            if choice in (BLOCK, LOOKUP):
                setattr(history, choice, getattr(history, choice) + rate * (accepted - getattr(history, choice)))
                self._pool(choice, accepted, match, history.rounds)
        for key in keys:  # every row is a round older
            self.history[key].rounds += 1

    def _pool(self, kind: str, observed: float, match: int | None = None, age: int = 0) -> None:
        """Move the pooled `priors[kind]`, for a block the pool of its row's `age` bucket (`block_priors`, starting
        from `priors[BLOCK]`), and for a lookup whose `match` is known the pool of its bucket (`lookup_priors`,
        starting from `priors[LOOKUP]`), towards `observed`: each the mean over every round it pools so far, its start
        counted as one, moving at least by `pool_smoothing` (an age bucket's pool by `age_smoothing`)."""
        if kind == BLOCK:
            bucket = age_bucket(age)
            self.block_priors[bucket] = self.block_prior(bucket)
            self._average(self.block_priors, bucket, (BLOCK, bucket), observed, self.age_smoothing(bucket))
        if kind == LOOKUP and match is not None:
            bucket = match_bucket(match)
            self.lookup_priors[bucket] = self.lookup_prior(bucket)
            self._average(self.lookup_priors, bucket, (LOOKUP, bucket), observed, self.pool_smoothing)
        self._average(self.priors, kind, kind, observed, self.pool_smoothing)

    def _pool_match(self, pools: dict, kind: str, match: int | None, observed: float) -> None:
        """Move `pools[match_bucket(match)]` (None: `match` unknown; a bucket not seen yet starts at `priors[kind]`)
        and `priors[kind]` towards `observed`, as `_pool` does."""
        bucket = None if match is None else match_bucket(match)
        pools[bucket] = pools.get(bucket, self.priors[kind])
        self._average(pools, bucket, (kind, bucket), observed, self.pool_smoothing)
        self._average(self.priors, kind, kind, observed, self.pool_smoothing)

    def age_smoothing(self, bucket: int) -> float:
        """The least step of the pooled block estimate of age `bucket`: a row spends 1, 1, 2, 4 and 8 rounds in
        buckets 0 to 4, so a step of `pool_smoothing` would follow the first rounds of many dozen rows (a process
        that turns from one kind of prompt to another would price a new row's first rounds by the old kind for
        that long); `1 / (AGE_POOL_ROWS x those rounds)` follows the latest few rows. At least `pool_smoothing`,
        which the open-ended bucket `OLDEST_AGE` keeps."""
        if bucket >= OLDEST_AGE:
            return self.pool_smoothing
        return max(self.pool_smoothing, 1 / (AGE_POOL_ROWS * (1 << max(bucket - 1, 0))))

    def _average(self, pool: dict, key, counter, observed: float, least: float) -> None:
        """`pool[key]` moved towards `observed` as `_pool` says, by at least `least`; `pooled_rounds[counter]` counts
        its rounds."""
        seen = self.pooled_rounds[counter] = self.pooled_rounds.get(counter, 0) + 1
        pool[key] += max(least, 1 / (seen + 1)) * (observed - pool[key])

    def _backoff(self, interval: int, accepted: int) -> int:
        """The rounds before the next probe of a kind after a probe that kept `accepted` drafts: back to
        `probe_every` when it kept any, else doubled, at most 8x."""
        return self.probe_every if accepted else min(2 * interval, 8 * self.probe_every)

    def forget(self, key) -> None:
        """Drop a row that left."""
        self.history.pop(key, None)

    def _measure(self, kind: str, rows: int, seconds: float) -> None:
        """Smooth `seconds` into the cost of `kind` at `rows`; a round above `OUTLIER` times the estimate counts as
        that much (a pause of the process, another program's burst: a cost the policy stops measuring once it skips
        that pass must not jump on one slow round). The first `WARM_UP_PASSES` of a kind at a batch size pay one-time
        costs (a compile, the first use of kernels and buffers; seconds where a pass takes milliseconds): the pass
        after them replaces what they measured, unless it was slower (a pause of the process in the one pass that sets
        the estimate). A cost taken too high sticks (a pass the policy thinks dear is not chosen, so not measured
        again, and a 10x pause there would make a drafter that pays look dear for a whole run), one taken too low
        corrects itself (the pass is chosen, and measured: at most 1.25x a pass, `OUTLIER` and `smoothing`). So a
        wider target pass (`SCALED`) keeps its cost relative to the plain step's, which rounds measure most when drafts
        pay least: its estimate is moved at the plain step's present level and `levels` keeps that level (while plain
        steps are measured), so a spell of a slower machine (another process's burst: the passes of every kind
        1.5x slower for seconds) does not stick to a pass that is chosen rarely."""
        count = self.pass_counts[(kind, rows)] = self.pass_counts.get((kind, rows), 0) + 1
        old = self._seconds(kind, rows) if (kind, rows) in self.measured else None
        if old is not None and count > WARM_UP_PASSES + 1:
            seconds = old + self.smoothing * (min(seconds, OUTLIER * old) - old)
        elif old is not None:
            seconds = min(seconds, old)
        self.measured[(kind, rows)] = seconds
        if kind in SCALED and self._known("narrow", rows):
            self.levels[(kind, rows)] = self.measured[("narrow", rows)]
        else:
            self.levels.pop((kind, rows), None)


def age_bucket(rounds: int) -> int:
    """The bucket of a row's age (the rounds it took part in before this one) whose block acceptance the policy
    pools: round 0, 1, 2-3, 4-7, 8-15 and 16 on are buckets 0 to `OLDEST_AGE`."""
    return min(rounds.bit_length(), OLDEST_AGE)


def match_bucket(match: int) -> int:
    """The bucket of a lookup's match length whose acceptance the policy pools: 1, 2-3, 4-7, 8-15, 16-31, 32-63, 64
    tokens (`lookup_d3d.MAX_MATCH`) are buckets 1 to 7 (what a lookup keeps grows with its match: docs/results.md)."""
    return match.bit_length()


def verify_width(choices: list[str], block_size: int, long: bool = False, short: int | None = None) -> int:
    """Columns of the verify pass of a round whose rows verify `choices`: 1 when no row verifies drafts, `short`
    (`VerifyPolicy.short_width`; None: no short round) when rows verify only their lookups' first drafts, `B` when
    each verifies one proposal, `tree_width(B)` when any verifies both or (`long`) a lookup longer than a block."""
    if BOTH in choices or long:
        return tree_width(block_size)
    if short is not None and BLOCK not in choices and LOOKUP in choices:
        return short
    return block_size if any(choice != NOTHING for choice in choices) else 1


def pass_kind(width: int, block_size: int, short: int | None = None) -> str:
    """The kind of verify pass (`VerifyPolicy.cost`'s) of `width` columns: `"narrow"` (1), `"short"` (`short`, a
    short round's width; None: none), `"wide"` (`B`) or `"tree"` (`tree_width(B)`), the widths `verify_width`
    gives."""
    kinds = {1: "narrow", block_size: "wide", tree_width(block_size): "tree"}
    if short is not None:
        kinds[short] = "short"
    if width not in kinds:
        raise RuntimeError(f"A verify pass of {width} columns is none of the policy's widths {sorted(kinds)}")
    return kinds[width]


def tree_width(block_size: int) -> int:
    """Columns of a verify pass over two branches: the anchor, then `B - 1` drafts of each."""
    return 2 * block_size - 1


def rate(tokens: float, seconds: float) -> float:
    """Tokens per second; a round of passes not measured yet (0 s) is infinitely fast (it is tried)."""
    return tokens / seconds if seconds > 0 else float("inf")


DEFAULT_BLOCK_SIZE = 16  # the verify width of prompt lookup without a drafter, unless `lookup=` gives its drafts


def policy_for(model, block_size: int, compiled: bool, lookup: bool = False,
               drafting: Hashable = "sync") -> VerifyPolicy:
    """The `VerifyPolicy` kept on `model` (the drafter, else the target) in `model.d3d_verify_policies`, one per block
    size, mode (compiled passes cost other seconds than eager ones), drafting (`"sync"`, or asynchronous drafting's
    budget `("async", C, F)`: a worker drafting beside the target slows its passes, 3.4x a wide pass at one row on a
    2-core CPU, and hides most of the drafter's) and chooser (with a lookup or not: beside a lookup, the drafter's
    block is verified where no good lookup was found, and keeps less there than on average), made on first use: what
    it measured and learnt serves the next call of the same kind. Keys of rows are the engine's own objects, so
    engines sharing it do not mix their rows."""
    policies = model.__dict__.setdefault("d3d_verify_policies", {})
    return policies.setdefault((block_size, compiled, lookup, drafting), VerifyPolicy(block_size))


def make_chooser(lookup, policy, block_size: int | None, holder=None, compiled: bool = False,
                 drafting: Hashable = "sync") -> tuple[LookupSource | None, "VerifyPolicy | None"]:
    """The front doors' settings as engine parts. lookup: None (the default: True beside a drafter whose rounds the
    policy chooses, the hybrid, else False), False, True or an integer (at most that many drafts a
    round; True: without a drafter `B - 1`, beside one `tree_width(B) - 1`, what a long round verifies, else the
    first `B - 1`: `RoundPlan.long`). Without a drafter any number >= 1, and the verify pass is that many plus one
    columns wide; beside one at most `tree_width(B) - 1` (where the text repeats, lookups longer than a block keep
    more, docs/results.md). policy: None or True (a
    `VerifyPolicy`: the default whenever there is a drafter or a lookup), a `VerifyPolicy`, or False (the drafter's
    whole block every round, the paper's rule). Lookup needs the policy (it decides when a lookup is worth
    verifying). block_size: the drafter's (None: no drafter, and the verify width is the lookup's, else
    `DEFAULT_BLOCK_SIZE`); holder: the model that keeps a policy made here across calls (`policy_for`: one per
    mode, `compiled`, per `drafting`, and per chooser; None: a new one). Returns (None, None) with neither a drafter
    nor a lookup (the target alone). Raises `ValueError` for settings of the wrong kind."""
    has_drafter = block_size is not None
    if policy is not None and not isinstance(policy, (bool, VerifyPolicy)):
        raise ValueError(f"policy must be True, False or a VerifyPolicy, got {policy!r}")
    if lookup is None:
        lookup = has_drafter and policy is not False
    if not isinstance(lookup, (bool, int)) or (not isinstance(lookup, bool) and lookup < 1):
        raise ValueError(f"lookup must be True, False or the most drafts a lookup proposes (an integer >= 1), "
                         f"got {lookup!r}")
    if not has_drafter:  # the lookup's own verify width: its drafts and the anchor
        block_size = DEFAULT_BLOCK_SIZE if isinstance(lookup, bool) else lookup + 1
    source = None
    if lookup is not False:
        longest = tree_width(block_size) - 1 if has_drafter else None
        source = LookupSource(block_size, max_drafts=longest if lookup is True else lookup)
    if source is not None and policy is False:
        raise ValueError("lookup=True needs the verify policy (policy=True, or leave policy unset): it decides per "
                         "row when a lookup is worth verifying")
    if isinstance(policy, VerifyPolicy):
        check_policy_width(policy, block_size)
        return source, policy
    if policy is False or (source is None and not has_drafter):
        return source, None
    return source, (policy_for(holder, block_size, compiled, source is not None, drafting) if holder is not None
                    else VerifyPolicy(block_size))


def check_policy_width(policy: VerifyPolicy, block_size: int) -> None:
    """Raise `ValueError` unless `policy` plans rounds of `block_size` columns (the drafter's or the lookup's `B`)."""
    if policy.block_size != block_size:
        raise ValueError(f"The policy's block size {policy.block_size} differs from the verify width {block_size} "
                         "(the drafter's or the lookup's block size)")


def apply_plan(plan: RoundPlan, proposal: Proposal | None, lookups: list[list[int]], vocab_size: int,
               sampled: bool, device: torch.device, block_size: int) -> tuple[RoundPlan, Proposal | None]:
    """The round's proposal as `plan` says: the drafter's `proposal` (None: it did not run) with each `LOOKUP` row's
    drafts replaced by its lookup continuation (q one-hot; its first `B - 1` drafts, all of them in a long round,
    `RoundPlan.long`, as many as a short round's pass holds in a short one), each `NOTHING` row's drafts dropped, and
    each `BOTH` row's continuation as the second branch (`Proposal.second`), unless one branch's drafts begin with the
    other's: then the row verifies only the longer (a second branch could keep nothing more). Returns the plan as
    applied (`B` wide when no tree or long lookup is left) and the proposal, None when the round verifies no drafts (a
    1-column pass); a round's drafts (and q) are its pass's width less the anchor (a tree's: `B - 1`), zeros past a
    row's own. sampled: whether any row samples (then q is kept for every row); block_size: `B`, the verify width of one
    proposal."""
    if BOTH in plan.choices:
        plan = untangled(plan, proposal, lookups, block_size)
    if plan.width == 1:
        return plan, None
    if proposal is not None and all(choice == BLOCK for choice in plan.choices):
        return plan, proposal
    rows, branch = len(plan.choices), block_size - 1  # the drafts of a branch
    width = branch if BOTH in plan.choices else plan.width - 1  # the drafts' columns
    if proposal is None:
        proposal = Proposal(torch.zeros(rows, width, dtype=torch.long, device=device),
                            torch.zeros(rows, dtype=torch.long, device=device),
                            torch.zeros(rows, width, vocab_size, device=device) if sampled else None,
                            [False] * rows, [False] * rows)
    padding = width - proposal.drafts.shape[1]
    drafts = torch.nn.functional.pad(proposal.drafts, (0, padding))
    num_drafts = proposal.num_drafts.clone()
    logits = None if proposal.logits is None else torch.nn.functional.pad(proposal.logits, (0, 0, 0, padding))
    second = num_second = None
    if BOTH in plan.choices:
        second = torch.zeros(rows, branch, dtype=torch.long)
        num_second = torch.zeros(rows, dtype=torch.long)
    for r, (choice, found) in enumerate(zip(plan.choices, lookups)):
        if choice == NOTHING:
            num_drafts[r] = 0
        elif choice in (LOOKUP, BOTH):
            found = found[: width if plan.long is not None and plan.long[r] else min(width, branch)]
            tokens = torch.tensor(found + [0] * (width - len(found)))
            if choice == BOTH:
                second[r], num_second[r] = tokens[:branch], len(found)
                continue
            drafts[r], num_drafts[r] = tokens.to(drafts.device), len(found)
            if logits is not None:
                logits[r] = one_hot_logits(tokens, vocab_size).to(logits.device)
    if second is not None:
        second, num_second = second.to(drafts.device), num_second.to(drafts.device)
    return plan, replace(proposal, drafts=drafts, num_drafts=num_drafts, logits=logits, second=second,
                         num_second=num_second)


def untangled(plan: RoundPlan, proposal: Proposal, lookups: list[list[int]], block_size: int) -> RoundPlan:
    """`plan` with each `BOTH` row whose block and lookup drafts begin one with the other verifying only the longer
    (`BLOCK` or `LOOKUP`): a tree keeps more only where the two differ. Where no tree is left, a row turned `LOOKUP`
    whose continuation goes past a block's drafts verifies it whole (a long round: the pass of the tree's width the
    plan priced). Reads the drafts to the host."""
    choices = list(plan.choices)
    rows = [r for r, choice in enumerate(choices) if choice == BOTH]
    blocks = proposal.drafts[rows].tolist()
    counts = proposal.num_drafts[rows].tolist()
    for r, block, count in zip(rows, blocks, counts):
        block, found = block[:count], lookups[r]
        shorter = min(len(block), len(found))
        if block[:shorter] == found[:shorter]:
            choices[r] = LOOKUP if len(found) > len(block) else BLOCK
    long = kept_long(choices, [r in rows and len(lookups[r]) > block_size - 1 for r in range(len(choices))])
    return RoundPlan(choices, plan.drafter, verify_width(choices, block_size, long is not None), plan.alone,
                     plan.matches, long)


def kept_long(choices: list[str], long: list[bool] | None) -> list[bool] | None:
    """`RoundPlan.long` of a round whose rows verify `choices`: `long` kept for its `LOOKUP` rows when no row verifies
    both (a tree's branches are `B - 1` drafts each); None when no long lookup is left."""
    if long is None or BOTH in choices:
        return None
    long = [is_long and choice == LOOKUP for is_long, choice in zip(long, choices)]
    return long if any(long) else None


__all__ = ["BLOCK", "BOTH", "DEFAULT_BLOCK_SIZE", "FULL", "LONG", "LOOKUP", "NOTHING", "RoundPlan", "RowHistory",
           "SHORT", "SHORT_DRAFTS", "VerifyPolicy", "age_bucket", "apply_plan", "check_policy_width", "kept_long",
           "make_chooser", "match_bucket", "pass_kind", "policy_for", "tree_width", "untangled", "verify_width"]
