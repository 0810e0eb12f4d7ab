// SPDX-License-Identifier: MIT
// The progress thread of a KVSTAGE NIXL backend (core.hpp; docs/nixl.md).
#include "core.hpp"
#include "wire.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdarg>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <unordered_map>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

extern "C" {
#include <kvstage.h>
}
#ifdef KVS_NIXL_VRAM
#include <cuda_runtime_api.h>
extern "C" {
#include <kvstage_cuda.h>
}
#endif

namespace kvsnixl {

namespace {

using Clock = std::chrono::steady_clock;
using ms = std::chrono::milliseconds;

constexpr size_t kMaxAgent = 1024;	      // an agent name's bytes at most
constexpr size_t kMaxNotif = 65536;	      // a notification's bytes at most
constexpr uint64_t kMaxDescs = 1u << 22;      // descriptors of one request at most
constexpr uint32_t kDescsPerFrame = 32768;    // 24 bytes each: 768 KiB a frame
constexpr size_t kTxHigh = 4u << 20;	      // stop making descriptor frames above this
constexpr size_t kMaxServesPerConn = 4096;    // requests one peer connection may have open
constexpr size_t kMaxAccepted = 256;	      // connections accepted at once
constexpr size_t kMaxForgotten = 65536;	      // forgotten prefixes remembered at most
constexpr unsigned kHandshakeMs = 5000;	      // connect + handshake bound
constexpr unsigned kStepsPerRound = 64;	      // copy steps between two looks at the sockets
constexpr size_t kDescWire = 24;

void log_line(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void log_line(const char *fmt, ...)
{
	char buf[1024];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(buf, sizeof(buf), fmt, ap);
	va_end(ap);
	fprintf(stderr, "kvstage nixl: %s\n", buf);
}

// At most one line a second for each kind; the next one says how many were left out.
struct RateLog {
	std::mutex mu;
	std::map<std::string, std::pair<Clock::time_point, unsigned>> last;
};
RateLog g_ratelog;

void log_rl(const char *kind, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void log_rl(const char *kind, const char *fmt, ...)
{
	auto now = Clock::now();
	unsigned left_out = 0;
	{
		std::lock_guard<std::mutex> lk(g_ratelog.mu);
		auto &e = g_ratelog.last[kind];
		if (e.first != Clock::time_point{} && now - e.first < std::chrono::seconds(1)) {
			e.second++;
			return;
		}
		left_out = e.second;
		e = {now, 0};
	}
	char buf[1024];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(buf, sizeof(buf), fmt, ap);
	va_end(ap);
	if (left_out)
		fprintf(stderr, "kvstage nixl: %s (%u more like it left out)\n", buf, left_out);
	else
		fprintf(stderr, "kvstage nixl: %s\n", buf);
}

bool split_hostport(const std::string &s, std::string &host, std::string &port)
{
	size_t c = s.rfind(':');
	if (c == std::string::npos || c + 1 >= s.size())
		return false;
	host = s.substr(0, c);
	port = s.substr(c + 1);
	if (host.size() >= 2 && host.front() == '[' && host.back() == ']')
		host = host.substr(1, host.size() - 2);
	return !host.empty();
}

struct Stream {
	std::vector<Span> spans;
	std::vector<uint64_t> start;
	std::vector<std::shared_ptr<Region>> regions;
	uint64_t total = 0;
	bool vram = false; // its regions are GPU memory (one kind a stream: a NIXL list's)

	void index()
	{
		start.resize(spans.size());
		uint64_t o = 0;
		for (size_t i = 0; i < spans.size(); i++) {
			start[i] = o;
			o += spans[i].len;
		}
		total = o;
	}
	bool any_dead() const
	{
		for (auto &r : regions)
			if (r->dead.load(std::memory_order_acquire))
				return true;
		return false;
	}
	template <class F> void walk(uint64_t off, uint64_t n, F f) const
	{
		size_t i = (size_t)(std::upper_bound(start.begin(), start.end(), off) - start.begin()) - 1;
		uint64_t pos = off - start[i];
		while (n && i < spans.size()) {
			const Span &s = spans[i];
			uint64_t k = std::min(n, s.len - pos);
			if (k)
				f((uint8_t *)s.addr + pos, k);
			n -= k;
			pos = 0;
			i++;
		}
	}
};

} // namespace

struct Xfer {
	uint64_t id = 0;
	uint8_t op = XFER_READ;
	std::string agent;
	Stream local;
	std::vector<Span> remote;
	bool has_notif = false;
	std::string notif;
	std::atomic<int> status{1};
	bool cancelled = false; // fence_mu_
	// The progress thread's:
	uint64_t conn = 0;
	bool finished = false;
	bool descs_done = false;
	size_t descs_sent = 0;
	uint64_t next_off = 0; // READ: the next segment to open
	unsigned rooms_open = 0;
	uint64_t landed = 0; // READ: bytes in the local pages
	bool got_done = false;
	std::vector<uint64_t> jobs;
	Clock::time_point last;
	Clock::time_point retry_at{};
	bool want_room = false;
	bool have_wroom = false; // WRITE: the target's room, to join once a handle is free
	kvs_room_desc wroom{};
};

namespace {

struct Serve {
	uint64_t conn = 0, xid = 0;
	uint8_t op = 0;
	std::string agent;
	bool has_notif = false;
	std::string notif;
	uint64_t ndescs = 0, total = 0;
	std::vector<Span> raw;
	Stream stream;
	bool validated = false;
	bool cancelled = false;	 // fence_mu_
	uint64_t forget_gen = 0; // fence_mu_
	Clock::time_point born, last;
	uint64_t next_off = 0; // READ: the next segment the initiator may name
	uint64_t sent = 0;     // READ: bytes the initiator's room has
	std::vector<uint64_t> jobs;
	struct PendingRoom {
		uint64_t off, len;
		kvs_room_desc desc;
	};
	std::deque<PendingRoom> pending; // READ: rooms to join once a handle is free
	bool want_room = false;		 // WRITE: the room to open once a handle is free
	Clock::time_point retry_at{};
	bool ended = false;
};

struct Job {
	uint64_t ud = 0;
	kvs_room *room = nullptr;
	bool recv = false;
	std::shared_ptr<Xfer> x;
	std::shared_ptr<Serve> s;
	uint64_t off = 0, len = 0;
	unsigned chunks = 0, next = 0;
	bool landed = false;
	bool pending = false;
	kvs_lease pl{};
	uint64_t poff = 0;
	uint32_t plen = 0;
	Clock::time_point retry_at{};
	unsigned backoff_ms = 0;
};

enum ConnSt { C_CONNECTING, C_DHELLO, C_LHELLO, C_LPROOF, C_UP };

struct Conn {
	uint64_t id = 0;
	int fd = -1;
	bool dialer = false;
	ConnSt st = C_CONNECTING;
	uint8_t cn[kNonce]{}, sn[kNonce]{};
	std::string ep;
	std::string peer;
	std::vector<uint8_t> rx;
	size_t rx_off = 0;
	std::deque<std::vector<uint8_t>> tx;
	size_t tx_off = 0, tx_bytes = 0;
	std::vector<std::vector<uint8_t>> early; // dialer: bodies made before the handshake ended
	uint64_t tx_seq = 0, rx_seq = 0;
	Clock::time_point deadline, since;
	std::deque<std::shared_ptr<Xfer>> descq;
	std::set<uint64_t> xfers;
	std::set<uint64_t> serves;
	bool killed = false; // kill_conn said so: the loop closes it
	std::string why;     // what to log then ("": nothing)
	bool alarm = false;  // the peer broke the protocol: logged even with nothing in flight
};

struct Endpoint {
	std::string key;
	sockaddr_storage addr;
	socklen_t alen;
};

enum CmdType { CMD_POST, CMD_CANCEL, CMD_NOTIF, CMD_REGION_DEAD, CMD_FORGET };
struct Cmd {
	CmdType type;
	std::shared_ptr<Xfer> x;
	std::string agent, msg;
};

// Every counter, by name, in the order the stats file lists them.
#define KVS_NIXL_COUNTERS(X)                                                                       \
	X(accepted)                                                                                \
	X(dialed)                                                                                  \
	X(handshakes)                                                                              \
	X(bad_magic)                                                                               \
	X(bad_proof)                                                                               \
	X(bad_mac)                                                                                 \
	X(bad_length)                                                                              \
	X(malformed)                                                                               \
	X(handshake_timeouts)                                                                      \
	X(evicted)                                                                                 \
	X(conns_lost)                                                                              \
	X(refused_descs)                                                                           \
	X(refused_forgotten)                                                                       \
	X(refused_other)                                                                           \
	X(served_read)                                                                             \
	X(served_write)                                                                            \
	X(serves_failed)                                                                           \
	X(serves_stopped)                                                                          \
	X(serves_ended)                                                                            \
	X(posted)                                                                                  \
	X(completed)                                                                               \
	X(failed)                                                                                  \
	X(released_in_flight)                                                                      \
	X(xfers_ended)                                                                             \
	X(steps_refused)                                                                           \
	X(chunks_gathered)                                                                         \
	X(chunks_scattered)                                                                        \
	X(bytes_gathered)                                                                          \
	X(bytes_scattered)                                                                         \
	X(notifs_in)                                                                               \
	X(notifs_out)

struct Stats {
#define X(n) uint64_t n = 0;
	KVS_NIXL_COUNTERS(X)
#undef X
};

std::mutex g_registry_mu;
std::map<std::string, Core *> g_registry;

} // namespace

struct Core::Impl {
	Config cfg;
	Core *self = nullptr;
	uint8_t key[kKey];
	kvs_client *kc = nullptr;
#ifdef KVS_NIXL_VRAM
	cudaStream_t cstream = nullptr; // GPU copies: a non-blocking stream of our own
#endif
	int kfd = -1;
	bool proxy_gone = false; // kvstaged went away: every room failed, nothing more is posted
	size_t slot = 0;
	uint64_t max_room = 0;
	// Receiving rooms open at once hold at most recv_budget bytes (half the pool): a
	// room waits for slots only while others drain, never for rooms that cannot finish.
	uint64_t recv_budget = 0, recv_open_bytes = 0;
	bool recv_over_budget(uint64_t len) const
	{
		return recv_open_bytes && recv_open_bytes + len > recv_budget;
	}
	int lfd = -1;
	uint16_t port = 0;
	std::string adv_host;
	int efd = -1;
	std::thread thr;
	std::atomic<bool> stop{false};

	// Engine threads and the progress thread.
	std::mutex cmd_mu;
	std::deque<Cmd> cmds;
	std::mutex notif_mu;
	std::vector<std::pair<std::string, std::string>> notifs;
	std::mutex regions_mu;
	std::multimap<uintptr_t, std::shared_ptr<Region>> regions;
	std::mutex agents_mu;
	std::map<std::string, Endpoint> agents;
	std::atomic<uint64_t> next_xid{1};

	// The fence: a copy step runs with busy set; releaseReqH, deregisterMem and
	// forget wait for the step they overlap.
	std::mutex fence_mu;
	std::condition_variable fence_cv;
	bool busy = false;
	const void *busy_owner = nullptr;
	std::deque<std::pair<Clock::time_point, std::string>> forgotten;
	uint64_t forget_gen = 1;

	// The progress thread's alone.
	Stats st;
	bool stats_dirty = true, stats_urgent = false;
	Clock::time_point stats_at{};
	uint64_t next_conn = 1, next_ud = 1;
	std::map<uint64_t, std::unique_ptr<Conn>> conns;
	std::map<std::string, uint64_t> dialed; // endpoint -> conn id
	std::map<uint64_t, std::shared_ptr<Xfer>> xfers;
	std::map<std::pair<uint64_t, uint64_t>, std::shared_ptr<Serve>> serves;
	std::unordered_map<uint64_t, std::unique_ptr<Job>> jobs;
	std::set<uint64_t> active; // jobs with a copy step to make
	Clock::time_point sweep_at{};
	// The test gate ("DIR:PHASE:N").
	std::string gate_dir, gate_phase;
	unsigned gate_n = 0, gate_count[2] = {0, 0};

	// ---------------------------------------------------------------- set-up
	bool start(std::string &err);
	bool connect_proxy(std::string &err);
	void run();
	void shutdown();
	void kick()
	{
		uint64_t one = 1;
		ssize_t r = write(efd, &one, sizeof(one));
		(void)r;
	}
	void queue(Cmd c)
	{
		{
			std::lock_guard<std::mutex> lk(cmd_mu);
			cmds.push_back(std::move(c));
		}
		kick();
	}

	// ---------------------------------------------------------------- stats
	// Counts an event; the stats file is rewritten at once (the byte and chunk
	// counters, which change at every step, wait for the next event or 50 ms).
	void count(uint64_t &c)
	{
		c++;
		stats_dirty = true;
		stats_urgent = true;
	}
	void write_stats(bool force);

	// ---------------------------------------------------------------- fence
	bool may_copy(const Job &j);
	bool begin_step(const Job &j);
	void end_step();
	bool is_forgotten(const std::string &notif); // fence_mu held
	void gate(int phase);
	void gate_after(int phase, bool copied);
	int gate_w = -1;

	// ---------------------------------------------------------------- connections
	Conn *dial(const Endpoint &e, int &rc);
	void accept_all();
	void conn_io(Conn *c, short rev);
	void conn_read(Conn *c);
	void conn_flush(Conn *c);
	void conn_up(Conn *c);
	void close_conn(Conn *c);
	void send_msg(Conn *c, std::vector<uint8_t> body);
	void seal(Conn *c, const std::vector<uint8_t> &body);
	bool on_frame(Conn *c, const uint8_t *b, size_t n);
	void pump_descs(Conn *c);
	// A live connection by id (nullptr once kill_conn has been called on it).
	Conn *conn_of(uint64_t id)
	{
		auto it = conns.find(id);
		return it == conns.end() || it->second->killed ? nullptr : it->second.get();
	}
	// Marks c for closing; the loop closes it (close_conn) when nothing uses it.
	void kill_conn(Conn *c, const char *why, bool alarm = false)
	{
		if (!c->killed) {
			c->killed = true;
			c->why = why ? why : "";
			c->alarm = alarm;
		}
	}
	void reap_conns();

	// ---------------------------------------------------------------- initiator
	void post(std::shared_ptr<Xfer> x);
	void open_segments(Xfer &x);
	bool end_xfer(const std::shared_ptr<Xfer> &x, Conn *&c);
	int copy_vram(const Stream &s, uint64_t off, uint32_t n, const kvs_lease &l, bool to_slot);
	void fail_xfer(const std::shared_ptr<Xfer> &x, int err);
	void complete_xfer(const std::shared_ptr<Xfer> &x);
	void maybe_complete(const std::shared_ptr<Xfer> &x);
	bool on_room_for_write(Conn *c, uint64_t xid, uint64_t off, uint64_t len,
			       const kvs_room_desc &d);
	bool on_done(Conn *c, uint64_t xid, int32_t status);
	void join_write_room(const std::shared_ptr<Xfer> &x);

	// ---------------------------------------------------------------- target
	bool on_req(Conn *c, Reader &r);
	bool on_descs(Conn *c, Reader &r);
	bool on_room_for_read(Conn *c, uint64_t xid, uint64_t off, uint64_t len,
			      const kvs_room_desc &d);
	void validate(const std::shared_ptr<Serve> &s);
	void serve_open_write_room(const std::shared_ptr<Serve> &s);
	void serve_join_rooms(const std::shared_ptr<Serve> &s);
	// Ends a served request; tell: say so to the initiator (DONE with status).
	void end_serve(const std::shared_ptr<Serve> &s, int status, bool tell = true);
	void push_notif(const std::string &agent, const std::string &msg);

	// ---------------------------------------------------------------- rooms
	Job *new_job(kvs_room *room, bool recv, uint64_t ud, uint64_t off, uint64_t len);
	void close_job(uint64_t ud);
	void on_event(const kvs_event &ev);
	void job_failed(Job &j, int err);
	void step(Job &j, Clock::time_point now);
	void step_send(Job &j, Clock::time_point now);
	void step_recv(Job &j, Clock::time_point now);
	void recv_finished(Job &j);
	void drain_events();
	void sweep(Clock::time_point now);
	void run_cmds();
	void retry_rooms(Clock::time_point now);
	Clock::time_point next_retry = Clock::time_point::max();
};

// ==================================================================== set-up

bool Core::Impl::start(std::string &err)
{
	std::string secret;
	if (!load_secret(cfg.secret_file, secret, err))
		return false;
	derive_key(secret, key);
	sodium_memzero(&secret[0], secret.size());

	if (!cfg.gate.empty()) {
		size_t a = cfg.gate.rfind(':');
		size_t b = a == std::string::npos ? a : cfg.gate.rfind(':', a - 1);
		if (b == std::string::npos) {
			err = "test_gate " + cfg.gate + ": not DIR:PHASE:N";
			return false;
		}
		gate_dir = cfg.gate.substr(0, b);
		gate_phase = cfg.gate.substr(b + 1, a - b - 1);
		gate_n = (unsigned)strtoul(cfg.gate.c_str() + a + 1, nullptr, 10);
		if ((gate_phase != "gather" && gate_phase != "scatter") || !gate_n) {
			err = "test_gate " + cfg.gate + ": PHASE is gather or scatter, N from 1";
			return false;
		}
	}

	std::string host, portstr;
	if (!split_hostport(cfg.listen, host, portstr)) {
		err = "listen " + cfg.listen + ": not HOST:PORT";
		return false;
	}
	addrinfo hints{}, *ai = nullptr;
	hints.ai_socktype = SOCK_STREAM;
	hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
	int g = getaddrinfo(host.c_str(), portstr.c_str(), &hints, &ai);
	if (g) {
		err = "listen " + cfg.listen + ": " + gai_strerror(g);
		return false;
	}
	lfd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	int one = 1;
	if (lfd >= 0)
		setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
	if (lfd < 0 || bind(lfd, ai->ai_addr, ai->ai_addrlen) < 0 || listen(lfd, 128) < 0) {
		err = "listen " + cfg.listen + ": " + strerror(errno);
		freeaddrinfo(ai);
		return false;
	}
	freeaddrinfo(ai);
	sockaddr_storage ss;
	socklen_t sl = sizeof(ss);
	getsockname(lfd, (sockaddr *)&ss, &sl);
	port = ntohs(ss.ss_family == AF_INET6 ? ((sockaddr_in6 *)&ss)->sin6_port
					      : ((sockaddr_in *)&ss)->sin_port);
	adv_host = cfg.advertise.empty() ? host : cfg.advertise;
	if (adv_host == "0.0.0.0" || adv_host == "::") {
		err = "listen " + cfg.listen +
		      " is a wildcard address: set advertise (KVSTAGE_NIXL_ADVERTISE) to the "
		      "address peers dial";
		return false;
	}
	efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	if (efd < 0) {
		err = std::string("eventfd: ") + strerror(errno);
		return false;
	}
	// Every libkvstage call is the progress thread's, the connection included:
	// the thread connects and says how it went before start() returns.
	std::promise<std::string> connected;
	auto result = connected.get_future();
	thr = std::thread([this, &connected] {
		std::string e;
		bool ok = connect_proxy(e);
		connected.set_value(ok ? std::string() : e);
		if (ok)
			run();
	});
	err = result.get();
	if (!err.empty()) {
		thr.join();
		return false;
	}
	return true;
}

bool Core::Impl::connect_proxy(std::string &err)
{
	int rc = kvs_connect(cfg.socket.empty() ? nullptr : cfg.socket.c_str(), &kc);
	if (rc < 0) {
		err = std::string("kvstaged at ") +
		      (cfg.socket.empty() ? "the default socket" : cfg.socket) + ": " +
		      kvs_strerror(rc);
		kc = nullptr;
		return false;
	}
	kfd = kvs_event_fd(kc);
	if (kfd < 0) {
		err = std::string("kvs_event_fd: ") + kvs_strerror(kfd);
		kvs_close(kc);
		kc = nullptr;
		return false;
	}
	slot = kvs_slot_size(kc);
	uint64_t pool = (uint64_t)slot * kvs_slot_count(kc);
	max_room = cfg.max_room_bytes ? cfg.max_room_bytes : pool / 4;
	max_room = std::min<uint64_t>(max_room, pool) / slot * slot;
	if (max_room < slot)
		max_room = slot;
	recv_budget = std::max(max_room, pool / 2);
	if (cfg.vram) {
#ifdef KVS_NIXL_VRAM
		rc = kvs_cuda_register(kc);
		cudaError_t e = rc < 0 ? cudaSuccess
				       : cudaStreamCreateWithFlags(&cstream, cudaStreamNonBlocking);
		if (rc < 0 || e != cudaSuccess) {
			err = std::string("vram=1: ") +
			      (rc < 0 ? std::string("kvs_cuda_register: ") + kvs_strerror(rc) + " (" +
						kvs_cuda_last_error() + ")"
				      : std::string("cudaStreamCreate: ") + cudaGetErrorString(e));
			kvs_close(kc);
			kc = nullptr;
			return false;
		}
#else
		err = "vram=1: this libplugin_KVSTAGE.so was built without CUDA (libkvstage_cuda): "
		      "build it where meson finds the CUDA toolkit (docs/nixl.md)";
		kvs_close(kc);
		kc = nullptr;
		return false;
#endif
	}
	return true;
}

// n bytes of s from off between GPU memory and slot l, on our stream, waited
// for before returning: the copy step (and so the fence) spans the DMA.
// Returns 0, or -errno.
int Core::Impl::copy_vram(const Stream &s, uint64_t off, uint32_t n, const kvs_lease &l,
			  bool to_slot)
{
#ifdef KVS_NIXL_VRAM
	int rc = 0;
	uint64_t at = 0;
	s.walk(off, n, [&](const uint8_t *p, uint64_t k) {
		if (!rc)
			rc = to_slot ? kvs_cuda_copy_to_slot(kc, &l, at, p, k, cstream, nullptr)
				     : kvs_cuda_copy_from_slot(kc, &l, at, (void *)p, k, cstream,
							       nullptr);
		at += k;
	});
	cudaError_t e = cudaStreamSynchronize(cstream); // also after a failed queue: nothing left running
	if (!rc && e != cudaSuccess)
		rc = -EIO;
	if (rc < 0)
		log_rl("cuda", "%s: a GPU copy failed: %s (%s)", cfg.agent.c_str(), kvs_strerror(rc),
		       rc == -EIO && e != cudaSuccess ? cudaGetErrorString(e) : kvs_cuda_last_error());
	return rc;
#else
	(void)s;
	(void)off;
	(void)n;
	(void)l;
	(void)to_slot;
	return -ENOTSUP; // no VRAM region is taken in such a build
#endif
}

void Core::Impl::shutdown()
{
	if (thr.joinable()) {
		stop = true;
		kick();
		thr.join();
	}
	for (auto &kv : conns)
		if (kv.second->fd >= 0)
			close(kv.second->fd);
	conns.clear();
	if (lfd >= 0)
		close(lfd);
	if (efd >= 0)
		close(efd);
	if (gate_w >= 0)
		close(gate_w);
	lfd = efd = gate_w = -1;
	write_stats(true);
}

void Core::Impl::write_stats(bool force)
{
	if (cfg.stats_file.empty() || !stats_dirty)
		return;
	auto now = Clock::now();
	if (!force && !stats_urgent && now - stats_at < ms(50))
		return;
	std::string tmp = cfg.stats_file + ".tmp";
	FILE *f = fopen(tmp.c_str(), "w");
	if (!f)
		return;
	fprintf(f, "{\"agent\": \"%s\", \"port\": %u", cfg.agent.c_str(), port);
#define X(n) fprintf(f, ", \"" #n "\": %llu", (unsigned long long)st.n);
	KVS_NIXL_COUNTERS(X)
#undef X
	fprintf(f, ", \"xfers\": %zu, \"serves\": %zu, \"rooms\": %zu, \"conns\": %zu}\n",
		xfers.size(), serves.size(), jobs.size(), conns.size());
	fclose(f);
	rename(tmp.c_str(), cfg.stats_file.c_str());
	stats_dirty = stats_urgent = false;
	stats_at = now;
}

// ==================================================================== the fence

bool Core::Impl::is_forgotten(const std::string &notif)
{
	for (auto &f : forgotten)
		if (notif.compare(0, f.second.size(), f.second) == 0)
			return true;
	return false;
}

bool Core::Impl::may_copy(const Job &j)
{
	if (j.x)
		return !j.x->cancelled && !j.x->local.any_dead();
	Serve &s = *j.s;
	if (s.cancelled)
		return false;
	if (s.forget_gen != forget_gen) {
		s.forget_gen = forget_gen;
		if (s.has_notif && is_forgotten(s.notif))
			s.cancelled = true;
	}
	if (!s.cancelled && cfg.serve_deadline_ms &&
	    Clock::now() - s.born > ms(cfg.serve_deadline_ms))
		s.cancelled = true;
	return !s.cancelled && !s.stream.any_dead();
}

bool Core::Impl::begin_step(const Job &j)
{
	std::lock_guard<std::mutex> lk(fence_mu);
	if (!may_copy(j))
		return false;
	busy = true;
	busy_owner = j.x ? (const void *)j.x.get() : (const void *)j.s.get();
	return true;
}

void Core::Impl::end_step()
{
	{
		std::lock_guard<std::mutex> lk(fence_mu);
		busy = false;
		busy_owner = nullptr;
	}
	fence_cv.notify_all();
}

// The test gate: at the Nth copy step of its phase (0 gather, 1 scatter), tell
// DIR/reached and wait for a byte on DIR/open; after the step, say whether it
// copied. Inert unless the test_gate parameter names it.
void Core::Impl::gate(int phase)
{
	if (gate_dir.empty() || gate_w >= 0)
		return;
	if (gate_phase != (phase ? "scatter" : "gather") || ++gate_count[phase] != gate_n)
		return;
	gate_w = open((gate_dir + "/reached").c_str(), O_WRONLY | O_CLOEXEC);
	if (gate_w < 0)
		return;
	char line[64];
	int n = snprintf(line, sizeof(line), "reached %s %u\n", gate_phase.c_str(), gate_n);
	ssize_t w = write(gate_w, line, (size_t)n);
	(void)w;
	int r = open((gate_dir + "/open").c_str(), O_RDONLY | O_CLOEXEC);
	if (r >= 0) {
		char c;
		ssize_t got = read(r, &c, 1);
		(void)got;
		close(r);
	}
}

void Core::Impl::gate_after(int, bool copied)
{
	if (gate_w < 0 || gate_dir.empty())
		return;
	const char *line = copied ? "passed copied\n" : "passed skipped\n";
	ssize_t w = write(gate_w, line, strlen(line));
	(void)w;
	close(gate_w);
	gate_w = -2; // once
}

// ==================================================================== connections

Conn *Core::Impl::dial(const Endpoint &e, int &rc)
{
	auto it = dialed.find(e.key);
	if (it != dialed.end()) {
		Conn *c = conn_of(it->second);
		if (c)
			return c;
		dialed.erase(it);
	}
	int fd = socket(e.addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (fd < 0) {
		rc = -errno;
		return nullptr;
	}
	int one = 1;
	setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
	if (connect(fd, (const sockaddr *)&e.addr, e.alen) < 0 && errno != EINPROGRESS) {
		rc = -errno;
		close(fd);
		return nullptr;
	}
	auto c = std::make_unique<Conn>();
	c->id = next_conn++;
	c->fd = fd;
	c->dialer = true;
	c->st = C_CONNECTING;
	c->ep = e.key;
	c->peer = e.key;
	c->since = Clock::now();
	c->deadline = c->since + ms(kHandshakeMs);
	random_bytes(c->cn, kNonce);
	std::vector<uint8_t> hello(kMagic, kMagic + 8);
	hello.insert(hello.end(), c->cn, c->cn + kNonce);
	c->tx_bytes = hello.size();
	c->tx.push_back(std::move(hello));
	Conn *raw = c.get();
	dialed[e.key] = c->id;
	conns[c->id] = std::move(c);
	count(st.dialed);
	return raw;
}

void Core::Impl::accept_all()
{
	for (int k = 0; k < 64; k++) {
		sockaddr_storage ss;
		socklen_t sl = sizeof(ss);
		int fd = accept4(lfd, (sockaddr *)&ss, &sl, SOCK_NONBLOCK | SOCK_CLOEXEC);
		if (fd < 0)
			return;
		size_t accepted = 0;
		Conn *oldest = nullptr;
		for (auto &kv : conns)
			if (!kv.second->dialer && !kv.second->killed) {
				accepted++;
				if (kv.second->st != C_UP &&
				    (!oldest || kv.second->since < oldest->since))
					oldest = kv.second.get();
			}
		if (accepted >= kMaxAccepted) {
			if (!oldest) {
				close(fd);
				count(st.evicted);
				continue;
			}
			count(st.evicted);
			kill_conn(oldest, nullptr);
		}
		int one = 1;
		setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
		auto c = std::make_unique<Conn>();
		c->id = next_conn++;
		c->fd = fd;
		c->dialer = false;
		c->st = C_LHELLO;
		c->since = Clock::now();
		c->deadline = c->since + ms(kHandshakeMs);
		char host[INET6_ADDRSTRLEN] = "?";
		if (ss.ss_family == AF_INET)
			inet_ntop(AF_INET, &((sockaddr_in *)&ss)->sin_addr, host, sizeof(host));
		else if (ss.ss_family == AF_INET6)
			inet_ntop(AF_INET6, &((sockaddr_in6 *)&ss)->sin6_addr, host, sizeof(host));
		c->peer = host;
		conns[c->id] = std::move(c);
		count(st.accepted);
	}
}

void Core::Impl::seal(Conn *c, const std::vector<uint8_t> &body)
{
	std::vector<uint8_t> f(4 + body.size() + kMac);
	uint32_t n = (uint32_t)body.size();
	f[0] = (uint8_t)(n >> 24);
	f[1] = (uint8_t)(n >> 16);
	f[2] = (uint8_t)(n >> 8);
	f[3] = (uint8_t)n;
	memcpy(f.data() + 4, body.data(), body.size());
	frame_mac(key, c->dialer ? 'd' : 'l', c->cn, c->sn, c->tx_seq++, f.data(), 4 + body.size(),
		  f.data() + 4 + body.size());
	c->tx_bytes += f.size();
	c->tx.push_back(std::move(f));
}

void Core::Impl::send_msg(Conn *c, std::vector<uint8_t> body)
{
	if (c->st != C_UP) {
		c->early.push_back(std::move(body));
		return;
	}
	seal(c, body);
	conn_flush(c);
}

void Core::Impl::conn_up(Conn *c)
{
	c->st = C_UP;
	count(st.handshakes);
	for (auto &b : c->early)
		seal(c, b);
	c->early.clear();
	pump_descs(c);
	conn_flush(c);
}

void Core::Impl::conn_flush(Conn *c)
{
	if (c->fd < 0 || c->st == C_CONNECTING)
		return;
	while (!c->tx.empty()) {
		auto &f = c->tx.front();
		ssize_t w = send(c->fd, f.data() + c->tx_off, f.size() - c->tx_off, MSG_NOSIGNAL);
		if (w < 0) {
			if (errno == EAGAIN || errno == EINTR)
				return;
			kill_conn(c, strerror(errno));
			return;
		}
		c->tx_off += (size_t)w;
		c->tx_bytes -= (size_t)w;
		if (c->tx_off == f.size()) {
			c->tx.pop_front();
			c->tx_off = 0;
		}
	}
}

void Core::Impl::reap_conns()
{
	std::vector<Conn *> dead;
	for (auto &kv : conns)
		if (kv.second->killed)
			dead.push_back(kv.second.get());
	for (Conn *c : dead)
		close_conn(c);
}

// Closes a killed connection: what was in flight over it ends (the initiator's
// requests fail, the target's stop), then it is forgotten.
void Core::Impl::close_conn(Conn *c)
{
	uint64_t id = c->id;
	// A connection closed with nothing in flight over it is no news, unless the
	// peer broke the protocol (logged at most once a second, the rest counted).
	if (!c->why.empty() && (c->alarm || !c->xfers.empty() || !c->serves.empty()))
		log_rl("conn", "%s: control connection %s %s: %s", cfg.agent.c_str(),
		       c->dialer ? "to" : "from", c->peer.c_str(), c->why.c_str());
	if (c->fd >= 0)
		close(c->fd);
	c->fd = -1;
	if (c->st == C_UP && !c->why.empty())
		count(st.conns_lost);
	if (c->dialer) {
		auto it = dialed.find(c->ep);
		if (it != dialed.end() && it->second == id)
			dialed.erase(it);
	}
	std::set<uint64_t> xs = c->xfers, ss = c->serves;
	for (uint64_t xid : xs) {
		auto it = xfers.find(xid);
		if (it != xfers.end())
			fail_xfer(it->second, -ECONNRESET);
	}
	for (uint64_t xid : ss) {
		auto it = serves.find({id, xid});
		if (it != serves.end())
			end_serve(it->second, -ECONNRESET, false);
	}
	conns.erase(id);
}

void Core::Impl::conn_io(Conn *c, short rev)
{
	uint64_t id = c->id;
	if (c->st == C_CONNECTING && (rev & (POLLOUT | POLLERR | POLLHUP))) {
		int e = 0;
		socklen_t el = sizeof(e);
		getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &e, &el);
		if (e) {
			kill_conn(c, strerror(e));
			return;
		}
		c->st = C_DHELLO;
		conn_flush(c);
		if (!conn_of(id))
			return;
	}
	if (rev & (POLLIN | POLLHUP | POLLERR))
		conn_read(c);
	if (!conn_of(id))
		return;
	if (rev & POLLOUT)
		conn_flush(c);
	if (conn_of(id) && c->st == C_UP)
		pump_descs(c);
}

void Core::Impl::conn_read(Conn *c)
{
	uint64_t id = c->id;
	uint8_t buf[65536];
	for (int k = 0; k < 16; k++) {
		ssize_t r = recv(c->fd, buf, sizeof(buf), 0);
		if (r < 0) {
			if (errno == EAGAIN || errno == EINTR)
				break;
			kill_conn(c, strerror(errno));
			return;
		}
		if (r == 0) {
			kill_conn(c, c->st == C_UP ? "closed by the peer" : nullptr);
			return;
		}
		c->rx.insert(c->rx.end(), buf, buf + r);
		// Consume what is whole.
		for (;;) {
			size_t have = c->rx.size() - c->rx_off;
			const uint8_t *p = c->rx.data() + c->rx_off;
			if (c->st == C_LHELLO) {
				size_t m = std::min<size_t>(have, 8);
				if (memcmp(p, kMagic, m) != 0) {
					count(st.bad_magic);
					kill_conn(c, "not a kvstage nixl control channel", true);
					return;
				}
				if (have < 8 + kNonce)
					break;
				memcpy(c->cn, p + 8, kNonce);
				c->rx_off += 8 + kNonce;
				random_bytes(c->sn, kNonce);
				std::vector<uint8_t> reply(c->sn, c->sn + kNonce);
				reply.resize(kNonce + kMac);
				listener_proof(key, c->cn, c->sn, reply.data() + kNonce);
				c->tx_bytes += reply.size();
				c->tx.push_back(std::move(reply));
				c->st = C_LPROOF;
				conn_flush(c);
				if (!conn_of(id))
					return;
				continue;
			}
			if (c->st == C_LPROOF) {
				if (have < kMac)
					break;
				uint8_t want[kMac];
				dialer_proof(key, c->cn, c->sn, want);
				if (!mac_equal(want, p)) {
					count(st.bad_proof);
					kill_conn(c,
						  "the dialer did not prove it holds the peer secret",
						  true);
					return;
				}
				c->rx_off += kMac;
				conn_up(c);
				if (!conn_of(id))
					return;
				continue;
			}
			if (c->st == C_DHELLO) {
				if (have < kNonce + kMac)
					break;
				uint8_t want[kMac];
				memcpy(c->sn, p, kNonce);
				listener_proof(key, c->cn, c->sn, want);
				if (!mac_equal(want, p + kNonce)) {
					count(st.bad_proof);
					kill_conn(c,
						  "the listener did not prove it holds the peer secret "
						  "(another KVSTAGE_PEER_SECRET?)",
						  true);
					return;
				}
				c->rx_off += kNonce + kMac;
				std::vector<uint8_t> proof(kMac);
				dialer_proof(key, c->cn, c->sn, proof.data());
				c->tx_bytes += proof.size();
				c->tx.push_back(std::move(proof));
				conn_up(c);
				if (!conn_of(id))
					return;
				continue;
			}
			// C_UP: frames.
			if (have < 4)
				break;
			uint32_t n = (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 |
				     (uint32_t)p[2] << 8 | p[3];
			if (n == 0 || n > kMaxBody) {
				count(st.bad_length);
				kill_conn(c, "a frame of a bad length", true);
				return;
			}
			if (have < 4 + (size_t)n + kMac)
				break;
			uint8_t want[kMac];
			frame_mac(key, c->dialer ? 'l' : 'd', c->cn, c->sn, c->rx_seq, p, 4 + n,
				  want);
			if (!mac_equal(want, p + 4 + n)) {
				count(st.bad_mac);
				kill_conn(c,
					  "a frame with a bad MAC (another secret, tampered, replayed or "
					  "out of order)",
					  true);
				return;
			}
			c->rx_seq++;
			c->rx_off += 4 + (size_t)n + kMac;
			if (!on_frame(c, p + 4, n)) {
				if (conn_of(id)) {
					count(st.malformed);
					kill_conn(c, "a malformed message", true);
				}
				return;
			}
			if (!conn_of(id))
				return;
		}
		if (c->rx_off == c->rx.size()) {
			c->rx.clear();
			c->rx_off = 0;
		} else if (c->rx_off > (1u << 20)) {
			c->rx.erase(c->rx.begin(), c->rx.begin() + (long)c->rx_off);
			c->rx_off = 0;
		}
		if ((size_t)r < sizeof(buf))
			break;
	}
}

bool Core::Impl::on_frame(Conn *c, const uint8_t *b, size_t n)
{
	Reader r(b, n);
	uint8_t t = r.u8();
	switch (t) {
	case MSG_REQ:
		return !c->dialer && on_req(c, r);
	case MSG_DESCS:
		return !c->dialer && on_descs(c, r);
	case MSG_ROOM: {
		uint64_t xid = r.u64(), off = r.u64(), len = r.u64();
		kvs_room_desc d;
		r.bytes(d.bytes, sizeof(d.bytes));
		if (!r.end())
			return false;
		return c->dialer ? on_room_for_write(c, xid, off, len, d)
				 : on_room_for_read(c, xid, off, len, d);
	}
	case MSG_DONE: {
		uint64_t xid = r.u64();
		int32_t status = (int32_t)r.u32();
		if (!r.end() || !c->dialer)
			return false;
		return on_done(c, xid, status);
	}
	case MSG_CANCEL: {
		uint64_t xid = r.u64();
		if (!r.end() || c->dialer)
			return false;
		auto it = serves.find({c->id, xid});
		if (it != serves.end()) {
			{
				std::lock_guard<std::mutex> lk(fence_mu);
				it->second->cancelled = true;
			}
			count(st.serves_stopped);
			end_serve(it->second, -ECANCELED, false);
		}
		return true;
	}
	case MSG_NOTIF: {
		std::string agent, msg;
		r.str16(agent, kMaxAgent);
		r.str32(msg, kMaxNotif);
		if (!r.end())
			return false;
		push_notif(agent, msg);
		return true;
	}
	default:
		return false;
	}
}

void Core::Impl::push_notif(const std::string &agent, const std::string &msg)
{
	{
		std::lock_guard<std::mutex> lk(notif_mu);
		notifs.emplace_back(agent, msg);
	}
	count(st.notifs_in);
}

// ==================================================================== the initiator

void Core::Impl::post(std::shared_ptr<Xfer> x)
{
	if (x->finished)
		return;
	Endpoint e;
	bool found = false;
	{
		std::lock_guard<std::mutex> lk(agents_mu);
		auto it = agents.find(x->agent);
		if (it != agents.end()) {
			e = it->second;
			found = true;
		}
	}
	if (!found && x->agent == cfg.agent) {
		// To ourselves: our own listener.
		sockaddr_storage ss;
		socklen_t sl = sizeof(ss);
		getsockname(lfd, (sockaddr *)&ss, &sl);
		if (ss.ss_family == AF_INET && ((sockaddr_in *)&ss)->sin_addr.s_addr == INADDR_ANY)
			((sockaddr_in *)&ss)->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
		e.addr = ss;
		e.alen = sl;
		e.key = "self";
		found = true;
	}
	xfers[x->id] = x;
	x->last = Clock::now();
	if (proxy_gone) {
		fail_xfer(x, -ENOTCONN);
		return;
	}
	if (!found) {
		fail_xfer(x, -EHOSTUNREACH);
		return;
	}
	int rc = 0;
	Conn *c = dial(e, rc);
	if (!c) {
		fail_xfer(x, rc ? rc : -EHOSTUNREACH);
		return;
	}
	x->conn = c->id;
	c->xfers.insert(x->id);
	Writer w;
	w.u8(MSG_REQ).u64(x->id).u8(x->op).u64(x->local.total).u64(x->remote.size());
	w.str16(cfg.agent);
	if (x->has_notif)
		w.u8(1).str32(x->notif);
	else
		w.u8(0);
	send_msg(c, std::move(w.b));
	c->descq.push_back(x);
	if (c->st == C_UP)
		pump_descs(c);
}

void Core::Impl::pump_descs(Conn *c)
{
	uint64_t id = c->id;
	while (!c->descq.empty() && c->tx_bytes < kTxHigh) {
		auto x = c->descq.front();
		if (x->finished) {
			c->descq.pop_front();
			continue;
		}
		size_t n = std::min<size_t>(kDescsPerFrame, x->remote.size() - x->descs_sent);
		if (n) {
			Writer w;
			w.b.reserve(1 + 8 + 4 + n * kDescWire);
			w.u8(MSG_DESCS).u64(x->id).u32((uint32_t)n);
			for (size_t i = x->descs_sent; i < x->descs_sent + n; i++)
				w.u64(x->remote[i].addr).u64(x->remote[i].len).u64(x->remote[i].dev);
			x->descs_sent += n;
			seal(c, w.b);
		}
		if (x->descs_sent == x->remote.size()) {
			c->descq.pop_front();
			x->descs_done = true;
			if (x->op == XFER_READ)
				open_segments(*x);
		}
		conn_flush(c);
		if (!conn_of(id))
			return;
	}
}

// READ: rooms for the next segments of the request's bytes, up to the window.
void Core::Impl::open_segments(Xfer &x)
{
	Conn *c = conn_of(x.conn);
	if (!c || x.finished)
		return;
	x.want_room = false;
	while (x.rooms_open < std::max(1u, cfg.read_window) && x.next_off < x.local.total) {
		uint64_t len = std::min(max_room, x.local.total - x.next_off);
		uint64_t ud = next_ud++;
		kvs_room *room = nullptr;
		kvs_room_desc d;
		int rc = recv_over_budget(len) ? -ENOBUFS : kvs_recv_open(kc, len, ud, &room, &d);
		if (rc == -EMFILE || rc == -ENFILE || rc == -ENOBUFS || rc == -EAGAIN) {
			x.want_room = true;
			x.retry_at = Clock::now() + ms(2);
			next_retry = std::min(next_retry, x.retry_at);
			return;
		}
		auto xp = xfers.find(x.id);
		if (rc < 0) {
			log_line("%s: opening a room of %llu bytes: %s", cfg.agent.c_str(),
				 (unsigned long long)len, kvs_strerror(rc));
			fail_xfer(xp->second, rc);
			return;
		}
		Job *j = new_job(room, true, ud, x.next_off, len);
		j->x = xp->second;
		x.jobs.push_back(ud);
		x.rooms_open++;
		Writer w;
		w.u8(MSG_ROOM).u64(x.id).u64(x.next_off).u64(len).bytes(d.bytes, sizeof(d.bytes));
		x.next_off += len;
		send_msg(c, std::move(w.b));
		if (!conn_of(x.conn))
			return;
	}
}

// x's end, once: its rooms closed, its connection (c: nullptr if gone) no
// longer naming it. Returns false when x had ended already.
bool Core::Impl::end_xfer(const std::shared_ptr<Xfer> &x, Conn *&c)
{
	if (x->finished)
		return false;
	x->finished = true;
	count(st.xfers_ended);
	for (uint64_t ud : x->jobs)
		close_job(ud);
	x->jobs.clear();
	c = conn_of(x->conn);
	if (c)
		c->xfers.erase(x->id);
	return true;
}

void Core::Impl::fail_xfer(const std::shared_ptr<Xfer> &x, int err)
{
	Conn *c;
	if (!end_xfer(x, c))
		return;
	if (c) {
		if (c->st == C_UP || !c->early.empty()) {
			Writer w;
			w.u8(MSG_CANCEL).u64(x->id);
			send_msg(c, std::move(w.b));
		}
	}
	bool released;
	{
		std::lock_guard<std::mutex> lk(fence_mu);
		released = x->cancelled;
	}
	if (!released) {
		count(st.failed);
		log_rl("failed", "%s: a %s of %llu bytes %s %s failed: %s", cfg.agent.c_str(),
		       x->op == XFER_READ ? "READ" : "WRITE", (unsigned long long)x->local.total,
		       x->op == XFER_READ ? "from" : "to", x->agent.c_str(), strerror(-err));
	}
	x->status.store(err, std::memory_order_release);
	xfers.erase(x->id);
}

void Core::Impl::complete_xfer(const std::shared_ptr<Xfer> &x)
{
	Conn *c;
	if (!end_xfer(x, c))
		return;
	count(st.completed);
	x->status.store(0, std::memory_order_release);
	xfers.erase(x->id);
}

void Core::Impl::maybe_complete(const std::shared_ptr<Xfer> &x)
{
	if (x->finished)
		return;
	if (x->op == XFER_READ) {
		if (x->landed == x->local.total && (x->local.total || x->got_done))
			complete_xfer(x);
	} else if (x->got_done) {
		complete_xfer(x);
	}
}

bool Core::Impl::on_room_for_write(Conn *c, uint64_t xid, uint64_t off, uint64_t len,
				   const kvs_room_desc &d)
{
	auto it = xfers.find(xid);
	if (it == xfers.end() || it->second->conn != c->id)
		return true; // released or failed meanwhile: its CANCEL is on its way
	auto x = it->second;
	if (x->op != XFER_WRITE || off != 0 || len != x->local.total || !x->jobs.empty() ||
	    x->have_wroom)
		return false;
	x->have_wroom = true;
	x->wroom = d;
	x->last = Clock::now();
	join_write_room(x);
	return true;
}

// WRITE: the sending half of the target's room; retried while no handle is free.
void Core::Impl::join_write_room(const std::shared_ptr<Xfer> &x)
{
	x->want_room = false;
	if (x->finished)
		return;
	uint64_t ud = next_ud++;
	kvs_room *room = nullptr;
	int rc = kvs_send_open(kc, &x->wroom, ud, &room);
	if (rc == -EMFILE || rc == -ENFILE || rc == -EAGAIN) {
		x->want_room = true;
		x->retry_at = Clock::now() + ms(2);
		next_retry = std::min(next_retry, x->retry_at);
		return;
	}
	if (rc == 0 && kvs_room_bytes(room) != x->local.total) {
		kvs_room_close(room);
		rc = -EPROTO;
	}
	if (rc < 0) {
		fail_xfer(x, rc);
		return;
	}
	Job *j = new_job(room, false, ud, 0, x->local.total);
	j->x = x;
	x->jobs.push_back(ud);
	active.insert(ud);
}

bool Core::Impl::on_done(Conn *c, uint64_t xid, int32_t status)
{
	auto it = xfers.find(xid);
	if (it == xfers.end() || it->second->conn != c->id)
		return true;
	auto x = it->second;
	x->last = Clock::now();
	if (status > 0)
		return false;
	if (status < 0) {
		fail_xfer(x, status);
		return true;
	}
	x->got_done = true;
	maybe_complete(x);
	return true;
}

// ==================================================================== the target

bool Core::Impl::on_req(Conn *c, Reader &r)
{
	auto s = std::make_shared<Serve>();
	s->conn = c->id;
	s->xid = r.u64();
	s->op = r.u8();
	s->total = r.u64();
	s->ndescs = r.u64();
	r.str16(s->agent, kMaxAgent);
	uint8_t hn = r.u8();
	if (hn == 1)
		r.str32(s->notif, kMaxNotif);
	s->has_notif = hn == 1;
	if (!r.end() || hn > 1 || s->op > OP_WRITE || s->ndescs > kMaxDescs)
		return false;
	if (serves.count({c->id, s->xid}))
		return false;
	if (c->serves.size() >= kMaxServesPerConn) {
		count(st.refused_other);
		Writer w;
		w.u8(MSG_DONE).u64(s->xid).u32((uint32_t)-EBUSY);
		send_msg(c, std::move(w.b));
		return true;
	}
	s->born = s->last = Clock::now();
	s->raw.reserve((size_t)std::min<uint64_t>(s->ndescs, kDescsPerFrame));
	{
		std::lock_guard<std::mutex> lk(fence_mu);
		s->forget_gen = forget_gen;
		if (s->has_notif && is_forgotten(s->notif))
			s->cancelled = true;
	}
	serves[{c->id, s->xid}] = s;
	c->serves.insert(s->xid);
	if (s->cancelled) {
		count(st.refused_forgotten);
		end_serve(s, -ESTALE);
		return true;
	}
	if (s->ndescs == 0)
		validate(s);
	return true;
}

bool Core::Impl::on_descs(Conn *c, Reader &r)
{
	uint64_t xid = r.u64();
	uint32_t n = r.u32();
	if (!r.ok || r.n != (size_t)n * kDescWire)
		return false;
	auto it = serves.find({c->id, xid});
	if (it == serves.end())
		return true; // ended already (refused, forgotten): its descriptors go nowhere
	auto s = it->second;
	if (s->validated || s->raw.size() + n > s->ndescs)
		return false;
	for (uint32_t i = 0; i < n; i++) {
		Span sp;
		sp.addr = (uintptr_t)r.u64();
		sp.len = r.u64();
		sp.dev = r.u64();
		s->raw.push_back(sp);
	}
	s->last = Clock::now();
	if (s->raw.size() == s->ndescs)
		validate(s);
	return true;
}

// Every descriptor must lie inside a region this engine registered and still has,
// on the same device; their bytes must add up to what the request said. Nothing
// of the initiator's is trusted.
void Core::Impl::validate(const std::shared_ptr<Serve> &s)
{
	std::map<const Region *, size_t> seen;
	uint64_t sum = 0;
	bool ok = true;
	{
		std::lock_guard<std::mutex> lk(regions_mu);
		for (const Span &sp : s->raw) {
			if (sp.len == 0)
				continue;
			if (sp.addr + sp.len < sp.addr || sum + sp.len < sum) {
				ok = false;
				break;
			}
			const std::shared_ptr<Region> *hit = nullptr;
			auto it = regions.upper_bound(sp.addr);
			while (it != regions.begin()) {
				--it;
				const auto &rg = it->second;
				if (!rg->dead.load() && rg->dev == sp.dev &&
				    sp.addr + sp.len <= rg->addr + rg->len) {
					hit = &rg;
					break;
				}
			}
			if (!hit) {
				ok = false;
				break;
			}
			if (s->stream.spans.empty()) {
				s->stream.vram = (*hit)->vram;
			} else if ((*hit)->vram != s->stream.vram) {
				ok = false; // GPU and host memory in one request: NIXL never posts it
				break;
			}
			if (!seen.count(hit->get())) {
				seen[hit->get()] = s->stream.regions.size();
				s->stream.regions.push_back(*hit);
			}
			s->stream.spans.push_back(sp);
			sum += sp.len;
		}
	}
	s->raw.clear();
	s->raw.shrink_to_fit();
	if (!ok || sum != s->total) {
		count(st.refused_descs);
		log_rl("refused", "%s: refused a %s from %s (%s): a descriptor outside this engine's "
		       "registered memory, or bytes that do not add up",
			 cfg.agent.c_str(), s->op == OP_READ ? "READ" : "WRITE", s->agent.c_str(),
			 conn_of(s->conn) ? conn_of(s->conn)->peer.c_str() : "?");
		s->stream = Stream();
		end_serve(s, -EACCES);
		return;
	}
	s->stream.index();
	s->validated = true;
	if (s->op == OP_WRITE) {
		if (s->total > max_room) {
			count(st.refused_other);
			log_rl("too-big", "%s: refused a WRITE of %llu bytes from %s: more than a room "
			       "holds here (%llu; max_room_bytes)",
			       cfg.agent.c_str(), (unsigned long long)s->total, s->agent.c_str(),
			       (unsigned long long)max_room);
			end_serve(s, -EMSGSIZE);
			return;
		}
		if (s->total == 0) {
			if (s->has_notif)
				push_notif(s->agent, s->notif);
			count(st.served_write);
			end_serve(s, 0);
			return;
		}
		serve_open_write_room(s);
	} else if (s->total == 0) {
		if (s->has_notif)
			push_notif(s->agent, s->notif);
		count(st.served_read);
		end_serve(s, 0);
	} else {
		serve_join_rooms(s);
	}
}

void Core::Impl::serve_open_write_room(const std::shared_ptr<Serve> &s)
{
	Conn *c = conn_of(s->conn);
	if (!c || s->ended)
		return;
	s->want_room = false;
	uint64_t ud = next_ud++;
	kvs_room *room = nullptr;
	kvs_room_desc d;
	int rc = recv_over_budget(s->total) ? -ENOBUFS : kvs_recv_open(kc, s->total, ud, &room, &d);
	if (rc == -EMFILE || rc == -ENFILE || rc == -ENOBUFS || rc == -EAGAIN) {
		s->want_room = true;
		s->retry_at = Clock::now() + ms(2);
		next_retry = std::min(next_retry, s->retry_at);
		return;
	}
	if (rc < 0) {
		end_serve(s, rc);
		return;
	}
	Job *j = new_job(room, true, ud, 0, s->total);
	j->s = s;
	s->jobs.push_back(ud);
	Writer w;
	w.u8(MSG_ROOM).u64(s->xid).u64(0).u64(s->total).bytes(d.bytes, sizeof(d.bytes));
	send_msg(c, std::move(w.b));
}

bool Core::Impl::on_room_for_read(Conn *c, uint64_t xid, uint64_t off, uint64_t len,
				  const kvs_room_desc &d)
{
	auto it = serves.find({c->id, xid});
	if (it == serves.end())
		return true; // ended already
	auto s = it->second;
	if (s->op != OP_READ || !s->validated || off != s->next_off || len == 0 ||
	    len > s->total - off)
		return false;
	s->next_off += len;
	s->pending.push_back({off, len, d});
	s->last = Clock::now();
	serve_join_rooms(s);
	return true;
}

void Core::Impl::serve_join_rooms(const std::shared_ptr<Serve> &s)
{
	s->want_room = false;
	while (!s->pending.empty() && !s->ended) {
		auto &p = s->pending.front();
		uint64_t ud = next_ud++;
		kvs_room *room = nullptr;
		int rc = kvs_send_open(kc, &p.desc, ud, &room);
		if (rc == -EMFILE || rc == -ENFILE || rc == -EAGAIN) {
			s->want_room = true;
			s->retry_at = Clock::now() + ms(2);
			next_retry = std::min(next_retry, s->retry_at);
			return;
		}
		if (rc == 0 && kvs_room_bytes(room) != p.len) {
			kvs_room_close(room);
			rc = -EPROTO;
		}
		if (rc < 0) {
			end_serve(s, rc);
			return;
		}
		Job *j = new_job(room, false, ud, p.off, p.len);
		j->s = s;
		s->jobs.push_back(ud);
		active.insert(ud);
		s->pending.pop_front();
	}
}

void Core::Impl::end_serve(const std::shared_ptr<Serve> &s, int status, bool tell)
{
	if (s->ended)
		return;
	s->ended = true;
	count(st.serves_ended);
	for (uint64_t ud : s->jobs)
		close_job(ud);
	s->jobs.clear();
	if (status < 0 && status != -ECONNRESET && status != -ECANCELED)
		count(st.serves_failed);
	if (status < 0 && cfg.notif_on_abort && s->op == OP_READ && s->has_notif && s->validated)
		push_notif(s->agent, s->notif);
	Conn *c = conn_of(s->conn);
	if (c) {
		c->serves.erase(s->xid);
		if (tell) {
			Writer w;
			w.u8(MSG_DONE).u64(s->xid).u32((uint32_t)status);
			send_msg(c, std::move(w.b));
		}
	}
	serves.erase({s->conn, s->xid});
}

// ==================================================================== rooms and copies

Job *Core::Impl::new_job(kvs_room *room, bool recv, uint64_t ud, uint64_t off, uint64_t len)
{
	auto j = std::make_unique<Job>();
	j->ud = ud;
	j->room = room;
	j->recv = recv;
	j->off = off;
	j->len = len;
	j->chunks = (unsigned)((len + slot - 1) / slot);
	if (recv)
		recv_open_bytes += len;
	Job *raw = j.get();
	jobs[ud] = std::move(j);
	return raw;
}

// Closes the room (an unfinished one is aborted: its final event still comes,
// and finds no job) and forgets the job. A lease it held is given back.
void Core::Impl::close_job(uint64_t ud)
{
	auto it = jobs.find(ud);
	if (it == jobs.end())
		return;
	Job &j = *it->second;
	if (j.pending)
		kvs_release(kc, &j.pl);
	if (j.room)
		kvs_room_close(j.room);
	if (j.recv) {
		recv_open_bytes -= j.len;
		next_retry = Clock::now(); // a room waiting for the budget may open now
	}
	active.erase(ud);
	jobs.erase(it);
}

void Core::Impl::drain_events()
{
	kvs_event ev[64];
	if (proxy_gone)
		return;
	for (;;) {
		int n = kvs_poll(kc, ev, 64);
		if (n <= 0) {
			if (n < 0 && n != -EAGAIN) {
				proxy_gone = true;
				if (!stop)
					log_line("%s: kvstaged: %s; transfers fail from now on",
						 cfg.agent.c_str(), kvs_strerror(n));
				// The proxy is gone: every room with it.
				std::vector<uint64_t> uds;
				for (auto &kv : jobs)
					uds.push_back(kv.first);
				for (uint64_t ud : uds) {
					auto it = jobs.find(ud);
					if (it != jobs.end())
						job_failed(*it->second, n);
				}
			}
			return;
		}
		for (int i = 0; i < n; i++)
			on_event(ev[i]);
		if (n < 64)
			return;
	}
}

void Core::Impl::on_event(const kvs_event &ev)
{
	auto it = jobs.find(ev.user_data);
	if (it == jobs.end()) {
		if (ev.type == KVS_EV_REJECTED)
			kvs_release(kc, &ev.lease);
		return;
	}
	Job &j = *it->second;
	switch (ev.type) {
	case KVS_EV_REJECTED:
		kvs_release(kc, &ev.lease);
		job_failed(j, ev.status ? ev.status : -EPROTO);
		return;
	case KVS_EV_SEND_DONE: {
		uint64_t ud = j.ud;
		if (j.x) {
			auto x = j.x;
			x->last = Clock::now();
			close_job(ud);
			x->jobs.erase(std::remove(x->jobs.begin(), x->jobs.end(), ud), x->jobs.end());
			maybe_complete(x);
		} else if (j.s) {
			auto s = j.s;
			s->sent += j.len;
			s->last = Clock::now();
			close_job(ud);
			s->jobs.erase(std::remove(s->jobs.begin(), s->jobs.end(), ud), s->jobs.end());
			if (s->sent == s->total) {
				if (s->has_notif) {
					push_notif(s->agent, s->notif);
				}
				count(st.served_read);
				end_serve(s, 0);
			}
		}
		return;
	}
	case KVS_EV_RECV_DONE:
		j.landed = true;
		if (j.x)
			j.x->last = Clock::now();
		if (j.s)
			j.s->last = Clock::now();
		active.insert(j.ud);
		return;
	case KVS_EV_ABORTED:
	case KVS_EV_FAILED:
	default:
		job_failed(j, ev.status ? ev.status : -ECANCELED);
		return;
	}
}

void Core::Impl::job_failed(Job &j, int err)
{
	if (j.x) {
		auto x = j.x;
		fail_xfer(x, err);
	} else if (j.s) {
		auto s = j.s;
		end_serve(s, err);
	} else {
		close_job(j.ud);
	}
}

void Core::Impl::step(Job &j, Clock::time_point now)
{
	if (j.recv)
		step_recv(j, now);
	else
		step_send(j, now);
}

void Core::Impl::step_send(Job &j, Clock::time_point now)
{
	if (j.retry_at > now)
		return;
	if (j.pending) {
		int rc = kvs_send(j.room, &j.pl, j.poff, j.plen);
		if (rc == -EAGAIN) {
			j.retry_at = now + ms(1);
			next_retry = std::min(next_retry, j.retry_at);
			return;
		}
		j.pending = false;
		if (rc < 0) {
			kvs_release(kc, &j.pl);
			job_failed(j, rc);
			return;
		}
		if (++j.next == j.chunks)
			active.erase(j.ud);
		return;
	}
	kvs_lease l;
	int rc = kvs_acquire(kc, 1, &l);
	if (rc == -ENOBUFS || rc == -EAGAIN) {
		j.backoff_ms = std::min(16u, j.backoff_ms ? j.backoff_ms * 2 : 1u);
		j.retry_at = now + ms(j.backoff_ms);
		next_retry = std::min(next_retry, j.retry_at);
		return;
	}
	if (rc < 0) {
		job_failed(j, rc);
		return;
	}
	j.backoff_ms = 0;
	uint64_t at = (uint64_t)j.next * slot;
	uint32_t n = (uint32_t)std::min<uint64_t>(slot, j.len - at);
	uint8_t *dst = (uint8_t *)kvs_lease_ptr(kc, &l);
	const Stream &src = j.x ? j.x->local : j.s->stream;
	gate(0);
	if (!dst || !begin_step(j)) {
		gate_after(0, false);
		kvs_release(kc, &l);
		count(st.steps_refused);
		if (j.s)
			count(st.serves_stopped);
		job_failed(j, -ECANCELED);
		return;
	}
	int crc = 0;
	if (src.vram)
		crc = copy_vram(src, j.off + at, n, l, true);
	else
		src.walk(j.off + at, n, [&](const uint8_t *p, uint64_t k) {
			memcpy(dst, p, k);
			dst += k;
		});
	end_step();
	gate_after(0, crc == 0);
	if (crc < 0) {
		kvs_release(kc, &l);
		job_failed(j, crc);
		return;
	}
	st.chunks_gathered++;
	st.bytes_gathered += n;
	stats_dirty = true;
	rc = kvs_send(j.room, &l, at, n);
	if (rc == -EAGAIN) {
		j.pending = true;
		j.pl = l;
		j.poff = at;
		j.plen = n;
		j.retry_at = now + ms(1);
		next_retry = std::min(next_retry, j.retry_at);
		return;
	}
	if (rc < 0) {
		kvs_release(kc, &l);
		job_failed(j, rc);
		return;
	}
	if (j.x)
		j.x->last = now;
	if (j.s)
		j.s->last = now;
	if (++j.next == j.chunks)
		active.erase(j.ud);
}

void Core::Impl::step_recv(Job &j, Clock::time_point now)
{
	if (!j.landed || j.retry_at > now)
		return;
	kvs_lease l;
	int rc = kvs_room_lease(j.room, j.next, &l);
	if (rc == -EAGAIN) {
		j.retry_at = now + ms(1);
		next_retry = std::min(next_retry, j.retry_at);
		return;
	}
	if (rc < 0) {
		job_failed(j, rc);
		return;
	}
	const uint8_t *src = (const uint8_t *)kvs_lease_ptr(kc, &l);
	uint64_t at = (uint64_t)j.next * slot;
	uint32_t n = (uint32_t)std::min<uint64_t>(slot, j.len - at);
	const Stream &dst = j.x ? j.x->local : j.s->stream;
	gate(1);
	if (!src || !begin_step(j)) {
		gate_after(1, false);
		count(st.steps_refused);
		if (j.s)
			count(st.serves_stopped);
		job_failed(j, -ECANCELED);
		return;
	}
	int crc = 0;
	if (dst.vram)
		crc = copy_vram(dst, j.off + at, n, l, false);
	else
		dst.walk(j.off + at, n, [&](uint8_t *p, uint64_t k) {
			memcpy(p, src, k);
			src += k;
		});
	end_step();
	gate_after(1, crc == 0);
	if (crc < 0) {
		job_failed(j, crc);
		return;
	}
	st.chunks_scattered++;
	st.bytes_scattered += n;
	stats_dirty = true;
	if (++j.next == j.chunks)
		recv_finished(j);
}

void Core::Impl::recv_finished(Job &j)
{
	uint64_t ud = j.ud;
	if (j.x) {
		auto x = j.x;
		x->landed += j.len;
		x->rooms_open--;
		x->last = Clock::now();
		close_job(ud);
		x->jobs.erase(std::remove(x->jobs.begin(), x->jobs.end(), ud), x->jobs.end());
		maybe_complete(x);
		if (!x->finished)
			open_segments(*x);
	} else if (j.s) {
		auto s = j.s;
		close_job(ud);
		s->jobs.erase(std::remove(s->jobs.begin(), s->jobs.end(), ud), s->jobs.end());
		if (s->has_notif)
			push_notif(s->agent, s->notif);
		count(st.served_write);
		end_serve(s, 0);
	}
}

// ==================================================================== the loop

void Core::Impl::run_cmds()
{
	uint64_t v;
	ssize_t r = read(efd, &v, sizeof(v));
	(void)r;
	std::deque<Cmd> todo;
	{
		std::lock_guard<std::mutex> lk(cmd_mu);
		todo.swap(cmds);
	}
	for (auto &c : todo) {
		switch (c.type) {
		case CMD_POST:
			count(st.posted);
			post(c.x);
			break;
		case CMD_CANCEL: // queued by a release while the transfer was in flight
			count(st.released_in_flight);
			fail_xfer(c.x, -ECANCELED);
			break;
		case CMD_NOTIF: {
			Endpoint e;
			bool found = false;
			{
				std::lock_guard<std::mutex> lk(agents_mu);
				auto it = agents.find(c.agent);
				if (it != agents.end()) {
					e = it->second;
					found = true;
				}
			}
			if (!found && c.agent == cfg.agent) {
				push_notif(cfg.agent, c.msg);
				break;
			}
			int rc = 0;
			Conn *cn = found ? dial(e, rc) : nullptr;
			if (!cn) {
				log_rl("notif", "%s: a notification to %s: no way to it",
				       cfg.agent.c_str(), c.agent.c_str());
				break;
			}
			Writer w;
			w.u8(MSG_NOTIF).str16(cfg.agent).str32(c.msg);
			send_msg(cn, std::move(w.b));
			count(st.notifs_out);
			break;
		}
		case CMD_REGION_DEAD:
		case CMD_FORGET: {
			// Requests that can no longer copy end now rather than at their next step.
			std::vector<std::shared_ptr<Xfer>> xs;
			std::vector<std::shared_ptr<Serve>> ss;
			{
				std::lock_guard<std::mutex> lk(fence_mu);
				for (auto &kv : xfers)
					if (kv.second->local.any_dead())
						xs.push_back(kv.second);
				for (auto &kv : serves) {
					Job probe;
					probe.s = kv.second;
					if (!may_copy(probe))
						ss.push_back(kv.second);
				}
			}
			for (auto &x : xs)
				fail_xfer(x, -ECANCELED);
			for (auto &s : ss) {
				count(st.serves_stopped);
				end_serve(s, -ESTALE);
			}
			break;
		}
		}
	}
}

void Core::Impl::retry_rooms(Clock::time_point now)
{
	if (now < next_retry)
		return;
	next_retry = Clock::time_point::max();
	std::vector<std::shared_ptr<Xfer>> xs;
	for (auto &kv : xfers)
		if (kv.second->want_room)
			xs.push_back(kv.second);
	for (auto &x : xs) {
		if (x->retry_at <= now && x->op == XFER_WRITE)
			join_write_room(x);
		else if (x->retry_at <= now)
			open_segments(*x);
		else
			next_retry = std::min(next_retry, x->retry_at);
	}
	std::vector<std::shared_ptr<Serve>> ss;
	for (auto &kv : serves)
		if (kv.second->want_room)
			ss.push_back(kv.second);
	for (auto &s : ss) {
		if (s->retry_at > now) {
			next_retry = std::min(next_retry, s->retry_at);
			continue;
		}
		if (s->op == OP_WRITE)
			serve_open_write_room(s);
		else
			serve_join_rooms(s);
	}
	for (uint64_t ud : active) {
		auto it = jobs.find(ud);
		if (it != jobs.end() && it->second->retry_at > now)
			next_retry = std::min(next_retry, it->second->retry_at);
	}
}

void Core::Impl::sweep(Clock::time_point now)
{
	if (now < sweep_at)
		return;
	sweep_at = now + ms(100);
	std::vector<Conn *> late;
	for (auto &kv : conns)
		if (!kv.second->killed && kv.second->st != C_UP && now > kv.second->deadline)
			late.push_back(kv.second.get());
	for (Conn *c : late) {
		count(st.handshake_timeouts);
		kill_conn(c, "no handshake within 5 s", true);
	}
	if (cfg.peer_timeout_ms) {
		std::vector<std::shared_ptr<Xfer>> xs;
		for (auto &kv : xfers)
			if (kv.second->jobs.empty() && now - kv.second->last > ms(cfg.peer_timeout_ms))
				xs.push_back(kv.second);
		for (auto &x : xs)
			fail_xfer(x, -ETIMEDOUT);
	}
	std::vector<std::shared_ptr<Serve>> ss;
	for (auto &kv : serves) {
		auto &s = kv.second;
		if ((cfg.serve_deadline_ms && now - s->born > ms(cfg.serve_deadline_ms)) ||
		    (cfg.peer_timeout_ms && s->jobs.empty() && now - s->last > ms(cfg.peer_timeout_ms)))
			ss.push_back(s);
	}
	for (auto &s : ss) {
		{
			std::lock_guard<std::mutex> lk(fence_mu);
			s->cancelled = true;
		}
		count(st.serves_stopped);
		end_serve(s, -ETIMEDOUT);
	}
	std::lock_guard<std::mutex> lk(fence_mu);
	while (!forgotten.empty() &&
	       (forgotten.size() > kMaxForgotten ||
		now - forgotten.front().first > ms(cfg.forget_ttl_ms)))
		forgotten.pop_front();
}

void Core::Impl::run()
{
	std::vector<pollfd> pf;
	std::vector<uint64_t> ids;
	while (!stop) {
		run_cmds();
		drain_events();
		auto now = Clock::now();
		retry_rooms(now);
		// Copy steps: one per job a round, so every request moves and a release is
		// answered between two steps.
		unsigned steps = 0;
		bool work = false;
		std::vector<uint64_t> act(active.begin(), active.end());
		for (uint64_t ud : act) {
			auto it = jobs.find(ud);
			if (it == jobs.end())
				continue;
			Job &j = *it->second;
			if (j.retry_at > now || (j.recv && !j.landed))
				continue;
			step(j, now);
			if (++steps >= kStepsPerRound)
				break;
		}
		for (uint64_t ud : active) {
			auto it = jobs.find(ud);
			if (it != jobs.end() && it->second->retry_at <= now &&
			    (!it->second->recv || it->second->landed)) {
				work = true;
				break;
			}
		}
		sweep(now);
		reap_conns();
		write_stats(false);

		pf.clear();
		ids.clear();
		pf.push_back({efd, POLLIN, 0});
		pf.push_back({proxy_gone ? -1 : kfd, POLLIN, 0});
		pf.push_back({lfd, POLLIN, 0});
		for (auto &kv : conns) {
			Conn *c = kv.second.get();
			short ev = POLLIN;
			if (c->st == C_CONNECTING || !c->tx.empty())
				ev |= POLLOUT;
			pf.push_back({c->fd, ev, 0});
			ids.push_back(c->id);
		}
		int timeout = 100;
		if (work)
			timeout = 0;
		else if (next_retry != Clock::time_point::max()) {
			auto d = std::chrono::duration_cast<ms>(next_retry - Clock::now()).count();
			timeout = (int)std::clamp<long long>(d + 1, 0, 100);
		}
		if (stats_dirty && !cfg.stats_file.empty())
			timeout = std::min(timeout, 50);
		int n = poll(pf.data(), pf.size(), timeout);
		if (n <= 0)
			continue;
		if (pf[2].revents & POLLIN)
			accept_all();
		for (size_t i = 3; i < pf.size(); i++) {
			if (!pf[i].revents)
				continue;
			Conn *c = conn_of(ids[i - 3]);
			if (c)
				conn_io(c, pf[i].revents);
		}
		reap_conns();
	}
	// Stopping: every room closed (an unfinished one aborted) and the connection
	// to kvstaged closed, here, on the thread that made them.
	for (auto &kv : jobs)
		if (kv.second->room)
			kvs_room_close(kv.second->room);
	jobs.clear();
	active.clear();
#ifdef KVS_NIXL_VRAM
	if (cstream)
		cudaStreamDestroy(cstream);
	cstream = nullptr;
#endif
	if (kc)
		kvs_close(kc); // undoes kvs_cuda_register too
	kc = nullptr;
}

// ==================================================================== the API

Core::Core(Impl *impl) : impl_(impl)
{
}

Core *Core::create(const Config &cfg, std::string &err)
{
	auto *impl = new Impl();
	impl->cfg = cfg;
	if (!impl->start(err)) {
		impl->shutdown();
		delete impl;
		return nullptr;
	}
	Core *c = new Core(impl);
	impl->self = c;
	std::lock_guard<std::mutex> lk(g_registry_mu);
	g_registry[cfg.agent] = c;
	return c;
}

Core::~Core()
{
	{
		std::lock_guard<std::mutex> lk(g_registry_mu);
		auto it = g_registry.find(impl_->cfg.agent);
		if (it != g_registry.end() && it->second == this)
			g_registry.erase(it);
	}
	impl_->shutdown();
	delete impl_;
}

int forget_for_agent(const std::string &agent, const std::string &prefix)
{
	// Under the registry's lock: the instance cannot be destroyed meanwhile (its
	// destructor takes the lock first); forget waits at most one copy step.
	std::lock_guard<std::mutex> lk(g_registry_mu);
	auto it = g_registry.find(agent);
	if (it == g_registry.end())
		return -ENOENT;
	it->second->forget(prefix);
	return 0;
}

std::string Core::conn_info() const
{
	return "kvstage-nixl 1 " + impl_->adv_host + " " + std::to_string(impl_->port);
}

int Core::load_remote(const std::string &agent, const std::string &info)
{
	char tag[32], host[256];
	unsigned ver, port;
	if (sscanf(info.c_str(), "%31s %u %255s %u", tag, &ver, host, &port) != 4 ||
	    strcmp(tag, "kvstage-nixl") != 0 || ver != 1 || port == 0 || port > 65535)
		return -EINVAL;
	addrinfo hints{}, *ai = nullptr;
	hints.ai_socktype = SOCK_STREAM;
	hints.ai_flags = AI_NUMERICSERV;
	if (getaddrinfo(host, std::to_string(port).c_str(), &hints, &ai) || !ai)
		return -EHOSTUNREACH;
	Endpoint e;
	memcpy(&e.addr, ai->ai_addr, ai->ai_addrlen);
	e.alen = ai->ai_addrlen;
	e.key = std::string(host) + ":" + std::to_string(port);
	freeaddrinfo(ai);
	std::lock_guard<std::mutex> lk(impl_->agents_mu);
	impl_->agents[agent] = e;
	return 0;
}

void Core::forget_remote(const std::string &agent)
{
	std::lock_guard<std::mutex> lk(impl_->agents_mu);
	impl_->agents.erase(agent);
}

bool Core::built_with_cuda()
{
#ifdef KVS_NIXL_VRAM
	return true;
#else
	return false;
#endif
}

std::shared_ptr<Region> Core::add_region(uintptr_t addr, uint64_t len, uint64_t dev, bool vram)
{
	auto r = std::make_shared<Region>();
	r->addr = addr;
	r->len = len;
	r->dev = dev;
	r->vram = vram;
	std::lock_guard<std::mutex> lk(impl_->regions_mu);
	impl_->regions.emplace(addr, r);
	return r;
}

void Core::remove_region(const std::shared_ptr<Region> &r)
{
	{
		std::unique_lock<std::mutex> lk(impl_->fence_mu);
		r->dead.store(true, std::memory_order_release);
		impl_->fence_cv.wait(lk, [&] { return !impl_->busy; });
	}
	{
		std::lock_guard<std::mutex> lk(impl_->regions_mu);
		auto range = impl_->regions.equal_range(r->addr);
		for (auto it = range.first; it != range.second; ++it)
			if (it->second == r) {
				impl_->regions.erase(it);
				break;
			}
	}
	impl_->queue({CMD_REGION_DEAD, nullptr, {}, {}});
}

std::shared_ptr<Xfer> Core::post(uint8_t op, std::vector<Span> local,
				 std::vector<std::shared_ptr<Region>> local_regions,
				 std::vector<Span> remote, const std::string &agent, bool has_notif,
				 std::string notif, int &rc)
{
	auto x = std::make_shared<Xfer>();
	x->id = impl_->next_xid++;
	x->op = op;
	x->agent = agent;
	x->local.spans = std::move(local);
	x->local.regions = std::move(local_regions);
	x->local.index();
	for (auto &r : x->local.regions)
		if (r->vram != x->local.regions.front()->vram) {
			rc = -EINVAL; // GPU and host memory in one list
			return nullptr;
		}
	x->local.vram = !x->local.regions.empty() && x->local.regions.front()->vram;
	x->remote = std::move(remote);
	x->has_notif = has_notif;
	x->notif = std::move(notif);
	uint64_t rt = 0;
	for (auto &s : x->remote)
		rt += s.len;
	if (op > XFER_WRITE || rt != x->local.total || x->remote.size() > kMaxDescs ||
	    agent.size() > kMaxAgent || x->notif.size() > kMaxNotif) {
		rc = -EINVAL;
		return nullptr;
	}
	if (x->local.any_dead()) {
		rc = -EINVAL;
		return nullptr;
	}
	rc = 0;
	impl_->queue({CMD_POST, x, {}, {}});
	return x;
}

int Core::status(const std::shared_ptr<Xfer> &x) const
{
	return x->status.load(std::memory_order_acquire);
}

void Core::release(const std::shared_ptr<Xfer> &x)
{
	{
		std::unique_lock<std::mutex> lk(impl_->fence_mu);
		x->cancelled = true;
		impl_->fence_cv.wait(lk, [&] { return impl_->busy_owner != x.get(); });
	}
	if (x->status.load(std::memory_order_acquire) == 1)
		impl_->queue({CMD_CANCEL, x, {}, {}});
}

void Core::take_notifs(std::vector<std::pair<std::string, std::string>> &out)
{
	std::lock_guard<std::mutex> lk(impl_->notif_mu);
	for (auto &n : impl_->notifs)
		out.push_back(std::move(n));
	impl_->notifs.clear();
}

int Core::gen_notif(const std::string &agent, const std::string &msg)
{
	if (msg.size() > kMaxNotif || agent.size() > kMaxAgent)
		return -EINVAL;
	{
		std::lock_guard<std::mutex> lk(impl_->agents_mu);
		if (!impl_->agents.count(agent) && agent != impl_->cfg.agent)
			return -ENOENT;
	}
	impl_->queue({CMD_NOTIF, nullptr, agent, msg});
	return 0;
}

void Core::forget(const std::string &prefix)
{
	{
		std::unique_lock<std::mutex> lk(impl_->fence_mu);
		impl_->forgotten.emplace_back(Clock::now(), prefix);
		impl_->forget_gen++;
		impl_->fence_cv.wait(lk, [&] { return !impl_->busy; });
	}
	impl_->queue({CMD_FORGET, nullptr, {}, {}});
}

} // namespace kvsnixl
