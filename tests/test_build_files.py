"""Bazel runs the same tests as pytest: every test file has exactly one pytest_test target,
and every package module has a py_library."""

from __future__ import annotations

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
        if not (ROOT / pkg).is_dir():
            continue
        srcs = set(_srcs(ROOT / pkg / "BUILD"))
        missing += [f"{pkg}/{m.name}" for m in sorted((ROOT / pkg).glob("*.py")) if m.name not in srcs]
    assert not missing, f"modules without a py_library in their package's BUILD: {missing}"
