"""How the Space shows selective prefill: the prompt's chunks, kept ones highlighted, each with its probe score.

Every chunk is a `<span class="d3d-chunk" data-kept="true|false" data-score="S">` holding the chunk's text; kept
chunks (what the target prefills) are shaded by score, dropped ones greyed out. The span's title gives the chunk's
index, token range and score.
"""

import html

if __package__:
    from .decoding import encode_prompt
else:  # beside its modules as the root of a Space
    from decoding import encode_prompt

TEXT_STYLE = "white-space: pre-wrap; font-family: ui-monospace, monospace; line-height: 1.7; color: #111827"


def _chunk_text(tokenizer, ids: list[int], start: int, end: int) -> str:
    """The text chunk `[start, end)` adds to the decoded prompt (decoding chunks alone would drop the spaces and
    split characters at their boundaries)."""
    return tokenizer.decode(ids[:end])[len(tokenizer.decode(ids[:start])) :]


def kept_chunks_html(tokenizer, input_ids, selection) -> str:
    """HTML of the prompt `(1, L)` cut into `selection.spans` (a `PromptSelection`), kept chunks highlighted."""
    ids = input_ids[0].tolist()
    top = float(selection.scores.max()) if selection.scores is not None else 1.0
    spans = []
    for index, (start, end) in enumerate(selection.spans):
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
            f"{html.escape(_chunk_text(tokenizer, ids, start, end))}</span>"
        )
    summary = (
        f'<div class="d3d-prefill-summary">kept {len(selection.kept)} of {len(selection.spans)} chunks: '
        f"{selection.kept_length} of {selection.prompt_length} tokens (retention {selection.retention:g})</div>"
    )
    return f'{summary}<div class="d3d-prefill" style="{TEXT_STYLE}; padding: 8px">{"".join(spans)}</div>'


def prefill_preview(drafter, tokenizer, prompt: str | None, retention: float, chunk_size: int) -> str:
    """The chunks the drafter's one-MASK probe keeps of `prompt` at `retention` (what the target would prefill under
    `selective_prefill=retention`), as `kept_chunks_html`. Raises `ValueError` for an empty prompt or bad settings."""
    ids = encode_prompt(tokenizer, prompt).to(drafter.device)
    return kept_chunks_html(tokenizer, ids, drafter.select_prompt_chunks(ids, float(retention), int(chunk_size)))


__all__ = ["kept_chunks_html", "prefill_preview"]
