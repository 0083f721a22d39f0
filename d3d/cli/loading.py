"""Loading what the commands take: models, tokenizers and prompt files."""

import json
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def load_target(path: str, dtype: torch.dtype, device_map: str | None = None):
    """A target causal LM in `dtype` (see `d3d.common.dtype.choose_dtype`) and its tokenizer from a folder or Hub id.
    On CUDA it goes whole to this process's GPU (`LOCAL_RANK`, else 0): the engine refuses a target split over
    devices."""
    device_map = device_map or (f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else None)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=device_map).eval()
    return model, AutoTokenizer.from_pretrained(path)


def read_prompts(path: str | Path) -> list[str]:
    """Prompts from a `.jsonl` file (field `prompt`, else `text`) or a text file (one per line)."""
    path = Path(path)
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if path.suffix == ".jsonl":
        records = [json.loads(line) for line in lines]
        return [record["prompt"] if "prompt" in record else record["text"] for record in records]
    return lines
