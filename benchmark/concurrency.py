"""`d3d bench --concurrency 1,4,8,16`: aggregate throughput of batched D3D against the target's own batched greedy
decoding, at each number of concurrent requests, in one process.

At concurrency c the prompts are decoded in groups of c, left-padded: the baseline is `target.generate` on the
group (Hugging Face batched greedy decoding, finished rows padded until the last one ends), D3D is
`drafter.generate_batch` on the same group (rows leave at their own EOS or length). Both count the same new tokens
(each row up to its EOS); every D3D row is checked against the baseline's row. Each level is warmed up first.
"""

import json
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from modeling_d3d.speculative_d3d import synchronize


def left_pad(prompts: list[torch.Tensor], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(1, L_i)` prompts -> left-padded ids and attention mask `(n, max L_i)`."""
    width = max(prompt.shape[1] for prompt in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - prompt.shape[1] :], mask[row, width - prompt.shape[1] :] = prompt[0], 1
    return ids, mask


def new_tokens(sequences: torch.Tensor, prompt_width: int, eos_token_ids: set[int]) -> list[list[int]]:
    """Each row's new tokens up to and including its first EOS."""
    rows = []
    for row in sequences[:, prompt_width:].tolist():
        end = next((i + 1 for i, token in enumerate(row) if token in eos_token_ids), len(row))
        rows.append(row[:end])
    return rows


def timed(generate, ids: torch.Tensor, mask: torch.Tensor, device) -> tuple[torch.Tensor, float]:
    synchronize(device)
    began = time.perf_counter()
    sequences = generate(ids.to(device), mask.to(device))
    synchronize(device)
    return sequences.cpu(), time.perf_counter() - began


def concurrency_benchmark(target, drafter, prompts: list[torch.Tensor], levels: list[int], max_new_tokens: int) -> dict:
    """For each concurrency level: tokens/s of the target's batched greedy decoding and of batched D3D on the same
    groups (interleaved group by group, so machine drift hits both alike), the speedup, τ (tokens per row per
    verification round) and whether every D3D row equals the baseline's. Returns what `concurrency.json` holds."""
    config = target.generation_config
    eos = config.eos_token_id
    eos_ids = set([eos] if isinstance(eos, int) else (eos or []))
    pad = config.pad_token_id if config.pad_token_id is not None else next(iter(eos_ids), 0)
    settings = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)

    def baseline(ids, mask):
        return target.generate(ids, attention_mask=mask, **settings)

    def d3d(ids, mask):
        return drafter.generate_batch(target, ids, attention_mask=mask, **settings)

    rows = []
    for level in tqdm(levels, desc="concurrency levels"):
        groups = [left_pad(prompts[start : start + level], pad) for start in range(0, len(prompts), level)]
        for generate in (baseline, d3d):  # warm-up
            timed(generate, *groups[0], target.device)
        seconds = {"baseline": 0.0, "d3d": 0.0}
        outputs = {"baseline": [], "d3d": []}
        tokens, row_rounds, rounds = 0, 0, 0
        for ids, mask in groups:
            for name, generate in (("baseline", baseline), ("d3d", d3d)):
                sequences, elapsed = timed(generate, ids, mask, target.device)
                seconds[name] += elapsed
                outputs[name] += new_tokens(sequences, ids.shape[1], eos_ids)
            tokens += drafter.batch_stats.new_tokens
            row_rounds += drafter.batch_stats.row_rounds
            rounds += drafter.batch_stats.rounds
        counted = {name: sum(len(row) for row in decoded) for name, decoded in outputs.items()}
        rows.append({
            "concurrency": level,
            "requests": len(prompts),
            "new_tokens": counted["baseline"],
            "baseline_tokens_per_second": counted["baseline"] / seconds["baseline"],
            "d3d_tokens_per_second": counted["d3d"] / seconds["d3d"],
            "speedup": (counted["d3d"] / seconds["d3d"]) / (counted["baseline"] / seconds["baseline"]),
            "tau": tokens / row_rounds,
            "batched_rounds": rounds,
            "lossless": outputs["d3d"] == outputs["baseline"],
            "baseline_seconds": seconds["baseline"],
            "d3d_seconds": seconds["d3d"],
        })
    return {"max_new_tokens": max_new_tokens, "block_size": drafter.config.block_size, "levels": rows}


def markdown(results: dict) -> str:
    lines = [
        f"### Concurrency ({results['levels'][0]['requests']} requests, {results['max_new_tokens']} new tokens, greedy)",
        "",
        "| concurrency | target batched tok/s | D3D batched tok/s | speedup | τ | rounds | lossless |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in results["levels"]:
        lines.append(
            f"| {row['concurrency']} | {row['baseline_tokens_per_second']:.1f} | {row['d3d_tokens_per_second']:.1f} | "
            f"{row['speedup']:.2f}x | {row['tau']:.2f} | {row['batched_rounds']} | {'yes' if row['lossless'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    """Aggregate tokens/s of both methods against concurrency, speedup on a second axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = [row["concurrency"] for row in results["levels"]]
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot(levels, [row["baseline_tokens_per_second"] for row in results["levels"]], "o-", label="target batched greedy")
    axis.plot(levels, [row["d3d_tokens_per_second"] for row in results["levels"]], "s-", label="D3D batched")
    axis.set_xlabel("concurrent requests")
    axis.set_ylabel("aggregate tokens/s")
    axis.set_xticks(levels)
    speedup_axis = axis.twinx()
    speedup_axis.plot(levels, [row["speedup"] for row in results["levels"]], "k--", alpha=0.6, label="speedup")
    speedup_axis.set_ylabel("speedup")
    handles = axis.get_legend_handles_labels()[0] + speedup_axis.get_legend_handles_labels()[0]
    axis.legend(handles, [h.get_label() for h in handles], loc="upper left")
    axis.set_title("Throughput against concurrency, one process")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write(results: dict, output_dir: Path) -> str:
    """`concurrency.json`, `concurrency.md`, `concurrency.png` in `output_dir`; returns the markdown."""
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "concurrency.json").write_text(json.dumps(results, indent=2))
    table = markdown(results)
    (output_dir / "concurrency.md").write_text(table)
    plot(results, output_dir / "concurrency.png")
    return table


__all__ = ["concurrency_benchmark", "left_pad", "markdown", "new_tokens", "plot", "timed", "write"]
