"""The one chooser: per row and round, what a round verifies: nothing (a plain target step), the drafter's block, or
a lookup continuation (`lookup_d3d`).

A round's cost is shared by its rows: one target pass, 1 column wide when no row verifies drafts, else `B` wide,
plus one drafter pass when any row verifies the drafter's block. `VerifyPolicy.plan` picks, before the round, the
kind of round with the most expected tokens per second (`RoundPlan`): expected tokens from each row's acceptance so
far (accepted drafts per round, for the drafter's blocks and for lookups, smoothed), seconds from the rounds this
engine has run (smoothed, per batch size; a cost not measured yet is taken as the cheapest it can be, so the round
that measures it is tried). A row that has not verified the drafter's block for `probe_every` rounds verifies it
again (its acceptance may have changed), and likewise a lookup it found, so an engine never stops learning.

Lossless whatever it decides: the decision reads past rounds and the proposals' own contents (lookup drafts are a
function of the text), never the target's logits of this round nor the drafter's sampled tokens (which would change
which draws are verified, and so their distribution). `tests/test_policy_d3d.py` shows a chooser that peeks failing
the χ² test.
"""

from dataclasses import dataclass, field

import torch

from .lookup_d3d import LookupSource, one_hot_logits
from .sources_d3d import Proposal

NOTHING, BLOCK, LOOKUP = "nothing", "block", "lookup"
OUTLIER = 2.0  # a measured pass above this many times its estimate is counted as this many (see `_measure`)


@dataclass
class RoundPlan:
    """What one round verifies: `choices[r]` per row (`NOTHING`, `BLOCK`, `LOOKUP`); `drafter`: whether the
    drafter's pass runs; `width`: the verify pass's columns (1, or `B` when any row verifies drafts)."""

    choices: list[str]
    drafter: bool
    width: int


@dataclass
class RowHistory:
    """One row's smoothed accepted drafts per round when it verified the drafter's block and a lookup, and the rounds
    since it last verified each."""

    block: float
    lookup: float
    since_block: int = 0
    since_lookup: int = 0


@dataclass
class VerifyPolicy:
    """Maximises expected tokens per second (see the module docstring). block_size: the verify width `B`; smoothing:
    the weight of the newest observation in every average; probe_every: rounds a row may go without verifying the
    drafter's block, or a lookup it found (each doubled after a probe of its kind that kept nothing, up to 8x, and
    reset by one that kept a draft: `interval`, `lookup_interval`);
    costs: seconds per kind of pass (`"narrow"`, `"wide"`, `"drafter"`) to use instead of measured ones (then
    decisions do not depend on timing: reproducible rounds); pooling: the weight of the drafter's pooled acceptance
    (`priors`: the mean over every row and round, its start counted as one round, moving by at least
    `pool_smoothing` a round once many were seen) in a row's expected drafts from its block, the rest its own
    average (a row's few latest rounds say little: a hard stretch of text does not make a good drafter worth
    skipping). What it learns (costs; `priors`, where new rows start) carries over from call to call when it is kept
    (`policy_for`)."""

    block_size: int
    smoothing: float = 0.25
    probe_every: int = 16
    costs: dict[str, float] | None = None
    pooling: float = 0.5
    pool_smoothing: float = 0.03
    measured: dict[tuple[str, int], float] = field(default_factory=dict)
    history: dict = field(default_factory=dict)
    priors: dict[str, float] = field(default_factory=dict)
    pooled_rounds: dict[str, int] = field(default_factory=dict)
    interval: int = 0
    lookup_interval: int = 0

    def __post_init__(self):
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {self.smoothing!r}")
        if not 0 <= self.pooling <= 1 or not 0 < self.pool_smoothing <= 1:
            raise ValueError(f"pooling must be in [0, 1] and pool_smoothing in (0, 1], got {self.pooling!r}, "
                             f"{self.pool_smoothing!r}")
        if isinstance(self.probe_every, bool) or not isinstance(self.probe_every, int) or self.probe_every < 1:
            raise ValueError(f"probe_every must be an integer >= 1, got {self.probe_every!r}")
        self.priors = self.priors or {BLOCK: (self.block_size - 1) / 2, LOOKUP: (self.block_size - 1) / 2}
        self.interval = self.interval or self.probe_every
        self.lookup_interval = self.lookup_interval or self.probe_every

    def cost(self, kind: str, rows: int) -> float:
        """Seconds of a pass of `kind` over `rows` rows: given, measured, or (not measured yet) the cheapest it can
        be: a narrow pass and a drafter pass free, a wide pass as a narrow one. So the first round at a batch size
        is a plain step, which measures the narrow pass (were it priced as a wide one, a drafter that keeps a few
        tokens would win every round and the narrow pass never be measured, however dear wide rounds are: at 16
        rows on a CPU they cost 4-5 narrow ones). A narrow pass never counts as dearer than a wide one: a slow narrow
        round (a pause of the process) would otherwise make every round draft."""
        if self.costs is not None:
            return self.costs[kind]
        if kind == "narrow":
            if ("narrow", rows) not in self.measured:
                return 0.0
            return min(self.measured[(k, rows)] for k in ("narrow", "wide") if (k, rows) in self.measured)
        if (kind, rows) in self.measured:
            return self.measured[(kind, rows)]
        if kind == "wide":
            return self.measured.get(("narrow", rows), 1.0)
        return 0.0

    def row(self, key) -> RowHistory:
        """`key`'s history; a new row starts from the priors (at first optimistic: half a block accepted)."""
        if key not in self.history:
            self.history[key] = RowHistory(block=self.priors[BLOCK], lookup=self.priors[LOOKUP])
        return self.history[key]

    def plan(self, keys: list, lookups: list[list[int]], drafter: bool) -> RoundPlan:
        """The round for rows `keys` with lookup continuations `lookups` (empty: none found); `drafter`: whether
        the engine has a drafter source."""
        rows = len(keys)
        history = [self.row(key) for key in keys]
        lookup_gain = [min(h.lookup, len(found)) if found else 0.0 for h, found in zip(history, lookups)]
        pooled = self.pooling * self.priors[BLOCK]
        block_gain = [(1 - self.pooling) * h.block + pooled if drafter else 0.0 for h in history]
        narrow, wide = self.cost("narrow", rows), self.cost("wide", rows)
        options = [(rate(rows, narrow), 0, [NOTHING] * rows)]
        if any(lookups):
            options.append((rate(rows + sum(lookup_gain), wide), 1,
                            [LOOKUP if found else NOTHING for found in lookups]))
        if drafter:
            gains = [max(b, g) for b, g in zip(block_gain, lookup_gain)]
            choices = [LOOKUP if g > b else BLOCK for b, g in zip(block_gain, lookup_gain)]
            drafting = self.cost("drafter", rows) if BLOCK in choices else 0.0
            options.append((rate(rows + sum(gains), wide + drafting), 2, choices))
            probes = [h.since_block >= self.interval for h in history]
            if any(probes):
                options = [(0.0, 3, [BLOCK if probe else choice for probe, choice in zip(probes, choices)])]
        _, _, choices = max(options, key=lambda option: option[:2])
        # a row that found a continuation but has not verified one for `lookup_interval` rounds verifies it (its
        # estimate, learnt only from verified lookups, would otherwise never come back up)
        choices = [LOOKUP if found and choice == NOTHING and h.since_lookup >= self.lookup_interval else choice
                   for choice, found, h in zip(choices, lookups, history)]
        verifies = any(choice != NOTHING for choice in choices)
        return RoundPlan(choices, BLOCK in choices, self.block_size if verifies else 1)

    def observe(self, keys: list, plan: RoundPlan, accepted_drafts: list[int], verify_seconds: float,
                drafter_seconds: float) -> None:
        """What the round of `plan` kept per row (`accepted_drafts`, for rows that went on) and what its passes cost."""
        rows, rate = len(keys), self.smoothing
        self._measure("wide" if plan.width > 1 else "narrow", rows, verify_seconds)
        if plan.drafter:
            self._measure("drafter", rows, drafter_seconds)
        for key, choice, accepted in zip(keys, plan.choices, accepted_drafts):
            history = self.row(key)
            if choice == BLOCK and history.since_block >= self.interval:  # a probe: back off while they keep nothing
                self.interval = self._backoff(self.interval, accepted)
            if choice == LOOKUP and history.since_lookup >= self.lookup_interval:  # a lookup probe: the same
                self.lookup_interval = self._backoff(self.lookup_interval, accepted)
            history.since_block = 0 if choice == BLOCK else history.since_block + 1
            history.since_lookup = 0 if choice == LOOKUP else history.since_lookup + 1
            if choice in (BLOCK, LOOKUP):
                kind = BLOCK if choice == BLOCK else LOOKUP
                setattr(history, kind, getattr(history, kind) + rate * (accepted - getattr(history, kind)))
                seen = self.pooled_rounds[kind] = self.pooled_rounds.get(kind, 0) + 1
                self.priors[kind] += max(self.pool_smoothing, 1 / (seen + 1)) * (accepted - self.priors[kind])

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
        that pass must not jump on one slow round)."""
        old = self.measured.get((kind, rows))
        if old is not None:
            seconds = old + self.smoothing * (min(seconds, OUTLIER * old) - old)
        self.measured[(kind, rows)] = seconds


def rate(tokens: float, seconds: float) -> float:
    """Tokens per second; a round of passes not measured yet (0 s) is infinitely fast (it is tried)."""
    return tokens / seconds if seconds > 0 else float("inf")


DEFAULT_BLOCK_SIZE = 16  # the verify width of prompt lookup without a drafter


def policy_for(model, block_size: int, compiled: bool) -> VerifyPolicy:
    """The `VerifyPolicy` kept on `model` (the drafter, else the target) in `model.d3d_verify_policies`, one per block
    size and mode (compiled passes cost other seconds than eager ones), made on first use: what it measured and learnt
    serves the next call. Keys of rows are the engine's own objects, so engines sharing it do not mix their rows."""
    policies = model.__dict__.setdefault("d3d_verify_policies", {})
    return policies.setdefault((block_size, compiled), VerifyPolicy(block_size))


def make_chooser(lookup, policy, block_size: int | None, holder=None,
                 compiled: bool = False) -> tuple[LookupSource | None, "VerifyPolicy | None"]:
    """The front doors' settings as engine parts. lookup: False, True (up to `B - 1` drafts a round) or an integer
    (at most that many); policy: None or True (a `VerifyPolicy`: the default whenever there is a drafter or a
    lookup), a `VerifyPolicy`, or False (the drafter's whole block every round, the paper's rule). Lookup needs the
    policy (it decides when a lookup is worth verifying). block_size: the drafter's (None: no drafter,
    `DEFAULT_BLOCK_SIZE`); holder: the model that keeps a policy made here across calls (`policy_for`, per mode:
    `compiled`; None: a new one). Returns (None, None) with neither a drafter nor a lookup (the target alone).
    Raises `ValueError` for settings of the wrong kind."""
    drafting = block_size is not None
    block_size = block_size or DEFAULT_BLOCK_SIZE
    if policy is not None and not isinstance(policy, (bool, VerifyPolicy)):
        raise ValueError(f"policy must be True, False or a VerifyPolicy, got {policy!r}")
    if not isinstance(lookup, (bool, int)):
        raise ValueError(f"lookup must be True, False or the most drafts a lookup proposes (an integer), got {lookup!r}")
    source = None
    if lookup is not False:
        source = LookupSource(block_size, max_drafts=None if lookup is True else lookup)
    if source is not None and policy is False:
        raise ValueError("lookup=True needs the verify policy (policy=True, or leave policy unset): it decides per "
                         "row when a lookup is worth verifying")
    if isinstance(policy, VerifyPolicy):
        if policy.block_size != block_size:
            raise ValueError(f"The policy's block size {policy.block_size} differs from the verify width {block_size}")
        return source, policy
    if policy is False or (source is None and not drafting):
        return source, None
    return source, policy_for(holder, block_size, compiled) if holder is not None else VerifyPolicy(block_size)


def apply_plan(plan: RoundPlan, proposal: Proposal | None, lookups: list[list[int]], vocab_size: int,
               sampled: bool, device: torch.device) -> Proposal | None:
    """The round's proposal as `plan` says: the drafter's `proposal` (None: it did not run) with each `LOOKUP` row's
    drafts replaced by its lookup continuation (q one-hot) and each `NOTHING` row's drafts dropped; None when the
    round verifies no drafts (a 1-column pass). sampled: whether any row samples (then q is kept for every row)."""
    if plan.width == 1:
        return None
    if proposal is not None and all(choice == BLOCK for choice in plan.choices):
        return proposal
    rows, width = len(plan.choices), plan.width - 1
    if proposal is None:
        proposal = Proposal(torch.zeros(rows, width, dtype=torch.long, device=device),
                            torch.zeros(rows, dtype=torch.long, device=device),
                            torch.zeros(rows, width, vocab_size, device=device) if sampled else None,
                            [False] * rows, [False] * rows)
    drafts, num_drafts = proposal.drafts.clone(), proposal.num_drafts.clone()
    logits = proposal.logits.clone() if proposal.logits is not None else None
    for r, (choice, found) in enumerate(zip(plan.choices, lookups)):
        if choice == NOTHING:
            num_drafts[r] = 0
        elif choice == LOOKUP:
            tokens = torch.tensor(found + [0] * (width - len(found)), device=drafts.device)
            drafts[r], num_drafts[r] = tokens, len(found)
            if logits is not None:
                logits[r] = one_hot_logits(tokens, vocab_size).to(logits.device)
    return Proposal(drafts, num_drafts, logits, proposal.looked_up, proposal.hits, proposal.exposed_seconds,
                    proposal.errors)


__all__ = ["BLOCK", "DEFAULT_BLOCK_SIZE", "LOOKUP", "NOTHING", "RoundPlan", "RowHistory", "VerifyPolicy", "apply_plan",
           "make_chooser", "policy_for"]
