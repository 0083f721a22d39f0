"""Selective prefill with D3D (paper, Appendix C): the drafter picks the prompt chunks the target prefills.

1. **Importance probe.** The drafter reads the full prompt `x_1..x_L` followed by ONE mask position, laid out as a
   D3D block `[x_L, M]` over the cached prefix `x_1..x_{L-1}` (the layout it drafts with, block size 2). The score of
   prompt token `i` is the attention probability the MASK query gives key `i`, averaged over every layer and every
   query head (each head's row sums to 1, so token scores are a distribution over the prompt, the anchor `x_L`
   included, plus the MASK's own key). A chunk's score is the sum of its tokens' scores: the attention mass the MASK
   pays to it.
2. **Chunk selection.** The prompt is cut into chunks of `chunk_size` tokens aligned to its end (the first chunk may
   be shorter). The last chunk (the question or instruction, and the anchor of the first drafted block) is always
   kept; then chunks in decreasing score are added while a chunk brings the kept length closer to `retention * L`
   (a chunk is taken when `kept + size / 2 <= retention * L`). The kept length is therefore within one chunk of
   `retention * L`. Kept chunks keep their original order; the reduced prompt is their concatenation.
3. **Decoding.** The target prefills only the reduced prompt and decodes with ordinary D3D speculative decoding,
   target-verified on the reduced prompt, through the engine: the row's drafter context is the FULL prompt followed
   by the generated tokens (the drafter prefills the full prompt in its own cache), the target's the reduced one.

With `retention < 1` the output is the target's output on the reduced prompt, not on the full prompt; with
`retention == 1` `d3d_generate` is exactly D3D decoding of the full prompt through the engine.
"""

from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .masking_d3d import block_layout
from .engine_d3d import RoundRecord
from .generation_d3d import front_door_kwargs, speculative_generate
from .inputs_d3d import check_prompts

DEFAULT_CHUNK_SIZE = 32
PROBE_BLOCK_SIZE = 2


@dataclass
class PromptSelection:
    """Which prompt chunks the target prefills.

    spans: every chunk as `[start, end)` token indices, in prompt order; scores: `(num_chunks,)` attention mass the
    probe's MASK query pays each chunk (None when no probe ran); kept: sorted indices into `spans`.
    """

    spans: list[tuple[int, int]]
    scores: torch.FloatTensor | None
    kept: list[int]
    retention: float
    chunk_size: int

    @property
    def prompt_length(self) -> int:
        return self.spans[-1][1]

    @property
    def kept_spans(self) -> list[tuple[int, int]]:
        return [self.spans[i] for i in self.kept]

    @property
    def kept_length(self) -> int:
        return sum(end - start for start, end in self.kept_spans)

    def kept_positions(self) -> torch.LongTensor:
        """`(kept_length,)` indices of the kept prompt tokens, in order."""
        return torch.cat([torch.arange(start, end) for start, end in self.kept_spans])

    def reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """`(batch, L, ...)` prompt-aligned tensor (ids, attention mask) -> `(batch, kept_length, ...)`."""
        if tensor.shape[1] != self.prompt_length:
            raise ValueError(f"Expected {self.prompt_length} prompt positions, got {tensor.shape[1]}")
        return tensor[:, self.kept_positions().to(tensor.device)]


@dataclass
class SelectivePrefillOutput:
    """What `d3d_generate` returns.

    output: what `target.generate` returned (a tensor, or a `GenerateDecoderOnlyOutput` with
    `return_dict_in_generate=True`), on `prompt_ids`; prompt_ids: `(1, R)` the prompt the target read (the input
    itself when nothing was dropped); selection: the chunks (None for `selective_prefill=1`, where no probe runs);
    round_record: the engine's round record of the call.
    """

    output: torch.LongTensor | GenerateDecoderOnlyOutput
    prompt_ids: torch.LongTensor
    selection: PromptSelection | None
    round_record: RoundRecord

    @property
    def sequences(self) -> torch.LongTensor:
        """`(1, R + n)` the target's prompt and its new tokens."""
        return self.output if isinstance(self.output, torch.Tensor) else self.output.sequences

    @property
    def new_tokens(self) -> torch.LongTensor:
        """`(1, n)` the generated tokens."""
        return self.sequences[:, self.prompt_ids.shape[1] :]


def check_prefill_arguments(input_ids: torch.Tensor, retention: float, chunk_size: int) -> None:
    """Raise `ValueError` unless `input_ids` is `(1, L >= 1)`, `0 < retention <= 1` and `chunk_size >= 1`."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < 1:
        raise ValueError(f"Selective prefill takes one prompt of shape (1, L) with L >= 1, got {tuple(input_ids.shape)}")
    if not 0.0 < retention <= 1.0:
        raise ValueError(f"retention (selective_prefill) must be in (0, 1], got {retention}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an integer >= 1, got {chunk_size!r}")


def chunk_spans(length: int, chunk_size: int) -> list[tuple[int, int]]:
    """`[start, end)` chunks of `chunk_size` tokens covering `0..length`, aligned to the end, in order."""
    return sorted((max(0, end - chunk_size), end) for end in range(length, 0, -chunk_size))


def _mask_queries(
    drafter, layer_inputs: tuple[torch.Tensor, ...], position_ids: torch.LongTensor
) -> list[torch.Tensor]:
    """Per decoder layer, the MASK position's query `(heads, head_dim)` as its attention computes it (`q_proj`,
    `q_norm`, rotary), recomputed from the layer's input `(1, 2, hidden)` of the probe's own pass."""
    cos, sin = drafter.model.rotary_emb(layer_inputs[0], position_ids)
    queries = []
    for layer, layer_input in zip(drafter.model.layers, layer_inputs):
        attention = layer.self_attn
        states = attention.q_proj(layer.input_layernorm(layer_input))
        states = attention.q_norm(states.view(*states.shape[:-1], -1, attention.head_dim)).transpose(1, 2)
        query = apply_rotary_pos_emb(states, states, cos, sin)[0]
        queries.append(query[0, :, -1].float())  # the last position of the pass is the MASK
    return queries


def _mask_attention(drafter, queries: list[torch.Tensor], cache: DynamicCache, length: int) -> torch.Tensor:
    """`(layers, heads, L)`: the MASK query's attention probabilities over the prompt's keys, per layer and head.
    The MASK sees every cached key (the prefix, the anchor and itself: the block is bidirectional)."""
    rows = []
    for index, (layer, query) in enumerate(zip(drafter.model.layers, queries)):
        keys = cache.layers[index].keys[0].float()  # (kv_heads, T, head_dim)
        keys = keys.repeat_interleave(query.shape[0] // keys.shape[0], dim=0)
        probabilities = (torch.einsum("hd,htd->ht", query, keys) * layer.self_attn.scaling).softmax(dim=-1)
        rows.append(probabilities[:, :length])
    return torch.stack(rows)


@torch.no_grad()
def probe_token_importance(drafter, input_ids: torch.LongTensor) -> tuple[torch.FloatTensor, DynamicCache]:
    """The one-MASK importance probe: `(1, L)` prompt -> `(L,)` token scores and the drafter cache of `x_1..x_{L-1}`.

    The prefix `x_1..x_{L-1}` is prefilled causally (this cache is exactly what the first drafted block needs, so
    selective prefill reuses it); the 2-token block `[x_L, M]` then runs with the drafter's own attention backend
    and `output_hidden_states` (entry i is the input of decoder layer i), the MASK's query is recomputed from each
    layer's input, and its attention probabilities over the cached keys follow (one query row over L keys per layer
    and head). Score of token i: that probability, mean over layers and query heads. Everything it reads belongs to
    this call (no hooks of its own, the config untouched), so other threads may draft with the drafter meanwhile.
    """
    length = input_ids.shape[1]
    device = drafter.model.embed_tokens.weight.device
    input_ids = input_ids.to(device)
    cache = DynamicCache(config=drafter.config)
    if length > 1:
        drafter(input_ids=input_ids[:, :-1], past_key_values=cache, use_cache=True, logits_to_keep=1)
    anchor = torch.full((1, 1), length - 1, device=device, dtype=torch.long)
    block_ids, visible_prefix, position_ids = block_layout(0, anchor, PROBE_BLOCK_SIZE, length - 1)
    hidden_states = drafter(
        input_ids=drafter.mask_blocks(input_ids[:, -1:])[:, :PROBE_BLOCK_SIZE],
        position_ids=position_ids,
        block_ids=block_ids,
        visible_prefix=visible_prefix,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
        output_hidden_states=True,
    ).hidden_states
    queries = _mask_queries(drafter, hidden_states[: len(drafter.model.layers)], position_ids)
    mask_rows = _mask_attention(drafter, queries, cache, length)  # (layers, heads, L)
    cache.crop(-PROBE_BLOCK_SIZE)
    return mask_rows.mean(dim=(0, 1)), cache


def choose_chunks(token_scores: torch.Tensor, retention: float, chunk_size: int) -> PromptSelection:
    """Chunk scores (sums of `(L,)` token scores) and the kept chunks: the last one, then the best while they bring
    the kept length closer to `retention * L` (see the module docstring)."""
    spans = chunk_spans(token_scores.shape[0], chunk_size)
    scores = torch.stack([token_scores[start:end].sum() for start, end in spans]).cpu()
    budget = retention * token_scores.shape[0]
    last = len(spans) - 1
    ranked = sorted(range(last), key=lambda i: (-scores[i].item(), i))
    kept, total = [last], spans[last][1] - spans[last][0]
    for index in ranked:
        size = spans[index][1] - spans[index][0]
        if total + size / 2 <= budget:
            kept.append(index)
            total += size
    return PromptSelection(spans, scores, sorted(kept), retention, chunk_size)


def select_prompt_chunks(
    drafter, input_ids: torch.LongTensor, retention: float, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> PromptSelection:
    """Score the chunks of `input_ids` `(1, L)` with the drafter's one-MASK probe and choose the kept ones."""
    check_prefill_arguments(input_ids, retention, chunk_size)
    token_scores, _ = probe_token_importance(drafter, input_ids)
    return choose_chunks(token_scores, retention, chunk_size)


def d3d_generate(
    target,
    drafter,
    input_ids: torch.LongTensor,
    selective_prefill: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    **generate_kwargs,
) -> SelectivePrefillOutput:
    """D3D speculative decoding, optionally with selective prefill.

    input_ids: `(1, L)`; selective_prefill: retention rho in (0, 1]. At 1 this is exactly
    `target.generate(input_ids, custom_generate=speculative_generate, drafter=drafter, **generate_kwargs)`. Below 1
    the drafter's probe picks the
    chunks (`select_prompt_chunks`), the target generates from the reduced prompt with the drafter drafting from the
    full one (`drafter_input_ids`: the engine's rows read another prompt in the drafter); an `attention_mask` in
    `generate_kwargs` is reduced alike.
    """
    check_prefill_arguments(input_ids, selective_prefill, chunk_size)
    check_prompts(input_ids, generate_kwargs.get("attention_mask"))
    generate_kwargs = front_door_kwargs(generate_kwargs)
    if "assistant_model" in generate_kwargs or "custom_generate" in generate_kwargs:
        raise ValueError("d3d_generate drafts with `drafter`; do not pass assistant_model or custom_generate")
    record = RoundRecord()
    engine_kwargs = dict(custom_generate=speculative_generate, drafter=drafter, round_record=record)
    if selective_prefill == 1.0:
        output = target.generate(input_ids, **engine_kwargs, **generate_kwargs)
        return SelectivePrefillOutput(output, input_ids, None, record)
    token_scores, _ = probe_token_importance(drafter, input_ids)
    selection = choose_chunks(token_scores, selective_prefill, chunk_size)
    reduced = selection.reduce(input_ids)
    if generate_kwargs.get("attention_mask") is not None:
        generate_kwargs["attention_mask"] = selection.reduce(generate_kwargs["attention_mask"])
    output = target.generate(reduced.to(target.device), drafter_input_ids=input_ids, **engine_kwargs, **generate_kwargs)
    return SelectivePrefillOutput(output, reduced, selection, record)


__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "PromptSelection",
    "SelectivePrefillOutput",
    "check_prefill_arguments",
    "choose_chunks",
    "chunk_spans",
    "d3d_generate",
    "probe_token_importance",
    "select_prompt_chunks",
]
