"""kvstage.sglang without SGLang: SGLang's base classes are not copied into kvstage (the test
suite's stand-ins live in python/tests/sglang_stubs); the module still imports, its room layout works, and a
backend class says plainly that it needs SGLang."""
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT

pytest.importorskip("numpy", reason="kvstage.sglang needs numpy (Debian: python3-numpy)")

SCRIPT = textwrap.dedent("""
    import sys
    sys.modules["sglang"] = None  # import sglang -> ImportError, whatever is installed
    import types
    from kvstage import sglang as ks
    assert not ks.HAVE_SGLANG and ks.KVPoll is None
    args = types.SimpleNamespace(kv_data_ptrs=[0x1000], kv_data_lens=[400], kv_item_lens=[100])
    lay = ks.RoomLayout(ks.MemoryMap(args, kv_device=False), 3, False, [])
    assert lay.nbytes == 300 and [e.idx for e in lay.kv_extents([3, 0], 1)] == [(3, 0)]
    for cls in (ks.KvstageKVManager, ks.KvstageKVSender, ks.KvstageKVReceiver, ks.KvstageKVBootstrapServer, ks.KVArgs):
        try:
            cls()
        except ImportError as e:
            assert "needs SGLang" in str(e), e
        else:
            raise AssertionError(f"{cls.__name__}() without SGLang")
    print("ok")
""")


def test_without_sglang_imports_and_refuses_clearly():
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr


def test_no_sglang_stand_ins_in_the_package():
    src = "".join(f.read_text() for f in sorted((ROOT / "python" / "kvstage" / "sglang").glob("*.py")))
    for name in ("class KVPoll", "class BaseKVManager", "class BaseKVSender", "class BaseKVReceiver",
                 "class BaseKVBootstrapServer", "class KVArgs"):
        assert name not in src, name
    stubs = ROOT / "python" / "tests" / "sglang_stubs"
    assert (stubs / "sglang" / "srt" / "disaggregation" / "base" / "conn.py").is_file()
