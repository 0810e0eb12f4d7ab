// SPDX-License-Identifier: MIT
// libplugin_KVSZCOPY.so: a TEST-ONLY NIXL backend that moves bytes the zero-copy
// way, straight between registered pages (a loopback in one process standing in
// for a NIC's DMA), never installed. Like a posted RDMA operation, a posted
// transfer runs to its end on its worker thread whatever happens to its handle:
// releaseReqH returns NIXL_SUCCESS at once and does not stop it (UCX cancels the
// request and returns; libfabric, UCCL and Mooncake forget the handle). The
// release tests (tests/nixl/test_release.py) run the same scenario through it and
// through KVSTAGE, held by the same test gate (KVSTAGE_NIXL_TEST_GATE=DIR:scatter:N,
// the Nth 64 KiB step writing into the initiator's pages): this one is shown
// writing after its release; KVSTAGE is not.
#include <atomic>
#include <cstring>
#include <fcntl.h>
#include <memory>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include "backend/backend_engine.h"
#include "backend/backend_plugin.h"

namespace {

constexpr size_t kStep = 65536;

struct MD : public nixlBackendMD {
	MD() : nixlBackendMD(true)
	{
	}
};

struct Job {
	std::vector<std::pair<uint8_t *, const uint8_t *>> at; // (dst, src) per descriptor
	std::vector<size_t> len;
	std::atomic<int> status{NIXL_IN_PROG};
};

struct ReqH : public nixlBackendReqH {
	std::shared_ptr<Job> job;
};

// The test gate, as nixl/core.cpp has it (docs/nixl.md, "Tests").
struct Gate {
	std::string dir;
	unsigned n = 0, count = 0;
	int w = -1;
	Gate()
	{
		const char *g = getenv("KVSTAGE_NIXL_TEST_GATE");
		if (!g)
			return;
		std::string s = g;
		size_t a = s.rfind(':'), b = a == std::string::npos ? a : s.rfind(':', a - 1);
		if (b == std::string::npos || s.substr(b + 1, a - b - 1) != "scatter")
			return;
		dir = s.substr(0, b);
		n = (unsigned)strtoul(s.c_str() + a + 1, nullptr, 10);
	}
	void before()
	{
		if (dir.empty() || ++count != n)
			return;
		w = open((dir + "/reached").c_str(), O_WRONLY | O_CLOEXEC);
		std::string line = "reached scatter " + std::to_string(n) + "\n";
		if (w >= 0 && write(w, line.data(), line.size()) < 0)
			return;
		int r = open((dir + "/open").c_str(), O_RDONLY | O_CLOEXEC);
		char c;
		if (r >= 0 && read(r, &c, 1) >= 0)
			close(r);
	}
	void after()
	{
		if (w < 0)
			return;
		const char *line = "passed copied\n"; // a posted operation cannot be recalled
		if (write(w, line, strlen(line)) < 0)
			return;
		close(w);
		w = -1;
	}
};

class ZcopyEngine : public nixlBackendEngine {
      public:
	explicit ZcopyEngine(const nixlBackendInitParams *init) : nixlBackendEngine(init)
	{
	}
	~ZcopyEngine() override
	{
		for (auto &t : workers_)
			t.join();
	}
	bool supportsRemote() const override
	{
		return false;
	}
	bool supportsLocal() const override
	{
		return true;
	}
	bool supportsNotif() const override
	{
		return false;
	}
	nixl_mem_list_t getSupportedMems() const override
	{
		return {DRAM_SEG};
	}
	nixl_status_t registerMem(const nixlBlobDesc &, const nixl_mem_t &, nixlBackendMD *&out) override
	{
		out = new MD();
		return NIXL_SUCCESS;
	}
	nixl_status_t deregisterMem(nixlBackendMD *meta) override
	{
		delete meta; // and the posted work goes on, as a NIC's would until the region is invalidated
		return NIXL_SUCCESS;
	}
	nixl_status_t connect(const std::string &) override
	{
		return NIXL_SUCCESS;
	}
	nixl_status_t disconnect(const std::string &) override
	{
		return NIXL_SUCCESS;
	}
	nixl_status_t unloadMD(nixlBackendMD *input) override
	{
		delete input;
		return NIXL_SUCCESS;
	}
	nixl_status_t loadLocalMD(nixlBackendMD *, nixlBackendMD *&output) override
	{
		output = new MD();
		return NIXL_SUCCESS;
	}
	nixl_status_t prepXfer(const nixl_xfer_op_t &, const nixl_meta_dlist_t &, const nixl_meta_dlist_t &,
			       const std::string &, nixlBackendReqH *&handle,
			       const nixl_opt_b_args_t *) const override
	{
		handle = new ReqH();
		return NIXL_SUCCESS;
	}
	nixl_status_t postXfer(const nixl_xfer_op_t &op, const nixl_meta_dlist_t &local,
			       const nixl_meta_dlist_t &remote, const std::string &, nixlBackendReqH *&handle,
			       const nixl_opt_b_args_t *) const override
	{
		auto job = std::make_shared<Job>();
		for (int i = 0; i < local.descCount(); i++) {
			uint8_t *l = (uint8_t *)local[i].addr, *r = (uint8_t *)remote[i].addr;
			job->at.push_back(op == NIXL_READ ? std::make_pair(l, (const uint8_t *)r)
							  : std::make_pair(r, (const uint8_t *)l));
			job->len.push_back(local[i].len);
		}
		static_cast<ReqH *>(handle)->job = job;
		gate_ = gate_ ? gate_ : std::make_shared<Gate>();
		auto gate = gate_;
		workers_.emplace_back([job, gate] {
			for (size_t i = 0; i < job->at.size(); i++)
				for (size_t off = 0; off < job->len[i]; off += kStep) {
					gate->before();
					memcpy(job->at[i].first + off, job->at[i].second + off,
					       std::min(kStep, job->len[i] - off));
					gate->after();
				}
			job->status = NIXL_SUCCESS;
		});
		return NIXL_IN_PROG;
	}
	nixl_status_t checkXfer(nixlBackendReqH *handle) const override
	{
		return (nixl_status_t) static_cast<ReqH *>(handle)->job->status.load();
	}
	nixl_status_t releaseReqH(nixlBackendReqH *handle) const override
	{
		delete static_cast<ReqH *>(handle); // returns at once; the worker holds the job
		return NIXL_SUCCESS;
	}

      private:
	mutable std::vector<std::thread> workers_;
	mutable std::shared_ptr<Gate> gate_;
};

} // namespace

using zcopy_plugin_t = nixlBackendPluginCreator<ZcopyEngine>;

extern "C" NIXL_PLUGIN_EXPORT nixlBackendPlugin *nixl_plugin_init()
{
	return zcopy_plugin_t::create(NIXL_PLUGIN_API_VERSION, "KVSZCOPY", "0.1.0", {}, {DRAM_SEG});
}

extern "C" NIXL_PLUGIN_EXPORT void nixl_plugin_fini()
{
}
