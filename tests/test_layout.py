"""The house rules of ../shared/DESIGN.md ("Layout"), checked on the tree: the policy core and
the baselines import neither jax nor the web stack, the scheduler has no mixins, no package has
an import cycle, and no source file is over 400 lines."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("pallas_kernels", "mesh", "vertumnus_jax", "serving", "eval")
FORBIDDEN_IN_CORE = ("jax", "jaxlib", "flax", "orbax", "fastapi", "uvicorn", "prometheus_client",
                     "httpx", "vertumnus_jax", "mesh", "pallas_kernels", "eval")


def _imported(path: pathlib.Path) -> set[str]:
    """Dotted names of every module `path` imports (function-level imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def _sources() -> list[pathlib.Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def test_policy_core_and_baselines_import_no_jax_or_web_stack():
    bad = {}
    for folder in ("serving/policy", "serving/baselines"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            hits = sorted(n for n in _imported(path) if n.split(".")[0] in FORBIDDEN_IN_CORE)
            if hits:
                bad[path.relative_to(ROOT).as_posix()] = hits
    assert not bad, f"policy-core files importing jax, the web stack or the live side: {bad}"


def test_simulator_imports_no_jax():
    bad = {p.relative_to(ROOT).as_posix(): sorted(n for n in _imported(p)
                                                  if n.split(".")[0] in ("jax", "vertumnus_jax", "mesh"))
           for p in sorted((ROOT / "eval" / "sim").rglob("*.py"))}
    assert not {k: v for k, v in bad.items() if v}


def test_no_mixin_classes_in_serving():
    mixins = [f"{p.relative_to(ROOT)}:{m}" for p in sorted((ROOT / "serving").rglob("*.py"))
              for m in re.findall(r"^class (\w*Mixin)\b", p.read_text(), re.M)]
    assert not mixins, f"mixins in serving/ (make them collaborators): {mixins}"


def test_no_source_file_over_400_lines():
    long = {p.relative_to(ROOT).as_posix(): n for p in _sources()
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"source files over 400 lines (split them): {long}"


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _module_level(tree: ast.Module):
    """Statements run at import time or read by type checkers: the module body and the bodies
    of its `if` / `try` blocks (`if TYPE_CHECKING:` included), not functions or classes."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, (ast.If, ast.Try)):
            todo += node.body + node.orelse + getattr(node, "finalbody", [])
            todo += [s for h in getattr(node, "handlers", []) for s in h.body]


def test_no_import_cycles_inside_a_package():
    """Module-level imports between the modules of one folder form no cycle, `if TYPE_CHECKING:`
    imports included (a package's `__init__` re-exporting its modules is not part of the
    graph)."""
    modules = {_module_name(p): p for p in _sources() if p.name != "__init__.py"}
    graph = {}
    for name, path in modules.items():
        package = name.rsplit(".", 1)[0]
        deps = set()
        for node in _module_level(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            deps |= {t for t in targets if t in modules and t.rsplit(".", 1)[0] == package}
        graph[name] = deps
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, f"import cycles inside a package: {cycles}"
