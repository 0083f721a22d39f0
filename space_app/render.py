"""How the Space draws a decode: coloured token spans, a statistics table, a bar chart of the rounds (SVG).

Every token is a `<span class="d3d-token d3d-KIND" data-kind="KIND">`, KIND one of `draft` (an accepted draft token
from a drafting pass), `cache` (an accepted draft token of a round served from a cache hit), `lookup` (an accepted
token of a prompt-lookup continuation) and `target` (the
target's own token), its text exactly the token's. Text wraps anywhere, whitespace runs included (`break-spaces`),
so nothing leaves its panel; spaces and tabs show their colour, and an empty `<span class="d3d-eol">` before each
newline shows `↵` through `TOKENS_CSS` (the panel's CSS), outside the text. Statistics cells carry `data-stat="COLUMN-NAME"` so that a browser or a client can read them.
"""

import html
import math

if __package__:
    from .decoding import CACHE, DRAFT, LOOKUP, TARGET, LiveDecode
else:  # beside app.py as the root of a Space
    from decoding import CACHE, DRAFT, LOOKUP, TARGET, LiveDecode

KINDS = {
    DRAFT: ("accepted draft token", "#bfdbfe"),
    CACHE: ("accepted draft token, served from a cache hit", "#bbf7d0"),
    LOOKUP: ("accepted token of a prompt-lookup continuation", "#e9d5ff"),
    TARGET: ("the target's own token", "#fde68a"),
}
SERVED_COLOURS = {"cache hit": "#22c55e", "drafting pass": "#3b82f6", "prompt lookup": "#a855f7", "no draft": "#f59e0b"}
TEXT_STYLE = (
    "white-space: break-spaces; overflow-wrap: anywhere; font-family: ui-monospace, monospace; line-height: 1.7; "
    "color: #111827"
)
NEWLINE_MARK = "↵"
TOKENS_CSS = f'.d3d-eol::before {{ content: "{NEWLINE_MARK}"; color: #6b7280; }}'


def token_span(text: str, kind: str) -> str:
    title, colour = KINDS[kind]
    marked = '<span class="d3d-eol"></span>\n'.join(html.escape(line) for line in text.split("\n"))
    return (
        f'<span class="d3d-token d3d-{kind}" data-kind="{kind}" title="{title}" '
        f'style="background-color: {colour}; border-radius: 3px">{marked}</span>'
    )


def tokens_html(live: LiveDecode | None, column: str) -> str:
    """The tokens of one column (`column`: `target` or `d3d`) as coloured spans; a placeholder before it starts."""
    state = "waiting" if live is None else "done" if live.done else "running"
    spans = "" if live is None else "".join(token_span(text, kind) for text, kind in zip(live.texts, live.kinds))
    waiting = "waiting for a prompt…" if column == "target" else "runs when the target alone is done…"
    placeholder = f'<span style="color: #9ca3af">{waiting}</span>' if live is None else ""
    return (
        f'<div class="d3d-text" data-column="{column}" data-state="{state}" '
        f'style="{TEXT_STYLE}; min-height: 6em; padding: 8px; background: #ffffff">{spans}{placeholder}</div>'
    )


def legend_html() -> str:
    spans = " ".join(token_span(title, kind) for kind, (title, _) in KINDS.items())
    return f'{spans} <span style="color: #6b7280">&nbsp; {NEWLINE_MARK} a newline</span>'



STATS = {
    "tokens": "new tokens",
    "rounds": "rounds (target forward passes)",
    "tau": "τ (tokens per round)",
    "hit-rate": "cache-hit rate",
    "tok-s": "tokens/s",
    "speedup": "speedup",
}


def _number(value: float, spec: str, suffix: str = "") -> str:
    return "–" if math.isnan(value) else f"{value:{spec}}{suffix}"


def _column(run: LiveDecode | None, hit_rate: bool, speedup: float) -> dict[str, str]:
    if run is None:
        return dict.fromkeys(STATS, "–")
    return {
        "tokens": str(len(run.tokens)),
        "rounds": str(len(run.rounds)),
        "tau": _number(run.tau, ".2f"),
        "hit-rate": _number(run.hit_rate * 100, ".1f", "%") if hit_rate else "–",
        "tok-s": _number(run.tokens_per_second, ".1f"),
        "speedup": _number(speedup, ".2f", "x"),
    }


def stats_html(alone: LiveDecode | None, d3d: LiveDecode | None) -> str:
    """A table of both columns, live: new tokens, rounds, τ, cache-hit rate, tokens/s, and speedup (D3D's tokens/s
    over the target alone's)."""
    speedup = float("nan")
    if alone is not None and d3d is not None and d3d.rounds and alone.tokens_per_second > 0:
        speedup = d3d.tokens_per_second / alone.tokens_per_second
    columns = {"target": _column(alone, False, 1.0), "d3d": _column(d3d, True, speedup)}
    rows = "".join(
        f"<tr><td>{label}</td>" + "".join(f'<td data-stat="{name}-{key}">{cells[key]}</td>' for name, cells in columns.items())
        + "</tr>"
        for key, label in STATS.items()
    )
    return (
        '<table class="d3d-stats" style="width: 100%"><thead><tr><th></th><th>target alone</th><th>D3D async</th>'
        f"</tr></thead><tbody>{rows}</tbody></table>"
    )


def rounds_svg(d3d: LiveDecode | None, block_size: int) -> str:
    """A bar per D3D round (`<rect data-round data-added data-served>`): its height the tokens the round added (the
    target's token included, 1..`block_size`), its colour how its draft was served (`SERVED_COLOURS`)."""
    rounds = [] if d3d is None else d3d.rounds
    slots, bar, unit, left, top = max(len(rounds), 32), 10, 16, 28, 8
    width, height = left + slots * bar + 4, top + block_size * unit + 22
    baseline = top + block_size * unit
    parts = [f'<line x1="{left}" y1="{baseline}" x2="{width}" y2="{baseline}" stroke="#6b7280"/>']
    for level in range(1, block_size + 1):
        y = baseline - level * unit
        parts.append(f'<line x1="{left}" y1="{y}" x2="{width}" y2="{y}" stroke="#e5e7eb"/>')
        parts.append(f'<text x="{left - 6}" y="{y + 4}" text-anchor="end" font-size="10">{level}</text>')
    tick = 10 if slots <= 200 else 50
    for index, round_ in enumerate(rounds, start=1):
        added, x = len(round_.tokens), left + (index - 1) * bar
        parts.append(
            f'<rect data-round="{index}" data-added="{added}" data-served="{round_.served}" x="{x + 1}" '
            f'y="{baseline - added * unit}" width="{bar - 2}" height="{added * unit}" '
            f'fill="{SERVED_COLOURS[round_.served]}"><title>round {index}: {added} tokens ({round_.served})</title></rect>'
        )
        if index % tick == 0:
            parts.append(f'<text x="{x + bar / 2}" y="{baseline + 14}" text-anchor="middle" font-size="10">{index}</text>')
    legend = " ".join(
        f'<span style="color: {colour}">&#9632;</span> {served}' for served, colour in SERVED_COLOURS.items()
    )
    return (
        f'<div class="d3d-rounds"><div style="font-size: 0.9em">Tokens added per D3D round (accepted drafts + the '
        f"target's token) &nbsp; {legend}</div>"
        f'<svg viewBox="0 0 {width} {height}" width="100%" role="img" aria-label="tokens added per round" '
        f'style="max-height: 260px">{"".join(parts)}</svg></div>'
    )


__all__ = ["KINDS", "NEWLINE_MARK", "SERVED_COLOURS", "STATS", "TEXT_STYLE", "TOKENS_CSS", "legend_html", "rounds_svg", "stats_html", "token_span", "tokens_html"]
