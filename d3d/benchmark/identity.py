"""What a method's output that differs from the target's own greedy output means. In float32 identity is checked
exactly: any difference fails. In bfloat16 (or float16), verifying several tokens in one pass rounds differently from
one-token steps, so where the target's own two best tokens nearly tie the pick can flip, for every speculative method:
such a mismatch is a near-tie (reported, not a failure); any other is a divergence (a failure)."""

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

# Top-2 logit margin, relative to the top logit, under which a flip is rounding: 8 bfloat16 roundings (2^-8 each).
NEAR_TIE = 2**-5
CANDIDATES = 8  # the best tokens of the low-precision logits whose logits are recomputed in float32


def checks_exactly(target) -> bool:
    """Whether `target`'s outputs are compared token for token (float32) rather than up to near-ties."""
    return target.dtype == torch.float32


def top2_margin(logits: torch.Tensor) -> tuple[list[int], float]:
    """The two best entries of `logits` `(vocab,)` (indices) and their gap relative to the best logit (at least 1 in
    magnitude): what `NEAR_TIE` is compared with."""
    best = logits.topk(2)
    return best.indices.tolist(), float(best.values[0] - best.values[1]) / max(1.0, float(best.values[0].abs()))


@torch.no_grad()
def top2_in_float32(target, ids: list[int]) -> tuple[list[int], float]:
    """The target's two best next tokens after `ids` and their margin relative to the best logit: the logits of its
    best candidates recomputed in float32 from its last hidden state `(hidden,)` and its output layer's rows."""
    inputs = torch.tensor([ids], device=target.device)
    hidden = target.get_decoder()(input_ids=inputs).last_hidden_state[0, -1]
    head = target.get_output_embeddings()
    candidates = head(hidden).topk(min(CANDIDATES, head.weight.shape[0])).indices
    logits = head.weight[candidates].float() @ hidden.float()
    if head.bias is not None:
        logits += head.bias[candidates].float()
    top2, margin = top2_margin(logits)
    return candidates[top2].tolist(), margin


def classify(target, prompts: list[torch.Tensor], reference: list[list[int]], outputs: list[list[int]],
             either_order: bool = False) -> dict:
    """Counts of `outputs` (one per prompt `(1, L)`) against the target's `reference`: identical, near-ties (the
    first differing token is the target's runner-up at a near-tie) and divergences (any other difference, and every
    difference when `checks_exactly(target)`). `either_order`: `reference` is another engine's greedy output (vLLM
    alone), not `target`'s own, so at a near-tie either of the two tokens may be `target`'s best."""
    counts = {"identical": 0, "near_ties": 0, "divergences": 0}
    for prompt, expected, got in zip(prompts, reference, outputs):
        if expected == got:
            counts["identical"] += 1
            continue
        first = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), None)
        near_tie = False
        if first is not None and not checks_exactly(target):
            top2, margin = top2_in_float32(target, prompt[0].tolist() + expected[:first])
            pair = [expected[first], got[first]]
            near_tie = margin <= NEAR_TIE and (top2 == pair or (either_order and top2 == pair[::-1]))
        counts["near_ties" if near_tie else "divergences"] += 1
    return counts


# What `generate` samples with where neither the call nor the model's generation config sets a value: transformers'
# documented defaults (top-k 50: "sampling at T=1.0" draws from the 50 likeliest tokens unless told otherwise).
GENERATE_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50}


def effective_sampling(target, sampling: dict) -> dict:
    """`sampling` (`do_sample` and any of temperature, top_p, top_k) with every setting `target.generate` would use
    for it: the call's, else the target's generation config's, else `GENERATE_DEFAULTS`. Given to every method
    explicitly, the draws and the distribution they are checked against are the same one."""
    config = target.generation_config
    settings = {}
    for name, default in GENERATE_DEFAULTS.items():
        value = sampling.get(name)
        value = getattr(config, name, None) if value is None else value
        settings[name] = default if value is None else value
    return {**sampling, **settings}


def sampling_processors(sampling: dict) -> LogitsProcessorList:
    """The warpers `generate` builds for `sampling` (temperature, then top-k, then top-p)."""
    processors = LogitsProcessorList()
    if sampling.get("temperature") not in (None, 1.0):
        processors.append(TemperatureLogitsWarper(sampling["temperature"]))
    if sampling.get("top_k"):
        processors.append(TopKLogitsWarper(sampling["top_k"]))
    if sampling.get("top_p") not in (None, 1.0):
        processors.append(TopPLogitsWarper(sampling["top_p"]))
    return processors


@torch.no_grad()
def output_logits(target, prompt: torch.Tensor, output: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of the target over `prompt` `(1, L)` and `output`: the ids `(1, L + n)` and the float32 logits
    `(n, vocab)` that predict each token of `output`."""
    ids = torch.cat([prompt[0].cpu(), torch.tensor(output, dtype=torch.long)])[None].to(target.device)
    return ids, target(ids).logits[0, prompt.shape[1] - 1 : -1].float()


def processed_probabilities(ids: torch.Tensor, logits: torch.Tensor, sampling: dict) -> torch.Tensor:
    """`output_logits`' logits `(n, vocab)` processed as sampling with `sampling` does, each with its context (the
    ids before its token), as probabilities `(n, vocab)`."""
    processors, start = sampling_processors(sampling), ids.shape[1] - logits.shape[0]
    rows = [processors(ids[:, : start + j], logits[j : j + 1]) for j in range(logits.shape[0])]
    return torch.cat(rows).softmax(-1) if rows else logits.new_zeros(0, logits.shape[-1])


def output_probabilities(target, prompt: torch.Tensor, output: list[int], sampling: dict) -> torch.Tensor:
    """The target's processed next-token probabilities `(len(output), vocab)` at each token of `output` after
    `prompt` `(1, L)` (what sampling with `sampling` draws each token from)."""
    return processed_probabilities(*output_logits(target, prompt, output), sampling)


def rounding_allowance(sampling: dict) -> dict:
    """`sampling` with its support widened by what low-precision rounding moves (one more token for top-k, `NEAR_TIE`
    more mass for top-p): a one-token step in bfloat16 may keep a token that the checking pass, over the whole
    sequence at once, ranks just outside the support, as the target's own `generate` does."""
    wider = dict(sampling)
    if sampling.get("top_k"):
        wider["top_k"] = sampling["top_k"] + 1
    if sampling.get("top_p") not in (None, 1.0):
        wider["top_p"] = min(1.0, sampling["top_p"] + NEAR_TIE)
    return wider


def sampled_consistency(target, prompts: list[torch.Tensor], reference: list[list[int]], outputs: list[list[int]],
                        sampling: dict) -> dict:
    """Whether sampled `outputs` look drawn from the target's distribution, by three tests, each of which must pass:
    every token inside the sampling support (in low precision, its `rounding_allowance`: float32 checks it exactly);
    the tokens' randomised probability integral transforms uniform (`uniformity_p_value`, `uniform_p` >= 1e-4: each
    token's value is uniform given the tokens before it, so the values of all tokens of all prompts are independent
    uniforms, a test that bites at a few prompts); and the mean log-probability of their tokens under the target not
    above or below that of the target's own `reference` draws by a paired sign-flip test over prompts (`p` >= 1e-4,
    from 14 prompts on; `z`, the paired difference of the per-prompt means over its standard error, beside it). A
    distribution check, not token identity."""
    differences, outside, transforms = [], 0, []
    exact = checks_exactly(target)
    generator = torch.Generator().manual_seed(0)  # the transforms' own draws: the same check every run
    for prompt, expected, got in zip(prompts, reference, outputs):
        means = []
        for name, tokens in (("reference", expected), ("outputs", got)):
            if not tokens:
                continue
            index = torch.arange(len(tokens)), torch.tensor(tokens)
            ids, logits = output_logits(target, prompt, tokens)
            support = processed_probabilities(ids, logits, sampling if exact else rounding_allowance(sampling))
            support = support.cpu().double()
            outside += int((support[index] == 0).sum()) if name == "outputs" else 0
            means.append(float(support[index].clamp(min=1e-30).log().mean()))
            if name == "outputs":  # the transforms under the exact distribution (in low precision the support is wider)
                probabilities = support if exact else processed_probabilities(ids, logits, sampling).cpu().double()
                transforms.append(probability_transforms(probabilities, index[1], generator))
        if len(means) == 2:
            differences.append(means[1] - means[0])
    d = torch.tensor(differences, dtype=torch.float64)
    error = float(d.std() / len(d) ** 0.5) if len(d) > 1 else float("inf")
    z = float(d.mean()) / error if 0 < error < float("inf") else 0.0
    p = sign_flip_p_value(d)
    uniform_p = uniformity_p_value(torch.cat(transforms)) if transforms else 1.0
    return {"z": z, "p": p, "uniform_p": uniform_p, "outside_support": outside,
            "consistent": outside == 0 and p >= 1e-4 and uniform_p >= 1e-4}


def probability_transforms(probabilities: torch.Tensor, tokens: torch.Tensor, generator: torch.Generator
                           ) -> torch.Tensor:
    """The randomised probability integral transform `(n,)` of each token `tokens[i]` under its distribution
    `probabilities[i]` `(n, vocab)`, the vocabulary ranked likeliest first (ties by id): the mass ranked before the
    token plus a uniform share of its own. Uniform on [0, 1] when the token is drawn from that distribution; draws
    that favour likely tokens (too cold) fall low, draws that favour unlikely ones high."""
    chosen = probabilities.gather(1, tokens[:, None])
    ids = torch.arange(probabilities.shape[1])
    before = (probabilities > chosen) | ((probabilities == chosen) & (ids < tokens[:, None]))
    shares = torch.rand(len(tokens), generator=generator, dtype=probabilities.dtype)
    return (probabilities * before).sum(-1) + shares * chosen[:, 0]


def uniformity_p_value(values: torch.Tensor) -> float:
    """Whether `values` `(n,)` look uniform on [0, 1]: two tests, Bonferroni-combined: their mean against 1/2 (a
    shift: draws too cold or too hot) and Kolmogorov-Smirnov (any other difference)."""
    n = values.numel()
    z = (float(values.double().mean()) - 0.5) * (12 * n) ** 0.5
    shift = float(torch.special.erfc(torch.tensor(abs(z) / 2**0.5, dtype=torch.float64)))
    return min(1.0, 2 * min(shift, kolmogorov_smirnov_p_value(values)))


def kolmogorov_smirnov_p_value(values: torch.Tensor, terms: int = 100) -> float:
    """Kolmogorov-Smirnov test of `values` `(n,)` against the uniform distribution on [0, 1]: the asymptotic p-value
    of the statistic with Stephens' small-sample correction (accurate to about 1 % from n = 5)."""
    n = values.numel()
    ordered = values.double().sort().values
    ranks = torch.arange(1, n + 1, dtype=torch.float64)
    statistic = float(torch.maximum(ranks / n - ordered, ordered - (ranks - 1) / n).max())
    scaled = (n ** 0.5 + 0.12 + 0.11 / n ** 0.5) * statistic
    if scaled < 0.2:  # the tail is 1 to within 1e-20 there, where the alternating series converges slowly
        return 1.0
    k = torch.arange(1, terms + 1, dtype=torch.float64)
    tail = 2 * float(((-1) ** (k - 1) * torch.exp(-2 * k**2 * scaled**2)).sum())
    return min(max(tail, 0.0), 1.0)


def sign_flip_p_value(differences: torch.Tensor, draws: int = 1 << 16) -> float:
    """Two-sided p-value that paired `differences` `(n,)` are centred on 0: the share of sign flips whose mean is
    at least as far from 0 as theirs (every flip for n <= 16, else `draws` seeded random ones). Exact for any n,
    unlike a normal z with few prompts (3 prompts can give |z| > 4 by chance); it cannot reject below 2 / 2**n."""
    n = len(differences)
    if n == 0:
        return 1.0
    if n <= 16:
        signs = ((torch.arange(1 << n)[:, None] >> torch.arange(n)) & 1) * 2 - 1
    else:
        signs = torch.randint(0, 2, (draws, n), generator=torch.Generator().manual_seed(0)) * 2 - 1
    flipped = (signs.to(differences.dtype) * differences).mean(1).abs()
    return float((flipped >= differences.mean().abs() - 1e-12).double().mean())


def ceiling_tau(target, prompts: list[torch.Tensor], outputs: list[list[int]], block_size: int, sampling: dict) -> float:
    """τ a perfect argmax drafter would reach on these outputs: it proposes the target's most probable token at every
    position, accepted with that token's probability (greedy: always), so a round from position s keeps
    `1 + sum_k prod_{j<k} max p_{s+j}` tokens in expectation (up to `B`); averaged over every position of the target's
    own outputs. What no drafter can beat on this run: the target's entropy, not the drafter's fault."""
    gains = []
    for prompt, tokens in zip(prompts, outputs):
        if not tokens:
            continue
        best = output_probabilities(target, prompt, tokens, sampling).max(-1).values.tolist() if sampling else [1.0] * len(tokens)
        for start in range(len(tokens)):
            kept, chance = 1.0, 1.0
            for probability in best[start : start + block_size - 1]:
                chance *= probability
                kept += chance
            gains.append(kept)
    return sum(gains) / len(gains) if gains else float("nan")


__all__ = ["CANDIDATES", "NEAR_TIE", "ceiling_tau", "checks_exactly", "classify", "kolmogorov_smirnov_p_value",
           "output_logits", "output_probabilities", "probability_transforms", "processed_probabilities",
           "rounding_allowance", "sampled_consistency", "sampling_processors", "sign_flip_p_value", "top2_in_float32",
           "top2_margin", "uniformity_p_value"]
