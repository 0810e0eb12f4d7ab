"""Drives nixl_agent from Debian's python3 for tools/nixl/check.sh.

usage: python3 check_agent.py SCRATCH_DIR
DRAM -> file -> DRAM through NIXL's POSIX plugin, every byte compared.
Needs PYTHONPATH/LD_LIBRARY_PATH from PREFIX/kvstage-nixl.env.
"""

import os
import sys
import time

import numpy as np
from nixl._api import nixl_agent, nixl_agent_config

SIZE = 1 << 20


def wait(agent, handle, what):
    deadline = time.monotonic() + 30
    state = agent.transfer(handle)
    if state == "ERR":
        raise SystemExit(f"{what}: posting the transfer failed")
    if state == "DONE":
        return
    while True:
        state = agent.check_xfer_state(handle)
        if state == "DONE":
            return
        if state == "ERR":
            raise SystemExit(f"{what}: the transfer failed")
        if time.monotonic() > deadline:
            raise SystemExit(f"{what}: the transfer did not finish in 30 s")
        time.sleep(0.001)


def dram(agent, arr):
    return [(arr.ctypes.data, arr.nbytes, 0, "")]


def posix(scratch):
    name = "kvstage-check-posix"
    agent = nixl_agent(name, nixl_agent_config(backends=[]))
    plugins = agent.get_plugin_list()
    if "POSIX" not in plugins:
        raise SystemExit(f"POSIX: not among the plugins NIXL found: {plugins}")
    agent.create_backend("POSIX")
    src = np.random.default_rng(1).integers(0, 256, SIZE, dtype=np.uint8)
    dst = np.zeros(SIZE, dtype=np.uint8)
    reg = agent.get_reg_descs(dram(agent, src) + dram(agent, dst), "DRAM")
    if agent.register_memory(reg) is None:
        raise SystemExit("POSIX: registering DRAM failed")
    path = os.path.join(scratch, "posix.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        files = agent.register_memory([(0, SIZE, fd, "f")], "FILE")
        if files is None:
            raise SystemExit("POSIX: registering the file failed")
        fdescs = files.trim()
        for op, arr in (("WRITE", src), ("READ", dst)):
            local = agent.get_xfer_descs([(arr.ctypes.data, SIZE, 0)], "DRAM")
            h = agent.initialize_xfer(op, local, fdescs, name)
            if not h:
                raise SystemExit(f"POSIX: creating the {op} failed")
            wait(agent, h, f"POSIX {op}")
            agent.release_xfer_handle(h)
        agent.deregister_memory(files)
    finally:
        os.close(fd)
    agent.deregister_memory(reg)
    if os.path.getsize(path) != SIZE or not np.array_equal(src, dst):
        raise SystemExit("POSIX: the bytes read back differ from those written")
    print(f"POSIX: {SIZE} bytes DRAM -> {path} -> DRAM, every byte equal")


def main():
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    posix(sys.argv[1])


if __name__ == "__main__":
    main()
