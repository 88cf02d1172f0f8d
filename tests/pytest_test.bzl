"""`pytest_test`: a Bazel test that runs one pytest file the way `python -m pytest` does.

Pattern for BUILD files (one pytest_test per test file, next to it):

    # serving/BUILD: one py_library per module, deps on the modules it imports.
    py_library(
        name = "request",
        srcs = ["request.py"],
        srcs_version = "PY3",
    )

    # tests/serving/BUILD
    load("//tests:pytest_test.bzl", "pytest_test")

    pytest_test(
        name = "test_request",          # the file name without ".py"
        srcs = ["test_request.py"],     # exactly one test file
        deps = ["//serving:request"],   # the first-party py_library targets it imports
    )

Rules of the pattern:
  * deps lists first-party targets only. Third-party packages (numpy, jax, pytest, hypothesis,
    ...) come from the python3 on PATH that requirements.txt was installed into (the
    toolchain in third_party/bazel/BUILD); there are no pip rules.
  * A test that imports a helper module from tests/ (or a conftest.py below tests/) adds a
    py_library for it in that package's BUILD and lists it in deps.
  * data: files the test reads at run time, as labels (Bazel copies them into the runfiles).
  * size: "small" (60 s timeout) for numpy-only tests, "medium" (300 s, the default) for
    tests that compile with jax, "large" (900 s) for the slowest. Other py_test arguments
    (tags, timeout, env, args, flaky, ...) pass through.
  * Every pytest_test gets //tests:pytest_support: tests/conftest.py (8 host CPU devices for
    jax) and pyproject.toml (pytest's rootdir and options), so pytest under Bazel collects the
    same tests with the same configuration as `python -m pytest tests/...`.
"""

_MAIN = "//tests:pytest_main.py"

def pytest_test(name, srcs, deps = [], data = [], args = [], size = "medium", tags = [], **kwargs):
    """Declares a py_test that runs pytest on one test file.

    Args:
      name: target name, by convention the test file's name without ".py".
      srcs: a list holding exactly one test file (test_*.py).
      deps: first-party py_library targets the test imports.
      data: run-time data files.
      args: extra pytest arguments, appended after the test file.
      size: Bazel test size ("small", "medium" or "large").
      tags: extra tags; "pytest" is always added.
      **kwargs: passed through to py_test.
    """
    if len(srcs) != 1:
        fail("pytest_test %s: srcs must hold exactly one test file, got %s" % (name, srcs))
    native.py_test(
        name = name,
        srcs = srcs + [_MAIN],
        main = _MAIN,
        args = ["$(rootpath %s)" % srcs[0]] + args,
        deps = deps + ["//tests:pytest_support"],
        data = data,
        python_version = "PY3",
        srcs_version = "PY3",
        size = size,
        tags = tags + ["pytest"],
        **kwargs
    )
