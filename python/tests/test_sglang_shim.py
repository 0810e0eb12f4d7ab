"""kvstage.sglang_shim against stand-ins of SGLang's modules (SGLang is not installable here): the same module
names and the same objects as sgl-project/sglang main (disaggregation/utils.py: TransferBackend, KVClassType,
get_kv_class as an if/elif that raises for an unknown backend; DISAGG_TRANSFER_BACKEND_CHOICES in
sglang.srt.server_args and sglang.srt.arg_groups.choices), and a launcher run whose spawned child must see the
backend too."""
import argparse
import enum
import importlib
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

pytest.importorskip("numpy", reason="kvstage.sglang needs numpy (Debian: python3-numpy)")

PYDIR = Path(__file__).resolve().parent.parent  # python/, where the kvstage package is


def _standin(monkeypatch):
    """Installs a stand-in sglang module tree into sys.modules (undone at teardown); returns its parts."""
    def mod(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        if "." in name:
            parent, _, leaf = name.rpartition(".")
            setattr(sys.modules[parent], leaf, m)
        else:
            m.__path__ = []
        monkeypatch.setitem(sys.modules, name, m)
        return m

    class TransferBackend(enum.Enum):
        MOONCAKE = "mooncake"
        MORI = "mori"
        NIXL = "nixl"
        ASCEND = "ascend"
        FAKE = "fake"

    class KVClassType(enum.Enum):
        KVARGS = "kvargs"
        MANAGER = "manager"
        SENDER = "sender"
        RECEIVER = "receiver"
        BOOTSTRAP_SERVER = "bootstrap_server"

    class MooncakeKVManager:
        pass

    def get_kv_class(transfer_backend, class_type):
        if transfer_backend == TransferBackend.MOONCAKE:
            return {KVClassType.MANAGER: MooncakeKVManager}.get(class_type)
        elif transfer_backend == TransferBackend.FAKE:
            return None
        raise ValueError(f"Unsupported transfer backend: {transfer_backend}")

    choices = ["mooncake", "nixl", "ascend", "fake", "mori"]
    for name in ("sglang", "sglang.srt", "sglang.srt.disaggregation", "sglang.srt.arg_groups"):
        mod(name)
    utils = mod("sglang.srt.disaggregation.utils", TransferBackend=TransferBackend, KVClassType=KVClassType,
                get_kv_class=get_kv_class)
    mod("sglang.srt.arg_groups.choices", DISAGG_TRANSFER_BACKEND_CHOICES=choices)
    mod("sglang.srt.server_args", DISAGG_TRANSFER_BACKEND_CHOICES=choices)  # re-exported: the same list
    decode = mod("sglang.srt.disaggregation.decode", get_kv_class=get_kv_class)  # `from ..utils import get_kv_class`
    return types.SimpleNamespace(utils=utils, decode=decode, choices=choices, orig=get_kv_class,
                                 TransferBackend=TransferBackend, KVClassType=KVClassType, Mooncake=MooncakeKVManager)


def _fresh_shim(monkeypatch):
    monkeypatch.delitem(sys.modules, "kvstage.sglang_shim", raising=False)
    return importlib.import_module("kvstage.sglang_shim")


def test_shim_registers_the_backend(monkeypatch):
    sg = _standin(monkeypatch)
    from kvstage import sglang as ks
    shim = _fresh_shim(monkeypatch)  # install() runs at import
    assert shim.installed
    TB, KT, u = sg.TransferBackend, sg.KVClassType, sg.utils
    assert TB("kvstage") is TB.KVSTAGE and TB["KVSTAGE"] is TB.KVSTAGE and TB.KVSTAGE.value == "kvstage"
    assert [m.value for m in TB] == ["mooncake", "mori", "nixl", "ascend", "fake", "kvstage"]
    assert TB("mooncake") is TB.MOONCAKE  # the others untouched
    want = {KT.KVARGS: ks.KVArgs, KT.MANAGER: ks.KvstageKVManager, KT.SENDER: ks.KvstageKVSender,
            KT.RECEIVER: ks.KvstageKVReceiver, KT.BOOTSTRAP_SERVER: ks.KvstageKVBootstrapServer}
    for kt, cls in want.items():
        assert u.get_kv_class(TB.KVSTAGE, kt) is cls
        assert sg.decode.get_kv_class(TB("kvstage"), kt) is cls  # a module that imported the name before
    assert u.get_kv_class(TB.MOONCAKE, KT.MANAGER) is sg.Mooncake and u.get_kv_class(TB.FAKE, KT.MANAGER) is None
    with pytest.raises(ValueError, match="Unsupported transfer backend"):
        u.get_kv_class("bogus", KT.MANAGER)
    assert u.get_kv_class.__name__ == "get_kv_class" and u.get_kv_class._kvstage_orig is sg.orig
    # the CLI: the choices list SGLang's parser is built from
    assert sg.choices.count("kvstage") == 1
    p = argparse.ArgumentParser()
    p.add_argument("--disaggregation-transfer-backend",
                   choices=sys.modules["sglang.srt.server_args"].DISAGG_TRANSFER_BACKEND_CHOICES)
    args = p.parse_args(["--disaggregation-transfer-backend", "kvstage"])
    assert TB(args.disaggregation_transfer_backend) is TB.KVSTAGE  # as disagg_service.py resolves it
    # idempotent
    wrapped = u.get_kv_class
    assert shim.install() and u.get_kv_class is wrapped and sg.choices.count("kvstage") == 1
    assert TB._value2member_map_["kvstage"] is TB.KVSTAGE and len(TB) == 6


def test_shim_without_sglang(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # import sglang -> ImportError
    shim = _fresh_shim(monkeypatch)
    assert not shim.installed and shim.install() is False


def test_shim_with_a_tuple_of_choices(monkeypatch):
    sg = _standin(monkeypatch)
    monkeypatch.setattr(sys.modules["sglang.srt.server_args"], "DISAGG_TRANSFER_BACKEND_CHOICES", ("mooncake", "nixl"))
    _fresh_shim(monkeypatch)
    assert sys.modules["sglang.srt.server_args"].DISAGG_TRANSFER_BACKEND_CHOICES == ("mooncake", "nixl", "kvstage")
    assert "kvstage" in sg.choices


FAKE_TREE = {
    "sglang/__init__.py": "",
    "sglang/srt/__init__.py": "",
    "sglang/srt/disaggregation/__init__.py": "",
    "sglang/srt/disaggregation/utils.py": """
        from enum import Enum

        class TransferBackend(Enum):
            MOONCAKE = "mooncake"
            FAKE = "fake"

        class KVClassType(Enum):
            KVARGS = "kvargs"
            MANAGER = "manager"
            SENDER = "sender"
            RECEIVER = "receiver"
            BOOTSTRAP_SERVER = "bootstrap_server"

        def get_kv_class(transfer_backend, class_type):
            raise ValueError(f"Unsupported transfer backend: {transfer_backend}")
    """,
    "sglang/srt/server_args.py": """
        import argparse
        DISAGG_TRANSFER_BACKEND_CHOICES = ["mooncake", "fake"]

        def parse(argv):
            p = argparse.ArgumentParser()
            p.add_argument("--disaggregation-transfer-backend", choices=DISAGG_TRANSFER_BACKEND_CHOICES,
                           default="mooncake")
            return p.parse_args(argv)
    """,
    "sglang/srt/scheduler.py": """
        from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

        def run_scheduler_process(backend, q):
            try:
                cls = get_kv_class(TransferBackend(backend), KVClassType.MANAGER)
                q.put(f"{TransferBackend(backend).name} {cls.__module__}.{cls.__name__}")
            except Exception as e:
                q.put(f"error: {e!r}")
    """,
    "sglang/launch_server.py": """
        import multiprocessing as mp
        import sys
        from sglang.srt.server_args import parse
        from sglang.srt.scheduler import run_scheduler_process

        if __name__ == "__main__":
            args = parse(sys.argv[1:])
            mp.set_start_method("spawn", force=True)  # as SGLang does
            q = mp.Queue()
            p = mp.Process(target=run_scheduler_process, args=(args.disaggregation_transfer_backend, q))
            p.start()
            print("child:", q.get(timeout=60))
            p.join(60)
            print("exit:", p.exitcode)
    """,
}


def _run_launcher(tmp_path, *argv):
    for rel, text in FAKE_TREE.items():
        f = tmp_path / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(textwrap.dedent(text))
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{PYDIR}")
    return subprocess.run([sys.executable, "-m", "kvstage.sglang_shim", *argv], capture_output=True, text=True,
                          env=env, timeout=120, cwd=tmp_path)


def test_launcher_reaches_spawned_children(tmp_path):
    out = _run_launcher(tmp_path, "sglang.launch_server", "--disaggregation-transfer-backend", "kvstage")
    assert out.returncode == 0, out.stderr
    assert "child: KVSTAGE kvstage.sglang.manager.KvstageKVManager" in out.stdout and "exit: 0" in out.stdout, \
        out.stdout


def test_launcher_without_kvstage_is_sglang_unchanged(tmp_path):
    out = _run_launcher(tmp_path, "sglang.launch_server")  # the default backend: SGLang's own lookup answers
    assert out.returncode == 0, out.stderr
    want = "child: error: ValueError('Unsupported transfer backend: TransferBackend.MOONCAKE')"
    assert want in out.stdout, out.stdout


def test_launcher_usage(tmp_path):
    (tmp_path / "tree").mkdir()
    out = _run_launcher(tmp_path / "tree")
    assert out.returncode == 2 and "usage: python -m kvstage.sglang_shim MODULE" in out.stdout
    (tmp_path / "empty").mkdir()
    env = dict(os.environ, PYTHONPATH=str(PYDIR))  # no sglang at all
    out = subprocess.run([sys.executable, "-m", "kvstage.sglang_shim", "sglang.launch_server"], capture_output=True,
                         text=True, env=env, timeout=60, cwd=tmp_path / "empty")
    assert out.returncode == 2 and "SGLang is not importable" in out.stderr
