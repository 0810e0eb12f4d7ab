"""One engine process for the NIXL tests: a NIXL agent with the KVSTAGE backend, driven the way vLLM's
NixlConnector drives it (nixl_agent, register_memory, get_xfer_descs, prep_xfer_dlist, make_prepped_xfer,
transfer, check_xfer_state, release_xfer_handle, get_new_notifs), commanded over a pipe by the test
(nixlkit.Engine). Its "KV cache" is numpy arrays, one region per layer and K/V, blocks of block_len bytes;
descriptor i of a region list is block (i % blocks) of region (i // blocks), as vLLM numbers them.

Runs in a child started with multiprocessing's spawn: the environment (KVSTAGE_SOCKET, the peer secret,
NIXL_PLUGIN_DIR, test gates) is set before nixl is imported."""
import hashlib
import os
import time
import traceback


class _Engine:
    def __init__(self):
        self.agent = None
        self.name = None
        self.backend = "KVSTAGE"
        self.regions = []  # numpy arrays, or gpu.Buffer (mem "VRAM")
        self.mem = "DRAM"
        self.reg_descs = None
        self.blocks = self.block_len = 0
        self.dlists = {}  # id -> prepped dlist handle
        self.xfers = {}  # id -> xfer handle
        self.next_id = 1
        self._notifs = []  # (agent, bytes)

    # -- set-up -----------------------------------------------------------------------------------
    def init(self, name, params=None, backend="KVSTAGE"):
        """A nixl_agent with one backend (KVSTAGE, or the test-only KVSZCOPY): params None creates it as vLLM
        does (nixl_agent_config(backends=[...]), no parameters), else create_backend(backend, params)."""
        from nixl._api import nixl_agent, nixl_agent_config
        if params is None:
            self.agent = nixl_agent(name, nixl_agent_config(backends=[backend]))
        else:
            self.agent = nixl_agent(name, nixl_agent_config(backends=[]))
            self.agent.create_backend(backend, params)
        if backend not in self.agent.backends:
            raise RuntimeError(f"no {backend} backend: " + repr(self.agent.backends))
        self.name, self.backend = name, backend
        return {"name": name, "params": self.agent.get_backend_params(backend)}

    def alloc(self, regions, blocks, block_len, seed=None, mem="DRAM"):
        """regions of blocks x block_len bytes, registered as mem: DRAM (numpy) or VRAM (gpu.Buffer, device 0)."""
        import numpy as np
        self.blocks, self.block_len, self.mem = blocks, block_len, mem
        host = [np.zeros(blocks * block_len, dtype=np.uint8) for _ in range(regions)]
        if seed is not None:
            rng = np.random.default_rng(seed)
            for r in host:  # never 0xEE: the tests' canary
                r[:] = rng.integers(0, 0xEE, r.size, dtype=np.uint8)
        if mem == "VRAM":
            import gpu
            self.regions = []
            for r in host:
                b = gpu.Buffer(r.nbytes)
                b.write(r.tobytes())
                self.regions.append(b)
        else:
            self.regions = host
        caches = [(self._base(r), self.blocks * self.block_len, 0, "") for r in self.regions]
        self.reg_descs = self.agent.register_memory(caches, mem, backends=[self.backend])
        return [self._base(r) for r in self.regions]

    def _base(self, r):
        return r.ptr if self.mem == "VRAM" else r.ctypes.data

    def try_register(self, mem, length=4096):
        """Registers a host buffer of length bytes as mem with the backend; "ok" (deregistered again), or what
        NIXL raised. The backend refuses a kind it does not take before it touches the memory."""
        import numpy as np
        buf = np.zeros(length, dtype=np.uint8)
        try:
            d = self.agent.register_memory([(buf.ctypes.data, length, 0, "")], mem, backends=[self.backend])
        except Exception as e:  # the bindings raise nixlNotSupportedError and kin
            return f"{type(e).__name__}: {e}"
        self.agent.deregister_memory(d, backends=[self.backend])
        return "ok"

    def dereg(self):
        self.agent.deregister_memory(self.reg_descs, backends=[self.backend])
        self.reg_descs = None
        return True

    def md(self):
        return self.agent.get_agent_metadata()

    def add_remote(self, md):
        name = self.agent.add_remote_agent(md)
        return name.decode() if isinstance(name, bytes) else name

    def _blocks_data(self, bases, blocks, block_len):
        return [(base + b * block_len, block_len, 0) for base in bases for b in range(blocks)]

    def prep_local(self):
        descs = self.agent.get_xfer_descs(
            self._blocks_data([self._base(r) for r in self.regions], self.blocks, self.block_len), self.mem)
        h = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs, backends=[self.backend])
        i = self.next_id
        self.next_id += 1
        self.dlists[i] = h
        return i

    def prep_remote(self, agent, bases, blocks, block_len, mem="DRAM"):
        descs = self.agent.get_xfer_descs(self._blocks_data(bases, blocks, block_len), mem)
        h = self.agent.prep_xfer_dlist(agent, descs, backends=[self.backend])
        i = self.next_id
        self.next_id += 1
        self.dlists[i] = h
        return i

    # -- transfers --------------------------------------------------------------------------------
    def desc_ids(self, block_ids, blocks=None):
        """vLLM's _get_block_descs_ids: every region's descriptors of block_ids."""
        blocks = blocks or self.blocks
        return [r * blocks + b for r in range(len(self.regions)) for b in block_ids]

    def xfer(self, kind, local, local_ids, remote, remote_ids, notif=b""):
        import numpy as np
        h = self.agent.make_prepped_xfer(kind, self.dlists[local], np.asarray(local_ids, dtype=np.int32),
                                         self.dlists[remote], np.asarray(remote_ids, dtype=np.int32),
                                         notif_msg=notif, backends=[self.backend])
        state = self.agent.transfer(h)
        i = self.next_id
        self.next_id += 1
        self.xfers[i] = h
        return {"id": i, "state": state}

    def state(self, xid):
        try:
            return self.agent.check_xfer_state(self.xfers[xid])
        except Exception:
            return "ERR"

    def wait(self, xid, timeout=60.0):
        """Polls check_xfer_state as vLLM's get_finished does, until DONE or ERR; releases the handle."""
        h = self.xfers[xid]
        end = time.monotonic() + timeout
        while True:
            try:
                s = self.agent.check_xfer_state(h)
            except Exception:  # the bindings raise for a failed transfer (vLLM catches it the same way)
                s = "ERR"
            if s != "PROC":
                break
            if time.monotonic() > end:
                return "TIMEOUT"
            time.sleep(0.001)
        self.agent.release_xfer_handle(h)
        del self.xfers[xid]
        return s

    def release(self, xid):
        """release_xfer_handle, timed (seconds); returns (seconds, state seen just before)."""
        h = self.xfers.pop(xid)
        try:
            before = self.agent.check_xfer_state(h)
        except Exception:
            before = "ERR"
        t = time.monotonic()
        self.agent.release_xfer_handle(h)
        return {"seconds": time.monotonic() - t, "before": before}

    def send_notif(self, agent, msg):
        self.agent.send_notif(agent, msg)  # as vLLM calls it (NIXL's backend= path passes a handle, not a list)
        return True

    def notifs(self, want, timeout=30.0):
        """Collects get_new_notifs until want messages arrived or timeout passed; returns [(agent, msg)]. With
        timeout 0: what has arrived (the tests look for an absence only after a barrier that orders it)."""
        end = time.monotonic() + timeout
        while True:  # at least one look, even with timeout 0
            for agent, msgs in self.agent.get_new_notifs().items():
                self._notifs.extend((agent, m) for m in msgs)
            if len(self._notifs) >= want or time.monotonic() >= end:
                break
            time.sleep(0.001)
        got, self._notifs = self._notifs, []
        return got

    # -- memory -----------------------------------------------------------------------------------
    def read_blocks(self, block_ids):
        """The bytes of block_ids in every region, region by region."""
        out = bytearray()
        for r in self.regions:
            for b in block_ids:
                if self.mem == "VRAM":
                    out += r.read(b * self.block_len, self.block_len)
                else:
                    out += r[b * self.block_len:(b + 1) * self.block_len].tobytes()
        return bytes(out)

    def digest(self, block_ids):
        return hashlib.sha256(self.read_blocks(block_ids)).hexdigest()

    def fill(self, block_ids, value):
        for r in self.regions:
            for b in block_ids:
                r[b * self.block_len:(b + 1) * self.block_len] = value
        return True

    def poke(self, region, offset, data):
        self.regions[region][offset:offset + len(data)] = memoryview(data)
        return True

    def forget(self, prefix):
        """kvstage_nixl_forget(agent, prefix): the target's hook, through the plugin's C symbol."""
        import ctypes
        lib = ctypes.CDLL(os.path.join(os.environ["NIXL_PLUGIN_DIR"], "libplugin_KVSTAGE.so"))
        f = lib.kvstage_nixl_forget
        f.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
        f.restype = ctypes.c_int
        t = time.monotonic()
        rc = f(self.name.encode(), prefix, len(prefix))
        return {"rc": rc, "seconds": time.monotonic() - t}


def main(conn, env):
    os.environ.update(env)
    eng = _Engine()
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        op, kw = msg
        if op == "quit":
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", getattr(eng, op)(**kw)))
        except Exception as e:  # the test sees it
            conn.send(("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
