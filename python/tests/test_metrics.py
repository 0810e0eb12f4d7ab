"""kvstaged --metrics-listen: the page against promtool, and a real Prometheus server scraping a proxy."""
import http.client
import json
import os
import re
import select
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

import kvstage
from conftest import SLOT_SIZE, Proxy, next_event

PROMTOOL, PROMETHEUS = shutil.which("promtool"), shutil.which("prometheus")
need_prometheus = pytest.mark.skipif(
    not (PROMTOOL and PROMETHEUS),
    reason="Debian's prometheus package (promtool, prometheus) is not installed: tools/setup.sh installs it")


def metrics_url(px):
    """Returns the URL kvstaged logged for its metrics page."""
    m = re.search(r"metrics: serving (http://\S+/metrics)", px.log_text())
    assert m, "kvstaged did not log where it serves metrics"
    return m.group(1)


def scrape(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return r.read().decode()


def samples(page):
    """Returns {'name{labels}': float} of every sample line."""
    out = {}
    for line in page.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def workload(px, rooms, aborts, chunks=3):
    """Moves rooms rooms of chunks chunks each, then aborts aborts rooms after one chunk."""
    with kvstage.Client(px.socket) as tx, kvstage.Client(px.socket) as rx:
        for k in range(rooms + aborts):
            rroom, desc = rx.recv_open(chunks * SLOT_SIZE, user_data=k)
            sroom = tx.send_open(desc)
            for i, lease in enumerate(tx.acquire(1 if k >= rooms else chunks)):
                lease.view()[:8] = k.to_bytes(8, "little")
                sroom.send(lease, i * SLOT_SIZE, SLOT_SIZE)
            if k >= rooms:
                sroom.abort()
            sev, rev = next_event(tx), next_event(rx)
            assert {sev.type, rev.type} <= {kvstage.EventType.SEND_DONE, kvstage.EventType.RECV_DONE,
                                            kvstage.EventType.ABORTED}
            rroom.close()
            sroom.close()


def clients_gone(url):
    """The page, once the proxy has seen every client leave: a closed client's goodbye reaches it after
    kvs_close has returned."""
    deadline = time.monotonic() + 10
    while (s := samples(scrape(url)))["kvstage_clients"] != 0:
        assert time.monotonic() < deadline, "the clients never left"
        time.sleep(0.01)
    return s


@pytest.fixture
def mproxy(request):
    px = Proxy(["--metrics-listen", "0"])
    request.node._kvstaged = px
    yield px
    assert px.stop() == 0
    shutil.rmtree(px.dir, ignore_errors=True)


def test_page_counts_a_known_workload(mproxy):
    workload(mproxy, rooms=5, aborts=2)
    s = clients_gone(metrics_url(mproxy))
    assert s["kvstage_rooms_done_total"] == 5
    assert s["kvstage_rooms_aborted_total"] == 2
    assert s["kvstage_chunks_moved_total"] == 5 * 3 + 2  # an aborted room's first chunk landed too
    assert s["kvstage_bytes_moved_total"] == (5 * 3 + 2) * SLOT_SIZE
    assert s["kvstage_room_duration_seconds_count"] == 5
    assert s['kvstage_room_duration_seconds_bucket{le="+Inf"}'] == 5
    assert s["kvstage_chunk_latency_seconds_count"] == 5 * 3 + 2
    assert s["kvstage_clients"] == 0 and s["kvstage_clients_attached_total"] == 2
    assert s['kvstage_slots{state="free"}'] == s["kvstage_pool_slots"] == 64
    assert s["kvstage_rooms_open"] == 0
    buckets = [v for k, v in s.items() if k.startswith("kvstage_room_duration_seconds_bucket")]
    assert buckets == sorted(buckets)  # cumulative


@need_prometheus
def test_promtool_accepts_the_page(mproxy):
    workload(mproxy, rooms=2, aborts=1)
    page = scrape(metrics_url(mproxy))
    r = subprocess.run([PROMTOOL, "check", "metrics"], input=page, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), r.stdout + r.stderr


def test_only_get_of_metrics(mproxy):
    url = metrics_url(mproxy)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(url.replace("/metrics", "/nothing"), timeout=10)
    assert e.value.code == 404
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(urllib.request.Request(url, data=b"x" * 100000, method="POST"), timeout=10)
    assert e.value.code == 405 and e.value.headers["Allow"] == "GET, HEAD"
    # A hostile client: junk, then half a request left hanging. The page is still served.
    u = urllib.parse.urlsplit(url)
    with socket.create_connection((u.hostname, u.port)) as s:
        s.sendall(b"\x00\xff garbage\r\n\r\n")
        got = s.recv(4096)
        assert got == b"" or got.startswith(b"HTTP/1.1 400")  # libmicrohttpd hangs up, or says 400
    hanging = socket.create_connection((u.hostname, u.port))
    hanging.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
    assert "kvstage_rooms_done_total 0" in scrape(url)
    hanging.close()


def test_connections_past_the_limit_are_refused_and_the_proxy_still_works(mproxy):
    u = urllib.parse.urlsplit(metrics_url(mproxy))
    idle = [socket.create_connection((u.hostname, u.port)) for _ in range(8)]  # the per-address limit
    extra = socket.create_connection((u.hostname, u.port))
    extra.settimeout(10)
    extra.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
    try:
        assert extra.recv(4096) == b""  # closed without an answer...
    except ConnectionResetError:
        pass  # ...or reset
    extra.close()
    for _ in range(200):  # a flood of them is not a flood of log lines
        with socket.create_connection((u.hostname, u.port)):
            pass
    workload(mproxy, rooms=1, aborts=0)  # the loop never waited on the server
    for s in idle:
        s.close()
    # libmicrohttpd frees their places once its thread has seen them close, which nothing here can wait on
    # but a retry: until then a new connection is refused as above.
    deadline, page = time.monotonic() + 10, None
    while page is None:
        try:
            page = scrape(metrics_url(mproxy))
        except (ConnectionError, http.client.HTTPException, urllib.error.URLError):
            assert time.monotonic() < deadline, "the closed connections' places never came back"
    s = samples(page)
    assert s["kvstage_rooms_done_total"] == 1
    assert mproxy.log_text().count("connection limit") <= 10


def test_trickling_requests_are_cut_at_their_deadline_and_a_full_server_refuses_at_once(mproxy):
    """Eight connections from each of two addresses trickle a request a byte a second: they fill the
    server, and a scrape meanwhile is refused at once, never left to wait for its timeout. Each trickler
    is cut before its request is whole: a deadline for the request, which no byte renews (an idle
    timeout would let them trickle for ever). Then scrapes work again."""
    u = urllib.parse.urlsplit(metrics_url(mproxy))
    request = b"GET /metrics HTTP/1.1\r\nHost: kvstage\r\n\r\n"
    slow = [socket.create_connection((u.hostname, u.port), source_address=(src, 0))
            for src in ("127.0.0.1", "127.0.0.2") for _ in range(8)]
    for s in slow:
        s.sendall(request[:1])
    extra = socket.create_connection((u.hostname, u.port), source_address=("127.0.0.3", 0))
    extra.settimeout(20)  # a failure guard: the answer is the close, at once
    extra.sendall(request)
    try:
        assert extra.recv(4096) == b"", "a scrape past the limit was served"
    except ConnectionResetError:
        pass
    extra.close()
    cut = set()
    for sent in range(1, len(request)):  # a byte a second: the attack's own pace
        readable, _, _ = select.select([s for s in slow if s not in cut], [], [], 1.0)
        for s in readable:
            try:
                if s.recv(4096) == b"":
                    cut.add(s)
            except ConnectionResetError:
                cut.add(s)
        if len(cut) == len(slow):
            break
        for s in slow:
            if s not in cut:
                try:
                    s.sendall(request[sent:sent + 1])
                except (BrokenPipeError, ConnectionResetError):
                    cut.add(s)
    assert len(cut) == len(slow), f"{len(slow) - len(cut)} trickling requests were never cut"
    assert sent < len(request) - 1, "the requests were whole before they were cut"
    for s in slow:
        s.close()
    deadline, page = time.monotonic() + 10, None
    while page is None:  # their places come back once the server's thread saw them go
        try:
            page = scrape(metrics_url(mproxy))
        except (ConnectionError, http.client.HTTPException, urllib.error.URLError):
            assert time.monotonic() < deadline, "the cut connections' places never came back"
    assert "kvstage_rooms_done_total 0" in page
    assert mproxy.log_text().count("metrics:") <= 12, "the cuts are logged through a limit"


@pytest.mark.parametrize("value", ["", "x", "65536", "1.2.3.4", "localhost:9", "127.0.0.1:", "[::1]"])
def test_bad_addresses_are_refused_at_start(value, tmp_path):
    from conftest import kvstaged_path
    r = subprocess.run([kvstaged_path(), "--socket", str(tmp_path / "s"), "--metrics-listen", value],
                       capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert r.returncode == 2
    assert f"invalid --metrics-listen '{value}'" in r.stderr


def test_a_port_in_use_stops_the_start(tmp_path):
    from conftest import kvstaged_path
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([kvstaged_path(), "--socket", str(tmp_path / "s"), "--slots", "4", "--slot-size", "64K",
                            "--metrics-listen", str(port)],
                           capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert r.returncode == 1
    assert f"metrics: cannot serve on 127.0.0.1:{port}" in r.stderr
    assert not os.path.exists(tmp_path / "s")  # it never served


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@need_prometheus
def test_a_prometheus_server_scrapes_the_proxy(mproxy):
    """A real Prometheus scrapes every 200 ms; its query API must return the workload's counts."""
    target = urllib.parse.urlsplit(metrics_url(mproxy)).netloc
    d = tempfile.mkdtemp(prefix="kvs-prom-")
    conf = os.path.join(d, "prometheus.yml")
    with open(conf, "w") as f:
        f.write("global:\n  scrape_interval: 200ms\n  scrape_timeout: 150ms\n"
                f"scrape_configs:\n  - job_name: kvstaged\n    static_configs:\n      - targets: ['{target}']\n")
    port = free_port()
    log = open(os.path.join(d, "prometheus.log"), "wb")
    prom = subprocess.Popen([PROMETHEUS, f"--config.file={conf}", f"--storage.tsdb.path={d}/data",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)

    def query(q):
        url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": q})
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                body = json.load(r)
        except (urllib.error.URLError, ConnectionError):
            return None
        assert body["status"] == "success", body
        res = body["data"]["result"]
        return float(res[0]["value"][1]) if res else None

    def until(q, want, limit=60):
        """Polls Prometheus (an outside process on its own clock) until q == want; fails after limit s."""
        deadline, got = time.monotonic() + limit, None
        while time.monotonic() < deadline:
            assert prom.poll() is None, f"prometheus exited {prom.returncode}"
            got = query(q)
            if got == want:
                return
            time.sleep(0.2)
        log.flush()
        pytest.fail(f"{q}: {got}, not {want}, after {limit} s\n" + open(log.name, errors="replace").read()[-3000:])

    try:
        until('up{job="kvstaged"}', 1.0)
        until("kvstage_rooms_done_total", 0.0)
        workload(mproxy, rooms=7, aborts=3)
        until("kvstage_rooms_done_total", 7.0)
        until("kvstage_rooms_aborted_total", 3.0)
        until("kvstage_room_duration_seconds_count", 7.0)
        until("kvstage_bytes_moved_total", float((7 * 3 + 3) * SLOT_SIZE))
        until('kvstage_slots{state="free"}', 64.0)
        q = query("histogram_quantile(0.5, kvstage_room_duration_seconds_bucket)")
        assert q is not None and 0 < q < 120
    finally:
        prom.terminate()
        prom.wait(30)
        log.close()
        shutil.rmtree(d, ignore_errors=True)


def test_two_proxies_show_their_peer_session(tmp_path):
    """A room from proxy A to proxy B over tcp: both pages show the session, its bytes, and pass promtool."""
    secret = tmp_path / "peer.secret"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    common = ["--peer-secret-file", str(secret), "--transport", "tcp", "--metrics-listen", "0"]
    pa = Proxy(common)
    pb = Proxy(common + ["--listen", "127.0.0.1:0"])
    try:
        with kvstage.Client(pa.socket) as tx, kvstage.Client(pb.socket) as rx:
            rroom, desc = rx.recv_open(3 * SLOT_SIZE)
            sroom = tx.send_open(desc)
            for i, lease in enumerate(tx.acquire(3)):
                lease.view()[:4] = b"kvs!"
                sroom.send(lease, i * SLOT_SIZE, SLOT_SIZE)
            assert next_event(tx).type == kvstage.EventType.SEND_DONE
            assert next_event(rx).type == kvstage.EventType.RECV_DONE
            rroom.close()
            sroom.close()
        for px, sent in ((pa, "kvstage_peer_sent_bytes_total"), (pb, "kvstage_peer_received_bytes_total")):
            page = scrape(metrics_url(px))
            s = samples(page)
            assert s["kvstage_peer_sessions"] == 1
            rows = {k: v for k, v in s.items() if k.startswith(sent + "{")}
            assert len(rows) == 1 and next(iter(rows.values())) >= 3 * SLOT_SIZE, rows
            assert 'rdma="no"' in next(iter(rows))
            assert [v for k, v in s.items() if k.startswith("kvstage_peer_up{")] == [1.0]
            if PROMTOOL:
                r = subprocess.run([PROMTOOL, "check", "metrics"], input=page, capture_output=True, text=True,
                                   timeout=60)
                assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr
        assert samples(scrape(metrics_url(pa)))["kvstage_tcp_sent_bytes_total"] >= 3 * SLOT_SIZE
        # The data paths' counters (ABI 4: the control segment's counter block) keep their
        # names and types; the RDMA data path's are there wherever the build has it.
        page = scrape(metrics_url(pb))
        types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", page, re.M))
        want = {n: "counter" for n in (
            "kvstage_tcp_sent_bytes_total", "kvstage_tcp_received_bytes_total", "kvstage_tcp_send_calls_total",
            "kvstage_tcp_recv_calls_total", "kvstage_tcp_lowat_calls_total", "kvstage_tcp_zerocopy_sends_total",
            "kvstage_tcp_zerocopy_copied_total")}
        # kvstage-stat beside this kvstaged: a build's tools/, or the bin of a wheel's venv.
        kvsd = os.environ["KVSTAGED"]
        stat = next(p for p in (os.path.join(os.path.dirname(os.path.dirname(kvsd)), "tools", "kvstage-stat"),
                                os.path.join(os.path.dirname(kvsd), "kvstage-stat"), shutil.which("kvstage-stat"))
                    if p and os.path.exists(p))
        built = json.loads(subprocess.run([stat, "--json", "-s", pb.socket], capture_output=True, text=True,
                                          timeout=30, check=True).stdout)
        if "verbs" not in built["built_without"]:
            want.update({n: "counter" for n in (
                "kvstage_rdma_reads_total", "kvstage_rdma_received_bytes_total", "kvstage_rdma_window_binds_total",
                "kvstage_rdma_window_invalidates_total", "kvstage_rdma_region_registrations_total",
                "kvstage_rdma_region_deregistrations_total", "kvstage_rdma_reads_refused_total",
                "kvstage_rdma_links_lost_total")})
            want["kvstage_rdma_sessions"] = "gauge"
        assert {n: types.get(n) for n in want} == want
        assert samples(page)["kvstage_tcp_received_bytes_total"] >= 3 * SLOT_SIZE
    finally:
        for px in (pa, pb):
            px.stop()
            shutil.rmtree(px.dir, ignore_errors=True)


def test_attached_clients_have_their_own_series(mproxy):
    """Per client: its ops, rooms and bytes, labelled with its id and pid; gone once it closes."""
    url = metrics_url(mproxy)
    with kvstage.Client(mproxy.socket) as tx, kvstage.Client(mproxy.socket) as rx:
        for k in range(3):
            rroom, desc = rx.recv_open(2 * SLOT_SIZE, user_data=k)
            sroom = tx.send_open(desc)
            for i, lease in enumerate(tx.acquire(2)):
                sroom.send(lease, i * SLOT_SIZE, SLOT_SIZE)
            assert next_event(tx).type == kvstage.EventType.SEND_DONE
            assert next_event(rx).type == kvstage.EventType.RECV_DONE
            rroom.close()
            sroom.close()
        page = scrape(url)
        s = samples(page)
        pid = f'pid="{os.getpid()}"'
        sent = {k: v for k, v in s.items() if k.startswith("kvstage_client_sent_bytes_total{")}
        recv = {k: v for k, v in s.items() if k.startswith("kvstage_client_received_bytes_total{")}
        assert len(sent) == 2 and all(pid in k for k in sent), sent
        assert sorted(sent.values()) == [0, 6 * SLOT_SIZE] and sorted(recv.values()) == [0, 6 * SLOT_SIZE]
        done = [v for k, v in s.items() if k.startswith("kvstage_client_rooms_done_total{")]
        assert done == [3, 3]
        if PROMTOOL:
            r = subprocess.run([PROMTOOL, "check", "metrics"], input=page, capture_output=True, text=True, timeout=60)
            assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr
    assert not [k for k in clients_gone(url) if k.startswith("kvstage_client_")]
