/*
 * cuda_stub.c: a stand-in for the CUDA driver (libcuda.so.1) with no GPU behind it.
 *
 * Why it exists: memrec's probes are uprobes on libcuda's exported symbols. To test them on a
 * machine without a GPU (CI, laptops, the no-GPU quick start) we need a library that exports the
 * same symbols with the same ABI as cuda.h, so the BPF program reads arguments, out-pointers and
 * the 64-byte by-value IPC handle exactly where the real driver has them. No memory is ever
 * allocated on a device: device pointers are fake addresses, one window per physical device, and
 * a per-device capacity makes over-capacity allocations fail with CUDA_ERROR_OUT_OF_MEMORY.
 *
 * Behaviour worth knowing:
 *  - MEMREC_STUB_DEVICES (default 2) physical devices; MEMREC_STUB_DEVICE_BYTES (default 80 GiB)
 *    each. CUDA_VISIBLE_DEVICES (comma list of indices) maps ordinals to physical devices; the
 *    list stops at the first invalid entry, as the real driver does.
 *  - Accounting is per process (there is no shared state between processes).
 *  - IPC handles and fabric handles encode (exporter pid, pointer/handle, size, device) plus a
 *    magic, so another process can open them. POSIX fds from cuMemExportToShareableHandle are
 *    unlinked temp files holding the same encoding, so they survive SCM_RIGHTS.
 *  - Exported functions never call each other, so one API call is exactly one probe hit.
 *  - Device code and stream-ordered pools behave as measured on an H200 (docs/validation/
 *    untraced-explore.md): a library load costs nothing on the device; a kernel fetched into a
 *    context (cuLibraryGetKernel with a context current, cuKernelGetFunction) costs
 *    MEMREC_STUB_KERNEL_BYTES, the first one in a context MEMREC_STUB_FIRST_KERNEL_BYTES (the
 *    lazy first-launch step); a module load (cuModuleLoad*) costs MEMREC_STUB_MODULE_BYTES; a
 *    context MEMREC_STUB_CTX_BYTES. Pools keep freed blocks up to their release threshold
 *    (default 0: at once given back, as after a sync) until a trim or their destruction.
 *  - With MEMREC_STUB_NVML_DIR set, the stub writes what NVML would say this process uses on each
 *    physical device to MEMREC_STUB_NVML_DIR/<pid> ("<device> <bytes>" lines, rewritten on every
 *    change): contexts + device code + allocations + pool-held bytes. Tests stand it in for NVML.
 *  - Device memory no allocation call takes, as measured on an H200 (docs/validation/families.md):
 *    a CUDA array costs its descriptor's bytes rounded up to 2 MiB at creation; a stack limit
 *    costs (new - old) x MEMREC_STUB_RESIDENT_THREADS (default 132 x 2048; old: 1 KiB at first)
 *    inside cuCtxSetLimit once the context has launched a kernel, else at its next cuLaunchKernel
 *    (never probed); the malloc heap and printf FIFO limits cost nothing (as on the H200 for
 *    kernels using neither); a stream-ordered allocation made while its stream is captured
 *    (cuStreamBeginCapture_v2 .. cuStreamEndCapture) or a graph memory node takes nothing until its
 *    graph is uploaded or launched (the graph pool grows to the largest graph's footprint, rounded
 *    up to 2 MiB) and gives it back at cuDeviceGraphMemTrim; multicast objects are refused (CUDA_ERROR_NOT_SUPPORTED, as on one H200)
 *    unless MEMREC_STUB_MULTICAST=1, then they cost nothing of their own. A module loaded from PTX
 *    text costs nothing (a one-line PTX module was +0 on the H200).
 *  - MEMREC_STUB_PACE_US: context binds, code loads, kernel fetches, pool calls and stream-ordered
 *    allocations sleep this long before they act, as the real driver takes its time (a primary
 *    retain took ~100 ms on an H200): a recorder reading NVML after each call sees one step each.
 *
 * Build: cc -O1 -g -fPIC -shared -Wl,-soname,libcuda.so.1 -o libcuda.so.1 cuda_stub.c -lpthread
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- cuda.h types (the subset the probes read; layouts as in cuda.h) ------------------------ */

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUmemPoolHandle_st *CUmemoryPool;
typedef struct CUmod_st *CUmodule;
typedef struct CUlib_st *CUlibrary;
typedef struct CUkern_st *CUkernel;
typedef struct CUfunc_st *CUfunction;
typedef int CUjit_option;     /* an enum in cuda.h: only passed through */
typedef int CUlibraryOption;  /* an enum in cuda.h: only passed through */
typedef int CUmemPool_attribute;

#define CU_IPC_HANDLE_SIZE 64
typedef struct CUipcMemHandle_st {
    char reserved[CU_IPC_HANDLE_SIZE];
} CUipcMemHandle;

typedef enum CUmemLocationType_enum {
    CU_MEM_LOCATION_TYPE_INVALID = 0x0,
    CU_MEM_LOCATION_TYPE_DEVICE = 0x1,
} CUmemLocationType;

typedef enum CUmemAllocationType_enum {
    CU_MEM_ALLOCATION_TYPE_INVALID = 0x0,
    CU_MEM_ALLOCATION_TYPE_PINNED = 0x1,
} CUmemAllocationType;

typedef enum CUmemAllocationHandleType_enum {
    CU_MEM_HANDLE_TYPE_NONE = 0x0,
    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1,
    CU_MEM_HANDLE_TYPE_WIN32 = 0x2,
    CU_MEM_HANDLE_TYPE_WIN32_KMT = 0x4,
    CU_MEM_HANDLE_TYPE_FABRIC = 0x8,
} CUmemAllocationHandleType;

typedef struct CUmemLocation_st {
    CUmemLocationType type; /* +0 in the location, +8 in the prop */
    int id;                 /* +4 in the location, +12 in the prop */
} CUmemLocation;

typedef struct CUmemAllocationProp_st {
    CUmemAllocationType type;
    CUmemAllocationHandleType requestedHandleTypes;
    CUmemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} CUmemAllocationProp;

typedef enum CUmemAllocationGranularity_flags_enum {
    CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0,
    CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 0x1,
} CUmemAllocationGranularity_flags;

typedef struct CUmemPoolProps_st {
    CUmemAllocationType allocType;
    CUmemAllocationHandleType handleTypes;
    CUmemLocation location;
    void *win32SecurityAttributes;
    size_t maxSize;
    unsigned short usage;
    unsigned char reserved[54];
} CUmemPoolProps;

#define CU_MEMPOOL_ATTR_RELEASE_THRESHOLD 4

typedef struct CUexecAffinityParam_st CUexecAffinityParam; /* opaque here */
typedef struct CUctxCreateParams_st CUctxCreateParams;     /* opaque here */

/* Compile-time checks that the layouts the BPF program relies on hold. */
_Static_assert(sizeof(CUipcMemHandle) == 64, "CUipcMemHandle is 64 bytes");
_Static_assert(__builtin_offsetof(CUmemAllocationProp, location) == 8, "prop->location at +8");
_Static_assert(__builtin_offsetof(CUmemAllocationProp, location.id) == 12, "location.id at +12");
_Static_assert(sizeof(CUmemAllocationProp) == 32, "CUmemAllocationProp is 32 bytes");
_Static_assert(__builtin_offsetof(CUmemPoolProps, location.id) == 12, "pool props location.id at +12");
_Static_assert(__builtin_offsetof(CUmemPoolProps, maxSize) == 24, "pool props maxSize at +24");

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_SUPPORTED = 801,
};

/* Every exported entry point: kept out of line and in the dynamic symbol table for uprobes. */
#define CUAPI __attribute__((visibility("default"), noinline, used))

/* ---- configuration and state ----------------------------------------------------------------- */

#define MAX_DEVICES 16
#define DEVICE_BASE 0x7f0000000000ULL   /* device d's window starts at DEVICE_BASE + (d << 40) */
#define DEVICE_WINDOW (1ULL << 40)
#define VA_BASE 0x7a0000000000ULL       /* cuMemAddressReserve */
#define IPC_BASE 0x7c0000000000ULL      /* cuIpcOpenMemHandle_v2 mappings */
#define ALLOC_ALIGN 512ULL
#define VMM_GRANULARITY (2ULL << 20)
#define MAX_LIVE 65536
#define MAX_SMALL 4096
#define CTX_MAGIC 0x4d454d43u /* "MEMC" */
#define HANDLE_TAG 0x4d52000000000000ULL
static const char IPC_MAGIC[8] = {'M', 'R', 'E', 'C', 'I', 'P', 'C', '1'};
static const char FAB_MAGIC[8] = {'M', 'R', 'E', 'C', 'F', 'A', 'B', '1'};

struct CUctx_st {
    unsigned magic;
    int ordinal;
    int physical;
    int primary;
    int refs;
    int kernels;                /* kernels fetched into this context (the first costs more) */
    unsigned long long resident; /* what the context itself costs on its device */
    unsigned long long stack, stack_placed;   /* the stack limit, and the one on the device */
    int launched;                             /* a kernel was launched in it */
};

struct live_alloc {
    CUdeviceptr ptr;
    unsigned long long size;
    int physical;
    int pool; /* index in g_pools + 1 of the pool it came from; 0: none (synchronous or unknown pool) */
};

/* A pool: what it keeps of freed blocks (held), up to its release threshold. */
struct pool {
    unsigned long long id;
    int physical;
    int is_default;
    unsigned long long held;
    unsigned long long threshold;
};

/* A library or module, and the kernels fetched from it into contexts (to give back at unload). */
struct code {
    unsigned long long id;
    int is_module;
    int physical; /* modules load into the current context's device at once; -1 for libraries */
    unsigned long long resident;
};

struct kernel_load {
    unsigned long long kernel; /* the CUkernel handle */
    unsigned long long code;   /* its library */
    CUcontext ctx;             /* the context it was loaded into (0: fetched, not loaded) */
    unsigned long long resident;
};

struct vmm_handle {
    CUmemGenericAllocationHandle id;
    unsigned long long size;
    int physical;
    int refs;
    int imported; /* imported handles do not charge this process's capacity */
};

struct range {
    unsigned long long start;
    unsigned long long size;
    unsigned long long tag; /* mapping: the handle; ipc: unused; host: flags */
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_initialized;
static int g_physical_count = 2;
static unsigned long long g_capacity = 80ULL << 30;
static int g_visible[MAX_DEVICES]; /* ordinal -> physical */
static int g_visible_count;
static unsigned long long g_used[MAX_DEVICES];
static unsigned long long g_bump[MAX_DEVICES];
static unsigned long long g_va_bump;
static unsigned long long g_ipc_bump;
static unsigned long long g_handle_seq;
static struct CUctx_st g_primary[MAX_DEVICES];

static struct live_alloc g_live[MAX_LIVE];
static int g_live_count;
static struct vmm_handle g_handles[MAX_SMALL];
static int g_handle_count;
static struct range g_maps[MAX_SMALL];
static int g_map_count;
static struct range g_reserved[MAX_SMALL];
static int g_reserved_count;
static struct range g_ipc_open[MAX_SMALL];
static int g_ipc_open_count;
static struct range g_host[MAX_SMALL];
static int g_host_count;
static struct pool g_pools[MAX_SMALL];
static int g_pool_count;
static struct code g_code[MAX_SMALL];
static int g_code_count;
static struct kernel_load g_kernels[MAX_SMALL];
static int g_kernel_count;
static unsigned long long g_resident[MAX_DEVICES]; /* contexts and device code, per physical device */
static int g_contexts[MAX_DEVICES];                /* live contexts per physical device */
static unsigned long long g_ctx_bytes = 300ULL << 20;
static unsigned long long g_first_kernel_bytes = 90ULL << 20;
static unsigned long long g_kernel_bytes = 2ULL << 20;
static unsigned long long g_module_bytes = 4ULL << 20;
static const char *g_nvml_dir;
static unsigned long long g_pace_us;
static unsigned long long g_resident_threads = 132ULL * 2048ULL;
static int g_multicast;

#define CTX_STACK_MAX 16
static __thread CUcontext t_stack[CTX_STACK_MAX];
static __thread int t_depth;

/* ---- helpers (static: never exported, never probed) ------------------------------------------ */

static unsigned long long env_u64(const char *name, unsigned long long dflt) {
    const char *v = getenv(name);
    if (!v || !*v)
        return dflt;
    char *end = NULL;
    unsigned long long x = strtoull(v, &end, 0);
    return (end && *end == '\0') ? x : dflt;
}

static void parse_visible_devices(void) {
    const char *v = getenv("CUDA_VISIBLE_DEVICES");
    g_visible_count = 0;
    if (!v) {
        for (int i = 0; i < g_physical_count; i++)
            g_visible[g_visible_count++] = i;
        return;
    }
    /* The real driver keeps the entries up to the first invalid one. */
    const char *p = v;
    while (*p && g_visible_count < MAX_DEVICES) {
        while (*p == ' ')
            p++;
        char *end = NULL;
        long idx = strtol(p, &end, 10);
        if (end == p || idx < 0 || idx >= g_physical_count)
            break;
        int dup = 0;
        for (int i = 0; i < g_visible_count; i++)
            dup |= g_visible[i] == (int)idx;
        if (dup)
            break;
        g_visible[g_visible_count++] = (int)idx;
        p = end;
        while (*p == ' ')
            p++;
        if (*p != ',')
            break;
        p++;
    }
}

static CUcontext current_ctx(void) { return t_depth > 0 ? t_stack[t_depth - 1] : NULL; }

static int valid_ctx(CUcontext c) { return c && c->magic == CTX_MAGIC; }

static unsigned long long align_up(unsigned long long x, unsigned long long a) {
    return (x + a - 1) / a * a;
}

/* Charge `size` bytes to a physical device; returns a fake address or 0 when over capacity. */
static CUdeviceptr charge(int physical, unsigned long long size) {
    unsigned long long rounded = align_up(size ? size : 1, ALLOC_ALIGN);
    if (size > g_capacity || g_used[physical] + size > g_capacity)
        return 0;
    if (g_bump[physical] + rounded > DEVICE_WINDOW)
        return 0;
    CUdeviceptr p = DEVICE_BASE + ((unsigned long long)physical << 40) + g_bump[physical];
    g_bump[physical] += rounded;
    g_used[physical] += size;
    return p;
}

/* Take the driver's time before acting (MEMREC_STUB_PACE_US; never with the lock held). */
static void pace(void) {
    if (g_pace_us)
        usleep((useconds_t)g_pace_us);
}

/* What NVML would list for this process, per physical device (MEMREC_STUB_NVML_DIR; lock held). */
static void nvml_publish(void) {
    if (!g_nvml_dir)
        return;
    char path[512], tmp[520];
    snprintf(path, sizeof(path), "%s/%d", g_nvml_dir, (int)getpid());
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f)
        return;
    for (int d = 0; d < g_physical_count; d++) {
        unsigned long long held = 0;
        for (int i = 0; i < g_pool_count; i++)
            if (g_pools[i].physical == d)
                held += g_pools[i].held;
        if (g_contexts[d] > 0 || g_used[d] || held || g_resident[d])
            fprintf(f, "%d %llu\n", d, g_resident[d] + g_used[d] + held);
    }
    fclose(f);
    rename(tmp, path);
}

static void ctx_charge(CUcontext c) {
    c->resident = g_ctx_bytes;
    c->kernels = 0;
    c->stack = c->stack_placed = 1024; /* the default stack */
    c->launched = 0;
    g_resident[c->physical] += c->resident;
    g_contexts[c->physical]++;
}

static void ctx_uncharge(CUcontext c) {
    g_resident[c->physical] -= c->resident;
    g_contexts[c->physical]--;
    c->resident = 0;
    for (int i = g_kernel_count - 1; i >= 0; i--) {
        if (g_kernels[i].ctx == c) {
            g_resident[c->physical] -= g_kernels[i].resident;
            g_kernels[i] = g_kernels[--g_kernel_count];
        }
    }
}

static int find_pool(CUmemoryPool p) {
    for (int i = 0; i < g_pool_count; i++)
        if (g_pools[i].id == (unsigned long long)(uintptr_t)p)
            return i;
    return -1;
}

static int new_pool(int physical, int is_default) {
    if (g_pool_count >= MAX_SMALL)
        return -1;
    int i = g_pool_count++;
    g_pools[i].id = HANDLE_TAG | (0xFULL << 44) | ((unsigned long long)getpid() << 24) | (++g_handle_seq);
    g_pools[i].physical = physical;
    g_pools[i].is_default = is_default;
    g_pools[i].held = 0;
    g_pools[i].threshold = 0;
    return i;
}

static int default_pool(int physical) {
    for (int i = 0; i < g_pool_count; i++)
        if (g_pools[i].is_default && g_pools[i].physical == physical)
            return i;
    return new_pool(physical, 1);
}

/* A pool gives back what it holds over its release threshold (the stub "synchronises" at once). */
static void pool_settle(struct pool *p) {
    if (p->held > p->threshold)
        p->held = p->threshold;
}

static int find_handle(CUmemGenericAllocationHandle id) {
    for (int i = 0; i < g_handle_count; i++)
        if (g_handles[i].id == id)
            return i;
    return -1;
}

static int new_handle(unsigned long long size, int physical, int imported) {
    if (g_handle_count >= MAX_SMALL)
        return -1;
    int i = g_handle_count++;
    g_handles[i].id = HANDLE_TAG | ((unsigned long long)getpid() << 24) | (++g_handle_seq);
    g_handles[i].size = size;
    g_handles[i].physical = physical;
    g_handles[i].refs = 1;
    g_handles[i].imported = imported;
    return i;
}

static void put_u32(char *b, unsigned v) { memcpy(b, &v, 4); }
static void put_u64(char *b, unsigned long long v) { memcpy(b, &v, 8); }
static unsigned get_u32(const char *b) { unsigned v; memcpy(&v, b, 4); return v; }
static unsigned long long get_u64(const char *b) { unsigned long long v; memcpy(&v, b, 8); return v; }

/* 64 distinctive bytes: magic, pid, device, value, size, then a pattern derived from the value. */
static void encode64(char out[64], const char magic[8], unsigned long long value, unsigned long long size,
                     int physical) {
    memcpy(out, magic, 8);
    put_u32(out + 8, (unsigned)getpid());
    put_u32(out + 12, (unsigned)physical);
    put_u64(out + 16, value);
    put_u64(out + 24, size);
    unsigned long long x = value ^ 0x9e3779b97f4a7c15ULL ^ ((unsigned long long)getpid() << 32);
    for (int i = 32; i < 64; i++) {
        x = x * 6364136223846793005ULL + 1442695040888963407ULL;
        out[i] = (char)((x >> 56) | 1); /* never zero */
    }
}

static int decode64(const char in[64], const char magic[8], unsigned long long *value,
                    unsigned long long *size, int *physical) {
    if (memcmp(in, magic, 8) != 0)
        return 0;
    *physical = (int)get_u32(in + 12);
    *value = get_u64(in + 16);
    *size = get_u64(in + 24);
    return *physical >= 0 && *physical < g_physical_count;
}

/* Allocate on the current context's device; from pool `pool` (a g_pools index, or -1: none), whose
 * held bytes are handed out first, as a stream-ordered pool reuses what was freed into it. */
static CUresult device_alloc_from(CUdeviceptr *dptr, unsigned long long size, int pool) {
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!dptr || size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    CUcontext c = current_ctx();
    if (!valid_ctx(c))
        return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&g_lock);
    CUresult rc = CUDA_SUCCESS;
    if (g_live_count >= MAX_LIVE) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
        CUdeviceptr p = charge(c->physical, size);
        if (!p) {
            rc = CUDA_ERROR_OUT_OF_MEMORY; /* *dptr stays untouched, as the driver leaves it */
        } else {
            if (pool >= 0) {
                unsigned long long take = g_pools[pool].held < size ? g_pools[pool].held : size;
                g_pools[pool].held -= take;
            }
            g_live[g_live_count].ptr = p;
            g_live[g_live_count].size = size;
            g_live[g_live_count].physical = c->physical;
            g_live[g_live_count].pool = pool + 1;
            g_live_count++;
            *dptr = p;
            nvml_publish();
        }
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

static CUresult device_alloc(CUdeviceptr *dptr, unsigned long long size) { return device_alloc_from(dptr, size, -1); }

/* Free `p`; an asynchronous free (`to_pool`) leaves the block with its pool, up to the threshold. */
static CUresult device_free_to(CUdeviceptr p, int to_pool) {
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (p == 0)
        return CUDA_SUCCESS;
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    /* Search from the end: the common pattern frees recent allocations first. */
    for (int i = g_live_count - 1; i >= 0; i--) {
        if (g_live[i].ptr == p) {
            g_used[g_live[i].physical] -= g_live[i].size;
            int pool = g_live[i].pool - 1;
            if (to_pool && pool >= 0) {
                g_pools[pool].held += g_live[i].size;
                pool_settle(&g_pools[pool]);
            }
            g_live[i] = g_live[--g_live_count];
            rc = CUDA_SUCCESS;
            nvml_publish();
            break;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

static CUresult device_free(CUdeviceptr p) { return device_free_to(p, 0); }

static int find_range(struct range *tab, int n, unsigned long long addr, int exact) {
    for (int i = n - 1; i >= 0; i--) {
        if (exact ? tab[i].start == addr : (addr >= tab[i].start && addr < tab[i].start + tab[i].size))
            return i;
    }
    return -1;
}

static int add_range(struct range *tab, int *n, unsigned long long start, unsigned long long size,
                     unsigned long long tag) {
    if (*n >= MAX_SMALL)
        return -1;
    tab[*n].start = start;
    tab[*n].size = size;
    tab[*n].tag = tag;
    return (*n)++;
}

static void del_range(struct range *tab, int *n, int i) { tab[i] = tab[--(*n)]; }

/* The checks of a call that writes to `out` about device `dev`. */
static CUresult device_call(const void *out, CUdevice dev) {
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    if (dev < 0 || dev >= g_visible_count)
        return CUDA_ERROR_INVALID_DEVICE;
    return CUDA_SUCCESS;
}

/* ---- initialisation and devices --------------------------------------------------------------- */

CUAPI CUresult cuInit(unsigned int Flags) {
    if (Flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    if (!g_initialized) {
        g_physical_count = (int)env_u64("MEMREC_STUB_DEVICES", 2);
        if (g_physical_count < 1)
            g_physical_count = 1;
        if (g_physical_count > MAX_DEVICES)
            g_physical_count = MAX_DEVICES;
        g_capacity = env_u64("MEMREC_STUB_DEVICE_BYTES", 80ULL << 30);
        g_ctx_bytes = env_u64("MEMREC_STUB_CTX_BYTES", g_ctx_bytes);
        g_first_kernel_bytes = env_u64("MEMREC_STUB_FIRST_KERNEL_BYTES", g_first_kernel_bytes);
        g_kernel_bytes = env_u64("MEMREC_STUB_KERNEL_BYTES", g_kernel_bytes);
        g_module_bytes = env_u64("MEMREC_STUB_MODULE_BYTES", g_module_bytes);
        g_pace_us = env_u64("MEMREC_STUB_PACE_US", 0);
        g_resident_threads = env_u64("MEMREC_STUB_RESIDENT_THREADS", g_resident_threads);
        g_multicast = (int)env_u64("MEMREC_STUB_MULTICAST", 0);
        g_nvml_dir = getenv("MEMREC_STUB_NVML_DIR");
        if (g_nvml_dir && !*g_nvml_dir)
            g_nvml_dir = NULL;
        parse_visible_devices();
        for (int i = 0; i < g_visible_count; i++) {
            g_primary[i].magic = CTX_MAGIC;
            g_primary[i].ordinal = i;
            g_primary[i].physical = g_visible[i];
            g_primary[i].primary = 1;
            g_primary[i].refs = 0;
        }
        g_initialized = 1;
    }
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

CUAPI CUresult cuDriverGetVersion(int *driverVersion) {
    if (!driverVersion)
        return CUDA_ERROR_INVALID_VALUE;
    *driverVersion = 13000;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuDeviceGetCount(int *count) {
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!count)
        return CUDA_ERROR_INVALID_VALUE;
    *count = g_visible_count;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    if (ordinal < 0 || ordinal >= g_visible_count)
        return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    CUresult rc = device_call(bytes, dev);
    if (rc != CUDA_SUCCESS)
        return rc;
    *bytes = g_capacity;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    CUcontext c = current_ctx();
    if (!valid_ctx(c))
        return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&g_lock);
    if (free_bytes)
        *free_bytes = g_capacity - g_used[c->physical];
    if (total)
        *total = g_capacity;
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

/* Not a CUDA API: lets tests and the workload learn the physical device behind an ordinal. */
CUAPI int memrec_stub_physical_device(int ordinal) {
    if (!g_initialized || ordinal < 0 || ordinal >= g_visible_count)
        return -1;
    return g_visible[ordinal];
}

/* ---- contexts ---------------------------------------------------------------------------------- */

CUAPI CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    pace();
    CUresult rc = device_call(pctx, dev);
    if (rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&g_lock);
    if (g_primary[dev].refs++ == 0) {
        ctx_charge(&g_primary[dev]);
        nvml_publish();
    }
    pthread_mutex_unlock(&g_lock);
    *pctx = &g_primary[dev];
    return CUDA_SUCCESS;
}

CUAPI CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (dev < 0 || dev >= g_visible_count)
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_lock);
    if (g_primary[dev].refs > 0 && --g_primary[dev].refs == 0) {
        ctx_uncharge(&g_primary[dev]);
        nvml_publish();
    }
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

static CUresult create_ctx(CUcontext *pctx, CUdevice dev) {
    pace();
    CUresult rc = device_call(pctx, dev);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (t_depth >= CTX_STACK_MAX)
        return CUDA_ERROR_OUT_OF_MEMORY;
    struct CUctx_st *c = calloc(1, sizeof(*c));
    if (!c)
        return CUDA_ERROR_OUT_OF_MEMORY;
    c->magic = CTX_MAGIC;
    c->ordinal = dev;
    c->physical = g_visible[dev];
    c->refs = 1;
    pthread_mutex_lock(&g_lock);
    ctx_charge(c);
    nvml_publish();
    pthread_mutex_unlock(&g_lock);
    t_stack[t_depth++] = c; /* a created context becomes current */
    *pctx = c;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    (void)flags;
    return create_ctx(pctx, dev);
}

CUAPI CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *paramsArray, int numParams,
                              unsigned int flags, CUdevice dev) {
    (void)paramsArray;
    (void)numParams;
    (void)flags;
    return create_ctx(pctx, dev);
}

CUAPI CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *ctxCreateParams, unsigned int flags,
                              CUdevice dev) {
    (void)ctxCreateParams;
    (void)flags;
    return create_ctx(pctx, dev);
}

CUAPI CUresult cuCtxDestroy_v2(CUcontext ctx) {
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!valid_ctx(ctx) || ctx->primary)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (current_ctx() == ctx)
        t_depth--; /* destroying the current context pops it */
    pthread_mutex_lock(&g_lock);
    ctx_uncharge(ctx);
    nvml_publish();
    pthread_mutex_unlock(&g_lock);
    ctx->magic = 0;
    free(ctx);
    return CUDA_SUCCESS;
}

CUAPI CUresult cuCtxSetCurrent(CUcontext ctx) {
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (ctx == NULL) {
        if (t_depth > 0)
            t_depth--;
        return CUDA_SUCCESS;
    }
    if (!valid_ctx(ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    if (t_depth == 0)
        t_stack[t_depth++] = ctx;
    else
        t_stack[t_depth - 1] = ctx;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuCtxGetCurrent(CUcontext *pctx) {
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    *pctx = current_ctx();
    return CUDA_SUCCESS;
}

CUAPI CUresult cuCtxPushCurrent_v2(CUcontext ctx) {
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!valid_ctx(ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    if (t_depth >= CTX_STACK_MAX)
        return CUDA_ERROR_OUT_OF_MEMORY;
    t_stack[t_depth++] = ctx;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuCtxPopCurrent_v2(CUcontext *pctx) {
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (t_depth == 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    CUcontext c = t_stack[--t_depth];
    if (pctx)
        *pctx = c;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuCtxGetDevice(CUdevice *device) {
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    CUcontext c = current_ctx();
    if (!valid_ctx(c))
        return CUDA_ERROR_INVALID_CONTEXT;
    *device = c->ordinal;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuCtxSynchronize(void) {
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    return valid_ctx(current_ctx()) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

/* ---- device memory ---------------------------------------------------------------------------- */

CUAPI CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) { return device_alloc(dptr, bytesize); }

CUAPI CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
                                  unsigned int ElementSizeBytes) {
    if (!pPitch || WidthInBytes == 0 || Height == 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (ElementSizeBytes != 4 && ElementSizeBytes != 8 && ElementSizeBytes != 16)
        return CUDA_ERROR_INVALID_VALUE;
    size_t pitch = (size_t)align_up(WidthInBytes, ALLOC_ALIGN);
    CUresult rc = device_alloc(dptr, (unsigned long long)pitch * Height);
    if (rc == CUDA_SUCCESS)
        *pPitch = pitch;
    return rc;
}

CUAPI CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) {
    if (flags != 1 && flags != 2) /* CU_MEM_ATTACH_GLOBAL, CU_MEM_ATTACH_HOST */
        return CUDA_ERROR_INVALID_VALUE;
    return device_alloc(dptr, bytesize);
}

static int captured_alloc(CUdeviceptr *dptr, size_t size, CUstream s);
static int captured_free(CUstream s);

/* From the current device's default pool (or, on a stream being captured, graph memory). */
static CUresult alloc_async(CUdeviceptr *dptr, size_t bytesize, CUstream s) {
    pace();
    CUcontext c = current_ctx();
    int pool = -1;
    if (g_initialized && valid_ctx(c) && dptr && bytesize) {
        pthread_mutex_lock(&g_lock);
        int graph = captured_alloc(dptr, bytesize, s);
        pthread_mutex_unlock(&g_lock);
        if (graph)
            return CUDA_SUCCESS;
    }
    if (g_initialized && valid_ctx(c)) {
        pthread_mutex_lock(&g_lock);
        pool = default_pool(c->physical);
        pthread_mutex_unlock(&g_lock);
    }
    return device_alloc_from(dptr, bytesize, pool);
}

/* From `pool`; a value that is no pool of the stub's (the workload's fake ones) is no pool at all. */
static CUresult alloc_from_pool(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream s) {
    pace();
    if (!pool || !dptr)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    if (g_initialized && bytesize && captured_alloc(dptr, bytesize, s)) {
        pthread_mutex_unlock(&g_lock);
        return CUDA_SUCCESS;
    }
    int i = find_pool(pool);
    pthread_mutex_unlock(&g_lock);
    return device_alloc_from(dptr, bytesize, i);
}

CUAPI CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    return alloc_async(dptr, bytesize, hStream);
}

CUAPI CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    return alloc_async(dptr, bytesize, hStream);
}

CUAPI CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                       CUstream hStream) {
    return alloc_from_pool(dptr, bytesize, pool, hStream);
}

CUAPI CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                            CUstream hStream) {
    return alloc_from_pool(dptr, bytesize, pool, hStream);
}

CUAPI CUresult cuMemFree_v2(CUdeviceptr dptr) { return device_free(dptr); }

static CUresult free_async(CUdeviceptr dptr, CUstream hStream) {
    pace();
    if (g_initialized && captured_free(hStream))
        return CUDA_SUCCESS; /* a free node of the graph being captured */
    return device_free_to(dptr, 1);
}

CUAPI CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) { return free_async(dptr, hStream); }
CUAPI CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream) { return free_async(dptr, hStream); }

/* ---- stream-ordered pools ----------------------------------------------------------------------- */

CUAPI CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool_out, CUdevice dev) {
    pace();
    CUresult rc = device_call(pool_out, dev);
    if (rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&g_lock);
    int i = default_pool(g_visible[dev]);
    pthread_mutex_unlock(&g_lock);
    if (i < 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *pool_out = (CUmemoryPool)(uintptr_t)g_pools[i].id;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *poolProps) {
    pace();
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!pool || !poolProps || poolProps->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    int ordinal = poolProps->location.id;
    if (ordinal < 0 || ordinal >= g_visible_count)
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_lock);
    int i = new_pool(g_visible[ordinal], 0);
    pthread_mutex_unlock(&g_lock);
    if (i < 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *pool = (CUmemoryPool)(uintptr_t)g_pools[i].id;
    return CUDA_SUCCESS;
}

enum pool_op { POOL_DESTROY, POOL_TRIM, POOL_THRESHOLD, POOL_OTHER_ATTR };

/* One operation on a pool the stub made; INVALID_VALUE for any other handle (or destroying a
 * device's default pool, which the driver refuses too). */
static CUresult pool_op(CUmemoryPool pool, enum pool_op op, unsigned long long value) {
    pace();
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    int i = find_pool(pool);
    if (i >= 0 && !(op == POOL_DESTROY && g_pools[i].is_default)) {
        rc = CUDA_SUCCESS;
        if (op == POOL_DESTROY) {
            /* Blocks still allocated from it stay valid and now belong to no pool. */
            for (int a = 0; a < g_live_count; a++) {
                if (g_live[a].pool == i + 1)
                    g_live[a].pool = 0;
                else if (g_live[a].pool == g_pool_count)
                    g_live[a].pool = i + 1; /* the last pool moves into slot i */
            }
            g_pools[i] = g_pools[--g_pool_count];
        } else if (op == POOL_TRIM) {
            if (g_pools[i].held > value)
                g_pools[i].held = value;
        } else if (op == POOL_THRESHOLD) {
            g_pools[i].threshold = value;
            pool_settle(&g_pools[i]);
        }
        nvml_publish();
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

CUAPI CUresult cuMemPoolDestroy(CUmemoryPool pool) { return pool_op(pool, POOL_DESTROY, 0); }

CUAPI CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep) {
    return pool_op(pool, POOL_TRIM, minBytesToKeep);
}

CUAPI CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value) {
    if (!value || attr < 1 || attr > 8)
        return CUDA_ERROR_INVALID_VALUE;
    if (attr == CU_MEMPOOL_ATTR_RELEASE_THRESHOLD)
        return pool_op(pool, POOL_THRESHOLD, *(unsigned long long *)value);
    return pool_op(pool, POOL_OTHER_ATTR, 0);
}

/* ---- device code ---------------------------------------------------------------------------------- */

/* The stack limit reaches the device at the next launch, or at once once the context has launched;
 * the heap and the printf FIFO showed no step on the H200 (kernels using neither): none here. */
static void limits_at_launch(CUcontext c) {
    c->launched = 1;
    if (c->stack > c->stack_placed) {
        unsigned long long add = (c->stack - c->stack_placed) * g_resident_threads;
        g_resident[c->physical] += add;
        c->resident += add;
        c->stack_placed = c->stack;
    }
}

static int find_code(unsigned long long id) {
    for (int i = 0; i < g_code_count; i++)
        if (g_code[i].id == id)
            return i;
    return -1;
}

/* A library (no context needed, nothing on the device until a kernel is fetched) or a module
 * (loaded into the current context at once). */
static CUresult code_load(unsigned long long *out, const void *image, const char *file, int is_module) {
    pace();
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!out || (!image && !file))
        return CUDA_ERROR_INVALID_VALUE;
    if (file && access(file, R_OK) != 0)
        return 301; /* CUDA_ERROR_FILE_NOT_FOUND */
    CUcontext c = current_ctx();
    if (is_module && !valid_ctx(c))
        return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&g_lock);
    CUresult rc = CUDA_SUCCESS;
    if (g_code_count >= MAX_SMALL) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
        int i = g_code_count++;
        g_code[i].id = HANDLE_TAG | (0xCULL << 44) | ((unsigned long long)getpid() << 24) | (++g_handle_seq);
        g_code[i].is_module = is_module;
        g_code[i].physical = is_module ? c->physical : -1;
        int ptx = image && memcmp(image, ".version", 8) == 0;
        g_code[i].resident = is_module && !ptx ? g_module_bytes : 0;
        if (is_module) {
            g_resident[c->physical] += g_code[i].resident;
            nvml_publish();
        }
        *out = g_code[i].id;
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

static CUresult code_unload(unsigned long long id, int is_module) {
    pace();
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult rc = CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&g_lock);
    int i = find_code(id);
    if (i >= 0 && g_code[i].is_module == is_module) {
        if (g_code[i].physical >= 0)
            g_resident[g_code[i].physical] -= g_code[i].resident;
        for (int k = g_kernel_count - 1; k >= 0; k--) {
            if (g_kernels[k].code == id) {
                if (g_kernels[k].ctx)
                    g_resident[g_kernels[k].ctx->physical] -= g_kernels[k].resident;
                g_kernels[k] = g_kernels[--g_kernel_count];
            }
        }
        g_code[i] = g_code[--g_code_count];
        nvml_publish();
        rc = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

CUAPI CUresult cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jitOptions,
                                 void **jitOptionsValues, unsigned int numJitOptions,
                                 CUlibraryOption *libraryOptions, void **libraryOptionValues,
                                 unsigned int numLibraryOptions) {
    (void)jitOptions, (void)jitOptionsValues, (void)numJitOptions;
    (void)libraryOptions, (void)libraryOptionValues, (void)numLibraryOptions;
    return code_load((unsigned long long *)library, code, NULL, 0);
}

CUAPI CUresult cuLibraryLoadFromFile(CUlibrary *library, const char *fileName, CUjit_option *jitOptions,
                                     void **jitOptionsValues, unsigned int numJitOptions,
                                     CUlibraryOption *libraryOptions, void **libraryOptionValues,
                                     unsigned int numLibraryOptions) {
    (void)jitOptions, (void)jitOptionsValues, (void)numJitOptions;
    (void)libraryOptions, (void)libraryOptionValues, (void)numLibraryOptions;
    return code_load((unsigned long long *)library, NULL, fileName, 0);
}

CUAPI CUresult cuLibraryUnload(CUlibrary library) { return code_unload((unsigned long long)(uintptr_t)library, 0); }

CUAPI CUresult cuModuleLoad(CUmodule *module, const char *fname) {
    return code_load((unsigned long long *)module, NULL, fname, 1);
}

CUAPI CUresult cuModuleLoadData(CUmodule *module, const void *image) {
    return code_load((unsigned long long *)module, image, NULL, 1);
}

CUAPI CUresult cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int numOptions,
                                  CUjit_option *options, void **optionValues) {
    (void)numOptions, (void)options, (void)optionValues;
    return code_load((unsigned long long *)module, image, NULL, 1);
}

CUAPI CUresult cuModuleLoadFatBinary(CUmodule *module, const void *fatCubin) {
    return code_load((unsigned long long *)module, fatCubin, NULL, 1);
}

CUAPI CUresult cuModuleUnload(CUmodule hmod) { return code_unload((unsigned long long)(uintptr_t)hmod, 1); }

/* Load kernel `kernel` of library `code` into the current context, once (lock held). */
static void kernel_into_context(unsigned long long kernel, unsigned long long code) {
    CUcontext c = current_ctx();
    if (!valid_ctx(c))
        return;
    for (int k = 0; k < g_kernel_count; k++)
        if (g_kernels[k].kernel == kernel && g_kernels[k].ctx == c)
            return;
    if (g_kernel_count >= MAX_SMALL)
        return;
    unsigned long long cost = c->kernels++ == 0 ? g_first_kernel_bytes : g_kernel_bytes;
    g_kernels[g_kernel_count].kernel = kernel;
    g_kernels[g_kernel_count].code = code;
    g_kernels[g_kernel_count].ctx = c;
    g_kernels[g_kernel_count].resident = cost;
    g_kernel_count++;
    g_resident[c->physical] += cost;
    nvml_publish();
}

/* A kernel handle encodes its library's slot and the name's hash, so fetching twice gives one handle. */
CUAPI CUresult cuLibraryGetKernel(CUkernel *pKernel, CUlibrary library, const char *name) {
    pace();
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!pKernel || !name || !*name)
        return CUDA_ERROR_INVALID_VALUE;
    unsigned long long lib = (unsigned long long)(uintptr_t)library;
    pthread_mutex_lock(&g_lock);
    CUresult rc = CUDA_SUCCESS;
    if (find_code(lib) < 0) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else {
        unsigned long long h = 1469598103934665603ULL;
        for (const char *p = name; *p; p++)
            h = (h ^ (unsigned char)*p) * 1099511628211ULL;
        unsigned long long kernel = (lib & ~0xFFFFFFULL) ^ (h & 0xFFFFFFULL) ^ (lib & 0xFFFFFF);
        kernel_into_context(kernel, lib);
        *pKernel = (CUkernel)(uintptr_t)kernel;
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

CUAPI CUresult cuKernelGetFunction(CUfunction *pFunc, CUkernel kernel) {
    pace();
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!pFunc || !kernel)
        return CUDA_ERROR_INVALID_VALUE;
    CUcontext c = current_ctx();
    if (!valid_ctx(c))
        return CUDA_ERROR_INVALID_CONTEXT;
    unsigned long long k = (unsigned long long)(uintptr_t)kernel;
    pthread_mutex_lock(&g_lock);
    unsigned long long code = 0;
    for (int i = 0; i < g_kernel_count; i++)
        if (g_kernels[i].kernel == k)
            code = g_kernels[i].code;
    kernel_into_context(k, code);
    pthread_mutex_unlock(&g_lock);
    *pFunc = (CUfunction)(uintptr_t)(k ^ ((unsigned long long)(uintptr_t)c & 0xFFFF));
    return CUDA_SUCCESS;
}

/* ---- device memory no allocation call takes (issue 21) ----------------------------------------- */

typedef struct CUarray_st *CUarray;
typedef struct CUmipmappedArray_st *CUmipmappedArray;
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUgraphNode_st *CUgraphNode;
typedef int CUlimit;
typedef int CUstreamCaptureMode;

typedef struct CUDA_ARRAY_DESCRIPTOR_st {
    size_t Width;
    size_t Height;
    int Format;
    unsigned int NumChannels;
} CUDA_ARRAY_DESCRIPTOR;

typedef struct CUDA_ARRAY3D_DESCRIPTOR_st {
    size_t Width;
    size_t Height;
    size_t Depth;
    int Format;
    unsigned int NumChannels;
    unsigned int Flags;
} CUDA_ARRAY3D_DESCRIPTOR;

typedef struct CUDA_MEM_ALLOC_NODE_PARAMS_st {
    CUmemPoolProps poolProps;
    const void *accessDescs;
    size_t accessDescCount;
    size_t bytesize;
    CUdeviceptr dptr;
} CUDA_MEM_ALLOC_NODE_PARAMS;

typedef struct CUmulticastObjectProp_st {
    unsigned int numDevices;
    size_t size;
    unsigned long long handleTypes;
    unsigned long long flags;
} CUmulticastObjectProp;

_Static_assert(__builtin_offsetof(CUDA_ARRAY_DESCRIPTOR, Format) == 16, "array Format at +16");
_Static_assert(__builtin_offsetof(CUDA_ARRAY3D_DESCRIPTOR, Format) == 24, "3D array Format at +24");
_Static_assert(sizeof(CUmemPoolProps) == 88, "CUmemPoolProps is 88 bytes");
_Static_assert(__builtin_offsetof(CUDA_MEM_ALLOC_NODE_PARAMS, bytesize) == 104, "bytesize at +104");
_Static_assert(__builtin_offsetof(CUDA_MEM_ALLOC_NODE_PARAMS, dptr) == 112, "dptr at +112");
_Static_assert(__builtin_offsetof(CUmulticastObjectProp, size) == 8, "multicast size at +8");

#define MAX_GRAPHS 256

struct array_rec {
    unsigned long long id;
    int physical;
    unsigned long long resident;
};
static struct array_rec g_arrays[MAX_SMALL];
static int g_array_count;

/* A graph being built (or captured): its footprint; an executable graph: the footprint it needs. */
struct graph_rec {
    unsigned long long id;
    int exec;
    int physical;
    unsigned long long footprint;
    unsigned long long stream; /* while captured */
};
static struct graph_rec g_graphs[MAX_GRAPHS];
static int g_graph_count;
static unsigned long long g_graph_pool[MAX_DEVICES]; /* the graph memory pool on each device */

static unsigned long long format_bytes(int f) {
    switch (f) {
    case 0x01: case 0x08: return 1;
    case 0x02: case 0x09: case 0x10: return 2;
    case 0x03: case 0x0a: case 0x20: return 4;
    default: return 0;
    }
}

static CUresult array_create(unsigned long long *out, size_t w, size_t h, size_t d, int format, unsigned ch,
                             unsigned levels) {
    pace();
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    CUcontext c = current_ctx();
    if (!valid_ctx(c))
        return CUDA_ERROR_INVALID_CONTEXT;
    unsigned long long per = format_bytes(format) * ch;
    if (!out || !w || !per || !levels)
        return CUDA_ERROR_INVALID_VALUE;
    unsigned long long bytes = 0;
    for (unsigned i = 0; i < levels; i++) {
        bytes += (unsigned long long)w * (h ? h : 1) * (d ? d : 1) * per;
        w = w > 1 ? w >> 1 : w;
        h = h > 1 ? h >> 1 : h;
        d = d > 1 ? d >> 1 : d;
    }
    bytes = align_up(bytes, VMM_GRANULARITY);
    pthread_mutex_lock(&g_lock);
    CUresult rc = CUDA_SUCCESS;
    if (g_array_count >= MAX_SMALL || g_used[c->physical] + g_resident[c->physical] + bytes > g_capacity) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
        int i = g_array_count++;
        g_arrays[i].id = HANDLE_TAG | (0xAULL << 44) | ((unsigned long long)getpid() << 24) | (++g_handle_seq);
        g_arrays[i].physical = c->physical;
        g_arrays[i].resident = bytes;
        g_resident[c->physical] += bytes;
        *out = g_arrays[i].id;
        nvml_publish();
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

static CUresult array_destroy(unsigned long long id) {
    pace();
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult rc = CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < g_array_count; i++) {
        if (g_arrays[i].id == id) {
            g_resident[g_arrays[i].physical] -= g_arrays[i].resident;
            g_arrays[i] = g_arrays[--g_array_count];
            nvml_publish();
            rc = CUDA_SUCCESS;
            break;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

CUAPI CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *d) {
    if (!d)
        return CUDA_ERROR_INVALID_VALUE;
    return array_create((unsigned long long *)pHandle, d->Width, d->Height, 0, d->Format, d->NumChannels, 1);
}

CUAPI CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d) {
    if (!d)
        return CUDA_ERROR_INVALID_VALUE;
    return array_create((unsigned long long *)pHandle, d->Width, d->Height, d->Depth, d->Format, d->NumChannels, 1);
}

CUAPI CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d,
                                      unsigned int numMipmapLevels) {
    if (!d)
        return CUDA_ERROR_INVALID_VALUE;
    return array_create((unsigned long long *)pHandle, d->Width, d->Height, d->Depth, d->Format, d->NumChannels,
                        numMipmapLevels);
}

CUAPI CUresult cuArrayDestroy(CUarray a) { return array_destroy((unsigned long long)(uintptr_t)a); }
CUAPI CUresult cuMipmappedArrayDestroy(CUmipmappedArray a) { return array_destroy((unsigned long long)(uintptr_t)a); }

/* cuCtxSetLimit: the stack moves at once in a context that has launched, else at its next launch. */
CUAPI CUresult cuCtxSetLimit(CUlimit limit, size_t value) {
    pace();
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    CUcontext c = current_ctx();
    if (!valid_ctx(c))
        return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&g_lock);
    CUresult rc = CUDA_SUCCESS;
    if (limit == 0) {
        c->stack = value;
        if (c->launched && value < c->stack_placed) { /* shrunk at the call */
            g_resident[c->physical] -= (c->stack_placed - value) * g_resident_threads;
            c->resident -= (c->stack_placed - value) * g_resident_threads;
            c->stack_placed = value;
        } else if (c->launched) {
            limits_at_launch(c);
        }
        nvml_publish();
    } else if (limit < 0 || limit > 6) {
        rc = CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* A kernel launch: not probed (the hot path); it places the limits set since the last one. */
CUAPI CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                              unsigned bz, unsigned shared, CUstream stream, void **params, void **extra) {
    (void)f, (void)gx, (void)gy, (void)gz, (void)bx, (void)by, (void)bz, (void)shared, (void)stream;
    (void)params, (void)extra;
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    CUcontext c = current_ctx();
    if (!valid_ctx(c))
        return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&g_lock);
    limits_at_launch(c);
    nvml_publish();
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

static int find_graph(unsigned long long id) {
    for (int i = 0; i < g_graph_count; i++)
        if (g_graphs[i].id == id)
            return i;
    return -1;
}

static int capturing_graph(unsigned long long stream) {
    for (int i = 0; i < g_graph_count; i++)
        if (!g_graphs[i].exec && g_graphs[i].stream == stream && stream)
            return i;
    return -1;
}

static int new_graph(int exec, int physical, unsigned long long footprint, unsigned long long stream) {
    if (g_graph_count >= MAX_GRAPHS)
        return -1;
    int i = g_graph_count++;
    g_graphs[i].id = HANDLE_TAG | ((exec ? 0xEULL : 0x6ULL) << 44) | ((unsigned long long)getpid() << 24) | (++g_handle_seq);
    g_graphs[i].exec = exec;
    g_graphs[i].physical = physical;
    g_graphs[i].footprint = footprint;
    g_graphs[i].stream = stream;
    return i;
}

static CUresult begin_capture(CUstream s, CUstreamCaptureMode mode) {
    (void)mode;
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    CUcontext c = current_ctx();
    if (!valid_ctx(c) || !s)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    CUresult rc = capturing_graph((unsigned long long)(uintptr_t)s) >= 0 ? CUDA_ERROR_INVALID_VALUE
                  : new_graph(0, c->physical, 0, (unsigned long long)(uintptr_t)s) < 0 ? CUDA_ERROR_OUT_OF_MEMORY
                  : CUDA_SUCCESS;
    pthread_mutex_unlock(&g_lock);
    return rc;
}

static CUresult end_capture(CUstream s, CUgraph *out) {
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    int i = capturing_graph((unsigned long long)(uintptr_t)s);
    if (i >= 0) {
        g_graphs[i].stream = 0;
        *out = (CUgraph)(uintptr_t)g_graphs[i].id;
    }
    pthread_mutex_unlock(&g_lock);
    return i >= 0 ? CUDA_SUCCESS : 901; /* CUDA_ERROR_STREAM_CAPTURE_UNMATCHED */
}

CUAPI CUresult cuStreamBeginCapture_v2(CUstream s, CUstreamCaptureMode mode) { return begin_capture(s, mode); }
CUAPI CUresult cuStreamBeginCapture_v2_ptsz(CUstream s, CUstreamCaptureMode mode) { return begin_capture(s, mode); }
CUAPI CUresult cuStreamEndCapture(CUstream s, CUgraph *g) { return end_capture(s, g); }
CUAPI CUresult cuStreamEndCapture_ptsz(CUstream s, CUgraph *g) { return end_capture(s, g); }

/* A stream-ordered allocation on a stream being captured: graph memory, nothing on the device
 * (lock held); returns 1 if it was one. */
static int captured_alloc(CUdeviceptr *dptr, size_t size, CUstream s) {
    int i = capturing_graph((unsigned long long)(uintptr_t)s);
    if (i < 0)
        return 0;
    g_graphs[i].footprint += align_up(size, VMM_GRANULARITY);
    *dptr = VA_BASE + (1ULL << 39) + (g_va_bump += align_up(size, VMM_GRANULARITY));
    return 1;
}

static int captured_free(CUstream s) {
    pthread_mutex_lock(&g_lock);
    int i = capturing_graph((unsigned long long)(uintptr_t)s);
    pthread_mutex_unlock(&g_lock);
    return i >= 0;
}

CUAPI CUresult cuGraphCreate(CUgraph *out, unsigned int flags) {
    (void)flags;
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    CUcontext c = current_ctx();
    if (!out || !valid_ctx(c))
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    int i = new_graph(0, c->physical, 0, 0);
    if (i >= 0)
        *out = (CUgraph)(uintptr_t)g_graphs[i].id;
    pthread_mutex_unlock(&g_lock);
    return i >= 0 ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

CUAPI CUresult cuGraphAddMemAllocNode(CUgraphNode *node, CUgraph graph, const CUgraphNode *deps, size_t n,
                                      CUDA_MEM_ALLOC_NODE_PARAMS *params) {
    (void)deps, (void)n;
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!node || !params || !params->bytesize)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    int i = find_graph((unsigned long long)(uintptr_t)graph);
    if (i >= 0 && !g_graphs[i].exec) {
        unsigned long long size = align_up(params->bytesize, VMM_GRANULARITY);
        g_graphs[i].footprint += size;
        params->dptr = VA_BASE + (1ULL << 39) + (g_va_bump += size);
        *node = (CUgraphNode)(uintptr_t)(g_graphs[i].id ^ params->dptr);
    }
    pthread_mutex_unlock(&g_lock);
    return i >= 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUAPI CUresult cuGraphAddMemFreeNode(CUgraphNode *node, CUgraph graph, const CUgraphNode *deps, size_t n,
                                     CUdeviceptr dptr) {
    (void)deps, (void)n;
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!node)
        return CUDA_ERROR_INVALID_VALUE;
    *node = (CUgraphNode)(uintptr_t)((unsigned long long)(uintptr_t)graph ^ dptr ^ 1);
    return CUDA_SUCCESS;
}

/* The graph pool grows to what the largest executable graph needs (lock held). */
static void graph_pool_fits(int i) {
    int d = g_graphs[i].physical;
    if (g_graph_pool[d] < g_graphs[i].footprint) {
        g_resident[d] += g_graphs[i].footprint - g_graph_pool[d];
        g_graph_pool[d] = g_graphs[i].footprint;
        nvml_publish();
    }
}

static CUresult instantiate(CUgraphExec *out, CUgraph graph) {
    pace();
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    int i = find_graph((unsigned long long)(uintptr_t)graph);
    int e = -1;
    if (i >= 0 && !g_graphs[i].exec && (e = new_graph(1, g_graphs[i].physical, g_graphs[i].footprint, 0)) >= 0) {
        *out = (CUgraphExec)(uintptr_t)g_graphs[e].id;
    }
    pthread_mutex_unlock(&g_lock);
    return e >= 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUAPI CUresult cuGraphInstantiateWithFlags(CUgraphExec *out, CUgraph graph, unsigned long long flags) {
    (void)flags;
    return instantiate(out, graph);
}

CUAPI CUresult cuGraphInstantiateWithParams(CUgraphExec *out, CUgraph graph, void *params) {
    (void)params;
    return instantiate(out, graph);
}

CUAPI CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *out, CUgraph graph, void *params) {
    (void)params;
    return instantiate(out, graph);
}

static CUresult graph_run(CUgraphExec exec) {
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    pthread_mutex_lock(&g_lock);
    int i = find_graph((unsigned long long)(uintptr_t)exec);
    if (i >= 0 && g_graphs[i].exec)
        graph_pool_fits(i);
    pthread_mutex_unlock(&g_lock);
    return i >= 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUAPI CUresult cuGraphUpload(CUgraphExec exec, CUstream s) { (void)s; pace(); return graph_run(exec); }
CUAPI CUresult cuGraphUpload_ptsz(CUgraphExec exec, CUstream s) { (void)s; pace(); return graph_run(exec); }
/* Not probed (SGLang launches a graph every decode step). */
CUAPI CUresult cuGraphLaunch(CUgraphExec exec, CUstream s) { (void)s; return graph_run(exec); }

CUAPI CUresult cuDeviceGraphMemTrim(CUdevice dev) {
    pace();
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (dev < 0 || dev >= g_visible_count)
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_lock);
    int d = g_visible[dev];
    g_resident[d] -= g_graph_pool[d];
    g_graph_pool[d] = 0;
    nvml_publish();
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

/* Multicast objects: refused unless MEMREC_STUB_MULTICAST=1; then bookkeeping only. */
CUAPI CUresult cuMulticastCreate(CUmemGenericAllocationHandle *mc, const CUmulticastObjectProp *prop) {
    pace();
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!mc || !prop || !prop->numDevices || !prop->size)
        return CUDA_ERROR_INVALID_VALUE;
    if (!g_multicast)
        return CUDA_ERROR_NOT_SUPPORTED;
    pthread_mutex_lock(&g_lock);
    *mc = HANDLE_TAG | (0x3ULL << 44) | ((unsigned long long)getpid() << 24) | (++g_handle_seq);
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

/* A multicast call: refused unless MEMREC_STUB_MULTICAST=1, else checked only. */
static CUresult multicast_call(int valid) {
    pace();
    if (!g_multicast)
        return CUDA_ERROR_NOT_SUPPORTED;
    return valid ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUAPI CUresult cuMulticastAddDevice(CUmemGenericAllocationHandle mc, CUdevice dev) {
    return multicast_call(mc && dev >= 0 && dev < g_visible_count);
}

CUAPI CUresult cuMulticastBindMem(CUmemGenericAllocationHandle mc, size_t mcOffset, CUmemGenericAllocationHandle mem,
                                  size_t memOffset, size_t size, unsigned long long flags) {
    (void)mcOffset, (void)memOffset, (void)flags;
    return multicast_call(mc && mem && size);
}

CUAPI CUresult cuMulticastBindAddr(CUmemGenericAllocationHandle mc, size_t mcOffset, CUdeviceptr memptr, size_t size,
                                   unsigned long long flags) {
    (void)mcOffset, (void)flags;
    return multicast_call(mc && memptr && size);
}

CUAPI CUresult cuMulticastUnbind(CUmemGenericAllocationHandle mc, CUdevice dev, size_t mcOffset, size_t size) {
    (void)mcOffset;
    return multicast_call(mc && dev >= 0 && dev < g_visible_count && size);
}

/* ---- virtual memory management ---------------------------------------------------------------- */

CUAPI CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                             CUmemAllocationGranularity_flags option) {
    (void)option;
    if (!granularity || !prop)
        return CUDA_ERROR_INVALID_VALUE;
    *granularity = VMM_GRANULARITY;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                           unsigned long long flags) {
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!handle || !prop || flags != 0 || size == 0 || size % VMM_GRANULARITY != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    int ordinal = prop->location.id;
    if (ordinal < 0 || ordinal >= g_visible_count)
        return CUDA_ERROR_INVALID_DEVICE;
    int physical = g_visible[ordinal];
    CUresult rc = CUDA_SUCCESS;
    pthread_mutex_lock(&g_lock);
    if (size > g_capacity || g_used[physical] + size > g_capacity) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
        int i = new_handle(size, physical, 0);
        if (i < 0) {
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            g_used[physical] += size;
            *handle = g_handles[i].id;
            nvml_publish();
        }
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

CUAPI CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    int i = find_handle(handle);
    if (i >= 0) {
        rc = CUDA_SUCCESS;
        if (--g_handles[i].refs == 0) {
            if (!g_handles[i].imported)
                g_used[g_handles[i].physical] -= g_handles[i].size;
            g_handles[i] = g_handles[--g_handle_count];
            nvml_publish();
        }
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

CUAPI CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                   unsigned long long flags) {
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!ptr || size == 0 || flags != 0 || size % VMM_GRANULARITY != 0)
        return CUDA_ERROR_INVALID_VALUE;
    (void)addr; /* a hint only, as in the driver */
    unsigned long long a = alignment ? alignment : VMM_GRANULARITY;
    CUresult rc = CUDA_SUCCESS;
    pthread_mutex_lock(&g_lock);
    unsigned long long start = align_up(VA_BASE + g_va_bump, a);
    if (add_range(g_reserved, &g_reserved_count, start, size, 0) < 0) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
        g_va_bump = start + size - VA_BASE;
        *ptr = start;
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

CUAPI CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    int i = find_range(g_reserved, g_reserved_count, ptr, 1);
    if (i >= 0 && g_reserved[i].size == size) {
        del_range(g_reserved, &g_reserved_count, i);
        rc = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

CUAPI CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                        unsigned long long flags) {
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (flags != 0 || size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = CUDA_SUCCESS;
    pthread_mutex_lock(&g_lock);
    int h = find_handle(handle);
    if (h < 0) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else if (offset + size > g_handles[h].size) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (find_range(g_reserved, g_reserved_count, ptr, 0) < 0) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (add_range(g_maps, &g_map_count, ptr, size, handle) < 0) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

CUAPI CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    int i = find_range(g_maps, g_map_count, ptr, 1);
    if (i >= 0 && g_maps[i].size == size) {
        del_range(g_maps, &g_map_count, i);
        rc = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

typedef struct CUmemAccessDesc_st CUmemAccessDesc; /* opaque here */

CUAPI CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
    (void)ptr;
    (void)size;
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    return (desc && count) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUAPI CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr) {
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!handle)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    int m = find_range(g_maps, g_map_count, (unsigned long long)(uintptr_t)addr, 0);
    if (m >= 0) {
        int h = find_handle(g_maps[m].tag);
        if (h >= 0) {
            g_handles[h].refs++;
            *handle = g_handles[h].id;
            rc = CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

CUAPI CUresult cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                            CUmemAllocationHandleType handleType, unsigned long long flags) {
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!shareableHandle || flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    int h = find_handle(handle);
    struct vmm_handle copy;
    if (h >= 0)
        copy = g_handles[h];
    pthread_mutex_unlock(&g_lock);
    if (h < 0)
        return CUDA_ERROR_INVALID_HANDLE;
    char blob[64];
    if (handleType == CU_MEM_HANDLE_TYPE_FABRIC) {
        encode64(blob, FAB_MAGIC, copy.id, copy.size, copy.physical);
        memcpy(shareableHandle, blob, 64);
        return CUDA_SUCCESS;
    }
    if (handleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return CUDA_ERROR_NOT_SUPPORTED;
    /* An fd another process can receive over SCM_RIGHTS and decode: an unlinked temp file. */
    char path[] = "/tmp/memrec-stub-XXXXXX";
    int fd = mkstemp(path);
    if (fd < 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    unlink(path);
    encode64(blob, FAB_MAGIC, copy.id, copy.size, copy.physical);
    if (pwrite(fd, blob, 64, 0) != 64) {
        close(fd);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *(int *)shareableHandle = fd;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle,
                                              CUmemAllocationHandleType shHandleType) {
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!handle)
        return CUDA_ERROR_INVALID_VALUE;
    char blob[64];
    if (shHandleType == CU_MEM_HANDLE_TYPE_FABRIC) {
        if (!osHandle)
            return CUDA_ERROR_INVALID_VALUE;
        memcpy(blob, osHandle, 64);
    } else if (shHandleType == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
        int fd = (int)(intptr_t)osHandle;
        if (pread(fd, blob, 64, 0) != 64)
            return CUDA_ERROR_INVALID_VALUE;
    } else {
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    unsigned long long id, size;
    int physical;
    if (!decode64(blob, FAB_MAGIC, &id, &size, &physical))
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = CUDA_SUCCESS;
    pthread_mutex_lock(&g_lock);
    int i = new_handle(size, physical, 1);
    if (i < 0)
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    else
        *handle = g_handles[i].id;
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* ---- IPC ---------------------------------------------------------------------------------------- */

CUAPI CUresult cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr) {
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!pHandle)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    for (int i = g_live_count - 1; i >= 0; i--) {
        if (g_live[i].ptr == dptr) {
            encode64(pHandle->reserved, IPC_MAGIC, dptr, g_live[i].size, g_live[i].physical);
            rc = CUDA_SUCCESS;
            break;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* The handle is passed BY VALUE (64 bytes, SysV class MEMORY): it sits on the caller's stack at
 * [rsp+8] on entry, and Flags arrives in the second integer register (rsi). */
CUAPI CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags) {
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!pdptr || (Flags & ~1u) != 0) /* CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS */
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_ctx(current_ctx()))
        return CUDA_ERROR_INVALID_CONTEXT;
    unsigned long long ptr, size;
    int physical;
    if (!decode64(handle.reserved, IPC_MAGIC, &ptr, &size, &physical))
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = CUDA_SUCCESS;
    pthread_mutex_lock(&g_lock);
    unsigned long long va = IPC_BASE + g_ipc_bump;
    if (add_range(g_ipc_open, &g_ipc_open_count, va, size, ptr) < 0) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
        g_ipc_bump += align_up(size ? size : 1, VMM_GRANULARITY);
        *pdptr = va;
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

CUAPI CUresult cuIpcCloseMemHandle(CUdeviceptr dptr) {
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    int i = find_range(g_ipc_open, g_ipc_open_count, dptr, 1);
    if (i >= 0) {
        del_range(g_ipc_open, &g_ipc_open_count, i);
        rc = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* ---- pinned host memory (real host memory: callers may touch it) ------------------------------ */

static CUresult host_alloc(void **pp, size_t bytesize, unsigned int flags) {
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!pp || bytesize == 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_ctx(current_ctx()))
        return CUDA_ERROR_INVALID_CONTEXT;
    void *p = NULL;
    if (posix_memalign(&p, 4096, bytesize) != 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&g_lock);
    int i = add_range(g_host, &g_host_count, (unsigned long long)(uintptr_t)p, bytesize, flags);
    pthread_mutex_unlock(&g_lock);
    if (i < 0) {
        free(p);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *pp = p;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags) {
    return host_alloc(pp, bytesize, Flags);
}

CUAPI CUresult cuMemAllocHost_v2(void **pp, size_t bytesize) { return host_alloc(pp, bytesize, 0); }

CUAPI CUresult cuMemFreeHost(void *p) {
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    int i = find_range(g_host, g_host_count, (unsigned long long)(uintptr_t)p, 1);
    if (i >= 0) {
        del_range(g_host, &g_host_count, i);
        rc = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_lock);
    if (rc == CUDA_SUCCESS)
        free(p);
    return rc;
}

/* Registered ranges are only remembered, so Unregister can tell a known pointer from a stray one. */
static struct range g_registered[MAX_SMALL];
static int g_registered_count;

CUAPI CUresult cuMemHostRegister_v2(void *p, size_t bytesize, unsigned int Flags) {
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!p || bytesize == 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    int i = add_range(g_registered, &g_registered_count, (unsigned long long)(uintptr_t)p, bytesize, Flags);
    pthread_mutex_unlock(&g_lock);
    return i < 0 ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_SUCCESS;
}

CUAPI CUresult cuMemHostUnregister(void *p) {
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    int i = find_range(g_registered, g_registered_count, (unsigned long long)(uintptr_t)p, 1);
    if (i >= 0) {
        del_range(g_registered, &g_registered_count, i);
        rc = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

CUAPI CUresult cuGetErrorName(CUresult error, const char **pStr) {
    if (!pStr)
        return CUDA_ERROR_INVALID_VALUE;
    switch (error) {
    case CUDA_SUCCESS: *pStr = "CUDA_SUCCESS"; break;
    case CUDA_ERROR_INVALID_VALUE: *pStr = "CUDA_ERROR_INVALID_VALUE"; break;
    case CUDA_ERROR_OUT_OF_MEMORY: *pStr = "CUDA_ERROR_OUT_OF_MEMORY"; break;
    case CUDA_ERROR_NOT_INITIALIZED: *pStr = "CUDA_ERROR_NOT_INITIALIZED"; break;
    case CUDA_ERROR_INVALID_DEVICE: *pStr = "CUDA_ERROR_INVALID_DEVICE"; break;
    case CUDA_ERROR_INVALID_CONTEXT: *pStr = "CUDA_ERROR_INVALID_CONTEXT"; break;
    case CUDA_ERROR_INVALID_HANDLE: *pStr = "CUDA_ERROR_INVALID_HANDLE"; break;
    case CUDA_ERROR_NOT_SUPPORTED: *pStr = "CUDA_ERROR_NOT_SUPPORTED"; break;
    default: *pStr = NULL; return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}
