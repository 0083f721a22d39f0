"""Prompt lookup in the engine (`LookupSource`): drafts copied from a row's own text, no model.

Per row, the longest suffix of its text (its drafter context: prompt, then the generated tokens; `min_ngram` to
`max_ngram` tokens) that occurred earlier in it; of its latest `CANDIDATES` earlier occurrences, the one whose
preceding text agrees longest with the row's own (its *match*: how many tokens before the drafts agree, at most
`MAX_MATCH`; the latest on a tie); the tokens that followed that occurrence are the drafts (`max_drafts`, copied on
past the text's end: a repeating cycle continues). The match predicts what a lookup keeps (on the quickstart's
repetitive prompts: 2-7 tokens -> ~2 drafts kept, 8-15 -> 8.5, 16+ -> 11-13; docs/results.md), and the verify
policy prices lookups by it (`policy_d3d`). The drafts are a function of the text alone, so their q is one-hot
(`one_hot_logits`) and rejection sampling stays exact. Each row keeps an n-gram index, extended by the tokens a
round adds (a dict per n-gram size: the latest end of each n-gram, every end of each `max_ngram`-gram), so a lookup
costs a few dict reads and at most `CANDIDATES` agreements (a few µs; ~75 µs when every candidate agrees over
nearly `MAX_MATCH` tokens).
"""

from dataclasses import dataclass, field

import torch

MAX_MATCH = 64  # how far back an occurrence's agreement with the row's own text is measured
CANDIDATES = 32  # the latest occurrences of the suffix compared (a common n-gram occurs thousands of times)


def check_lookup_settings(max_ngram: int, min_ngram: int, max_drafts: int, block_size: int) -> None:
    """Raise `ValueError` unless `1 <= min_ngram <= max_ngram` and `1 <= max_drafts <= 2 * block_size - 2`
    (integers): a lookup verified beside a drafter of block size `B` may be verified in a pass of a tree's width
    (`policy_d3d.tree_width`, a hybrid's long rounds); an engine checks it against its own widest pass."""
    values = (max_ngram, min_ngram, max_drafts)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"lookup lengths must be integers, got max_ngram={max_ngram!r}, min_ngram={min_ngram!r}, "
                         f"max_drafts={max_drafts!r}")
    if not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"lookup n-gram lengths must satisfy 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
    if not 1 <= max_drafts <= 2 * block_size - 2:
        raise ValueError(f"a lookup proposes 1..{2 * block_size - 2} drafts (the widest verify pass less the anchor), "
                         f"got {max_drafts}")


@dataclass
class NgramIndex:
    """One row's text and, per n-gram size `n`, where each n-gram of it ended (`text[e - n:e] == ngram`), for every
    end `e < len(text)` (so the text after it is never empty): `ends[n - 1][ngram]` is the latest end for `n <
    max_ngram` (a shorter suffix is looked up only where the next longer one never occurred, so every earlier
    occurrence agrees over exactly `n` tokens and the latest wins), and every end, oldest first, for `max_ngram` (an
    int while it occurred once: one list per repeated n-gram only, not per position)."""

    max_ngram: int
    text: list[int] = field(default_factory=list)
    ends: list[dict] = field(default_factory=list)

    def __post_init__(self):
        self.ends = [{} for _ in range(self.max_ngram)]

    def extend(self, context: list[int]) -> None:
        """Catch up with `context` (the text so far, which only grows): index the n-grams ending before its end.
        Raises `RuntimeError` (an engine bug) for a context shorter than the indexed text or whose token at the
        indexed text's end differs (a check of one token: drafts are verified anyway, but a stale index would draft
        from another text)."""
        old = len(self.text)
        if len(context) < old or (old and context[old - 1] != self.text[old - 1]):
            raise RuntimeError(f"A row's context of {len(context)} tokens does not extend the {old} tokens its lookup "
                               "index holds")
        self.text.extend(context[old:])
        longest = self.ends[-1]
        for end in range(max(old, 1), len(self.text)):
            for n in range(1, min(self.max_ngram, end) + 1):
                key = tuple(self.text[end - n : end])
                if n < self.max_ngram:
                    self.ends[n - 1][key] = end
                elif (seen := longest.get(key)) is None:
                    longest[key] = end
                elif isinstance(seen, int):
                    longest[key] = [seen, end]
                else:
                    seen.append(end)

    def continuation(self, min_ngram: int, count: int) -> tuple[list[int], int]:
        """The `count` tokens that followed the best earlier occurrence of the text's longest suffix of
        `min_ngram..max_ngram` tokens (of its latest `CANDIDATES`, the longest `agreement`, the latest on a tie),
        copied on past the text's end as an overlapping copy does (a text repeating a cycle shorter than `count`
        continues the cycle), and that occurrence's agreement; `([], 0)` when none occurred."""
        for n in range(min(self.max_ngram, len(self.text)), min_ngram - 1, -1):
            found = self.ends[n - 1].get(tuple(self.text[-n:]))
            if found is None:
                continue
            match, end = -1, None
            for candidate in reversed(found[-CANDIDATES:]) if isinstance(found, list) else (found,):
                agrees = self.agreement(candidate)  # the latest first: an older one must agree longer to win
                if agrees > match:
                    match, end = agrees, candidate
                    if match == MAX_MATCH:
                        break
            copied = []
            for k in range(count):
                at = end + k
                copied.append(self.text[at] if at < len(self.text) else copied[at - len(self.text)])
            return copied, match
        return [], 0

    def agreement(self, end: int, chunk: int = 8) -> int:
        """How many tokens before `end` equal the text's last ones (`text[end - k:end] == text[-k:]`), at most
        `MAX_MATCH` and `end`; compared `chunk` tokens at a time."""
        text, length = self.text, len(self.text)
        limit, k = min(MAX_MATCH, end), 0
        while k < limit:
            step = min(chunk, limit - k)
            if text[end - k - step : end - k] != text[length - k - step : length - k]:
                while text[end - 1 - k] == text[length - 1 - k]:  # within this chunk: stops before its end
                    k += 1
                return k
            k += step
        return k


def one_hot_logits(drafts: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """q of deterministic drafts `(rows, m)`: logits `(rows, m, vocab)`, 0 at the draft and -inf elsewhere."""
    logits = torch.full((*drafts.shape, vocab_size), float("-inf"), device=drafts.device)
    return logits.scatter_(-1, drafts[..., None], 0.0)


class LookupSource:
    """Prompt-lookup drafts for every row, from its own text (see the module docstring). Slots are the engine's, as
    for drafter sources (`allocate`, `add`, `move`); `propose` gives each row's continuation, which the engine's
    policy verifies or not (`policy_d3d`)."""

    def __init__(self, block_size: int, max_ngram: int = 4, min_ngram: int = 2, max_drafts: int | None = None):
        max_drafts = block_size - 1 if max_drafts is None else max_drafts
        check_lookup_settings(max_ngram, min_ngram, max_drafts, block_size)
        self.block_size, self.max_ngram, self.min_ngram, self.max_drafts = block_size, max_ngram, min_ngram, max_drafts
        self.rows: list[NgramIndex | None] = []

    def allocate(self, slots: int, capacity: int) -> None:
        self.rows = [None] * slots

    def add(self, first_slot: int, contexts: list[list[int]]) -> None:
        for slot, context in enumerate(contexts, first_slot):
            self.rows[slot] = NgramIndex(self.max_ngram)
            self.rows[slot].extend(context)

    def move(self, from_slot: int, to_slot: int) -> None:
        self.rows[to_slot] = self.rows[from_slot]

    def propose(self, contexts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
        """Each row's drafts (possibly none) and their match (0 for none), its index first caught up with its
        context."""
        drafts, matches = [], []
        for slot, context in enumerate(contexts):
            index = self.rows[slot]
            index.extend(context)
            found, match = index.continuation(self.min_ngram, self.max_drafts)
            drafts.append(found)
            matches.append(match)
        return drafts, matches


__all__ = ["CANDIDATES", "LookupSource", "MAX_MATCH", "NgramIndex", "check_lookup_settings", "one_hot_logits"]
