#!/usr/bin/env bash
# Builds kvstage with CUDA in build-h200/ (release) and collects into
# build-h200/bundle/ what the lent H200 machine needs to run the CUDA tests
# and the GPU bench: that machine has an NVIDIA driver but no package
# registry and no DPDK, so the binaries travel with every shared library
# they load that is not glibc's (the CUDA runtime, libcudart, included: it
# must match the build; the driver's libcuda is the machine's own and never
# carried).
#
#   tools/h200/bundle.sh            # here, once per change
#   then, with the device tool:     run(command="tools/h200/run.sh",
#                                       carry=["build-h200/bundle"], timeout_s=540)
set -euo pipefail
cd "$(dirname "$0")/../.."
B=build-h200
OUTB=$B/bundle
LIMIT_MB=60 # the device tool carries 64 MiB at most, the working tree included

if [ ! -f "$B/build.ninja" ]; then
  meson setup "$B" --buildtype=release -Dcuda=enabled -Dtests=true > build-setup.log 2>&1 \
    || { cat build-setup.log; exit 1; }
fi
ninja -C "$B" proxy/kvstaged tools/bench/kvstage-bench tests/test-cuda shm/libkvstage.so.0.1.0 shm/libkvstage_cuda.so.0.1.0

rm -rf "$OUTB"
mkdir -p "$OUTB/proxy" "$OUTB/tools/bench" "$OUTB/tests" "$OUTB/lib"
# The build tree's layout, so KVSTAGE_BUILD_DIR=bundle finds proxy/kvstaged
# for the tests and the bench finds it beside itself (../../proxy/kvstaged).
cp "$B/proxy/kvstaged" "$OUTB/proxy/"
cp "$B/tools/bench/kvstage-bench" "$OUTB/tools/bench/"
cp "$B/tests/test-cuda" "$OUTB/tests/"
# The binding's libraries, for py_gpu_check.py (python/ travels with the tree).
cp -L "$B/shm/libkvstage.so.0" "$B/shm/libkvstage_cuda.so.0" "$OUTB/lib/"
bins=("$OUTB/proxy/kvstaged" "$OUTB/tools/bench/kvstage-bench" "$OUTB/tests/test-cuda")

# Every library ldd resolves, but glibc's own (the machine's must be used)
# and the NVIDIA driver's.
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libdl\.so|libpthread\.so|librt\.so|libresolv\.so|libutil\.so|libcuda\.so|libnvidia)'
for b in "${bins[@]}"; do
  if ldd "$b" | grep -q 'not found'; then
    echo "bundle: $b has unresolved libraries here:" >&2
    ldd "$b" | grep 'not found' >&2
    exit 1
  fi
  ldd "$b" | awk '$2 == "=>" && $3 ~ /^\// { print $1, $3 }' | while read -r name path; do
    if [[ ! "$name" =~ $skip ]]; then
      cp -L "$path" "$OUTB/lib/$name"
    fi
  done
done

# The newest glibc symbol version any of them needs: the H200 image's glibc
# must be at least that.
need=$(for f in "${bins[@]}" "$OUTB"/lib/*; do objdump -T "$f" 2>/dev/null; done |
  grep -o 'GLIBC_2\.[0-9]*' | sort -t. -k2 -n -u | tail -1)
{
  echo "kvstage $(git describe --always --dirty 2>/dev/null || echo '?') built $(date -u +%FT%TZ) on $(uname -n)"
  echo "nvcc: $("$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)" --version | grep -o 'V[0-9][0-9.]*')"
  echo "needs glibc >= ${need#GLIBC_}"
  echo "libraries carried: $(cd "$OUTB/lib" && ls | tr '\n' ' ')"
} > "$OUTB/BUILD-INFO"

mb=$(du -sm "$OUTB" | cut -f1)
cat "$OUTB/BUILD-INFO"
du -sh "$OUTB"
if [ "$mb" -gt "$LIMIT_MB" ]; then
  echo "bundle: ${mb} MiB is over ${LIMIT_MB} MiB: the device tool would refuse it" >&2
  exit 1
fi
echo "bundle ready: run(command=\"tools/h200/run.sh\", carry=[\"$OUTB\"], timeout_s=540)"
