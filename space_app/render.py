"""How the Space draws a decode: coloured token spans, a statistics table, the per-round accepted lengths.

Every token is a `<span class="d3d-token d3d-KIND" data-kind="KIND">`, KIND one of `draft` (an accepted draft token
from a drafting pass), `cache` (an accepted draft token of a round served from a cache hit) and `target` (the
target's own token). Statistics cells carry `data-stat="COLUMN-NAME"` so that a browser or a client can read them.
"""

import html
import math

import pandas as pd

if __package__:
    from .decoding import CACHE, DRAFT, TARGET, LiveDecode
else:  # beside app.py as the root of a Space
    from decoding import CACHE, DRAFT, TARGET, LiveDecode

KINDS = {
    DRAFT: ("accepted draft token", "#bfdbfe"),
    CACHE: ("accepted draft token, served from a cache hit", "#bbf7d0"),
    TARGET: ("the target's own token", "#fde68a"),
}
TEXT_STYLE = "white-space: pre-wrap; font-family: ui-monospace, monospace; line-height: 1.7; color: #111827"


def token_span(text: str, kind: str) -> str:
    title, colour = KINDS[kind]
    return (
        f'<span class="d3d-token d3d-{kind}" data-kind="{kind}" title="{title}" '
        f'style="background-color: {colour}; border-radius: 3px">{html.escape(text)}</span>'
    )


def tokens_html(live: LiveDecode | None, column: str) -> str:
    """The tokens of one column (`column`: `target` or `d3d`) as coloured spans; a placeholder before it starts."""
    state = "waiting" if live is None else "done" if live.done else "running"
    spans = "" if live is None else "".join(token_span(text, kind) for text, kind in zip(live.texts, live.kinds))
    placeholder = '<span style="color: #9ca3af">waiting for the target alone…</span>' if live is None else ""
    return (
        f'<div class="d3d-text" data-column="{column}" data-state="{state}" '
        f'style="{TEXT_STYLE}; min-height: 6em; padding: 8px; background: #ffffff">{spans}{placeholder}</div>'
    )


def legend_html() -> str:
    return " ".join(token_span(title, kind) for kind, (title, _) in KINDS.items())


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


def accepted_length_frame(d3d: LiveDecode | None) -> pd.DataFrame:
    """One row per D3D round: `round` (1..), `tokens added` (the target's token included), `served` (see `Round`)."""
    rounds = [] if d3d is None else d3d.rounds
    return pd.DataFrame(
        {
            "round": list(range(1, len(rounds) + 1)),
            "tokens added": [len(round_.tokens) for round_ in rounds],
            "served": [round_.served for round_ in rounds],
        }
    )


__all__ = ["KINDS", "STATS", "accepted_length_frame", "legend_html", "stats_html", "token_span", "tokens_html"]
