import json

import pytest
import torch

from conftest import tiny_target, word_tokenizer
from d3d.trainer.data import RECORDS, generate_responses, load_responses, read_records

PROMPTS = [" ".join(f"w{(i * 7 + j) % 90}" for j in range(1 + i % 5)) for i in range(11)]


class InterruptedTarget:
    """Wraps a real target; its `generate` is interrupted on the given call, as a killed run would be."""

    def __init__(self, target, interrupt_at: int):
        self.target, self.interrupt_at, self.calls = target, interrupt_at, 0

    def __getattr__(self, name):
        return getattr(self.target, name)

    def generate(self, **kwargs):
        self.calls += 1
        if self.calls == self.interrupt_at:
            raise KeyboardInterrupt
        return self.target.generate(**kwargs)


def test_responses_are_the_targets_greedy_continuations(tmp_path):
    target, tokenizer = tiny_target(0), word_tokenizer()
    dataset = generate_responses(target, tokenizer, PROMPTS[:4], tmp_path, batch_size=3, max_new_tokens=6)
    assert dataset.column_names == ["index", "prompt", "completion"] and len(dataset) == 4
    for text, example in zip(PROMPTS, dataset):
        ids = tokenizer(text)["input_ids"]
        expected = target.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, len(ids) :].tolist()
        assert example["prompt"] == ids and example["completion"] == expected
    assert load_responses(tmp_path)[:] == dataset[:]


def test_an_interrupted_run_resumes_without_loss_or_duplicates(tmp_path):
    target, tokenizer = tiny_target(0), word_tokenizer()
    interrupted = InterruptedTarget(target, interrupt_at=3)
    with pytest.raises(KeyboardInterrupt):
        generate_responses(interrupted, tokenizer, PROMPTS, tmp_path, batch_size=2, max_new_tokens=5)
    with (tmp_path / RECORDS).open("a") as handle:
        handle.write('{"index": 9, "prompt": [1')  # a torn write from the killed process
    resumed = InterruptedTarget(target, interrupt_at=-1)
    dataset = generate_responses(resumed, tokenizer, PROMPTS, tmp_path, batch_size=2, max_new_tokens=5)
    assert resumed.calls == 4  # 4 of 11 prompts were done in 2 batches; 7 remain in 4 batches
    lines = [json.loads(line) for line in (tmp_path / RECORDS).read_text().splitlines()]
    assert sorted(record["index"] for record in lines) == list(range(11))
    fresh = generate_responses(target, tokenizer, PROMPTS, tmp_path / "fresh", batch_size=2, max_new_tokens=5)
    assert dataset[:] == fresh[:]


class CountingTarget(InterruptedTarget):
    """A real target that also records how many prompts each `generate` call was given."""

    def __init__(self, target):
        super().__init__(target, interrupt_at=-1)
        self.rows: list[int] = []

    def generate(self, **kwargs):
        self.rows.append(len(kwargs["input_ids"]))
        return super().generate(**kwargs)


def test_a_rerun_reuses_only_rows_of_the_same_prompt_and_settings(tmp_path, capsys):
    target, tokenizer = tiny_target(0), word_tokenizer()
    generate_responses(target, tokenizer, PROMPTS[:6], tmp_path, batch_size=4, max_new_tokens=5)
    edited = ["w88 w89 w87", *PROMPTS[:6]]  # one prompt inserted at the top
    counting = CountingTarget(target)
    dataset = generate_responses(counting, tokenizer, edited, tmp_path, batch_size=4, max_new_tokens=5)
    assert counting.rows == [1]  # only the new prompt was generated
    assert "reused 6 of 7 rows; 1 prompt(s) new or with other settings; 0 earlier row(s) dropped" in capsys.readouterr().out
    fresh = generate_responses(target, tokenizer, edited, tmp_path / "fresh", batch_size=4, max_new_tokens=5)
    assert dataset[:] == fresh[:] and dataset["index"] == list(range(7))
    assert sorted(json.loads(line)["index"] for line in (tmp_path / RECORDS).read_text().splitlines()) == list(range(7))

    longer = CountingTarget(target)
    dataset = generate_responses(longer, tokenizer, edited[1:], tmp_path, batch_size=4, max_new_tokens=7)
    assert longer.rows == [4, 2]  # other settings: nothing reused
    assert "reused 0 of 6 rows; 6 prompt(s) new or with other settings; 7 earlier row(s) dropped" in capsys.readouterr().out
    assert dataset[:] == generate_responses(target, tokenizer, edited[1:], tmp_path / "fresh7", max_new_tokens=7)[:]


def test_a_torn_line_in_the_middle_loses_no_record_after_it(tmp_path, capsys):
    target, tokenizer = tiny_target(0), word_tokenizer()
    generate_responses(target, tokenizer, PROMPTS[:6], tmp_path, batch_size=4, max_new_tokens=5)
    lines = (tmp_path / RECORDS).read_text().splitlines(keepends=True)
    torn = "".join([*lines[:2], '{"index": 2, "prompt": [1\n', *lines[2:], '{"index": 7, "pro'])
    (tmp_path / RECORDS).write_text(torn)
    assert read_records(tmp_path / RECORDS) == [json.loads(line) for line in lines]
    assert (tmp_path / RECORDS).read_text() == torn[: torn.rindex("\n") + 1]  # only the torn last line is cut
    assert "skipped 1 unreadable line(s) (line 3); kept the 6 whole record(s)" in capsys.readouterr().err
    counting = CountingTarget(target)
    dataset = generate_responses(counting, tokenizer, PROMPTS[:6], tmp_path, batch_size=4, max_new_tokens=5)
    assert counting.rows == []  # every record after the torn line was reused, none regenerated
    assert dataset[:] == generate_responses(target, tokenizer, PROMPTS[:6], tmp_path / "fresh", max_new_tokens=5)[:]
