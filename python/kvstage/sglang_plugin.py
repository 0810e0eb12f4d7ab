"""kvstage as an SGLang general plugin: ``--disaggregation-transfer-backend kvstage`` by installation alone.

SGLang (since the plugin framework, sgl-project/sglang #21388, 2026-04-20) loads, early in every process it
starts (``sglang serve`` / ``launch_server``, ``Engine``, each scheduler process), every entry point of the
group ``sglang.srt.plugins`` (``sglang.srt.plugins.load_plugins``): it calls the loaded callable with no
arguments, then applies the hooks registered with ``HookRegistry``. kvstage's installed metadata
(``kvstage-<version>.dist-info/entry_points.txt``, installed by meson next to the package) declares

    [sglang.srt.plugins]
    kvstage = kvstage.sglang_plugin:register

and ``register()``:
  * adds ``kvstage`` to the CLI choices (``sglang.srt.server_args.add_disagg_transfer_backend_choices``),
  * adds the member ``TransferBackend.KVSTAGE = "kvstage"`` (SGLang converts the option with
    ``TransferBackend(server_args.disaggregation_transfer_backend)``; there is no API to extend the enum),
  * registers an AROUND hook on ``sglang.srt.disaggregation.utils.get_kv_class`` that answers kvstage's
    classes (``kvstage.sglang.kv_class``) for that backend and passes every other one to SGLang's function;
    SGLang applies it, also to the modules that imported the name already.
It imports neither kvstage.sglang nor numpy (that happens at the first lookup), so every SGLang process
can load it cheaply. If ``SGLANG_PLUGINS`` is set (a whitelist of plugin names), it must include
``kvstage``. SGLang without the plugin framework: use ``kvstage.sglang_shim`` (python/SGLANG.md).
"""
import logging

logger = logging.getLogger(__name__)

GROUP = "sglang.srt.plugins"   # SGLang's GENERAL_PLUGINS_GROUP
ENTRY_POINT = "kvstage"
NAME, VALUE = "KVSTAGE", "kvstage"
TARGET = "sglang.srt.disaggregation.utils.get_kv_class"


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


def is_kvstage(backend):
    return getattr(backend, "value", backend) == VALUE


def get_kv_class_hook(original_fn, *args, **kwargs):
    """HookType.AROUND on get_kv_class(transfer_backend, class_type): kvstage's class for the kvstage backend."""
    backend = args[0] if args else kwargs.get("transfer_backend")
    if is_kvstage(backend):
        class_type = args[1] if len(args) > 1 else kwargs.get("class_type")
        from . import sglang as kvstage_sglang
        return kvstage_sglang.kv_class(class_type)
    return original_fn(*args, **kwargs)


def register():
    """The entry point SGLang calls (no arguments); see the module docstring. Idempotent."""
    from sglang.srt import server_args as sa
    from sglang.srt.disaggregation import utils as u
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if VALUE not in sa.DISAGG_TRANSFER_BACKEND_CHOICES:
        sa.add_disagg_transfer_backend_choices([VALUE])
    _add_member(u.TransferBackend, NAME, VALUE)
    if not any(h is get_kv_class_hook for _, h, _ in getattr(HookRegistry, "_hooks", {}).get(TARGET, ())):
        HookRegistry.register(TARGET, get_kv_class_hook, HookType.AROUND)
    logger.info("kvstage: registered the SGLang transfer backend %r", VALUE)
