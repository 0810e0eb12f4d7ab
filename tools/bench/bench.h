/* SPDX-License-Identifier: MIT */
/*
 * kvstage-bench: throughput, latency and idle behaviour of kvstaged, each
 * figure next to a baseline measured in the same run (memcpy, a raw
 * rte_ring between two processes, a raw TCP stream).
 *
 * One process starts (or attaches to) the proxy and forks the client
 * processes; results come back through MAP_SHARED memory. Every number
 * printed is measured in the run that prints it.
 */
#ifndef KVS_BENCH_H
#define KVS_BENCH_H

#include <sched.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>

#include "parse.h"

#define BENCH_MAX_CHUNKS 32
#define BENCH_MAX_PAIRS 64
#define BENCH_WSET_DEFAULT (256ull << 20)
#define GPU_TARGET_SLOT 0.90   /* gpu: slot copies, both directions, against cudaMallocHost */
#define GPU_TARGET_GATHER 0.80 /* gpu: gather of 16 KiB pages */

enum bench_mode {
	MODE_LOCAL,
	MODE_LATENCY,
	MODE_IDLE,
	MODE_BASELINE,
	MODE_GPU,
	MODE_TCP,
	MODE_VERBS,
	MODE_ABORT
};
enum bench_payload { PAYLOAD_NONE, PAYLOAD_COPY, PAYLOAD_VERIFY, PAYLOAD_IN };
enum bench_fmt { FMT_TABLE, FMT_JSON, FMT_CSV };

struct bench_opts {
	enum bench_mode mode;
	const char *socket;	    /* a running proxy, or NULL: start one */
	const char *kvstaged;	    /* proxy binary, or NULL: search (see proxy.c) */
	const char *proxy_args[16]; /* extra arguments for a proxy we start */
	unsigned nproxy_args;
	uint64_t chunks[BENCH_MAX_CHUNKS];
	unsigned nchunks;
	bool chunk_set;
	uint64_t room_bytes; /* 0: 16 chunks */
	unsigned rooms;	     /* concurrent rooms per sender */
	unsigned senders, receivers;
	enum bench_payload payload;
	double duration;     /* seconds measured per point (when bytes == 0) */
	uint64_t bytes;	     /* total bytes per point, or 0 */
	double warmup;	     /* seconds before the measured window */
	double baseline_sec; /* seconds per baseline measurement */
	uint64_t wset;	     /* bytes of each private buffer ring (memcpy, client copies) */
	unsigned samples;    /* idle: wake-up samples */
	double idle_gap_ms;  /* idle: quiet time before each wake-up sample */
	enum bench_fmt fmt;
	const char *plot;
	bool progress, quiet;
	bool no_pin;		 /* leave CPU placement to the scheduler */
	bool netns;		 /* tcp: the two proxies in network namespaces joined by veth */
	unsigned tcp_streams;	 /* tcp: --tcp-streams of the proxies, and of the raw baseline */
	const char *rdma_device; /* verbs: the device both proxies and ib_read_bw use */
	int rdma_gid_index;	 /* verbs: -1: the proxies' and perftest's own choice */
	/* abort */
	double abort_rates[16]; /* fractions of rooms aborted, one point each; 0 first */
	unsigned nrates;
	unsigned abort_sides;	/* 1: the sender aborts, 2: the receiver, 3: either at random */
	const char *vulnerable; /* the test-only kvstaged-vulnerable, or NULL: next to the build */
	bool strict;		/* a red control that caught nothing is an error */
	/* gpu */
	uint64_t gpu_size;   /* bytes per slot copy and per gather */
	uint64_t psizes[16]; /* gather/scatter page sizes */
	unsigned npsizes;
	unsigned pages; /* pages per gather; 0: a whole gpu_size */
	uint64_t pool;	/* device page pool the tables draw from */
	unsigned iters, reps;
	bool gather_modes[3]; /* enum kvs_cuda_gather_mode */
	int device;
	int argc;
	char **argv; /* as given, for --json */
};

/* ------------------------------------------------------------ opts.c */

/* Parses the command line into o (defaults filled in). Returns 0, 1 when
 * --help or --version was served, or 2 after printing why the input is bad. */
int bench_opts_parse(int argc, char **argv, struct bench_opts *o);
/* The mode's word ("local", ...). */
const char *bench_mode_name(enum bench_mode m);
/* Parses a decimal in [lo, hi] (digits only: no sign, space or suffix) into *out. Returns 0, or -1. */
int bench_parse_uint(const char *s, unsigned lo, unsigned hi, unsigned *out);
/* "64K", "1M", "1536K": the shortest exact binary-suffixed form of v, in buf. */
const char *bench_size_str(uint64_t v, char *buf, size_t len);
/* The payload word for p ("none", "copy", "verify", "in"). */
const char *bench_payload_str(enum bench_payload p);
/* Chunks in one room for chunk size chunk under o. */
unsigned bench_room_chunks(const struct bench_opts *o, uint64_t chunk);
/* Bytes of one room for chunk size chunk under o. */
uint64_t bench_room_bytes(const struct bench_opts *o, uint64_t chunk);

/* ----------------------------------------------------------- stats.c */

/* Log-linear histogram of nanosecond values: 64 sub-buckets per power of
 * two (at most 1.6% error), fixed size so it can live in shared memory. */
#define HIST_SUB_BITS 6
#define HIST_BUCKETS ((64 - HIST_SUB_BITS + 1) << HIST_SUB_BITS)
struct hist {
	uint64_t n, sum, min, max;
	uint64_t b[HIST_BUCKETS];
};

/* Percentiles of one histogram, in microseconds (n == 0: all zero). */
struct lat {
	uint64_t n;
	double p50, p99, p999, mean, max;
};

/* CLOCK_MONOTONIC in nanoseconds (the same clock in every process). */
uint64_t now_ns(void);
/* Empties h. */
void hist_init(struct hist *h);
/* Records one value (nanoseconds). */
void hist_add(struct hist *h, uint64_t v);
/* Adds src's counts into dst. */
void hist_merge(struct hist *dst, const struct hist *src);
/* The q-quantile (0 < q <= 1) in nanoseconds: the midpoint of its bucket, clamped to [min, max]. */
double hist_quantile(const struct hist *h, double q);
/* p50/p99/p99.9/mean/max of h, converted to microseconds. */
struct lat hist_lat(const struct hist *h);
/* Sleeps until CLOCK_MONOTONIC reaches t (nanoseconds). */
void sleep_until_ns(uint64_t t);
/* Sleeps for ns nanoseconds. */
void sleep_ns(uint64_t ns);
/* Anonymous memory of len bytes, every page touched so no fault lands in a measurement; NULL on failure. */
void *bench_alloc(size_t len, bool shared);
/* Frees bench_alloc memory. */
void bench_free(void *p, size_t len);

/* ----------------------------------------------------------- proxy.c */

struct bench_proxy {
	pid_t pid;     /* ours to stop, or 0 for an external proxy */
	pid_t cpu_pid; /* whose /proc/PID/stat to read, or 0: n/a */
	char dir[64];  /* our temporary directory, "" if none */
	char sock[128];
	char log[128];
	char bin[512];
	uint64_t slot_size;
	uint32_t slots;
};

/* Starts kvstaged with slots x slot_size in a fresh temporary directory and
 * waits until it serves (--ready-fd). Returns 0, or -1 after printing why. */
int proxy_start(struct bench_proxy *px, const struct bench_opts *o, uint64_t slot_size,
		uint32_t slots);
/* The same, with more arguments (NULL-terminated, or NULL), on CPU cpu
 * (-1: as pinning says), in network namespace netns (NULL: ours).
 * Returns 0, or -1 after printing why. */
int proxy_start_ex(struct bench_proxy *px, const struct bench_opts *o, uint64_t slot_size,
		   uint32_t slots, const char *const *extra, int cpu, const char *netns);
/* A proxy we started has the pool the run needs: need chunks of chunk bytes
 * (a --proxy-arg may have changed --slots or --slot-size). Returns 0, or
 * -1 after saying why. */
int proxy_fits(const struct bench_proxy *px, uint64_t chunk, uint64_t need);
/* Uses the running proxy at sock: reads its pool geometry and pid from its
 * control segment. Returns 0, or -1 after printing why. */
int proxy_attach(struct bench_proxy *px, const char *sock);
/* The proxy of a mode: the running one at --socket (its slot size the
 * --chunk given, if one was; clients placed off its CPUs), else one started
 * with slots x chunk. Returns 0, 1 (failed) or 2 (a --chunk it does not have), after saying why. */
int proxy_open(struct bench_proxy *px, const struct bench_opts *o, uint64_t chunk, uint32_t slots);
/* SIGTERMs and reaps a proxy we started, removes its directory; no-op for an external one. */
void proxy_stop(struct bench_proxy *px);
/* CPU placement. With two or more CPUs, the proxy we start takes the last
 * CPU we may use and every client process the others: a polling proxy and
 * a client never share a core, so neither waits for the other's time slice
 * (on a busy 2-core machine that costs ~100 us a round trip), and the
 * clients' copies share one core, which is what the memcpy/2 bound assumes. */
struct bench_pin {
	bool on;	/* clients pinned away from the proxy */
	bool spread;	/* two or more CPUs and no --no-pin: baselines may spread */
	int proxy_cpu;	/* for a proxy we start; -1: none */
	int proxy2_cpu; /* tcp: the receiving side's proxy; -1: none */
	cpu_set_t all, clients;
};
extern struct bench_pin g_pin;
/* Plans the placement from our own affinity (off with --no-pin or one CPU). */
void pin_init(const struct bench_opts *o);
/* An external proxy: clients take the CPUs its affinity leaves, if it is pinned to some of ours. */
void pin_external(pid_t proxy_pid);
/* Moves the calling process onto the client CPUs (no-op when off). */
void pin_clients(void);
/* Moves the calling process back onto every CPU it may use. */
void pin_all(void);
/* Moves the calling process onto CPU cpu alone (-1: leaves it where it is). */
void pin_one(int cpu);
/* fork() for a helper process: the child dies with us and runs on CPU cpu (-1: where we may). */
pid_t bench_fork(int cpu);
/* "proxy on CPU 1, clients on 0" (or why not), for the output. */
const char *pin_desc(char *buf, size_t len);
/* CPU seconds (user + system) pid has used so far, or -1 if unknown. */
double proc_cpu_seconds(pid_t pid);
/* Slots for a pool of slot_size chunks: min(1 GiB, 256 chunks), at least need. */
uint32_t proxy_slots_for(uint64_t slot_size, uint64_t need);

/* -------------------------------------------------------- baseline.c */

struct ring_base {
	bool done;
	double rt_per_s;	/* ping-pong: one record out and back, one at a time */
	struct lat rtt;		/* ping-pong round-trip time */
	double batch_rec_per_s; /* records out and back per second, bursts of 32, 512 in flight */
};

/* Single-thread memcpy GB/s (1e9) at chunk size, over a wset-byte ring of buffers each way. */
double baseline_memcpy(uint64_t chunk, uint64_t wset, double sec);
/* How baseline_copy copies a chunk: memcpy; with its CRC32C computed as it goes
 * (kvs_copy_crc32c); its CRC32C, then memcpy. */
enum copy_kind { COPY_PLAIN, COPY_CRC, CHECK_COPY };
/* baseline_memcpy's figure (GB/s) for copies of kind how. */
double baseline_copy(uint64_t chunk, uint64_t wset, double sec, enum copy_kind how);
/* Raw SPSC rte_ring ping-pong and batched round trips between two processes. Returns 0, or -1. */
int baseline_ring(double sec, struct ring_base *out);
/* One TCP connection on 127.0.0.1, writes of chunk bytes: GB/s, or < 0 on failure. */
double baseline_tcp(uint64_t chunk, double sec);
/* rawtcp.c: streams TCP connections from a sender process (in tx_ns, on
 * tx_cpu) to a receiver process (listening on rx_ip in rx_ns, on rx_cpu),
 * each holding all of its sockets in one thread. NULL namespace: ours;
 * NULL rx_ip: 127.0.0.1; cpu -1: unpinned. */
struct raw_tcp {
	uint64_t chunk;
	double sec;
	unsigned streams;
	const char *tx_ns, *rx_ns, *rx_ip;
	int tx_cpu, rx_cpu;
	double cpu_s_per_gb; /* out: both processes' CPU seconds per GB moved; < 0: n/a */
};
/* GB/s the receiver counted over r->sec, or < 0 on failure. */
double baseline_raw_tcp(struct raw_tcp *r);
/* extbase.c: UCX's ucx_perftest tag_bw with UCX_TLS=tcp between r's two
 * endpoints (server in rx_ns on rx_ip, client in tx_ns; r->streams is not
 * used), iters messages of r->chunk bytes after a tenth as many to warm up:
 * GB/s, with both processes' CPU seconds per GB (their whole lives, warm-up
 * included) in *cpu_s_per_gb; or < 0 with why filled in. */
double baseline_ucx_tcp(const struct raw_tcp *r, uint64_t iters, double *cpu_s_per_gb, char *why,
			size_t why_len);
/* extbase.c: perftest's ib_read_bw between two processes on dev (gid_index
 * < 0: its own choice), READs of chunk bytes for sec (whole seconds, at
 * least 1): GB/s, or < 0 with why filled in. */
double baseline_ib_read_bw(const char *dev, int gid_index, uint64_t chunk, double sec, char *why,
			   size_t why_len);
/* Moves the calling process into network namespace ns (/run/netns/NS); NULL or "": stays.
 * Returns 0, or -errno. */
int bench_enter_netns(const char *ns);
/* One of the published counters (statnames.h) of the proxy at sock, or 0 if unreadable. */
uint64_t bench_stat(const char *sock, const char *name);
/* n published counters of the proxy at sock, read from one mapping into out
 * (0 for one unknown). Returns 0, or -1 (unreadable: every out is 0). */
int bench_stats(const char *sock, const char *const *names, unsigned n, uint64_t *out);
/* Eventfd ping-pong between two processes that both block (placed like the
 * proxy and a client), one round trip after each gap_ns of quiet: the
 * kernel's floor for waking a sleeping proxy and then its sleeping client.
 * Returns 0, or -1. */
int baseline_wake(unsigned samples, uint64_t gap_ns, struct lat *out);
/* The copy path without kvstage: one process copies chunks from a private
 * wset ring into slots of a shared memfd of inflight bytes, another copies
 * them out into its own ring, slot indices passing through two raw
 * rte_rings; both placed like the clients, yielding (not spinning) when
 * there is nothing to do. GB/s of chunks through both copies, or < 0. */
double baseline_pipe(uint64_t chunk, uint64_t inflight, uint64_t wset, double sec);
/* Frees the buffers baseline_memcpy keeps between calls. */
void baseline_fini(void);

/* ------------------------------------------------------------- modes */

/* Per-point result of the local mode. */
struct local_point {
	uint64_t chunk, room_bytes;
	unsigned room_chunks, slots;
	double warmup_s; /* from go to the window's start */
	double seconds;
	uint64_t bytes, chunks, rooms, errors;
	double gbps, chunks_s, rooms_s;
	struct lat chunk_lat, room_lat;
	double proxy_cpu;   /* % of one core, < 0: n/a */
	double clients_cpu; /* every sender and receiver process, summed, % of one core; < 0: n/a */
	double memcpy_gbps, bound_gbps;
	double pipe_gbps; /* payload copy/verify: baseline_pipe, else 0 */
	/* tcp mode */
	double proxy_rx_cpu;		 /* the receiving side's proxy, % of one core; < 0: n/a */
	double tcp1_gbps, tcpn_gbps;	 /* raw TCP, one stream and --tcp-streams; < 0: failed */
	double tcp1_cpu_gb, tcpn_cpu_gb; /* their two processes' CPU seconds per GB; < 0: n/a */
	double ucx_gbps, ucx_cpu_gb;	 /* UCX tag_bw over UCX_TLS=tcp; < 0: not measured */
	double rdma_gbps;		 /* verbs: ib_read_bw on the same device; < 0: failed */
	/* verbs: each chunk's key on the sending proxy, per chunk READ */
	double binds, invalidates, regions, region_frees;
	/* tcp: each proxy's (0: A, 1: B) syscalls on its peer connections over
	 * the window, per chunk it moved (its chunks_moved); NaN: n/a */
	double sends[2], recvs[2], epolls[2];
};

struct latency_result {
	uint64_t chunk;
	double seconds;
	uint64_t iters;
	double handoffs_s;
	struct lat chunk_lat, room_lat, sync_lat;
	double proxy_cpu;
};

struct idle_result {
	double window_s;
	double proxy_cpu;      /* % of one core over the idle window */
	uint64_t proxy_sleeps; /* times the proxy went to sleep in the window */
	double client_cpu;     /* % of one core used by a client blocked in kvs_wait */
	unsigned samples, not_asleep;
	double gap_ms;
	struct lat wake; /* first sync op after an idle gap */
	struct lat warm; /* the same op back to back */
	struct lat efd;	 /* baseline: eventfd round trip between two sleeping processes, same gap */
};

struct baseline_point {
	uint64_t chunk;
	double memcpy_gbps, copy_crc_gbps, check_copy_gbps, tcp_gbps;
};

/* Runs the local mode over every chunk size. Returns the exit code. */
int run_local(const struct bench_opts *o);
/* Runs the single-chunk latency mode. Returns the exit code. */
int run_latency(const struct bench_opts *o);
/* Runs the idle mode. Returns the exit code. */
int run_idle(const struct bench_opts *o);
/* Runs the tcp mode (tcp.c): two proxies, rooms between them, raw TCP. Returns the exit code. */
int run_tcp(const struct bench_opts *o);
/* Runs the abort mode (abort.c): rooms aborted at random phases, each
 * side's final and the slots' return timed, every byte checked. Returns the exit code. */
int run_abort(const struct bench_opts *o);
/* Runs the baselines alone. Returns the exit code. */
int run_baseline(const struct bench_opts *o);
/* Runs the gpu mode (gpu.c with CUDA, else gpu_stub.c). Returns the exit code. */
int run_gpu(const struct bench_opts *o);

/* ---------------------------------------------------------- report.c */

/* True when the live progress line should be drawn (stderr a TTY or --progress, not --quiet). */
bool progress_on(const struct bench_opts *o);
/* Redraws the progress line on stderr (printf-style). */
void progress_line(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Clears the progress line if one was drawn. */
void progress_clear(void);
/* A note on stderr unless --quiet (printf-style, newline added). */
void note(const struct bench_opts *o, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* A child's failure: writes why into msg (len bytes), sets *failed. Returns 1, the child's exit code. */
int child_fail(char *msg, size_t len, int *failed, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));

#endif
