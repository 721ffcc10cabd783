/* CUDA driver and runtime uprobes for the mscale agent (mscale/probes/ebpf.py loads this).
 *
 * Everything is aggregated here, in the kernel: one `stats` entry per traced process holds
 * counters and the log2 histogram of synchronise times; the agent reads the maps on its
 * interval. There is no per-event perf buffer: the launch path is one hash lookup, two
 * atomic adds and a clock read.
 *
 * The agent creates a zeroed `stats` entry before it attaches to a process and deletes it
 * when the process exits; a hit from a process without an entry is ignored, so the entry
 * doubles as the pid filter.
 *
 * Each launch, copy and synchronise is counted once whichever layer it was seen in: the
 * runtime's entry points (libcudart: cudaLaunchKernel, cudaMemcpyAsync, ...) count and mark
 * the thread as inside the runtime until they return, and the driver entry points the
 * runtime calls on that thread (cuLaunchKernel, ...) then count nothing. A driver call made
 * directly (a process without libcudart, Triton, a statically linked runtime) counts at the
 * driver.
 *
 * Tokens (a NAME between two pairs of at-signs) are filled in at load time from an explicit map
 * (ebpf_loader.specialise); a token without a value, or a value without a token, fails the load.
 */
#include <uapi/linux/ptrace.h>

#define MAX_PIDS @@MAX_PIDS@@
#define MAX_THREADS @@MAX_THREADS@@
#define HIST_SLOTS 64

/* copy directions, indexes into copies[] and copy_bytes[] (ebpf_loader.DIRECTIONS) */
#define DIR_HTOD 0
#define DIR_DTOH 1
#define DIR_DTOD 2
#define DIR_DEFAULT 3 /* cuMemcpyAsync: unified addressing, the driver infers it */
#define NDIR 4

#define SYNC_STREAM 1
#define SYNC_CTX 2
#define SYNC_EVENT 3

/* what the runtime is doing on a thread (rt_entry.kind) */
#define RT_LAUNCH 1 /* a launch or copy: microseconds */
#define RT_SYNC 2   /* a synchronise: as long as the GPU takes */
/* A launch mark older than this is stale: its return probe was detached with the duty cycle
 * while the call ran, and it must not silence the driver probes on that thread for good. */
#define RT_LAUNCH_MARK_NS 1000000000ULL

struct pid_stats {
    u64 launches;       /* cuLaunchKernel[Ex][_ptsz] */
    u64 graph_launches; /* cuGraphLaunch[_ptsz]: a whole graph of kernels */
    u64 last_launch_ns; /* bpf_ktime_get_ns() (CLOCK_MONOTONIC) of the latest launch of either kind */
    u64 copies[NDIR];
    u64 copy_bytes[NDIR];
    u64 sync_calls;
    u64 sync_ns;
    u64 alloc_calls;
    u64 alloc_failures;
    u64 last_alloc_fail_bytes;
    s64 last_alloc_error; /* CUresult of the latest failed cuMemAlloc */
    /* sync_hist[s]: synchronise calls that took [2^(s-1), 2^s) ns (bpf_log2l) */
    u64 sync_hist[HIST_SLOTS];
};

struct sync_entry {
    u64 ts; /* entry time, CLOCK_MONOTONIC ns */
    u32 kind;
    u32 pad;
};

BPF_HASH(stats, u32, struct pid_stats, MAX_PIDS);
/* synchronise calls in flight, by thread: a thread blocked here past the hang timeout is a
 * hang even while the duty-cycled launch probe is detached */
BPF_HASH(inflight, u64, struct sync_entry, MAX_THREADS);
BPF_HASH(alloc_req, u64, u64, MAX_THREADS); /* requested bytes, from entry to return */

struct rt_entry {
    u64 ts; /* entry time, CLOCK_MONOTONIC ns */
    u32 kind;
    u32 pad;
};
/* threads inside a CUDA runtime call, from its entry probe to its return probe */
BPF_HASH(in_runtime, u64, struct rt_entry, MAX_THREADS);

static __always_inline struct pid_stats *traced(u64 pid_tgid) {
    u32 tgid = pid_tgid >> 32;
    return stats.lookup(&tgid);
}

/* A driver call the runtime makes on this thread: the runtime's probe counted it. */
static __always_inline int runtime_counted(u64 id, u32 kind) {
    struct rt_entry *e = in_runtime.lookup(&id);
    if (!e || e->kind != kind)
        return 0;
    return kind == RT_SYNC || bpf_ktime_get_ns() - e->ts < RT_LAUNCH_MARK_NS;
}

static __always_inline void runtime_enter(u64 id, u32 kind) {
    struct rt_entry e = {.ts = bpf_ktime_get_ns(), .kind = kind};
    in_runtime.update(&id, &e);
}

/* --- high rate: attached for a window every period --------------------------------- */

/* The stats of the calling process when this launch or copy counts: a runtime call marks its
 * thread (so the driver call inside it is not counted again), a driver call the runtime
 * already counted does not count. NULL: the process is not traced, or the call was counted. */
static __always_inline struct pid_stats *counts_here(int runtime) {
    u64 id = bpf_get_current_pid_tgid();
    struct pid_stats *s = traced(id);
    if (!s)
        return 0;
    if (runtime)
        runtime_enter(id, RT_LAUNCH);
    else if (runtime_counted(id, RT_LAUNCH))
        return 0;
    return s;
}

static __always_inline int count_launch(int graph, int runtime) {
    struct pid_stats *s = counts_here(runtime);
    if (!s)
        return 0;
    if (graph)
        __sync_fetch_and_add(&s->graph_launches, 1);
    else
        __sync_fetch_and_add(&s->launches, 1);
    s->last_launch_ns = bpf_ktime_get_ns();
    return 0;
}

int on_launch(struct pt_regs *ctx) { return count_launch(0, 0); }
int on_graph_launch(struct pt_regs *ctx) { return count_launch(1, 0); }
int on_rt_launch(struct pt_regs *ctx) { return count_launch(0, 1); }
int on_rt_graph_launch(struct pt_regs *ctx) { return count_launch(1, 1); }

/* The return of a runtime launch or copy (high rate, with them). */
int on_rt_return(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    struct rt_entry *e = in_runtime.lookup(&id);
    if (e && e->kind == RT_LAUNCH)
        in_runtime.delete(&id);
    return 0;
}

/* The byte count is the third argument of every async copy; the pre-v2 entry points take
 * it as a 32-bit unsigned int, whose register's upper half is undefined. */
static __always_inline int count_copy(u32 dir, u64 bytes, int runtime) {
    struct pid_stats *s = counts_here(runtime);
    if (!s)
        return 0;
    __sync_fetch_and_add(&s->copies[dir], 1);
    __sync_fetch_and_add(&s->copy_bytes[dir], bytes);
    return 0;
}

#define COPY_PROBE(name, dir, type) \
    int name(struct pt_regs *ctx) { return count_copy(dir, (type)PT_REGS_PARM3(ctx), 0); }

COPY_PROBE(on_copy_htod, DIR_HTOD, u64)
COPY_PROBE(on_copy_htod32, DIR_HTOD, u32)
COPY_PROBE(on_copy_dtoh, DIR_DTOH, u64)
COPY_PROBE(on_copy_dtoh32, DIR_DTOH, u32)
COPY_PROBE(on_copy_dtod, DIR_DTOD, u64)
COPY_PROBE(on_copy_dtod32, DIR_DTOD, u32)
COPY_PROBE(on_copy_default, DIR_DEFAULT, u64)

/* cudaMemcpyAsync(dst, src, count, kind, stream): cudaMemcpyKind 1 host to device, 2 device
 * to host, 3 device to device; 0 (host to host) and 4 (default: the driver infers it) count
 * as default. */
int on_rt_copy(struct pt_regs *ctx) {
    u32 kind = (u32)PT_REGS_PARM4(ctx);
    u64 bytes = (u64)PT_REGS_PARM3(ctx);
    /* a constant index per branch: the verifier bounds copies[dir] by it */
    if (kind == 1)
        return count_copy(DIR_HTOD, bytes, 1);
    if (kind == 2)
        return count_copy(DIR_DTOH, bytes, 1);
    if (kind == 3)
        return count_copy(DIR_DTOD, bytes, 1);
    return count_copy(DIR_DEFAULT, bytes, 1);
}

/* --- rare: always attached ---------------------------------------------------------- */

static __always_inline int sync_enter(u32 kind, int runtime) {
    u64 id = bpf_get_current_pid_tgid();
    if (!traced(id))
        return 0;
    if (runtime)
        runtime_enter(id, RT_SYNC);
    else if (runtime_counted(id, RT_SYNC))
        return 0; /* the runtime's synchronise entered first: it times the call */
    struct sync_entry e = {.ts = bpf_ktime_get_ns(), .kind = kind};
    inflight.update(&id, &e);
    return 0;
}

int on_stream_sync(struct pt_regs *ctx) { return sync_enter(SYNC_STREAM, 0); }
int on_ctx_sync(struct pt_regs *ctx) { return sync_enter(SYNC_CTX, 0); }
int on_event_sync(struct pt_regs *ctx) { return sync_enter(SYNC_EVENT, 0); }
int on_rt_stream_sync(struct pt_regs *ctx) { return sync_enter(SYNC_STREAM, 1); }
int on_rt_device_sync(struct pt_regs *ctx) { return sync_enter(SYNC_CTX, 1); }
int on_rt_event_sync(struct pt_regs *ctx) { return sync_enter(SYNC_EVENT, 1); }

static __always_inline int sync_return(u64 id) {
    struct sync_entry *e = inflight.lookup(&id);
    if (!e)
        return 0; /* entered before we attached */
    u64 delta = bpf_ktime_get_ns() - e->ts;
    inflight.delete(&id);
    struct pid_stats *s = traced(id);
    if (!s)
        return 0;
    __sync_fetch_and_add(&s->sync_calls, 1);
    __sync_fetch_and_add(&s->sync_ns, delta);
    u32 slot = bpf_log2l(delta);
    if (slot >= HIST_SLOTS)
        slot = HIST_SLOTS - 1;
    __sync_fetch_and_add(&s->sync_hist[slot], 1);
    return 0;
}

int on_sync_return(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    if (runtime_counted(id, RT_SYNC))
        return 0; /* the driver call inside the runtime's: the runtime's return counts */
    return sync_return(id);
}

int on_rt_sync_return(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    struct rt_entry *e = in_runtime.lookup(&id);
    if (e && e->kind == RT_SYNC)
        in_runtime.delete(&id);
    return sync_return(id);
}

static __always_inline int alloc_enter(u64 bytes) {
    u64 id = bpf_get_current_pid_tgid();
    if (!traced(id))
        return 0;
    alloc_req.update(&id, &bytes);
    return 0;
}

int on_alloc(struct pt_regs *ctx) { return alloc_enter((u64)PT_REGS_PARM2(ctx)); }
int on_alloc32(struct pt_regs *ctx) { return alloc_enter((u32)PT_REGS_PARM2(ctx)); }

int on_alloc_return(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    struct pid_stats *s = traced(id);
    u64 *req = alloc_req.lookup(&id);
    u64 bytes = req ? *req : 0;
    if (req)
        alloc_req.delete(&id);
    if (!s)
        return 0;
    int rc = (int)PT_REGS_RC(ctx); /* CUresult */
    __sync_fetch_and_add(&s->alloc_calls, 1);
    if (rc != 0) {
        __sync_fetch_and_add(&s->alloc_failures, 1);
        s->last_alloc_fail_bytes = bytes;
        s->last_alloc_error = rc;
    }
    return 0;
}
