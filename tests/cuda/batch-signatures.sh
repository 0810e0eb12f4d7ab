#!/bin/sh
# shm/cuda.c must build against each toolkit's cudaMemcpyBatchAsync. Only one
# toolkit is installed here, so its runtime header is copied with the version
# and that one prototype swapped for CUDA 12.8's and 12.9's (NVIDIA's
# documented signatures: a size_t *failIdx before the stream; 12.8 without
# const), and cuda.c is compiled against each copy, -Werror, syntax only.
# Usage: batch-signatures.sh CC CUDA_INCLUDE_DIR SOURCE_ROOT
set -eu
cc=$1 inc=$2 src=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
proto='cudaError_t CUDARTAPI cudaMemcpyBatchAsync('
v128='void **dsts, void **srcs, size_t *sizes, size_t count, struct cudaMemcpyAttributes *attrs, size_t *attrsIdxs, size_t numAttrs, size_t *failIdx, cudaStream_t stream);'
v129='void *const *dsts, const void *const *srcs, const size_t *sizes, size_t count, struct cudaMemcpyAttributes *attrs, size_t *attrsIdxs, size_t numAttrs, size_t *failIdx, cudaStream_t stream);'
grep -q "$proto" "$inc/cuda_runtime_api.h" || { echo "no cudaMemcpyBatchAsync prototype in $inc"; exit 1; }
for v in 12080 12090; do
  mkdir -p "$tmp/$v"
  cp -r "$inc"/. "$tmp/$v/"
  [ $v = 12080 ] && args=$v128 || args=$v129
  sed -i -e "s/^#define CUDART_VERSION .*/#define CUDART_VERSION $v/" \
    -e "s/\($proto\).*/\1$args/" "$tmp/$v/cuda_runtime_api.h"
  [ "$(grep -c "failIdx, cudaStream_t stream);" "$tmp/$v/cuda_runtime_api.h")" -ge 1 ] ||
    { echo "could not swap the prototype for $v"; exit 1; }
  "$cc" -std=gnu11 -D_GNU_SOURCE -Wall -Wextra -Werror -fsyntax-only -isystem "$tmp/$v" \
    -I"$src/include" -I"$src/shm" $(pkg-config --cflags-only-I libdpdk | sed 's/-I/-isystem /g') \
    "$src/shm/cuda.c"
  echo "cuda.c builds against CUDA $v's cudaMemcpyBatchAsync"
done
# and against the installed toolkit itself
"$cc" -std=gnu11 -D_GNU_SOURCE -Wall -Wextra -Werror -fsyntax-only -isystem "$inc" \
  -I"$src/include" -I"$src/shm" $(pkg-config --cflags-only-I libdpdk | sed 's/-I/-isystem /g') \
  "$src/shm/cuda.c"
echo "cuda.c builds against the installed toolkit ($(grep '^#define CUDART_VERSION' "$inc/cuda_runtime_api.h"))"
