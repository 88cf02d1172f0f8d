#!/bin/sh
# Interpreter for py_binary/py_test (see third_party/bazel/BUILD): the python3 on PATH, i.e. the
# one `python -m pytest` uses and requirements.txt was installed into.
exec python3 "$@"
