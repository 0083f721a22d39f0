"""Target-aligned training data: the target regenerates the responses the drafter learns from.

Records are appended to `responses.jsonl` as each batch finishes, so an interrupted run resumes where it stopped:
nothing regenerated twice, nothing lost. Each record keeps its prompt's token ids and the generation settings it was
made with; a rerun reuses only records whose prompt and settings match (whatever their position: prompts may have
been inserted or removed), regenerates the rest and drops the earlier records that no longer match. The finished set
is saved as a `datasets` dataset with `index`, `prompt` and `completion` (in the prompts' order).
"""

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from datasets import Dataset, load_from_disk
from tqdm.auto import tqdm

from d3d.common.prompts import encode_prompt, left_pad

RECORDS = "responses.jsonl"
DATASET = "dataset"


def read_records(path: Path) -> list[dict]:
    """The completed records of `path`, every one that is whole. A torn last line (an interrupted write, no newline
    yet) is cut from the file so the next append starts on a line of its own; an unreadable line elsewhere is skipped
    and reported on stderr, and the records after it are kept."""
    if not path.exists():
        return []
    records, skipped, whole_bytes = [], [], 0
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.endswith(b"\n"):
                break  # the last line, torn: cut below
            whole_bytes += len(line)
            record = _record(line)
            if record is None:
                skipped.append(number)
            else:
                records.append(record)
    if whole_bytes < path.stat().st_size:
        with path.open("r+b") as handle:
            handle.truncate(whole_bytes)
    if skipped:
        print(f"{path}: skipped {len(skipped)} unreadable line(s) (line {', '.join(map(str, skipped))}); "
              f"kept the {len(records)} whole record(s)", file=sys.stderr)
    return records


def _record(line: bytes) -> dict | None:
    """The record on `line`, or None unless it is a JSON object with a prompt and a completion."""
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) and {"prompt", "completion"} <= record.keys() else None


def _key(prompt_ids: list[int], settings: dict) -> str:
    """What a record must match to be reused: its prompt's token ids and its generation settings."""
    return json.dumps([prompt_ids, settings], sort_keys=True)


def reusable_records(path: Path, encoded: list[list[int]], settings: dict) -> dict[int, dict]:
    """Records of `path` made from `encoded[index]` with `settings`, by index; rewrites `path` to hold only those."""
    earlier = {_key(record["prompt"], record.get("settings")): record for record in read_records(path)}
    reused = {}
    for index, ids in enumerate(encoded):
        record = earlier.get(_key(ids, settings))
        if record is not None:
            reused[index] = {**record, "index": index}
    scratch = path.with_suffix(".tmp")
    scratch.write_text("".join(json.dumps(reused[index]) + "\n" for index in sorted(reused)))
    os.replace(scratch, path)
    if earlier:
        print(f"{path}: reused {len(reused)} of {len(encoded)} rows; {len(encoded) - len(reused)} prompt(s) new or with "
              f"other settings; {len(earlier) - len(reused)} earlier row(s) dropped")
    return reused


def _completion(generated: list[int], stop_ids: set[int], pad_token_id: int | None) -> list[int]:
    """Cut generated ids after the first stop token (kept) and drop trailing padding."""
    for position, token in enumerate(generated):
        if token in stop_ids:
            return generated[: position + 1]
    while generated and pad_token_id is not None and generated[-1] == pad_token_id:
        generated = generated[:-1]
    return generated


# One batch of the loop: `complete(indices, prompt_ids)` returns the generated ids of each prompt (stop tokens
# included, padding allowed after them).
Completer = Callable[[list[int], list[list[int]]], list[list[int]]]


@torch.no_grad()
def generate_responses(
    target,
    tokenizer,
    prompts: list[str],
    output_dir: str | os.PathLike,
    batch_size: int = 8,
    max_new_tokens: int = 256,
    do_sample: bool = False,
    seed: int = 0,
    **generate_kwargs,
) -> Dataset:
    """Regenerate a response for every prompt with `target` (batched, left-padded) and return the dataset.

    Sampling settings default to the target's generation config (its recommended ones); `do_sample=False` is greedy.
    Rerunning with the same `output_dir` continues an interrupted run."""
    settings = {"max_new_tokens": max_new_tokens, "do_sample": do_sample, "seed": seed if do_sample else None,
                **{name: repr(value) for name, value in generate_kwargs.items()}}
    tokenizer.padding_side = "left"
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = next(target.parameters()).device

    def complete(indices: list[int], batch: list[list[int]]) -> list[list[int]]:
        input_ids, attention_mask = left_pad(batch, pad_token_id)
        torch.manual_seed(seed + indices[0])
        generated = target.generate(
            input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), max_new_tokens=max_new_tokens,
            do_sample=do_sample, pad_token_id=pad_token_id, **generate_kwargs,
        )
        return generated[:, input_ids.shape[1]:].tolist()

    return write_responses(tokenizer, target.generation_config.eos_token_id, prompts, output_dir, settings,
                           batch_size, complete)


def write_responses(
    tokenizer,
    eos_token_id: int | list[int] | None,
    prompts: list[str],
    output_dir: str | os.PathLike,
    settings: dict,
    batch_size: int,
    complete: Completer,
) -> Dataset:
    """The resumable loop of every engine: reuse the records made with `settings`, `complete` the other prompts a
    batch at a time (each record appended and synced as its batch finishes), then save the dataset."""
    output = Path(output_dir)
    output.mkdir(parents=True, exist_ok=True)
    records_path = output / RECORDS
    encoded = [encode_prompt(tokenizer, prompt) for prompt in prompts]
    records = reusable_records(records_path, encoded, settings)
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = eos_token_id
    stop_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    todo = [index for index in range(len(prompts)) if index not in records]
    with records_path.open("a") as sink, tqdm(total=len(prompts), initial=len(records), desc="target responses") as bar:
        for start in range(0, len(todo), batch_size):
            indices = todo[start : start + batch_size]
            batch = [encoded[index] for index in indices]
            for index, ids, generated in zip(indices, batch, complete(indices, batch), strict=True):
                completion = _completion(generated, stop_ids, pad_token_id)
                record = {"index": index, "prompt": ids, "completion": completion, "settings": settings}
                sink.write(json.dumps(record) + "\n")
                records[index] = record
            sink.flush()
            os.fsync(sink.fileno())
            bar.update(len(indices))
    ordered = [{name: records[index][name] for name in ("index", "prompt", "completion")} for index in range(len(prompts))]
    dataset = Dataset.from_list(ordered)
    dataset.save_to_disk(str(output / DATASET))
    return dataset


def load_responses(output_dir: str | os.PathLike) -> Dataset:
    """The dataset a finished `generate_responses` run saved (`FileNotFoundError` if there is none)."""
    path = Path(output_dir) / DATASET
    if not path.is_dir():
        raise FileNotFoundError(f"no dataset in {output_dir}: run `d3d generate-data --output {output_dir}` first")
    return load_from_disk(str(path))


__all__ = ["encode_prompt", "generate_responses", "load_responses", "read_records", "reusable_records",
           "write_responses"]
