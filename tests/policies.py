"""Scripted plans for the engine's tests: `EveryChoice` makes every round verify each kind of proposal in turn, so
identity and distribution tests cover nothing, the drafter's block, lookups (short, of a block and long) and trees of
both, mixed in one batch and alone."""

from modeling_d3d.policy_d3d import BLOCK, BOTH, LOOKUP, NOTHING, SHORT_DRAFTS, RoundPlan, VerifyPolicy


class EveryChoice(VerifyPolicy):
    """Row `r` of round `n` verifies nothing, the drafter's block, its lookup continuation or both by `(n + r) % 4`
    (both: only a greedy row of an engine that verifies trees, else its lookup; a lookup with no continuation: the
    block; no drafter: nothing). In an engine that verifies trees, every odd round verifies at least one tree where a
    greedy row has a lookup (the first such row whose turn was its lookup or nothing verifies both, when no row's turn
    for both had one: rows of a server join at any round), every even round verifies no tree (a row's turn for both
    is its lookup) and each lookup whole (a long round, `RoundPlan.long`, where a continuation goes past a block's
    drafts). With `short_every`, every such call is a short round where the policy has one
    (`VerifyPolicy.short_width`) and a row has a continuation: each such row verifies its first `short_drafts`, the
    others nothing; it does not count as a round of the turns above. Its decisions read nothing of the round's
    verification, as the real policy's."""

    def __init__(self, block_size: int, short_drafts: int = SHORT_DRAFTS, short_every: int = 0):
        super().__init__(block_size, short_drafts=short_drafts)
        self.round = self.calls = 0
        self.short_every = short_every

    def plan(self, keys: list, lookups: list[list[int]], drafter: bool, greedy: list[bool] | None = None,
             trees: bool = False, matches: list[int] | None = None) -> RoundPlan:
        self.calls += 1
        short = self.short_every and self.calls % self.short_every == 0 and self.short_width() is not None
        if short and any(lookups):
            return self.round_of([LOOKUP if found else NOTHING for found in lookups], short=True)
        self.round += 1
        choices, long = [], trees and self.round % 2 == 0
        for r, found in enumerate(lookups):
            choice = (NOTHING, BLOCK, LOOKUP, BOTH)[(self.round + r) % 4]
            if choice == BOTH and not (trees and greedy[r] and not long):
                choice = LOOKUP
            if choice in (LOOKUP, BOTH) and not found:
                choice = BLOCK
            if choice == BLOCK and not drafter:
                choice = NOTHING
            choices.append(choice)
        if trees and not long and BOTH not in choices:  # no row's turn for both had a lookup: the first greedy row
            # with one whose turn was its lookup or nothing verifies both (never a turn for the block: a lone row's
            # are every fourth round), so that trees are verified however rows join and leave (a server's)
            first = next((r for r, found in enumerate(lookups) if found and greedy[r] and choices[r] != BLOCK), None)
            if first is not None:
                choices[first] = BOTH
        return self.round_of(choices, long=[long and len(found) > self.block_size - 1 for found in lookups])
