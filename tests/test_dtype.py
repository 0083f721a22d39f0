"""The dtype helper: bfloat16 only where the hardware runs it natively and fast (simulated here), `--dtype` overrides,
and the stages take their dtype from it."""

import json

import pytest
import torch

from conftest import tiny_target, word_tokenizer
from d3d.benchmark import forward_cost
from d3d.cli.main import build_parser, main
from d3d.common import dtype
from d3d.hub_upload.model_card import build_model_card
from d3d.trainer.provenance import DrafterProvenance

NATIVE = frozenset({"fpu", "avx2", "avx512f", "avx512_bf16", "amx_bf16"})
AVX2_ONLY = frozenset({"fpu", "sse4_2", "avx2", "fma"})


@pytest.fixture
def cpu(monkeypatch):
    """Simulate a CPU: `cpu(flags, bf16_seconds, float32_seconds)`; the measurement cache is cleared around it."""

    def simulate(flags: frozenset[str], bf16_seconds: float = 1.0, float32_seconds: float = 1.0) -> None:
        times = {torch.bfloat16: bf16_seconds, torch.float32: float32_seconds}
        monkeypatch.setattr(dtype, "cpu_flags", lambda: flags)
        monkeypatch.setattr(dtype, "matmul_seconds", lambda kind: times[kind])
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        dtype.cpu_bf16_is_fast.cache_clear()

    yield simulate
    dtype.cpu_bf16_is_fast.cache_clear()


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    (tmp_path / "x86").write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\nflags\t\t: fpu avx2\n")
    (tmp_path / "arm").write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert dtype.cpu_flags(tmp_path / "x86") == {"fpu", "avx2", "avx512_bf16"}
    assert dtype.cpu_flags(tmp_path / "arm") == {"fp", "asimd", "bf16"}
    assert dtype.cpu_flags(tmp_path / "missing") == frozenset()


def test_a_cpu_without_native_bf16_gets_float32_even_if_bf16_timed_fast(cpu):
    cpu(AVX2_ONLY, bf16_seconds=0.1, float32_seconds=1.0)
    choice = dtype.choose_dtype()
    assert choice.dtype == torch.float32 and not choice.bf16
    assert str(choice) == "dtype: float32 (cpu without native bf16)"


def test_native_bf16_flags_need_the_timed_matmul_to_agree(cpu):
    cpu(NATIVE, bf16_seconds=49.0, float32_seconds=1.0)
    assert dtype.choose_dtype().dtype == torch.float32
    assert "slower than float32" in dtype.choose_dtype().reason
    cpu(NATIVE, bf16_seconds=1.05, float32_seconds=1.0)  # within the margin
    choice = dtype.choose_dtype()
    assert choice.dtype == torch.bfloat16 and choice.bf16
    assert choice.description == "bfloat16 (cpu with native bf16, confirmed by a timed matmul)"


def test_the_matmul_is_timed_once_a_process(cpu, monkeypatch):
    cpu(NATIVE)
    calls = []
    monkeypatch.setattr(dtype, "matmul_seconds", lambda kind: calls.append(kind) or 1.0)
    dtype.choose_dtype(), dtype.choose_dtype()
    assert calls == [torch.bfloat16, torch.float32] * 5


def test_a_burst_of_load_during_the_timing_does_not_decide_the_dtype(cpu, monkeypatch):
    """Native bf16 as fast as float32, but the machine is busy during the first timed matmul (3x slower): the
    alternating best-of rounds still see bf16 as fast (timing bf16 once, then float32 once, chose float32)."""
    cpu(NATIVE)
    calls = []

    def busy_at_first(kind: torch.dtype) -> float:
        calls.append(kind)
        return 3.0 if len(calls) == 1 else 1.0

    monkeypatch.setattr(dtype, "matmul_seconds", busy_at_first)
    assert dtype.choose_dtype().dtype == torch.bfloat16


def test_cuda_follows_its_native_bf16_support(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    assert dtype.choose_dtype(device="cuda:0") == dtype.DtypeChoice(torch.bfloat16, "cuda with native bf16")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)
    assert dtype.choose_dtype(device="cuda") == dtype.DtypeChoice(torch.float32, "cuda without native bf16")


def test_an_explicit_dtype_overrides_the_hardware(cpu):
    cpu(AVX2_ONLY)
    assert dtype.choose_dtype("bfloat16") == dtype.DtypeChoice(torch.bfloat16, "--dtype")
    cpu(NATIVE)
    assert dtype.choose_dtype("float32").dtype == torch.float32


def test_the_real_matmul_timing_runs():
    assert 0 < dtype.matmul_seconds(torch.float32, repeats=1) < 10


@pytest.mark.parametrize("command", ["quickstart", "train", "prune", "generate-data", "bench", "bench-prefill", "space"])
def test_every_model_loading_command_takes_dtype(command):
    required = {"quickstart": [], "train": ["--target", "org/t", "--data", "d", "--output", "o"],
                "prune": ["--target", "org/t", "--drafter", "org/d", "--data", "d", "--output", "o"],
                "generate-data": ["--target", "org/t", "--prompts", "p", "--output", "o"],
                "bench": ["--target", "org/t", "--drafter", "org/d"],
                "bench-prefill": ["--target", "org/t", "--drafter", "org/d"],
                "space": []}[command]
    parser = build_parser([command])
    assert parser.parse_args([command, *required]).dtype == "auto"
    assert parser.parse_args([command, *required, "--dtype", "bfloat16"]).dtype == "bfloat16"
    with pytest.raises(SystemExit):
        parser.parse_args([command, *required, "--dtype", "float16"])


def test_generate_data_and_train_run_in_the_chosen_dtype_and_record_it(cpu, tmp_path, capsys):
    """A simulated CPU with fast native bf16: the target loads in bf16, training autocasts, provenance and card say so."""
    cpu(NATIVE, bf16_seconds=0.5, float32_seconds=1.0)
    tiny_target(0, layers=1).save_pretrained(tmp_path / "target")
    word_tokenizer().save_pretrained(tmp_path / "target")
    (tmp_path / "prompts.txt").write_text("\n".join(f"w{i} w{i + 1} w{i + 2}" for i in range(8)))
    assert main(["generate-data", "--target", str(tmp_path / "target"), "--prompts", str(tmp_path / "prompts.txt"),
                 "--output", str(tmp_path / "data"), "--max-new-tokens", "6"]) == 0
    assert main(["train", "--target", str(tmp_path / "target"), "--data", str(tmp_path / "data"),
                 "--output", str(tmp_path / "drafter"), "--block-size", "4", "--max-steps", "2", "--num-anchors", "2",
                 "--global-batch-size", "2", "--per-device-batch-size", "2"]) == 0
    expected = "bfloat16 (cpu with native bf16, confirmed by a timed matmul)"
    assert capsys.readouterr().out.count(f"dtype: {expected}") == 2
    provenance = DrafterProvenance.load(tmp_path / "drafter")
    assert provenance.dtype == expected
    assert json.loads((tmp_path / "drafter" / "config.json").read_text())["dtype"] == "bfloat16"
    assert f"- training dtype: {expected}" in str(build_model_card(tmp_path / "drafter", "me/drafter"))


def test_forward_cost_runs_and_records_the_dtype(tmp_path):
    forward_cost.main(["--preset", "tiny", "--device", "cpu", "--prefix-length", "8", "--block-size", "4",
                       "--budgets", "2x1", "--repeats", "1", "--dtype", "float32", "--output", str(tmp_path / "cost.json")])
    assert json.loads((tmp_path / "cost.json").read_text())["dtype"] == "float32 (--dtype)"


@pytest.mark.parametrize("flags", [AVX2_ONLY, NATIVE])
def test_quickstart_pretraining_autocasts_exactly_when_the_helper_picks_bf16(cpu, flags, tmp_path, monkeypatch):
    from d3d.quickstart import pipeline
    from d3d.quickstart.pretrain import chunked_dataset, train_tokenizer

    cpu(flags, bf16_seconds=0.5, float32_seconds=1.0)
    built = []
    real_pretrain = pipeline.pretrain
    monkeypatch.setattr(pipeline, "pretrain", lambda config, data, args: built.append(args) or real_pretrain(config, data, args))
    texts = ["def f(x):\n    return x + 1\n" * 20] * 4
    tokenizer = train_tokenizer(texts, 300)
    size = pipeline.ModelSize(16, 1, 2, 1, 32, steps=1, batch_size=2, learning_rate=1e-3)
    pipeline._causal_lm(tmp_path / "lm", size, tokenizer, 300, chunked_dataset(tokenizer, texts, 16), dtype.choose_dtype())
    assert [args.bf16 for args in built] == [flags == NATIVE] and (tmp_path / "lm" / "config.json").exists()
