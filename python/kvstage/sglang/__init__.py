"""SGLang PD-disaggregation transfer backend over kvstage (``--disaggregation-transfer-backend kvstage``).

SGLang's interface, mirrored name for name and signature for signature, as read from
sgl-project/sglang main (the stored copies this was written against):
  python/sglang/srt/disaggregation/base/conn.py    @ 0094505da74125a31ceb354f37ae7a1b6a97d3f5
      KVArgs, KVPoll, KVTransferMetric, BaseKVManager, BaseKVSender, BaseKVReceiver, BaseKVBootstrapServer
  python/sglang/srt/disaggregation/utils.py        @ 0094505da74125a31ceb354f37ae7a1b6a97d3f5
      TransferBackend, KVClassType, get_kv_class (the if/elif the shim wraps), DisaggregationMode
  python/sglang/srt/disaggregation/common/conn.py  @ 8905cbd42f4a
      CommonKVBootstrapServer (kvstage's bootstrap server is SGLang's own), PrefillServerInfo,
      KVTransferError, and CommonKVManager's register_to_bootstrap payload, try_ensure_parallel_info
      and submit_prefill_recompute (the manager itself is not subclassed: its constructor binds a
      ZMQ socket and registers that as the rank's address; kvstage's side channel is its own)
  python/sglang/srt/disaggregation/decode.py, prefill.py: stored copies whose commit the index did not name
      (same period: init(prefill_dp_rank) + send_metadata; that decode.py also passes send_metadata a
      spec_metadata= keyword, hence **_kw) - how the scheduler drives the classes: DecodePreallocQueue,
      DecodeTransferQueue (it frees decode pages on Failed, then calls clear()), PrefillBootstrapQueue
  python/sglang/srt/disaggregation/nixl/conn.py    @ 007ba532d3bee198c0fc40572df051fe423abac3 (a real backend's shape)

How it moves bytes. The decode side opens one kvstage room per request (recv_open) when SGLang
calls send_metadata, and sends the room's descriptor (128 bytes) to the prefill rank over a small
TCP side channel (kvstage.sidechannel: mutual handshake and per-message MACs keyed by the peer
secret); the prefill rank's address comes from the bootstrap server, which speaks SGLang's own
HTTP routes. The prefill side copies its pages into leased slots (kvstage.plan plans the copies)
and sends each slot once it is full; the proxy moves the slots; the decode side, on RECV_DONE,
copies them into its own pages and only then reports Success. Neither the proxy nor the side
channel ever learns an engine page address or index: only the two managers, each about its own
memory.

Room layout (both sides compute it from the same numbers: page count, item lengths, whether
there is aux, the state item counts):
    for each KV buffer b, in kv_data_ptrs order:   npages * kv_item_lens[b] bytes; the request's
                                                   j-th page at j * kv_item_lens[b]
    for each aux buffer a, in aux_data_ptrs order:  aux_item_lens[a] bytes (the aux_index row)
    for each state component c, each tensor t:      n_c * state_item_lens[c][t] bytes; the k-th
                                                   state index's item at k * item_len
Chunk i of the room is slot i (slot_size bytes; the last one the rest).

Abort and page release. The only writer of a decode page is this package's copy-out, and it
runs only for a RECV_DONE of a request that is not aborted; a queued copy-out is cancelled by
the abort. So:
  * abort() (or a timeout, or the prefill aborting) makes poll() say Failed at once; nothing
    writes the request's decode pages after poll() has said Failed (SGLang frees them there).
  * clear() returns once the room's final event (ABORTED, or a RECV_DONE that raced the abort,
    or FAILED) has come and no copy-out of it can run; then .pages_released is True and the
    room's slots are back in the pool. An engine that wants the strict rule frees the pages
    only then. clear() waits at most clear_timeout seconds (then logs, keeps tracking the room
    in the background; pages_released stays False).
The transport itself (local hand-off, tcp between proxies) only ever writes slots; a slot still
touched by a transport after its room ended is a tombstone in the proxy and never reaches an
engine (kvstage's own guarantee, README.md).

Memory. KV and state pages in host memory are copied by the CPU (kvstage.plan.CpuCopier), one
copy per run of contiguous pages. KV on a CUDA device needs libkvstage_cuda (kvstage.cuda) and is
refused with a clear error unless KVSTAGE_SGLANG_CUDA=1: that path is written but has never run
on a GPU. There (kvstage.plan.CudaCopier, on its stream) the pages of one buffer (KV buffer or
state tensor) that lie in one slot are one gather_idx (decode: scatter_idx) of the whole pages plus
a plain copy for each part of a page a slot boundary cuts, or one plain copy per run of contiguous
pages, whichever takes fewer calls (on a tie the plain copies: kvstage.plan says why). Aux
(SGLang's MetadataBuffers) is always host memory.

Topologies. DP attention on either side: the decode side's prefill_dp_rank (SGLang's scheduler picks it: the
bootstrap room modulo the DP size, or the bootstrap server's /query_dp_ranks after the prefill sender's
/register_dp_rank) selects the prefill ranks the bootstrap server registered for that DP rank. Attention-TP
sizes that differ by a power of two (SGLang's CommonKVManager._resolve_rank_mapping for which ranks pair up,
Mooncake's send_kvcache_slice for which heads each pair moves): one room per rank pair, carrying that pair's
heads of every token (MLA: the whole token, from one prefill rank; the others are SGLang's dummy ranks; with
the decode side wider, the decode ranks of a prefill rank read one shared room, the joiners getting its
descriptor through the prefill rank in a room of one descriptor each; KVSTAGE_SGLANG_MLA_SHARED=0: a room
per decode rank instead, as Mooncake sends). A
decode rank succeeds only once every room it has has landed; a failure of any fails the request on that rank,
which aborts all its rooms. The prefill rank checks each share (rank, head range, layer count, dtype, layout)
before it opens the room and refuses a misrouted one, naming what differs.

Not supported (refused with a reason, never silently wrong): attention-TP sizes that are not a power of two
apart, GQA replication on a wider prefill side (more prefill ranks than KV heads), state (mamba) between
different attention-TP sizes, prefill pipeline parallelism or context parallelism, layouts that differ
between the two sides (item lengths), decode-context parallelism (dcp_size > 1).

Settings (environment): KVSTAGE_SOCKET (the proxy; default /run/kvstage/kvstaged.sock),
KVSTAGE_SGLANG_HOST (the address the prefill rank's side channel binds and advertises),
KVSTAGE_PEER_SECRET_FILE or KVSTAGE_PEER_SECRET (the deployment's peer secret: the side channel, kvstage.sidechannel,
authenticates both ends and every message with it; without one the manager refuses to start),
KVSTAGE_SGLANG_CUDA=1, KVSTAGE_SGLANG_CLEAR_TIMEOUT (s, default 10), KVSTAGE_SGLANG_MLA_SHARED=0, and SGLang's own
SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT / SGLANG_DISAGGREGATION_WAITING_TIMEOUT (s, default 300).
See python/SGLANG.md.

Where each part lives: base.py (SGLang's classes, or stand-ins without SGLang), layout.py (MemoryMap, RoomLayout),
topology.py (rank pairs and head slices), messages.py (the side channel's messages, the bootstrap server's HTTP),
bootstrap.py (the bootstrap server), manager.py (KvstageKVManager), sender.py (prefill), receiver.py (decode).
"""
from __future__ import annotations

from ..client import EventType
from ..errors import KvstageError
from .base import (BaseKVBootstrapServer, BaseKVManager, BaseKVReceiver, BaseKVSender, DisaggregationMode, HAVE_SGLANG,
                   KVArgs, KVPoll, KVTransferError, KVTransferMetric, PrefillServerInfo)
from .bootstrap import KvstageKVBootstrapServer, bootstrap_server_on_a_free_port
from .layout import MemoryMap, RoomLayout, state_counts_of
from .manager import KvstageKVManager
from .messages import _http, check_side_message
from .receiver import KvstageKVReceiver
from .sender import KvstageKVSender
from .topology import decode_slices, head_slice, rank_mapping, tp_sizes_unsupported

# For the shim: SGLang's KVClassType -> our classes.
CLASSES = {
    "KVARGS": KVArgs,
    "MANAGER": KvstageKVManager,
    "SENDER": KvstageKVSender,
    "RECEIVER": KvstageKVReceiver,
    "BOOTSTRAP_SERVER": KvstageKVBootstrapServer,
}


def kv_class(class_type):
    """Returns the class for an SGLang KVClassType (member or its name/value), or None (as SGLang's mapping.get)."""
    name = getattr(class_type, "name", None) or str(class_type).upper()
    return CLASSES.get(name)


__all__ = ["KvstageKVManager", "KvstageKVSender", "KvstageKVReceiver", "KvstageKVBootstrapServer",
           "bootstrap_server_on_a_free_port", "KVArgs", "KVPoll", "KVTransferError", "KVTransferMetric",
           "PrefillServerInfo", "RoomLayout", "MemoryMap", "kv_class", "HAVE_SGLANG", "DisaggregationMode"]
