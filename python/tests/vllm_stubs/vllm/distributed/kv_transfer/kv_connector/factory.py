"""Stand-in (tests only): vllm/distributed/kv_transfer/kv_connector/factory.py @ 9aaf83ef502f - how vLLM loads an
unregistered connector (kv_connector_module_path) and creates it, without the registry of vLLM's own connectors."""
import importlib
import inspect

from vllm.distributed.kv_transfer.kv_connector.v1 import supports_hma


def supports_kw(fn, kw_name):
    """vllm/utils/func_utils.py's supports_kw (allow_var_kwargs=True)."""
    params = inspect.signature(fn).parameters
    if kw_name in params:
        return params[kw_name].kind != inspect.Parameter.POSITIONAL_ONLY
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())


class KVConnectorFactory:
    @classmethod
    def create_connector(cls, config, role, kv_cache_config):
        kv_transfer_config = config.kv_transfer_config
        if kv_transfer_config is None:
            raise ValueError("kv_transfer_config must be set to create a connector")
        connector_cls = cls.get_connector_class(kv_transfer_config)
        hma_enabled = not config.scheduler_config.disable_hybrid_kv_cache_manager
        if hma_enabled and not supports_hma(connector_cls):
            raise ValueError(
                f"Connector {connector_cls.__name__} does not support HMA but "
                f"HMA is enabled. Please set `--disable-hybrid-kv-cache-manager`.")
        return connector_cls(config, role, kv_cache_config)

    @classmethod
    def get_connector_class(cls, kv_transfer_config):
        connector_name = kv_transfer_config.kv_connector
        if connector_name is None:
            raise ValueError("Connector name is not set in KVTransferConfig")
        connector_module_path = kv_transfer_config.kv_connector_module_path
        if connector_module_path is not None and not connector_module_path:
            raise ValueError("kv_connector_module_path cannot be an empty string.")
        if not connector_module_path:
            raise ValueError(f"Unsupported connector type: {connector_name}")
        connector_module = importlib.import_module(connector_module_path)
        try:
            connector_cls = getattr(connector_module, connector_name)
        except AttributeError as e:
            raise AttributeError(f"Class {connector_name} not found in {connector_module_path}") from e
        if not supports_kw(connector_cls, "kv_cache_config"):
            raise ValueError(
                f"Connector {connector_cls.__name__} uses deprecated 2-argument constructor signature. External v1 "
                "KV connectors must accept kv_cache_config as the third constructor argument and pass it to "
                "super().__init__().")
        return connector_cls
