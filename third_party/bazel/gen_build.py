"""Writes the repository's Python BUILD files from the imports of the code (Gazelle's job).

    python third_party/bazel/gen_build.py          # rewrite every BUILD file below the packages
    python third_party/bazel/gen_build.py --check  # exit 1 and name the stale files

Rules (the pattern of `tests/pytest_test.bzl`):
  * every Python package below `PACKAGES` (a folder with `__init__.py`) gets a BUILD file with
    one `py_library` per module (named after the module; `__init__.py` is the library named
    after the folder) whose `deps` are the first-party modules it imports (anywhere in the file,
    function-level imports included); a module with an `if __name__ == "__main__":` block also
    gets a `py_binary` `<module>_main`;
  * every folder below `tests/` holding test files gets one `pytest_test` per `test_*.py`, a
    `py_library` per helper module, and `:init` libraries for its `__init__.py`; a test's `size`
    is kept from the BUILD file it replaces ("medium" for a new test);
  * a BUILD file's leading comment lines are kept; `EXTRA` adds attributes the imports cannot
    show (data files).

Third-party imports are not deps: they come from the interpreter on PATH
(`third_party/bazel/README.md`).
"""

from __future__ import annotations

import ast
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("pallas_kernels", "mesh", "vertumnus_jax", "serving", "eval")
FIRST_PARTY = PACKAGES + ("tests",)
# Attributes the imports do not show, by label (a list is added to the generated one).
EXTRA = {
    "//serving:server": {"data": ['"data/tiny_cpu8.csv"']},
    # `serving.prom.DASHBOARD`, read by tests/serving/test_metrics_names.py
    "//serving:prom": {"data": ['"grafana/vertumnus-dashboard.json"']},
    # runs `python -m serving.main` in a subprocess
    "//tests/serving:test_main": {"deps": ['"//serving:main"']},
}


def _module_label(dotted: str) -> str | None:
    """The Bazel label of a first-party dotted module name (a module or a package)."""
    parts = dotted.split(".")
    if parts[0] not in FIRST_PARTY:
        return None
    path = ROOT.joinpath(*parts)
    if path.with_suffix(".py").is_file():
        pkg = "/".join(parts[:-1])
        return f"//{pkg}:{parts[-1]}"
    if (path / "__init__.py").is_file():
        if parts == ["tests"]:
            return "//tests:pytest_support"
        return f"//{'/'.join(parts)}:{parts[-1]}" if parts[0] != "tests" else \
            f"//{'/'.join(parts)}:init"
    return None


def imports(path: pathlib.Path) -> set[str]:
    """Labels of the first-party modules `path` imports."""
    labels = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pkg import mod` names a module when pkg/mod.py exists, else a package member.
            subs = [f"{node.module}.{a.name}" for a in node.names]
            found = [s for s in subs if _module_label(s)]
            names = found + ([node.module] if len(found) < len(subs) else [])
        for name in names:
            label = _module_label(name)
            while label is None and "." in name:  # `import a.b.c` of a member: its package
                name = name.rsplit(".", 1)[0]
                label = _module_label(name)
            if label:
                labels.add(label)
    return labels


def _has_main(path: pathlib.Path) -> bool:
    return re.search(r'^if __name__ == "__main__":', path.read_text(), re.M) is not None


def _relative(label: str, pkg: str) -> str:
    p, name = label[2:].split(":")
    if p == pkg:
        return f":{name}"
    return f"//{p}" if p.rsplit("/", 1)[-1] == name else label


def _deps(labels: set[str], pkg: str, self_label: str) -> list[str]:
    deps = {_relative(label, pkg) for label in labels if label != self_label}
    # Bazel's order: other packages first, then this package's targets.
    return sorted(deps, key=lambda d: (d.startswith(":"), d))


def _rule(kind: str, attrs: list[tuple[str, object]]) -> str:
    lines = [f"{kind}("]
    for key, value in attrs:
        if isinstance(value, list):
            if not value:
                continue
            if len(value) == 1:
                lines.append(f"    {key} = [{value[0]}],")
            else:
                lines.append(f"    {key} = [")
                lines += [f"        {v}," for v in value]
                lines.append("    ],")
        else:
            lines.append(f"    {key} = {value},")
    lines.append(")")
    return "\n".join(lines)


def _q(items) -> list[str]:
    return [f'"{i}"' for i in items]


def _header(build: pathlib.Path, default: str) -> str:
    if build.exists():
        head = []
        for line in build.read_text().splitlines():
            if not line.startswith("#"):
                break
            head.append(line)
        if head:
            return "\n".join(head)
    return default


def package_build(folder: pathlib.Path) -> str:
    pkg = folder.relative_to(ROOT).as_posix()
    rules = []
    for mod in sorted(folder.glob("*.py")):
        name = folder.name if mod.name == "__init__.py" else mod.stem
        label = f"//{pkg}:{name}"
        attrs = [("name", f'"{name}"'), ("srcs", _q([mod.name])), ("srcs_version", '"PY3"')]
        extra = EXTRA.get(label, {})
        attrs += [(k, v) for k, v in extra.items() if k != "deps"]
        attrs.append(("deps", _q(_deps(imports(mod), pkg, label)) + extra.get("deps", [])))
        rules.append((name, _rule("py_library", attrs)))
        if mod.name != "__init__.py" and _has_main(mod):
            binary = f"{folder.name}_main" if name == "main" else f"{name}_main"
            rules.append((binary, _rule("py_binary", [
                ("name", f'"{binary}"'), ("srcs", _q([mod.name])), ("main", f'"{mod.name}"'),
                ("python_version", '"PY3"'), ("deps", _q([f":{name}"]))])))
    head = _header(folder / "BUILD", f"# {pkg}/: one py_library per module "
                                     "(third_party/bazel/gen_build.py).")
    body = "\n\n".join(r for _, r in sorted(rules))
    return f'{head}\npackage(default_visibility = ["//visibility:public"])\n\n{body}\n'


def _old_sizes(build: pathlib.Path) -> dict[str, str]:
    if not build.exists():
        return {}
    text = build.read_text()
    return dict(re.findall(r'name = "(test_\w+)",\n\s+srcs = \[[^\]]*\],\n\s+size = "(\w+)"', text))


def tests_build(folder: pathlib.Path) -> str:
    pkg = folder.relative_to(ROOT).as_posix()
    sizes = _old_sizes(folder / "BUILD")
    inits = []
    p = folder
    while p != ROOT / "tests":
        inits.append(f"//{p.relative_to(ROOT).as_posix()}:init")
        p = p.parent
    rules = [_rule("py_library", [("name", '"init"'),
                                  ("visibility", '["//tests:__subpackages__"]'),
                                  ("srcs", _q(["__init__.py"])), ("srcs_version", '"PY3"')])]
    for mod in sorted(folder.glob("*.py")):
        if mod.name in ("__init__.py", "conftest.py"):
            continue
        label = f"//{pkg}:{mod.stem}"
        deps = imports(mod) | set(inits)
        extra = EXTRA.get(label, {})
        if mod.name.startswith("test_"):
            rules.append(_rule("pytest_test", [
                ("name", f'"{mod.stem}"'), ("srcs", _q([mod.name])),
                ("size", f'"{sizes.get(mod.stem, "medium")}"'),
                ("deps", _q(_deps(deps, pkg, label)) + extra.get("deps", [])),
                *((k, v) for k, v in extra.items() if k != "deps")]))
        else:
            rules.append(_rule("py_library", [
                ("name", f'"{mod.stem}"'), ("visibility", '["//tests:__subpackages__"]'),
                ("srcs", _q([mod.name])), ("srcs_version", '"PY3"'),
                ("deps", _q(_deps(deps - {label}, pkg, label)))]))
    head = _header(folder / "BUILD", f"# {pkg}/: one pytest_test per test file "
                                     "(tests/pytest_test.bzl).")
    return f'{head}\nload("//tests:pytest_test.bzl", "pytest_test")\n\n' + "\n\n".join(rules) + "\n"


def expected() -> dict[pathlib.Path, str]:
    """Every generated BUILD file and its text."""
    out = {}
    for top in PACKAGES:
        for init in sorted((ROOT / top).rglob("__init__.py")):
            out[init.parent / "BUILD"] = package_build(init.parent)
    for init in sorted((ROOT / "tests").rglob("__init__.py")):  # folders holding any module
        if init.parent != ROOT / "tests" and any(
                p.name not in ("__init__.py", "conftest.py") for p in init.parent.glob("*.py")):
            out[init.parent / "BUILD"] = tests_build(init.parent)
    return out


def main(argv: list[str]) -> int:
    stale = []
    for path, text in expected().items():
        if not path.exists() or path.read_text() != text:
            stale.append(path.relative_to(ROOT).as_posix())
            if "--check" not in argv:
                path.write_text(text)
    if "--check" in argv and stale:
        print("stale BUILD files (run python third_party/bazel/gen_build.py):", *stale)
        return 1
    print(("stale: " if "--check" in argv else "written: ") + (", ".join(stale) or "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
