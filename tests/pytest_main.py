"""Entry point of every Bazel `pytest_test` (tests/pytest_test.bzl): runs one pytest file.

Bazel runs a py_test with the runfiles tree of the workspace as the working directory and
passes the test file's workspace-relative path (`$(rootpath ...)`) as the first argument, so
`pytest.main` sees the same file, rootdir (pyproject.toml) and conftest.py files as
`python -m pytest` from the repository root does. The pytest cache is disabled (runfiles are
not a place to keep state). When Bazel asks for a JUnit report (XML_OUTPUT_FILE), pytest writes
it, so Bazel's test.xml lists each test case.

Usage: pytest_main.py TEST_FILE [PYTEST_ARGS ...]; the exit status is pytest's (0 all passed,
1 some failed, 5 none collected, which also fails the Bazel test).
"""

from __future__ import annotations

import os
import sys

import pytest


def main(argv: list[str]) -> int:
    """Runs pytest on `argv` (a test file, then extra pytest arguments); returns its exit code."""
    if not argv:
        print("usage: pytest_main.py TEST_FILE [PYTEST_ARGS ...]", file=sys.stderr)
        return 2
    args = [*argv, "-q", "-p", "no:cacheprovider"]
    junit_xml = os.environ.get("XML_OUTPUT_FILE")  # set by `bazel test`
    if junit_xml:
        args.append(f"--junitxml={junit_xml}")
    return int(pytest.main(args))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
