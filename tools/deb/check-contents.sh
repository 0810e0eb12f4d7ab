#!/usr/bin/env bash
# Checks the .debs that tools/deb/build.sh left in DIR without installing
# them: every package there once; every file it must hold, and none it
# must not (each file matches a pattern below); its Depends; no RPATH or
# RUNPATH in any ELF file; libkvstage0's SONAME, shlibs and symbols (the
# symbols file against what the library exports); the unit, conffile and
# maintainer scripts; every man page through man's warnings.
#
# Usage: tools/deb/check-contents.sh DIR
#
# Prints one line per check to stderr, then "check-contents: ok" or the
# failures; exits 1 on any failure.

# "test && ok ... || bad ...": ok only prints, so bad runs only when the test fails.
# shellcheck disable=SC2015
set -euo pipefail
export LC_ALL=C.UTF-8

[ $# -eq 1 ] || { echo "usage: tools/deb/check-contents.sh DIR" >&2; exit 2; }
dir=$(cd "$1" && pwd)
tmp=$(mktemp -d /tmp/kvstage-debcheck.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
fails=0
ok() { echo "  ok: $*" >&2; }
bad() { echo "  FAIL: $*" >&2; fails=$((fails + 1)); }

# Each package's files: "must" lines are paths that have to be there
# (literal, or a glob that must match at least one path); "may" lines are
# further globs a file may match. A file that matches neither fails: a
# stray file (a /usr/local path, a test binary, CUDA) is caught here.
multiarch=$(dpkg-architecture -qDEB_HOST_MULTIARCH)
libdir=usr/lib/$multiarch
py=usr/lib/python3/dist-packages
expect() {
  case $1 in
    kvstage) cat <<EOF
must usr/bin/kvstaged
must usr/bin/kvstage-stat
must usr/bin/kvstage-ctl
must usr/bin/kvstage-bench
must usr/bin/kvstage-demo
must usr/share/man/man8/kvstaged.8.gz
must usr/share/man/man1/kvstage-stat.1.gz
must usr/share/man/man1/kvstage-ctl.1.gz
must usr/share/man/man1/kvstage-bench.1.gz
must usr/share/man/man1/kvstage-demo.1.gz
must lib/systemd/system/kvstaged.service
must usr/lib/sysusers.d/kvstaged.conf
must usr/lib/tmpfiles.d/kvstaged.conf
must etc/kvstage/kvstaged.conf
must usr/share/doc/kvstage/kvstaged.conf.example
must usr/share/doc/kvstage/README.md.gz
must usr/share/doc/kvstage/README.Debian
must usr/share/doc/kvstage/copyright
must usr/share/doc/kvstage/changelog.gz
EOF
      ;;
    libkvstage0) cat <<EOF
must $libdir/libkvstage.so.0
must $libdir/libkvstage.so.0.*
must usr/share/doc/libkvstage0/copyright
must usr/share/doc/libkvstage0/changelog.gz
may usr/share/lintian/overrides/libkvstage0
EOF
      ;;
    libkvstage-dev) cat <<EOF
must usr/include/kvstage.h
must $libdir/libkvstage.so
must $libdir/libkvstage.a
must $libdir/pkgconfig/libkvstage.pc
must usr/share/man/man3/kvstage.3.gz
must usr/share/doc/libkvstage-dev/copyright
must usr/share/doc/libkvstage-dev/changelog.gz
EOF
      ;;
    python3-kvstage) cat <<EOF
must $py/kvstage/__init__.py
must $py/kvstage/_lib.py
must $py/kvstage/client.py
must $py/kvstage/sglang_plugin.py
must $py/kvstage/sglang/__init__.py
must $py/kvstage/vllm/__init__.py
must $py/kvstage/vllm/connector.py
must $py/kvstage-*.dist-info/METADATA
must $py/kvstage-*.dist-info/entry_points.txt
must $py/kvstage-*.dist-info/top_level.txt
must usr/share/doc/python3-kvstage/copyright
must usr/share/doc/python3-kvstage/changelog.gz
may $py/kvstage/*.py
may $py/kvstage/sglang/*.py
may $py/kvstage/vllm/*.py
EOF
      ;;
  esac
  # Lintian overrides of the package itself, wherever it has some.
  echo "may usr/share/lintian/overrides/$1"
}

# Whether a line of stdin matches the glob $1.
has() {
  local f
  while read -r f; do
    # shellcheck disable=SC2053 # $1 is a glob
    [[ $f == $1 ]] && return 0
  done
  return 1
}

pkgs=(kvstage libkvstage0 libkvstage-dev python3-kvstage)
declare -A deb
for p in "${pkgs[@]}"; do
  # shellcheck disable=SC2206 # the glob is meant
  found=("$dir/${p}"_*.deb)
  if [ ${#found[@]} -ne 1 ] || [ ! -f "${found[0]}" ]; then
    bad "$p: want one ${p}_*.deb in $dir, found ${#found[@]}: ${found[*]}"
    continue
  fi
  deb[$p]=${found[0]}
done
[ ${#deb[@]} -eq ${#pkgs[@]} ] || { echo "check-contents: packages missing" >&2; exit 1; }
version=$(dpkg-deb -f "${deb[kvstage]}" Version)
echo "check-contents: kvstage $version in $dir" >&2

for p in "${pkgs[@]}"; do
  echo "$p ($(basename "${deb[$p]}"), $(stat -c %s "${deb[$p]}") bytes):" >&2
  mkdir -p "$tmp/$p"
  dpkg-deb -x "${deb[$p]}" "$tmp/$p"
  dpkg-deb -e "${deb[$p]}" "$tmp/$p/DEBIAN"
  # Files and symlinks, relative, no leading ./ (directories need no rule).
  (cd "$tmp/$p" && find . -path ./DEBIAN -prune -o ! -type d -print | sed 's|^\./||' | sort) > "$tmp/$p.files"
  expect "$p" > "$tmp/$p.expect"
  while read -r kind pat; do
    [ "$kind" = must ] || continue
    has "$pat" < "$tmp/$p.files" || bad "$p: no $pat"
  done < "$tmp/$p.expect"
  stray=0
  while read -r f; do
    matched=0
    while read -r _ pat; do
      # shellcheck disable=SC2053
      if [[ $f == $pat ]]; then matched=1; break; fi
    done < "$tmp/$p.expect"
    [ $matched -eq 1 ] || { bad "$p: unexpected file $f"; stray=1; }
  done < "$tmp/$p.files"
  [ $stray -eq 1 ] || ok "$p: $(wc -l < "$tmp/$p.files") files, each where it belongs"

  # No RPATH/RUNPATH: the build tree's would outlive the build, and
  # Debian's libraries are found by the loader's own paths.
  while read -r f; do
    if [ -f "$tmp/$p/$f" ] && [ "$(head -c 4 "$tmp/$p/$f" | od -An -c | tr -d ' ')" = '177ELF' ]; then
      if readelf -d "$tmp/$p/$f" | grep -q -E '\((RPATH|RUNPATH)\)'; then
        bad "$p: $f has $(readelf -d "$tmp/$p/$f" | grep -E 'RPATH|RUNPATH')"
      else
        ok "$p: $f: no RPATH/RUNPATH"
      fi
    fi
  done < "$tmp/$p.files"
done

# Depends: each package's must name these (a substring of the field).
want_dep() {
  local p=$1 field=$2 need=$3 val
  val=$(dpkg-deb -f "${deb[$p]}" "$field")
  if [[ $val == *"$need"* ]]; then ok "$p: $field has $need"; else bad "$p: $field lacks '$need': $val"; fi
}
no_dep() {
  local p=$1 field=$2 not=$3 val
  val=$(dpkg-deb -f "${deb[$p]}" "$field")
  if [[ $val == *"$not"* ]]; then bad "$p: $field has '$not': $val"; else ok "$p: $field has no $not"; fi
}
echo "dependencies:" >&2
# kvstaged's libraries (the four optional parts built in), sysusers' provider.
for d in 'systemd | systemd-standalone-sysusers | systemd-sysusers' libsodium23 librte-ring23 \
         libinih1 libibverbs1 libmicrohttpd12 libsystemd0 libacl1; do
  want_dep kvstage Depends "$d"
done
no_dep kvstage Depends cuda
# DPDK's EAL: nothing of kvstaged asks for it (its CRC32C is libkvstage's, design note 46).
no_dep kvstage Depends librte-eal
want_dep libkvstage0 Depends libc6
# The client library needs nothing of DPDK at run time (its headers only).
no_dep libkvstage0 Depends librte
want_dep libkvstage-dev Depends "libkvstage0 (= $version)"
want_dep python3-kvstage Depends "libkvstage0 (>= $version)"
want_dep python3-kvstage Depends "libkvstage0 (<< $version.1~)"
want_dep python3-kvstage Depends python3-numpy
want_dep python3-kvstage Depends python3
[ "$(dpkg-deb -f "${deb[python3-kvstage]}" Architecture)" = all ] &&
  ok "python3-kvstage: Architecture all" || bad "python3-kvstage: not Architecture all"
want_dep libkvstage0 Multi-Arch same

echo "libkvstage0:" >&2
lib=$(ls "$tmp/libkvstage0/$libdir"/libkvstage.so.0.*)
soname=$(readelf -d "$lib" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
[ "$soname" = libkvstage.so.0 ] && ok "SONAME $soname" || bad "SONAME is '$soname'"
shlibs=$(cat "$tmp/libkvstage0/DEBIAN/shlibs" 2>/dev/null || true)
[[ $shlibs == "libkvstage 0 libkvstage0 (>= "* ]] && ok "shlibs: $shlibs" || bad "shlibs: '$shlibs'"
if [ -f "$tmp/libkvstage0/DEBIAN/symbols" ]; then
  # What the library exports (defined, in version KVSTAGE_0) against the
  # symbols file: the same set, both ways.
  # objdump -T: "ADDR g DF .text SIZE VERSION NAME"; undefined ones say *UND*.
  objdump -T "$lib" | grep -v '\*UND\*' | awk '$2 == "g" && $NF != "KVSTAGE_0" {print $NF "@" $(NF-1)}' |
    sort -u > "$tmp/exported"
  sed -n 's/^ \([^ ]*\) .*/\1/p' "$tmp/libkvstage0/DEBIAN/symbols" | grep -v '^KVSTAGE_0@KVSTAGE_0$' |
    sort -u > "$tmp/listed"
  if diff -u "$tmp/listed" "$tmp/exported" > "$tmp/symdiff"; then
    ok "symbols: $(wc -l < "$tmp/exported") kvs_* symbols, version KVSTAGE_0, as exported"
  else
    bad "symbols file and exports differ:"; cat "$tmp/symdiff" >&2
  fi
  leaked=$(objdump -T "$lib" | grep -v '\*UND\*' |
           awk '$2 == "g" && ($NF !~ /^kvs_/ || $(NF-1) != "KVSTAGE_0") && $NF != "KVSTAGE_0"' || true)
  [ -z "$leaked" ] && ok "only kvs_* exported" || bad "exported beyond kvs_*: $leaked"
else
  bad "no DEBIAN/symbols"
fi
grep -q 'activate-noawait ldconfig' "$tmp/libkvstage0/DEBIAN/triggers" 2>/dev/null &&
  ok "ldconfig trigger" || bad "no ldconfig trigger"
pc=$tmp/libkvstage-dev/$libdir/pkgconfig/libkvstage.pc
grep -qx 'prefix=/usr' "$pc" && grep -q "^libdir=\${prefix}/lib/$multiarch" "$pc" &&
  ok "libkvstage.pc: prefix /usr, multiarch libdir" || bad "libkvstage.pc: $(head -3 "$pc" | tr '\n' ' ')"
[ "$(readlink "$tmp/libkvstage-dev/$libdir/libkvstage.so")" = libkvstage.so.0 ] &&
  ok "libkvstage.so -> libkvstage.so.0" || bad "libkvstage.so points elsewhere"

echo "kvstage: unit, conffile, maintainer scripts:" >&2
unit=$tmp/kvstage/lib/systemd/system/kvstaged.service
grep -q '^ExecStart=/usr/bin/kvstaged ' "$unit" && ok "ExecStart=/usr/bin/kvstaged" ||
  bad "ExecStart: $(grep ExecStart= "$unit")"
# Built with libsystemd: kvstaged says READY=1, so the unit waits for it.
grep -qx 'Type=notify' "$unit" && ok "Type=notify" || bad "$(grep '^Type=' "$unit")"
grep -q -E '@[a-z_]+@' "$unit" && bad "unit has an unsubstituted @...@" || ok "unit fully configured"
grep -qx '/etc/kvstage/kvstaged.conf' "$tmp/kvstage/DEBIAN/conffiles" &&
  ok "conffile /etc/kvstage/kvstaged.conf" || bad "conffiles: $(cat "$tmp/kvstage/DEBIAN/conffiles")"
cmp -s "$tmp/kvstage/etc/kvstage/kvstaged.conf" "$tmp/kvstage/usr/share/doc/kvstage/kvstaged.conf.example" &&
  ok "kvstaged.conf is the example" || bad "kvstaged.conf differs from the example"
post=$tmp/kvstage/DEBIAN/postinst
grep -q 'systemd-sysusers .*kvstaged.conf' "$post" && ok "postinst: systemd-sysusers" || bad "postinst: no sysusers"
grep -q 'systemd-tmpfiles .*--create kvstaged.conf' "$post" && ok "postinst: systemd-tmpfiles" || bad "postinst: no tmpfiles"
# The user must exist before tmpfiles chowns /etc/kvstage to its group.
[ "$(grep -n systemd-sysusers "$post" | head -1 | cut -d: -f1)" -lt "$(grep -n systemd-tmpfiles "$post" | head -1 | cut -d: -f1)" ] &&
  ok "postinst: sysusers before tmpfiles" || bad "postinst: tmpfiles runs before sysusers"
grep -q "deb-systemd-helper enable 'kvstaged.service'" "$post" && ok "postinst: enables the unit" || bad "postinst: no enable"
grep -q 'deb-systemd-invoke start' "$post" && bad "postinst starts the unit" || ok "postinst: no start at install"
# An upgrade: no stop before it, a try-restart after it.
grep -qs 'deb-systemd-invoke stop' "$tmp/kvstage/DEBIAN/preinst" && bad "preinst stops the unit before an upgrade" ||
  ok "preinst: no stop before an upgrade"
grep -q "deb-systemd-invoke try-restart 'kvstaged.service'" "$post" && ok "postinst: try-restart on upgrade" ||
  bad "postinst: no try-restart on upgrade"
grep -q 'deb-systemd-invoke stop kvstaged.service' "$tmp/kvstage/DEBIAN/prerm" &&
  ok "prerm: stops at removal" || bad "prerm: no stop"
grep -q 'py3compile -p python3-kvstage' "$tmp/python3-kvstage/DEBIAN/postinst" &&
  ok "python3-kvstage: postinst byte-compiles" || bad "python3-kvstage: no py3compile"
grep -q '^kvstage = kvstage.sglang_plugin:register' "$tmp/python3-kvstage/$py"/kvstage-*.dist-info/entry_points.txt &&
  ok "python3-kvstage: sglang.srt.plugins entry point" || bad "python3-kvstage: no entry point"
grep -qx "Version: $version" "$tmp/python3-kvstage/$py"/kvstage-*.dist-info/METADATA &&
  ok "python3-kvstage: METADATA Version $version" || bad "python3-kvstage: METADATA version differs"

echo "man pages:" >&2
for p in kvstage libkvstage-dev; do
  for m in "$tmp/$p"/usr/share/man/man*/*.gz; do
    warn=$(MANWIDTH=80 man --warnings -l "$m" 2>&1 >/dev/null || echo "man failed")
    [ -z "$warn" ] && ok "$(basename "$m")" || bad "$(basename "$m"): $warn"
  done
done

if [ $fails -ne 0 ]; then
  echo "check-contents: $fails failure(s)" >&2
  exit 1
fi
echo "check-contents: ok" >&2
