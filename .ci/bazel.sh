#!/usr/bin/env bash
# Builds and tests the repository with Bazel, offline (Debian's bazel-bootstrap 4.2.3; see
# third_party/bazel/README.md for the repository overrides in .bazelrc and WORKSPACE).
#
# Usage: .ci/bazel.sh [test|build]
#   test  (default)  bazel build //... then bazel test //... --test_output=errors
#   build            bazel build //... only
# Installs bazel-bootstrap, bazel-platforms and bazel-rules-java with apt-get when missing.
# Bazel's output stays in its default place (~/.cache/bazel; /bazel-* symlinks, git-ignored).
# Exit status: 0 when everything built and every test passed; Bazel's own code otherwise
# (1 build failed, 3 some test failed, 4 no test targets found).
set -euo pipefail

mode="${1:-test}"
case "${mode}" in
  build | test) ;;
  *)
    echo "usage: $0 [test|build]" >&2
    exit 2
    ;;
esac

cd "$(dirname "$0")/.."

# The two Debian-packaged repositories .bazelrc points at, and Bazel itself.
if ! command -v bazel >/dev/null 2>&1 \
  || [[ ! -f /usr/share/bazel/tools/platforms/WORKSPACE ]] \
  || [[ ! -f /usr/share/bazel/rules/java/WORKSPACE ]]; then
  sudo=""
  if [[ "$(id -u)" -ne 0 ]]; then sudo="sudo"; fi
  ${sudo} apt-get update -qq
  DEBIAN_FRONTEND=noninteractive ${sudo} apt-get install -y -qq \
    bazel-bootstrap bazel-platforms bazel-rules-java
fi

# In CI, leave no Bazel server running behind the job.
if [[ -n "${CI:-}" ]]; then
  trap 'bazel shutdown >/dev/null 2>&1 || true' EXIT
fi

echo "== bazel build //..."
bazel build //...

if [[ "${mode}" == "test" ]]; then
  echo "== bazel test //..."
  bazel test //... --test_output=errors
fi
