"""Packaging (issue #18), checked on pyproject.toml and the requirements files: the runtime
dependencies provide every third-party module the packages import (so `pip install -e .` runs
the demo), test-only packages stay in the `test` extra, the pins cover both lists, the console
scripts run their tools, and CI runs the README's test command."""

from __future__ import annotations

import ast
import importlib.metadata
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("pallas_kernels", "mesh", "vertumnus_jax", "serving", "eval")
TEST_ONLY = {"torch", "transformers", "pytest", "hypothesis"}
# A module whose distribution is named otherwise, for when it is not installed here.
DISTRIBUTION_OF = {"absl": "absl-py", "orbax": "orbax-checkpoint",
                   "prometheus_client": "prometheus-client", "yaml": "pyyaml"}

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _name(requirement: str) -> str:
    """The normalized distribution name of a requirement (PEP 503): `jax[cuda13]>=1` -> `jax`."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement).group()).lower()


def _pins(path: pathlib.Path) -> dict[str, str]:
    """`name==version` lines of a requirements file, following `-r` includes."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("-r"):
            pins |= _pins(path.parent / line[2:].strip())
        elif line:
            name, sep, version = line.partition("==")
            assert sep, f"{path.name}: {line!r} is not pinned with =="
            pins[_name(name)] = version.strip()
    return pins


RUNTIME = {_name(r) for r in PYPROJECT["dependencies"]}
TEST_EXTRA = {_name(r) for r in PYPROJECT["optional-dependencies"]["test"]}


# Extras a user opts into (not the test extra): their modules may only be imported lazily.
OPTIONAL = {_name(r) for extra, reqs in PYPROJECT["optional-dependencies"].items()
            if extra != "test" for r in reqs}


def _third_party_imports() -> dict[str, dict[str, bool]]:
    """Top-level third-party module -> {source file (tests excluded): imported at module level}."""
    found: dict[str, dict[str, bool]] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            top_level = {id(n) for n in tree.body}
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                else:
                    continue
                for top in {n.split(".")[0] for n in names}:
                    if top not in sys.stdlib_module_names and top not in PACKAGES:
                        files = found.setdefault(top, {})
                        rel = path.relative_to(ROOT).as_posix()
                        files[rel] = files.get(rel, False) or id(node) in top_level
    return found


def test_runtime_dependencies_provide_every_import():
    """`pip install -e .` is enough to import every module: a third-party module comes from a
    runtime dependency, or from an optional extra (`ray`) and is then imported only inside the
    functions that need it."""
    installed = importlib.metadata.packages_distributions()
    missing, eager = {}, {}
    for module, files in sorted(_third_party_imports().items()):
        providers = {_name(d) for d in installed.get(module, ())}
        if module in DISTRIBUTION_OF:
            providers.add(DISTRIBUTION_OF[module])
        if providers & RUNTIME:
            continue
        if providers & OPTIONAL:
            eager.update({f: module for f, at_top in files.items() if at_top})
        else:
            missing[module] = (sorted(providers) or ["?"], sorted(files)[:3])
    assert not missing, ("modules imported by the packages but provided by no runtime dependency "
                         f"of pyproject.toml (module: (distributions, files)): {missing}")
    assert not eager, f"optional dependencies imported at module level (file: module): {eager}"


def test_test_only_packages_are_not_runtime_dependencies():
    assert not RUNTIME & TEST_ONLY, f"test-only packages in dependencies: {RUNTIME & TEST_ONLY}"
    assert TEST_EXTRA == TEST_ONLY, f"the test extra holds {sorted(TEST_EXTRA)}"
    assert "httpx" in RUNTIME  # the load generator needs it at run time
    assert PYPROJECT["optional-dependencies"]["cuda"] == ["jax[cuda13]>=0.10.2"]
    assert not OPTIONAL & TEST_ONLY


def test_pins_cover_the_dependencies():
    runtime_pins = _pins(ROOT / "requirements.txt")
    test_pins = _pins(ROOT / "requirements-test.txt")
    assert not set(runtime_pins) & TEST_ONLY, "requirements.txt pins test-only packages"
    assert RUNTIME <= set(runtime_pins), f"unpinned: {sorted(RUNTIME - set(runtime_pins))}"
    assert TEST_EXTRA <= set(test_pins), f"unpinned: {sorted(TEST_EXTRA - set(test_pins))}"
    extras = OPTIONAL - {"jax"}  # all but `cuda` (GPU images bring their own jax), for CI
    assert extras <= set(test_pins), f"unpinned: {sorted(extras - set(test_pins))}"
    assert test_pins["torch"] == "2.13.0"  # the CPU wheel these machines carry


@pytest.mark.parametrize("script, flag, doc", [
    ("vertumnus-serve", "composition", "The serving binary"),
    ("vertumnus-loadgen", "launch_server", "Load generator: replays a trace"),
    ("vertumnus-replay", "systems", "Replay a workload through simulated prefill pools")])
def test_console_scripts_run_their_tools(script, flag, doc):
    """What the installed script does: import the entry point, call it with `--help` (absl
    prints the main module's docstring and key flags and exits 1), as `python -m <tool>
    --help` does; a fresh process, as each tool defines its flags. (Before
    `serving.console.help_as_module` the scripts printed a usage line only.)"""
    module, _, attr = PYPROJECT["scripts"][script].partition(":")
    code = (f"import sys; sys.argv = [{script!r}, '--help']\n"
            f"from {module} import {attr} as entry\nentry()")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"--{flag}:" in proc.stdout.replace("[no]", ""), proc.stdout[-2000:]
    assert proc.stdout.lstrip().startswith(doc), proc.stdout[:500]


def test_ci_runs_the_readme_test_command():
    blocks = re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text().split(
        "## Set up", 1)[1].split("\n## ", 1)[0], re.S)
    assert len(blocks) == 2, "README's Set up has exactly two commands"
    assert blocks[0].startswith("pip install -r requirements.txt -e . && ")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert blocks[1].replace("pip install ", "pip install -q ", 1) in ci
