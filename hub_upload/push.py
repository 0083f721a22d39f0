"""Publishing a drafter folder to the Hugging Face Hub: weights, remote code, tokenizer and a model card.

The files are staged in a temporary folder (the drafter folder is never modified), checked (`auto_map` points at
remote-code files that are there, weights are there), and committed in one commit. Each push uploads a manifest,
`d3d_push_manifest.json`, listing the files it wrote; the next push deletes only those of them it does not carry
(stale weights, shards) and keeps every other file of the repo. A non-empty repo without a manifest (no `d3d push`
made it) is refused unless `force=True`, which uploads beside its files and deletes none. The token comes from the
usual `huggingface_hub` places (`HF_TOKEN`, `hf auth login`); it is never printed. Of the folder's subfolders only
`custom_generate/` is published (the Hub front door, `target.generate(ids, custom_generate=REPO, ...)`, which the
drafter's `save_pretrained` writes); training checkpoints and the like stay local.
"""

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi, get_token
from huggingface_hub.errors import HfHubHTTPError

from d3d.common.model_files import check_model_files

from .model_card import build_model_card

WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
MANIFEST = "d3d_push_manifest.json"
# Training leftovers that do not belong in a published model repo (and what staging writes itself).
SKIPPED = ("d3d_training.json", "training_args.bin", "README.md", MANIFEST)
# Files the Hub itself creates in a new repo: they do not make a repo someone else's.
HUB_DEFAULTS = (".gitattributes",)
# The Hub front door that `D3DForBlockDiffusion.save_pretrained` writes: the only subfolder published.
FRONT_DOOR = "custom_generate/generate.py"
PUBLISHED_FOLDERS = ("custom_generate",)


class PushError(RuntimeError):
    """Publishing failed; the message says where and what the Hub answered."""


def check_drafter_folder(folder: Path) -> None:
    """Raise `ValueError` unless `folder` holds a loadable `trust_remote_code` drafter with whole weights
    (`FileNotFoundError` if absent)."""
    if not folder.is_dir():
        raise FileNotFoundError(f"no such folder: {folder}")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{folder} has no config.json: not a saved drafter folder")
    check_model_files(folder)  # config.json is JSON, every *.safetensors whole (a truncated copy is refused)
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
    if not (folder / FRONT_DOOR).is_file():
        raise ValueError(f"{folder} has no {FRONT_DOOR} (the Hub front door, written by this version's "
                         "save_pretrained): re-save it with D3DForBlockDiffusion.from_pretrained(folder).save_pretrained(folder)")


def inside(folder: Path, name: str) -> Path:
    """`folder / name`, refused (`ValueError`) when `name` (read from a manifest) would leave `folder`."""
    path = folder / name
    if not path.resolve().is_relative_to(folder.resolve()):
        raise ValueError(f"{name!r} points outside {folder}: refusing to touch it")
    return path


def published_files(folder: Path) -> list[str]:
    """The names, relative to `folder`, that a push publishes: its own files but training leftovers and hidden ones,
    and the files of `PUBLISHED_FOLDERS`."""
    names = [path.name for path in folder.iterdir()
             if path.is_file() and not path.name.startswith(".") and path.name not in SKIPPED]
    for subfolder in PUBLISHED_FOLDERS:
        names += [path.relative_to(folder).as_posix() for path in (folder / subfolder).rglob("*")
                  if path.is_file() and not any(part.startswith(".") or part == "__pycache__"
                                                for part in path.relative_to(folder).parts)]
    return sorted(names)


def checked_name(name: object, where: str) -> str:
    """`name` if it is a name `d3d push` writes: a plain file name, or a file name inside one of `PUBLISHED_FOLDERS`
    (relative, no `..`, no empty part), so a path built from it stays inside its folder (a local folder or a repo's
    root); else `ValueError` naming `where` it came from."""
    parts = name.split("/") if isinstance(name, str) and "\\" not in name and "\0" not in name else [""]
    if (any(part in ("", ".", "..") for part in parts) or len(parts) > 2
            or (len(parts) == 2 and parts[0] not in PUBLISHED_FOLDERS)):
        raise ValueError(f"{where} lists {name!r}, not a file name that `d3d push` writes: nothing deleted")
    return name


def read_manifest(text: str, where: str) -> set[str]:
    """The files an earlier push (or dry run) wrote, from its manifest's text; every name is checked
    (`checked_name`) before any is used, so a deletion built from it stays inside its folder or repo."""
    try:
        files = json.loads(text)["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(f"{where} is not a {MANIFEST} that `d3d push` wrote: {error}") from error
    if not isinstance(files, list):
        raise ValueError(f"{where} is not a {MANIFEST} that `d3d push` wrote: its files are not a list")
    return {checked_name(name, where) for name in files}


def clear_earlier_dry_run(folder: Path, destination: Path) -> None:
    """Make `destination` ready for staging: absent, empty, or an earlier dry run's output, whose files (only those
    its manifest lists) are removed. Anything else is refused, as is the drafter folder itself; the whole manifest
    is checked (names `d3d push` writes, each a regular file inside `destination` or absent) before anything is
    deleted."""
    if destination.resolve() == folder.resolve():
        raise ValueError(f"the destination {destination} is the drafter folder itself: choose another folder")
    if not destination.exists() or not any(destination.iterdir()):
        return
    manifest = destination / MANIFEST
    if not manifest.is_file():
        raise ValueError(f"{destination} is not empty and no earlier `d3d push --dry-run` wrote it (no {MANIFEST}): "
                         "choose a new or empty folder")
    paths = [inside(destination, name)
             for name in sorted(read_manifest(manifest.read_text(), str(manifest)) | {MANIFEST})]
    for path in paths:
        if path.is_symlink() or (path.exists() and not path.is_file()):
            raise ValueError(f"{manifest} lists {path.relative_to(destination)}, which is not a file a dry run wrote: "
                             "nothing deleted; choose a new or empty folder")
    for path in paths:
        path.unlink(missing_ok=True)


def stage_drafter(folder: str | Path, repo_id: str, destination: str | Path, bench: dict | None = None,
                  target: str | None = None) -> Path:
    """Copy what gets published from `folder` to `destination` with the model card and the manifest; returns it.

    `destination` must be new, empty, or an earlier staging's output (only the files that one wrote are replaced)."""
    folder, destination = Path(folder), Path(destination)
    check_drafter_folder(folder)
    card = build_model_card(folder, repo_id, bench, target)  # fails before anything is written
    clear_earlier_dry_run(folder, destination)
    destination.mkdir(parents=True, exist_ok=True)
    written = published_files(folder)
    for name in written:
        (destination / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(folder / name, destination / name)
    card.save(destination / "README.md")
    manifest = {"written_by": "d3d push", "repo_id": repo_id, "files": sorted([*written, "README.md"])}
    (destination / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return destination


def files_to_delete(api: HfApi, repo_id: str, staged: set[str], force: bool, say: Callable[[str], None]) -> list[str]:
    """What an earlier push wrote to `repo_id` and this one (`staged`) does not carry; refuses a foreign repo
    unless `force` (then nothing is deleted, and the files this push replaces are named)."""
    existing = set(api.list_repo_files(repo_id)) - set(HUB_DEFAULTS)
    if MANIFEST in existing:
        with tempfile.TemporaryDirectory(prefix="d3d-manifest-") as cache:
            path = api.hf_hub_download(repo_id, MANIFEST, cache_dir=cache)
            earlier = read_manifest(Path(path).read_text(), f"{MANIFEST} of {repo_id}")
        return sorted((earlier & existing) - staged)
    if existing and not force:
        raise PushError(f"{repo_id} already holds {len(existing)} file(s) and no `d3d push` made it (no {MANIFEST}): "
                        "refusing to publish into it; --force uploads beside its files and deletes none")
    if existing & staged:
        say(f"replacing in {repo_id} (--force): {', '.join(sorted(existing & staged))}")
    return []


def push_drafter(folder: str | Path, repo_id: str, bench: dict | None = None, target: str | None = None,
                 private: bool = False, token: str | None = None, endpoint: str | None = None,
                 commit_message: str = "Upload D3D drafter", force: bool = False,
                 say: Callable[[str], None] = print) -> str:
    """Create `repo_id` (if needed) and upload the drafter in `folder` with its card; returns the commit URL.

    Deletes only files an earlier push wrote that this one does not carry, and `say`s which, before committing."""
    check_drafter_folder(Path(folder))
    token = token or get_token()
    if token is None:
        raise PushError("No Hugging Face token found: run `hf auth login` or set HF_TOKEN")
    api = HfApi(endpoint=endpoint, token=token)
    with tempfile.TemporaryDirectory(prefix="d3d-push-") as staging:
        stage_drafter(folder, repo_id, staging, bench, target)
        staged = sorted(path.relative_to(staging).as_posix() for path in Path(staging).rglob("*") if path.is_file())
        try:
            api.create_repo(repo_id, private=private, exist_ok=True)
            stale = files_to_delete(api, repo_id, set(staged), force, say)
            say(f"deleting from {repo_id} (written by an earlier d3d push, not carried now): {', '.join(stale)}"
                if stale else f"deleting nothing from {repo_id}")
            operations = [CommitOperationAdd(name, str(Path(staging) / name)) for name in staged]
            operations += [CommitOperationDelete(name) for name in stale]
            commit = api.create_commit(repo_id, operations, commit_message=commit_message)
        except HfHubHTTPError as error:
            status = error.response.status_code if error.response is not None else "no response"
            raise PushError(f"Publishing {folder} to {repo_id} failed (HTTP {status}): {error.server_message or error}") from error
    return commit.commit_url


__all__ = ["MANIFEST", "PushError", "check_drafter_folder", "push_drafter", "stage_drafter"]
