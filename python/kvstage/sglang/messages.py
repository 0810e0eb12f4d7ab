"""kvstage.sglang: what the decode side tells a prefill rank over the side channel (kvstage.sidechannel) - meta
and abort - checked before anything is read from it; and the bootstrap server's HTTP calls."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

from .._lib import KVS_MAX_READERS
from ..sidechannel import desc_bytes


# Bounds of a side-channel message's numbers: far above any real request, low enough that nothing computed from
# them (room bytes, layout offsets) can overflow or allocate absurdly.
_MAX_ROOM_ID = (1 << 63) - 1
_MAX_PAGES = 1 << 31
_MAX_NBYTES = 1 << 50
_MAX_LIST = 4096


def _is_int(v, lo=0, hi=_MAX_NBYTES):
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _int_list(v, hi=_MAX_NBYTES):
    return isinstance(v, list) and len(v) <= _MAX_LIST and all(_is_int(x, 0, hi) for x in v)


def check_side_message(msg):
    """Returns None if msg is a well-formed side-channel message (decode -> prefill rank), else why not.
    meta: {t, room, npages, aux, state_counts, nbytes, prefix_len, layout, desc, from}; abort: {t, room}.
    Every field is checked for presence, type and range, so nothing downstream can raise on a message."""
    if not isinstance(msg, dict):
        return "not a JSON object"
    if not _is_int(msg.get("room"), 0, _MAX_ROOM_ID):
        return f"room must be an integer in [0, 2^63), not {msg.get('room')!r:.40}"
    t = msg.get("t")
    if t == "abort":
        return None
    if t != "meta":
        return f"unknown message type {t!r:.40}"
    if not _is_int(msg.get("npages"), 0, _MAX_PAGES):
        return f"npages must be an integer in [0, 2^31], not {msg.get('npages')!r:.40}"
    if not isinstance(msg.get("aux"), bool):
        return f"aux must be true or false, not {msg.get('aux')!r:.40}"
    if not _int_list(msg.get("state_counts"), _MAX_PAGES):
        return "state_counts must be a list of integers in [0, 2^31]"
    if not _is_int(msg.get("nbytes")):
        return f"nbytes must be an integer in [0, 2^50], not {msg.get('nbytes')!r:.40}"
    if not _is_int(msg.get("prefix_len", 0), 0, _MAX_PAGES * 1024):
        return f"prefix_len must be a non-negative integer, not {msg.get('prefix_len')!r:.40}"
    lay = msg.get("layout")
    if not isinstance(lay, dict):
        return "layout must be an object"
    if not (_int_list(lay.get("kv_item_lens")) and _int_list(lay.get("aux_item_lens"))):
        return "layout.kv_item_lens and layout.aux_item_lens must be lists of non-negative integers"
    sil = lay.get("state_item_lens")
    if not (isinstance(sil, list) and len(sil) <= _MAX_LIST and all(_int_list(c) for c in sil)):
        return "layout.state_item_lens must be a list of lists of non-negative integers"
    st = lay.get("state_types", [])
    if not (isinstance(st, list) and len(st) <= _MAX_LIST and all(isinstance(x, str) for x in st)):
        return "layout.state_types must be a list of strings"
    if "from" in msg and not isinstance(msg["from"], str):
        return "from must be a string"
    if msg.get("kv_cache_dtype") is not None and not isinstance(msg["kv_cache_dtype"], str):
        return "kv_cache_dtype must be a string or null"
    tp = msg.get("tp")
    if tp is not None:
        if not isinstance(tp, dict):
            return "tp must be an object"
        for key in ("prefill_rank", "prefill_tp", "decode_rank", "decode_tp"):
            if not _is_int(tp.get(key), 0, 1 << 20):
                return f"tp.{key} must be an integer in [0, 2^20], not {tp.get(key)!r:.40}"
        if not (tp["prefill_rank"] < tp["prefill_tp"] and tp["decode_rank"] < tp["decode_tp"]):
            return "tp ranks must be below their TP sizes"
        sl = tp.get("slices")
        if not (isinstance(sl, list) and len(sl) <= _MAX_LIST
                and all(_int_list(x) and len(x) == 2 for x in sl)):
            return "tp.slices must be a list of [offset, length] pairs"
        if not isinstance(tp.get("dummy", False), bool) or not isinstance(tp.get("join", False), bool):
            return "tp.dummy and tp.join must be true or false"
        if not _is_int(tp.get("readers", 1), 1, KVS_MAX_READERS):
            return f"tp.readers must be an integer from 1 to {KVS_MAX_READERS}"
    d = msg.get("desc")
    if d is None:
        if msg["nbytes"]:
            return "desc missing for a room of more than 0 bytes"
    else:
        try:
            desc_bytes(d)
        except ValueError as e:
            return str(e)
    return None


def _decode_rank_of(meta):
    """The decode attention-TP rank a meta message comes from (None: a decode rank that names no rank pair)."""
    tp = meta.get("tp")
    return tp.get("decode_rank") if isinstance(tp, dict) else None


def _http(method, url, body=None, timeout=5.0):
    """Returns (status, parsed JSON or text) of one HTTP request; (None, reason) if it could not be made."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw, status = resp.read(), resp.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    except (OSError, ValueError) as e:
        return None, str(e)
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def _url_host(host):
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
