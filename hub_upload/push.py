"""Publishing a drafter folder to the Hugging Face Hub: weights, remote code, tokenizer and a model card.

The files are staged in a temporary folder (the drafter folder is never modified), checked (`auto_map` points at
remote-code files that are there, weights are there), and committed in one commit, which also deletes what an
earlier push left in the repo and this one does not carry. The token comes from the usual
`huggingface_hub` places (`HF_TOKEN`, `hf auth login`); it is never printed.
"""

import json
import shutil
import tempfile
from pathlib import Path

from huggingface_hub import HfApi, get_token
from huggingface_hub.errors import HfHubHTTPError

from .model_card import build_model_card

WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
# Training leftovers that do not belong in a published model repo.
SKIPPED = ("d3d_training.json", "training_args.bin", "README.md")


class PushError(RuntimeError):
    """Publishing failed; the message says where and what the Hub answered."""


def check_drafter_folder(folder: Path) -> None:
    """Raise `ValueError` unless `folder` holds a loadable `trust_remote_code` drafter."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{folder} has no config.json: not a saved drafter folder")
    auto_map = json.loads(config_path.read_text()).get("auto_map", {})
    for auto_class in ("AutoConfig", "AutoModel"):
        if auto_class not in auto_map:
            raise ValueError(f"{config_path} has no auto_map entry for {auto_class}: it would not load with "
                             "trust_remote_code (save it with D3DForBlockDiffusion.save_pretrained)")
    for reference in auto_map.values():
        module = reference.split("--")[-1].rsplit(".", 1)[0]
        if not (folder / f"{module}.py").is_file():
            raise ValueError(f"auto_map names {reference} but {folder / (module + '.py')} is missing")
    if not any((folder / name).is_file() for name in WEIGHTS):
        raise ValueError(f"{folder} has no weights ({' or '.join(WEIGHTS)})")


def stage_drafter(folder: str | Path, repo_id: str, destination: str | Path, bench: dict | None = None,
                  target: str | None = None) -> Path:
    """Copy what gets published from `folder` to `destination` and write the model card there; returns it."""
    folder, destination = Path(folder), Path(destination)
    check_drafter_folder(folder)
    card = build_model_card(folder, repo_id, bench, target)  # fails before anything is written
    destination.mkdir(parents=True, exist_ok=True)
    for path in sorted(folder.iterdir()):
        if path.is_file() and not path.name.startswith(".") and path.name not in SKIPPED:
            shutil.copy2(path, destination / path.name)
    card.save(destination / "README.md")
    return destination


def push_drafter(folder: str | Path, repo_id: str, bench: dict | None = None, target: str | None = None,
                 private: bool = False, token: str | None = None, endpoint: str | None = None,
                 commit_message: str = "Upload D3D drafter") -> str:
    """Create `repo_id` (if needed) and upload the drafter in `folder` with its card; returns the commit URL."""
    token = token or get_token()
    if token is None:
        raise PushError("No Hugging Face token found: run `hf auth login` or set HF_TOKEN")
    api = HfApi(endpoint=endpoint, token=token)
    with tempfile.TemporaryDirectory(prefix="d3d-push-") as staging:
        stage_drafter(folder, repo_id, staging, bench, target)
        try:
            api.create_repo(repo_id, private=private, exist_ok=True)
            # delete_patterns: files of an earlier push that this one does not carry go (stale weights, shards).
            commit = api.upload_folder(folder_path=staging, repo_id=repo_id, commit_message=commit_message,
                                       delete_patterns="*")
        except HfHubHTTPError as error:
            status = error.response.status_code if error.response is not None else "no response"
            raise PushError(f"Publishing {folder} to {repo_id} failed (HTTP {status}): {error.server_message or error}") from error
    return commit.commit_url


__all__ = ["PushError", "check_drafter_folder", "push_drafter", "stage_drafter"]
