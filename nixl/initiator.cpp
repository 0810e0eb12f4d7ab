// SPDX-License-Identifier: MIT
// The initiator's side of a transfer: its request, its rooms, its end.
#include "impl.hpp"

namespace kvsnixl {

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

} // namespace kvsnixl
