"""How the Space shows selective prefill: the prompt's chunks, kept ones highlighted, each with its probe score.

Every chunk is a `<span class="d3d-chunk" data-kept="true|false" data-score="S">` holding the chunk's text; kept
chunks (what the target prefills) are shaded by score, dropped ones greyed out. The span's title gives the chunk's
index, token range and score.
"""

import html
import math

if __package__:
    from .decoding import check_prompt_length, encode_prompt
    from .render import TEXT_STYLE
else:  # beside its modules as the root of a Space
    from decoding import check_prompt_length, encode_prompt
    from render import TEXT_STYLE

CONTEXT_TOKENS = 8  # decoded before each chunk: its leading space, and a character split over up to 4 byte tokens
MAX_CHUNKS = 1024  # chunks one preview shows (each a span of about 200 bytes of HTML beside its text)


def _settled(text: str) -> str:
    """`text` without a trailing incomplete character (decoded as U+FFFD), which the next tokens complete."""
    return text.rstrip("\ufffd")


def chunk_texts(tokenizer, ids: list[int], spans: list[tuple[int, int]]) -> list[str]:
    """The text each chunk `[start, end)` adds to the decoded prompt; they join to `tokenizer.decode(ids)`.

    Decoding a chunk alone would drop the spaces and split characters at its boundaries, so each is decoded after
    its `CONTEXT_TOKENS` preceding tokens, whose own text is cut off: about `L + chunks * CONTEXT_TOKENS` tokens
    decoded in all. A character split across a boundary belongs to the chunk whose tokens complete it.
    """
    texts = []
    for start, end in spans:
        left = max(0, start - CONTEXT_TOKENS)
        before = _settled(tokenizer.decode(ids[left:start]))
        text = tokenizer.decode(ids[left:end])
        texts.append((text if end == len(ids) else _settled(text))[len(before) :])
    return texts


def check_chunk_count(length: int, chunk_size: int) -> None:
    """Raise `ValueError` when `chunk_size` cuts a `length`-token prompt into more than `MAX_CHUNKS` chunks."""
    chunks = math.ceil(length / max(chunk_size, 1))  # a size below 1 is refused by `select_prompt_chunks`
    if chunks > MAX_CHUNKS:
        raise ValueError(
            f"Chunk size {chunk_size} cuts the {length}-token prompt into {chunks} chunks; the preview shows at most "
            f"{MAX_CHUNKS}: use a chunk size of at least {math.ceil(length / MAX_CHUNKS)}"
        )


def kept_chunks_html(tokenizer, input_ids, selection) -> str:
    """HTML of the prompt `(1, L)` cut into `selection.spans` (a `PromptSelection`), kept chunks highlighted."""
    ids = input_ids[0].tolist()
    top = float(selection.scores.max()) if selection.scores is not None else 1.0
    spans = []
    texts = chunk_texts(tokenizer, ids, selection.spans)
    for index, ((start, end), text) in enumerate(zip(selection.spans, texts)):
        kept = index in selection.kept
        score = float(selection.scores[index]) if selection.scores is not None else float("nan")
        strength = 0.25 + 0.75 * (score / top if top > 0 else 0.0)
        style = (
            f"background-color: rgba(59, 130, 246, {strength:.2f}); border-radius: 3px" if kept
            else "color: #9ca3af; text-decoration: line-through"
        )
        spans.append(
            f'<span class="d3d-chunk" data-kept="{str(kept).lower()}" data-score="{score:.4f}" '
            f'title="chunk {index}, tokens {start}-{end}, score {score:.4f}" style="{style}">'
            f"{html.escape(text)}</span>"
        )
    summary = (
        f'<div class="d3d-prefill-summary">kept {len(selection.kept)} of {len(selection.spans)} chunks: '
        f"{selection.kept_length} of {selection.prompt_length} tokens (retention {selection.retention:g})</div>"
    )
    return f'{summary}<div class="d3d-prefill" style="{TEXT_STYLE}; padding: 8px">{"".join(spans)}</div>'


def prefill_preview(
    target, drafter, tokenizer, prompt: str | None, retention: float, chunk_size: int, max_new_tokens: int
) -> str:
    """The chunks the drafter's one-MASK probe keeps of `prompt` at `retention` (what the target would prefill under
    `selective_prefill=retention`), as `kept_chunks_html`. Raises `ValueError` for an empty prompt, a prompt that
    generating `max_new_tokens` would refuse (`check_prompt_length`), more than `MAX_CHUNKS` chunks, or bad settings."""
    ids = encode_prompt(tokenizer, prompt)
    check_prompt_length(target, ids, max_new_tokens)
    check_chunk_count(ids.shape[1], chunk_size)
    ids = ids.to(drafter.device)
    return kept_chunks_html(tokenizer, ids, drafter.select_prompt_chunks(ids, float(retention), int(chunk_size)))


__all__ = ["MAX_CHUNKS", "check_chunk_count", "chunk_texts", "kept_chunks_html", "prefill_preview"]
