"""The codebase is layered: imports point down, never up, and never in a circle.

Read from the source (the AST of every module, function-level imports included), so the rule holds
for code paths no other test runs. Layers, bottom to top (docs/architecture.md):

    attention < specdec.models < specdec.weights < specdec.runtime < specdec.engine
      < drafters (beside the engine: of it, only the drafter interface) < specdec.server
      < the library API and its commands (specdec.llm, arguments, generate, serve)
      < eval < drafters.training < specdec.cli (the `specdec` command: every subcommand) < scripts
"""

from __future__ import annotations

import ast
import itertools
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("attention", "specdec", "drafters", "eval", "scripts")

# bottom to top; a module's layer is its longest matching prefix
LAYERS = (
    ("attention",),
    ("specdec.models",),
    ("specdec.weights",),
    ("specdec.runtime",),
    ("specdec.engine",),
    ("drafters",),
    ("specdec.server",),
    ("specdec",),  # the library API (llm.py, the composition root) and the generate / serve commands
    ("eval",),
    ("drafters.training",),
    ("specdec.cli",),
    ("scripts",),
)
# what a layer may not import although it lies below: the engine's internals, for drafters
FORBIDDEN = {
    "drafters": lambda target: target.startswith("specdec.engine.") and target != "specdec.engine.drafter",
    "specdec.server": lambda target: layer_of(target) == "drafters",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


MODULES = project_modules()


def layer_of(module: str) -> str:
    matches = [prefix for (prefix,) in LAYERS if module == prefix or module.startswith(prefix + ".")]
    return max(matches, key=len)


def rank(module: str) -> int:
    return [prefix for (prefix,) in LAYERS].index(layer_of(module))


def resolve(name: str) -> str | None:
    """The project module an imported name refers to (a module, or the module defining the name)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> set[str]:
    """Project modules `module` imports anywhere in its code (`from a.b import c` counts a.b.c when c
    is a module, else a.b)."""
    tree = ast.parse(MODULES[module].read_text(), str(MODULES[module]))
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(target for target in map(resolve, names) if target is not None and target != module)
    return found


GRAPH = {module: imports_of(module) for module in MODULES}


def test_layers_are_known():
    assert {layer_of(m) for m in MODULES} <= {prefix for (prefix,) in LAYERS}
    assert "specdec.engine.engine" in MODULES and "attention.backend" in MODULES  # the walk found the code


def test_no_import_points_up_a_layer():
    upward = []
    for module, targets in GRAPH.items():
        for target in targets:
            forbidden = FORBIDDEN.get(layer_of(module), lambda t: False)
            if rank(target) > rank(module) or forbidden(target):
                upward.append(f"{module} ({layer_of(module)}) imports {target} ({layer_of(target)})")
    assert not upward, "imports that point up a layer:\n" + "\n".join(sorted(upward))


def test_nothing_of_inference_imports_training():
    inference = [m for m in MODULES if rank(m) < rank("eval")]
    assert not [(m, t) for m in inference for t in GRAPH[m] if layer_of(t) == "drafters.training"]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph (a list of modules, first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def packages_above(module: str) -> set[str]:
    parts = module.split(".")
    return {p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in MODULES}


def with_parent_packages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Importing a.b.c runs a/__init__.py and a/b/__init__.py first: those are edges too, except the
    importer's own packages (they ran before it did)."""
    return {module: (targets | {p for t in targets for p in packages_above(t)}) - packages_above(module) - {module}
            for module, targets in graph.items()}


def test_no_import_cycle():
    cycle = find_cycle(with_parent_packages(GRAPH))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_checks_can_fail():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert rank("specdec.server.openai_api") > rank("specdec.engine.engine") > rank("attention.kv_cache")
    assert FORBIDDEN["drafters"]("specdec.engine.request") and not FORBIDDEN["drafters"]("specdec.engine.drafter")


def test_tests_and_scripts_import_no_test_module():
    offenders = []
    for path in [*(ROOT / "tests").rglob("*.py"), *(ROOT / "scripts").rglob("*.py"), *(ROOT / "scripts").rglob("*.sh")]:
        text = path.read_text()
        for line in text.splitlines():
            words = line.replace(",", " ").split()
            if ("import" in words and any(w.startswith("tests.") or w == "tests" for w in words)
                    and any(part.startswith("test_") for w in words for part in w.split("."))):
                offenders.append(f"{path.relative_to(ROOT)}: {line.strip()}")
    assert not offenders, "test modules imported (move shared helpers into a helper module):\n" + "\n".join(offenders)


@pytest.mark.parametrize("order", list(itertools.permutations(["attention", "specdec", "drafters"])))
def test_top_packages_import_in_any_order(order):
    code = "; ".join(f"import {name}" for name in order) + "; from specdec import LLM, SamplingParams"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)
