// SPDX-License-Identifier: MIT
// libplugin_KVSTAGE.so: NIXL's nixlBackendEngine over kvstage (docs/nixl.md).
// This file adapts NIXL's classes to the core (core.hpp), which owns the
// progress thread; every method here runs on an engine thread and only
// queues work or reads state.
#include "core.hpp"

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "backend/backend_engine.h"
#include "backend/backend_plugin.h"

namespace {

using kvsnixl::Core;
using kvsnixl::Region;
using kvsnixl::Span;

// What registerMem hands NIXL: the region (its fence lives in the core).
struct RegionMD : public nixlBackendMD {
	explicit RegionMD(std::shared_ptr<Region> r) : nixlBackendMD(true), region(std::move(r))
	{
	}
	std::shared_ptr<Region> region;
};

// What loadRemoteMD/loadLocalMD hand NIXL for the other side's descriptors:
// nothing to know beyond the agent (the target checks every descriptor itself).
struct RemoteMD : public nixlBackendMD {
	explicit RemoteMD(std::string a) : nixlBackendMD(false), agent(std::move(a))
	{
	}
	std::string agent;
};

struct ReqH : public nixlBackendReqH {
	std::shared_ptr<kvsnixl::Xfer> x;
};

std::string param(const nixl_b_params_t &p, const char *name, const char *env,
		  const std::string &dflt)
{
	auto it = p.find(name);
	if (it != p.end() && !it->second.empty())
		return it->second;
	const char *e = env ? getenv(env) : nullptr;
	if (e && *e)
		return e;
	return dflt;
}

bool to_uint(const std::string &s, uint64_t &out)
{
	if (s.empty())
		return false;
	char *end = nullptr;
	errno = 0;
	unsigned long long v = strtoull(s.c_str(), &end, 10);
	if (errno || *end || s[0] == '-')
		return false;
	out = v;
	return true;
}

nixl_status_t to_status(int rc)
{
	switch (rc) {
	case 1:
		return NIXL_IN_PROG;
	case 0:
		return NIXL_SUCCESS;
	case -EINVAL:
	case -EACCES:
	case -EMSGSIZE:
		return NIXL_ERR_INVALID_PARAM;
	case -ECANCELED:
	case -ESTALE:
		return NIXL_ERR_CANCELED;
	default:
		return NIXL_ERR_BACKEND;
	}
}

class nixlKvstageEngine : public nixlBackendEngine {
      public:
	explicit nixlKvstageEngine(const nixlBackendInitParams *init) : nixlBackendEngine(init)
	{
		const nixl_b_params_t &p = *init->customParams;
		kvsnixl::Config cfg;
		cfg.agent = localAgent;
		cfg.socket = param(p, "socket", "KVSTAGE_SOCKET", "");
		cfg.secret_file = param(p, "peer_secret_file", nullptr, "");
		cfg.listen = param(p, "listen", "KVSTAGE_NIXL_LISTEN", "127.0.0.1:0");
		cfg.advertise = param(p, "advertise", "KVSTAGE_NIXL_ADVERTISE", "");
		cfg.stats_file = param(p, "stats_file", "KVSTAGE_NIXL_STATS", "");
		cfg.gate = param(p, "test_gate", "KVSTAGE_NIXL_TEST_GATE", "");
		struct {
			const char *name, *env;
			uint64_t *u64;
			unsigned *u32;
		} nums[] = {
			{"max_room_bytes", "KVSTAGE_NIXL_MAX_ROOM_BYTES", &cfg.max_room_bytes, nullptr},
			{"read_window", "KVSTAGE_NIXL_READ_WINDOW", nullptr, &cfg.read_window},
			{"peer_timeout_ms", "KVSTAGE_NIXL_PEER_TIMEOUT_MS", nullptr,
			 &cfg.peer_timeout_ms},
			{"serve_deadline_ms", "KVSTAGE_NIXL_SERVE_DEADLINE_MS", nullptr,
			 &cfg.serve_deadline_ms},
			{"forget_ttl_ms", "KVSTAGE_NIXL_FORGET_TTL_MS", nullptr, &cfg.forget_ttl_ms},
		};
		for (auto &n : nums) {
			std::string v = param(p, n.name, n.env, "");
			if (v.empty())
				continue;
			uint64_t u;
			if (!to_uint(v, u) || (n.u32 && u > 0xffffffffu)) {
				NIXL_ERROR << "KVSTAGE backend: " << n.name << "=" << v
					   << " is not a number";
				initErr = true;
				return;
			}
			if (n.u64)
				*n.u64 = u;
			else
				*n.u32 = (unsigned)u;
		}
		std::string noa = param(p, "notif_on_abort", "KVSTAGE_NIXL_NOTIF_ON_ABORT", "0");
		cfg.notif_on_abort = noa == "1" || noa == "true" || noa == "yes";
		std::string vram = param(p, "vram", "KVSTAGE_NIXL_VRAM", "0");
		cfg.vram = vram == "1" || vram == "true" || vram == "yes";
		vram_ = cfg.vram;
		std::string err;
		core_.reset(Core::create(cfg, err));
		if (!core_) {
			NIXL_ERROR << "KVSTAGE backend: " << err;
			initErr = true;
		}
	}

	bool supportsRemote() const override
	{
		return true;
	}
	bool supportsLocal() const override
	{
		return true;
	}
	bool supportsNotif() const override
	{
		return true;
	}
	nixl_mem_list_t getSupportedMems() const override
	{
		if (vram_)
			return {DRAM_SEG, VRAM_SEG};
		return {DRAM_SEG};
	}
	bool takes(nixl_mem_t m) const
	{
		return m == DRAM_SEG || (vram_ && m == VRAM_SEG);
	}

	nixl_status_t registerMem(const nixlBlobDesc &mem, const nixl_mem_t &nixl_mem,
				  nixlBackendMD *&out) override
	{
		if (!takes(nixl_mem))
			return NIXL_ERR_NOT_SUPPORTED;
		if (!mem.len || mem.addr + mem.len < mem.addr)
			return NIXL_ERR_INVALID_PARAM;
		out = new RegionMD(
			core_->add_region(mem.addr, mem.len, mem.devId, nixl_mem == VRAM_SEG));
		return NIXL_SUCCESS;
	}

	nixl_status_t deregisterMem(nixlBackendMD *meta) override
	{
		auto *md = dynamic_cast<RegionMD *>(meta);
		if (!md)
			return NIXL_ERR_INVALID_PARAM;
		core_->remove_region(md->region); // the fence: no copy touches it after this
		delete md;
		return NIXL_SUCCESS;
	}

	nixl_status_t connect(const std::string &) override
	{
		return NIXL_SUCCESS; // the control connection is made on the first transfer
	}
	nixl_status_t disconnect(const std::string &remote_agent) override
	{
		if (remote_agent != localAgent)
			core_->forget_remote(remote_agent);
		return NIXL_SUCCESS;
	}

	nixl_status_t unloadMD(nixlBackendMD *input) override
	{
		delete dynamic_cast<RemoteMD *>(input); // a RegionMD is deregisterMem's
		return NIXL_SUCCESS;
	}

	nixl_status_t getPublicData(const nixlBackendMD *, std::string &str) const override
	{
		str = "kvstage";
		return NIXL_SUCCESS;
	}
	nixl_status_t getConnInfo(std::string &str) const override
	{
		str = core_->conn_info();
		return NIXL_SUCCESS;
	}
	nixl_status_t loadRemoteConnInfo(const std::string &remote_agent,
					 const std::string &info) override
	{
		int rc = core_->load_remote(remote_agent, info);
		if (rc < 0) {
			NIXL_ERROR << "KVSTAGE backend: connection info of " << remote_agent << " ("
				   << info << "): " << strerror(-rc);
			return NIXL_ERR_INVALID_PARAM;
		}
		return NIXL_SUCCESS;
	}
	nixl_status_t loadRemoteMD(const nixlBlobDesc &, const nixl_mem_t &nixl_mem,
				   const std::string &remote_agent, nixlBackendMD *&output) override
	{
		if (!takes(nixl_mem))
			return NIXL_ERR_NOT_SUPPORTED;
		output = new RemoteMD(remote_agent);
		return NIXL_SUCCESS;
	}
	nixl_status_t loadLocalMD(nixlBackendMD *, nixlBackendMD *&output) override
	{
		output = new RemoteMD(localAgent);
		return NIXL_SUCCESS;
	}

	nixl_status_t prepXfer(const nixl_xfer_op_t &op, const nixl_meta_dlist_t &local,
			       const nixl_meta_dlist_t &remote, const std::string &,
			       nixlBackendReqH *&handle, const nixl_opt_b_args_t *) const override
	{
		if ((op != NIXL_READ && op != NIXL_WRITE) || local.descCount() != remote.descCount() ||
		    !takes(local.getType()) || !takes(remote.getType()))
			return NIXL_ERR_INVALID_PARAM;
		handle = new ReqH();
		return NIXL_SUCCESS;
	}

	nixl_status_t postXfer(const nixl_xfer_op_t &op, const nixl_meta_dlist_t &local,
			       const nixl_meta_dlist_t &remote, const std::string &remote_agent,
			       nixlBackendReqH *&handle, const nixl_opt_b_args_t *opt) const override
	{
		auto *h = static_cast<ReqH *>(handle);
		if (!h || (op != NIXL_READ && op != NIXL_WRITE) ||
		    local.descCount() != remote.descCount())
			return NIXL_ERR_INVALID_PARAM;
		if (h->x && core_->status(h->x) == 1)
			return NIXL_ERR_REPOST_ACTIVE;
		size_t n = (size_t)local.descCount();
		std::vector<Span> ls, rs;
		std::vector<std::shared_ptr<Region>> regions;
		ls.reserve(n);
		rs.reserve(n);
		const Region *last = nullptr;
		for (size_t i = 0; i < n; i++) {
			const nixlMetaDesc &l = local[i];
			const nixlMetaDesc &r = remote[i];
			auto *md = dynamic_cast<RegionMD *>(l.metadataP);
			if (!md || l.len != r.len || l.addr < md->region->addr ||
			    l.addr + l.len > md->region->addr + md->region->len ||
			    l.addr + l.len < l.addr)
				return NIXL_ERR_INVALID_PARAM;
			if (md->region.get() != last) {
				last = md->region.get();
				bool have = false;
				for (auto &g : regions)
					have |= g.get() == last;
				if (!have)
					regions.push_back(md->region);
			}
			ls.push_back({l.addr, l.len, l.devId});
			rs.push_back({r.addr, r.len, r.devId});
		}
		int rc = 0;
		bool has_notif = opt && opt->hasNotif;
		auto x = core_->post(op == NIXL_READ ? kvsnixl::XFER_READ : kvsnixl::XFER_WRITE,
				     std::move(ls), std::move(regions), std::move(rs), remote_agent,
				     has_notif, has_notif ? opt->notifMsg : std::string(), rc);
		if (!x)
			return to_status(rc);
		h->x = std::move(x);
		return NIXL_IN_PROG;
	}

	nixl_status_t checkXfer(nixlBackendReqH *handle) const override
	{
		auto *h = static_cast<ReqH *>(handle);
		if (!h || !h->x)
			return NIXL_ERR_INVALID_PARAM;
		return to_status(core_->status(h->x));
	}

	nixl_status_t releaseReqH(nixlBackendReqH *handle) const override
	{
		auto *h = static_cast<ReqH *>(handle);
		if (!h)
			return NIXL_SUCCESS;
		if (h->x)
			core_->release(h->x); // within one copy step; nothing of it lands after
		delete h;
		return NIXL_SUCCESS;
	}

	nixl_status_t getNotifs(notif_list_t &notif_list) override
	{
		core_->take_notifs(notif_list);
		return NIXL_SUCCESS;
	}

	nixl_status_t genNotif(const std::string &remote_agent, const std::string &msg) const override
	{
		int rc = core_->gen_notif(remote_agent, msg);
		return rc < 0 ? NIXL_ERR_NOT_FOUND : NIXL_SUCCESS;
	}

      private:
	std::unique_ptr<Core> core_;
	bool vram_ = false;
};

nixl_b_params_t kvstage_options()
{
	// Every one may be left empty: then its environment variable, else its default
	// (docs/nixl.md, "Parameters"). vLLM creates backends with no parameters.
	return {
		{"socket", ""},		   // $KVSTAGE_SOCKET, else kvstaged's default socket
		{"peer_secret_file", ""},  // $KVSTAGE_PEER_SECRET_FILE, else $KVSTAGE_PEER_SECRET
		{"listen", ""},		   // $KVSTAGE_NIXL_LISTEN, else 127.0.0.1:0
		{"advertise", ""},	   // $KVSTAGE_NIXL_ADVERTISE, else listen's host
		{"max_room_bytes", ""},	   // a quarter of the pool
		{"read_window", ""},	   // 2
		{"peer_timeout_ms", ""},   // 30000
		{"serve_deadline_ms", ""}, // 0: none
		{"forget_ttl_ms", ""},	   // 600000
		{"notif_on_abort", ""},	   // 0
		{"stats_file", ""},	   // none
		{"vram", ""},		   // 0: VRAM_SEG refused (opt-in; needs a CUDA build)
	};
}

} // namespace

using kvstage_plugin_t = nixlBackendPluginCreator<nixlKvstageEngine>;

extern "C" NIXL_PLUGIN_EXPORT nixlBackendPlugin *nixl_plugin_init()
{
	return kvstage_plugin_t::create(NIXL_PLUGIN_API_VERSION, "KVSTAGE", "0.1.0",
					kvstage_options(),
					kvsnixl::Core::built_with_cuda()
						? nixl_mem_list_t{DRAM_SEG, VRAM_SEG}
						: nixl_mem_list_t{DRAM_SEG});
}

extern "C" NIXL_PLUGIN_EXPORT void nixl_plugin_fini()
{
}

// The target's hook (docs/nixl.md, "What a target must do"): the engine whose
// local agent is `agent` refuses every request whose notification message starts
// with the len bytes at prefix, and stops the one it serves within a copy step.
// Returns 0, or -ENOENT (no KVSTAGE backend of that agent in this process).
extern "C" NIXL_PLUGIN_EXPORT int kvstage_nixl_forget(const char *agent, const void *prefix,
						      size_t len)
{
	if (!agent || (!prefix && len))
		return -EINVAL;
	return kvsnixl::forget_for_agent(agent, std::string((const char *)prefix, len));
}
