"""`d3d bench --engine vllm --concurrency 1,4,16`: vLLM alone, vLLM's n-gram speculation and vLLM with the D3D drafter
(the `d3d_vllm` plugin), each a real OpenAI-compatible server on 127.0.0.1 fed `c` requests at a time, beside this
project's own engine (`d3d.benchmark.concurrency`: the target's batched greedy decoding, D3D sync and async) on the
same token-id prompts, greedy.

Tokens/s is aggregate completion tokens over wall time at each level; τ for vLLM is its own counters (1 + accepted
drafts per drafting round, from /metrics); every speculative output is checked against vLLM alone's. The servers
run one after another (not interleaved), so drift of the machine between them shows in the numbers.
"""

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from d3d.common.report import pyplot, save_figure, table, write_report
from .vllm_server import (
                          complete,
                          d3d_speculative_config,
                          free_port,
                          running,
                          server_command,
                          spec_counters,
                          )

VLLM_METHODS = ("vLLM alone", "vLLM n-gram", "vLLM + D3D")
# Exactness is measured on computed tokens: no prefix caching.
SERVER_FLAGS = ["--no-enable-prefix-caching"]


def speculative_configs(drafter: str, num_speculative_tokens: int) -> dict[str, dict | None]:
    return {
        "vLLM alone": None,
        "vLLM n-gram": {"method": "ngram", "num_speculative_tokens": num_speculative_tokens, "prompt_lookup_max": 4,
                        "prompt_lookup_min": 2},
        "vLLM + D3D": d3d_speculative_config(drafter, num_speculative_tokens),
    }


def serve_level(base_url: str, model: str, prompts: list[list[int]], level: int, max_new_tokens: int) -> dict:
    """All prompts, `level` in flight at a time: tokens/s, τ (None without speculation) and the texts."""
    with ThreadPoolExecutor(level) as pool:  # warm-up at this level
        list(pool.map(lambda prompt: complete(base_url, model, prompt, 8), prompts[:level]))
    before = spec_counters(base_url)
    began = time.perf_counter()
    with ThreadPoolExecutor(level) as pool:
        answers = list(pool.map(lambda prompt: complete(base_url, model, prompt, max_new_tokens), prompts))
    seconds = time.perf_counter() - began
    after = spec_counters(base_url)
    drafts = after.get("num_drafts", 0.0) - before.get("num_drafts", 0.0)
    accepted = after.get("num_accepted_tokens", 0.0) - before.get("num_accepted_tokens", 0.0)
    tokens = sum(answer["tokens"] for answer in answers)
    return {"tokens_per_second": tokens / seconds, "new_tokens": tokens, "seconds": seconds,
            "tau": 1 + accepted / drafts if drafts else None, "texts": [answer["text"] for answer in answers]}


def vllm_benchmark(vllm_python: str, target: str, drafter: str, prompts: list[list[int]], levels: list[int],
                   max_new_tokens: int, num_speculative_tokens: int, dtype: str, log_dir: Path) -> dict:
    """Each vLLM method's server in turn, every level on it; returns `{method: {level: serve_level(...)}}`."""
    log_dir.mkdir(parents=True, exist_ok=True)
    flags = [*SERVER_FLAGS, "--dtype", dtype, "--max-num-seqs", str(max(levels))]
    results = {}
    for name, spec in speculative_configs(drafter, num_speculative_tokens).items():
        port = free_port()
        log = log_dir / f"{name.replace(' ', '_').replace('+', 'plus')}.log"
        with running(server_command(vllm_python, target, port, spec, flags), port, log) as base_url:
            results[name] = {level: serve_level(base_url, target, prompts, level, max_new_tokens) for level in levels}
    return results


def combine(served: dict, engine: dict) -> dict:
    """One row per (level, method): vLLM's methods and this project's engine (`concurrency_benchmark`'s levels),
    with speedups over vLLM alone at the same level and losslessness against each side's own baseline."""
    rows = []
    for engine_row in engine["levels"]:
        level = engine_row["concurrency"]
        alone = served["vLLM alone"][level]
        for name in VLLM_METHODS:
            measured = served[name][level]
            rows.append({"concurrency": level, "method": name, "tokens_per_second": measured["tokens_per_second"],
                         "speedup": measured["tokens_per_second"] / alone["tokens_per_second"],
                         "tau": measured["tau"], "lossless": measured["texts"] == alone["texts"]})
        own = {"target batched (HF)": (engine_row["baseline_tokens_per_second"], None, True),
               "D3D engine sync": (engine_row["sync"]["tokens_per_second"], engine_row["sync"]["tau"],
                                   engine_row["sync"]["lossless"]),
               "D3D engine async": (engine_row["async"]["tokens_per_second"], engine_row["async"]["tau"],
                                    engine_row["async"]["lossless"])}
        for name, (speed, tau, lossless) in own.items():
            rows.append({"concurrency": level, "method": name, "tokens_per_second": speed,
                         "speedup": speed / alone["tokens_per_second"], "tau": tau, "lossless": lossless})
    return {"rows": rows}


def markdown(results: dict) -> str:
    lines = [
        f"### vLLM beside this project's engine ({results['requests']} requests, {results['max_new_tokens']} new "
        f"tokens, greedy, K = {results['num_speculative_tokens']}, {results['dtype']})",
        "",
    ] + table(["concurrency", "method", "tok/s", "× vLLM alone", "τ", "lossless"],
              [[row["concurrency"], row["method"], f"{row['tokens_per_second']:.1f}", f"{row['speedup']:.2f}x",
                "-" if row["tau"] is None else f"{row['tau']:.2f}", "yes" if row["lossless"] else "NO"]
               for row in results["rows"]])
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    """Aggregate tokens/s of each method against concurrency."""
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(7, 4))
    methods = list(dict.fromkeys(row["method"] for row in results["rows"]))
    for method in methods:
        rows = [row for row in results["rows"] if row["method"] == method]
        axis.plot([row["concurrency"] for row in rows], [row["tokens_per_second"] for row in rows], "o-", label=method)
    axis.set_xlabel("concurrent requests")
    axis.set_ylabel("aggregate tokens/s")
    axis.legend(fontsize=8)
    axis.set_title("vLLM (servers) beside this project's engine (one process)")
    save_figure(figure, path)


def write(results: dict, output_dir: Path) -> str:
    """`vllm_bench.json`, `.md`, `.png` in `output_dir`; returns the markdown."""
    return write_report(results, output_dir, "vllm_bench", markdown, plot)


__all__ = ["combine", "markdown", "speculative_configs", "vllm_benchmark", "write"]
