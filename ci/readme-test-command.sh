#!/usr/bin/env bash
# Run the test command exactly as README.md states it (the quick-start line marked "# all tests"),
# so the README cannot drift from what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
command=$(sed -n 's/^\(uv run .*[^ ]\) *# all tests$/\1/p' README.md | head -n 1)
if [ -z "$command" ]; then
  echo "README.md has no quick-start line ending in '# all tests'" >&2
  exit 2
fi
echo "+ $command"
eval "$command"
