"""The house rules of ../shared/DESIGN.md ("Layout"), checked on the tree: the policy core and
the baselines import neither jax nor the web stack, the scheduler has no mixins, no package has
an import cycle, and no source file is over 400 lines."""

from __future__ import annotations

import ast
import importlib.util
import json
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("pallas_kernels", "mesh", "vertumnus_jax", "serving", "eval")
FORBIDDEN_IN_CORE = ("jax", "jaxlib", "flax", "orbax", "fastapi", "uvicorn", "prometheus_client",
                     "httpx", "vertumnus_jax", "mesh", "pallas_kernels", "eval")
LIVE_SERVICE = tuple(f"serving.{m}" for m in ("api", "api_models", "engine", "live_backend", "main",
                                              "prom", "server", "tokenizer"))
FORBIDDEN_LOADED = ("jax", "jaxlib", "flax", "orbax", "fastapi", "uvicorn", "prometheus_client",
                    "httpx", "vertumnus_jax", "mesh", "pallas_kernels") + LIVE_SERVICE


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
            hits = sorted(n for n in _imported(path) if n.split(".")[0] in FORBIDDEN_IN_CORE
                          or n.startswith(LIVE_SERVICE))
            if hits:
                bad[path.relative_to(ROOT).as_posix()] = hits
    assert not bad, f"policy-core files importing jax, the web stack or the live side: {bad}"


@pytest.mark.parametrize("room, forbidden", [
    ("serving/policy", FORBIDDEN_LOADED), ("serving/baselines", FORBIDDEN_LOADED),
    ("eval/sim", FORBIDDEN_LOADED + ("grain", "eval.traces.loaders")),
])
def test_importing_a_room_loads_nothing_forbidden(room, forbidden):
    """What importing every module of the room really loads, transitively (a fresh process)."""
    mods = [_module_name(p) for p in sorted((ROOT / room).rglob("*.py"))]
    code = ("import importlib, json, sys\n"
            f"for m in {mods!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted(sys.modules)))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout.splitlines()[-1])
    bad = sorted(m for m in loaded if any(m == f or m.startswith(f + ".") for f in forbidden))
    assert not bad, f"importing {room} loads {bad}"


def test_nothing_outside_eval_imports_eval():
    """Arrows point down (DESIGN.md): the evaluation uses the packages, never the reverse."""
    bad = {p.relative_to(ROOT).as_posix(): sorted(n for n in _imported(p) if n.split(".")[0] == "eval")
           for pkg in PACKAGES if pkg != "eval" for p in sorted((ROOT / pkg).rglob("*.py"))}
    assert not {k: v for k, v in bad.items() if v}


def test_imports_are_absolute():
    """Relative imports hide dependencies from the BUILD generator and the checks here."""
    bad = [p.relative_to(ROOT).as_posix() for p in _sources()
           if any(isinstance(n, ast.ImportFrom) and n.level > 0
                  for n in ast.walk(ast.parse(p.read_text())))]
    assert not bad, f"relative imports in {bad}"


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


def test_no_import_cycles():
    """The dependency graph the BUILD files are generated from (`third_party/bazel/gen_build.py`:
    every first-party import, function-level ones included, as Bazel needs them) has no cycle,
    so no package has an import circle and `bazel build` cannot fail on one."""
    spec = importlib.util.spec_from_file_location(
        "gen_build", ROOT / "third_party" / "bazel" / "gen_build.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    graph = {}
    for path in _sources():
        pkg = path.parent.relative_to(ROOT).as_posix()
        name = path.parent.name if path.name == "__init__.py" else path.stem
        label = f"//{pkg}:{name}"
        graph[label] = gen.imports(path) - {label}
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = 2

    for label in sorted(graph):
        if label not in state:
            visit(label, [label])
    assert not cycles, f"import cycles: {cycles}"


def test_pallas_kernels_import_only_jax():
    """DESIGN.md "Layout": `pallas_kernels` imports jax (and numpy), none of the project's other
    packages, so the kernels stay usable on their own."""
    bad = {}
    for path in sorted((ROOT / "pallas_kernels").rglob("*.py")):
        hits = sorted(n for n in _imported(path)
                      if n.split(".")[0] in PACKAGES and n.split(".")[0] != "pallas_kernels")
        if hits:
            bad[path.relative_to(ROOT).as_posix()] = hits
    assert not bad, f"pallas_kernels files importing other project packages: {bad}"
