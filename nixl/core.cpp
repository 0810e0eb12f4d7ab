// SPDX-License-Identifier: MIT
// The KVSTAGE NIXL backend's progress thread: set-up, the fence, the loop and the API (impl.hpp).
#include "impl.hpp"

namespace kvsnixl {

// The backends of this process by their local agent's name (forget_for_agent).
static std::mutex g_registry_mu;
static std::map<std::string, Core *> g_registry;

void log_line(const char *fmt, ...)
{
	char buf[1024];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(buf, sizeof(buf), fmt, ap);
	va_end(ap);
	fprintf(stderr, "kvstage nixl: %s\n", buf);
}

static struct {
	std::mutex mu;
	std::map<std::string, std::pair<Clock::time_point, unsigned>> last;
} g_ratelog; // log_rl's: when each kind last spoke, and how many it left out since

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
