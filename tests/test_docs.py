"""The README and docs/: every relative link and anchor resolves, every page is reachable from the README, every
repository path they name exists, the README's example runs, and `.ci/run` finds the commands it runs."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """`text` without fenced blocks and code spans (links there are code, not links)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (letters, digits, `_`, `-` kept), spaces ->
    `-`."""
    text = heading.strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of `page`, with GitHub's `-1`, `-2`, ... for repeated headings."""
    seen: dict[str, int] = {}
    result = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        match = re.match(r"^#{1,6} (.+)$", line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def links(page: Path) -> list[str]:
    return [target for target in LINK.findall(prose(page.read_text()))
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target)]  # http:, https:, mailto: are not checked here


def marked_block(text: str, marker: str) -> str:
    """The body of the one fenced block between `<!-- marker -->` and `<!-- /marker -->`."""
    section = re.findall(rf"<!-- {marker} -->\n(.*?)<!-- /{marker} -->", text, re.S)
    assert len(section) == 1, f"expected one <!-- {marker} --> section"
    blocks = re.findall(r"^```\w*\n(.*?)^```", section[0], re.S | re.M)
    assert len(blocks) == 1, f"expected one fenced block in the <!-- {marker} --> section"
    return blocks[0]


def test_slug_follows_github():
    assert slug("Serving with vLLM") == "serving-with-vllm"
    assert slug("2026-12-01: The quickstart in a fresh clone at 09e7ee2 (latest)") == \
        "2026-12-01-the-quickstart-in-a-fresh-clone-at-09e7ee2-latest"
    assert slug("Evaluating it: `d3d bench-prefill`") == "evaluating-it-d3d-bench-prefill"
    assert slug("The quickstart's benchmark (that fresh run)") == "the-quickstarts-benchmark-that-fresh-run"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_relative_links_and_anchors_resolve(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        destination = (page.parent / path).resolve() if path else page
        if not destination.exists():
            broken.append(f"{target}: no such file")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            broken.append(f"{target}: no heading with that anchor in {destination.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_every_docs_page_is_reachable_from_the_readme():
    reached, queue = {README}, [README]
    while queue:
        page = queue.pop()
        for target in links(page):
            path = target.partition("#")[0]
            destination = (page.parent / path).resolve() if path else page
            if destination.suffix == ".md" and destination.exists() and destination not in reached:
                reached.add(destination)
                queue.append(destination)
    assert set(PAGES) - reached == set()


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_named_repository_files_exist(page):
    """`dir/file.py` in code spans, where `dir` is a folder of this repository, and the bare `*_d3d.py` model files
    must exist: a rename elsewhere shows up here."""
    folders = {path.name for path in ROOT.iterdir() if path.is_dir()}
    missing = []
    for name in re.findall(r"`([\w./-]+\.(?:py|md|toml|cfg|txt))`", page.read_text()):
        if "/" in name and name.split("/")[0] in folders and not (ROOT / name).exists():
            missing.append(name)
        elif "/" not in name and name.endswith("_d3d.py") and not (ROOT / "modeling_d3d" / name).exists():
            missing.append(name)
    assert not missing, f"{page.relative_to(ROOT)} names files that do not exist: {sorted(set(missing))}"


def test_readme_example_runs():
    code = marked_block(README.read_text(), "example")
    assert len(code.splitlines()) <= 15, "the README's example should stay about ten lines"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "torch.Size([2, 58])" in result.stdout  # two prompts of 10 tokens + 48 new tokens each


def run_ci_extraction(start: str, end: str) -> list[str]:
    """Run the README-reading pipeline of `.ci/run` that begins with `start` and ends before `end`, as CI runs it."""
    script = (ROOT / ".ci" / "run").read_text()
    begin = script.index(start)
    pipeline = script[begin : script.index(end, begin)].strip()
    result = subprocess.run(["bash", "-c", pipeline], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    return result.stdout.splitlines()


def test_ci_runs_the_readme_test_command():
    commands = marked_block(README.read_text(), "quickstart").splitlines()
    assert len(commands) == 2 and commands[0].endswith("d3d quickstart") and commands[1].endswith("-m pytest")
    extracted = run_ci_extraction("sed -n '/<!-- quickstart -->", ")\necho")
    assert extracted == [commands[1]]


def test_ci_runs_the_readme_vllm_commands():
    commands = marked_block(README.read_text(), "vllm").splitlines()
    assert len(commands) == 2 and commands[1] == ".venv-vllm/bin/python -m pytest tests_vllm"
    extracted = run_ci_extraction("sed -n '/<!-- vllm -->", " | while read")
    assert extracted == commands


@pytest.mark.parametrize("marker, page", [("quickstart", "quickstart.md"), ("vllm", "serving-vllm.md")])
def test_docs_repeat_the_readme_commands_unchanged(marker, page):
    """The detailed pages show the same commands as the README (which CI runs), so they cannot drift apart."""
    text = (ROOT / "docs" / page).read_text()
    for command in marked_block(README.read_text(), marker).splitlines():
        assert command in text.splitlines(), f"docs/{page} lacks the README's command {command!r}"


def test_results_open_with_a_complete_contents_list():
    """docs/results.md lists every dated section, in order, under its contents (a new section must be added there)."""
    text = FENCE.sub("", (ROOT / "docs" / "results.md").read_text())
    dated = re.findall(r"^## (\d{4}-\d\d-\d\d: .+)$", text, re.M)
    contents = text.split("## Contents", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^- \[(.+)\]\(#([^)]+)\)$", contents, re.M)
    assert [title for title, _ in listed] == dated
    assert all(anchor == slug(title) for title, anchor in listed)
    assert text.index("## Current numbers") < text.index("## Contents") < text.index(f"## {dated[0]}")
