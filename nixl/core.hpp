// SPDX-License-Identifier: MIT
// The KVSTAGE NIXL backend's core: one progress thread per backend engine owns
// the kvs_client, the control channel's sockets and every copy between engine
// memory and staging slots. Engine threads only queue work and read state.
// No NIXL header here (nixl/kvstage_backend.cpp adapts NIXL's classes to it);
// the protocol is docs/nixl.md's.
#ifndef KVS_NIXL_CORE_HPP
#define KVS_NIXL_CORE_HPP

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace kvsnixl {

// A region of engine memory the engine registered (registerMem). dead is set
// by deregisterMem before it returns: no copy step touching the region starts
// after that, and the one running when it was set has ended.
struct Region {
	uintptr_t addr = 0;
	uint64_t len = 0;
	uint64_t dev = 0;
	bool vram = false; // GPU memory (VRAM_SEG): copied by libkvstage_cuda
	std::atomic<bool> dead{false};
};

// One descriptor: addr, len, devId.
struct Span {
	uintptr_t addr;
	uint64_t len;
	uint64_t dev;
};

struct Config {
	std::string agent;		// the local agent's name (notifications name it)
	std::string socket;		// kvstaged's socket ("" : $KVSTAGE_SOCKET or the default)
	std::string secret_file;	// "" : $KVSTAGE_PEER_SECRET_FILE, else $KVSTAGE_PEER_SECRET
	std::string listen = "127.0.0.1:0"; // the control channel's listening address
	std::string advertise;		// the host peers dial ("" : listen's host)
	uint64_t max_room_bytes = 0;	// a room's bytes at most (0: a quarter of the pool)
	unsigned read_window = 2;	// READ: rooms of one request open at once
	unsigned peer_timeout_ms = 30000; // a request waiting on its peer this long fails
	unsigned serve_deadline_ms = 0;	  // target: a request not done this long after it came is dropped (0: none)
	unsigned forget_ttl_ms = 600000;  // how long a forgotten notification prefix is remembered
	bool notif_on_abort = false;	  // READ target: notify also when its copy-out stopped short
	bool vram = false;		  // take VRAM_SEG too (opt-in: no GPU has run it; docs/nixl.md)
	std::string stats_file;		  // counters as JSON, rewritten as they change
	std::string gate;		  // test only: "DIR:PHASE:N" (docs/nixl.md, "Tests")
};

struct Xfer; // one posted transfer of an initiator (opaque)

enum : uint8_t { XFER_READ = 0, XFER_WRITE = 1 };

class Core {
      public:
	// Starts the progress thread (connects to kvstaged, listens). nullptr and why in err.
	static Core *create(const Config &cfg, std::string &err);
	~Core(); // stops the thread: every room closed, the connection to kvstaged closed

	Core(const Core &) = delete;
	Core &operator=(const Core &) = delete;

	// "kvstage-nixl 1 HOST PORT": what a peer's load_remote takes.
	std::string conn_info() const;
	// A peer's conn_info under its agent name. 0, or -EINVAL (not ours), -errno.
	int load_remote(const std::string &agent, const std::string &info);
	void forget_remote(const std::string &agent);

	std::shared_ptr<Region> add_region(uintptr_t addr, uint64_t len, uint64_t dev, bool vram);
	// Whether this build can copy GPU memory (libkvstage_cuda linked in).
	static bool built_with_cuda();
	// The fence of a region: returns once no copy step touches it any more, and
	// none ever will; requests touching it fail.
	void remove_region(const std::shared_ptr<Region> &r);

	// Posts a transfer: local spans (each inside regions[reg[i]], one of local_regions),
	// remote spans on the agent's side. Returns the transfer, or nullptr and a negative
	// errno in rc (-EINVAL: the lists do not match, a span outside its region).
	std::shared_ptr<Xfer> post(uint8_t op, std::vector<Span> local,
				   std::vector<std::shared_ptr<Region>> local_regions,
				   std::vector<Span> remote, const std::string &agent,
				   bool has_notif, std::string notif, int &rc);
	// 1 in progress, 0 done (READ: the bytes are in the local pages; WRITE: in the
	// target's), or a negative errno.
	int status(const std::shared_ptr<Xfer> &x) const;
	// The initiator's fence: returns within one copy step; from then on nothing
	// of x touches the local pages (its rooms are aborted, the target told).
	void release(const std::shared_ptr<Xfer> &x);

	// Notifications that arrived: (agent, message), oldest first.
	void take_notifs(std::vector<std::pair<std::string, std::string>> &out);
	// Sends msg to agent's backend as a notification. 0 or -errno (unknown agent).
	int gen_notif(const std::string &agent, const std::string &msg);
	// The target's hook: requests whose notification message starts with prefix are
	// refused from now on (for forget_ttl_ms), and one being served stops within a
	// copy step: after this returns nothing of them touches this engine's memory.
	void forget(const std::string &prefix);

	struct Impl;

      private:
	explicit Core(Impl *impl);
	Impl *impl_;
};

// Core::forget on the backend instance of this process whose local agent is
// named agent (the C hook kvstage_nixl_forget). 0, or -ENOENT (none).
int forget_for_agent(const std::string &agent, const std::string &prefix);

} // namespace kvsnixl
#endif
