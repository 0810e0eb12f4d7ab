#!/bin/bash
# Checks the style of every Python file under python/ (pycodestyle, python/pycodestyle.cfg: lines of 120
# columns at most). Needs pycodestyle (Debian: pycodestyle). Exit status: pycodestyle's.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
pycodestyle --config="$here/pycodestyle.cfg" "$here"
