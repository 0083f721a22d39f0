"""`d3d push DRAFTER_DIR REPO_ID`: publish a drafter with its remote code and model card to the Hub."""

import argparse
import json
from pathlib import Path

from d3d.hub_upload.push import PushError, check_drafter_folder, push_drafter, stage_drafter

from .errors import UserError
from .inputs import repo_id


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("drafter", help="a drafter folder (as `d3d train`, `d3d prune` or `d3d quickstart` write it)")
    parser.add_argument("repo_id", type=repo_id, help="the Hub repository, e.g. my-org/d3d-qwen3-8b")
    parser.add_argument("--bench", default=None,
                        help="bench.json for the card's eval results (default: DRAFTER/../bench.json if present)")
    parser.add_argument("--target", default=None, help="the target's Hub id for the card (default: as trained)")
    parser.add_argument("--private", action="store_true")
    parser.add_argument("--endpoint", default=None, help="a Hub endpoint other than the default")
    parser.add_argument("--force", action="store_true",
                        help="publish into a non-empty repo that no `d3d push` made (its files are kept, none deleted)")
    parser.add_argument("--dry-run", nargs="?", const="", default=None, metavar="FOLDER",
                        help="write what would be uploaded to FOLDER (default: ./<repo name>-upload), which must be new, "
                             "empty or an earlier dry run's output (only the files that one wrote are replaced); no network")


def run(args: argparse.Namespace) -> int:
    drafter = Path(args.drafter)
    check_drafter_folder(drafter)
    bench_path = Path(args.bench) if args.bench else drafter.resolve().parent / "bench.json"
    if args.bench and not bench_path.is_file():
        raise FileNotFoundError(f"no such file: {bench_path} (--bench)")
    bench = json.loads(bench_path.read_text()) if bench_path.is_file() else None
    if args.dry_run is not None:
        destination = Path(args.dry_run or f"{args.repo_id.split('/')[-1]}-upload")
        stage_drafter(drafter, args.repo_id, destination, bench, args.target)
        print(f"wrote {destination} (what `d3d push` would upload to {args.repo_id}; card: {destination / 'README.md'})")
        return 0
    try:
        url = push_drafter(drafter, args.repo_id, bench, args.target, private=args.private,
                           endpoint=args.endpoint, force=args.force)
    except PushError as error:
        raise UserError(str(error)) from error
    print(f"published {drafter} to {args.repo_id}: {url}")
    return 0
