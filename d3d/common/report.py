"""Rendering benchmark results: a markdown table, JSON and a bar chart."""

import json
from collections.abc import Callable
from pathlib import Path


def pyplot():
    """`matplotlib.pyplot` on the file-only Agg backend (no display; imported when a plot is drawn)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(figure, path: Path) -> None:
    """Lay `figure` out, write it to `path` (PNG, 120 dpi) and free it."""
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    pyplot().close(figure)


def speed_title(results: dict) -> str:
    """The benchmark plot's title, naming how it decoded (greedy or the sampling settings)."""
    return f"Decoding speed, {sampling_description(results.get('sampling'))}, one process"


def percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


IDENTITY = {
    "exact": "token for token with the target's own greedy output (float32 checks identity exactly).",
    "up to near-ties": "token for token, or `near-ties`: outputs that first differ where the target's own two best "
                       "tokens nearly tie (margin < 2^-5 of the top logit, recomputed in float32), as low precision "
                       "rounds them; a float32 run checks identity exactly.",
}


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _identical(row: dict, prompts: int) -> str:
    """`yes` when every output equals the target's; `near-ties (7/8)` when the others differ only at near-ties of
    the target's own logits (low precision, see `d3d.benchmark.identity`); else how many did (`NO (17/20)`)."""
    if "z" in row:  # sampled: a distribution check (`identity.sampled_consistency`)
        uniform = f", u {row['uniform_p']:.2g}" if "uniform_p" in row else ""
        return f"{'yes' if row['lossless'] else 'NO'} (z {row['z']:+.1f}{uniform})"
    if row["lossless"]:
        return "yes"
    if row.get("divergences") == 0:
        return f"near-ties ({row['identical']}/{prompts})"
    return f"NO ({row['identical_outputs']}/{prompts})" if "identical_outputs" in row else "NO"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _bound(row: dict, kind: str) -> str:
    """`2.50x (61%)`: an ideal bound and the fraction of it reached, or `-`."""
    bound = row.get(f"ideal_{kind}_speedup")
    return "-" if bound is None else f"{bound:.2f}x ({percent(row[f'ideal_{kind}_fraction'])})"


def _passes(results: dict) -> list[str]:
    """One line per mode: the engine's pass times on the benchmark's prefix."""
    lines = []
    for mode, passes in results.get("passes", {}).items():
        tree = passes.get("t_target_tree")  # absent from a bench.json written before trees
        short = passes.get("t_target_short")  # and before short rounds
        lines.append(f"- {mode}: t_T(1) = {1000 * passes['t_target_1']:.2f} ms, t_T(B={results['block_size']}) = "
                     f"{1000 * passes['t_target_b']:.2f} ms, "
                     + (f"t_T(2B-1) = {1000 * tree:.2f} ms, " if tree is not None else "")
                     + (f"t_T(short) = {1000 * short:.2f} ms, " if short is not None else "")
                     + f"t_D(B) = {1000 * passes['t_drafter_b']:.2f} ms "
                     f"(measured in {passes['measure_seconds']:.1f} s)")
    return lines


def sampling_description(sampling: dict | None) -> str:
    """`greedy`, or `sampled (temperature 0.6, top_p 0.95, top_k 20)`."""
    if not sampling or not sampling.get("do_sample"):
        return "greedy"
    off = {"top_p": 1.0, "top_k": 0}  # values that leave the distribution as it is
    settings = ", ".join(f"{name} {sampling[name]}" for name in ("temperature", "top_p", "top_k")
                         if sampling.get(name) and sampling[name] != off.get(name))
    return f"sampled ({settings})" if settings else "sampled"


def markdown(results: dict) -> str:
    """Tables (one per prompt set), the (C, F) sweep, the engine's pass times and the compile times."""
    lines = []
    decoding = sampling_description(results.get("sampling"))
    for name, prompt_set in results["prompt_sets"].items():
        lines += [f"### {name} ({prompt_set['prompts']} prompts, {results['max_new_tokens']} new tokens, {decoding})",
                  ""]
        lines += table(
            ["method", "tok/s", "speedup", "vs generate", "τ", "cache hits", "lossless", "ms/round", "verify",
             "exposed draft", "overhead", "ideal sync (reached)", "ideal async (reached)"],
            [[row["method"], f"{row['tokens_per_second']:.1f}", f"{row['speedup']:.2f}x",
              _times(row.get("speedup_vs_generate")), f"{row['tau']:.2f}", percent(row["hit_rate"]),
              _identical(row, prompt_set["prompts"]), _ms(row.get("ms_per_round")), _ms(row.get("verify_ms_per_round")),
              _ms(row.get("exposed_draft_ms_per_round")), _ms(row.get("overhead_ms_per_round")), _bound(row, "sync"),
              _bound(row, "async")] for row in prompt_set["methods"]])
        if "ceiling_tau" in prompt_set:
            lines.append(f"\nCeiling τ {prompt_set['ceiling_tau']:.2f}: a perfect argmax drafter's expected tokens "
                         "per round on the target's own outputs (the target's entropy; no drafter beats it).")
        if results.get("sampling"):
            allowance = "" if results.get("identity") == "exact" else (
                " (in low precision up to rounding: top-k + 1, top-p + 1/32)")
            lines.append(f"\nLossless (sampled): every token inside the sampling support{allowance}, the tokens' "
                         "probability integral transforms under the target uniform (mean and Kolmogorov-Smirnov, "
                         "u = p >= 1e-4) and the mean log-probability of the tokens under the target consistent with "
                         "the target's own draws (paired sign-flip test over prompts, p >= 1e-4; z beside it).")
        elif "identity" in results:
            lines.append(f"\nLossless: {IDENTITY[results['identity']]}")
        compiled = [f"{row['method']} {row['warmup_seconds']:.1f} s ({row.get('compilations', 0)} compiles after it)"
                    for row in prompt_set["methods"] if row.get("compiled")]
        if compiled:
            lines.append(f"\nCompile time (the first, warm-up call of each compiled method), and the graphs compiled "
                         f"again in the measured calls: {', '.join(compiled)}.")
        lines.append("")
    lines += ["### D3D async budget sweep", ""] + table(
        ["C", "F", "budget (tokens)", "tok/s", "τ", "cache hits"],
        [[row["coverage"], row["fanout"], row["budget"], f"{row['tokens_per_second']:.1f}", f"{row['tau']:.2f}",
          percent(row["hit_rate"])] for row in results["sweep"]])
    lines += [
        "", "Speedup: over the fastest target-alone baseline; vs generate: over plain `target.generate`. ms/round = "
        "verify + exposed draft (with the drafter's prefill of a row, on its first block round) + overhead (host work, "
        "the target's prefill, `generate` setup), from the engine's round record "
        "(other methods: the total only, rounds counted by a streamer). Ideal sync: the tokens at t_T(1) each over "
        "the passes the rounds ran, a round that verified the drafter's block t_T(B) + t_D(B), a lookup t_T(B) (one "
        "verified whole past a block's drafts t_T(2B-1), its first drafts only, in a short round, t_T(short)), both "
        "(a tree) t_T(2B-1) + t_D(B), nothing t_T(1) (the block every round: τ·t_T(1)/(t_T(B) + t_D(B))); "
        "ideal async the same with drafting "
        f"hidden (τ·t_T(1)/t_T(B)); with the engine's passes over a {results.get('pass_prefix_length', 256)}-token "
        "prefix (reached: the speedup over the target alone through the engine in the same mode, over the bound):",
        *_passes(results), "",
        f"Measured on: {results.get('hardware', 'hardware not recorded')}; dtype: {results.get('dtype', 'not recorded')}.",
    ]
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    """Speedup over the target alone, one bar group per prompt set."""
    plt = pyplot()

    sets = list(results["prompt_sets"])
    methods = [row["method"] for row in results["prompt_sets"][sets[0]]["methods"]]
    figure, axis = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(sets)
    for index, name in enumerate(sets):
        speedups = [row["speedup"] for row in results["prompt_sets"][name]["methods"]]
        axis.bar([m + index * width for m in range(len(methods))], speedups, width, label=name)
    axis.axhline(1.0, color="gray", linewidth=0.8)
    axis.set_xticks([m + width * (len(sets) - 1) / 2 for m in range(len(methods))])
    axis.set_xticklabels(methods, rotation=20, ha="right", fontsize=8)
    axis.set_ylabel("speedup over the fastest target-alone baseline")
    axis.legend()
    axis.set_title(speed_title(results))
    save_figure(figure, path)


def table(columns: list[str], rows: list[list[object]]) -> list[str]:
    """A markdown table's lines: the header, its rule and one line per row (cells as `str` gives them)."""
    return [f"| {' | '.join(columns)} |", "|" + "---|" * len(columns)] + [
        f"| {' | '.join(str(cell) for cell in row)} |" for row in rows]


def write_report(results: dict | list, output_dir: Path, name: str, render: Callable[[dict], str],
                 draw: Callable[[dict, Path], None] | None = None) -> str:
    """`<name>.json`, `<name>.md` (from `render`) and, with `draw`, `<name>.png` in `output_dir`: the one writer of
    the benchmarks' and the checks' reports. Returns the markdown."""
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / f"{name}.json").write_text(json.dumps(results, indent=2, default=str))
    markdown_text = render(results)
    (output_dir / f"{name}.md").write_text(markdown_text)
    if draw is not None:
        draw(results, output_dir / f"{name}.png")
    return markdown_text


def write(results: dict, output_dir: Path) -> str:
    """`bench.json`, `bench.md`, `bench.png` in `output_dir`; returns the markdown."""
    return write_report(results, output_dir, "bench", markdown, plot)


def prefill_markdown(results: dict) -> str:
    """The selective-prefill table (paper, Tables 6-7), speedups over the full prompt with the target alone."""
    lines = [
        f"### {results['task']}: {results['examples']} prompts of ~{results['prompt_tokens']:.0f} tokens, "
        f"{results['max_new_tokens']} new tokens, greedy, chunks of {results['chunk_size']}, B = {results['block_size']}",
        "",
    ] + table(
        ["setting", "score", "answer kept", "prompt kept", "TTFT", "decode tok/s", "TTFT speedup", "decode speedup",
         "E2E speedup", "τ", "= target on its prompt"],
        [[row["setting"], f"{row['score']:.2f}", percent(row["answer_kept"]), percent(row["kept_fraction"]),
          f"{1000 * row['ttft_seconds']:.0f} ms", f"{row['decode_tokens_per_second']:.1f}", _times(row["ttft_speedup"]),
          _times(row["decode_speedup"]), _times(row["e2e_speedup"]), f"{row['tau']:.2f}",
          "yes" if row["matches_target"] else "NO"] for row in results["settings"]])
    return "\n".join(lines) + "\n"


def prefill_plot(results: dict, path: Path) -> None:
    """TTFT, decode and end-to-end speedups per setting (bars) and the task score (line, right axis)."""
    plt = pyplot()

    rows = results["settings"]
    figure, axis = plt.subplots(figsize=(9, 4))
    width = 0.27
    for offset, (key, label) in enumerate([("ttft_speedup", "TTFT"), ("decode_speedup", "decode"), ("e2e_speedup", "end to end")]):
        axis.bar([i + (offset - 1) * width for i in range(len(rows))], [row[key] for row in rows], width, label=label)
    axis.axhline(1.0, color="gray", linewidth=0.8)
    axis.set_xticks(range(len(rows)))
    axis.set_xticklabels([row["setting"] for row in rows], fontsize=8)
    axis.set_ylabel("speedup over the full prompt, target alone")
    axis.legend(loc="upper left")
    score_axis = axis.twinx()
    score_axis.plot(range(len(rows)), [row["score"] for row in rows], "ko-", label="score")
    score_axis.set_ylabel(results["task"].split(" (")[0] + " score")
    score_axis.set_ylim(bottom=0)
    score_axis.legend(loc="upper right")
    axis.set_title("Selective prefill with D3D")
    save_figure(figure, path)


def write_prefill(results: dict, output_dir: Path) -> str:
    """`prefill.json`, `prefill.md`, `prefill.png` in `output_dir`; returns the markdown."""
    return write_report(results, output_dir, "prefill", prefill_markdown, prefill_plot)


__all__ = ["markdown", "percent", "pyplot", "plot", "prefill_markdown", "prefill_plot", "sampling_description",
           "save_figure", "speed_title", "table", "write", "write_prefill", "write_report"]
