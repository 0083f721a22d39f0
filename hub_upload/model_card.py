"""The drafter's model card, built with `huggingface_hub.ModelCard` from what its folder and the benchmark say."""

from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData
from transformers import AutoConfig

from d3d.common.report import markdown
from d3d.trainer.provenance import DrafterProvenance
from modeling_d3d.versions_d3d import TRANSFORMERS_RANGE, requirement

# Hub datasets behind the benchmark's prompt sets (pydoc prose ships with Python and has no Hub id).
DATASETS = {"humaneval": "openai/openai_humaneval", "pydoc": "pydoc_data"}
METRICS = {"tau": "acceptance length τ", "speedup": "speedup over the target", "hit_rate": "cache-hit rate"}

USAGE = """```python
from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

target = AutoModelForCausalLM.from_pretrained("{target}")
tokenizer = AutoTokenizer.from_pretrained("{target}")
ids = tokenizer("def fibonacci(n):", return_tensors="pt").input_ids
# the D3D engine as a decoding method of the target's own generate (this repo's custom_generate/ folder):
out = target.generate(ids, custom_generate="{repo}", trust_remote_code=True, max_new_tokens=64,
                      stop_strings=["\\n\\n"], tokenizer=tokenizer, streamer=TextStreamer(tokenizer))
print(f"tokens per round: {{target.d3d_drafter.round_record.tau:.2f}}")   # the drafter it loaded, reused

# or load the drafter yourself (its code ships with this repository):
from transformers import AutoModel
drafter = AutoModel.from_pretrained("{repo}", trust_remote_code=True)
out = drafter.generate_batch(target, ids, max_new_tokens=64, do_sample=False)   # batches of left-padded prompts too
out = drafter.generate_batch(target, ids, asynchronous=True, max_new_tokens=64)  # drafts the next blocks meanwhile
out = target.generate(ids, assistant_model=drafter, max_new_tokens=64)          # transformers' assisted loop, batch 1
```"""

LIMITATIONS = """## Limitations

- The output is exactly the target's (greedy: token-identical; sampling: the target's distribution); the drafter only
  changes speed. Speed depends on the hardware and on how well the drafter matches the target on your prompts: the
  figures above come from the hardware named with them.
- The drafter must be used with the target's tokenizer (same vocabulary); its mask token must not be one of the
  target's special tokens.
- Through `generate(assistant_model=...)` the batch size is 1 (transformers' assisted generation).
"""


def eval_results(bench: dict) -> list[EvalResult]:
    """`model-index` entries: τ, speedup and (asynchronous rows) hit rate of every D3D method per prompt set."""
    hardware = bench.get("hardware", "hardware not recorded")
    results = []
    for set_name, prompt_set in bench["prompt_sets"].items():
        for row in prompt_set["methods"]:
            if not row["method"].startswith("D3D"):
                continue
            for key, label in METRICS.items():
                if row.get(key) is None:
                    continue
                results.append(EvalResult(
                    task_type="text-generation", task_name="Speculative decoding",
                    dataset_type=DATASETS.get(set_name, set_name), dataset_name=set_name,
                    metric_type=key, metric_value=round(float(row[key]), 4),
                    metric_name=f"{label}, {row['method']} ({hardware})",
                ))
    return results


def _hub_id(name: str) -> bool:
    """Whether `name` reads as a Hub repo id (`owner/name`) rather than a local folder (recorded absolute)."""
    return name.count("/") == 1 and not name.startswith((".", "/", "~"))


def benchmark_sections(bench: dict) -> tuple[list[EvalResult], str]:
    """The card's `model-index` entries and its Benchmark section from `d3d bench`'s results; `ValueError` when
    `bench` is not what `d3d bench` writes (user input: `d3d push --bench FILE`)."""
    try:
        return eval_results(bench), (
            f"## Benchmark\n\nMeasured with `d3d bench` on {bench.get('hardware', 'hardware not recorded')}, "
            f"block size {bench['block_size']}.\n\n" + markdown(bench))
    except (KeyError, TypeError, AttributeError, ValueError) as error:
        raise ValueError(f"the benchmark results are not a bench.json that `d3d bench` wrote ({type(error).__name__}: "
                         f"{error}): give --bench a file from `d3d bench`, or none") from error


def build_model_card(folder: str | Path, repo: str, bench: dict | None = None, target: str | None = None) -> ModelCard:
    """A card for the drafter in `folder` (its `config.json` and `d3d_training.json`), published as `repo`.

    target: the target's Hub id for the usage snippet (default: the one recorded at training time).
    """
    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    provenance = DrafterProvenance.load(folder)
    recorded_target = provenance.target if provenance else None
    base_model = provenance.base_model if provenance else None
    if target and base_model is not None and base_model == recorded_target:  # initialised from the target
        base_model = target
    target = target or recorded_target
    if target is None:
        raise ValueError(f"{folder} does not record its target model: name it (d3d push --target ORG/MODEL)")
    results, benchmark = benchmark_sections(bench) if bench else (None, "")
    data = ModelCardData(
        model_name=repo.split("/")[-1], library_name="transformers", pipeline_tag="text-generation",
        base_model=base_model if base_model and _hub_id(base_model) else None,
        tags=["d3d", "speculative-decoding", "block-diffusion", "drafter", "custom_generate"],
        eval_results=results,
    )
    depth = config.num_hidden_layers
    if provenance and provenance.layers_before_pruning:
        pruning = (f"{provenance.pruning_stages} acceptance-guided pruning stage(s): "
                   f"{provenance.layers_before_pruning} -> {depth} layers")
    else:
        pruning = "none"
    training = ""
    if provenance:
        recipe = ", ".join(f"{key} {value}" for key, value in provenance.recipe.items()) or "not recorded"
        training = (f"- initialised from: `{base_model or 'not recorded'}`\n"
                    f"- training data: {provenance.training_data or 'not recorded'}\n"
                    f"- recipe: {recipe}\n"
                    f"- training dtype: {provenance.dtype or 'not recorded'}\n")
    text = f"""---
{data.to_yaml()}
---

# D3D drafter for `{target}`

A standalone block-diffusion drafter (D3D) for lossless speculative decoding: it proposes
{config.block_size - 1} tokens per forward pass from token ids alone, and the target verifies them, so the
output is exactly the target's.

- target model: `{target}`
- block size: {config.block_size}; mask token id: {config.mask_token_id}
- depth: {depth} layers; pruning: {pruning}
{training}
## Usage

Requires `{requirement('transformers', TRANSFORMERS_RANGE)}` (the drafter's code ships with this repository: `trust_remote_code=True`).

{USAGE.format(target=target, repo=repo)}

{benchmark}
{LIMITATIONS}"""
    return ModelCard(text)


def write_model_card(folder: str | Path, repo: str, bench: dict | None = None, target: str | None = None) -> None:
    """Write the card of the drafter in `folder` to `folder/README.md`."""
    build_model_card(folder, repo, bench, target).save(Path(folder) / "README.md")


__all__ = ["build_model_card", "eval_results", "write_model_card"]
