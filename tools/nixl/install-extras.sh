#!/bin/bash
# Called by tools/nixl/build.sh after 'meson install' into a staging directory:
#   install-extras.sh SRC BUILD STAGED PREFIX ABSL_DIR COMMIT VERSION HASH
# SRC: the unpacked NIXL tree; BUILD: its meson build dir; STAGED: the staged install
# (becomes PREFIX); ABSL_DIR: the abseil subproject's directory name.
# Adds what meson does not install but kvstage needs: the 'nixl' Python package, the
# headers and static Abseil an out-of-tree backend plugin compiles against, pkg-config
# files, and PREFIX/kvstage-nixl.env.
set -euo pipefail
[ $# -eq 8 ] || { echo "usage: $0 SRC BUILD STAGED PREFIX ABSL_DIR COMMIT VERSION HASH" >&2; exit 2; }
SRC=$1 BUILD=$2 STAGED=$3 PREFIX=$4 ABSL_DIR=$5 COMMIT=$6 VERSION=$7 HASH=$8
set -x

LIB=$STAGED/lib
PYSITE=lib/python3/dist-packages
INC=$STAGED/include

# 1. Python. meson installs the real package as nixl_cu12 (nixl_cu13 with CUDA 13; CPU-only
# builds name it cu12) with _api.py, _bindings, _utils. NIXL's wheel adds a small 'nixl'
# package that forwards to it (nixl-meta); install the same files so both
# 'from nixl._api import nixl_agent' and 'from nixl_cu12._api import nixl_agent' work.
test -f "$STAGED/$PYSITE/nixl_cu12/_api.py"
ls "$STAGED/$PYSITE"/nixl_cu12/_bindings*.so >/dev/null
META=$SRC/src/bindings/python/nixl-meta
mkdir -p "$STAGED/$PYSITE/nixl"
install -m 644 "$META/nixl/__init__.py" "$META/nixl/_api.py" "$META/nixl/logging.py" "$STAGED/$PYSITE/nixl/"
install -m 644 "$META/nixl_meta_utils.py" "$STAGED/$PYSITE/"

# 2. NIXL's source headers. 'install_headers' puts the public API, backend/ and
# utils/common/nixl_log.h under include/; in-tree plugins compile with the source tree's
# include dirs (src/api/cpp, src/api/cpp/backend, src/infra, src/core, src/core/telemetry,
# src/utils); keep a copy of every header there, same layout, under include/nixl-src.
(cd "$SRC/src" && find . -type f \( -name '*.h' -o -name '*.hpp' -o -name '*.inl' -o -name '*.cuh' \) \
    ! -path './bindings/rust/*' -print0 | tar --null -T - -cf -) | (mkdir -p "$INC/nixl-src" && tar -C "$INC/nixl-src" -xf -)

# 3. Abseil 20250814.1: NIXL's headers include absl/log/*.h, and NIXL links Abseil
# statically into each of its libraries and plugins (wrapdb's build makes static
# libraries only, and NIXL does not install them). An out-of-tree plugin links the same
# archives the same way: headers in include/nixl-absl, archives in lib/nixl-absl.
ABSL_SRC=$SRC/subprojects/$ABSL_DIR
(cd "$ABSL_SRC" && find absl -type f \( -name '*.h' -o -name '*.inc' \) ! -path '*/testdata/*' -print0 \
    | tar --null -T - -cf -) | (mkdir -p "$INC/nixl-absl" && tar -C "$INC/nixl-absl" -xf -)
mkdir -p "$LIB/nixl-absl"
# meson makes these thin archives (members stay in the build dir): write regular ones
for a in "$BUILD/subprojects/$ABSL_DIR"/libabsl_*.a; do
    out=$LIB/nixl-absl/$(basename "$a")
    (cd "$(dirname "$a")" && ar t "$a" | tr '\n' '\0' | xargs -0 ar qcD "$out")
    ranlib -D "$out"
    chmod 644 "$out"
    [ "$(head -c 8 "$out")" = '!<arch>' ] || { echo "not a regular archive: $out" >&2; exit 1; }
    [ "$(ar t "$out" | wc -l)" = "$(ar t "$a" | wc -l)" ]
done
ls "$LIB"/nixl-absl/libabsl_*.a >/dev/null
cp "$ABSL_SRC/LICENSE" "$LIB/nixl-absl/LICENSE"
absl_libs=$(cd "$LIB/nixl-absl" && ls libabsl_*.a | sed 's/^lib\(.*\)\.a$/-l\1/' | tr '\n' ' ')

# toml++ 3.4.0 headers: NIXL's common/configuration.h (nixl::config) includes toml++.
TOML_INC=$(ls -d "$SRC"/subprojects/tomlplusplus-*/include)
test -f "$TOML_INC/toml++/toml.hpp"
mkdir -p "$INC/nixl-toml"
cp -r "$TOML_INC/toml++" "$INC/nixl-toml/"

# 4. pkg-config. nixl.pc: an application using nixlAgent. nixl-plugin.pc: a backend plugin,
# with the include dirs and link line NIXL's own POSIX plugin is built with (build.ninja):
# libnixl_build and libnixl_common first, so Abseil's symbols resolve from
# libnixl_common.so, which exports them (as they do for NIXL's plugins); the static
# archives follow for anything it does not export. NIXL_TRACE_ENABLED is not defined
# (NIXL's tracing macros then compile to nothing in the plugin). The include dirs are
# -isystem: NIXL's headers are not -Wextra clean (unused parameters in backend_engine.h),
# and a plugin's own code should be free to build with -Wall -Wextra -Werror.
mkdir -p "$LIB/pkgconfig"
cat > "$LIB/pkgconfig/nixl.pc" <<EOF
# written by kvstage tools/nixl/build.sh (NIXL $COMMIT)
prefix=$PREFIX
includedir=\${prefix}/include
libdir=\${prefix}/lib
plugindir=\${libdir}/plugins

Name: nixl
Description: NVIDIA Inference Xfer Library (NIXL), C++ API
Version: $VERSION
Cflags: -std=c++20 -I\${includedir}
Libs: -L\${libdir} -Wl,-rpath,\${libdir} -lnixl -lnixl_build -lserdes
EOF
cat > "$LIB/pkgconfig/nixl-plugin.pc" <<EOF
# written by kvstage tools/nixl/build.sh (NIXL $COMMIT)
# For an out-of-tree NIXL backend plugin: a shared library named libplugin_<NAME>.so that
# exports nixl_plugin_init / nixl_plugin_fini (include/backend/backend_plugin.h). Build it
# with -shared -fPIC; put it in a directory named by NIXL_PLUGIN_DIR.
prefix=$PREFIX
includedir=\${prefix}/include
libdir=\${prefix}/lib
plugindir=\${libdir}/plugins
nixlsrcdir=\${includedir}/nixl-src
abslincludedir=\${includedir}/nixl-absl
tomlincludedir=\${includedir}/nixl-toml
absllibdir=\${libdir}/nixl-absl

Name: nixl-plugin
Description: NIXL backend plugin build flags (NIXL and its source-tree headers, Abseil 20250814.1)
Version: $VERSION
Cflags: -std=c++20 -fPIC -DNDEBUG -isystem \${includedir} -isystem \${includedir}/backend -isystem \${includedir}/utils -isystem \${nixlsrcdir}/api/cpp -isystem \${nixlsrcdir}/api/cpp/backend -isystem \${nixlsrcdir}/infra -isystem \${nixlsrcdir}/core -isystem \${nixlsrcdir}/core/telemetry -isystem \${nixlsrcdir}/utils -isystem \${nixlsrcdir}/utils/common -isystem \${abslincludedir} -isystem \${tomlincludedir}
Libs: -L\${libdir} -Wl,-rpath,\${libdir} -L\${absllibdir} -Wl,--start-group -lnixl_build -lnixl_common -lserdes $absl_libs-lrt -Wl,--end-group -pthread -ldl
EOF

# 5. the environment later steps source
PLUGIN_DIR=$PREFIX/lib/plugins
cat > "$STAGED/kvstage-nixl.env" <<EOF
# NIXL $VERSION (github.com/ai-dynamo/nixl $COMMIT), built by kvstage tools/nixl/build.sh
# (inputs $HASH). Source it:  . $PREFIX/kvstage-nixl.env
NIXL_PREFIX=$PREFIX
NIXL_COMMIT=$COMMIT
NIXL_VERSION=$VERSION
NIXL_INCLUDE_DIR=$PREFIX/include
NIXL_LIB_DIR=$PREFIX/lib
# where libnixl looks for plugins when NIXL_PLUGIN_DIR is unset (dirname(libnixl.so)/plugins)
NIXL_DEFAULT_PLUGIN_DIR=$PLUGIN_DIR
NIXL_PLUGIN_DIR=\${NIXL_PLUGIN_DIR:-$PLUGIN_DIR}
NIXL_EXAMPLE=$PREFIX/bin/nixl_example
NIXL_PYTHONPATH=$PREFIX/$PYSITE
PKG_CONFIG_PATH=$PREFIX/lib/pkgconfig\${PKG_CONFIG_PATH:+:\$PKG_CONFIG_PATH}
LD_LIBRARY_PATH=$PREFIX/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}
PYTHONPATH=$PREFIX/$PYSITE\${PYTHONPATH:+:\$PYTHONPATH}
export NIXL_PREFIX NIXL_COMMIT NIXL_VERSION NIXL_INCLUDE_DIR NIXL_LIB_DIR NIXL_DEFAULT_PLUGIN_DIR NIXL_PLUGIN_DIR NIXL_EXAMPLE NIXL_PYTHONPATH PKG_CONFIG_PATH LD_LIBRARY_PATH PYTHONPATH
EOF

# 6. what was built, and the marker build.sh reuses an install by
mkdir -p "$STAGED/share/kvstage-nixl"
{
    echo "NIXL $VERSION commit $COMMIT"
    echo "inputs $HASH"
    echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -srm)"
    echo "meson $(meson --version), ninja $(ninja --version), $(g++ --version | head -n1), $(python3 --version)"
    echo
    sed -n '/^nixl [0-9]/,$p' "$BUILD/meson-logs/meson-log.txt" | tail -n 60 || true
} > "$STAGED/share/kvstage-nixl/BUILD-INFO"
printf 'hash %s\ncommit %s\n' "$HASH" "$COMMIT" > "$STAGED/.kvstage-nixl-inputs"
