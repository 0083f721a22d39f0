"""`d3d quickstart`: the embedded default end to end, each stage reusing what an earlier run finished.

tokenizer -> target (trained from scratch) -> small AR assistant -> target-regenerated responses -> D3D drafter
(from the assistant's weights) -> pruning, kept if it pays -> benchmark (eager and compiled). Everything lands in one
output folder.
"""

import contextlib
import functools
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoTokenizer, Qwen3ForCausalLM

from d3d.benchmark.bench import benchmark
from d3d.common import report
from d3d.common.dtype import DtypeChoice, choose_dtype
from d3d.common.prompts import encode_prompt
from d3d.hub_upload.model_card import write_model_card
from d3d.trainer.d3d_trainer import D3DTrainer
from d3d.trainer.data import DATASET, generate_responses
from d3d.trainer.provenance import DrafterProvenance, record_pruning
from d3d.trainer.pruning import prune
from modeling_d3d import D3DForBlockDiffusion

from d3d.common.corpus import function_prompts, humaneval_prompts, pydoc_prompts, quality_texts, training_texts
from .budget import fit, measure_unit_costs, projected_seconds
from .recipe import Recipe, recorded_recipe
from .pretrain import (bits_per_byte, causal_lm_config, chunked_dataset, drafter_arguments, perplexity, pretrain,
                       pretraining_arguments, train_tokenizer)
from .sizes import MICRO, ModelSize, QuickstartSizes


def _done(folder: Path) -> bool:
    return (folder / "config.json").exists()


def benchmark_done(output: Path, drafter: Path) -> bool:
    """Whether the benchmark stage finished (its json, table and plot) after the drafter's weights in `drafter` were
    written."""
    files = [output / f"bench.{kind}" for kind in ("json", "md", "png")]
    weights = (drafter / "model.safetensors").stat().st_mtime_ns
    return all(f.exists() for f in files) and min(f.stat().st_mtime_ns for f in files) >= weights


def _causal_lm(folder: Path, size: ModelSize, tokenizer, vocab_size: int, dataset: Dataset, choice: DtypeChoice) -> None:
    """Train a causal LM from scratch on `dataset` (its first rows held out for perplexity) and save it, with its
    held-out perplexity and its bits per byte on `quality_texts` in `perplexity.json`."""
    config = causal_lm_config(tokenizer, vocab_size, size)
    held_out = dataset.select(range(min(64, len(dataset) // 10)))
    args = pretraining_arguments(folder, size.steps, size.batch_size, size.learning_rate, choice.bf16)
    model = pretrain(config, dataset.select(range(len(held_out), len(dataset))), args)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    quality = {name: bits_per_byte(model, tokenizer, texts) for name, texts in quality_texts().items()}
    (folder / "perplexity.json").write_text(json.dumps({"held_out_perplexity": perplexity(model, held_out),
                                                        "bits_per_byte": quality}))
    shutil.rmtree(folder / "checkpoints", ignore_errors=True)


def _first_recipe(sizes: QuickstartSizes, budget_minutes: float | None, start: float, tokenizer,
                  dataset: Callable[[], Dataset], prompts: list[str], choice: DtypeChoice) -> Recipe:
    """A first run's recipe: `sizes`, where `budget_minutes` is given fitted (`budget.fit`) to what is left of them
    since `start` (`time.monotonic()`) after timing the stages' units on this machine (the responses' `prompts`
    among them); said in one line."""
    if budget_minutes is None:
        return Recipe(sizes)
    encoded = [encode_prompt(tokenizer, prompt) for prompt in prompts[: sizes.response_batch_size]]
    costs = measure_unit_costs(sizes, tokenizer, dataset(), encoded, choice)
    fitted, factor = fit(sizes, costs, start + 60 * budget_minutes - time.monotonic())
    projected = projected_seconds(fitted, costs)
    minutes = {name: sum(projected_seconds(s, costs).values()) / 60 for name, s in (("default", sizes), ("fitted", fitted))}
    outcome = ("within it" if factor == 1.0 else
               f"every step and prompt count scaled to {factor:.2f} of the default's (projected {minutes['fitted']:.0f} min)")
    print(f"recipe: the default projects {minutes['default']:.0f} min on this machine (the target's training step "
          f"{costs.target_step:.2f} s) against the time budget of {budget_minutes:g} min: {outcome}")
    return Recipe(fitted, {"scale": factor, "time_budget_seconds": budget_minutes * 60, "unit_costs": asdict(costs),
                           "projected_seconds": {name: round(value, 1) for name, value in projected.items()}})


def run_quickstart(output: Path, sizes: QuickstartSizes = QuickstartSizes(), dtype: str = "auto",
                   budget_minutes: float | None = None) -> dict:
    """Run (or resume) every stage into `output` in the dtype `choose_dtype(dtype)` picks (printed, and recorded in
    `sizes.json`, `bench.json` and the drafter's provenance), the benchmark in float32 (eager and compiled), where
    token identity with the target is exact; returns the benchmark results (also in `bench.json`).

    budget_minutes: a first run scales `sizes` down to end within it (`budget.fit`), said in one line; `sizes.json`
    records the sizes, the plan and each stage's seconds, and a rerun keeps its recipe (`recipe.recorded_recipe`;
    `ValueError` where the folder holds a run of other sizes)."""
    start = time.monotonic()
    choice = choose_dtype(dtype)
    print(choice)
    output.mkdir(parents=True, exist_ok=True)
    kept = recorded_recipe(output, sizes)
    texts = training_texts(sizes.corpus_bytes)  # the corpus, vocabulary and sequence length are never scaled
    if (output / "tokenizer" / "tokenizer.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(output / "tokenizer")
    else:
        tokenizer = train_tokenizer(texts, sizes.vocab_size)
        tokenizer.save_pretrained(output / "tokenizer")
    dataset = functools.cache(lambda length=sizes.sequence_length: chunked_dataset(tokenizer, texts, length).shuffle(seed=0))
    prompts = function_prompts(sizes.drafter_prompts)  # a scaled recipe's responses are their first ones
    if kept is not None:
        print(f"recipe: kept from the first run into {output} ({kept.plan['scale']:.2f} of the given sizes' counts)")
    recipe = kept or _first_recipe(sizes, budget_minutes, start, tokenizer, dataset, prompts, choice)
    sizes = recipe.sizes
    recipe.seconds["setup"] = round(time.monotonic() - start, 1)
    recipe.write(output, choice.description)

    def stage(name: str):
        return recipe.stage(name, output, choice.description)

    models = {"target": sizes.target, "assistant": sizes.assistant}
    for name, size in models.items():
        if not _done(output / name):
            with stage(name):
                _causal_lm(output / name, size, tokenizer, sizes.vocab_size, dataset(), choice)
    target, assistant = (Qwen3ForCausalLM.from_pretrained(output / name, dtype=choice.dtype).eval() for name in models)

    responded = (output / "data" / DATASET).is_dir()
    with contextlib.nullcontext() if responded else stage("responses"):
        data = generate_responses(target, tokenizer, prompts[: sizes.drafter_prompts], output / "data",
                                  batch_size=sizes.response_batch_size, max_new_tokens=sizes.response_tokens)
    dev = 2 * sizes.dev_prompts
    train_data, dev_prompts = data.select(range(len(data) - dev)), [torch.tensor([p]) for p in data[len(data) - dev :]["prompt"]]

    trained = output / "drafter-trained"
    if _done(trained):
        drafter = D3DForBlockDiffusion.from_pretrained(trained)
    else:  # from the AR assistant, float32 weights, trained under bf16 autocast when the choice is bfloat16
        drafter = D3DForBlockDiffusion.from_backbone(str(output / "assistant"), block_size=sizes.block_size,
                                                     tokenizer=tokenizer, dtype=torch.float32)
        with stage("drafter"):
            D3DTrainer(drafter, drafter_arguments(trained, sizes, sizes.drafter_steps, choice),
                       train_dataset=train_data).train()
        drafter.save_pretrained(trained)
        DrafterProvenance(
            target=str((output / "target").resolve()), base_model=str((output / "assistant").resolve()),
            training_data=(f"{len(train_data)} target-regenerated responses to standard-library function prompts "
                           "(the embedded quickstart corpus)"),
            recipe={"steps": sizes.drafter_steps, "batch": sizes.drafter_batch_size,
                    "learning rate": sizes.drafter_learning_rate, "loss": "L_diff + L_AR"},
            dtype=choice.description,
        ).save(trained)
    drafter.eval()

    final = output / "drafter"
    if not _done(final):
        pruning = output / "pruning"
        depth = drafter.config.num_hidden_layers
        with stage("pruning"):
            prune(drafter, target, train_data, dev_prompts[: sizes.dev_prompts], dev_prompts[sizes.dev_prompts :],
                  pruning, drafter_arguments(pruning, sizes, sizes.recovery_steps, choice),
                  min_layers=max(depth - sizes.prune_stages, 1), min_tau_fraction=0.0, max_new_tokens=sizes.response_tokens)
        shutil.copytree(pruning / "drafter", final)
        tokenizer.save_pretrained(final)
        record_pruning(trained, final)
    # The benchmark checks every output against the target's own: exact in float32 only (bf16 rounds a block pass
    # differently from one-token steps, so near-ties flip for every speculative method; see the README).
    target, assistant = target.float(), assistant.float()
    drafter = D3DForBlockDiffusion.from_pretrained(final, dtype=torch.float32).eval()

    if benchmark_done(output, final):
        print(f"benchmark: kept from an earlier run ({output / 'bench.md'}; `d3d bench` measures again)")
        results = json.loads((output / "bench.json").read_text())
    else:
        prompt_sets = {
            "humaneval": [torch.tensor([tokenizer(p)["input_ids"]]) for p in humaneval_prompts()[: sizes.bench_prompts]],
            "pydoc": [torch.tensor([tokenizer(p)["input_ids"]]) for p in pydoc_prompts()[: sizes.bench_pydoc_prompts]],
        }
        with stage("benchmark"):
            results = {"dtype": f"training {choice.description}; benchmark float32 (exact token identity)",
                       **benchmark(target, drafter, prompt_sets, sizes.bench_new_tokens, assistant, compile="both")}
        report.write(results, output)
    write_model_card(final, repo=str(final), bench=results)
    print("stages (s): " + ", ".join(f"{name} {value:.0f}" for name, value in recipe.seconds.items())
          + f"; this run {time.monotonic() - start:.0f}")
    return results


__all__ = ["MICRO", "ModelSize", "QuickstartSizes", "benchmark_done", "run_quickstart"]
