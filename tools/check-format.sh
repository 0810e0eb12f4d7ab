#!/bin/bash
# check-format.sh [FILE...]: every C file of the tree (git ls-files), or the
# FILEs given, is as clang-format makes it (.clang-format; Debian:
# clang-format). Prints the first differences and exits 1 if one is not;
# `clang-format -i FILE` fixes it. CI runs it over the whole tree.
set -euo pipefail
cd "$(dirname "$0")/.."
cf=$(command -v clang-format-14 || command -v clang-format || true)
[ -n "$cf" ] || { echo "check-format: clang-format is not installed (Debian: clang-format)" >&2; exit 2; }
if [ $# -eq 0 ]; then
	mapfile -t files < <(git ls-files '*.c' '*.h')
else
	files=("$@")
fi
out=$(mktemp)
trap 'rm -f "$out"' EXIT
if ! "$cf" --dry-run --Werror --style=file "${files[@]}" 2>"$out"; then
	head -40 "$out"
	echo "check-format: $(grep -c 'error:' "$out") lines differ from .clang-format's style: clang-format -i the files named" >&2
	exit 1
fi
echo "check-format: ${#files[@]} C files as .clang-format has them"
