// SPDX-License-Identifier: MIT
// The KVSTAGE NIXL backend's progress thread, shared by its parts (no NIXL header):
// core.cpp (set-up, the fence, the loop, the API), channel.cpp (the control
// channel's connections), initiator.cpp, target.cpp, rooms.cpp (rooms and copies).
#ifndef KVS_NIXL_IMPL_HPP
#define KVS_NIXL_IMPL_HPP
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

// One line to stderr, "kvstage nixl: ..." (core.cpp).
void log_line(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
// At most one line a second for each kind; the next one says how many were left out.
void log_rl(const char *kind, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
// "HOST:PORT" (HOST may be [v6]). false if it is not that.
bool split_hostport(const std::string &s, std::string &host, std::string &port);

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

} // namespace kvsnixl
#endif
