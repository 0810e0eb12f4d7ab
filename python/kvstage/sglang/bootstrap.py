"""kvstage.sglang: the bootstrap server, SGLang's own (disaggregation/common/conn.py), as Mooncake and NIXL use it,
so its routes, health check, dp-rank registry and whatever SGLang adds there serve kvstage too. The prefill rank
registers its side channel's address there; the layout both sides must share travels in the decode side's first
side-channel message and is checked by the prefill rank (KvstageKVSender._adopt)."""
from __future__ import annotations

import socket
import time

from .base import CommonKVBootstrapServer
from .messages import _http, _url_host


class KvstageKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's CommonKVBootstrapServer, unchanged: kvstage's prefill ranks register their side-channel
    address with it (PUT /route) as Mooncake's and NIXL's register theirs."""


def bootstrap_server_on_a_free_port(host="127.0.0.1", tries=5, timeout=10.0):
    """Starts a KvstageKVBootstrapServer on a free port of host and returns it once its /health answers
    (.port is the port). For programs that play SGLang's launcher (python/examples/pd_demo.py, the tests):
    SGLang's server takes a port and listens from a thread it starts, so the port is found first; if another
    process takes it in between, another port is tried."""
    for _ in range(tries):
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        server = KvstageKVBootstrapServer(host, port)
        deadline = time.monotonic() + timeout
        while server.thread.is_alive() and time.monotonic() < deadline:
            if _http("GET", f"http://{_url_host(host)}:{port}/health", timeout=1)[0] == 200:
                server.port = port
                return server
            time.sleep(0.01)  # a server that is starting: poll its readiness
        server.close()
    raise RuntimeError(f"the bootstrap server did not come up on {host} in {tries} tries")
