"""Static check: vLLM's GPU wheel defines every name the plugin hooks, with the signatures it expects.

`python tests_vllm/hooked_names.py WHEEL` reads the plugin's sources (`d3d_vllm/*.py`) and the wheel's Python
sources (from the zip, nothing installed or imported) and prints each problem, exiting 1 if any. Derived from the
plugin's own code, so a misspelt or vanished name fails:

- every `from vllm... import NAME` is defined (or re-exported) by that module;
- a method of a plugin class marked `@override` exists in a vLLM base class with the same parameters, and one not
  marked does not (an accidental override);
- every `self.NAME` a plugin class reads and does not set itself is set or defined by a vLLM base class;
- `NAME.attr` on a name imported from vLLM, and `param.attr` on a parameter annotated with a vLLM class, exist there
  (class members, dataclass fields, properties, or module attributes);
- keyword arguments of calls to vLLM classes are fields of them, and `_override_property(Cls, "name", ...)`
  names a property of `Cls`;
- plus the attributes reached through instances (`EXTRA`), which the code alone does not type.
"""

import ast
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

PLUGIN = Path(__file__).resolve().parent.parent / "d3d_vllm"

# (module, class, member) the plugin reaches through instances whose type its code does not name.
EXTRA = [
    ("vllm.config.attention", "AttentionConfig", "use_non_causal"),
    ("vllm.config.vllm", "VllmConfig", "attention_config"),
    ("vllm.config.vllm", "VllmConfig", "speculative_config"),
    ("vllm.config.speculative", "SpeculativeConfig", "draft_model_config"),
    ("vllm.config.speculative", "SpeculativeConfig", "method"),
    ("vllm.config.model", "ModelConfig", "hf_config"),
    ("vllm.v1.worker.utils", "AttentionGroup", "backend"),
    ("vllm.v1.attention.backend", "AttentionBackend", "get_name"),
    ("vllm.v1.attention.backend", "AttentionBackend", "supports_non_causal"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "drafter"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "device"),
]


@dataclass
class ClassInfo:
    """What a class (with its bases, as far as they are vLLM's) defines."""

    methods: dict[str, ast.FunctionDef] = field(default_factory=dict)
    properties: set[str] = field(default_factory=set)
    fields: set[str] = field(default_factory=set)  # class-level (annotated) names
    self_attributes: set[str] = field(default_factory=set)  # `self.X = ...` in any method

    def members(self) -> set[str]:
        return set(self.methods) | self.properties | self.fields | self.self_attributes


class Wheel:
    """The Python sources of a vLLM wheel, parsed on demand."""

    def __init__(self, path: Path):
        self.zip = zipfile.ZipFile(path)
        self.names = set(self.zip.namelist())
        self.trees: dict[str, ast.Module | None] = {}

    def module(self, name: str) -> ast.Module | None:
        if name not in self.trees:
            base = name.replace(".", "/")
            source = next((f for f in (f"{base}.py", f"{base}/__init__.py") if f in self.names), None)
            self.trees[name] = None if source is None else ast.parse(self.zip.read(source))
        return self.trees[name]

    def module_names(self, name: str) -> set[str]:
        """Names a module defines or imports at any nesting (TYPE_CHECKING blocks included), and its submodules."""
        tree = self.module(name)
        names = set()
        for node in ast.walk(tree) if tree else []:
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.ImportFrom | ast.Import):
                names |= {alias.asname or alias.name.split(".")[0] for alias in node.names}
        prefix = name.replace(".", "/") + "/"
        names |= {f[len(prefix):].split("/")[0].removesuffix(".py") for f in self.names if f.startswith(prefix)}
        return names

    def imports_of(self, module: str) -> dict[str, str]:
        """`local name -> defining module` for a module's `from X import Y`."""
        tree = self.module(module)
        result = {}
        for node in ast.walk(tree) if tree else []:
            if isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    result[alias.asname or alias.name] = node.module
        return result

    def find_class(self, module: str, name: str, depth: int = 0) -> tuple[str, ast.ClassDef] | None:
        """The class `name` as seen from `module` (following re-exports)."""
        tree = self.module(module)
        if tree is None or depth > 5:
            return None
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == name:
                return module, node
        source = self.imports_of(module).get(name)
        return None if source is None else self.find_class(source, name, depth + 1)

    def class_info(self, module: str, name: str) -> ClassInfo | None:
        found = self.find_class(module, name)
        if found is None:
            return None
        module, node = found
        info = ClassInfo()
        for base in node.bases:
            if isinstance(base, ast.Name) and (base_info := self.class_info(module, base.id)) is not None:
                info.methods |= base_info.methods
                info.properties |= base_info.properties
                info.fields |= base_info.fields
                info.self_attributes |= base_info.self_attributes
        for item in node.body:
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                info.methods[item.name] = item
                if any(_decorator_name(d) in ("property", "cached_property") for d in item.decorator_list):
                    info.properties.add(item.name)
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                info.fields.add(item.target.id)
            elif isinstance(item, ast.Assign):
                info.fields |= {t.id for t in item.targets if isinstance(t, ast.Name)}
        info.self_attributes |= _self_stores(node)
        return info


def _decorator_name(node: ast.expr) -> str:
    node = node.func if isinstance(node, ast.Call) else node
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def _self_stores(node: ast.AST) -> set[str]:
    return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
            and isinstance(n.value, ast.Name) and n.value.id == "self"}


def _parameters(function: ast.FunctionDef) -> list[str]:
    arguments = function.args
    return [a.arg for a in arguments.posonlyargs + arguments.args + arguments.kwonlyargs]


def check_module(wheel: Wheel, path: Path) -> list[str]:
    """Problems with the vLLM names one plugin module uses."""
    tree = ast.parse(path.read_text())
    where = path.name
    problems = []
    imported: dict[str, str] = {}  # local name -> vLLM module it comes from
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
            if wheel.module(node.module) is None:
                problems.append(f"{where}: module {node.module} is absent")
                continue
            defined = wheel.module_names(node.module)
            for alias in node.names:
                if alias.name not in defined:
                    problems.append(f"{where}: {node.module} does not define {alias.name}")
                imported[alias.asname or alias.name] = node.module

    def info_of(name: str) -> ClassInfo | None:
        return wheel.class_info(imported[name], name) if name in imported else None

    def member_problem(owner: str, attr: str) -> str | None:
        if (info := info_of(owner)) is not None:
            return None if attr in info.members() else f"{where}: {owner} has no {attr}"
        module = f"{imported[owner]}.{owner}"
        if wheel.module(module) is not None:  # `from vllm import envs`: a module
            return None if attr in wheel.module_names(module) else f"{where}: {module} has no {attr}"
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in imported:
            if (problem := member_problem(node.value.id, node.attr)) is not None:
                problems.append(problem)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in imported and (info := info_of(node.func.id)) is not None:
                accepted = info.fields | (set(_parameters(info.methods["__init__"])) if "__init__" in info.methods
                                          else set())
                problems += [f"{where}: {node.func.id} takes no {k.arg}" for k in node.keywords
                             if k.arg and k.arg not in accepted]
            if node.func.id == "_override_property" and len(node.args) >= 2:
                owner, name = node.args[0], node.args[1]
                info = info_of(owner.id) if isinstance(owner, ast.Name) else None
                if not isinstance(name, ast.Constant) or info is None or name.value not in info.properties:
                    problems.append(f"{where}: {ast.unparse(owner)}.{ast.unparse(name)} is not a vLLM property")
        if isinstance(node, ast.FunctionDef):
            for argument in node.args.args + node.args.kwonlyargs:
                annotation = argument.annotation
                if isinstance(annotation, ast.Name) and info_of(annotation.id) is not None:
                    members = info_of(annotation.id).members()
                    problems += [f"{where}: {annotation.id} has no {n.attr}" for n in ast.walk(node)
                                 if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                                 and n.value.id == argument.arg and n.attr not in members]
        if isinstance(node, ast.ClassDef):
            bases = [info_of(b.id) for b in node.bases if isinstance(b, ast.Name)]
            if not bases or None in bases:
                continue
            inherited = ClassInfo()
            for base in bases:
                inherited.methods |= base.methods
                inherited.properties |= base.properties
                inherited.fields |= base.fields
                inherited.self_attributes |= base.self_attributes
            own = _self_stores(node) | {item.name for item in node.body if isinstance(item, ast.FunctionDef)}
            for item in node.body:
                if not isinstance(item, ast.FunctionDef) or item.name == "__init__":
                    continue
                marked = any(_decorator_name(d) == "override" for d in item.decorator_list)
                base_method = inherited.methods.get(item.name)
                if marked and base_method is None:
                    problems.append(f"{where}: {node.name}.{item.name} overrides nothing in vLLM")
                elif marked and _parameters(base_method) != _parameters(item):
                    problems.append(f"{where}: {node.name}.{item.name}{tuple(_parameters(item))} differs from "
                                    f"vLLM's {tuple(_parameters(base_method))}")
                elif not marked and base_method is not None:
                    problems.append(f"{where}: {node.name}.{item.name} overrides vLLM's without @override")
            reads = {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load)
                     and isinstance(n.value, ast.Name) and n.value.id == "self"}
            problems += [f"{where}: {node.name} reads self.{name}, which vLLM's bases do not define"
                         for name in sorted(reads - own - inherited.members())]
    return problems


def check(wheel_path: Path, plugin: Path = PLUGIN) -> list[str]:
    """Every problem found in the plugin's sources (`plugin/*.py`) against the wheel's."""
    wheel = Wheel(wheel_path)
    problems = []
    for path in sorted(plugin.glob("*.py")):
        problems += check_module(wheel, path)
    for module, name, member in EXTRA:
        info = wheel.class_info(module, name)
        if info is None or member not in info.members():
            problems.append(f"{module}.{name} has no {member}")
    return problems


if __name__ == "__main__":
    found = check(Path(sys.argv[1]))
    print("\n".join(found) or "every hooked name is defined")
    sys.exit(1 if found else 0)
