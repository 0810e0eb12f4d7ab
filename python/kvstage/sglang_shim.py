"""Makes ``kvstage`` one of SGLang's PD transfer backends, at import time.

SGLang has no plugin registry: its backend lookup is an if/elif in
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

logger = logging.getLogger(__name__)

NAME, VALUE = "KVSTAGE", "kvstage"
_CHOICE_MODULES = ("sglang.srt.server_args", "sglang.srt.arg_groups.choices")
installed = False


def _add_member(enum_cls, name, value):
    """Adds name = value to an Enum class (no public API for it; works on Python 3.8-3.13); returns the member."""
    try:
        return enum_cls(value)
    except ValueError:
        pass
    member_type = getattr(enum_cls, "_member_type_", object)
    member = (object.__new__(enum_cls) if member_type is object else member_type.__new__(enum_cls, value))
    member._name_, member._value_ = name, value
    member.__objclass__ = enum_cls
    try:
        member.__init__(*((value,) if not isinstance(value, tuple) else value))
    except TypeError:
        pass
    if hasattr(next(iter(enum_cls), member), "_sort_order_"):
        member._sort_order_ = len(enum_cls._member_names_)
    add = getattr(enum_cls, "_add_member_", None)  # 3.13
    if add is not None:
        add(name, member)
    else:
        type.__setattr__(enum_cls, name, member)  # past EnumType.__setattr__, which refuses new members
        enum_cls._member_map_[name] = member
        if name not in enum_cls._member_names_:
            enum_cls._member_names_.append(name)
    enum_cls._value2member_map_[value] = member
    return member


def _is_kvstage(backend):
    return getattr(backend, "value", backend) == VALUE


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
        print("usage: python -m kvstage.sglang_shim MODULE [ARGS...]   (e.g. sglang.launch_server --disaggregation-transfer-backend kvstage ...)")
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
