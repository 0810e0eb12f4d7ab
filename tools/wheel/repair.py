#!/usr/bin/python3
"""Makes meson-python's kvstage wheel run on a host without the build's libraries (our auditwheel).

Usage: tools/wheel/repair.py [-q] WHEEL OUTDIR
Writes the repaired wheel into OUTDIR and prints its path (-q: nothing else). It unpacks WHEEL; lists
the shared-library closure (ldd) of every ELF file in it; copies every library that is neither glibc's
own nor libgcc_s into kvstage/_libs/ under its SONAME (the name DT_NEEDED gives); sets RUNPATH
$ORIGIN/../_libs on the programs in kvstage/_bin and $ORIGIN on every library in kvstage/_libs
(patchelf); retags it py3-none-manylinux_2_X_ARCH (this host's ARCH), X from the highest GLIBC_ symbol
version any ELF file in it needs (there are no extension modules: the package loads its libraries
with ctypes, so any CPython 3 will do); puts the vendored libraries' Debian copyright files into the
dist-info's licenses/vendored/ (needs dpkg-query; without it, a line says they are missing); and
rewrites RECORD. Fails, naming the file, if ldd cannot resolve a library. Needs python3 (stdlib), ldd
and patchelf. Libraries a vendored one dlopens at run time (libibverbs' providers, the CUDA driver)
stay the host's: they are not in ldd's list.
"""
import base64
import hashlib
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile

# The host's own: glibc's libraries, its loader and libgcc_s (every manylinux policy allows these).
SYSTEM = {"libc.so.6", "libm.so.6", "libdl.so.2", "librt.so.1", "libpthread.so.0", "libutil.so.1",
          "libresolv.so.2", "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1", "libgcc_s.so.1",
          "linux-vdso.so.1"}
LIBS, BINS = "kvstage/_libs", "kvstage/_bin"
QUIET = False


class RepairError(Exception):
    """Why the wheel cannot be repaired, in words."""


def say(msg):
    """A progress line on stderr (none with -q)."""
    if not QUIET:
        print(f"repair.py: {msg}", file=sys.stderr)


def is_elf(path):
    with open(path, "rb") as f:
        return f.read(4) == b"\x7fELF"


def ldd(path):
    """Returns [(soname, resolved path or None)] for path's whole closure, as the loader would find it
    with no LD_LIBRARY_PATH (RUNPATH, the cache, the default directories)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LD_")}
    r = subprocess.run(["ldd", path], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RepairError(f"ldd {path}: {r.stderr.strip() or r.stdout.strip()}")
    out = []
    for line in r.stdout.splitlines():
        line = line.strip()
        m = re.match(r"(\S+) => (not found|(\S+) \(0x[0-9a-f]+\))$", line)
        if m:
            out.append((m.group(1), m.group(3)))
        elif (m := re.match(r"(\S+) \(0x[0-9a-f]+\)$", line)):
            out.append((os.path.basename(m.group(1)), m.group(1)))
        elif line:
            raise RepairError(f"ldd {path}: a line this script does not read: {line!r}")
    return out


def set_runpath(path, runpath):
    r = subprocess.run(["patchelf", "--set-rpath", runpath, path], capture_output=True, text=True)
    if r.returncode != 0:
        raise RepairError(f"patchelf --set-rpath {runpath} {path}: {r.stderr.strip()}")


def needed_versions(path):
    """Returns {(library, version)} path's symbols need (ELF64 little-endian .gnu.version_r)."""
    with open(path, "rb") as f:
        data = f.read()
    if data[4] != 2 or data[5] != 1:
        raise RepairError(f"{path}: not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    out = set()
    for _name, stype, _fl, _addr, off, _size, link, info, _al, _es in sections:
        if stype != 0x6FFFFFFE:  # SHT_GNU_verneed
            continue
        stroff = sections[link][4]

        def string(at):
            return data[stroff + at:data.index(b"\0", stroff + at)].decode()
        at = off
        for _ in range(info):  # sh_info: the number of Verneed entries
            _ver, cnt, file_, aux, nxt = struct.unpack_from("<HHIII", data, at)
            a = at + aux
            for _ in range(cnt):
                _hash, _flags, _other, name, anext = struct.unpack_from("<IHHII", data, a)
                out.add((string(file_), string(name)))
                a += anext
            at += nxt
    return out


def unpack(whl, root):
    """Extracts whl into root, keeping each file's mode; returns {name: ZipInfo}."""
    infos = {}
    with zipfile.ZipFile(whl) as z:
        for info in z.infolist():
            if info.is_dir():
                continue
            dest = os.path.join(root, info.filename)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with z.open(info) as src, open(dest, "wb") as dst:
                shutil.copyfileobj(src, dst)
            mode = (info.external_attr >> 16) & 0o777
            os.chmod(dest, mode or 0o644)
            infos[info.filename] = info
    return infos


def vendor(root):
    """Copies every non-system library the ELF files need into kvstage/_libs; returns their names."""
    libs = os.path.join(root, LIBS)
    os.makedirs(libs, exist_ok=True)
    for d, runpath in ((BINS, "$ORIGIN/../_libs"), (LIBS, "$ORIGIN")):
        for name in sorted(os.listdir(os.path.join(root, d))):
            if is_elf(os.path.join(root, d, name)):
                set_runpath(os.path.join(root, d, name), runpath)
    vendored = []
    while True:
        elves = [os.path.join(dp, f) for dp, _, fs in os.walk(root) for f in sorted(fs)
                 if is_elf(os.path.join(dp, f))]
        added = False
        for elf in sorted(elves):
            rel = os.path.relpath(elf, root)
            for soname, path in ldd(elf):
                if path is None:
                    raise RepairError(f"{rel} needs {soname}, which ldd does not find here (not found): "
                                      "install it (or its -dev package) where the wheel is built")
                if soname in SYSTEM or os.path.realpath(path).startswith(os.path.realpath(root) + "/"):
                    continue
                dest = os.path.join(libs, soname)
                if os.path.exists(dest):
                    raise RepairError(f"{rel}: {soname} resolves to {path}, not to {LIBS}/{soname}")
                shutil.copyfile(os.path.realpath(path), dest)
                os.chmod(dest, 0o755)
                set_runpath(dest, "$ORIGIN")
                say(f"vendored {soname} ({path}, for {rel})")
                vendored.append((soname, path))
                added = True
        if not added:
            return sorted(vendored), sorted(elves)


def glibc_floor(root, elves):
    """Returns ((major, minor), files): the highest GLIBC_ version any ELF file needs, and which need it."""
    best, who = (2, 5), []  # manylinux's oldest
    for elf in elves:
        for lib, ver in needed_versions(elf):
            m = re.fullmatch(r"GLIBC_(\d+)\.(\d+)(?:\.\d+)?", ver)
            if m and lib in SYSTEM:
                v = (int(m.group(1)), int(m.group(2)))
                if v > best:
                    best, who = v, []
                if v == best and os.path.basename(elf) not in who:
                    who.append(os.path.basename(elf))
    return best, who


def copy_licenses(root, distinfo, sources):
    """Copies the Debian copyright file of each vendored library's package into DIST-INFO/licenses/vendored/
    (their licenses ask for it when they are passed on); returns the packages, or says why none."""
    if not shutil.which("dpkg-query"):
        say("no dpkg-query: the vendored libraries' copyright files are not in the wheel")
        return []
    dest = os.path.join(root, distinfo, "licenses", "vendored")
    pkgs = set()
    for path in sources:
        r = subprocess.run(["dpkg-query", "-S", path], capture_output=True, text=True)
        if r.returncode != 0:  # usrmerge: dpkg knows /usr/lib, ldd says /lib
            r = subprocess.run(["dpkg-query", "-S", "/usr" + path], capture_output=True, text=True)
        pkg = r.stdout.split(":", 1)[0].strip() if r.returncode == 0 else ""
        copyright_file = f"/usr/share/doc/{pkg}/copyright"
        if not pkg or not os.path.isfile(copyright_file):
            raise RepairError(f"no Debian copyright file for {path} (dpkg-query -S: {r.stderr.strip() or pkg})")
        os.makedirs(dest, exist_ok=True)
        shutil.copyfile(copyright_file, os.path.join(dest, f"{pkg}.copyright"))
        pkgs.add(pkg)
    return sorted(pkgs)


def record_line(root, name):
    with open(os.path.join(root, name), "rb") as f:
        data = f.read()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def repack(root, infos, out):
    """Writes root as the wheel out: the package first, dist-info last, RECORD rewritten."""
    distinfo = [d for d in os.listdir(root) if d.endswith(".dist-info")]
    if len(distinfo) != 1:
        raise RepairError(f"the wheel has {len(distinfo)} .dist-info directories, not one")
    record = f"{distinfo[0]}/RECORD"
    names = sorted(os.path.relpath(os.path.join(dp, f), root) for dp, _, fs in os.walk(root) for f in fs)
    names = [n for n in names if n != record]
    names.sort(key=lambda n: (n.startswith(distinfo[0] + "/"), n))
    when = infos[f"{distinfo[0]}/WHEEL"].date_time  # for the files the wheel did not have
    lines = [record_line(root, n) for n in names] + [f"{record},,"]
    with open(os.path.join(root, record), "w") as f:
        f.write("\n".join(lines) + "\n")
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for n in names + [record]:
            info = zipfile.ZipInfo(n, infos[n].date_time if n in infos else when)
            info.external_attr = (0o100000 | os.stat(os.path.join(root, n)).st_mode & 0o777) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            with open(os.path.join(root, n), "rb") as f:
                z.writestr(info, f.read())


def retag(root, tag):
    """Sets the WHEEL file's Tag line (and Root-Is-Purelib: false: there are ELF files)."""
    [distinfo] = [d for d in os.listdir(root) if d.endswith(".dist-info")]
    path = os.path.join(root, distinfo, "WHEEL")
    with open(path) as f:
        lines = [ln for ln in f.read().splitlines() if not ln.startswith(("Tag:", "Root-Is-Purelib:"))]
    with open(path, "w") as f:
        f.write("\n".join(lines + ["Root-Is-Purelib: false", f"Tag: {tag}"]) + "\n")
    return distinfo[:-len(".dist-info")]


def main(argv):
    global QUIET
    args = [a for a in argv if a != "-q"]
    QUIET = len(args) != len(argv)
    if "-h" in args or "--help" in args:
        print(__doc__.strip())
        return 0
    if len(args) != 2:
        print("usage: repair.py [-q] WHEEL OUTDIR (--help: what it does)", file=sys.stderr)
        return 2
    whl, outdir = args
    for tool in ("ldd", "patchelf"):
        if not shutil.which(tool):
            raise RepairError(f"no {tool} on PATH (Debian: apt-get install {'libc-bin' if tool == 'ldd' else tool})")
    with tempfile.TemporaryDirectory(prefix="kvstage-repair.") as tmp:
        root = os.path.join(tmp, "w")
        infos = unpack(whl, root)
        if not os.path.isdir(os.path.join(root, BINS)):
            raise RepairError(f"{whl} has no {BINS}: not a -Dwheel=true build")
        vendored, elves = vendor(root)
        (major, minor), who = glibc_floor(root, elves)
        tag = f"py3-none-manylinux_{major}_{minor}_{os.uname().machine}"
        say(f"{len(vendored)} libraries vendored: {' '.join(n for n, _ in vendored)}")
        by = ", ".join(who[:3]) + (f" and {len(who) - 3} more" if len(who) > 3 else "")
        say(f"highest GLIBC_ version needed: {major}.{minor} (by {by}): tag {tag}")
        basename = retag(root, tag)
        pkgs = copy_licenses(root, basename + ".dist-info", [p for _, p in vendored])
        if pkgs:
            say(f"copyright files of {len(pkgs)} Debian packages in {basename}.dist-info/licenses/vendored")
        os.makedirs(outdir, exist_ok=True)
        out = os.path.join(outdir, f"{basename}-{tag}.whl")
        repack(root, infos, out)
    print(out)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except (RepairError, zipfile.BadZipFile, OSError) as e:
        print(f"repair.py: {e}", file=sys.stderr)
        sys.exit(1)
