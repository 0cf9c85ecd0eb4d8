// SPDX-License-Identifier: Apache-2.0
//
// torch.bpf.c: PyTorch's caching-allocator USDT probes (pytorch:malloc, pytorch:free in
// libc10_cuda.so), appended to cuda.bpf.c (its ring, submit() and wanted() are used).
//
// Why one generic function and a spec table: the argument forms are the compiler's choice
// (PyTorch 2.11 built by its gcc: malloc = "-8@%rax -1@%dl -8@%r14 -8@-56(%rbp)"), so another
// release or build has others. memrec.probes.usdt parses each probe's note into a usdt_spec,
// stores it in `usdt_specs` and attaches usdt_torch at the probe with the spec's index as the
// BPF cookie. One program serves every PyTorch install on the host, whatever its registers.
//
// The probes sit behind semaphores (TORCH_SDT_IS_ENABLED): the attach passes each semaphore's
// file offset as the uprobe's ref_ctr_offset, and the kernel raises it in every process that maps
// the library, now and later. Nothing is written into a process here.

#define USDT_MAX_ARGS 12
#define USDT_SPECS 256
#define USDT_ARG_CONST 1
#define USDT_ARG_REG 2
#define USDT_ARG_DEREF 3
#define TORCH_MALLOC 1
#define TORCH_FREE 2
#define PT_REGS_BYTES 168 // sizeof(struct pt_regs) on x86-64: a register offset must be below

// One argument as memrec.probes.usdt.UsdtArg.pack() writes it.
struct usdt_arg {
    s64 value;   // the constant, or the memory operand's displacement
    u32 kind;    // USDT_ARG_*
    u32 reg_off; // the register's offset in struct pt_regs
    u32 shift;   // 64 - 8 * size: cut the value to its size
    u32 is_signed;
};

struct usdt_spec {
    struct usdt_arg args[USDT_MAX_ARGS];
    u32 nargs;
    u32 what; // TORCH_MALLOC, TORCH_FREE; 0: an unused slot
};

BPF_ARRAY(usdt_specs, struct usdt_spec, USDT_SPECS);

// Argument i of the probe, as the spec says to read it; 0 on success.
static __always_inline int usdt_arg(struct pt_regs *ctx, struct usdt_spec *spec, u32 i, u64 *out) {
    if (i >= USDT_MAX_ARGS || i >= spec->nargs)
        return -1;
    struct usdt_arg *a = &spec->args[i];
    u64 val = 0;
    u32 kind = a->kind;
    if (kind == USDT_ARG_CONST) {
        val = (u64)a->value;
    } else if (kind == USDT_ARG_REG || kind == USDT_ARG_DEREF) {
        u32 off = a->reg_off;
        if (off > PT_REGS_BYTES - sizeof(u64))
            return -1;
        if (bpf_probe_read_kernel(&val, sizeof(val), (void *)ctx + off))
            return -1;
        if (kind == USDT_ARG_DEREF && bpf_probe_read_user(&val, sizeof(val), (void *)(val + a->value)))
            return -1;
    } else {
        return -1;
    }
    u32 shift = a->shift & 63;
    val <<= shift;
    if (a->is_signed)
        val = (u64)(((s64)val) >> shift);
    else
        val >>= shift;
    *out = val;
    return 0;
}

int usdt_torch(struct pt_regs *ctx) {
    u32 idx = (u32)bpf_get_attach_cookie(ctx);
    struct usdt_spec *spec = usdt_specs.lookup(&idx);
    if (!spec || !spec->what)
        return 0;
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!wanted(tgid))
        return 0;
    struct event ev = {};
    ev.pid = tgid;
    ev.tid = (u32)id;
    ev.ordinal = -1;
    u64 ptr = 0;
    if (usdt_arg(ctx, spec, 0, &ptr))
        return 0;
    ev.ptr = ptr;
    if (spec->what == TORCH_MALLOC) {
        u64 device = 0, size = 0, stream = 0;
        if (usdt_arg(ctx, spec, 1, &device) || usdt_arg(ctx, spec, 2, &size))
            return 0;
        usdt_arg(ctx, spec, 3, &stream); // the stream is extra: a build without it still counts
        ev.kind = KIND_TENSOR_ALLOC;
        ev.api = API_torch_malloc;
        ev.ordinal = (s32)device;
        ev.size = size;
        ev.handle = stream;
#ifdef STACKS
        if (size >= STACK_MIN_BYTES)
            WITH_STACK(&ev);
#endif
    } else {
        ev.kind = KIND_TENSOR_FREE;
        ev.api = API_torch_free;
    }
    submit(&ev);
    return 0;
}
