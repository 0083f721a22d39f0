"""Scripted plans for the engine's tests: `EveryChoice` makes every round verify each kind of proposal in turn, so
identity and distribution tests cover nothing, the drafter's block and lookups, mixed in one batch and alone."""

from modeling_d3d.policy_d3d import BLOCK, LOOKUP, NOTHING, RoundPlan, VerifyPolicy


class EveryChoice(VerifyPolicy):
    """Row `r` of round `n` verifies nothing, the drafter's block or its lookup continuation by `(n + r) % 3` (a
    lookup with no continuation: the block; no drafter: nothing). Its decisions read nothing of the round's
    verification, as the real policy's."""

    def __init__(self, block_size: int):
        super().__init__(block_size)
        self.round = 0

    def plan(self, keys: list, lookups: list[list[int]], drafter: bool) -> RoundPlan:
        self.round += 1
        choices = []
        for r, found in enumerate(lookups):
            choice = (NOTHING, BLOCK, LOOKUP)[(self.round + r) % 3]
            if choice == LOOKUP and not found:
                choice = BLOCK
            if choice == BLOCK and not drafter:
                choice = NOTHING
            choices.append(choice)
        verifies = any(choice != NOTHING for choice in choices)
        return RoundPlan(choices, BLOCK in choices, self.block_size if verifies else 1)
