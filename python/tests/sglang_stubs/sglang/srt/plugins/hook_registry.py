"""Condensed copy of sglang/srt/plugins/hook_registry.py @ 8905cbd42f4a (SGLang, Apache-2.0): hooks registered
by plugins, applied by apply_hooks() (the target replaced where it is defined and in every module that holds
the original through `from X import Y`)."""
import contextvars
import functools
import pkgutil
import sys
from collections import defaultdict
from enum import Enum
from typing import NamedTuple, Optional


class HookSource(NamedTuple):
    plugin_name: str
    dist_name: Optional[str]


_current_plugin_source = contextvars.ContextVar("_current_plugin_source", default=None)


class HookType(Enum):
    BEFORE = "before"
    AFTER = "after"
    AROUND = "around"
    REPLACE = "replace"


class HookRegistry:
    _hooks = defaultdict(list)
    _patched = set()

    @classmethod
    def register(cls, target, hook, hook_type=HookType.AFTER, *, source=None):
        if isinstance(hook, type) and hook_type != HookType.REPLACE:
            raise TypeError("a class hook must be HookType.REPLACE")
        cls._hooks[target].append((hook_type, hook, source or _current_plugin_source.get()))

    @classmethod
    def apply_hooks(cls):
        for target, hooks in sorted(cls._hooks.items()):
            if target in cls._patched:
                continue
            obj_path, attr = target.rsplit(".", 1)
            obj = pkgutil.resolve_name(obj_path)
            original = getattr(obj, attr)
            wrapped = original
            for hook_type, hook, _ in sorted(hooks, key=lambda h: 0 if h[0] == HookType.REPLACE else 1):
                wrapped = hook if isinstance(hook, type) else _wrap_fn(wrapped, hook, hook_type)
            setattr(obj, attr, wrapped)
            if wrapped is not original:
                for mod in list(sys.modules.values()):
                    if mod is None or mod is obj:
                        continue
                    d = getattr(mod, "__dict__", None) or {}
                    for k, v in list(d.items()):
                        if v is original:
                            setattr(mod, k, wrapped)
            cls._patched.add(target)

    @classmethod
    def reset(cls):
        cls._hooks.clear()
        cls._patched.clear()


def _wrap_fn(original_fn, hook, hook_type):
    if hook_type == HookType.REPLACE:
        def wrapper(*args, **kwargs):
            return hook(*args, **kwargs)
    elif hook_type == HookType.BEFORE:
        def wrapper(*args, **kwargs):
            r = hook(*args, **kwargs)
            if r is not None:
                args, kwargs = r
            return original_fn(*args, **kwargs)
    elif hook_type == HookType.AFTER:
        def wrapper(*args, **kwargs):
            result = original_fn(*args, **kwargs)
            m = hook(result, *args, **kwargs)
            return m if m is not None else result
    elif hook_type == HookType.AROUND:
        def wrapper(*args, **kwargs):
            return hook(original_fn, *args, **kwargs)
    else:
        raise ValueError(f"Unknown hook type: {hook_type}")
    functools.update_wrapper(wrapper, original_fn)
    wrapper.__wrapped__ = original_fn
    return wrapper
