"""A saved drafter loads with `trust_remote_code` alone, in a fresh process where this project cannot be imported."""

from pathlib import Path

import torch

from conftest import run_without_project, tiny_drafter

FRESH_PROCESS = """
    import torch
    from transformers import AutoConfig, AutoModel

    folder = sys.argv[1]
    assert AutoConfig.from_pretrained(folder, trust_remote_code=True).model_type == "d3d"
    model = AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
    reference = torch.load(f"{folder}/reference.pt")
    ids = reference["ids"]
    torch.testing.assert_close(model(ids).logits, reference["causal"], atol=1e-6, rtol=0)
    torch.testing.assert_close(model.draft_block(ids).logits, reference["draft"], atol=1e-6, rtol=0)

    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(Qwen3Config(vocab_size=model.config.vocab_size, hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                          head_dim=8)).eval()
    plain = target.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=model), plain)
    with model.async_generator() as generator:
        assert torch.equal(target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=generator), plain)
    selective = model.selective_prefill_generate(target, ids, selective_prefill=0.5, chunk_size=3, max_new_tokens=12)
    assert selective.selection.kept == model.select_prompt_chunks(ids, 0.5, 3).kept
    assert torch.equal(selective.sequences, target.generate(selective.prompt_ids, max_new_tokens=12, do_sample=False))
    batch = torch.cat([ids, ids.flip(1)])
    assert torch.equal(model.generate_batch(target, batch, max_new_tokens=12, do_sample=False),
                       torch.cat([target.generate(row[None], max_new_tokens=12, do_sample=False) for row in batch]))
    assert model.round_record.new_tokens == 24
    with model.batch_server(target, max_batch_size=2) as server:
        assert server.submit(ids, max_new_tokens=12).result(timeout=60) == plain[0, ids.shape[1]:].tolist()
    print("loaded", type(model).__module__)
"""


def test_save_pretrained_writes_remote_code_that_loads_in_a_fresh_process(tmp_path: Path):
    drafter = tiny_drafter(seed=4, block_size=5)
    drafter.save_pretrained(tmp_path)
    config = (tmp_path / "config.json").read_text()
    assert '"AutoModel": "modeling_d3d.D3DForBlockDiffusion"' in config
    assert '"AutoConfig": "configuration_d3d.D3DConfig"' in config
    shipped = {path.name for path in (Path(__file__).parents[1] / "modeling_d3d").glob("*_d3d.py")}
    assert {"engine_d3d.py", "sources_d3d.py", "generation_d3d.py", "serving_d3d.py"} <= shipped
    for name in shipped:  # every module of the package travels (modeling_d3d.py imports them all, recursively)
        assert (tmp_path / name).is_file(), name
    ids = torch.randint(0, 90, (1, 11))
    with torch.no_grad():
        reference = {"ids": ids, "causal": drafter(ids).logits, "draft": drafter.draft_block(ids).logits}
    torch.save(reference, tmp_path / "reference.pt")

    result = run_without_project(FRESH_PROCESS, str(tmp_path), cwd=tmp_path.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "loaded transformers_modules." in result.stdout


def test_code_files_import_only_torch_transformers_and_each_other():
    folder = Path(__file__).parents[1] / "modeling_d3d"
    allowed = {"torch", "transformers", "dataclasses", "collections", "typing", "threading",
               "time", "math", "queue", "concurrent", "contextlib", "copy", "__future__", "inspect", "pathlib",
               "types", "ctypes", "os"}
    for path in folder.glob("*.py"):
        for line in path.read_text().splitlines():
            words = line.split()
            if len(words) >= 2 and words[0] in ("import", "from") and not line.startswith(" "):
                module = words[1]
                assert module.startswith(".") or module.split(".")[0] in allowed, f"{path.name}: {line}"


def test_the_decoding_modules_import_each_other_without_a_cycle():
    """`modeling_d3d/`'s relative imports form a graph without cycles, and the network (the model) imports no
    decoding module: arrows point down."""
    import re
    from pathlib import Path

    folder = Path(__file__).parent.parent / "modeling_d3d"
    graph = {path.stem: set(re.findall(r"^from \.(\w+) import", path.read_text(), re.M)) for path in folder.glob("*.py")}
    assert graph["network_d3d"] <= {"configuration_d3d", "masking_d3d"}

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, " -> ".join(path + (module,))
        for imported in graph.get(module, ()):
            visit(imported, path + (module,))

    for module in graph:
        visit(module, ())
