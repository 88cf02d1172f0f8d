"""Bazel runs the same tests as pytest: every test file has exactly one pytest_test target,
every package module has a py_library, and the BUILD files are what
`third_party/bazel/gen_build.py` writes from the imports (so no dep is missing or stale)."""

from __future__ import annotations

import importlib.util
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("serving", "eval", "pallas_kernels", "mesh", "vertumnus_jax")


def _srcs(build: pathlib.Path) -> list[str]:
    return re.findall(r'srcs = \["([^"]+\.py)"\]', build.read_text()) if build.exists() else []


def test_every_test_file_has_a_pytest_target():
    missing, duplicated = [], []
    for test in sorted(ROOT.glob("tests/**/test_*.py")):
        if test.parent == ROOT / "tests":
            continue  # repository-level checks like this one run under pytest only
        srcs = _srcs(test.parent / "BUILD")
        n = srcs.count(test.name)
        (missing if n == 0 else duplicated if n > 1 else []).append(str(test.relative_to(ROOT)))
    assert not missing, f"test files without a pytest_test in their BUILD: {missing}"
    assert not duplicated, f"test files with several targets: {duplicated}"


def test_every_module_has_a_py_library():
    missing = []
    for pkg in PACKAGES:
        for init in sorted((ROOT / pkg).rglob("__init__.py")):
            folder = init.parent
            srcs = set(_srcs(folder / "BUILD"))
            missing += [m.relative_to(ROOT).as_posix() for m in sorted(folder.glob("*.py"))
                        if m.name not in srcs]
    assert not missing, f"modules without a py_library in their package's BUILD: {missing}"


def _gen_build():
    spec = importlib.util.spec_from_file_location(
        "gen_build", ROOT / "third_party" / "bazel" / "gen_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_build_files_match_the_imports():
    stale = [path.relative_to(ROOT).as_posix() for path, text in _gen_build().expected().items()
             if not path.exists() or path.read_text() != text]
    assert not stale, f"stale BUILD files, run `python third_party/bazel/gen_build.py`: {stale}"


def test_gen_build_maps_imports_to_labels(tmp_path):
    gen = _gen_build()
    module = tmp_path / "m.py"
    module.write_text(
        "import numpy\n"
        "from serving.policy import request, Scheduler\n"  # a module and a package member
        "from eval.traces.loaders import load_trace\n"
        "def f():\n    import mesh\n    from tests.eval.traces import trace_fixtures\n")
    assert gen.imports(module) == {
        "//serving/policy:request", "//serving/policy:policy", "//eval/traces:loaders",
        "//mesh:mesh", "//tests/eval/traces:trace_fixtures"}
