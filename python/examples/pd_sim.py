"""The engine pieces pd_demo.py's workers and the test suite's SGLang engines share: an SGLang-shaped engine's
memory (paged KV buffers, aux rows, state rows as torch CPU tensors, described as SGLang's KVArgs describes them),
the bytes a request writes there (stamped, so that a page from another request or position is named), an
allocator, and a stand-in of SGLang's ServerArgs. Needs torch (Debian: python3-torch) for Cache only."""
import random
import types

M62 = (1 << 62) - 1
M64 = (1 << 64) - 1
TAG_KV, TAG_AUX, TAG_STATE = 0, 1, 2
MARK = 0x4D41524B  # "MARK": the high half of every word of a marked item


def mix(*xs):
    """A 62-bit hash of the ints xs (splitmix64 steps)."""
    h = 0x9E3779B97F4A7C15
    for x in xs:
        h = ((h ^ (x & M64)) * 0xBF58476D1CE4E5B9) & M64
        h ^= h >> 31
    return h & M62


def stamp(torch, room, tag, b, js, nbytes):
    """The bytes ([len(js), nbytes] uint8) request `room` writes into item j (j in js) of its buffer b of kind tag:
    int64 word 0 the room, word 1 (tag, b, j), then words unique to (room, tag, b, j); the last word cut short
    when nbytes is not a multiple of 8."""
    js = list(js)
    nwords = -(-nbytes // 8)
    base = torch.tensor([mix(room, tag, b, j) for j in js], dtype=torch.int64)
    w = torch.arange(nwords, dtype=torch.int64).unsqueeze(0) + base.unsqueeze(1)
    w[:, 0] = room
    if nwords > 1:
        w[:, 1] = torch.tensor([(tag << 48) | (b << 32) | j for j in js], dtype=torch.int64)
    return w.view(torch.uint8)[:, :nbytes]


def mark_bytes(torch, k, nbytes):
    """The marker (nbytes uint8) an aborted request k's items get once the engine owns them again."""
    return torch.tensor([MARK << 32 | k], dtype=torch.int64).view(torch.uint8).repeat(-(-nbytes // 8))[:nbytes]


def _nbytes(t):
    return t.numel() * t.element_size()  # torch 1.13 has no Tensor.nbytes


class Cache:
    """One SGLang-shaped engine's memory, all torch CPU tensors: 2 * layers paged KV buffers [tokens, heads,
    head_dim] fp16 (K and V per layer), aux buffers [rows, ...] (SGLang's MetadataBuffers) and state components,
    each a list of tensors [rows, ...] (a mamba-like state). aux: [(shape of a row, dtype)]; state: a list of
    components, each [(shape of a row, dtype)]. kv_args() describes them as SGLang's KVArgs does.
    Items hold stamped bytes (stamp); check() names whose bytes an item holds when they are not the expected ones."""

    def __init__(self, pages, rows=64, page_size=4, layers=3, heads=2, head_dim=12, aux=None, state=None):
        import torch
        self.torch, self.pages, self.rows, self.page_size = torch, pages, rows, page_size
        aux = aux or [((16,), torch.int32), ((8,), torch.float32), ((4,), torch.int64)]
        state = state or [[((64,), torch.float32)]]
        self.kv = [torch.zeros((pages * page_size, heads, head_dim), dtype=torch.float16) for _ in range(2 * layers)]
        self.aux = [torch.zeros((rows, *shape), dtype=dt) for shape, dt in aux]
        self.state = [[torch.zeros((rows, *shape), dtype=dt) for shape, dt in comp] for comp in state]

    # byte views: [pages, page bytes] and [rows, row bytes]
    def kv_u8(self, b):
        return self.kv[b].view(self.torch.uint8).view(self.pages, -1)

    def aux_u8(self, a):
        return self.aux[a].view(self.torch.uint8).reshape(self.rows, -1)

    def state_u8(self, t, c=0):
        return self.state[c][t].view(self.torch.uint8).reshape(self.rows, -1)

    def kv_args(self, engine_rank=0):
        """Returns SGLang's KVArgs (kvstage.sglang's: SGLang's own, or the test suite's stand-in) describing them."""
        from kvstage import sglang as ks
        a = ks.KVArgs()
        a.engine_rank, a.gpu_id, a.page_size, a.pp_rank, a.system_dp_rank = engine_rank, 0, self.page_size, 0, 0
        a.kv_data_ptrs = [t.data_ptr() for t in self.kv]
        a.kv_data_lens = [_nbytes(t) for t in self.kv]
        a.kv_item_lens = [_nbytes(t[0]) * self.page_size for t in self.kv]
        a.aux_data_ptrs = [t.data_ptr() for t in self.aux]
        a.aux_data_lens = [_nbytes(t) for t in self.aux]
        a.aux_item_lens = [_nbytes(t[0]) for t in self.aux]
        a.state_types = ["mamba"] * len(self.state)
        a.state_data_ptrs = [[t.data_ptr() for t in comp] for comp in self.state]
        a.state_data_lens = [[_nbytes(t) for t in comp] for comp in self.state]
        a.state_item_lens = [[_nbytes(t[0]) for t in comp] for comp in self.state]
        return a

    def _rowbufs(self):
        """[(tag, buffer number, [rows, row bytes] view)] of the aux and state buffers."""
        return ([(TAG_AUX, a, self.aux_u8(a)) for a in range(len(self.aux))]
                + [(TAG_STATE, i, t.view(self.torch.uint8).reshape(self.rows, -1))
                   for i, t in enumerate(t for comp in self.state for t in comp)])

    # the prefill's forward
    def fill_pages(self, room, pages, first=0):
        """Writes request `room`'s pages at request positions first... into engine pages `pages`."""
        if not len(pages):
            return
        idx = self.torch.tensor(list(pages), dtype=self.torch.long)
        for b in range(len(self.kv)):
            t = self.kv_u8(b)
            t[idx] = stamp(self.torch, room, TAG_KV, b, range(first, first + len(pages)), t.shape[1])

    def fill_rows(self, room, row):
        for tag, i, t in self._rowbufs():
            t[row] = stamp(self.torch, room, tag, i, [0], t.shape[1])[0]

    def fill(self, room, pages, row):
        self.fill_pages(room, pages)
        self.fill_rows(room, row)

    # the decode side's checks
    def check(self, room, pages, row, whose=None):
        """Returns None if pages and row hold exactly request `room`'s bytes, else what differs (the first one).
        whose: {bootstrap room: request name}, to name the request whose bytes a page holds."""
        torch = self.torch
        idx = torch.tensor(list(pages), dtype=torch.long)
        for b in range(len(self.kv) if len(pages) else 0):
            t = self.kv_u8(b)
            got, want = t[idx], stamp(torch, room, TAG_KV, b, range(len(pages)), t.shape[1])
            if not torch.equal(got, want):
                j = int((got != want).any(1).nonzero()[0, 0])
                return (f"kv buffer {b} page {j} of {len(pages)} (engine page {pages[j]}) "
                        f"{self.describe(got[j], want[j], whose or {})}")
        for tag, i, t in self._rowbufs():
            got, want = t[row], stamp(torch, room, tag, i, [0], t.shape[1])[0]
            if not torch.equal(got, want):
                return (f"{'aux' if tag == TAG_AUX else 'state'} buffer {i} row {row} "
                        f"{self.describe(got, want, whose or {})}")
        return None

    def describe(self, got, want, whose):
        """Says whose bytes `got` (one item's bytes, want the expected ones) holds."""
        torch = self.torch
        if not bool(got.any()):
            return "was never written (zeros)"
        off = int((got != want).nonzero()[0, 0])
        head = torch.zeros(16, dtype=torch.uint8)
        head[:min(16, got.shape[0])] = got[:16]
        w0, w1 = (int(w) for w in head.view(torch.int64))
        if torch.equal(got, mark_bytes(torch, w0 & 0xFFFFFFFF, got.shape[0])):
            return f"holds request {w0 & 0xFFFFFFFF}'s abort marker"
        tag, b, j = (w1 >> 48) & 0xFFFF, (w1 >> 32) & 0xFFFF, w1 & 0xFFFFFFFF
        kind = {TAG_KV: "kv buffer", TAG_AUX: "aux buffer", TAG_STATE: "state buffer"}.get(tag, f"tag {tag} buffer")
        if w0 in whose:
            other = whose[w0]
            if torch.equal(got, stamp(torch, w0, tag, b, [j], got.shape[0])[0]):
                item = f"page {j}" if tag == TAG_KV else "row"
                own = " (its own bytes, in the wrong place)" if torch.equal(got[:8], want[:8]) else ""
                return f"holds request {other}'s {kind} {b} {item}{own}"
            return f"differs from its own bytes from byte {off} on (stamp: request {other}'s {kind} {b}, item {j})"
        return f"holds unknown bytes (first differing byte {off}; word 0 {w0:#x})"

    def mark(self, pages, row, k):
        """Writes request k's abort marker into pages and row (the engine owns them again)."""
        idx = self.torch.tensor(list(pages), dtype=self.torch.long)
        for b in range(len(self.kv) if len(pages) else 0):
            t = self.kv_u8(b)
            t[idx] = mark_bytes(self.torch, k, t.shape[1])
        for _, _, t in self._rowbufs():
            t[row] = mark_bytes(self.torch, k, t.shape[1])

    def marked(self, pages, row, k):
        """Returns None if request k's marker is intact in pages and row, else where it is not."""
        idx = self.torch.tensor(list(pages), dtype=self.torch.long)
        for b in range(len(self.kv) if len(pages) else 0):
            t = self.kv_u8(b)
            bad = (t[idx] != mark_bytes(self.torch, k, t.shape[1])).any(1).nonzero()
            if len(bad):
                return f"kv buffer {b} page {int(bad[0, 0])} (engine page {pages[int(bad[0, 0])]})"
        for tag, i, t in self._rowbufs():
            if not bool((t[row] == mark_bytes(self.torch, k, t.shape[1])).all()):
                return f"{'aux' if tag == TAG_AUX else 'state'} buffer {i} row {row}"
        return None


class Alloc:
    """A free list (an engine's page or row allocator), handing out shuffled items, or a contiguous run."""

    def __init__(self, n, rng=None):
        self.rng = rng or random.Random(0)
        self.free = list(range(n))
        self.rng.shuffle(self.free)

    def alloc(self, n, contiguous=False):
        """Returns n items (a run of consecutive ones if contiguous and there is one), or None if fewer are free."""
        if n > len(self.free):
            return None
        if contiguous:
            s = sorted(self.free)
            for i in range(len(s) - n + 1):
                if s[i + n - 1] - s[i] == n - 1:
                    run = set(s[i:i + n])
                    self.free = [p for p in self.free if p not in run]
                    return s[i:i + n]
        out, self.free = self.free[:n], self.free[n:]
        return out

    def give_back(self, items):
        self.free.extend(items)
        self.rng.shuffle(self.free)


def server_args(socket_path, bootstrap_port, **kw):
    """A stand-in of SGLang's ServerArgs: the fields the backend reads (one TP rank, KV cache on the CPU); kw
    overrides or adds fields."""
    d = dict(host="127.0.0.1", disaggregation_bootstrap_port=bootstrap_port, dist_init_addr=None, kv_cache_dtype="auto",
             load_balance_method="follow_bootstrap_room", dp_size=1, tp_size=1, pp_size=1, enable_dp_attention=False,
             device="cpu", port=None, kvstage_socket=socket_path)
    d.update(kw)
    return types.SimpleNamespace(**d)
