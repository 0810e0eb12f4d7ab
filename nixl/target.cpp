// SPDX-License-Identifier: MIT
// The target's side: a request checked against the registered regions, served, ended.
#include "impl.hpp"

namespace kvsnixl {

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

} // namespace kvsnixl
