"""Puts the test stand-ins of vllm and prometheus_client (this folder) on sys.path where the real package is
not importable (vLLM is not installable on the development machine). Import this before kvstage.vllm."""
import importlib.util
import os
import sys

STUBS = os.path.dirname(os.path.abspath(__file__))


def install():
    """Returns True if the vllm stand-in is in use."""
    use = importlib.util.find_spec("vllm") is None
    if use and STUBS not in sys.path:
        sys.path.append(STUBS)
    prom = os.path.join(STUBS, "prom")
    if importlib.util.find_spec("prometheus_client") is None and prom not in sys.path:
        sys.path.append(prom)
    return use


STAND_IN = install()
