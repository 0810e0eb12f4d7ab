"""kvstage registers with SGLang through SGLang's plugin mechanism: an entry point in the
group SGLang loads, declared by the kvstage-<version>.dist-info that meson installs next to the package.

The dist-info is built here from python/dist-info/ exactly as python/meson.build installs it (METADATA with the
project's version, entry_points.txt, top_level.txt). The loader is sglang_stubs/sglang/srt/plugins (a condensed
copy of SGLang's; the real one where SGLang is installed): it finds the entry point through importlib.metadata,
calls it, applies the hooks. Each check runs in a fresh interpreter, as each SGLang process loads plugins itself."""
import importlib.metadata
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import REAL_SGLANG, ROOT, SGLANG_STUBS

PYDIR = ROOT / "python"
GROUP = "sglang.srt.plugins"


def project_version():
    """The version in the top meson.build's project() (meson.project_version())."""
    m = re.search(r"project\([^)]*?version\s*:\s*'([^']+)'", (ROOT / "meson.build").read_text(), re.S)
    assert m, "no version in meson.build's project()"
    return m.group(1)


def make_dist_info(site):
    """Writes kvstage-<version>.dist-info into site as python/meson.build installs it; returns its path."""
    d = Path(site) / f"kvstage-{project_version()}.dist-info"
    d.mkdir(parents=True)
    src = PYDIR / "dist-info"
    (d / "METADATA").write_text((src / "METADATA.in").read_text().replace("@VERSION@", project_version()))
    for f in ("entry_points.txt", "top_level.txt"):
        (d / f).write_text((src / f).read_text())
    return d


def test_meson_installs_the_dist_info():
    """python/meson.build installs these very files (a rename there would leave this test building a stale copy)."""
    mb = (PYDIR / "meson.build").read_text()
    for f in ("dist-info/METADATA.in", "dist-info/entry_points.txt", "dist-info/top_level.txt"):
        assert f"'{f}'" in mb and (PYDIR / f).is_file(), f
    assert "kvstage-@0@.dist-info'.format(meson.project_version())" in mb
    assert "'kvstage/sglang_plugin.py'" in mb


def test_entry_point_found_through_importlib_metadata(tmp_path):
    make_dist_info(tmp_path)
    (dist,) = [d for d in importlib.metadata.distributions(path=[str(tmp_path)])]
    assert dist.metadata["Name"] == "kvstage" and dist.version == project_version()
    eps = [ep for ep in dist.entry_points if ep.group == GROUP]
    assert [(ep.name, ep.value) for ep in eps] == [("kvstage", "kvstage.sglang_plugin:register")]
    from kvstage import sglang_plugin
    assert eps[0].load() is sglang_plugin.register


# One SGLang process: a module imported get_kv_class before the plugins were loaded (as scheduler.py does),
# then load_plugins() (launch_server, Engine, run_scheduler_process all call it first), then the CLI and the lookup.
PROCESS = textwrap.dedent("""
    import multiprocessing
    import early_importer  # binds get_kv_class before the plugins are loaded, as SGLang's scheduler module does
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend
    from sglang.srt.plugins import load_plugins

    def resolve(tag):
        load_plugins()
        from sglang.srt.disaggregation import utils
        from sglang.srt.server_args import parse
        try:
            args = parse(["--disaggregation-transfer-backend", "kvstage"])
        except SystemExit:
            print(tag, "cli: refused"); return
        backend = TransferBackend(args.disaggregation_transfer_backend)
        out = {}
        for t in KVClassType:
            c = utils.get_kv_class(backend, t)
            out[t.name] = f"{c.__module__}.{c.__name__}"
        print(tag, "cli: ok", backend.name, out)
        stale = early_importer.get_kv_class(backend, KVClassType.MANAGER)  # bound before load_plugins
        print(tag, "early:", f"{stale.__module__}.{stale.__name__}")
        print(tag, "mooncake:", utils.get_kv_class(TransferBackend.MOONCAKE, KVClassType.SENDER))

    if __name__ == "__main__":
        resolve("main")
        ctx = multiprocessing.get_context("spawn")  # SGLang's scheduler processes
        p = ctx.Process(target=resolve, args=("child",))
        p.start(); p.join()
        print("child exit:", p.exitcode)
""")


def run_process(tmp_path, with_dist_info, **env):
    tmp_path.mkdir(exist_ok=True)
    site = tmp_path / "site"
    site.mkdir()
    if with_dist_info:
        make_dist_info(site)
    script = tmp_path / "sglang_process.py"
    script.write_text(PROCESS)
    (tmp_path / "early_importer.py").write_text("from sglang.srt.disaggregation.utils import get_kv_class\n")
    path = [str(site), str(PYDIR)] + ([] if REAL_SGLANG else [str(SGLANG_STUBS)])
    e = dict(os.environ, PYTHONPATH=os.pathsep.join(path), **env)
    if "SGLANG_PLUGINS" not in env:
        e.pop("SGLANG_PLUGINS", None)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=e, timeout=120,
                         cwd=str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


EXPECTED = ("{'KVARGS': '%s.KVArgs', 'MANAGER': 'kvstage.sglang.manager.KvstageKVManager', "
            "'SENDER': 'kvstage.sglang.sender.KvstageKVSender', "
            "'RECEIVER': 'kvstage.sglang.receiver.KvstageKVReceiver', "
            "'BOOTSTRAP_SERVER': 'kvstage.sglang.bootstrap.KvstageKVBootstrapServer'}"
            % "sglang.srt.disaggregation.base.conn")


def test_installed_entry_point_registers_the_backend_in_every_process(tmp_path):
    out = run_process(tmp_path, True)
    for tag in ("main", "child"):
        assert f"{tag} cli: ok KVSTAGE {EXPECTED}" in out, out
        assert f"{tag} early: kvstage.sglang.manager.KvstageKVManager" in out, out
        assert f"{tag} mooncake: <builtin mooncake sender>" in out or REAL_SGLANG, out
    assert "child exit: 0" in out, out


def test_without_the_dist_info_sglang_refuses_kvstage(tmp_path):
    """What a user without the installed metadata (or with SGLANG_PLUGINS excluding kvstage) sees."""
    assert "main cli: refused" in run_process(tmp_path / "none", False)
    assert "main cli: refused" in run_process(tmp_path / "other", True, SGLANG_PLUGINS="someone_else")
    assert "main cli: ok KVSTAGE" in run_process(tmp_path / "listed", True, SGLANG_PLUGINS="someone_else,kvstage")


def test_register_is_idempotent_and_leaves_other_backends(monkeypatch):
    """register() twice (the shim and the plugin, or two loaders) adds one choice, one member, one hook."""
    if REAL_SGLANG:
        pytest.skip("checks the stand-in SGLang's registry state")
    from sglang.srt import server_args as sa
    from sglang.srt.disaggregation import utils as u
    from sglang.srt.plugins.hook_registry import HookRegistry
    from kvstage import sglang_plugin
    monkeypatch.setattr(sa, "DISAGG_TRANSFER_BACKEND_CHOICES", list(sa.DISAGG_TRANSFER_BACKEND_CHOICES))
    monkeypatch.setattr(HookRegistry, "_hooks", type(HookRegistry._hooks)(list))
    monkeypatch.setattr(HookRegistry, "_patched", set())
    monkeypatch.setattr(u, "get_kv_class", u.get_kv_class)
    sglang_plugin.register()
    sglang_plugin.register()
    assert sa.DISAGG_TRANSFER_BACKEND_CHOICES.count("kvstage") == 1
    assert len(HookRegistry._hooks[sglang_plugin.TARGET]) == 1
    assert u.TransferBackend("kvstage") is u.TransferBackend.KVSTAGE
    HookRegistry.apply_hooks()
    from kvstage import sglang as ks
    assert u.get_kv_class(u.TransferBackend.KVSTAGE, u.KVClassType.RECEIVER) is ks.KvstageKVReceiver
    assert u.get_kv_class(transfer_backend=u.TransferBackend.KVSTAGE,
                          class_type=u.KVClassType.SENDER) is ks.KvstageKVSender
    with pytest.raises(ValueError):
        u.get_kv_class("nonesuch", u.KVClassType.SENDER)
