"""Run by the vLLM environment for `d3d gpu-check --vllm` (`d3d.benchmark.gpu_check_vllm`): one vLLM engine, the target
alone or with a D3D drafter, greedy over token-id prompts at each concurrency level; answers one JSON file.

`python -m d3d.benchmark.gpu_check_vllm_worker SETTINGS_JSON OUT_JSON`; SETTINGS: `target`, `drafter` (null: vLLM
alone), `num_speculative_tokens`, `dtype`, `max_model_len`, `enforce_eager`, `prompts` (lists of ids), `levels`,
`max_tokens`, `recorded_prompts`, `recorded_tokens`. OUT: versions, the attention backends vLLM selected (target and
drafter), the CUDA graph mode, per level tokens/s, the outputs and vLLM's speculative counters, and (D3D) every
proposal made for the first `recorded_prompts` prompts generated together (`d3d.benchmark.vllm_drafts`).
The engine core runs in this process (so its runner and proposer can be read); vLLM's logs go to stderr.
"""

import json
import os
import sys
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before vLLM is imported: the engine core in this process


def backends(worker) -> dict:
    """Run on vLLM's worker (`LLM.collective_rpc`): the attention backends of the target's and the drafter's layers."""
    runner = worker.model_runner
    drafter = getattr(runner, "drafter", None)
    return {"target": sorted({group.backend.get_name() for groups in runner.attn_groups for group in groups}),
            "drafter": sorted({group.backend.get_name() for group in getattr(drafter, "draft_attn_groups", [])}),
            "proposer": type(drafter).__name__ if drafter is not None else None}


def spec_counters(llm) -> dict[str, float]:
    """vLLM's speculative-decoding counters (`vllm:spec_decode_num_drafts`, `..._num_accepted_tokens`, ...)."""
    counters: dict[str, float] = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode_num_") and hasattr(metric, "value"):
            name = metric.name.removeprefix("vllm:spec_decode_")
            counters[name] = counters.get(name, 0.0) + float(metric.value)
    return counters


def run_level(llm, params, prompts: list[list[int]], level: int) -> dict:
    """All `prompts`, `level` requests at a time (each group generated together): tokens/s, outputs, τ."""
    warm_up = params.clone()
    warm_up.max_tokens = min(8, params.max_tokens)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:level]], warm_up, use_tqdm=False)
    before = spec_counters(llm)
    outputs, began = [], time.perf_counter()
    for start in range(0, len(prompts), level):
        group = [{"prompt_token_ids": p} for p in prompts[start:start + level]]
        outputs += [list(o.outputs[0].token_ids) for o in llm.generate(group, params, use_tqdm=False)]
    seconds = time.perf_counter() - began
    after = spec_counters(llm)
    drafts = after.get("num_drafts", 0.0) - before.get("num_drafts", 0.0)
    accepted = after.get("num_accepted_tokens", 0.0) - before.get("num_accepted_tokens", 0.0)
    tokens = sum(len(output) for output in outputs)
    return {"level": level, "seconds": seconds, "new_tokens": tokens, "tokens_per_second": tokens / seconds,
            "drafting_rounds": drafts, "accepted_drafts": accepted, "tau": 1 + accepted / drafts if drafts else None,
            "outputs": outputs}


def main(settings_path: str, out_path: str) -> None:
    settings = json.loads(Path(settings_path).read_text())
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    recorder = None
    speculative = None
    if settings["drafter"] is not None:
        from .vllm_drafts import DraftRecorder
        from .vllm_server import d3d_speculative_config

        recorder = DraftRecorder()
        recorder.install()
        speculative = d3d_speculative_config(settings["drafter"], settings["num_speculative_tokens"])
    began = time.perf_counter()
    llm = LLM(model=settings["target"], dtype=settings["dtype"], max_model_len=settings["max_model_len"],
              max_num_seqs=max(settings["levels"]), enforce_eager=settings["enforce_eager"],
              enable_prefix_caching=False, seed=0, skip_tokenizer_init=True, disable_log_stats=False,
              speculative_config=speculative)
    startup = time.perf_counter() - began
    config = llm.llm_engine.vllm_config
    result = {"vllm": vllm.__version__, "torch": torch.__version__, "startup_seconds": startup,
              "backends": llm.collective_rpc(backends)[0],
              "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
              "async_scheduling": config.scheduler_config.async_scheduling, "levels": []}
    params = SamplingParams(temperature=0.0, max_tokens=settings["max_tokens"], ignore_eos=True, detokenize=False)
    for level in settings["levels"]:
        result["levels"].append(run_level(llm, params, settings["prompts"], level))
        print(f"vllm worker: level {level}: {result['levels'][-1]['tokens_per_second']:.1f} tok/s", file=sys.stderr,
              flush=True)
    if recorder is not None:
        recorded = settings["prompts"][: settings["recorded_prompts"]]
        recorder.recording = True
        outputs = llm.generate([{"prompt_token_ids": p} for p in recorded],
                               SamplingParams(temperature=0.0, max_tokens=settings["recorded_tokens"], ignore_eos=True,
                                              detokenize=False), use_tqdm=False)
        recorder.recording = False
        result["recorded"] = recorder.results(recorded, outputs)
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
