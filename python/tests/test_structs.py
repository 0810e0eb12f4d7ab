"""The ctypes mirrors against the C compiler's view of include/kvstage.h."""
import ctypes
import shutil
import subprocess

import pytest

import kvstage
from kvstage import _lib
from kvstage.cuda import GatherMode, KVS_CUDA_KERNEL_BELOW

from conftest import ROOT

# (ctypes struct, C type, fields)
STRUCTS = [
    (_lib.kvs_lease, "struct kvs_lease", ["slot", "epoch"]),
    (_lib.kvs_room_desc, "struct kvs_room_desc", ["bytes"]),
    (_lib.kvs_event, "struct kvs_event", ["type", "status", "user_data", "bytes", "lease", "rsvd"]),
]
CONSTANTS = {
    "KVS_ROOM_DESC_SIZE": kvstage.KVS_ROOM_DESC_SIZE,
    "KVS_MAX_READERS": kvstage.KVS_MAX_READERS,
    "KVS_EV_SEND_DONE": kvstage.KVS_EV_SEND_DONE,
    "KVS_EV_RECV_DONE": kvstage.KVS_EV_RECV_DONE,
    "KVS_EV_ABORTED": kvstage.KVS_EV_ABORTED,
    "KVS_EV_FAILED": kvstage.KVS_EV_FAILED,
    "KVS_EV_REJECTED": kvstage.KVS_EV_REJECTED,
    "KVS_CUDA_GATHER_AUTO": GatherMode.AUTO,
    "KVS_CUDA_GATHER_COPY": GatherMode.COPY,
    "KVS_CUDA_GATHER_KERNEL": GatherMode.KERNEL,
    "KVS_CUDA_KERNEL_BELOW": KVS_CUDA_KERNEL_BELOW,
}


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory):
    """Returns {name: value} printed by a C program built against include/ (sizeof, alignof, offsetof, constants)."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        pytest.skip("no C compiler (cc, gcc, clang) on PATH: the struct layouts are not checked against C")
    lines = ['#include <stdio.h>', '#include <stddef.h>', '#include "kvstage.h"', '#include "kvstage_cuda.h"',
             "int main(void) {"]
    for _, ctype, fields in STRUCTS:
        lines.append(f'printf("sizeof {ctype} %zu\\n", sizeof({ctype}));')
        lines.append(f'printf("alignof {ctype} %zu\\n", _Alignof({ctype}));')
        for f in fields:
            lines.append(f'printf("offsetof {ctype}.{f} %zu\\n", offsetof({ctype}, {f}));')
            lines.append(f'printf("sizeof {ctype}.{f} %zu\\n", sizeof((({ctype} *)0)->{f}));')
    for name in CONSTANTS:
        lines.append(f'printf("{name} %lld\\n", (long long){name});')
    lines.append('printf("KVS_VERSION_STRING %s\\n", KVS_VERSION_STRING);')
    lines.append("return 0; }")
    d = tmp_path_factory.mktemp("layout")
    (d / "layout.c").write_text("\n".join(lines) + "\n")
    subprocess.run([cc, "-std=c11", "-Wall", "-Werror", "-I", str(ROOT / "include"), "-o", str(d / "layout"),
                    str(d / "layout.c")], check=True)
    out = subprocess.run([str(d / "layout")], check=True, capture_output=True, text=True).stdout
    return dict(line.rsplit(" ", 1) for line in out.splitlines())


@pytest.mark.parametrize("st,ctype,fields", STRUCTS, ids=[s[1] for s in STRUCTS])
def test_struct_matches_c(c_layout, st, ctype, fields):
    assert [f[0] for f in st._fields_] == fields, "every field, in the C order"
    assert ctypes.sizeof(st) == int(c_layout[f"sizeof {ctype}"])
    assert ctypes.alignment(st) == int(c_layout[f"alignof {ctype}"])
    for f in fields:
        assert getattr(st, f).offset == int(c_layout[f"offsetof {ctype}.{f}"]), f
        assert getattr(st, f).size == int(c_layout[f"sizeof {ctype}.{f}"]), f


def test_constants_match_c(c_layout):
    for name, value in CONSTANTS.items():
        assert int(value) == int(c_layout[name]), name
    assert kvstage.__version__ == c_layout["KVS_VERSION_STRING"], "the library is the one the header describes"


def test_event_types_are_an_intenum():
    assert [e.name for e in kvstage.EventType] == ["SEND_DONE", "RECV_DONE", "ABORTED", "FAILED", "REJECTED"]
    assert kvstage.EventType.RECV_DONE == 2
