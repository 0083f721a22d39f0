"""`d3d push`: a drafter folder, its remote code and its model card reach a (local, mock) Hub intact."""

import json
from pathlib import Path

import pytest
from huggingface_hub import ModelCard, constants

from conftest import run_without_project, tiny_drafter, word_tokenizer
from d3d.cli.main import main
from d3d.hub_upload.push import MANIFEST, PushError, push_drafter
from d3d.trainer.provenance import DrafterProvenance, record_pruning
from mock_hub import MockHub

TOKEN = "hf_secret_test_token_0123456789"


def bench_results(tau: float, speedup: float, hit_rate: float) -> dict:
    """What `d3d.benchmark.bench.benchmark` returns, for one prompt set with a sync and an async D3D row."""
    def row(method: str, hits: float | None) -> dict:
        return {"method": method, "tokens_per_second": 100.0 * speedup, "speedup": speedup, "tau": tau,
                "hit_rate": hits, "lossless": True, "ideal_sync_speedup": None, "ideal_async_speedup": None,
                "ms_per_round": 1.0, "new_tokens": 64, "seconds": 1.0}

    passes = {"t_target_1": 0.001, "t_target_b": 0.002, "t_target_tree": 0.003, "t_drafter_b": 0.001,
              "measure_seconds": 0.1}
    return {"hardware": "test CPU, 2 threads", "max_new_tokens": 32, "block_size": 5, "passes": {"eager": passes},
            "sweep": [], "best_budget": {"coverage": 2, "fanout": 1},
            "prompt_sets": {"humaneval": {"prompts": 4, "methods": [
                row("target alone", None), row("D3D sync", None), row("D3D async C=2 F=1", hit_rate)]}}}


@pytest.fixture(autouse=True)
def hub_reachable(monkeypatch):
    """These tests talk to a mock Hub on 127.0.0.1: they set the Hub online themselves, whatever the environment
    says (an air-gapped machine's HF_HUB_OFFLINE=1 is read once, at import, into `constants`)."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


@pytest.fixture
def drafter_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "drafter"
    tiny_drafter(seed=4, block_size=5).save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    DrafterProvenance(target="org/target-lm", base_model="org/target-lm", training_data="64 regenerated responses",
                      recipe={"steps": 10}, layers_before_pruning=3, pruning_stages=1).save(folder)
    return folder


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (`custom_generate/generate.py` included), by its path relative to it."""
    return {path.relative_to(folder).as_posix(): path.read_bytes() for path in folder.rglob("*") if path.is_file()}


def published_names(folder: Path) -> set[str]:
    """The files a push of the drafter in `folder` writes: its own but the training record, the card, the manifest."""
    return (set(snapshot(folder)) - {"d3d_training.json"}) | {"README.md", MANIFEST}


FOREIGN = {"LICENSE": b"MIT", "eval/results.json": b"{}", "model-q4.gguf": b"GGUF", "demo.ipynb": b"{}"}


def test_push_uploads_the_folder_and_a_card_that_round_trips(drafter_folder, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    before = snapshot(drafter_folder)
    bench = bench_results(tau=3.25, speedup=1.75, hit_rate=0.4)
    with MockHub() as hub:
        assert main(["push", str(drafter_folder), "me/d3d-tiny", "--endpoint", hub.endpoint,
                     "--bench", str(_write(tmp_path / "bench.json", bench))]) == 0
    assert snapshot(drafter_folder) == before  # the source folder is never modified
    assert list(hub.state.repos) == ["me/d3d-tiny"]
    assert [path for _, path in hub.state.requests] == [
        "/api/repos/create", "/api/models/me/d3d-tiny/tree/main", "/api/validate-yaml",
        "/api/models/me/d3d-tiny/preupload/main", "/api/models/me/d3d-tiny/commit/main",
    ]
    uploaded = hub.state.files["me/d3d-tiny"]
    assert set(uploaded) == published_names(drafter_folder)
    assert json.loads(uploaded[MANIFEST])["files"] == sorted(published_names(drafter_folder) - {MANIFEST})
    assert all(uploaded[name] == before[name] for name in before if name != "d3d_training.json")
    assert hub.state.authorizations == {f"Bearer {TOKEN}"}
    assert TOKEN not in capsys.readouterr().out

    published = tmp_path / "published"
    published.mkdir()
    for name, content in uploaded.items():
        (published / name).parent.mkdir(exist_ok=True)
        (published / name).write_bytes(content)
    card = ModelCard.load(published / "README.md")
    assert card.data.base_model == "org/target-lm"
    values = {(r.dataset_name, r.metric_type, r.metric_name.split(",")[1].split("(")[0].strip()): r.metric_value
              for r in card.data.eval_results}
    assert values[("humaneval", "tau", "D3D sync")] == 3.25
    assert values[("humaneval", "speedup", "D3D async C=2 F=1")] == 1.75
    assert values[("humaneval", "hit_rate", "D3D async C=2 F=1")] == 0.4
    assert ("humaneval", "hit_rate", "D3D sync") not in values
    assert all("test CPU, 2 threads" in r.metric_name for r in card.data.eval_results)
    assert "3 -> 2 layers" in card.text and 'from_pretrained("me/d3d-tiny", trust_remote_code=True)' in card.text
    assert "custom_generate" in card.data.tags and 'custom_generate="me/d3d-tiny", trust_remote_code=True' in card.text
    assert card.text.index('custom_generate="me/d3d-tiny"') < card.text.index("AutoModel.from_pretrained")  # first
    assert uploaded["custom_generate/generate.py"] == before["custom_generate/generate.py"]

    loaded = run_without_project(
        """
        from transformers import AutoModel
        model = AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True)
        print(type(model).__name__, model.config.block_size)
        """,
        str(published), cwd=tmp_path,
    )
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.split() == ["D3DForBlockDiffusion", "5"]


def test_a_second_push_removes_only_its_own_stale_files(drafter_folder, tmp_path, capsys):
    with MockHub() as hub:
        push_drafter(drafter_folder, "me/d3d-tiny", token=TOKEN, endpoint=hub.endpoint)
        assert "deleting nothing" in capsys.readouterr().out
        hub.state.files["me/d3d-tiny"].update(FOREIGN)  # added on the Hub by hand, after the push
        single = (drafter_folder / "model.safetensors").read_bytes()
        (drafter_folder / "model.safetensors").unlink()  # the drafter is re-saved sharded
        for shard in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
            (drafter_folder / shard).write_bytes(single)
        (drafter_folder / "model.safetensors.index.json").write_text('{"weight_map": {}}')
        push_drafter(drafter_folder, "me/d3d-tiny", token=TOKEN, endpoint=hub.endpoint)
    assert set(hub.state.files["me/d3d-tiny"]) == published_names(drafter_folder) | set(FOREIGN)
    assert "model.safetensors" not in hub.state.files["me/d3d-tiny"]
    assert "deleting from me/d3d-tiny (written by an earlier d3d push, not carried now): model.safetensors" in capsys.readouterr().out


def test_a_repo_that_no_push_made_is_refused_without_force(drafter_folder, tmp_path, capsys):
    with MockHub() as hub:
        hub.state.repos["me/d3d-tiny"] = {}
        hub.state.files["me/d3d-tiny"] = {**FOREIGN, ".gitattributes": b"*.gguf filter=lfs", "README.md": b"mine"}
        with pytest.raises(PushError, match=f"no `d3d push` made it \\(no {MANIFEST}\\).*--force"):
            push_drafter(drafter_folder, "me/d3d-tiny", token=TOKEN, endpoint=hub.endpoint)
        assert set(hub.state.files["me/d3d-tiny"]) == set(FOREIGN) | {".gitattributes", "README.md"}
        push_drafter(drafter_folder, "me/d3d-tiny", token=TOKEN, endpoint=hub.endpoint, force=True)
        assert set(hub.state.files["me/d3d-tiny"]) == published_names(drafter_folder) | set(FOREIGN) | {".gitattributes"}
        assert "replacing in me/d3d-tiny (--force): README.md" in capsys.readouterr().out
        (drafter_folder / "tokenizer.json").unlink()
        push_drafter(drafter_folder, "me/d3d-tiny", token=TOKEN, endpoint=hub.endpoint)  # now a push made it
    assert set(hub.state.files["me/d3d-tiny"]) == published_names(drafter_folder) | set(FOREIGN) | {".gitattributes"}


def test_a_new_repo_holding_only_the_hubs_gitattributes_needs_no_force(drafter_folder):
    with MockHub() as hub:
        hub.state.repos["me/d3d-tiny"] = {}
        hub.state.files["me/d3d-tiny"] = {".gitattributes": b"*.safetensors filter=lfs"}
        push_drafter(drafter_folder, "me/d3d-tiny", token=TOKEN, endpoint=hub.endpoint)
    assert set(hub.state.files["me/d3d-tiny"]) == published_names(drafter_folder) | {".gitattributes"}


def test_a_refused_commit_is_a_clear_error_and_leaves_nothing_behind(drafter_folder, tmp_path, monkeypatch):
    staging_root = tmp_path / "tmp"
    staging_root.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(staging_root))
    before = snapshot(drafter_folder)
    with MockHub() as hub:
        hub.state.refuse_commits = True
        with pytest.raises(PushError, match=r"me/d3d-tiny failed \(HTTP 403\).*rights"):
            push_drafter(drafter_folder, "me/d3d-tiny", token=TOKEN, endpoint=hub.endpoint)
    assert hub.state.files["me/d3d-tiny"] == {}
    assert list(staging_root.iterdir()) == []
    assert snapshot(drafter_folder) == before


def test_dry_run_writes_the_folder_and_card_without_network(drafter_folder, tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # any Hub request would raise
    output = tmp_path / "upload"
    assert main(["push", str(drafter_folder), "me/d3d-tiny", "--dry-run", str(output)]) == 0
    assert set(snapshot(output)) == published_names(drafter_folder)
    card = ModelCard.load(output / "README.md")
    assert card.data.eval_results is None and "org/target-lm" in card.text


def test_a_bench_json_written_before_trees_still_makes_the_card(drafter_folder, tmp_path):
    """A bench.json from before the tree pass was timed has no `t_target_tree`: its card is made without that term
    (it was refused as "not a bench.json that `d3d bench` wrote")."""
    bench = bench_results(tau=3.25, speedup=1.75, hit_rate=0.4)
    del bench["passes"]["eager"]["t_target_tree"]
    output = tmp_path / "upload"
    assert main(["push", str(drafter_folder), "me/d3d-tiny", "--dry-run", str(output),
                 "--bench", str(_write(tmp_path / "bench.json", bench))]) == 0
    lines = (output / "README.md").read_text().splitlines()
    assert "- eager: t_T(1) = 1.00 ms, t_T(B=5) = 2.00 ms, t_D(B) = 1.00 ms (measured in 0.1 s)" in lines


def test_a_second_dry_run_replaces_only_what_the_first_wrote(drafter_folder, tmp_path):
    output = tmp_path / "upload"
    assert main(["push", str(drafter_folder), "me/d3d-tiny", "--dry-run", str(output)]) == 0
    (output / "notes.txt").write_text("mine")
    (drafter_folder / "tokenizer.json").unlink()
    assert main(["push", str(drafter_folder), "me/d3d-tiny", "--dry-run", str(output)]) == 0
    assert set(snapshot(output)) == published_names(drafter_folder) | {"notes.txt"}


def test_a_dry_run_into_a_foreign_folder_or_the_drafter_is_refused(drafter_folder, tmp_path, capsys):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "config.json").write_text("{}")
    before = snapshot(drafter_folder)
    assert main(["push", str(drafter_folder), "me/d3d-tiny", "--dry-run", str(foreign)]) == 2
    assert "no earlier `d3d push --dry-run` wrote it" in capsys.readouterr().err
    assert snapshot(foreign) == {"config.json": b"{}"}
    assert main(["push", str(drafter_folder), "me/d3d-tiny", "--dry-run", str(drafter_folder)]) == 2
    assert "is the drafter folder itself" in capsys.readouterr().err
    assert snapshot(drafter_folder) == before


def tree(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (relative path -> content)."""
    return {str(path.relative_to(folder)): path.read_bytes() for path in folder.rglob("*") if path.is_file()}


@pytest.mark.parametrize("entry", ["../outside.txt", "ABSOLUTE", "sub", "sub/kept.txt", "..", 3])
def test_a_dry_run_manifest_naming_anything_but_its_own_files_deletes_nothing(drafter_folder, tmp_path, capsys, entry):
    """Every name is checked before anything is deleted: a name outside the folder, a subfolder or a path into one
    refuses the whole manifest, and the earlier output stays whole."""
    output = tmp_path / "work" / "upload"
    assert main(["push", str(drafter_folder), "me/d3d-tiny", "--dry-run", str(output)]) == 0
    (tmp_path / "work" / "outside.txt").write_text("not yours")
    (output / "sub").mkdir()
    (output / "sub" / "kept.txt").write_text("not yours either")
    manifest = json.loads((output / MANIFEST).read_text())
    entry = str(tmp_path / "work" / "outside.txt") if entry == "ABSOLUTE" else entry
    manifest["files"] = ["config.json", entry, "tokenizer.json"]  # a good name before the bad one too
    (output / MANIFEST).write_text(json.dumps(manifest))
    before = tree(tmp_path / "work")
    assert main(["push", str(drafter_folder), "me/d3d-tiny", "--dry-run", str(output)]) == 2
    error = capsys.readouterr().err
    assert len(error.strip().splitlines()) == 1 and MANIFEST in error and "nothing deleted" in error
    assert tree(tmp_path / "work") == before


def test_a_hub_manifest_naming_anything_but_pushed_files_deletes_nothing(drafter_folder):
    """The manifest read from the repo gets the same check: no deletion is built from a name d3d push never writes."""
    with MockHub() as hub:
        push_drafter(drafter_folder, "me/d3d-tiny", token=TOKEN, endpoint=hub.endpoint)
        files = hub.state.files["me/d3d-tiny"]
        files.update(FOREIGN)
        files[MANIFEST] = json.dumps({"files": ["config.json", "eval/results.json"]}).encode()
        before = dict(files)
        with pytest.raises(ValueError, match="eval/results.json"):
            push_drafter(drafter_folder, "me/d3d-tiny", token=TOKEN, endpoint=hub.endpoint)
    assert hub.state.files["me/d3d-tiny"] == before


def test_a_folder_that_would_not_load_is_refused(drafter_folder, tmp_path):
    (drafter_folder / "modeling_d3d.py").unlink()
    with pytest.raises(ValueError, match="modeling_d3d.py is missing"):
        push_drafter(drafter_folder, "me/d3d-tiny", token=TOKEN, endpoint="http://127.0.0.1:9")


def test_a_folder_without_the_hub_front_door_is_refused(drafter_folder):
    (drafter_folder / "custom_generate" / "generate.py").unlink()
    with pytest.raises(ValueError, match="no custom_generate/generate.py .*re-save it"):
        push_drafter(drafter_folder, "me/d3d-tiny", token=TOKEN, endpoint="http://127.0.0.1:9")


def test_only_custom_generate_of_the_subfolders_is_published(drafter_folder, tmp_path):
    (drafter_folder / "checkpoint-10").mkdir()
    (drafter_folder / "checkpoint-10" / "optimizer.pt").write_bytes(b"state")
    (drafter_folder / "custom_generate" / "__pycache__").mkdir()
    (drafter_folder / "custom_generate" / "__pycache__" / "generate.cpython-311.pyc").write_bytes(b"pyc")
    assert main(["push", str(drafter_folder), "me/d3d-tiny", "--dry-run", str(tmp_path / "out")]) == 0
    published = set(snapshot(tmp_path / "out"))
    assert {"custom_generate/generate.py", "custom_generate/requirements.txt"} <= published
    assert not any(name.startswith("checkpoint-10") or "__pycache__" in name for name in published)


def test_no_token_is_a_clear_error(drafter_folder, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-home"))
    with pytest.raises(PushError, match="No Hugging Face token"):
        push_drafter(drafter_folder, "me/d3d-tiny", endpoint="http://127.0.0.1:9")


def test_a_drafter_without_a_recorded_target_needs_one(drafter_folder, tmp_path):
    (drafter_folder / "d3d_training.json").unlink()
    with pytest.raises(ValueError, match="does not record its target"):
        main(["--debug", "push", str(drafter_folder), "me/d3d-tiny", "--dry-run", str(tmp_path / "out")])
    assert main(["push", str(drafter_folder), "me/d3d-tiny", "--dry-run", str(tmp_path / "out"),
                 "--target", "org/other-lm"]) == 0
    assert 'AutoModelForCausalLM.from_pretrained("org/other-lm")' in (tmp_path / "out" / "README.md").read_text()


def test_a_card_that_cannot_be_built_writes_nothing(drafter_folder, tmp_path, capsys):
    output = tmp_path / "upload"
    assert main(["push", str(drafter_folder), "me/d3d-tiny", "--dry-run", str(output),
                 "--bench", str(_write(tmp_path / "bench.json", {"hardware": "x"}))]) == 2
    error = capsys.readouterr().err
    assert len(error.strip().splitlines()) == 1 and "not a bench.json that `d3d bench` wrote" in error
    assert not output.exists()


def test_a_pruned_drafter_without_provenance_does_not_invent_a_target(drafter_folder, tmp_path, capsys):
    (drafter_folder / "d3d_training.json").unlink()
    pruned = tmp_path / "pruned"
    tiny_drafter(seed=4, block_size=5, layers=1).save_pretrained(pruned)
    record_pruning(drafter_folder, pruned)
    assert main(["push", str(pruned), "me/d3d-tiny", "--dry-run", str(tmp_path / "out")]) == 2
    assert "does not record its target" in capsys.readouterr().err
    assert main(["push", str(pruned), "me/d3d-tiny", "--dry-run", str(tmp_path / "out"), "--target", "org/lm"]) == 0
    card = ModelCard.load(tmp_path / "out" / "README.md")
    assert "2 -> 1 layers" in card.text and "not recorded" in card.text and card.data.base_model is None


def _write(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data))
    return path


def test_a_truncated_weights_file_is_refused_before_anything_is_written_or_uploaded(drafter_folder, tmp_path, capsys):
    weights = drafter_folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    output = tmp_path / "upload"
    assert main(["push", str(drafter_folder), "me/d3d-tiny", "--dry-run", str(output)]) == 2
    error = capsys.readouterr().err
    assert error.splitlines() == [error.strip()] and f"{weights} is not a whole safetensors file" in error
    assert not output.exists()
    with MockHub() as hub:
        with pytest.raises(ValueError, match="is not a whole safetensors file"):
            push_drafter(drafter_folder, "me/d3d-tiny", token=TOKEN, endpoint=hub.endpoint)
    assert hub.state.requests == []
