// SPDX-License-Identifier: MIT
// The control channel between backends: dialing, accepting, the handshake, framing (docs/nixl.md).
#include "impl.hpp"

namespace kvsnixl {

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

} // namespace kvsnixl
