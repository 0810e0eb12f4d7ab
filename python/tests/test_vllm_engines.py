"""The vLLM connector driven as vLLM drives it: a prefill and a decode engine (tests/vllm_engine.py: scheduler
step loop, then the worker's per-forward calls layer by layer) in two spawned processes, each with its own
connection to one real kvstaged; the test is the router between them (vLLM's disaggregated proxy: prefill with
do_remote_decode, its response's kv_transfer_params to the decode instance). 40 requests, chunked prefill,
3 layers (K and V), block size 4, a block pool that hands freed blocks out again first; aborts from either side
at every stage of a transfer, a decode load timeout, prefill stage timeouts."""
import multiprocessing as mp
import random
import socket
from multiprocessing.connection import wait

from sglang_common import NEED_TORCH, assert_pool_free, kv_proxy  # noqa: F401 (fixture)

pytestmark = NEED_TORCH

PLANS = ["prefix", "prefix", "d-abort-waiting", "d-mid", "d-mid", "d-after", "d-timeout",
         "p-abort-prefill", "p-abort-staging", "never-decoded", "late-pull"]
N = 40

# plan -> (prefill status at request_finished, decode outcome or None: never reaches the decode engine)
EXPECT = {
    None: ("FINISHED_LENGTH_CAPPED", "ok"),
    "prefix": ("FINISHED_LENGTH_CAPPED", "ok"),                 # half the blocks already cached on the decode side
    "d-abort-waiting": ("FINISHED_LENGTH_CAPPED", "aborted"),   # aborted before the decode scheduler allocated
    "d-mid": ("FINISHED_LENGTH_CAPPED", "aborted"),             # aborted with the first chunk in the room
    "d-after": ("FINISHED_LENGTH_CAPPED", "ok+aborted"),        # aborted after the load, while decoding
    "d-timeout": ("FINISHED_LENGTH_CAPPED", "load-failed"),     # the prefill side stalls: the load times out
    "p-abort-prefill": ("FINISHED_ABORTED", None),              # aborted between two prefill chunks
    "p-abort-staging": ("FINISHED_ABORTED", None),              # aborted while its copies into slots wait
    "never-decoded": ("FINISHED_LENGTH_CAPPED", None),          # the router never forwards it: slots expire
    "late-pull": ("FINISHED_LENGTH_CAPPED", "load-failed"),     # forwarded only after its slots expired
}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _recv(conn, name, timeout=60):
    assert conn.poll(timeout), f"the {name} engine went silent"
    msg = conn.recv()
    assert msg[0] != "error", f"the {name} engine failed:\n{msg[1]}"
    return msg


def test_engines_with_aborts_and_timeouts(kv_proxy):
    check(drive(kv_proxy.socket, kv_proxy.socket))


def drive(p_socket, d_socket, extra=None):
    """Runs the N requests with their PLANS, the prefill engine on p_socket's kvstaged and the decode engine on
    d_socket's (extra: more kv_connector_extra_config for both); returns what check() checks."""
    import vllm_engine as E
    rng = random.Random(20250114)
    plans = {k: (PLANS[k] if k < len(PLANS) else None) for k in range(N)}
    sizes = {k: (40 if plans[k] in ("d-mid", "d-timeout", "p-abort-prefill") else rng.randint(5, 40)) for k in range(N)}
    seeds = {k: rng.getrandbits(48) for k in range(N)}
    ctx = mp.get_context("spawn")
    flags, acks = ctx.Array("b", N, lock=False), ctx.Array("b", N, lock=False)
    port = _free_port()
    pconn, pchild = ctx.Pipe()
    dconn, dchild = ctx.Pipe()
    pre = ctx.Process(target=E.prefill_main, args=(pchild, p_socket, port, plans, flags, acks, extra))
    dec = ctx.Process(target=E.decode_main, args=(dchild, d_socket, _free_port(), plans, flags, acks, extra))
    pre.start()
    dec.start()
    try:
        assert _recv(pconn, "prefill")[0] == "ready" and _recv(dconn, "decode")[0] == "ready"
        for k in range(N):
            extra = {"kvstage_stage_timeout": 1.0} if plans[k] in ("never-decoded", "late-pull") else {}
            pconn.send(("add", k, sizes[k], seeds[k], extra))
        prefill_done, expired, results, waiting_expiry = {}, {}, {}, {}
        want_results = {k for k in range(N) if EXPECT[plans[k]][1] is not None}
        while len(prefill_done) < N or set(results) != want_results or len(expired) < 2:
            ready = wait([pconn, dconn], timeout=60)
            assert ready, (f"stuck: prefill done {sorted(prefill_done)}, expired {sorted(expired)}, "
                           f"results {sorted(results)}")
            for conn in ready:
                msg = _recv(conn, "prefill" if conn is pconn else "decode")
                if msg[0] == "finished":
                    _, k, status, params = msg
                    prefill_done[k] = (status, params)
                    if params is None or plans[k] == "never-decoded":
                        continue
                    if plans[k] == "late-pull":
                        waiting_expiry[k] = params
                        if k in expired:
                            dconn.send(("add", k, sizes[k], seeds[k], waiting_expiry.pop(k)))
                        continue
                    dconn.send(("add", k, sizes[k], seeds[k], params))
                elif msg[0] == "expired":
                    expired[msg[1]] = msg[2]
                    if msg[1] in waiting_expiry:
                        dconn.send(("add", msg[1], sizes[msg[1]], seeds[msg[1]], waiting_expiry.pop(msg[1])))
                elif msg[0] == "result":
                    assert msg[1] not in results, f"request {msg[1]} reported twice"
                    results[msg[1]] = msg[2]
        pconn.send(("stop",))
        dconn.send(("stop",))
        psum = _recv(pconn, "prefill", 30)[1]
        dsum = _recv(dconn, "decode", 30)[1]
    finally:
        for p in (pre, dec):
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
    assert (pre.exitcode, dec.exitcode) == (0, 0)
    return dict(plans=plans, prefill_done=prefill_done, results=results, expired=expired, psum=psum, dsum=dsum,
                sockets=(p_socket, d_socket))


def check(run):
    """The outcome of every request as its plan wants it, and every normal one's blocks exact."""
    plans, prefill_done, results, expired = run["plans"], run["prefill_done"], run["results"], run["expired"]
    psum, dsum = run["psum"], run["dsum"]

    problems = []
    for k in range(N):
        want_status, want_outcome = EXPECT[plans[k]]
        status, params = prefill_done[k]
        if status != want_status:
            problems.append(f"request {k} ({plans[k]}): prefill ended {status}, expected {want_status}")
        got = results.get(k)
        if want_outcome is None:
            if got is not None:
                problems.append(f"request {k} ({plans[k]}): reached the decode engine: {got}")
            continue
        if got is None or got["outcome"] != want_outcome:
            problems.append(f"request {k} ({plans[k]}): decode {got}, expected {want_outcome}")
            continue
        if want_outcome.startswith("ok") and got["wrong"] is not None:
            problems.append(f"request {k} ({plans[k]}): decode blocks differ from the prefill's: {got['wrong']}")
    assert not problems, "\n".join(problems)

    normal = [k for k in range(N) if plans[k] in (None, "prefix")]
    assert len(normal) >= 30 and all(results[k]["outcome"] == "ok" and results[k]["wrong"] is None for k in normal)
    # why each special request ended, as the connectors saw it
    why = {k: (results.get(k) or {}).get("why") for k in range(N)}
    assert "timed out" in why[PLANS.index("d-timeout")], why
    late = PLANS.index("late-pull")
    assert "aborted by the prefill side" in why[late] and "expired" in expired[late], (why[late], expired)
    assert "expired" in psum["ended"][f"p{PLANS.index('never-decoded')}"], psum["ended"]
    assert "released" in psum["ended"][f"p{PLANS.index('d-abort-waiting')}"], psum["ended"]
    for k in range(N):  # a decode request aborted during its load got its blocks back by finished_recving
        if plans[k] == "d-mid":
            assert results[k]["how"] == "finished_recving", results[k]
    # prefill blocks: every request that handed off was freed by finished_sending, and at that moment its copy
    # into slots was over (never "staging"); the one aborted while its copies waited was freed only once they
    # were cancelled; the rest at request_finished
    for k in range(N):
        rid = f"p{k}"
        how, (state, _) = psum["staged_at_free"][rid]
        if EXPECT[plans[k]][0] == "FINISHED_LENGTH_CAPPED" or plans[k] == "p-abort-staging":
            assert how == "finished_sending" and state != "staging", (k, plans[k], how, state)
        else:
            assert how == "at-finish", (k, plans[k], how)
    assert psum["gate"] and all(st == "cancelled" for _, _, st in psum["gate"]), psum["gate"]
    # decode blocks of aborted requests: marked when given back, never written after
    assert dsum["n_marked"] >= 3 and dsum["bad_markers"] == [], dsum
    assert psum["double"] == [] and dsum["double"] == [], (psum["double"], dsum["double"])
    assert psum["free_blocks"] == psum["num_blocks"] and dsum["free_blocks"] == dsum["num_blocks"]
    assert_pool_free(run["sockets"][0])
    s = assert_pool_free(run["sockets"][1])  # the decode side's: its rooms
    assert s["rooms"]["done"] >= len(normal)
