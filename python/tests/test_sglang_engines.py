"""The SGLang backend driven as SGLang's schedulers drive it: a prefill and a decode engine in separate
(spawned) processes, each with its own manager, against one real kvstaged; 40 requests, 16 at a time on the
decode side, chunked sends, KV caches as torch tensors (3 layers, K and V, page_size 4, aux and state);
aborts from either side at every KVPoll state, and engine-side timeouts."""
import multiprocessing as mp

from sglang_common import NEED_TORCH, assert_pool_free, kv_proxy  # noqa: F401 (fixture)

pytestmark = NEED_TORCH

PLANS = [
    ("decode", "Bootstrapping"), ("decode", "WaitingForInput"), ("decode", "Transferring"), ("decode", "mid"),
    ("decode", "Success"),
    ("prefill", "Bootstrapping"), ("prefill", "WaitingForInput"), ("prefill", "Transferring"), ("prefill", "Success"),
    ("timeout", "decode-waiting"), ("timeout", "prefill-bootstrap"), ("timeout", "stall"),
]
N = 40

# plan -> (decode outcome, prefill outcome); None: a normal request
EXPECT = {
    None: ("Success", "Success"),
    ("decode", "Bootstrapping"): ("Failed", "Failed"),       # the prefill side never hears: its bootstrap timeout
    ("decode", "WaitingForInput"): ("Failed", "Failed"),     # told through the side channel
    ("decode", "Transferring"): ("Failed", "Failed"),        # the room is aborted before the prefill side opens it
    ("decode", "mid"): ("Failed", "Failed"),                 # first chunk in flight, the rest held back
    ("decode", "Success"): ("Success+aborted", "Success"),
    ("prefill", "Bootstrapping"): ("Failed", "Failed"),
    ("prefill", "WaitingForInput"): ("Failed", "Failed"),
    ("prefill", "Transferring"): ("Failed", "Failed"),
    ("prefill", "Success"): ("Success", "Success+aborted"),
    ("timeout", "decode-waiting"): ("Failed", "absent"),     # the prefill server never got the request
    ("timeout", "prefill-bootstrap"): ("absent", "Failed"),  # the decode server never got it
    ("timeout", "stall"): ("Failed", "Failed"),              # the prefill forward hangs after one chunk
}


def _run(socket_path, reqs):
    import sglang_engine
    ctx = mp.get_context("spawn")
    flags, acks = ctx.Array("b", len(reqs), lock=False), ctx.Array("b", len(reqs), lock=False)
    pconn, pchild = ctx.Pipe()
    dconn, dchild = ctx.Pipe()
    pre = ctx.Process(target=sglang_engine.prefill_main, args=(pchild, socket_path, reqs, flags, acks, 1200))
    pre.start()
    assert pconn.poll(30), "the prefill engine did not start"
    tag, addr = pconn.recv()
    assert tag == "ready", addr
    dec = ctx.Process(target=sglang_engine.decode_main, args=(dchild, socket_path, reqs, flags, acks, 1200, addr))
    dec.start()
    got = {}
    try:
        for name, conn in (("decode", dconn), ("prefill", pconn)):
            while True:
                assert conn.poll(90), f"the {name} engine gave no result"
                tag, val = conn.recv()
                if tag == "ready":
                    continue
                assert tag == "result", f"the {name} engine failed:\n{val}"
                got[name] = val
                break
    finally:
        for p in (pre, dec):
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
    assert (pre.exitcode, dec.exitcode) == (0, 0)
    return got


def test_engines_with_aborts_and_timeouts(kv_proxy):
    import sglang_engine
    reqs = sglang_engine.make_requests(N, seed=20240611, plans=PLANS)
    got = _run(kv_proxy.socket, reqs)
    (dec, bad_markers, n_marked), pre = got["decode"], got["prefill"]
    problems = []
    for r in reqs:
        k, plan = r["k"], r["plan"]
        want = EXPECT[plan]
        d, p = dec[k], pre[k]
        if (d["outcome"], p["outcome"]) != want:
            problems.append(f"request {k} plan {plan}: decode {d}, prefill {p}; expected {want}")
            continue
        if d["outcome"] in ("Success", "Success+aborted") and d.get("wrong"):
            problems.append(f"request {k} plan {plan}: decode pages wrong: {d['wrong']}")
        timed_out = {("timeout", "decode-waiting"): d, ("timeout", "stall"): d, ("timeout", "prefill-bootstrap"): p,
                     ("decode", "Bootstrapping"): p}.get(plan)
        if timed_out is not None and "timed out" not in timed_out.get("reason", ""):
            problems.append(f"request {k} plan {plan}: not a timeout: {timed_out}")
        states = [s for s in d["states"] if s != "Failed"]
        order = ["Bootstrapping", "WaitingForInput", "Transferring", "Success"]
        if states != sorted(states, key=order.index):
            problems.append(f"request {k}: decode states out of order: {d['states']}")
    assert not problems, "\n".join(problems)
    normal = [r for r in reqs if r["plan"] is None]
    assert len(normal) == N - len(PLANS) and all(dec[r["k"]]["wrong"] is None for r in normal)
    assert n_marked >= 8, n_marked  # every aborted decode request with pages left a marker
    assert bad_markers == [], f"decode pages written after their request's clear(): {bad_markers}"
    s = assert_pool_free(kv_proxy.socket)
    assert s["rooms"]["done"] >= len(normal)
