"""Makes ``kvstage`` one of SGLang's PD transfer backends, at import time: the fallback for SGLang without
the plugin framework.

SGLang since the plugin framework (sgl-project/sglang #21388, commit 7ca356613, 2026-04-20) loads kvstage
by itself: the installed ``kvstage-<version>.dist-info`` declares the entry point ``kvstage =
kvstage.sglang_plugin:register`` in the group ``sglang.srt.plugins`` (see ``kvstage.sglang_plugin``); no
shim, no launcher. This module is for older SGLang (or kvstage used from a source tree, without the
installed metadata); with a plugin-capable SGLang it still works (both paths answer the same classes).

Older SGLang has no plugin registry: its backend lookup is an if/elif in
``sglang/srt/disaggregation/utils.py`` (``TransferBackend`` enum, ``get_kv_class``), and the CLI
choices are the list ``DISAGG_TRANSFER_BACKEND_CHOICES`` (``sglang.srt.server_args``, or
``sglang.srt.arg_groups.choices`` in newer trees). Importing this module, when SGLang is
importable:
  * adds the member ``TransferBackend.KVSTAGE = "kvstage"`` (so ``TransferBackend("kvstage")`` works),
  * wraps ``get_kv_class`` so that backend maps to ``kvstage.sglang``'s classes (every other backend
    goes to SGLang's own function), also in SGLang modules that already imported the name,
  * appends ``"kvstage"`` to the CLI choices list (in place, so parsers built later accept it).
Without SGLang it does nothing (``installed`` is False). It is idempotent.

SGLang starts its schedulers with multiprocessing "spawn": a child re-imports only the parent's
``__main__``. So either import this module at the top of your own launcher script, or launch
through it (it stays ``__main__``, so every spawned child runs it again):

    python -m kvstage.sglang_shim sglang.launch_server --disaggregation-transfer-backend kvstage ...
"""
import functools
import logging
import sys

# The plugin's names and its enum member (no side effects at import: the plugin registers only when called).
from .sglang_plugin import NAME, VALUE, _add_member  # noqa: F401 - NAME, VALUE re-exported
from .sglang_plugin import is_kvstage as _is_kvstage

logger = logging.getLogger(__name__)

_CHOICE_MODULES = ("sglang.srt.server_args", "sglang.srt.arg_groups.choices")
installed = False


def install():
    """Registers the backend with an importable SGLang; returns True if SGLang is there (and now knows kvstage)."""
    global installed
    try:
        import sglang.srt.disaggregation.utils as u
    except Exception as e:  # no SGLang (or a broken one): nothing to patch
        logger.debug("kvstage.sglang_shim: SGLang not importable (%s)", e)
        return False
    _add_member(u.TransferBackend, NAME, VALUE)
    orig = u.get_kv_class
    if not getattr(orig, "_kvstage", False):
        @functools.wraps(orig)
        def get_kv_class(transfer_backend, class_type, *args, **kwargs):
            if _is_kvstage(transfer_backend):
                from . import sglang as backend
                return backend.kv_class(class_type)
            return orig(transfer_backend, class_type, *args, **kwargs)

        get_kv_class._kvstage = True
        get_kv_class._kvstage_orig = orig
        for mod in list(sys.modules.values()):  # modules that did `from ...utils import get_kv_class` already
            if getattr(mod, "__name__", "").startswith("sglang") and getattr(mod, "get_kv_class", None) is orig:
                mod.get_kv_class = get_kv_class
        u.get_kv_class = get_kv_class
    for name in _CHOICE_MODULES:
        try:
            mod = __import__(name, fromlist=["_"])
        except Exception:
            continue
        choices = getattr(mod, "DISAGG_TRANSFER_BACKEND_CHOICES", None)
        if isinstance(choices, list):
            if VALUE not in choices:
                choices.append(VALUE)
        elif isinstance(choices, tuple) and VALUE not in choices:
            mod.DISAGG_TRANSFER_BACKEND_CHOICES = choices + (VALUE,)
    installed = True
    return True


install()


def main(argv=None):
    """python -m kvstage.sglang_shim MODULE [ARGS...]: runs MODULE as __main__ with kvstage registered."""
    import runpy
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip().splitlines()[0])
        print("usage: python -m kvstage.sglang_shim MODULE [ARGS...]   "
              "(e.g. sglang.launch_server --disaggregation-transfer-backend kvstage ...)")
        return 0 if argv else 2
    if not installed:
        print("kvstage.sglang_shim: SGLang is not importable here", file=sys.stderr)
        return 2
    mod = argv[0]
    sys.argv = [mod] + argv[1:]
    # alter_sys=False keeps this module as sys.modules["__main__"], so spawn children re-import it (and install()).
    runpy.run_module(mod, run_name="__main__", alter_sys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
