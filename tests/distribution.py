"""The exact distribution of a target's first sampled tokens, and a chi-square test against it."""

from collections import Counter

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

VOCAB = 8
NEW_TOKENS = 3
SAMPLES = 2500
BROKEN_SAMPLES = 700  # enough for a broken sampler to fail by far (p < 1e-17 in the tests that show it)
SETTINGS = dict(temperature=0.7, top_k=5, top_p=0.9)
PROMPT = torch.tensor([[1, 5, 2, 7]])


def processors() -> LogitsProcessorList:
    return LogitsProcessorList(
        [TemperatureLogitsWarper(SETTINGS["temperature"]), TopKLogitsWarper(SETTINGS["top_k"]), TopPLogitsWarper(SETTINGS["top_p"])]
    )


def sampled_counts(target, seed: int, samples: int = SAMPLES, rows: int = 1, **generate_kwargs) -> Counter:
    """How often each continuation of NEW_TOKENS tokens came out of `samples` sampled rows, `rows` identical rows per
    `generate` call (assisted decoding takes one row a call; plain sampling draws each row independently)."""
    torch.manual_seed(seed)
    counts = Counter()
    for start in range(0, samples, rows):
        prompts = PROMPT.expand(min(rows, samples - start), -1)
        out = target.generate(prompts, max_new_tokens=NEW_TOKENS, do_sample=True, **SETTINGS, **generate_kwargs)
        counts.update(tuple(row) for row in out[:, PROMPT.shape[1] :].tolist())
    return counts


@torch.no_grad()
def exact_distribution(target, prompt: torch.Tensor = PROMPT) -> dict[tuple[int, ...], float]:
    """P(first NEW_TOKENS tokens after `prompt` `(1, L)`) under the target with the sampling processors, by
    enumerating every prefix."""
    distribution = {(): 1.0}
    for _ in range(NEW_TOKENS):
        extended = {}
        for continuation, probability in distribution.items():
            if probability == 0.0:
                continue
            ids = torch.cat([prompt, torch.tensor([continuation], dtype=torch.long).reshape(1, -1)], dim=1)
            logits = target(ids).logits[:, -1].float()
            step = processors()(ids, logits).softmax(-1)[0]
            for token in range(VOCAB):
                extended[continuation + (token,)] = probability * step[token].item()
        distribution = extended
    return distribution


def chi_square_p_value(counts: Counter, expected: dict[tuple[int, ...], float], samples: int) -> float:
    """Pearson chi-square p-value; outcomes with fewer than 5 expected draws are pooled into one cell."""
    cells, pooled_expected, pooled_observed = [], 0.0, 0
    for outcome, probability in expected.items():
        if probability * samples >= 5:
            cells.append((counts.get(outcome, 0), probability * samples))
        else:
            pooled_expected += probability * samples
            pooled_observed += counts.get(outcome, 0)
    if pooled_expected > 0:
        cells.append((pooled_observed, pooled_expected))
    unexpected = sum(n for outcome, n in counts.items() if outcome not in expected or expected[outcome] == 0)
    if unexpected:
        return 0.0
    statistic = sum((observed - mean) ** 2 / mean for observed, mean in cells)
    dof = len(cells) - 1
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(statistic / 2, dtype=torch.float64)).item()
