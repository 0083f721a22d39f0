"""The package's shape, read from its imports and setup.cfg: layers import only downwards, one `d3d` namespace and the
Hub-facing `modeling_d3d` are all that is installed, and every package folder is installed."""

import ast
import configparser
from importlib.metadata import distribution
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Bottom to top: a module may import its own layer and those below it, never one above.
LAYERS = ["modeling_d3d", "d3d_vllm", "d3d.common", "d3d.trainer", "d3d.hub_upload", "d3d.space_app", "d3d.benchmark",
          "d3d.quickstart", "d3d.cli", "d3d"]


def package_folders() -> dict[str, Path]:
    """Each installed package's dotted name -> its folder, as setup.cfg's `packages` and `package_dir` say."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    options = config["options"]
    mapped = dict(line.split(" = ") for line in options["package_dir"].strip().splitlines())
    folders = {}
    for name in options["packages"].split():
        root = max((key for key in mapped if name == key or name.startswith(key + ".")), key=len, default=None)
        folder = Path(mapped[root], *name[len(root) + 1:].split(".")) if root else Path(*name.split("."))
        folders[name] = ROOT / folder.as_posix().rstrip("/")
    return folders


def layer_of(module: str) -> str | None:
    """The deepest layer that `module` (dotted) belongs to; None for a module outside the project."""
    return max((layer for layer in LAYERS if module == layer or module.startswith(layer + ".")), key=len, default=None)


def imports_of(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in the file at `path`, whose dotted name is `module`."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.append((node.lineno, base))
    return found


def project_modules() -> list[tuple[Path, str]]:
    """(file, dotted module name) of every module that is installed (and of the vLLM plugin)."""
    modules = []
    folders = {**package_folders(), "d3d_vllm": ROOT / "d3d_vllm"}
    for package, folder in folders.items():
        for path in sorted(folder.glob("*.py")):
            modules.append((path, package if path.stem == "__init__" else f"{package}.{path.stem}"))
    return modules


def test_every_package_folder_is_installed_and_nothing_else_at_the_top():
    folders = package_folders()
    assert all((folder / "__init__.py").is_file() for folder in folders.values()), folders
    on_disk = {path.parent for top in {"d3d", "trainer", "hub_upload", "space_app", "modeling_d3d"}
               for path in (ROOT / top).rglob("__init__.py")}
    assert on_disk == set(folders.values())
    assert {name.split(".")[0] for name in folders} == {"d3d", "modeling_d3d"}
    # What the README's install put into site-packages says the same.
    assert set(distribution("d3d").read_text("top_level.txt").split()) == {"d3d", "modeling_d3d"}


def test_imports_only_run_downwards():
    upward = []
    for path, module in project_modules():
        own = LAYERS.index(layer_of(module))
        for line, imported in imports_of(path, module):
            target = layer_of(imported)
            if target is not None and LAYERS.index(target) > own:
                upward.append(f"{path.relative_to(ROOT)}:{line} imports {imported} ({target} is above {LAYERS[own]})")
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize("folder", ["d3d", "trainer", "hub_upload", "space_app", "modeling_d3d", "tests", "tests_vllm",
                                    "d3d_vllm"])
def test_nothing_imports_the_old_top_level_names(folder):
    """`cli`, `benchmark`, `quickstart`, ... are not installed: an import of one would work only from a checkout."""
    old = {"cli", "benchmark", "quickstart", "trainer", "hub_upload", "space_app"}
    found = [f"{path.relative_to(ROOT)}:{line} {imported}" for path in sorted((ROOT / folder).rglob("*.py"))
             for line, imported in imports_of(path, "x.y") if imported.split(".")[0] in old]
    assert not found, "\n".join(found)


def test_modeling_d3d_stays_self_contained_for_the_hub():
    outside = [f"{path.name}:{line} {imported}" for path, module in project_modules()
               if module.startswith("modeling_d3d")
               for line, imported in imports_of(path, module) if imported.split(".")[0] in {"d3d", "d3d_vllm"}]
    assert not outside, outside
