#!/bin/bash
# Runs the Python binding's tests against a build dir: python/run-tests.sh [BUILD_DIR [PYTEST_ARGS...]]
# (PYTEST_ARGS naming test files, python/tests/X.py or X.py::test, run those only.)
# BUILD_DIR (default build, relative to the repository root) must hold shm/libkvstage.so.0 and
# proxy/kvstaged. An ASan build (b_sanitize=address) works too: libasan is preloaded into Python,
# whose own allocations LeakSanitizer would report, so leak detection is off there.
# Needs python3 with pytest (Debian: python3-pytest; python3-numpy is optional). Exit status: pytest's.
set -euo pipefail
export PATH="${PATH:-/usr/local/bin:/usr/bin:/bin}"
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(dirname "$here")
bd=${1:-build}
[ $# -gt 0 ] && shift
case $bd in /*) ;; *) bd=$root/$bd ;; esac

export KVSTAGE_LIB=$bd/shm/libkvstage.so.0
export KVSTAGED=$bd/proxy/kvstaged
for f in "$KVSTAGE_LIB" "$KVSTAGED"; do
	[ -e "$f" ] || { echo "run-tests.sh: no $f (build it: ninja -C $bd)" >&2; exit 2; }
done
if [ -e "$bd/shm/libkvstage_cuda.so.0" ]; then
	export KVSTAGE_CUDA_LIB=$bd/shm/libkvstage_cuda.so.0
else
	export KVSTAGE_CUDA_LIB=$bd/shm/libkvstage_cuda.so.0.absent # not built: no toolkit; a system copy would not match
fi

# A python3 that has pytest: $PYTHON, else the first on PATH, else Debian's.
py=
for cand in ${PYTHON:-} python3 /usr/bin/python3; do
	if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import pytest' 2>/dev/null; then
		py=$cand
		break
	fi
done
[ -n "$py" ] || { echo "run-tests.sh: no python3 with pytest (apt-get install python3-pytest)" >&2; exit 2; }

asan=$(ldd "$KVSTAGE_LIB" | awk '/libasan\.so/ { print $3; exit }')
if [ -n "$asan" ]; then
	# The library is instrumented: its runtime must be loaded first, into Python itself.
	export LD_PRELOAD=$asan${LD_PRELOAD:+:$LD_PRELOAD}
	export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:abort_on_error=1}
	export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
	echo "run-tests.sh: ASan build: LD_PRELOAD=$LD_PRELOAD ASAN_OPTIONS=$ASAN_OPTIONS" >&2
fi

export PYTHONPATH=$here${PYTHONPATH:+:$PYTHONPATH}
export PYTHONDONTWRITEBYTECODE=1
cd "$root"
# Test files or node ids among the arguments: those only; else the whole suite.
targets=(python/tests)
for a in "$@"; do
	case $a in python/tests/* | *.py | *.py::*) targets=(); break ;; esac
done
exec "$py" -m pytest -q -p no:cacheprovider "${targets[@]}" "$@" </dev/null
