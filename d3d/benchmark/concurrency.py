"""`d3d bench --concurrency 1,4,8,16`: aggregate throughput of batched D3D against the target's own batched greedy
decoding, at each number of concurrent requests, in one process.

At concurrency c the prompts are decoded in groups of c, left-padded: the baseline is `target.generate` on the
group (Hugging Face batched greedy decoding, finished rows padded until the last one ends), D3D is the engine
(`drafter.generate_batch`, i.e. `custom_generate=speculative_generate`) on the same group (rows leave at their own
EOS or length), synchronous and asynchronous, and the batch server (`D3DBatchServer` of c rows, synchronous: the
group's c requests submitted at once, decoded on its scheduler thread); statistics come from the engines'
`RoundRecord`s. D3D runs at the front doors' defaults (the drafter and prompt lookup, one chooser per row: the hybrid),
the fixed block with the policy off (the paper's rule).
All count the same new tokens (each row up to its EOS); every D3D row is checked against the baseline's row. Each
level is warmed up first.
"""

from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig

from modeling_d3d.engine_d3d import RoundRecord
from modeling_d3d.generation_d3d import pad_outputs
from modeling_d3d.serving_d3d import D3DBatchServer

from d3d.common.measure import timed
from d3d.common.prompts import left_pad
from d3d.common.report import percent, pyplot, save_figure, table, write_report


def new_tokens(sequences: torch.Tensor, prompt_width: int, eos_token_ids: set[int]) -> list[list[int]]:
    """Each row's new tokens up to and including its first EOS."""
    rows = []
    for row in sequences[:, prompt_width:].tolist():
        end = next((i + 1 for i, token in enumerate(row) if token in eos_token_ids), len(row))
        rows.append(row[:end])
    return rows


COUNTERS = ("new_tokens", "row_rounds", "rounds", "lookups", "branch_hits")


def served(server: D3DBatchServer, ids: torch.Tensor, mask: torch.Tensor, pad_token_id: int, max_new_tokens: int,
           record: RoundRecord) -> torch.Tensor:
    """The left-padded group `(c, P)` submitted to `server` at once, as `(c, P + longest)` sequences padded with
    `pad_token_id`; `record` gets the server's round counters of this group."""
    before = {key: getattr(server.round_record, key) for key in COUNTERS}
    handles = [server.submit(row[mask[i].bool()].tolist(), max_new_tokens=max_new_tokens, do_sample=False)
               for i, row in enumerate(ids)]
    rows = [handle.result(timeout=3600) for handle in handles]
    for key in COUNTERS:
        setattr(record, key, getattr(server.round_record, key) - before[key])
    return pad_outputs(ids.cpu(), dict(enumerate(rows)), GenerationConfig(pad_token_id=pad_token_id))


def fresh(records: dict[str, RoundRecord], name: str) -> RoundRecord:
    """A new round record for the next call of method `name`, kept in `records` to read after the call."""
    records[name] = RoundRecord()
    return records[name]


def measure_level(methods: dict, groups: list, records: dict[str, RoundRecord], eos_ids: set[int], device):
    """Every method on every group, methods interleaved group by group after a warm-up on the first group: seconds
    per method, each row's new tokens per method, and the round counters summed per recorded method."""
    for generate in methods.values():
        timed(lambda g=generate: g(groups[0][0].to(device), groups[0][1].to(device)), device)
    seconds = dict.fromkeys(methods, 0.0)
    outputs = {name: [] for name in methods}
    totals = {name: dict.fromkeys(COUNTERS, 0) for name in records}
    for ids, mask in groups:
        for name, generate in methods.items():
            sequences, elapsed = timed(lambda g=generate: g(ids.to(device), mask.to(device)).cpu(), device)
            seconds[name] += elapsed
            outputs[name] += new_tokens(sequences, ids.shape[1], eos_ids)
            if name in totals:
                for key in COUNTERS:
                    totals[name][key] += getattr(records[name], key)
    return seconds, outputs, totals


def concurrency_benchmark(
    target, drafter, prompts: list[torch.Tensor], levels: list[int], max_new_tokens: int, coverage: int, fanout: int
) -> dict:
    """For each concurrency level, on the same groups (interleaved group by group, so machine drift hits all alike):
    tokens/s of the target's batched greedy decoding, of batched D3D (sync, the verify policy on as every front door
    runs it; and sync with it off, the drafter's whole block every round: "fixed"), of batched D3D with asynchronous
    drafting at budget (coverage, fanout) and of the batch server (sync); speedups over the first; τ (tokens per row
    per round), batched rounds, cache-hit rate, and whether every D3D row equals the baseline's. Returns what
    `concurrency.json` holds."""
    config = target.generation_config
    eos = config.eos_token_id
    eos_ids = set([eos] if isinstance(eos, int) else (eos or []))
    pad = config.pad_token_id if config.pad_token_id is not None else next(iter(eos_ids), 0)
    settings = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
    records = {"sync": RoundRecord(), "fixed": RoundRecord(), "async": RoundRecord(), "server": RoundRecord()}
    longest = max(prompt.shape[1] for prompt in prompts) + max_new_tokens
    methods = {
        "baseline": lambda ids, mask: target.generate(ids, attention_mask=mask, **settings),
        "sync": lambda ids, mask: drafter.generate_batch(target, ids, attention_mask=mask,
                                                        round_record=fresh(records, "sync"), **settings),
        "fixed": lambda ids, mask: drafter.generate_batch(target, ids, attention_mask=mask, policy=False,
                                                         round_record=fresh(records, "fixed"), **settings),
        "async": lambda ids, mask: drafter.generate_batch(target, ids, attention_mask=mask, asynchronous=True,
                                                         coverage=coverage, fanout=fanout,
                                                         round_record=fresh(records, "async"), **settings),
    }
    rows = []
    for level in tqdm(levels, desc="concurrency levels"):
        groups = [left_pad([prompt[0].tolist() for prompt in prompts[start : start + level]], pad)
                  for start in range(0, len(prompts), level)]
        with D3DBatchServer(target, drafter, max_batch_size=level, max_length=longest) as server:
            methods["server"] = lambda ids, mask: served(server, ids, mask, pad, max_new_tokens, records["server"])
            seconds, outputs, totals = measure_level(methods, groups, records, eos_ids, target.device)
        speed = {name: sum(len(row) for row in outputs[name]) / seconds[name] for name in methods}
        row = {"concurrency": level, "requests": len(prompts), "new_tokens": sum(len(r) for r in outputs["baseline"]),
               "baseline_tokens_per_second": speed["baseline"], "baseline_seconds": seconds["baseline"]}
        for name, total in totals.items():
            row[name] = {
                "tokens_per_second": speed[name],
                "speedup": speed[name] / speed["baseline"],
                "tau": total["new_tokens"] / total["row_rounds"],
                "batched_rounds": total["rounds"],
                "hit_rate": total["branch_hits"] / total["lookups"] if total["lookups"] else None,
                "lossless": outputs[name] == outputs["baseline"],
                "seconds": seconds[name],
            }
        rows.append(row)
    return {"max_new_tokens": max_new_tokens, "block_size": drafter.config.block_size, "coverage": coverage,
            "fanout": fanout, "levels": rows}


def markdown(results: dict) -> str:
    budget = f"C={results['coverage']} F={results['fanout']}"
    lines = [
        f"### Concurrency ({results['levels'][0]['requests']} requests, {results['max_new_tokens']} new tokens, greedy)",
        "",
    ]
    rows = []
    for row in results["levels"]:
        methods = [row[name] for name in ("sync", "fixed", "async", "server")]
        lossless = "yes" if all(method["lossless"] for method in methods) else "NO"
        rows.append([row["concurrency"], f"{row['baseline_tokens_per_second']:.1f}"]
                    + [cell for m in methods for cell in (f"{m['tokens_per_second']:.1f}", f"{m['speedup']:.2f}x")]
                    + [f"{row['sync']['tau']:.2f}", percent(row["async"]["hit_rate"]), lossless])
    columns = ["concurrency", "target batched tok/s", "D3D sync tok/s", "speedup", "D3D sync, fixed block tok/s",
               "speedup", f"D3D async {budget} tok/s", "speedup", "D3D server tok/s", "speedup", "τ",
               "cache hits (async)", "lossless"]
    return "\n".join(lines + table(columns, rows)) + "\n"


def plot(results: dict, path: Path) -> None:
    """Aggregate tokens/s of each method against concurrency, speedups on a second axis."""
    plt = pyplot()

    levels = [row["concurrency"] for row in results["levels"]]
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot(levels, [row["baseline_tokens_per_second"] for row in results["levels"]], "o-", label="target batched greedy")
    axis.plot(levels, [row["sync"]["tokens_per_second"] for row in results["levels"]], "s-", label="D3D sync")
    axis.plot(levels, [row["fixed"]["tokens_per_second"] for row in results["levels"]], "v-",
              label="D3D sync, fixed block")
    axis.plot(levels, [row["async"]["tokens_per_second"] for row in results["levels"]], "^-", label="D3D async")
    axis.plot(levels, [row["server"]["tokens_per_second"] for row in results["levels"]], "d-", label="D3D server")
    axis.set_xlabel("concurrent requests")
    axis.set_ylabel("aggregate tokens/s")
    axis.set_xticks(levels)
    speedup_axis = axis.twinx()
    for name, style in (("sync", "k--"), ("fixed", "b--"), ("async", "k:"), ("server", "k-.")):
        speedup_axis.plot(levels, [row[name]["speedup"] for row in results["levels"]], style, alpha=0.6,
                          label=f"speedup, {name}")
    speedup_axis.set_ylabel("speedup over the target's batched decoding")
    handles = axis.get_legend_handles_labels()[0] + speedup_axis.get_legend_handles_labels()[0]
    axis.legend(handles, [h.get_label() for h in handles], loc="upper left", fontsize=8)
    axis.set_title("Throughput against concurrency, one process")
    save_figure(figure, path)


def write(results: dict, output_dir: Path) -> str:
    """`concurrency.json`, `concurrency.md`, `concurrency.png` in `output_dir`; returns the markdown."""
    return write_report(results, output_dir, "concurrency", markdown, plot)


__all__ = ["COUNTERS", "concurrency_benchmark", "fresh", "markdown", "measure_level", "new_tokens", "plot",
           "served", "write"]
