"""From logits to tokens, batched over rows: each row's logits processing (the target's processors, applied to the
target's and the drafter's logits alike), drafts chosen from the drafter's logits, and the one acceptance routine
(greedy matching and rejection sampling, on the device).

Acceptance inputs are per round: drafts `(rows, m)` with `num_drafts` `(rows,)` real ones per row (the rest padding),
the target's processed logits `(rows, m + 1, vocab)` over `[anchor, drafts]`, and for sampling the proposal's
processed logits `(rows, m, vocab)` (q = softmax). Both return `accepted` `(rows,)` drafts kept and `tokens`
`(rows, m + 1)`: a row adds `tokens[:accepted + 1]` (its accepted drafts, then the target's token).
"""

import inspect
from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessorList
from transformers.generation import logits_process

LOCAL_PROCESSORS = ("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper")
CONTEXT_FREE_PROCESSORS = LOCAL_PROCESSORS + ("TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper",
                                              "TopHLogitsWarper")


@dataclass
class RowSampling:
    """How a row turns drafter logits into drafts: the target's processors, argmax or sampling, its generator.
    device: where the processors were built and the generator lives (the target's device; None: wherever the
    drafter's logits are). The processors hold tensors there (MinNewTokens' EOS ids, SuppressTokens' ids, ...), so
    a row that processes or samples has its drafter logits moved there first (a drafter on another GPU), and its
    drafts and q come out there, where verification reads them."""

    logits_processor: LogitsProcessorList = field(default_factory=LogitsProcessorList)
    do_sample: bool = False
    generator: torch.Generator | None = None
    device: torch.device | None = None

    @property
    def processes(self) -> bool:
        """Whether this row's drafter logits go through its processors or a draw (else: argmax of the raw ones)."""
        return bool(self.logits_processor) or self.do_sample


class RowProcessors(LogitsProcessorList):
    """A row's logits processors, called as `LogitsProcessorList` calls them, each processor's signature read once:
    transformers' list reads every processor's signature on every call (`inspect.signature`, about 0.08 ms each on
    a CPU), and a row calls its list every round, which made a sampled decoding step of a small target measurably
    slower than `generate`'s. A processor that takes more than `(input_ids, scores)` goes through transformers'
    list, with its checks and kwargs. The warpers after a top-k warper run over the k scores it keeps
    (`top_k_candidates`), the same scores out: top-p sorts the whole vocabulary per column otherwise (16 columns of
    4096 on a CPU: 1.07 ms, against 0.18 ms)."""

    def __init__(self, processors=()):
        super().__init__(processors)
        self._takes: dict[int, tuple[object, bool]] = {}  # id -> (processor, takes kwargs); the list may change
        self._after_rules: tuple[tuple, "RowProcessors"] | None = None  # (the list it was made of, the list)

    def acting_from(self, length: int) -> "RowProcessors":
        """The processors that may change the scores of a context of `length` tokens or more: this list (also when it
        holds no length rule), or once every length rule in it (`identity_from`) is past `length`, the list without
        them (made once)."""
        starts = [start for start in map(identity_from, self) if start is not None]
        if not starts or max(starts) > length:
            return self
        processors = tuple(self)
        if self._after_rules is None or self._after_rules[0] != processors:
            self._after_rules = processors, RowProcessors(p for p in processors if identity_from(p) is None)
        return self._after_rules[1]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        split = self._top_k_split()
        for index, processor in enumerate(self):
            if index == split:
                kept = top_k_candidates(processor, scores)
                if kept is not None:  # the rest see the top-k tokens only (every other token stays -inf)
                    values, indices = kept
                    for later in self[index + 1 :]:
                        values = later(input_ids, values)
                    return torch.full_like(scores, processor.filter_value).scatter_(-1, indices, values)
            scores = self._apply(processor, input_ids, scores, kwargs)
        return scores

    def _apply(self, processor, input_ids: torch.LongTensor, scores: torch.Tensor, kwargs: dict) -> torch.Tensor:
        if self._takes_kwargs(processor):
            return LogitsProcessorList([processor])(input_ids, scores, **kwargs)
        return processor(input_ids, scores)

    def _top_k_split(self) -> int | None:
        """The index of the first top-k warper after which every processor acts only on the tokens it keeps
        (`top_k_local`), or None."""
        split = None
        for index in range(len(self) - 1, -1, -1):
            if not top_k_local(self[index]):
                break
            if isinstance(self[index], logits_process.TopKLogitsWarper):
                split = index
        return split

    def _takes_kwargs(self, processor) -> bool:
        known = self._takes.get(id(processor))
        if known is None or known[0] is not processor:
            known = self._takes[id(processor)] = processor, len(inspect.signature(processor.__call__).parameters) > 2
        return known[1]


def top_k_local(processor) -> bool:
    """Whether `processor` (temperature, top-k, top-p, min-p, each filling with -inf) maps scores that are -inf
    outside a set of tokens to scores that are -inf outside it, computed from that set's scores alone: then, after a
    top-k warper, it can be applied to the k kept scores instead of the whole vocabulary."""
    return (isinstance(processor, warper_classes(LOCAL_PROCESSORS))
            and getattr(processor, "filter_value", -float("inf")) == -float("inf"))


def top_k_candidates(warper, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """What the top-k `warper` keeps of scores `(..., vocab)`: its k scores and their token ids `(..., k)`, the same
    tokens `warper(ids, scores)` leaves finite; None where k covers the vocabulary (nothing to gain) or any two of
    the k + 1 highest scores are equal or NaN: a tie at the k-th keeps more than k, and the order of tied scores
    (`torch.sort`'s, unstable) decides which of them a later top-p keeps, so only distinct scores give the same
    tokens for certain. Scores on the CPU only: that check reads them, which on a GPU would stall the host until the
    verify pass is done (a round's one read is its acceptance's), and a GPU sorts a vocabulary per column fast."""
    k = min(warper.top_k, scores.shape[-1])
    if scores.device.type != "cpu" or k + 1 > scores.shape[-1]:
        return None
    values, indices = scores.topk(k + 1, dim=-1)  # descending
    if not bool((values[..., 1:] < values[..., :-1]).all()):  # a tie, or a NaN (which compares false)
        return None
    return values[..., :k], indices[..., :k]


def identity_from(processor) -> int | None:
    """The context length from which `processor` leaves every score as it is, where it reads the context through
    its length only: transformers' `MinLengthLogitsProcessor` and `MinNewTokensLengthLogitsProcessor` (the classes
    themselves), which mask the EOS tokens while the context is shorter; None for any other processor."""
    if type(processor) is logits_process.MinLengthLogitsProcessor:
        return processor.min_length
    if type(processor) is logits_process.MinNewTokensLengthLogitsProcessor:
        return processor.prompt_length_to_skip + processor.min_new_tokens
    return None


def context_free(logits_processor: LogitsProcessorList | None) -> bool:
    """Whether every processor ignores the token ids (temperature, top-k, top-p, ...): then one batched call over
    every position gives what per-position calls with their own contexts give."""
    free = warper_classes(CONTEXT_FREE_PROCESSORS)
    return all(isinstance(processor, free) for processor in (logits_processor or []))


def warper_classes(names: tuple[str, ...]) -> tuple[type, ...]:
    """The classes of transformers' `logits_process` named in `names` that this transformers has."""
    return tuple(getattr(logits_process, name) for name in names if hasattr(logits_process, name))


def ends_row_only(error: BaseException) -> bool:
    """Whether `error`, raised by a row's own code (its logits processors, stopping criteria), ends that row only:
    any exception but a Ctrl-C (`KeyboardInterrupt`), which stops the whole call. A `BaseException` that is not an
    `Exception` (a `SystemExit`, an `asyncio.CancelledError`, a class of the user's) is the row's failure too."""
    return not isinstance(error, KeyboardInterrupt)


def process(logits_processor: LogitsProcessorList | None, contexts: torch.Tensor | list | None, logits: torch.Tensor,
            growing: torch.Tensor | None = None) -> torch.Tensor:
    """Apply one row's processors to its logits `(n, vocab)`, position j with its own context: `contexts` (the row's
    tokens, 1-D) followed by `growing[:j]` when given (the drafts before j), else `contexts` alone. Processors that
    ignore the context are applied to every position in one call, also once the length rules among them
    (`identity_from`: `min_new_tokens`, `min_length`) are past the shortest context (a `RowProcessors`' list, else
    position by position: a verified column cost 0.2 ms on a CPU with `min_new_tokens` set)."""
    if isinstance(logits_processor, RowProcessors) and contexts is not None:  # None: context-free processors
        logits_processor = logits_processor.acting_from(len(contexts))
    if not logits_processor:
        return logits
    if context_free(logits_processor):
        return logits_processor(torch.zeros(logits.shape[0], 1, dtype=torch.long, device=logits.device), logits.clone())
    context = torch.as_tensor(contexts, dtype=torch.long, device=logits.device)
    rows = []
    for j in range(logits.shape[0]):
        ids = context if growing is None else torch.cat([context, growing[:j].to(logits.device)])
        rows.append(logits_processor(ids[None], logits[j : j + 1].clone()))
    return torch.cat(rows)


def choose(logits: torch.Tensor, do_sample: bool, generator: torch.Generator | None) -> torch.Tensor:
    """Draft tokens `(n,)` from processed logits `(n, vocab)`: argmax, or a draw from their softmax. A position
    without mass (its processors left no token, or NaN logits) gets a token inside the vocabulary, so the verify
    pass can read it; verification never keeps it (its q has no mass: `usable_drafts`)."""
    if not do_sample:
        return logits.argmax(-1)
    return draw(logits.softmax(-1), [generator] * logits.shape[0]).clamp_(max=logits.shape[-1] - 1)


def draw(weights: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token `(rows,)` per row of `weights` `(rows, vocab)` (>= 0), drawn with probability proportional to its
    weight, row r with `generators[r]` (None: the global one): where one uniform draw falls in the row's cumulative
    weights, summed in float64. `torch.multinomial` draws an exponential per token of the vocabulary instead (about
    85 us a row of 4096 on a CPU: 1.3 ms for a block's 15 drafts, 1.4 % of a small target's sampled step). A row
    without mass (NaN, or nothing but zeros: processors that left every score -inf) gets the token `vocab`, outside
    the vocabulary, on every device (no read of the weights, which on a GPU would stall the host before the round's
    one read): the engine ends such a row with an error after that read, and the other rows go on."""
    cumulative = weights.to(torch.float64).cumsum(-1)
    total = cumulative[:, -1:]
    uniform = torch.cat([torch.rand(1, dtype=torch.float64, device=weights.device, generator=g) for g in generators])
    # below the total (a draw of 1 - 2^-53 could round up to it): the first column past it has a weight > 0
    below = torch.minimum(uniform[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    tokens = torch.searchsorted(cumulative, below, right=True)[:, 0]
    return torch.where(total[:, 0] > 0, tokens, weights.shape[-1])  # NaN compares false


def drafts_from_logits(raw: torch.Tensor, contexts: list[list[int]], sampling: list[RowSampling],
                       errors: dict[int, BaseException] | None = None):
    """Per row: its processors over raw block logits `(rows, m, vocab)` (context: its tokens), then argmax or a draw.
    Returns drafts `(rows, m)` and the processed logits `(rows, m, vocab)` (the raw ones when no row has
    processors). With `errors`, a row whose processing fails is drafted from its raw logits and its exception is
    put in `errors[row]` (that row ends; the others go on); without, the exception propagates. When a row processes,
    every row's results are on the processors' device (`RowSampling.device`)."""
    if not any(s.processes for s in sampling):
        return raw.argmax(-1), raw
    raw = raw.to(next((s.device for s in sampling if s.device is not None), raw.device))
    rows, drafts = [], []
    for r, (context, s) in enumerate(zip(contexts, sampling)):
        try:
            logits = process(s.logits_processor, context, raw[r])
            tokens = choose(logits, s.do_sample, s.generator)
        except BaseException as error:
            if errors is None or not ends_row_only(error):
                raise
            errors[r] = error
            logits, tokens = raw[r], raw[r].argmax(-1)
        rows.append(logits)
        drafts.append(tokens)
    return torch.stack(drafts), torch.stack(rows)


def greedy_accept(drafts: torch.Tensor, num_drafts: torch.Tensor, target_logits: torch.Tensor):
    """Longest prefix of drafts equal to the target's argmax, then the target's own token."""
    choices = target_logits.argmax(-1)
    if drafts.shape[1] == 0:  # a plain step: nothing to match (its few small operations skipped, every round)
        return torch.zeros(drafts.shape[0], dtype=torch.long, device=drafts.device), choices
    real = torch.arange(drafts.shape[1], device=drafts.device) < num_drafts[:, None]
    accepted = ((drafts == choices[:, :-1]) & real).long().cumprod(1).sum(1)
    return accepted, choices


def rejection_sample(drafts: torch.Tensor, num_drafts: torch.Tensor, draft_logits: torch.Tensor,
                     target_logits: torch.Tensor, generators: list[torch.Generator | None]):
    """Leviathan et al.: accept draft j with probability min(1, p/q); at the first rejection sample from
    norm(max(0, p - q)); after every real draft is accepted, sample the bonus token from p. One generator per row
    (None: the global one). The tokens are distributed exactly as the target's processed p."""
    if drafts.shape[1] == 0:
        return _without_drafts(target_logits, generators)
    p, q, p_draft, q_draft = _draft_probabilities(drafts, draft_logits, target_logits)
    num_drafts = usable_drafts(num_drafts, q_draft)
    draws = _uniforms(drafts, generators, p.device)
    real = torch.arange(drafts.shape[1], device=p.device) < num_drafts[:, None]
    accepted = ((draws * q_draft < p_draft) & real).long().cumprod(1).sum(1)  # u < p/q: never a token p excludes
    return accepted, _finish(drafts, num_drafts, accepted, p, q, p.new_ones(drafts.shape[0], 1), generators)


def block_verify(drafts: torch.Tensor, num_drafts: torch.Tensor, draft_logits: torch.Tensor,
                 target_logits: torch.Tensor, generators: list[torch.Generator | None]):
    """Block verification (Sun et al., "Block Verification Accelerates Speculative Decoding", 2024): the drafts are
    judged jointly, so a later draft that p likes more than q can make up for an earlier one it liked less. With
    `a_0 = 1`, `a_i = min(1, a_{i-1} p_i(y_i) / q_i(y_i))` and the mass `R_i = sum max(0, a_i p_{i+1} - q_{i+1})`,
    prefix `i < n` passes with probability `R_i / (R_i + 1 - a_i)` (1 when that is 0/0), prefix `n` with `a_n`, each
    on its own uniform draw; the longest passing prefix `tau` is kept, then a token from `norm(max(0, a_tau p - q))`
    at position `tau` (from p after all `n` drafts). Same inputs and outputs as `rejection_sample`; the tokens are
    distributed exactly as the target's processed p, and the expected number kept is never smaller."""
    if drafts.shape[1] == 0:
        return _without_drafts(target_logits, generators)
    p, q, p_draft, q_draft = _draft_probabilities(drafts, draft_logits, target_logits)
    num_drafts = usable_drafts(num_drafts, q_draft)
    rows, m = drafts.shape
    scale = [torch.ones(rows, device=p.device, dtype=p.dtype)]  # a_0 .. a_m
    for j in range(m):
        scale.append(torch.minimum(scale[-1] * p_draft[:, j] / q_draft[:, j].clamp(min=1e-30), torch.ones_like(scale[-1])))
    scale = torch.stack(scale, dim=1)  # (rows, m + 1)
    mass = (scale[:, :, None] * p - q).clamp(min=0).sum(-1)  # (rows, m + 1): R_i, the residual's mass after i drafts
    denominator = mass[:, 1:] + 1 - scale[:, 1:]
    passing = torch.where(denominator > 0, mass[:, 1:] / denominator.clamp(min=1e-30), torch.ones_like(denominator))
    lengths = torch.arange(1, m + 1, device=p.device)
    passing = torch.where(lengths == num_drafts[:, None], scale[:, 1:], passing)  # the whole block: a_n
    draws = _uniforms(drafts, generators, p.device)
    passed = (draws < passing) & (lengths <= num_drafts[:, None])
    accepted = (passed * lengths).amax(1)
    return accepted, _finish(drafts, num_drafts, accepted, p, q, scale, generators)


def _without_drafts(target_logits: torch.Tensor, generators: list[torch.Generator | None]):
    """A round without drafts: no draft accepted, each row's token drawn from p `(rows, 1, vocab)` with its
    generator."""
    p = target_logits[:, 0].softmax(-1)
    return torch.zeros(p.shape[0], dtype=torch.long, device=p.device), draw(p, generators)[:, None]


def _draft_probabilities(drafts: torch.Tensor, draft_logits: torch.Tensor, target_logits: torch.Tensor):
    """p `(rows, m + 1, vocab)`, q `(rows, m + 1, vocab)` (zero after the drafts), and each draft's p and q
    `(rows, m)`."""
    rows, m = drafts.shape
    p = target_logits.softmax(-1)
    q = torch.cat([draft_logits.softmax(-1), draft_logits.new_zeros(rows, 1, draft_logits.shape[-1])], dim=1)
    p_draft = p[:, :m].gather(-1, drafts[..., None])[..., 0]
    q_draft = q[:, :m].gather(-1, drafts[..., None])[..., 0]
    return p, q, p_draft, q_draft


def usable_drafts(num_drafts: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
    """`num_drafts` `(rows,)` cut before each row's first draft to which q gives no probability (`q_draft` `(rows,
    m)`, each draft's q: 0, or NaN where the drafter's logits were NaN or its processors left no token): such a draft
    was not drawn from q, and p / q would keep it; verification stops before it (the row's next token is then drawn
    from p there). On the device, no read."""
    usable = (q_draft > 0).long().cumprod(1).sum(1)  # the drafts before the first unusable one; NaN compares false
    return torch.minimum(num_drafts, usable)


def _uniforms(drafts: torch.Tensor, generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """One uniform draw `(rows, m)` per draft, from each row's generator."""
    return torch.stack([torch.rand(drafts.shape[1], generator=g, device=device) for g in generators])


def _finish(drafts: torch.Tensor, num_drafts: torch.Tensor, accepted: torch.Tensor, p: torch.Tensor,
            q: torch.Tensor, scale: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Tokens `(rows, m + 1)`: the drafts with, at `accepted`, a draw from `norm(max(0, a p - q))` there (`scale`
    `(rows, >= 1)` holds `a` per accepted length; p alone after every real draft, or when that has no mass)."""
    at = accepted[:, None, None].expand(-1, 1, p.shape[-1])
    p_at, q_at = p.gather(1, at)[:, 0], q.gather(1, at)[:, 0]
    a = scale.gather(1, accepted.clamp(max=scale.shape[1] - 1)[:, None])
    residual = (a * p_at - q_at).clamp(min=0)
    use_residual = (accepted < num_drafts) & (residual.sum(-1) > 0)
    distribution = torch.where(use_residual[:, None], residual, p_at)  # weights: `draw` normalises
    tokens = torch.cat([drafts, drafts.new_zeros(drafts.shape[0], 1)], dim=1)
    tokens.scatter_(1, accepted[:, None], draw(distribution, generators)[:, None])
    return tokens


__all__ = ["CONTEXT_FREE_PROCESSORS", "RowProcessors", "RowSampling", "block_verify", "choose", "context_free", "draw",
           "drafts_from_logits", "ends_row_only", "greedy_accept", "process", "rejection_sample",
           "usable_drafts"]
