// SPDX-License-Identifier: MIT
// Rooms and copies: kvstaged's events, and every copy step between engine memory and slots.
#include "impl.hpp"

namespace kvsnixl {

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

} // namespace kvsnixl
