"""The drafter's model card, built with `huggingface_hub.ModelCard` from what the folder and the benchmark say."""

from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData

USAGE = """```python
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

target = AutoModelForCausalLM.from_pretrained("{target}")
tokenizer = AutoTokenizer.from_pretrained("{target}")
drafter = AutoModel.from_pretrained("{repo}", trust_remote_code=True)
ids = tokenizer("def fibonacci(n):", return_tensors="pt").input_ids
out = target.generate(ids, assistant_model=drafter, max_new_tokens=64, do_sample=False)
print(tokenizer.decode(out[0]))
```"""


def build_model_card(drafter_config, target: str, repo: str, training: str, bench: dict | None = None) -> ModelCard:
    """A card with base/target model, block size, depth, training recipe and benchmark tables."""
    data = ModelCardData(library_name="transformers", base_model=target, pipeline_tag="text-generation",
                         tags=["d3d", "speculative-decoding", "block-diffusion", "drafter"])
    bench_section = ""
    if bench is not None:
        from benchmark.report import markdown

        bench_section = "## Benchmark\n\n" + markdown(bench)
    text = f"""---
{data.to_yaml()}
---

# D3D drafter for `{target}`

A standalone block-diffusion drafter (D3D) for lossless speculative decoding: it proposes
{drafter_config.block_size - 1} tokens per forward pass from token ids alone, and the target verifies them, so the
output is exactly the target's.

- target model: `{target}`
- block size: {drafter_config.block_size}; mask token id: {drafter_config.mask_token_id}
- depth: {drafter_config.num_hidden_layers} layers
- training: {training}

## Usage

{USAGE.format(target=target, repo=repo)}

{bench_section}
## Limitations

Speed depends on the hardware and on how well the drafter matches the target on your prompts; the figures above
come from the machine named with them. Batch size is 1 through `generate(assistant_model=...)`.
"""
    return ModelCard(text)


def write_model_card(folder: Path, **kwargs) -> None:
    build_model_card(**kwargs).save(folder / "README.md")


__all__ = ["build_model_card", "write_model_card"]
