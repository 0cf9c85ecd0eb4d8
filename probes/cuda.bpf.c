// SPDX-License-Identifier: Apache-2.0
//
// cuda.bpf.c: uprobes on the CUDA driver API (libcuda.so.1) that record every device-memory
// event as one fixed-size record in a BPF ring buffer.
//
// Why this shape:
//  - Entry probes read the arguments (and whatever lives only at entry, such as the 64-byte IPC
//    handle passed by value on the stack); return probes read the out-pointers and the CUresult.
//    Both halves meet in `inflight`, keyed by (api << 32 | tid) so different APIs may nest.
//  - The device ordinal of an event is resolved here, from the calling thread's current context,
//    because only the kernel sees every context switch of every thread (cuCtxSetCurrent & co.).
//  - Records are submitted with BPF_RB_NO_WAKEUP: the reader polls the ring by mmap on a timer,
//    so waking it per record would only cost (+50% per probe hit on the measured hosts). Once
//    the ring holds RINGBUF_WAKE_BYTES, a submit forces the wakeup: a burst is drained when it
//    fills a quarter of the ring, not when the timer comes round.
//  - Every number (Kind, Api, flags) comes from -D flags built by memrec.events.bpf_defines().
//
// -D flags: RINGBUF_PAGES (power of two), RINGBUF_WAKE_BYTES (the fill that wakes the reader), FOLLOW_TREE (record only `tracked` tgids and follow
// their forks), HAVE_GROUP_DEAD (sched_process_exit has the group_dead field, kernel >= 6.16).
//
// ABI notes (x86-64 SysV): integer/pointer args in rdi, rsi, rdx, rcx, r8 (PT_REGS_PARM1..5).
// cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags): the
// 64-byte struct is class MEMORY, so it is copied to the stack and takes no register: pdptr is
// in rdi, Flags in rsi (PARM2), and the handle is at [rsp + 8] on entry (rsp points at the return
// address). On arm64 (AAPCS64) a composite larger than 16 bytes is passed by reference instead:
// x1 holds a pointer to a copy and Flags is in x2.

#include <uapi/linux/ptrace.h>

#ifndef RINGBUF_PAGES
#error "RINGBUF_PAGES must be given with -D (memrec.probes.cuda does)"
#endif
#ifndef RINGBUF_WAKE_BYTES
#error "RINGBUF_WAKE_BYTES must be given with -D (memrec.probes.cuda does)"
#endif
#ifndef KIND_ALLOC
#error "the Kind/Api ids must be given with -D (memrec.events.bpf_defines())"
#endif

#define IPC_BYTES 64
#define CTX_STACK_DEPTH 8 /* a power of two; deeper pushes are counted, not stored */
#define CLONE_THREAD_FLAG 0x00010000ULL
#define HANDLE_TYPE_POSIX_FD 1
#define HANDLE_TYPE_FABRIC 8

// One record, exactly memrec.events.RAW_COLUMNS (128 bytes, little-endian, no padding).
struct event {
    u64 ts;
    u32 pid;
    u32 tid;
    u16 kind;
    u16 api;
    s32 result;
    s32 ordinal;
    u32 flags;
    u64 ptr;
    u64 size;
    u64 handle;
    u64 aux;
    u8 ipc[IPC_BYTES];
};

// What the return probe must do to complete an event.
enum out_mode {
    OUT_NONE = 0,        // nothing to read
    OUT_PTR,             // *(u64 *)out -> ptr (allocations, reservations, IPC open)
    OUT_HANDLE,          // *(u64 *)out -> handle (cuMemCreate, imports, retain)
    OUT_IPC,             // 64 bytes at out -> ipc (cuIpcGetMemHandle)
    OUT_PITCH,           // *(u64 *)out -> ptr, *(size_t *)arg * arg2 -> size
    OUT_SHARE_EXPORT,    // by handle type: int fd -> ptr, or 64 fabric bytes -> ipc
    OUT_CAPTURE,         // the stream (ev.handle) is being captured from now on
    OUT_CTX_RETAIN,      // *(CUcontext *)out -> handle; ctx -> device
    OUT_CTX_CREATE,      // as retain, and the context becomes current
    OUT_CTX_SET,         // arg = ctx: replace the top of the stack (NULL pops)
    OUT_CTX_PUSH,        // arg = ctx: push
    OUT_CTX_POP,         // pop
    OUT_CTX_DESTROY,     // arg = ctx: forget it, pop it if current
    OUT_CTX_GET_CURRENT, // *(CUcontext *)out is the current context
    OUT_CTX_GET_DEVICE,  // *(int *)out is the current context's device
};

struct inflight {
    struct event ev; // prepared at entry, completed at return
    u64 out;         // user pointer read at return
    u64 arg;         // per mode: pitch pointer, context
    u64 arg2;        // per mode: height
    u32 mode;        // enum out_mode
    u32 emit;        // 1: submit ev at return; 0: context bookkeeping only
};

struct ctx_key {
    u64 ctx;
    u32 tgid;
    u32 pad;
};

struct ctx_stack {
    u64 ctx[CTX_STACK_DEPTH];
    u32 depth; // may exceed CTX_STACK_DEPTH: the top is then unknown until pops bring it back
    u32 pad;
};

BPF_RINGBUF_OUTPUT(events, RINGBUF_PAGES); // first: EVENTS_MAP below counts on it
BPF_PERCPU_ARRAY(lost, u64, 1);
// LRU: a thread killed inside a call never reaches the return probe; its entry ages out.
BPF_TABLE("lru_hash", u64, struct inflight, inflight, 16384);
BPF_TABLE("lru_hash", struct ctx_key, s32, ctx_dev, 16384);
BPF_TABLE("lru_hash", u32, struct ctx_stack, ctx_stacks, 16384);
// Device learnt from cuCtxGetDevice when the thread's context is not known (attached late).
BPF_TABLE("lru_hash", u32, s32, thread_dev, 16384);
// tgids that produced events: only they get a PROC_EXIT (not an LRU: evicting a live server
// would lose its exit).
BPF_HASH(seen, u32, u8, 65536);
#ifdef FOLLOW_TREE
BPF_HASH(tracked, u32, u8, 65536);
#endif
// Streams being captured into a graph, (tgid, stream) -> 1: a stream-ordered allocation made on
// one is graph-owned, not live (issue 21). Set when cuStreamBeginCapture* returns, cleared when
// cuStreamEndCapture* is entered. LRU: a process that dies mid-capture leaves its entry to age out.
struct stream_key {
    u64 stream;
    u32 tgid;
    u32 pad;
};
BPF_TABLE("lru_hash", struct stream_key, u8, capturing, 4096);

// ---- helpers ---------------------------------------------------------------------------------

static __always_inline int wanted(u32 tgid) {
#ifdef FOLLOW_TREE
    return tracked.lookup(&tgid) != NULL;
#else
    return 1;
#endif
}

static __always_inline u64 stack_top(struct ctx_stack *s) {
    u32 d = s->depth;
    if (d == 0 || d > CTX_STACK_DEPTH)
        return 0;
    return s->ctx[(d - 1) & (CTX_STACK_DEPTH - 1)];
}

static __always_inline void stack_push(struct ctx_stack *s, u64 c) {
    u32 d = s->depth;
    if (d < CTX_STACK_DEPTH)
        s->ctx[d & (CTX_STACK_DEPTH - 1)] = c;
    if (d < 0x7fffffff)
        s->depth = d + 1;
}

static __always_inline void stack_pop(struct ctx_stack *s) {
    if (s->depth > 0)
        s->depth -= 1;
}

static __always_inline void stack_set(struct ctx_stack *s, u64 c) {
    u32 d = s->depth;
    if (c == 0) {
        stack_pop(s);
    } else if (d == 0) {
        stack_push(s, c);
    } else if (d <= CTX_STACK_DEPTH) {
        s->ctx[(d - 1) & (CTX_STACK_DEPTH - 1)] = c;
    }
}

static __always_inline struct ctx_stack *stack_of(u32 tid) {
    struct ctx_stack zero = {};
    return ctx_stacks.lookup_or_try_init(&tid, &zero);
}

static __always_inline u64 current_ctx(u32 tid) {
    struct ctx_stack *s = ctx_stacks.lookup(&tid);
    return s ? stack_top(s) : 0;
}

// The device ordinal of the calling thread's current context, or -1.
static __always_inline s32 current_ordinal(u32 tgid, u32 tid) {
    u64 c = current_ctx(tid);
    if (c) {
        struct ctx_key k = {.ctx = c, .tgid = tgid};
        s32 *d = ctx_dev.lookup(&k);
        if (d)
            return *d;
    }
    s32 *td = thread_dev.lookup(&tid);
    return td ? *td : -1;
}

static __always_inline void count_lost(void) {
    u32 zero = 0;
    u64 *n = lost.lookup(&zero);
    if (n)
        *n += 1;
}

static __always_inline void mark_seen(u32 tgid) {
    if (!seen.lookup(&tgid)) {
        u8 one = 1;
        seen.update(&tgid, &one);
    }
}

// The `events` map for helpers bcc 0.26 has no method for (bpf_ringbuf_query): its rewriter names
// a map bpf_pseudo_fd(1, -N), N counting declarations from 1, and `events` is declared first.
// Were it another map, the verifier would refuse the program (bpf_ringbuf_query takes only a ring).
#define EVENTS_MAP ((void *)bpf_pseudo_fd(1, -1))

// How to submit a record: without waking the reader (it polls), unless the ring is filling up.
static __always_inline u64 wakeup_flag(void) {
    return bpf_ringbuf_query(EVENTS_MAP, BPF_RB_AVAIL_DATA) >= RINGBUF_WAKE_BYTES ? BPF_RB_FORCE_WAKEUP : BPF_RB_NO_WAKEUP;
}

static __always_inline void submit(struct event *ev) {
    // Seen even when the record is lost: the process still holds memory and must get its exit.
    mark_seen(ev->pid);
    // Ring order is reservation order; across CPUs it can differ from ts order by the few
    // instructions between the two, so readers that need strict order sort a batch by ts.
    ev->ts = bpf_ktime_get_ns();
    struct event *rec = events.ringbuf_reserve(sizeof(struct event));
    if (!rec) {
        count_lost();
        return;
    }
    __builtin_memcpy(rec, ev, sizeof(struct event));
    // A context being bound is a process's first, rare driver event: wake the reader so the
    // daemon reads the process's /proc (CUDA_VISIBLE_DEVICES) while it surely still runs, and
    // reads NVML's per-process memory right before (CTX_BEGIN) and after (CTX) the context.
    // The rare calls whose cost lands later (a limit, a graph's pool) wake it too (issue 21).
    // An event with a stack (--stacks) wakes it too: the daemon names the frames by reading the
    // process's memory, which must happen before the process exits (a burst of allocations
    // right before the exit is common: a rank sizing its KV cache, then failing).
    int wake = ev->kind == KIND_CTX || ev->kind == KIND_CTX_BEGIN || ev->kind == KIND_CTX_LIMIT
               || ev->kind == KIND_GRAPH_EXEC || ev->kind == KIND_GRAPH_TRIM || ev->kind == KIND_MULTICAST_CREATE
               || (ev->flags & FLAG_STACK);
    events.ringbuf_submit(rec, wake ? BPF_RB_FORCE_WAKEUP : wakeup_flag());
}

// Record a process-level event (tracepoints): no inflight state, no ordinal.
static __always_inline void submit_proc(u16 kind, u16 api, u32 pid, u32 tid, u64 ptr) {
    struct event *rec = events.ringbuf_reserve(sizeof(struct event));
    if (!rec) {
        count_lost();
        return;
    }
    __builtin_memset(rec, 0, sizeof(struct event));
    rec->ts = bpf_ktime_get_ns();
    rec->pid = pid;
    rec->tid = tid;
    rec->kind = kind;
    rec->api = api;
    rec->ordinal = -1;
    rec->ptr = ptr;
    events.ringbuf_submit(rec, wakeup_flag());
}

#ifdef STACKS
// ---- stacks (--stacks): the allocating thread's Python frames and native return addresses ------
// Why here and like this: only the probe sees the thread at the moment of the call, and nothing
// may run in the traced process. The daemon locates each process's interpreter (_PyRuntime) and
// writes its address with the offsets of that CPython version into `py_procs`; this walks
// _PyRuntime.interpreters.head->threads.head to the thread state whose native_thread_id is the
// calling tid (3.10: whose thread_id, pthread_self(), is the thread's FS base: py_proc.fsbase),
// then the frames, and records (code object, instruction pointer or 3.10's f_lasti) per frame. The
// daemon turns those into file, line and function by reading the code objects
// (memrec.probes.pystacks). One record per stack in the `stacks` ring (all of one size, read like
// `events`); the event names it by id in its ipc column (FLAG_STACK).
// -D flags: PY_FRAMES (the bound, <= PY_FRAMES_MAX), STACK_RING_PAGES, STACK_MIN_BYTES (tensor blocks).
#define PY_FRAMES_MAX 32   // memrec.probes.pystacks.PY_FRAMES_MAX: the most frames kept (PY_FRAMES)
#define PY_SLOTS 64        // memrec.probes.pystacks.PY_SLOTS: slots walked, shim frames included
#define NATIVE_FRAMES_MAX 16 // memrec.probes.pystacks.NATIVE_FRAMES_MAX
#define PY_THREADS_MAX 256 // thread states looked at before giving up (STACK_NO_THREAD)
#define PY_NONE 0xffffffff // an offset that does not apply to this version
#define STACK_OK 0
#define STACK_NO_INTERPRETER 1 // the process has no entry in py_procs
#define STACK_NO_THREAD 2      // no thread state of the interpreter belongs to this thread
#define STACK_READ_FAILED 3    // a pointer of the interpreter could not be read
#define STACK_TRUNCATED 0x100  // more frames than PY_FRAMES: the outermost ones are missing

// The layout of one process's interpreter, as memrec.probes.pystacks.PyProc.pack() writes it.
struct py_proc {
    u64 runtime;      // address of _PyRuntime in the process
    u32 interp_head;  // _PyRuntimeState.interpreters.head
    u32 threads_head; // PyInterpreterState.threads.head
    u32 ts_next;      // PyThreadState.next
    u32 ts_tid;       // PyThreadState.native_thread_id (3.10: .thread_id)
    u32 ts_frame;     // PyThreadState.cframe (3.11, 3.12), .current_frame (3.13), .frame (3.10)
    u32 cframe_frame; // _PyCFrame.current_frame, or PY_NONE (3.10, 3.13: the frame is the thread state's)
    u32 fr_previous;  // _PyInterpreterFrame.previous (3.10: PyFrameObject.f_back)
    u32 fr_code;      // .f_code / .f_executable
    u32 fr_instr;     // .prev_instr / .instr_ptr (3.10: .f_lasti)
    u32 fr_owner;     // .owner
    u32 owner_cstack; // owner of a C-stack shim frame (skipped), or PY_NONE
    // PY_NONE: ts_tid holds the kernel's thread id (3.11+). Otherwise ts_tid holds pthread_self()
    // (3.10), which on x86-64 is the thread's FS base, at this offset in task_struct
    // (thread.fsbase, found in the kernel's BTF by the daemon: the program is the same on every kernel).
    u32 fsbase;
};

struct stack_rec {
    u64 id;
    u32 pid;
    u32 tid;
    u32 status;  // STACK_* (| STACK_TRUNCATED)
    u16 npy;     // frames in code/instr, innermost first
    u16 nnative; // return addresses in native, innermost first
    u64 code[PY_SLOTS];
    u64 instr[PY_SLOTS];
    u64 native[NATIVE_FRAMES_MAX];
};

BPF_RINGBUF_OUTPUT(stacks, STACK_RING_PAGES);
BPF_HASH(py_procs, u32, struct py_proc, 16384);
BPF_PERCPU_ARRAY(stack_seq, u64, 1);
BPF_PERCPU_ARRAY(stacks_lost, u64, 1);

// The thread state's innermost frame (0: none, or unreadable).
static __always_inline u64 py_top_frame(struct py_proc *p, u64 ts) {
    u64 frame = 0;
    if (bpf_probe_read_user(&frame, sizeof(frame), (void *)(ts + p->ts_frame)))
        return 0;
    if (p->cframe_frame != PY_NONE && frame
        && bpf_probe_read_user(&frame, sizeof(frame), (void *)(frame + p->cframe_frame)))
        return 0;
    return frame;
}

// The calling thread's innermost Python frame, or 0 with *status said. A thread may own several
// thread states (C++ code such as PyTorch's creates one with PyGILState_Ensure or
// PyThreadState_New while another lives): the first of them, newest first, that has a frame is
// the one running Python. (Loops are kept free of state the verifier would have to tell apart
// per iteration: a failed read ends the walk as a null pointer would.)
static __always_inline u64 py_thread_frame(struct py_proc *p, u32 tid, u32 *status) {
    u64 interp = 0, ts = 0, frame = 0, want = tid, mask = 0xffffffffULL;
    u32 matched = 0;
    if (p->fsbase != PY_NONE) { // 3.10: the thread state's pthread id, all 64 bits of it
        u64 task = bpf_get_current_task();
        mask = ~0ULL;
        if (bpf_probe_read_kernel(&want, sizeof(want), (void *)(task + p->fsbase)) || !want) {
            *status = STACK_READ_FAILED;
            return 0;
        }
    }
    if (bpf_probe_read_user(&interp, sizeof(interp), (void *)(p->runtime + p->interp_head)) || !interp
        || bpf_probe_read_user(&ts, sizeof(ts), (void *)(interp + p->threads_head))) {
        *status = STACK_READ_FAILED;
        return 0;
    }
#pragma clang loop unroll(disable)
    for (int i = 0; i < PY_THREADS_MAX; i++) {
        if (!ts)
            break;
        u64 native = 0, next = 0;
        bpf_probe_read_user(&native, sizeof(native), (void *)(ts + p->ts_tid));
        if ((native & mask) == want) {
            matched = 1;
            frame = py_top_frame(p, ts);
            if (frame)
                break;
        }
        bpf_probe_read_user(&next, sizeof(next), (void *)(ts + p->ts_next));
        ts = next;
    }
    if (!matched)
        *status = STACK_NO_THREAD;
    return frame;
}

// Fill r's Python frames, innermost first; return the status. A C-stack shim frame (3.12+)
// takes a slot with code 0 and a frame whose fields cannot be read one with code 1: the daemon
// drops the first, says the second and keeps PY_FRAMES of the others. (The slot is the loop's
// own counter: a second counter of kept frames makes the verifier's walk explode.) Twice the
// frames kept in slots: one shim per Python frame at most (a call through C each time).
static __always_inline u32 read_python(struct stack_rec *r, u32 tgid, u32 tid) {
    struct py_proc *p = py_procs.lookup(&tgid);
    if (!p)
        return STACK_NO_INTERPRETER;
    u32 status = STACK_OK;
    u64 frame = py_thread_frame(p, tid, &status);
    if (status != STACK_OK)
        return status;
    u32 cstack = p->owner_cstack, off_owner = p->fr_owner, off_code = p->fr_code, off_instr = p->fr_instr,
        off_prev = p->fr_previous;
    int i = 0;
#pragma clang loop unroll(disable)
    for (i = 0; i < 2 * PY_FRAMES && i < PY_SLOTS; i++) {
        if (!frame)
            break;
        u8 owner = 0;
        u64 code = 1, instr = 0, prev = 0;
        if (bpf_probe_read_user(&code, sizeof(code), (void *)(frame + off_code)))
            code = 1;
        bpf_probe_read_user(&instr, sizeof(instr), (void *)(frame + off_instr));
        if (cstack != PY_NONE && !bpf_probe_read_user(&owner, sizeof(owner), (void *)(frame + off_owner))
            && owner == cstack)
            code = 0;
        r->code[i & (PY_SLOTS - 1)] = code;
        r->instr[i & (PY_SLOTS - 1)] = instr;
        bpf_probe_read_user(&prev, sizeof(prev), (void *)(frame + off_prev));
        frame = prev;
    }
    r->npy = i;
    return frame ? STACK_TRUNCATED : STACK_OK;
}

// Record the calling thread's stacks; return the record's id (0: lost, the ring was full).
static __always_inline u64 capture_stack(struct pt_regs *ctx, u32 tgid, u32 tid) {
    u32 zero = 0;
    struct stack_rec *r = stacks.ringbuf_reserve(sizeof(struct stack_rec));
    if (!r) {
        u64 *n = stacks_lost.lookup(&zero);
        if (n)
            *n += 1;
        return 0;
    }
    u64 *seq = stack_seq.lookup(&zero);
    u64 id = 0;
    if (seq) {
        *seq += 1;
        id = ((u64)(bpf_get_smp_processor_id() + 1) << 48) | (*seq & 0xffffffffffffULL);
    }
    r->id = id;
    r->pid = tgid;
    r->tid = tid;
    long got = bpf_get_stack(ctx, r->native, sizeof(r->native), BPF_F_USER_STACK);
    r->nnative = got > 0 ? got / sizeof(u64) : 0;
    r->npy = 0;
    r->status = read_python(r, tgid, tid);
    stacks.ringbuf_submit(r, BPF_RB_NO_WAKEUP); // the event that names it wakes the reader
    return id;
}

// Give the event in `v` the calling thread's stack (its id in the ipc column, FLAG_STACK).
static __always_inline void with_stack(struct pt_regs *ctx, struct event *ev) {
    u64 id = bpf_get_current_pid_tgid();
    if (!wanted(id >> 32))
        return;
    u64 sid = capture_stack(ctx, id >> 32, (u32)id);
    __builtin_memcpy(ev->ipc, &sid, sizeof(sid));
    ev->flags |= FLAG_STACK;
}
#define WITH_STACK(ev) with_stack(ctx, ev)
#else
#define WITH_STACK(ev)
#endif

#define ORD_CURRENT (-2) // begin(): resolve the ordinal from the thread's current context

// Start a call: fill the common fields of `v` (the caller sets the rest) and stash it.
// `ordinal` is ORD_CURRENT, -1 (not device-bound) or the device an argument names.
static __always_inline int begin(struct inflight *v, u32 api, u16 kind, u32 mode, s32 ordinal) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    u32 tid = (u32)id;
    if (!wanted(tgid))
        return 0;
    v->ev.pid = tgid;
    v->ev.tid = tid;
    v->ev.kind = kind;
    v->ev.api = api;
    v->ev.ordinal = ordinal == ORD_CURRENT ? current_ordinal(tgid, tid) : ordinal;
    v->mode = mode;
    v->emit = kind != 0;
    u64 key = ((u64)api << 32) | tid;
    inflight.update(&key, v);
    return 0;
}

// The per-thread context bookkeeping done at return (success only).
static __always_inline void context_op(struct inflight *v, u32 tgid, u32 tid) {
    u32 mode = v->mode;
    if (mode == OUT_CTX_RETAIN || mode == OUT_CTX_CREATE) {
        u64 c = 0;
        bpf_probe_read_user(&c, sizeof(c), (void *)v->out);
        v->ev.handle = c;
        if (c) {
            struct ctx_key k = {.ctx = c, .tgid = tgid};
            s32 dev = v->ev.ordinal;
            ctx_dev.update(&k, &dev);
        }
        if (mode == OUT_CTX_CREATE) {
            struct ctx_stack *s = stack_of(tid);
            if (s)
                stack_push(s, c);
            thread_dev.delete(&tid);
        }
        return;
    }
    if (mode == OUT_CTX_GET_DEVICE) {
        s32 dev = -1;
        bpf_probe_read_user(&dev, sizeof(dev), (void *)v->out);
        u64 c = current_ctx(tid);
        v->ev.handle = c;
        v->ev.ordinal = dev;
        if (c) {
            struct ctx_key k = {.ctx = c, .tgid = tgid};
            ctx_dev.update(&k, &dev);
        }
        thread_dev.update(&tid, &dev);
        return;
    }
    struct ctx_stack *s = stack_of(tid);
    if (!s)
        return;
    if (mode == OUT_CTX_SET) {
        stack_set(s, v->arg);
    } else if (mode == OUT_CTX_PUSH) {
        stack_push(s, v->arg);
    } else if (mode == OUT_CTX_POP) {
        stack_pop(s);
    } else if (mode == OUT_CTX_DESTROY) {
        struct ctx_key k = {.ctx = v->arg, .tgid = tgid};
        ctx_dev.delete(&k);
        if (stack_top(s) == v->arg)
            stack_pop(s);
    } else if (mode == OUT_CTX_GET_CURRENT) {
        u64 c = 0;
        bpf_probe_read_user(&c, sizeof(c), (void *)v->out);
        if (c == 0)
            s->depth = 0; // no current context: the stack is empty
        else if (stack_top(s) != c)
            stack_set(s, c);
        return; // the current context is unchanged: keep what cuCtxGetDevice taught us
    }
    thread_dev.delete(&tid);
}

// Finish a call at its return probe: read the outputs, do the bookkeeping, submit.
static __always_inline int finish(struct pt_regs *ctx, u32 api) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    u32 tid = (u32)id;
    u64 key = ((u64)api << 32) | tid;
    struct inflight *v = inflight.lookup(&key);
    if (!v)
        return 0;
    s32 rc = (s32)PT_REGS_RC(ctx);
    v->ev.result = rc;
    if (rc == 0) {
        u32 mode = v->mode;
        if (mode == OUT_PTR) {
            bpf_probe_read_user(&v->ev.ptr, sizeof(u64), (void *)v->out);
        } else if (mode == OUT_HANDLE) {
            bpf_probe_read_user(&v->ev.handle, sizeof(u64), (void *)v->out);
        } else if (mode == OUT_IPC) {
            if (bpf_probe_read_user(v->ev.ipc, IPC_BYTES, (void *)v->out) == 0)
                v->ev.flags |= FLAG_IPC_BYTES;
        } else if (mode == OUT_PITCH) {
            u64 pitch = 0;
            bpf_probe_read_user(&v->ev.ptr, sizeof(u64), (void *)v->out);
            bpf_probe_read_user(&pitch, sizeof(pitch), (void *)v->arg);
            v->ev.size = pitch * v->arg2;
        } else if (mode == OUT_SHARE_EXPORT) {
            if (v->ev.aux == HANDLE_TYPE_POSIX_FD) {
                s32 fd = -1;
                bpf_probe_read_user(&fd, sizeof(fd), (void *)v->out);
                v->ev.ptr = (u64)(u32)fd;
            } else if (v->ev.aux == HANDLE_TYPE_FABRIC) {
                if (bpf_probe_read_user(v->ev.ipc, IPC_BYTES, (void *)v->out) == 0)
                    v->ev.flags |= FLAG_IPC_BYTES;
            }
        } else if (mode == OUT_CAPTURE) {
            struct stream_key k = {.stream = v->ev.handle, .tgid = tgid};
            u8 one = 1;
            capturing.update(&k, &one);
        } else if (mode >= OUT_CTX_RETAIN) {
            context_op(v, tgid, tid);
        }
    }
    if (v->emit)
        submit(&v->ev);
    inflight.delete(&key);
    return 0;
}

// ---- entry probes ----------------------------------------------------------------------------
// Each fills what only the entry can see; begin() stashes it for the return probe.

#define ENTRY(name) int enter_##name(struct pt_regs *ctx)
#define RETURN(name) \
    int return_##name(struct pt_regs *ctx) { return finish(ctx, API_##name); }
#define P1 PT_REGS_PARM1(ctx)
#define P2 PT_REGS_PARM2(ctx)
#define P3 PT_REGS_PARM3(ctx)
#define P4 PT_REGS_PARM4(ctx)
#define P5 PT_REGS_PARM5(ctx)

// A CUmemLocation {type, id} at +8 of a CUmemAllocationProp or CUmemPoolProps; unreadable: {0, -1}.
static __always_inline void read_location(u64 props, s32 *loc) {
    if (bpf_probe_read_user(loc, 2 * sizeof(s32), (void *)(props + 8)) != 0) {
        loc[0] = 0;
        loc[1] = -1;
    }
}

// alloc(CUdeviceptr *dptr, size_t bytesize, ...): ptr read at return; handle = stream or pool.
static __always_inline int alloc_entry(struct pt_regs *ctx, u32 api, u64 handle, u64 aux) {
    struct inflight v = {};
    v.out = P1;
    v.ev.size = P2;
    v.ev.handle = handle;
    v.ev.aux = aux;
    WITH_STACK(&v.ev);
    return begin(&v, api, KIND_ALLOC, OUT_PTR, ORD_CURRENT);
}

// Whether `stream` of the calling process is being captured into a graph.
static __always_inline int captured(u64 stream) {
    struct stream_key k = {.stream = stream, .tgid = bpf_get_current_pid_tgid() >> 32};
    return capturing.lookup(&k) != NULL;
}

// A stream-ordered allocation: graph-owned (GRAPH_ALLOC) when its stream is being captured.
static __always_inline int async_alloc_entry(struct pt_regs *ctx, u32 api, u64 handle, u64 stream) {
    struct inflight v = {};
    v.out = P1;
    v.ev.size = P2;
    v.ev.handle = handle;
    WITH_STACK(&v.ev);
    return begin(&v, api, captured(stream) ? KIND_GRAPH_ALLOC : KIND_ALLOC, OUT_PTR, ORD_CURRENT);
}

ENTRY(cuMemAlloc_v2) { return alloc_entry(ctx, API_cuMemAlloc_v2, 0, 0); }
ENTRY(cuMemAllocManaged) { return alloc_entry(ctx, API_cuMemAllocManaged, 0, (u32)P3); }
ENTRY(cuMemAllocAsync) { return async_alloc_entry(ctx, API_cuMemAllocAsync, P3, P3); }
ENTRY(cuMemAllocAsync_ptsz) { return async_alloc_entry(ctx, API_cuMemAllocAsync_ptsz, P3, P3); }
ENTRY(cuMemAllocFromPoolAsync) { return async_alloc_entry(ctx, API_cuMemAllocFromPoolAsync, P3, P4); }
ENTRY(cuMemAllocFromPoolAsync_ptsz) { return async_alloc_entry(ctx, API_cuMemAllocFromPoolAsync_ptsz, P3, P4); }

// cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height, unsigned)
ENTRY(cuMemAllocPitch_v2) {
    struct inflight v = {};
    v.out = P1;
    v.arg = P2;
    v.arg2 = P4;
    v.ev.size = P3 * P4; // what was asked; the pitch × height replaces it on success
    WITH_STACK(&v.ev);
    return begin(&v, API_cuMemAllocPitch_v2, KIND_ALLOC, OUT_PITCH, ORD_CURRENT);
}

// free(CUdeviceptr dptr[, CUstream])
// (A stream-ordered free on a stream being captured is a graph's free node: GRAPH_FREE.)
static __always_inline int free_entry(struct pt_regs *ctx, u32 api, u64 stream) {
    struct inflight v = {};
    v.ev.ptr = P1;
    v.ev.handle = stream;
    return begin(&v, api, stream && captured(stream) ? KIND_GRAPH_FREE : KIND_FREE, OUT_NONE, ORD_CURRENT);
}

ENTRY(cuMemFree_v2) { return free_entry(ctx, API_cuMemFree_v2, 0); }
// The per-thread default stream (NULL under _ptsz) is never a capture's key: captures are of streams made.
ENTRY(cuMemFreeAsync) { return free_entry(ctx, API_cuMemFreeAsync, P2); }
ENTRY(cuMemFreeAsync_ptsz) { return free_entry(ctx, API_cuMemFreeAsync_ptsz, P2); }

// cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop, u64)
// prop->location.type at +8, prop->location.id (the device ordinal) at +12.
ENTRY(cuMemCreate) {
    struct inflight v = {};
    v.out = P1;
    v.ev.size = P2;
    s32 loc[2];
    read_location(P3, loc);
    v.ev.aux = (u32)loc[0];
    // The device is the one the prop names, not the current context's.
    WITH_STACK(&v.ev);
    return begin(&v, API_cuMemCreate, KIND_VMM_CREATE, OUT_HANDLE, loc[1]);
}

// cuMemRelease(CUmemGenericAllocationHandle handle)
ENTRY(cuMemRelease) {
    struct inflight v = {};
    v.ev.handle = P1;
    return begin(&v, API_cuMemRelease, KIND_VMM_RELEASE, OUT_NONE, -1);
}

// cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle, u64 flags)
ENTRY(cuMemMap) {
    struct inflight v = {};
    v.ev.ptr = P1;
    v.ev.size = P2;
    v.ev.aux = P3;
    v.ev.handle = P4;
    return begin(&v, API_cuMemMap, KIND_VMM_MAP, OUT_NONE, -1);
}

// cuMemUnmap(CUdeviceptr ptr, size_t size)
ENTRY(cuMemUnmap) {
    struct inflight v = {};
    v.ev.ptr = P1;
    v.ev.size = P2;
    return begin(&v, API_cuMemUnmap, KIND_VMM_UNMAP, OUT_NONE, -1);
}

// cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr, u64 flags)
ENTRY(cuMemAddressReserve) {
    struct inflight v = {};
    v.out = P1;
    v.ev.size = P2;
    v.ev.aux = P3;
    v.ev.handle = P4;
    return begin(&v, API_cuMemAddressReserve, KIND_VA_RESERVE, OUT_PTR, -1);
}

// cuMemAddressFree(CUdeviceptr ptr, size_t size)
ENTRY(cuMemAddressFree) {
    struct inflight v = {};
    v.ev.ptr = P1;
    v.ev.size = P2;
    return begin(&v, API_cuMemAddressFree, KIND_VA_FREE, OUT_NONE, -1);
}

// cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr): handle bytes at return.
ENTRY(cuIpcGetMemHandle) {
    struct inflight v = {};
    v.out = P1;
    v.ev.ptr = P2;
    return begin(&v, API_cuIpcGetMemHandle, KIND_IPC_EXPORT, OUT_IPC, ORD_CURRENT);
}

// cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle /* by value */, unsigned Flags)
ENTRY(cuIpcOpenMemHandle_v2) {
    struct inflight v = {};
    v.out = P1;
#if defined(bpf_target_arm64)
    u64 handle_addr = P2; // AAPCS64: a pointer to the caller's copy
    v.ev.aux = (u32)P3;
#else
    u64 handle_addr = PT_REGS_SP(ctx) + 8; // SysV: on the stack above the return address
    v.ev.aux = (u32)P2;
#endif
    if (bpf_probe_read_user(v.ev.ipc, IPC_BYTES, (void *)handle_addr) == 0)
        v.ev.flags |= FLAG_IPC_BYTES;
    return begin(&v, API_cuIpcOpenMemHandle_v2, KIND_IPC_OPEN, OUT_PTR, ORD_CURRENT);
}

// cuIpcCloseMemHandle(CUdeviceptr dptr)
ENTRY(cuIpcCloseMemHandle) {
    struct inflight v = {};
    v.ev.ptr = P1;
    return begin(&v, API_cuIpcCloseMemHandle, KIND_IPC_CLOSE, OUT_NONE, ORD_CURRENT);
}

// cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle, type, u64 flags)
ENTRY(cuMemExportToShareableHandle) {
    struct inflight v = {};
    v.out = P1;
    v.ev.handle = P2;
    v.ev.aux = (u32)P3;
    return begin(&v, API_cuMemExportToShareableHandle, KIND_SHARE_EXPORT, OUT_SHARE_EXPORT, -1);
}

// cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle, type)
// POSIX_FD: osHandle is the fd value itself; FABRIC: it points at the 64-byte fabric handle.
ENTRY(cuMemImportFromShareableHandle) {
    struct inflight v = {};
    u32 type = (u32)P3;
    v.out = P1;
    v.ev.aux = type;
    if (type == HANDLE_TYPE_FABRIC) {
        if (bpf_probe_read_user(v.ev.ipc, IPC_BYTES, (void *)P2) == 0)
            v.ev.flags |= FLAG_IPC_BYTES;
    } else {
        v.ev.ptr = P2;
    }
    // The importing context's device: the GPU whose view the imported memory is mapped into.
    return begin(&v, API_cuMemImportFromShareableHandle, KIND_SHARE_IMPORT, OUT_HANDLE, ORD_CURRENT);
}

// cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr)
ENTRY(cuMemRetainAllocationHandle) {
    struct inflight v = {};
    v.out = P1;
    v.ev.ptr = P2;
    return begin(&v, API_cuMemRetainAllocationHandle, KIND_VMM_RETAIN, OUT_HANDLE, -1);
}

// Pinned host memory: cuMemHostAlloc(void **pp, size_t, unsigned Flags), cuMemAllocHost_v2(void **pp, size_t)
ENTRY(cuMemHostAlloc) {
    struct inflight v = {};
    v.out = P1;
    v.ev.size = P2;
    v.ev.aux = (u32)P3;
    WITH_STACK(&v.ev);
    return begin(&v, API_cuMemHostAlloc, KIND_HOST_ALLOC, OUT_PTR, ORD_CURRENT);
}

ENTRY(cuMemAllocHost_v2) {
    struct inflight v = {};
    v.out = P1;
    v.ev.size = P2;
    WITH_STACK(&v.ev);
    return begin(&v, API_cuMemAllocHost_v2, KIND_HOST_ALLOC, OUT_PTR, ORD_CURRENT);
}

ENTRY(cuMemFreeHost) {
    struct inflight v = {};
    v.ev.ptr = P1;
    return begin(&v, API_cuMemFreeHost, KIND_HOST_FREE, OUT_NONE, ORD_CURRENT);
}

// cuMemHostRegister_v2(void *p, size_t bytesize, unsigned Flags)
ENTRY(cuMemHostRegister_v2) {
    struct inflight v = {};
    v.ev.ptr = P1;
    v.ev.size = P2;
    v.ev.aux = (u32)P3;
    return begin(&v, API_cuMemHostRegister_v2, KIND_HOST_REGISTER, OUT_NONE, ORD_CURRENT);
}

ENTRY(cuMemHostUnregister) {
    struct inflight v = {};
    v.ev.ptr = P1;
    return begin(&v, API_cuMemHostUnregister, KIND_HOST_UNREGISTER, OUT_NONE, ORD_CURRENT);
}

// ---- contexts ------------------------------------------------------------------------------------
// A CTX event binds a context to a device ordinal: aux 0 retain, 1 create, 2 get-device.

// Besides stashing the call, submit a CTX_BEGIN at once: the context's cost is NVML's
// per-process used after the call minus before it, and only the entry tells "before".
static __always_inline int ctx_bind_entry(u32 api, u64 out, s32 dev, u64 subtype, u32 mode) {
    struct inflight v = {};
    v.out = out;
    v.ev.aux = subtype;
    begin(&v, api, KIND_CTX, mode, dev);
    if (v.ev.pid == 0)
        return 0; // not a wanted process (begin() left it untouched)
    v.ev.kind = KIND_CTX_BEGIN;
    submit(&v.ev);
    return 0;
}

// cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
ENTRY(cuDevicePrimaryCtxRetain) { return ctx_bind_entry(API_cuDevicePrimaryCtxRetain, P1, (s32)P2, 0, OUT_CTX_RETAIN); }
// cuCtxCreate_v2(CUcontext *pctx, unsigned flags, CUdevice dev)
ENTRY(cuCtxCreate_v2) { return ctx_bind_entry(API_cuCtxCreate_v2, P1, (s32)P3, 1, OUT_CTX_CREATE); }
// cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *params, int n, unsigned flags, CUdevice dev)
ENTRY(cuCtxCreate_v3) { return ctx_bind_entry(API_cuCtxCreate_v3, P1, (s32)P5, 1, OUT_CTX_CREATE); }
// cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *params, unsigned flags, CUdevice dev)
ENTRY(cuCtxCreate_v4) { return ctx_bind_entry(API_cuCtxCreate_v4, P1, (s32)P4, 1, OUT_CTX_CREATE); }

// cuCtxGetDevice(CUdevice *device)
ENTRY(cuCtxGetDevice) {
    struct inflight v = {};
    v.out = P1;
    v.ev.aux = 2;
    return begin(&v, API_cuCtxGetDevice, KIND_CTX, OUT_CTX_GET_DEVICE, -1);
}

// Bookkeeping only (no event): kind 0 tells begin() not to emit.
static __always_inline int ctx_track_entry(u32 api, u32 mode, u64 out, u64 arg) {
    struct inflight v = {};
    v.out = out;
    v.arg = arg;
    return begin(&v, api, 0, mode, -1);
}

ENTRY(cuCtxSetCurrent) { return ctx_track_entry(API_cuCtxSetCurrent, OUT_CTX_SET, 0, P1); }
ENTRY(cuCtxPushCurrent_v2) { return ctx_track_entry(API_cuCtxPushCurrent_v2, OUT_CTX_PUSH, 0, P1); }
ENTRY(cuCtxPopCurrent_v2) { return ctx_track_entry(API_cuCtxPopCurrent_v2, OUT_CTX_POP, P1, 0); }
ENTRY(cuCtxDestroy_v2) { return ctx_track_entry(API_cuCtxDestroy_v2, OUT_CTX_DESTROY, 0, P1); }
ENTRY(cuCtxGetCurrent) { return ctx_track_entry(API_cuCtxGetCurrent, OUT_CTX_GET_CURRENT, P1, 0); }

// ---- device code ---------------------------------------------------------------------------------
// Loads run at start-up or once per module (cuLibraryLoad*, cuModuleLoad*) and once per kernel under
// lazy loading (cuLibraryGetKernel, cuKernelGetFunction); never on the launch path.

// How many bytes an in-memory code image spans, from its header (0: unknown). A module's code on
// the device cannot exceed what its image could place there (memrec.analysis.untraced bounds
// module-code steps by it). Fatbin: magic 0xBA55ED50, u16 header size at +6, u64 body size at +8;
// a fatbin wrapper (0x466243B1) points at one at +8; ELF (a cubin): section headers end the file
// (e_shoff +0x28, e_shentsize +0x3A, e_shnum +0x3C); PTX text (starting with a directive, a
// comment or blank): its length, if under 4 KiB; anything else: unknown.
#define MAGIC_FATBIN 0xBA55ED50u
#define MAGIC_FATBIN_WRAPPER 0x466243B1u
struct scratch_buf {
    char b[4096];
};
BPF_PERCPU_ARRAY(scratch, struct scratch_buf, 1);

static __always_inline u64 image_size(u64 ptr) {
    u8 head[64] = {};
    if (bpf_probe_read_user(head, sizeof(head), (void *)ptr) != 0)
        return 0;
    u32 magic = *(u32 *)head;
    if (magic == MAGIC_FATBIN_WRAPPER) {
        ptr = *(u64 *)(head + 8);
        if (bpf_probe_read_user(head, 16, (void *)ptr) != 0)
            return 0;
        magic = *(u32 *)head;
    }
    if (magic == MAGIC_FATBIN)
        return (u64)(*(u16 *)(head + 6)) + *(u64 *)(head + 8);
    if (head[0] == 0x7f && head[1] == 'E' && head[2] == 'L' && head[3] == 'F')
        return *(u64 *)(head + 0x28) + (u64)(*(u16 *)(head + 0x3A)) * (*(u16 *)(head + 0x3C));
    if (head[0] != '.' && head[0] != '/' && head[0] != '\n' && head[0] != ' ' && head[0] != '\t')
        return 0; // neither a header nor PTX text (a version, a comment or blank first)
    u32 zero = 0;
    struct scratch_buf *buf = scratch.lookup(&zero);
    if (!buf)
        return 0;
    long n = bpf_probe_read_user_str(buf->b, sizeof(buf->b), (void *)ptr);
    return n > 0 && n < (long)sizeof(buf->b) ? (u64)n : 0;
}

// A load or fetch: *out -> handle at return; aux = its entry time; ptr = the image in memory (loads) or the library /
// kernel a fetch names; a file or kernel name, when there is one, read into ipc (cut at 63 bytes).
static __always_inline int load_entry(struct pt_regs *ctx, u32 api, u16 kind, u64 ptr, u64 name) {
    struct inflight v = {};
    v.out = P1;
    v.ev.ptr = ptr;
    if (name && bpf_probe_read_user_str(v.ev.ipc, IPC_BYTES, (void *)name) > 0)
        v.ev.flags |= FLAG_NAME;
    if (kind == KIND_CODE_LOAD && ptr)
        v.ev.size = image_size(ptr);
    v.ev.aux = bpf_ktime_get_ns(); // the call's entry: a reading taken while it runs is its
    return begin(&v, api, kind, OUT_HANDLE, ORD_CURRENT);
}

// cuLibraryLoadData(CUlibrary *library, const void *code, ...jit and library options)
ENTRY(cuLibraryLoadData) { return load_entry(ctx, API_cuLibraryLoadData, KIND_CODE_LOAD, P2, 0); }
// cuLibraryLoadFromFile(CUlibrary *library, const char *fileName, ...)
ENTRY(cuLibraryLoadFromFile) { return load_entry(ctx, API_cuLibraryLoadFromFile, KIND_CODE_LOAD, 0, P2); }
// cuModuleLoad(CUmodule *module, const char *fname)
ENTRY(cuModuleLoad) { return load_entry(ctx, API_cuModuleLoad, KIND_CODE_LOAD, 0, P2); }
// cuModuleLoadData(CUmodule *module, const void *image)
ENTRY(cuModuleLoadData) { return load_entry(ctx, API_cuModuleLoadData, KIND_CODE_LOAD, P2, 0); }
// cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned numOptions, ...)
ENTRY(cuModuleLoadDataEx) { return load_entry(ctx, API_cuModuleLoadDataEx, KIND_CODE_LOAD, P2, 0); }
// cuModuleLoadFatBinary(CUmodule *module, const void *fatCubin)
ENTRY(cuModuleLoadFatBinary) { return load_entry(ctx, API_cuModuleLoadFatBinary, KIND_CODE_LOAD, P2, 0); }

// A call about one handle (and a byte count): unloads, pool destruction and trims; aux = its entry time.
static __always_inline int handle_entry(u32 api, u16 kind, u64 handle, u64 size, s32 ordinal) {
    struct inflight v = {};
    v.ev.handle = handle;
    v.ev.size = size;
    v.ev.aux = bpf_ktime_get_ns(); // the call's entry (memrec.analysis.untraced: a call in flight at a reading)
    return begin(&v, api, kind, OUT_NONE, ordinal);
}

// cuLibraryUnload(CUlibrary library), cuModuleUnload(CUmodule hmod)
ENTRY(cuLibraryUnload) { return handle_entry(API_cuLibraryUnload, KIND_CODE_UNLOAD, P1, 0, ORD_CURRENT); }
ENTRY(cuModuleUnload) { return handle_entry(API_cuModuleUnload, KIND_CODE_UNLOAD, P1, 0, ORD_CURRENT); }

// cuLibraryGetKernel(CUkernel *pKernel, CUlibrary library, const char *name): with the kernel's name.
ENTRY(cuLibraryGetKernel) { return load_entry(ctx, API_cuLibraryGetKernel, KIND_KERNEL_LOAD, P2, P3); }
// cuKernelGetFunction(CUfunction *pFunc, CUkernel kernel): loads the kernel into the current context.
ENTRY(cuKernelGetFunction) { return load_entry(ctx, API_cuKernelGetFunction, KIND_KERNEL_LOAD, P2, 0); }

// ---- stream-ordered pools ------------------------------------------------------------------------

// cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props): props->location.id at +12
// (the same head as CUmemAllocationProp), props->maxSize at +24.
ENTRY(cuMemPoolCreate) {
    struct inflight v = {};
    v.out = P1;
    s32 loc[2];
    read_location(P2, loc);
    bpf_probe_read_user(&v.ev.size, sizeof(u64), (void *)(P2 + 24));
    v.ev.aux = (u32)loc[0];
    return begin(&v, API_cuMemPoolCreate, KIND_POOL, OUT_HANDLE, loc[1]);
}

// cuDeviceGetDefaultMemPool(CUmemoryPool *pool_out, CUdevice dev)
ENTRY(cuDeviceGetDefaultMemPool) {
    struct inflight v = {};
    v.out = P1;
    return begin(&v, API_cuDeviceGetDefaultMemPool, KIND_POOL, OUT_HANDLE, (s32)P2);
}

// cuMemPoolDestroy(CUmemoryPool pool), cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep)
ENTRY(cuMemPoolDestroy) { return handle_entry(API_cuMemPoolDestroy, KIND_POOL_DESTROY, P1, 0, -1); }
ENTRY(cuMemPoolTrimTo) { return handle_entry(API_cuMemPoolTrimTo, KIND_POOL_TRIM, P1, P2, -1); }

// cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value): the value is a
// cuuint64_t from the release threshold on (attributes 4..8), an int before it.
ENTRY(cuMemPoolSetAttribute) {
    struct inflight v = {};
    u32 attr = (u32)P2;
    v.ev.handle = P1;
    v.ev.aux = attr;
    if (attr >= MEMPOOL_ATTR_RELEASE_THRESHOLD) {
        bpf_probe_read_user(&v.ev.size, sizeof(u64), (void *)P3);
    } else {
        u32 small = 0;
        bpf_probe_read_user(&small, sizeof(small), (void *)P3);
        v.ev.size = small;
    }
    return begin(&v, API_cuMemPoolSetAttribute, KIND_POOL_ATTR, OUT_NONE, -1);
}

// ---- device memory no allocation call takes (issue 21) ------------------------------------------
// Each is called at set-up or once per array, limit, capture, graph or multicast object; nothing
// here runs per launch (cuGraphLaunch and cuLaunchKernel are never probed).

// CUarray_format -> bytes per channel (cuda.h); 0 for a format memrec does not size.
static __always_inline u64 format_bytes(u32 f) {
    switch (f) {
    case 0x01: case 0x08: return 1;          // (UN)SIGNED_INT8
    case 0x02: case 0x09: case 0x10: return 2; // (UN)SIGNED_INT16, HALF
    case 0x03: case 0x0a: case 0x20: return 4; // (UN)SIGNED_INT32, FLOAT
    default: return 0;
    }
}

// An array's bytes from its descriptor: width × height × depth × channels × format, and for a
// mipmapped array every level (each halves every extent, down to 1). aux = levels << 32 |
// format << 8 | channels; the extents go to ipc (3 × u64) with FLAG_NAME unset.
static __always_inline int array_entry(struct pt_regs *ctx, u32 api, u64 desc, int three_d, u32 levels) {
    struct inflight v = {};
    u64 ext[3] = {0, 0, 0};
    u32 fc[2] = {0, 0}; // format, channels
    if (three_d) {
        bpf_probe_read_user(ext, sizeof(ext), (void *)desc);
        bpf_probe_read_user(fc, sizeof(fc), (void *)(desc + 24));
    } else {
        bpf_probe_read_user(ext, 2 * sizeof(u64), (void *)desc);
        bpf_probe_read_user(fc, sizeof(fc), (void *)(desc + 16));
    }
    u64 w = ext[0], h = ext[1], d = ext[2];
    u64 per = format_bytes(fc[0]) * fc[1];
    u64 total = 0;
    if (levels == 0)
        levels = 1;
#pragma unroll
    for (int i = 0; i < 16; i++) {
        if (i < levels) {
            total += (w ? w : 1) * (h ? h : 1) * (d ? d : 1) * per;
            w = w > 1 ? w >> 1 : w;
            h = h > 1 ? h >> 1 : h;
            d = d > 1 ? d >> 1 : d;
        }
    }
    v.out = P1;
    v.ev.size = total;
    v.ev.aux = ((u64)levels << 32) | ((u64)(fc[0] & 0xffffff) << 8) | (fc[1] & 0xff);
    __builtin_memcpy(v.ev.ipc, ext, sizeof(ext));
    return begin(&v, api, KIND_ARRAY_CREATE, OUT_HANDLE, ORD_CURRENT);
}

// cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *d): Width +0, Height +8, Format +16, NumChannels +20
ENTRY(cuArrayCreate_v2) { return array_entry(ctx, API_cuArrayCreate_v2, P2, 0, 1); }
// cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d): Width, Height, Depth, Format +24, NumChannels +28
ENTRY(cuArray3DCreate_v2) { return array_entry(ctx, API_cuArray3DCreate_v2, P2, 1, 1); }
// cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned numMipmapLevels)
ENTRY(cuMipmappedArrayCreate) { return array_entry(ctx, API_cuMipmappedArrayCreate, P2, 1, (u32)P3); }
ENTRY(cuArrayDestroy) { return handle_entry(API_cuArrayDestroy, KIND_ARRAY_DESTROY, P1, 0, ORD_CURRENT); }
ENTRY(cuMipmappedArrayDestroy) { return handle_entry(API_cuMipmappedArrayDestroy, KIND_ARRAY_DESTROY, P1, 0, ORD_CURRENT); }

// cuCtxSetLimit(CUlimit limit, size_t value)
ENTRY(cuCtxSetLimit) {
    struct inflight v = {};
    v.ev.aux = (u32)P1;
    v.ev.size = P2;
    return begin(&v, API_cuCtxSetLimit, KIND_CTX_LIMIT, OUT_NONE, ORD_CURRENT);
}

// cuStreamBeginCapture_v2(CUstream hStream, CUstreamCaptureMode mode): the stream is marked as
// capturing at return (success only, in finish()'s OUT_CAPTURE).
static __always_inline int capture_entry(u32 api, u64 stream, u64 mode) {
    struct inflight v = {};
    v.ev.handle = stream;
    v.ev.aux = mode;
    return begin(&v, api, KIND_CAPTURE_BEGIN, OUT_CAPTURE, ORD_CURRENT);
}
ENTRY(cuStreamBeginCapture_v2) { return capture_entry(API_cuStreamBeginCapture_v2, P1, (u32)P2); }
ENTRY(cuStreamBeginCapture_v2_ptsz) { return capture_entry(API_cuStreamBeginCapture_v2_ptsz, P1, (u32)P2); }

// cuStreamEndCapture(CUstream hStream, CUgraph *phGraph): the graph at return (ptr); the stream
// stops counting as captured at entry (an allocation after the call is live again).
static __always_inline int end_capture_entry(struct pt_regs *ctx, u32 api) {
    struct inflight v = {};
    struct stream_key k = {.stream = P1, .tgid = bpf_get_current_pid_tgid() >> 32};
    capturing.delete(&k);
    v.out = P2;
    v.ev.handle = P1;
    return begin(&v, api, KIND_CAPTURE_END, OUT_PTR, ORD_CURRENT);
}
ENTRY(cuStreamEndCapture) { return end_capture_entry(ctx, API_cuStreamEndCapture); }
ENTRY(cuStreamEndCapture_ptsz) { return end_capture_entry(ctx, API_cuStreamEndCapture_ptsz); }

// cuGraphAddMemAllocNode(CUgraphNode *node, CUgraph graph, const CUgraphNode *deps, size_t n,
// CUDA_MEM_ALLOC_NODE_PARAMS *params): poolProps (88 bytes: location.id at +12) then
// accessDescs (+88), accessDescCount (+96), bytesize (+104), dptr (+112, written at return).
ENTRY(cuGraphAddMemAllocNode) {
    struct inflight v = {};
    u64 params = P5;
    s32 loc[2];
    read_location(params, loc);
    bpf_probe_read_user(&v.ev.size, sizeof(u64), (void *)(params + 104));
    v.out = params + 112;
    v.ev.handle = P2;
    WITH_STACK(&v.ev);
    return begin(&v, API_cuGraphAddMemAllocNode, KIND_GRAPH_ALLOC, OUT_PTR, loc[1]);
}

// cuGraphAddMemFreeNode(CUgraphNode *node, CUgraph graph, const CUgraphNode *deps, size_t n, CUdeviceptr dptr)
ENTRY(cuGraphAddMemFreeNode) {
    struct inflight v = {};
    v.ev.handle = P2;
    v.ev.ptr = P5;
    return begin(&v, API_cuGraphAddMemFreeNode, KIND_GRAPH_FREE, OUT_NONE, ORD_CURRENT);
}

// cuGraphInstantiateWithFlags(CUgraphExec *exec, CUgraph graph, u64 flags) and
// cuGraphInstantiateWithParams(CUgraphExec *exec, CUgraph graph, CUDA_GRAPH_INSTANTIATE_PARAMS *p):
// handle = the executable graph (at return), ptr = the graph.
static __always_inline int instantiate_entry(struct pt_regs *ctx, u32 api) {
    struct inflight v = {};
    v.out = P1;
    v.ev.ptr = P2;
    return begin(&v, api, KIND_GRAPH_EXEC, OUT_HANDLE, ORD_CURRENT);
}
ENTRY(cuGraphInstantiateWithFlags) { return instantiate_entry(ctx, API_cuGraphInstantiateWithFlags); }
ENTRY(cuGraphInstantiateWithParams) { return instantiate_entry(ctx, API_cuGraphInstantiateWithParams); }
ENTRY(cuGraphInstantiateWithParams_ptsz) { return instantiate_entry(ctx, API_cuGraphInstantiateWithParams_ptsz); }

// cuGraphUpload(CUgraphExec exec, CUstream stream): the graph's memory can reach the device now.
static __always_inline int upload_entry(u32 api, u64 exec, u64 stream) {
    struct inflight v = {};
    v.ev.handle = exec;
    v.ev.ptr = stream;
    v.ev.aux = 1;
    return begin(&v, api, KIND_GRAPH_EXEC, OUT_NONE, ORD_CURRENT);
}
ENTRY(cuGraphUpload) { return upload_entry(API_cuGraphUpload, P1, P2); }
ENTRY(cuGraphUpload_ptsz) { return upload_entry(API_cuGraphUpload_ptsz, P1, P2); }

// cuDeviceGraphMemTrim(CUdevice device)
ENTRY(cuDeviceGraphMemTrim) { return handle_entry(API_cuDeviceGraphMemTrim, KIND_GRAPH_TRIM, 0, 0, (s32)P1); }

// cuMulticastCreate(CUmemGenericAllocationHandle *mcHandle, const CUmulticastObjectProp *prop):
// prop = {unsigned numDevices; size_t size (+8); u64 handleTypes; u64 flags}.
ENTRY(cuMulticastCreate) {
    struct inflight v = {};
    u32 n = 0;
    bpf_probe_read_user(&n, sizeof(n), (void *)P2);
    bpf_probe_read_user(&v.ev.size, sizeof(u64), (void *)(P2 + 8));
    v.out = P1;
    v.ev.aux = n;
    return begin(&v, API_cuMulticastCreate, KIND_MULTICAST_CREATE, OUT_HANDLE, ORD_CURRENT);
}

// A call about a multicast object: handle, then per kind a device, offsets, a memory handle or
// address, and a size.
static __always_inline int multicast_entry(u32 api, u16 kind, u64 handle, u64 ptr, u64 aux, u64 size, s32 ordinal) {
    struct inflight v = {};
    v.ev.handle = handle;
    v.ev.ptr = ptr;
    v.ev.aux = aux;
    v.ev.size = size;
    return begin(&v, api, kind, OUT_NONE, ordinal);
}

// cuMulticastAddDevice(CUmemGenericAllocationHandle mc, CUdevice dev)
ENTRY(cuMulticastAddDevice) {
    return multicast_entry(API_cuMulticastAddDevice, KIND_MULTICAST_ADD, P1, 0, (u32)P2, 0, (s32)P2);
}
// cuMulticastBindMem(mc, size_t mcOffset, CUmemGenericAllocationHandle memHandle, size_t memOffset, size_t size, u64 flags)
ENTRY(cuMulticastBindMem) {
    return multicast_entry(API_cuMulticastBindMem, KIND_MULTICAST_BIND, P1, P2, P3, P5, ORD_CURRENT);
}
// cuMulticastBindAddr(mc, size_t mcOffset, CUdeviceptr memptr, size_t size, u64 flags)
ENTRY(cuMulticastBindAddr) {
    return multicast_entry(API_cuMulticastBindAddr, KIND_MULTICAST_BIND, P1, P2, P3, P4, ORD_CURRENT);
}
// cuMulticastUnbind(mc, CUdevice dev, size_t mcOffset, size_t size)
ENTRY(cuMulticastUnbind) {
    return multicast_entry(API_cuMulticastUnbind, KIND_MULTICAST_UNBIND, P1, P3, (u32)P2, P4, (s32)P2);
}

// ---- return probes -------------------------------------------------------------------------------

RETURN(cuMemAlloc_v2)
RETURN(cuMemAllocPitch_v2)
RETURN(cuMemAllocManaged)
RETURN(cuMemAllocAsync)
RETURN(cuMemAllocAsync_ptsz)
RETURN(cuMemAllocFromPoolAsync)
RETURN(cuMemAllocFromPoolAsync_ptsz)
RETURN(cuMemFree_v2)
RETURN(cuMemFreeAsync)
RETURN(cuMemFreeAsync_ptsz)
RETURN(cuMemCreate)
RETURN(cuMemRelease)
RETURN(cuMemMap)
RETURN(cuMemUnmap)
RETURN(cuMemAddressReserve)
RETURN(cuMemAddressFree)
RETURN(cuIpcGetMemHandle)
RETURN(cuIpcOpenMemHandle_v2)
RETURN(cuIpcCloseMemHandle)
RETURN(cuMemExportToShareableHandle)
RETURN(cuMemImportFromShareableHandle)
RETURN(cuMemRetainAllocationHandle)
RETURN(cuMemHostAlloc)
RETURN(cuMemAllocHost_v2)
RETURN(cuMemFreeHost)
RETURN(cuMemHostRegister_v2)
RETURN(cuMemHostUnregister)
RETURN(cuDevicePrimaryCtxRetain)
RETURN(cuCtxCreate_v2)
RETURN(cuCtxCreate_v3)
RETURN(cuCtxCreate_v4)
RETURN(cuCtxSetCurrent)
RETURN(cuCtxPushCurrent_v2)
RETURN(cuCtxPopCurrent_v2)
RETURN(cuCtxDestroy_v2)
RETURN(cuCtxGetCurrent)
RETURN(cuCtxGetDevice)
RETURN(cuLibraryLoadData)
RETURN(cuLibraryLoadFromFile)
RETURN(cuLibraryUnload)
RETURN(cuModuleLoad)
RETURN(cuModuleLoadData)
RETURN(cuModuleLoadDataEx)
RETURN(cuModuleLoadFatBinary)
RETURN(cuModuleUnload)
RETURN(cuLibraryGetKernel)
RETURN(cuKernelGetFunction)
RETURN(cuMemPoolCreate)
RETURN(cuMemPoolDestroy)
RETURN(cuMemPoolTrimTo)
RETURN(cuMemPoolSetAttribute)
RETURN(cuDeviceGetDefaultMemPool)
RETURN(cuArrayCreate_v2)
RETURN(cuArray3DCreate_v2)
RETURN(cuMipmappedArrayCreate)
RETURN(cuArrayDestroy)
RETURN(cuMipmappedArrayDestroy)
RETURN(cuCtxSetLimit)
RETURN(cuStreamBeginCapture_v2)
RETURN(cuStreamBeginCapture_v2_ptsz)
RETURN(cuStreamEndCapture)
RETURN(cuStreamEndCapture_ptsz)
RETURN(cuGraphAddMemAllocNode)
RETURN(cuGraphAddMemFreeNode)
RETURN(cuGraphInstantiateWithFlags)
RETURN(cuGraphInstantiateWithParams)
RETURN(cuGraphInstantiateWithParams_ptsz)
RETURN(cuGraphUpload)
RETURN(cuGraphUpload_ptsz)
RETURN(cuDeviceGraphMemTrim)
RETURN(cuMulticastCreate)
RETURN(cuMulticastAddDevice)
RETURN(cuMulticastBindMem)
RETURN(cuMulticastBindAddr)
RETURN(cuMulticastUnbind)

// ---- process lifetime ------------------------------------------------------------------------

// Every exiting task: forget its per-thread state; when the whole thread group is gone (or, on
// kernels without group_dead, when its leader exits) emit PROC_EXIT for tgids that had events:
// the driver frees everything such a process still held.
TRACEPOINT_PROBE(sched, sched_process_exit) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    u32 tid = (u32)id;
    ctx_stacks.delete(&tid);
    thread_dev.delete(&tid);
#ifdef HAVE_GROUP_DEAD
    if (!args->group_dead)
        return 0;
#else
    if (tid != tgid)
        return 0;
#endif
#ifdef FOLLOW_TREE
    tracked.delete(&tgid);
#endif
    if (!seen.lookup(&tgid))
        return 0;
    seen.delete(&tgid);
    submit_proc(KIND_PROC_EXIT, API_sched_process_exit, tgid, tid, 0);
    return 0;
}

#ifdef FOLLOW_TREE
// A tracked process forked: track the child before it can run. task_newtask fires in the
// parent's context inside copy_process (like sched_process_fork, just before it) and carries
// clone_flags, which tells a new process from a new thread (threads share the tracked tgid and
// must not be reported as forks). The event keeps Api.sched_process_fork: it is the same moment.
TRACEPOINT_PROBE(task, task_newtask) {
    if (args->clone_flags & CLONE_THREAD_FLAG)
        return 0;
    u64 id = bpf_get_current_pid_tgid();
    u32 parent = id >> 32;
    if (!tracked.lookup(&parent))
        return 0;
    u32 child = args->pid;
    u8 one = 1;
    tracked.update(&child, &one);
    submit_proc(KIND_PROC_FORK, API_sched_process_fork, parent, (u32)id, child);
    return 0;
}
#endif
