#!/bin/bash
# SPDX-License-Identifier: MIT
#
# check-man.sh BUILD_DIR: keeps the man pages (docs/man/*.scd) honest.
#
#  1. Options: every long option a program's --help prints is documented in
#     its page, and every option the page documents is in --help. An option
#     is documented by a definition line, one that starts with the option in
#     bold at column 0 (`*-s*, *--socket* _PATH_`, then the indented text);
#     a mention elsewhere does not count. Short options must pair with the
#     same long ones in both.
#  2. Functions: every function declared in include/kvstage.h has an entry
#     in kvstage.3.scd (a line at column 0 such as
#     `int *kvs_connect*(const char \*_socket_path_, ...`), and
#     kvstage_cuda.h's in kvstage_cuda.3.scd; every entry names a declared
#     function; and each -ERRNO the header's comment on a function names is
#     in the function's entry.
#  3. Sections: each page has the sections a page of its kind needs.
#  4. Built pages: each page was built into BUILD_DIR/docs (by scdoc, see
#     docs/meson.build), and renders without warnings: man -l (man-db, with
#     groff's warnings on), groff -man -ww, and mandoc -T lint where present.
#
# Exit status: 0 all good; 1 something is missing or wrong (each problem is
# named on a FAIL line); 77 (meson: skipped) when the sources agree but the
# pages could not be built or rendered here (no scdoc, or no renderer).
set -u

if [ $# -lt 1 ] || [ ! -d "$1" ]; then
	echo "usage: $0 BUILD_DIR" >&2
	exit 2
fi
BUILD=$(cd "$1" && pwd)
SRC=$(cd "$(dirname "$0")/.." && pwd)
MAN="$SRC/docs/man"
export LC_ALL=C

fails=0
skips=0
fail() {
	echo "FAIL $*"
	fails=$((fails + 1))
}
ok() { echo "ok   $*"; }
skip() {
	echo "SKIP $*"
	skips=$((skips + 1))
}

# ---------------------------------------------------------------- options

# Long options of a --help text (stdin): the option column of lines that
# start, lightly indented, with a dash ("  -s, --socket PATH", "      --ring N",
# "  -m, --match USER_DATA, -k, --mask MASK"). Deeper lines are descriptions,
# which mention other options ("--proxy-arg=--spin-us=1000").
help_long() {
	grep -E '^ {1,8}-' | grep -oE '(^ +|, )--[A-Za-z0-9][A-Za-z0-9-]*' |
		sed -E 's/^.*(--[A-Za-z0-9-]+)$/\1/' | sort -u
}
# "-s --socket" pairs of a --help text (stdin).
help_pairs() {
	grep -E '^ {1,8}-' | grep -oE '(^ +|, )-[A-Za-z0-9], --[A-Za-z0-9][A-Za-z0-9-]*' |
		sed -E 's/^[ ,]*(-[A-Za-z0-9]), (--[A-Za-z0-9-]+)$/\1 \2/' | sort -u
}

# Definition lines of a page's options, outside literal blocks, as
# "SECTION<TAB>LINE" (SECTION: the "# " header they stand under). A
# definition starts at column 0 with the option in bold and is followed by
# its tab-indented text; a line of prose that happens to start with an
# option is followed by more prose, and is not one.
page_defs() {
	awk '
		function flush() { if (cand != "" && $0 ~ /^\t/) print csec "\t" cand; cand = "" }
		/^```/ { flush(); lit = !lit; next }
		lit { next }
		{ flush() }
		/^# / { sec = substr($0, 3); next }
		/^\*-/ { cand = $0; csec = sec }
	' "$1"
}
# Long options of definition lines (stdin: LINEs).
defs_long() {
	grep -oE '\*--[A-Za-z0-9][A-Za-z0-9-]*\*' | tr -d '*' | sort -u
}
defs_pairs() {
	grep -oE '^\*-[A-Za-z0-9]\*, \*--[A-Za-z0-9][A-Za-z0-9-]*\*' |
		sed -E 's/^\*(-[A-Za-z0-9])\*, \*(--[A-Za-z0-9-]+)\*$/\1 \2/' | sort -u
}

# check_opts WHAT PAGE HELP_FILE DEFS_FILE
check_opts() {
	local what=$1 page=$2 help=$3 defs=$4 missing extra n
	n=$(help_long <"$help" | wc -l)
	if [ "$n" -eq 0 ]; then
		fail "$what: no options found in its --help output (the help format changed?)"
		return
	fi
	missing=$(comm -23 <(help_long <"$help") <(defs_long <"$defs"))
	extra=$(comm -13 <(help_long <"$help") <(defs_long <"$defs"))
	for o in $missing; do
		fail "$what: $o is in --help but not documented in docs/man/$page (want a line '*$o* ...')"
	done
	for o in $extra; do
		fail "$what: $o is documented in docs/man/$page but not in --help (gone, or renamed?)"
	done
	missing=$(comm -23 <(help_pairs <"$help") <(defs_pairs <"$defs"))
	extra=$(comm -13 <(help_pairs <"$help") <(defs_pairs <"$defs"))
	while read -r s l; do
		[ -n "$s" ] && fail "$what: --help pairs $s with $l; docs/man/$page does not ('*$s*, *$l* ...')"
	done <<<"$missing"
	while read -r s l; do
		[ -n "$s" ] && fail "$what: docs/man/$page pairs $s with $l; --help does not"
	done <<<"$extra"
	[ -z "$missing$extra" ] && [ "$(comm -3 <(help_long <"$help") <(defs_long <"$defs") | wc -l)" -eq 0 ] &&
		ok "$what: $n long options, --help and docs/man/$page agree"
}

# help_of WHAT OUT CMD...: CMD's --help output into OUT.
help_of() {
	local what=$1 out=$2
	shift 2
	if [ ! -x "$1" ]; then
		fail "$what: no binary at $1 (build first: ninja -C $BUILD)"
		return 1
	fi
	if ! timeout 20 "$@" >"$out" 2>&1; then
		return 1
	fi
	return 0
}

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# program page binary
progs=(
	"kvstaged kvstaged.8.scd proxy/kvstaged"
	"kvstage-stat kvstage-stat.1.scd tools/kvstage-stat"
	"kvstage-ctl kvstage-ctl.1.scd tools/kvstage-ctl"
	"kvstage-bench kvstage-bench.1.scd tools/bench/kvstage-bench"
)
for p in "${progs[@]}"; do
	read -r prog page bin <<<"$p"
	if [ ! -f "$MAN/$page" ]; then
		fail "$prog: no page docs/man/$page"
		continue
	fi
	page_defs "$MAN/$page" >"$tmp/$prog.defs"
	cut -f2- "$tmp/$prog.defs" >"$tmp/$prog.lines"
	if help_of "$prog" "$tmp/$prog.help" "$BUILD/$bin" --help; then
		check_opts "$prog" "$page" "$tmp/$prog.help" "$tmp/$prog.lines"
	elif [ -x "$BUILD/$bin" ]; then
		fail "$prog: '$prog --help' failed: $(head -c 300 "$tmp/$prog.help")"
	fi
done

# -------------------------------------------------------------- functions

# "NAME<TAB>-EA -EB ..." for each function a header declares: a line at
# column 0 with NAME( on it, outside comments; the errnos are those of the
# comment right above it.
header_funcs() {
	awk '
		function flush_errnos(   s, out) {
			out = ""
			s = acc
			while (match(s, /-E[A-Z0-9]+/)) {
				out = out " " substr(s, RSTART, RLENGTH)
				s = substr(s, RSTART + RLENGTH)
			}
			return out
		}
		incomment {
			acc = acc " " $0
			if ($0 ~ /\*\//) incomment = 0
			next
		}
		/^[ \t]*\/\*/ {
			acc = acc " " $0
			if ($0 !~ /\*\//) incomment = 1
			next
		}
		/^[ \t]*$/ { next }
		/^[A-Za-z_]/ && !/^(typedef|#)/ && match($0, /[ *]kvs_[A-Za-z0-9_]+\(/) {
			name = substr($0, RSTART + 1, RLENGTH - 2)
			print name "\t" flush_errnos()
			acc = ""
			next
		}
		{ acc = "" }
	' "$1"
}

# Function entries of an API page, as "LINENO<TAB>NAME": a line at column 0,
# outside literal blocks, that is a C type and the name in bold, then "(".
ENTRY_RE='^((const|unsigned|signed|struct|enum) )*(void|int|char|size_t|ssize_t|unsigned|long|u?int(8|16|32|64)_t|kvs_[a-z_]+) (\\\*)*\*kvs_[A-Za-z0-9_]+\*\('
page_entries() {
	RE=$ENTRY_RE awk '
		/^```/ { lit = !lit; next }
		lit { next }
		$0 ~ ENVIRON["RE"] {
			match($0, /\*kvs_[A-Za-z0-9_]+\*\(/)
			print NR "\t" substr($0, RSTART + 1, RLENGTH - 3)
		}
	' "$1"
}
# entry_text PAGE NAME: the entry's text, from its line to the next entry or
# section header.
entry_text() {
	RE=$ENTRY_RE awk -v name="$2" '
		/^```/ { lit = !lit }
		!lit && ($0 ~ ENVIRON["RE"] || /^#/) { on = 0 }
		!lit && $0 ~ ENVIRON["RE"] && index($0, "*" name "*(") { on = 1 }
		on { print }
	' "$1"
}

# check_api HEADER PAGE
check_api() {
	local header=$1 page=$2 n missing extra bad=0
	if [ ! -f "$SRC/include/$header" ]; then
		fail "$page: no header include/$header"
		return
	fi
	if [ ! -f "$MAN/$page" ]; then
		fail "$header: no page docs/man/$page"
		return
	fi
	header_funcs "$SRC/include/$header" >"$tmp/$header.funcs"
	page_entries "$MAN/$page" | cut -f2 | sort >"$tmp/$page.entries"
	n=$(wc -l <"$tmp/$header.funcs")
	if [ "$n" -eq 0 ]; then
		fail "$header: no function declarations found (the header's layout changed?)"
		return
	fi
	missing=$(comm -23 <(cut -f1 "$tmp/$header.funcs" | sort -u) <(sort -u "$tmp/$page.entries"))
	extra=$(comm -13 <(cut -f1 "$tmp/$header.funcs" | sort -u) <(sort -u "$tmp/$page.entries"))
	for f in $missing; do
		fail "$page: $f (declared in include/$header) has no entry in docs/man/$page (want a line like 'int *$f*(...);')"
		bad=1
	done
	for f in $extra; do
		fail "$page: documents $f, which include/$header does not declare"
		bad=1
	done
	for f in $(sort "$tmp/$page.entries" | uniq -d); do
		fail "$page: $f has more than one entry"
		bad=1
	done
	while IFS=$'\t' read -r f errs; do
		grep -qx "$f" "$tmp/$page.entries" || continue
		entry_text "$MAN/$page" "$f" >"$tmp/entry"
		for e in $errs; do
			if ! grep -qF -- "$e" "$tmp/entry"; then
				fail "$page: the entry for $f does not name $e, which include/$header gives it"
				bad=1
			fi
		done
	done <"$tmp/$header.funcs"
	[ $bad -eq 0 ] && ok "$page: all $n functions of include/$header documented, with their errnos"
}
check_api kvstage.h kvstage.3.scd
check_api kvstage_cuda.h kvstage_cuda.3.scd

# --------------------------------------------------------------- sections

prog_sections="NAME|SYNOPSIS|DESCRIPTION|OPTIONS|ENVIRONMENT|FILES|EXIT STATUS|EXAMPLES|SEE ALSO"
lib_sections="NAME|SYNOPSIS|DESCRIPTION|RETURN VALUE|ENVIRONMENT|FILES|EXAMPLES|SEE ALSO"
for f in "$MAN"/*.scd; do
	page=$(basename "$f")
	case "$page" in
	*.3.scd) want=$lib_sections ;;
	*) want=$prog_sections ;;
	esac
	bad=0
	IFS='|' read -ra secs <<<"$want"
	for s in "${secs[@]}"; do
		if ! grep -qx "# $s" "$f"; then
			fail "$page: no '# $s' section"
			bad=1
		fi
	done
	[ $bad -eq 0 ] && ok "$page: has every section (${want//|/, })"
done

# ------------------------------------------------------ built and rendered

renderers=()
command -v man >/dev/null 2>&1 && renderers+=(man)
command -v groff >/dev/null 2>&1 && renderers+=(groff)
command -v mandoc >/dev/null 2>&1 && renderers+=(mandoc)
render() { # render TOOL FILE: the rendered text to stdout, warnings to stderr
	case $1 in
	man) MANWIDTH=80 MAN_DISABLE_SECCOMP=1 MANPAGER=cat PAGER=cat man --warnings -l "$2" ;;
	groff) groff -man -Tutf8 -ww -P-cbou "$2" ;;
	mandoc) mandoc -T lint -W warning "$2" >&2 && mandoc -T utf8 "$2" ;;
	esac
}
if command -v locale >/dev/null 2>&1 && locale -a 2>/dev/null | grep -qix 'c.utf-\?8'; then
	export LC_ALL=C.UTF-8
fi

have_scdoc=0
command -v scdoc >/dev/null 2>&1 && have_scdoc=1
for f in "$MAN"/*.scd; do
	page=$(basename "$f" .scd)
	out="$BUILD/docs/$page"
	if [ ! -s "$out" ]; then
		if [ $have_scdoc -eq 0 ]; then
			skip "$page: not built (scdoc not installed: apt install scdoc)"
		else
			fail "$page: not built at $out (is it in docs/meson.build? run ninja -C $BUILD)"
		fi
		continue
	fi
	# What scdoc makes of the source now, but for the date in .TH (meson
	# leaves an unchanged output untouched, so mtimes say nothing).
	if [ $have_scdoc -eq 1 ] &&
		! cmp -s <(scdoc <"$f" 2>&1 | grep -v '^\.TH ') <(grep -v '^\.TH ' "$out"); then
		fail "$page: $out is not what scdoc makes of docs/man/$page.scd now (run ninja -C $BUILD)"
		continue
	fi
	if [ ${#renderers[@]} -eq 0 ]; then
		skip "$page: built, but no man, groff or mandoc here to render it (apt install man-db groff-base)"
		continue
	fi
	bad=0
	for r in "${renderers[@]}"; do
		if ! render "$r" "$out" >"$tmp/out" 2>"$tmp/err"; then
			fail "$page: $r failed: $(head -c 400 "$tmp/err")"
			bad=1
		elif [ -s "$tmp/err" ]; then
			fail "$page: $r warns: $(head -c 400 "$tmp/err")"
			bad=1
		elif ! grep -q 'NAME' "$tmp/out"; then
			fail "$page: $r rendered no NAME section"
			bad=1
		fi
	done
	[ $bad -eq 0 ] && ok "$page: built, renders without warnings (${renderers[*]})"
done

echo
if [ $fails -gt 0 ]; then
	echo "man pages: $fails problem(s); see the FAIL lines above"
	exit 1
fi
if [ $skips -gt 0 ]; then
	echo "man pages: the sources agree with the programs and headers; $skips check(s) skipped"
	exit 77
fi
echo "man pages: all good"
exit 0
