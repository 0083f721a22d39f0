"""The training commands end to end on a tiny target: generate-data, a 2-process `accelerate launch` of train, prune."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from conftest import run_leaving_no_process, tiny_target, word_tokenizer
from d3d.cli.main import main
from modeling_d3d import D3DForBlockDiffusion

ROOT = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("commands")
    tiny_target(0, layers=2).save_pretrained(tmp / "target")
    word_tokenizer().save_pretrained(tmp / "target")
    (tmp / "prompts.txt").write_text("\n".join(" ".join(f"w{(i * 5 + j) % 90}" for j in range(2 + i % 4)) for i in range(24)))
    assert main(["generate-data", "--target", str(tmp / "target"), "--prompts", str(tmp / "prompts.txt"),
                 "--output", str(tmp / "data"), "--max-new-tokens", "16", "--batch-size", "8"]) == 0
    return tmp


def test_generate_data_writes_every_prompt_once(workspace):
    records = [json.loads(line) for line in (workspace / "data" / "responses.jsonl").read_text().splitlines()]
    assert sorted(r["index"] for r in records) == list(range(24))


def test_train_runs_distributed_with_two_processes(workspace):
    """`--multi_gpu` makes accelerate start torchrun; on a CPU-only machine the processes use gloo. The launch ends
    (its shutdown cannot deadlock: `d3d.cli.train.leave_process_group`) or is killed with its workers."""
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--num_machines", "1",
        "--main_process_port", "0", "--mixed_precision", "no", "--dynamo_backend", "no", "--multi_gpu",
        "-m", "d3d", "train",
        "--target", str(workspace / "target"), "--data", str(workspace / "data"), "--output", str(workspace / "drafter"),
        "--block-size", "4", "--max-steps", "6", "--num-anchors", "4", "--learning-rate", "1e-3",
        "--global-batch-size", "8", "--per-device-batch-size", "2", "--gradient-checkpointing",
        "--attn-implementation", "sdpa",
    ]
    result = run_leaving_no_process(command, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    log = result.stdout + result.stderr
    assert "trained 6 steps on 2 process(es), global batch 8" in log
    drafter = D3DForBlockDiffusion.from_pretrained(workspace / "drafter")
    assert drafter.config.block_size == 4 and (workspace / "drafter" / "tokenizer.json").exists()


def test_a_launch_past_its_timeout_is_killed_with_every_process_it_started(tmp_path):
    """As a hung `accelerate launch` would be: the launcher's worker runs in a session of its own."""
    pids = tmp_path / "pids"
    launcher = ("import os, subprocess, sys, time\n"
                "worker = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)\n"
                f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{worker.pid}}')\n"
                "time.sleep(600)\n")
    with pytest.raises(pytest.fail.Exception, match="killed with the 1 process"):
        run_leaving_no_process([sys.executable, "-c", launcher], timeout=10)
    assert not [pid for pid in map(int, pids.read_text().split()) if psutil.pid_exists(pid)
                and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]


def test_prune_writes_the_chosen_drafter_and_report(workspace):
    D3DForBlockDiffusion.from_backbone(str(workspace / "target"), block_size=4).save_pretrained(workspace / "init")
    assert main(["prune", "--target", str(workspace / "target"), "--drafter", str(workspace / "init"),
                 "--data", str(workspace / "data"), "--output", str(workspace / "pruned"), "--dev-size", "3",
                 "--recovery-steps", "4", "--min-layers", "1", "--max-new-tokens", "12", "--min-tau-fraction", "0",
                 "--per-device-batch-size", "4", "--global-batch-size", "4", "--num-anchors", "4"]) == 0
    report = json.loads((workspace / "pruned" / "pruning.json").read_text())
    assert [stage["depth"] for stage in report["stages"]] == [2, 1]
    assert D3DForBlockDiffusion.from_pretrained(workspace / "pruned" / "drafter").config.num_hidden_layers == report["chosen"]


# `d3d train` in a fresh process that SIGKILLs itself as step 5 ends, after checkpoint-4 was saved.
KILLED_AT_STEP_5 = """
import os, signal, sys
from transformers import TrainerCallback
from d3d.trainer.d3d_trainer import D3DTrainer

class KillAtStep5(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 5:
            os.kill(os.getpid(), signal.SIGKILL)

init = D3DTrainer.__init__
def init_then_arm(self, *args, **kwargs):
    init(self, *args, **kwargs)
    self.add_callback(KillAtStep5())
D3DTrainer.__init__ = init_then_arm
from d3d.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_train_resumes_a_killed_run_to_the_uninterrupted_weights(workspace, tmp_path, capsys):
    """Checkpoints every 2 steps; a run SIGKILLed at step 5 and continued with --resume (from checkpoint-4, mid-epoch:
    24 examples in batches of 2 are 6 steps an epoch) ends, 8 steps and one epoch boundary later, with the weights of
    a run never interrupted: same data order, same anchors, same optimizer and scheduler state."""
    def train(output: Path, *extra: str) -> list[str]:
        return ["train", "--target", str(workspace / "target"), "--data", str(workspace / "data"), "--output",
                str(output), "--block-size", "4", "--max-steps", "8", "--save-steps", "2", "--num-anchors", "4",
                "--learning-rate", "1e-3", "--global-batch-size", "4", "--per-device-batch-size", "2", *extra]

    assert main(train(tmp_path / "whole")) == 0
    killed = subprocess.run([sys.executable, "-c", KILLED_AT_STEP_5, *train(tmp_path / "resumed")], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-4000:]
    assert sorted(path.name for path in (tmp_path / "resumed").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    capsys.readouterr()
    assert main(train(tmp_path / "resumed")) == 2  # a fresh run would rotate out the killed run's checkpoints
    assert "holds checkpoint-4 of an earlier run: pass --resume" in capsys.readouterr().err
    assert main(train(tmp_path / "empty", "--resume")) == 2
    assert "--resume: " in capsys.readouterr().err

    assert main(train(tmp_path / "resumed", "--resume")) == 0
    assert "trained 8 steps" in capsys.readouterr().out
    whole, resumed = (load_file(tmp_path / name / "model.safetensors") for name in ("whole", "resumed"))
    assert whole.keys() == resumed.keys()
    for name in whole:
        torch.testing.assert_close(resumed[name], whole[name], msg=name)
