#!/usr/bin/env bash
# The tree's C++ layout (.clang-format): formats every tracked and new C++ source in place, or with
# --check lists those that differ and fails. The test suite runs the check (ctest -R style.format).
#   bash scripts/format.sh [--check]
set -euo pipefail
cd "$(dirname "$0")/.."
command -v clang-format > /dev/null || { echo "format: clang-format is not installed (bash scripts/setup.sh)"; exit 77; }
mapfile -t files < <( (git ls-files '*.cpp' '*.hpp'; git ls-files --others --exclude-standard '*.cpp' '*.hpp') |
  sort -u | while read -r f; do [[ -f $f ]] && echo "$f"; done)
if [[ ${1:-} != --check ]]; then
  clang-format -i "${files[@]}"
  exit 0
fi
bad=()
for f in "${files[@]}"; do
  clang-format "$f" | cmp -s - "$f" || bad+=("$f")
done
if ((${#bad[@]})); then
  echo "format: ${#bad[@]} file(s) differ from .clang-format's layout (bash scripts/format.sh fixes them):"
  printf '  %s\n' "${bad[@]}"
  exit 1
fi
echo "format: ${#files[@]} files follow .clang-format"
