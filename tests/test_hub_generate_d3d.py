"""The Hub front door: `target.generate(ids, custom_generate=<drafter folder or repo>, trust_remote_code=True, ...)`
runs the D3D engine in a fresh process where this project cannot be imported, and is the target's own `generate`:
token-identical in float32 with stop strings, a streamer, EOS in a ragged batch; the target's distribution when
sampling; the drafter loaded from the same folder or repo."""

import configparser
import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from conftest import run_without_project, tiny_drafter, tiny_target, word_tokenizer
from d3d.hub_upload.push import push_drafter
from distribution import NEW_TOKENS, PROMPT, SAMPLES, SETTINGS, VOCAB, chi_square_p_value, exact_distribution
from mock_hub import MockHub
from modeling_d3d.hub_generate_d3d import REQUIREMENTS
from modeling_d3d.versions_d3d import TORCH_RANGE, TRANSFORMERS_RANGE, requirement

GREEDY = """
    import torch
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer
    from transformers.generation.streamers import BaseStreamer

    torch.set_num_threads(1)
    drafter_folder, target_folder = sys.argv[1], sys.argv[2]
    target = AutoModelForCausalLM.from_pretrained(target_folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_folder)
    state = {name: tensor.clone() for name, tensor in target.state_dict().items()}
    hub = dict(custom_generate=drafter_folder, trust_remote_code=True)

    class Recording(BaseStreamer):
        def __init__(self):
            self.tokens, self.ended = [], False
        def put(self, value):
            self.tokens += value.reshape(-1).tolist()
        def end(self):
            self.ended = True

    # stop strings and a streamer, batch of one: a stop word the target reaches after a few tokens
    prompt = torch.tensor([[5, 17, 3, 42, 8, 61, 29]])
    plain = target.generate(prompt, max_new_tokens=24, do_sample=False)[0, prompt.shape[1]:].tolist()
    word = tokenizer.convert_ids_to_tokens(plain[6])
    assert word.startswith("w") and plain.index(plain[6]) == 6, plain
    settings = dict(max_new_tokens=24, do_sample=False, stop_strings=[word], tokenizer=tokenizer)
    alone, hub_streamer = Recording(), Recording()
    reference = target.generate(prompt, streamer=alone, **settings)
    out = target.generate(prompt, streamer=hub_streamer, **hub, **settings)
    assert torch.equal(out, reference) and out.shape[1] == prompt.shape[1] + 7, (out, reference)
    assert hub_streamer.tokens == alone.tokens == reference[0].tolist() and hub_streamer.ended and alone.ended

    # the drafter came from the same folder, in the target's dtype, kept beside (not inside) the target
    drafter = target.d3d_drafter
    assert type(drafter).__module__.startswith("transformers_modules.") and drafter.dtype == target.dtype
    assert drafter.round_record.new_tokens == 7 and drafter.round_record.rounds >= 1
    assert "generate" not in drafter.__dict__  # the folder's custom_generate is not bound as the drafter's own
    assert set(target.state_dict()) == set(state) and not any("d3d" in name for name, _ in target.named_modules())

    # EOS in a ragged, left-padded batch: each row is the target decoding it alone
    prompts = [torch.tensor([4, 9, 33]), torch.tensor([70, 2, 18, 25, 6, 11, 40, 3]), torch.tensor([12, 7, 88, 54, 1])]
    alone = [target.generate(p[None], max_new_tokens=16, do_sample=False)[0, len(p):].tolist() for p in prompts]
    eos = alone[0][3]
    assert 0 < sum(eos in row for row in alone) < len(alone), alone  # some rows stop early, some do not
    width = max(len(p) for p in prompts)
    ids = torch.stack([torch.cat([torch.full((width - len(p),), eos), p]) for p in prompts])
    mask = torch.stack([torch.cat([torch.zeros(width - len(p), dtype=torch.long), torch.ones_like(p)]) for p in prompts])
    settings = dict(max_new_tokens=16, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    out = target.generate(ids, attention_mask=mask, **hub, **settings)
    for row, p in enumerate(prompts):
        reference = target.generate(p[None], **settings)[0, len(p):].tolist()
        tail = out[row, width:].tolist()
        assert tail[:len(reference)] == reference and set(tail[len(reference):]) <= {eos}, (row, tail, reference)
    assert target.d3d_drafter is drafter  # reused: same folder, dtype and device

    # the engine's settings pass through; a drafter given explicitly is used as it is
    out = target.generate(prompt, asynchronous=True, coverage=2, fanout=1, **hub, **settings)
    assert torch.equal(out, target.generate(prompt, **settings))
    out = target.generate(ids, attention_mask=mask, lookup=True, policy=True, **hub, **settings)  # the chooser
    for row, p in enumerate(prompts):
        reference = target.generate(p[None], **settings)[0, len(p):].tolist()
        assert out[row, width:width + len(reference)].tolist() == reference, row
    assert sum(target.d3d_drafter.round_record.verified.values()) > 0
    mine = AutoModel.from_pretrained(drafter_folder, trust_remote_code=True).eval()
    out = target.generate(ids, attention_mask=mask, drafter=mine, **hub, **settings)
    assert mine.round_record.new_tokens > 0 and target.d3d_drafter is drafter
    assert torch.equal(target.state_dict()["lm_head.weight"], state["lm_head.weight"])
    mine.save_pretrained("resaved")  # saved again from its remote code: the front door travels with it
    front_door = "/custom_generate/generate.py"
    assert open("resaved" + front_door).read() == open(drafter_folder + front_door).read()

    # the target in bfloat16: the drafter is loaded again, in bfloat16
    target.to(torch.bfloat16)
    target.generate(prompt, max_new_tokens=4, do_sample=False, **hub)
    assert target.d3d_drafter is not drafter and target.d3d_drafter.dtype == torch.bfloat16
    print("hub front door ok")
"""

SAMPLING = """
    import json
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    drafter_folder, target_folder, prompt, samples, new_tokens, settings = sys.argv[1:7]
    target = AutoModelForCausalLM.from_pretrained(target_folder).eval()
    torch.manual_seed(0)
    ids = torch.tensor([json.loads(prompt)]).repeat(int(samples), 1)
    out = target.generate(ids, max_new_tokens=int(new_tokens), do_sample=True, custom_generate=drafter_folder,
                          trust_remote_code=True, **json.loads(settings))
    record = target.d3d_drafter.round_record
    print(json.dumps({"tails": out[:, ids.shape[1]:].tolist(), "accepted": dict(record.accepted)}))
"""


def saved_pair(folder: Path, vocab_size: int, words: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """A tiny drafter saved by this project and a tiny float32 target (with a tokenizer) saved beside it."""
    drafter_folder, target_folder = folder / "drafter", folder / "target"
    tiny_drafter(seed=1, block_size=4, vocab_size=vocab_size).save_pretrained(drafter_folder)
    target = tiny_target(0 if vocab_size != VOCAB else 11, vocab_size=vocab_size)
    target.save_pretrained(target_folder)
    if words:
        word_tokenizer(vocab_size - 2, words=words).save_pretrained(target_folder)
    return drafter_folder, target_folder


def test_save_pretrained_writes_the_hub_front_door(tmp_path: Path):
    drafter_folder, _ = saved_pair(tmp_path, 96)
    written = (drafter_folder / "custom_generate" / "generate.py").read_text()
    source = Path(__file__).parents[1] / "modeling_d3d" / "hub_generate_d3d.py"
    assert written == source.read_text() and "from ." not in written  # loads alone: no module beside it needed
    requirements = (drafter_folder / "custom_generate" / "requirements.txt").read_text().split()
    assert requirements == list(REQUIREMENTS)
    config = configparser.ConfigParser()
    config.read(Path(__file__).parents[1] / "setup.cfg")
    pins = config["options"]["install_requires"].split()
    ranges = [requirement("torch", TORCH_RANGE), requirement("transformers", TRANSFORMERS_RANGE)]
    assert requirements == ranges and all(pin in pins for pin in ranges), (requirements, ranges, pins)


def test_the_hub_call_is_the_target_own_generate_with_stops_a_streamer_and_eos(tmp_path: Path):
    drafter_folder, target_folder = saved_pair(tmp_path, 96, words=("abcdef",))
    result = run_without_project(GREEDY, str(drafter_folder), str(target_folder), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "hub front door ok" in result.stdout


# the drafter's block every round (its drafts surely verified), and the verify policy with lookup (the default's
# policy, whose choices follow measured pass times: it may verify none)
@pytest.mark.parametrize("chooser", [{"policy": False}, {"lookup": True, "policy": True}])
def test_hub_call_sampling_follows_the_target_distribution(tmp_path: Path, chooser: dict):
    drafter_folder, target_folder = saved_pair(tmp_path, VOCAB)
    result = run_without_project(SAMPLING, str(drafter_folder), str(target_folder), json.dumps(PROMPT[0].tolist()),
                                 str(SAMPLES), str(NEW_TOKENS), json.dumps({**SETTINGS, **chooser}), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    counts = Counter(tuple(tail) for tail in report["tails"])
    accepted = {int(n): count for n, count in report["accepted"].items()}
    assert sum(counts.values()) == SAMPLES
    if chooser["policy"] is False:  # drafts rejected and accepted
        assert 1 in accepted and max(accepted) >= 2, accepted
    target = tiny_target(11, vocab_size=VOCAB)
    assert chi_square_p_value(counts, exact_distribution(target), SAMPLES) > 1e-3


def test_a_pushed_repo_runs_the_hub_call_by_its_id(tmp_path: Path):
    drafter_folder, target_folder = saved_pair(tmp_path, 96, words=("abcdef",))
    code = """
        import torch
        from transformers import AutoModelForCausalLM

        target = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
        ids = torch.tensor([[5, 17, 3, 42], [8, 61, 29, 1]])
        out = target.generate(ids, custom_generate="me/d3d-tiny", trust_remote_code=True, max_new_tokens=10)
        assert torch.equal(out, torch.cat([target.generate(row[None], max_new_tokens=10) for row in ids]))
        print(type(target.d3d_drafter).__module__)
    """
    with MockHub() as hub:
        push_drafter(drafter_folder, "me/d3d-tiny", target="org/target-lm", token="hf_test", endpoint=hub.endpoint)
        uploaded = hub.state.files["me/d3d-tiny"]
        assert uploaded["custom_generate/generate.py"] == (drafter_folder / "custom_generate/generate.py").read_bytes()
        result = run_without_project(code, str(target_folder), cwd=tmp_path, env={"HF_ENDPOINT": hub.endpoint, "HF_HUB_OFFLINE": "0"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("transformers_modules.me.d3d_hyphen_tiny.")


def test_the_hub_call_refuses_a_drafter_that_is_not_d3d(tmp_path: Path):
    """Every transformers model has a `generate_batch` (continuous batching): a target passed as `drafter=` is refused
    in one clear error, not sent into it."""
    drafter_folder, _ = saved_pair(tmp_path, 96)
    target = tiny_target(0, vocab_size=96)
    with pytest.raises(ValueError, match="drafter= must be a D3D drafter .*got Qwen3ForCausalLM"):
        target.generate(torch.tensor([[5, 17, 3]]), custom_generate=str(drafter_folder), trust_remote_code=True,
                        drafter=tiny_target(1, vocab_size=96), max_new_tokens=4)
