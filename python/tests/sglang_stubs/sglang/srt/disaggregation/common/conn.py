"""Stand-in of sglang/srt/disaggregation/common/conn.py @ 8905cbd42f4a, reduced to what kvstage builds on:
KVTransferError, PrefillServerInfo, PrefillRankInfo and CommonKVBootstrapServer (aiohttp; the same routes, JSON,
status codes, readiness rule and room_to_dp_rank expiry). The common manager, sender and receiver (ZMQ) are not here:
kvstage does not use them (python/SGLANG.md says why)."""
import asyncio
import dataclasses
import logging
import os
import threading
import time
from typing import Dict, List, Optional

from aiohttp import web

from sglang.srt.disaggregation.base.conn import BaseKVBootstrapServer

logger = logging.getLogger(__name__)


class KVTransferError(Exception):
    def __init__(self, bootstrap_room: int, failure_reason: str, is_from_another_rank: bool = False):
        super().__init__(failure_reason)
        self.bootstrap_room = bootstrap_room
        self.failure_reason = failure_reason
        self.is_from_another_rank = is_from_another_rank

    def __str__(self):
        return f"KVTransferError(bootstrap_room={self.bootstrap_room}): {self.failure_reason}"


@dataclasses.dataclass
class PrefillServerInfo:
    attn_tp_size: int
    attn_cp_size: int
    dp_size: int
    pp_size: int
    page_size: Optional[int]
    kv_cache_dtype: Optional[str]
    follow_bootstrap_room: bool
    enable_dsa_cache_layer_split: bool = False
    prefill_http_port: Optional[int] = None
    target_tp_rank: Optional[int] = None
    target_tp_ranks: Optional[List[int]] = None
    target_cp_ranks: Optional[List[int]] = None
    target_pp_ranks: Optional[List[int]] = None
    required_dst_info_num: Optional[int] = None
    required_prefill_response_num: Optional[int] = None

    def __post_init__(self):
        for f in ("attn_tp_size", "attn_cp_size", "dp_size", "pp_size"):
            setattr(self, f, int(getattr(self, f)))
        self.page_size = None if self.page_size is None else int(self.page_size)
        self.kv_cache_dtype = None if self.kv_cache_dtype is None else str(self.kv_cache_dtype)
        self.follow_bootstrap_room = bool(self.follow_bootstrap_room)
        self.enable_dsa_cache_layer_split = bool(self.enable_dsa_cache_layer_split)
        self.prefill_http_port = None if self.prefill_http_port is None else int(self.prefill_http_port)


@dataclasses.dataclass
class PrefillRankInfo:
    rank_ip: str
    rank_port: int

    def __post_init__(self):
        self.rank_ip, self.rank_port = str(self.rank_ip), int(self.rank_port)


class CommonKVBootstrapServer(BaseKVBootstrapServer):
    """The prefill server's registry: ranks PUT /route, decode ranks GET /route; /register_dp_rank,
    /query_dp_ranks, /health. Serves from a thread started in the constructor (listening shortly after)."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.app = web.Application()
        self.store = dict()
        self.lock = asyncio.Lock()
        self._setup_routes()
        self.pp_size = self.attn_tp_size = self.attn_cp_size = self.dp_size = None
        self.page_size = None
        self.kv_cache_dtype = None
        self.follow_bootstrap_room = None
        self.enable_dsa_cache_layer_split = None
        self.prefill_http_port = None
        self.prefill_port_table: Dict[int, Dict[int, Dict[int, Dict[int, PrefillRankInfo]]]] = {}
        self.room_to_dp_rank: Dict[int, dict] = {}
        self._registered_count = 0
        self.entry_cleanup_interval = int(os.environ.get("SGLANG_DISAGGREGATION_BOOTSTRAP_ENTRY_CLEANUP_INTERVAL",
                                                         "120"))
        self._loop = None
        self.thread = threading.Thread(target=self._run_server, daemon=True)
        self.run()

    def run(self):
        self.thread.start()

    def _is_ready(self) -> bool:
        if None in (self.attn_tp_size, self.attn_cp_size, self.pp_size, self.dp_size):
            return False
        return self._registered_count >= self.dp_size * self.attn_cp_size * self.attn_tp_size * self.pp_size

    def _setup_routes(self):
        self.app.router.add_route("*", "/route", self._handle_route)
        self.app.router.add_post("/register_dp_rank", self._handle_register_dp_rank)
        self.app.router.add_post("/query_dp_ranks", self._handle_query_dp_ranks)
        self.app.router.add_get("/health", self._handle_health_check)

    async def _handle_health_check(self, request):
        return web.Response(text="OK", status=200)

    async def _handle_route(self, request: web.Request):
        if request.method == "PUT":
            return await self._handle_route_put(request)
        if request.method == "GET":
            return await self._handle_route_get(request)
        return web.Response(text="Method not allowed", status=405, content_type="application/json")

    async def _handle_route_put(self, request: web.Request):
        # As SGLang's: a missing key raises KeyError, which aiohttp answers with 500.
        data = await request.json()
        attn_tp_rank, attn_cp_rank = data["attn_tp_rank"], data["attn_cp_rank"]
        attn_dp_size, attn_dp_rank = data["attn_dp_size"], data["attn_dp_rank"]
        pp_rank = data["pp_rank"]
        system_dp_size, system_dp_rank = data["system_dp_size"], data["system_dp_rank"]
        rank_ip, rank_port = data["rank_ip"], int(data["rank_port"])
        page_size, kv_cache_dtype = int(data["page_size"]), data["kv_cache_dtype"]
        prefill_http_port = data.get("prefill_http_port")
        if self.attn_tp_size is None:
            self.attn_tp_size = data["attn_tp_size"]
        if self.attn_cp_size is None:
            self.attn_cp_size = data["attn_cp_size"]
        if self.dp_size is None:
            self.dp_size = attn_dp_size if system_dp_size == 1 else system_dp_size
        if self.pp_size is None:
            self.pp_size = data["pp_size"]
        if self.page_size is None:
            self.page_size = page_size
        if self.kv_cache_dtype is None and kv_cache_dtype is not None:
            self.kv_cache_dtype = kv_cache_dtype
        if self.prefill_http_port is None and prefill_http_port is not None:
            self.prefill_http_port = int(prefill_http_port)
        if self.follow_bootstrap_room is None:
            method = data.get("load_balance_method", "follow_bootstrap_room")
            self.follow_bootstrap_room = method == "follow_bootstrap_room"
        if self.enable_dsa_cache_layer_split is None:
            self.enable_dsa_cache_layer_split = bool(data.get("enable_dsa_cache_layer_split", False))
        dp_group = attn_dp_rank if system_dp_size == 1 else system_dp_rank
        async with self.lock:
            table = self.prefill_port_table.setdefault(dp_group, {}).setdefault(attn_cp_rank, {})
            table.setdefault(attn_tp_rank, {})[pp_rank] = PrefillRankInfo(rank_ip=rank_ip, rank_port=rank_port)
            self._registered_count += 1
        return web.Response(text="OK", status=200)

    async def _handle_route_get(self, request: web.Request):
        q = [request.query.get(k) for k in ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank",
                                            "target_pp_rank")]
        if not all(q):
            return web.Response(text="Missing inputs for bootstrap server.", status=400)
        dp, cp, tp, pp = (int(x) for x in q)
        if not self._is_ready():
            return web.Response(text=f"Prefill server not fully registered yet"
                                     f" ({self._registered_count} workers registered).", status=503)
        if (dp, cp, tp, pp) == (-1, -1, -1, -1):
            info = PrefillServerInfo(
                attn_tp_size=self.attn_tp_size, attn_cp_size=self.attn_cp_size, dp_size=self.dp_size,
                pp_size=self.pp_size, page_size=self.page_size, kv_cache_dtype=self.kv_cache_dtype,
                follow_bootstrap_room=True if self.follow_bootstrap_room is None else self.follow_bootstrap_room,
                enable_dsa_cache_layer_split=bool(self.enable_dsa_cache_layer_split),
                prefill_http_port=self.prefill_http_port)
            return web.json_response(dataclasses.asdict(info), status=200)
        try:
            async with self.lock:
                rank = self.prefill_port_table[dp][cp][tp][pp]
        except KeyError:
            return web.Response(text=f"Bootstrap info not found for dp_rank={dp} cp_rank={cp} "
                                     f"tp_rank={tp} pp_rank={pp}", status=404)
        return web.json_response(dataclasses.asdict(rank), status=200)

    async def _handle_register_dp_rank(self, request: web.Request):
        data = await request.json()
        room, dp_rank = int(data["bootstrap_room"]), int(data["dp_rank"])
        async with self.lock:
            self.room_to_dp_rank[room] = {"dp_rank": dp_rank, "timestamp": time.time()}
        return web.Response(text="OK", status=200)

    async def _handle_query_dp_ranks(self, request: web.Request):
        data = await request.json()
        out = {}
        async with self.lock:
            for room in data["bootstrap_rooms"]:
                if int(room) in self.room_to_dp_rank:
                    out[str(int(room))] = self.room_to_dp_rank[int(room)]["dp_rank"]
        return web.json_response(out, status=200)

    async def _cleanup_expired_entries(self):
        while True:
            await asyncio.sleep(self.entry_cleanup_interval)
            now = time.time()
            async with self.lock:
                for key in [k for k, v in self.room_to_dp_rank.items()
                            if now - v["timestamp"] > self.entry_cleanup_interval]:
                    del self.room_to_dp_rank[key]

    def _run_server(self):
        try:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            self._loop.create_task(self._cleanup_expired_entries())
            self._runner = web.AppRunner(self.app, access_log=None)
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, host=self.host, port=self.port)
            self._loop.run_until_complete(site.start())
            self._loop.run_forever()
        except Exception as e:
            logger.error(f"Server error: {e}", exc_info=True)
        finally:
            self._loop.run_until_complete(self._runner.cleanup())
            # Not in SGLang's: its loop closes with the cleanup task pending, and Python says so on stderr.
            for task in asyncio.all_tasks(self._loop):
                task.cancel()
            self._loop.run_until_complete(asyncio.sleep(0))
            self._loop.close()

    def close(self):
        if self._loop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self.thread.is_alive():
            self.thread.join(timeout=2)

    def poll(self):
        ...
