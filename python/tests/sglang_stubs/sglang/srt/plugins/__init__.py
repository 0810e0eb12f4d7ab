"""Condensed copy of sglang/srt/plugins/__init__.py @ 8905cbd42f4a (SGLang, Apache-2.0): what SGLang's plugin
loader does, early in every process it starts (launch_server / serve, Engine, each scheduler process).

General plugins are the entry points of the group "sglang.srt.plugins", found with importlib.metadata; each
is ep.load()-ed and called with no arguments (SGLANG_PLUGINS, comma-separated, restricts which by name); then
HookRegistry.apply_hooks() applies the hooks they registered. Once per process."""
import logging
import os
from importlib.metadata import entry_points

from sglang.srt.plugins.hook_registry import HookRegistry, HookSource, _current_plugin_source

logger = logging.getLogger(__name__)

PLATFORM_PLUGINS_GROUP = "sglang.srt.platforms"
GENERAL_PLUGINS_GROUP = "sglang.srt.plugins"
_plugins_loaded = False


def _entry_points(group):
    try:
        return entry_points(group=group)
    except TypeError:  # Python < 3.10
        return entry_points().get(group, [])


def load_plugins_by_group(group, excluded_dists=None):
    allowed = os.environ.get("SGLANG_PLUGINS")  # SGLang: envs.SGLANG_PLUGINS
    allowed_set = {x.strip() for x in allowed.split(",") if x.strip()} if allowed else None
    plugins = {}
    for ep in _entry_points(group):
        if allowed_set is not None and ep.name not in allowed_set:
            continue
        dist = getattr(ep, "dist", None)
        dist_name = dist.name if dist else None
        if excluded_dists and dist_name in excluded_dists:
            continue
        try:
            plugins[ep.name] = (ep.load(), dist_name)
        except Exception:
            logger.exception("Failed to load plugin %s from group %s", ep.name, group)
    return plugins


def load_plugins():
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for name, (func, dist_name) in load_plugins_by_group(GENERAL_PLUGINS_GROUP).items():
        token = _current_plugin_source.set(HookSource(plugin_name=name, dist_name=dist_name))
        try:
            func()
        except Exception:
            logger.exception("Failed to execute general plugin: %s", name)
        finally:
            _current_plugin_source.reset(token)
    HookRegistry.apply_hooks()
