#!/bin/bash
# Quick proof that a NIXL install made by tools/nixl/build.sh works. See --help.
set -euo pipefail
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
ME=kvstage-nixl-check
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

usage() {
    cat <<'EOF'
usage: tools/nixl/check.sh [PREFIX]

Checks a NIXL install made by tools/nixl/build.sh (PREFIX defaults to the one
'build.sh --print-prefix' names). Sources PREFIX/kvstage-nixl.env, then:
  1. the files later steps use are there (libnixl, the POSIX plugin, nixl_example,
     include/backend/backend_plugin.h, the pkg-config files, the Python package);
  2. nixl_example finds the POSIX plugin and creates its backend (nixl_example then
     needs a network backend for its agent-to-agent DRAM transfer, which POSIX is not:
     the step passes when it gets past 'createBackend' and registers memory);
  3. python3 (Debian's) imports nixl_agent from the 'nixl' package and from nixl_cu12,
     and moves 1 MiB DRAM -> file -> DRAM through the POSIX plugin, every byte compared
     (check_agent.py).
An out-of-tree plugin built against it is what tests/nixl/run.sh builds (libplugin_KVSTAGE.so).
Prints one line a check; exits 1 if any fails. Needs pkg-config, python3-numpy.
EOF
}
case ${1:-} in -h|--help) usage; exit 0 ;; esac
[ $# -le 1 ] || { usage >&2; exit 2; }
PREFIX=${1:-$("$HERE/build.sh" --print-prefix)}
ENVF=$PREFIX/kvstage-nixl.env
[ -f "$ENVF" ] || { echo "$ME: error: $ENVF not found: is $PREFIX an install of tools/nixl/build.sh?" >&2; exit 1; }
exec </dev/null
# shellcheck disable=SC1090
. "$ENVF"
export NIXL_PLUGIN_DIR=$NIXL_DEFAULT_PLUGIN_DIR

T=$(mktemp -d /tmp/kvstage-nixl-check.XXXXXX)
trap 'rm -rf "$T"' EXIT
failed=0
pass() { printf '%s: ok    %s\n' "$ME" "$*"; }
fail() { printf '%s: FAIL  %s\n' "$ME" "$*"; failed=1; }
show() { sed 's/^/        /' "$1" | tail -n "${2:-15}"; }

echo "$ME: NIXL $NIXL_VERSION ($NIXL_COMMIT) in $NIXL_PREFIX"

# 1. files
missing=
for f in "$NIXL_LIB_DIR/libnixl.so" "$NIXL_DEFAULT_PLUGIN_DIR/libplugin_POSIX.so" "$NIXL_EXAMPLE" \
         "$NIXL_INCLUDE_DIR/nixl.h" "$NIXL_INCLUDE_DIR/backend/backend_plugin.h" \
         "$NIXL_INCLUDE_DIR/nixl-absl/absl/log/log.h" "$NIXL_LIB_DIR/pkgconfig/nixl-plugin.pc" \
         "$NIXL_PYTHONPATH/nixl/__init__.py" "$NIXL_PYTHONPATH/nixl_cu12/_api.py"; do
    [ -e "$f" ] || missing="$missing $f"
done
if [ -z "$missing" ]; then pass "installed files"; else fail "missing:$missing"; fi
if out=$(ldd "$NIXL_EXAMPLE" "$NIXL_DEFAULT_PLUGIN_DIR/libplugin_POSIX.so" 2>&1) && ! grep -q 'not found' <<<"$out"; then
    pass "ldd: nixl_example and libplugin_POSIX.so resolve every library"
else
    fail "ldd: $(grep 'not found' <<<"$out" | tr -s ' \t' ' ' | tr '\n' ';')"
fi
if v=$(pkg-config --modversion nixl nixl-plugin 2>&1); then
    pass "pkg-config nixl nixl-plugin: $(echo $v)"
else
    fail "pkg-config: $v"
fi

# 2. nixl_example with the POSIX backend
rc=0
(cd "$T" && timeout 60 "$NIXL_EXAMPLE" POSIX > "$T/example.log" 2>&1) || rc=$?
if grep -qx 'POSIX' "$T/example.log" && grep -q 'Params after init' "$T/example.log"; then
    if [ $rc = 0 ]; then
        pass "nixl_example POSIX ran to the end"
    else
        pass "nixl_example POSIX: plugin found, backend created (exit $rc after that: $(grep -v '^\s' "$T/example.log" | tail -n 1))"
    fi
else
    fail "nixl_example POSIX (exit $rc):"; show "$T/example.log"
fi

# 3. python, POSIX transfers
if python3 -c 'import numpy' 2>/dev/null; then
    if python3 -c 'from nixl._api import nixl_agent; from nixl_cu12._api import nixl_agent' > "$T/import.log" 2>&1; then
        pass "python3: from nixl._api import nixl_agent (and nixl_cu12._api)"
    else
        fail "python3 import:"; show "$T/import.log"
    fi
    if (cd "$T" && timeout 120 python3 "$HERE/check_agent.py" "$T") > "$T/posix.log" 2>&1; then
        pass "python3: $(grep '^POSIX:' "$T/posix.log")"
    else
        fail "python3 POSIX transfer:"; show "$T/posix.log"
    fi
else
    fail "python3: numpy is missing (apt-get install python3-numpy); nixl's Python API imports it"
fi

if [ $failed = 0 ]; then echo "$ME: all checks passed"; else echo "$ME: some checks FAILED"; fi
exit $failed
