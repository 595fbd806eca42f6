/* core.c: status strings, version, the allocator and log hooks, asserts, CPU detection. */
#include "core.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#if defined(__x86_64__) && defined(__linux__)
#include <sys/syscall.h>
#endif
#include <time.h>
#include <unistd.h>
#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#define PKV_HWCAP_ASIMDDP (1ul << 20) /* HWCAP_ASIMDDP of the arm64 kernel's uapi hwcap.h */
#define PKV_HWCAP2_BF16 (1ul << 14)  /* HWCAP2_BF16, the same header's AT_HWCAP2 bit */
#endif

PKV_API const char *pkv_strerror(int rc) {
    switch (rc) {
    case PKV_OK: return "success";
    case PKV_EINVAL: return "invalid argument";
    case PKV_ENOMEM: return "out of host memory";
    case PKV_ENOSPC: return "no free KV block (even after eviction)";
    case PKV_ENOENT: return "unknown or stale sequence";
    case PKV_ELIMIT: return "limit reached (max_seqs or max_blocks_per_seq)";
    case PKV_ECORRUPT: return "invariant violated or corrupt data";
    case PKV_EIO: return "I/O error";
    case PKV_ENOTSUP: return "not supported";
    case PKV_EBUSY: return "resource busy";
    default: return rc > 0 ? "unexpected positive status" : "unknown error";
    }
}

PKV_API const char *pkv_version(void) { return PKV_VERSION_STRING; }

void pkv__assert_fail(const char *expr, const char *file, int line) {
    /* A library bug, never a user error: there is no safe way to continue. */
    fprintf(stderr, "pagedkv: internal invariant failed: %s (%s:%d)\n", expr, file, line);
    abort();
}

/* ---- allocation ---------------------------------------------------------------------------- */
/* The default allocator maps big regions (the pool) with mmap: zeroed, committed lazily,
 * aligned to 2 MiB and advised (MADV_HUGEPAGE) so transparent huge pages back them. Small ones use aligned_alloc. */
static void *default_alloc(size_t size, size_t align) {
    if (size >= PKV_HUGEPAGE) {
        size_t len = size + PKV_HUGEPAGE;
        if (len < size) return NULL;
        uint8_t *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) return NULL;
        uintptr_t a = pkv__align_up((uintptr_t)p, PKV_HUGEPAGE);
        size_t head = a - (uintptr_t)p, pg = (size_t)sysconf(_SC_PAGESIZE);
        size_t keep = pkv__align_up(size, pg); /* the mapping is exactly [a, a + keep) */
        if (head) munmap(p, head);
        if (len - head > keep) munmap((uint8_t *)a + keep, len - head - keep);
#ifdef MADV_HUGEPAGE
        /* Where THP is in "madvise" mode (the Debian default) only advised ranges get huge pages.
           Attention reads every (block, kv head) run of a sequence: scattered 4 KiB runs, each on
           its own small page, cost a TLB walk apiece; 2 MiB pages cover a block's neighbours too.
           Advice only: a kernel without THP refuses it and nothing changes. */
        (void)madvise((void *)a, keep, MADV_HUGEPAGE);
#endif
        return (void *)a;
    }
    if (align < sizeof(void *)) align = sizeof(void *);
    size_t rounded = pkv__align_up(size, align);
    if (rounded < size) return NULL;
    return aligned_alloc(align, rounded ? rounded : align);
}

static void default_free(void *p, size_t size) {
    if (!p) return;
    if (size >= PKV_HUGEPAGE) {
        /* default_alloc trimmed the mapping to exactly [p, p + size rounded up to a page):
           unmapping more would unmap whatever the kernel placed after it. */
        size_t pg = (size_t)sysconf(_SC_PAGESIZE);
        munmap(p, pkv__align_up(size, pg));
        return;
    }
    free(p);
}

void *pkv__alloc(const pkv_allocator *a, size_t size, size_t align) {
    if (size == 0) size = 1;
    if (a && a->alloc) return a->alloc(a->ctx, size, align);
    return default_alloc(size, align);
}

void *pkv__calloc(const pkv_allocator *a, size_t size, size_t align) {
    if (size == 0) size = 1;
    void *p = pkv__alloc(a, size, align);
    /* mmap'ed regions from the default allocator are already zero: skip touching them. */
    if (p && ((a && a->alloc) || size < PKV_HUGEPAGE)) memset(p, 0, size);
    return p;
}

void pkv__free(const pkv_allocator *a, void *p, size_t size) {
    if (!p) return;
    if (size == 0) size = 1;
    if (a && a->alloc) {
        if (a->free) a->free(a->ctx, p, size);
        return;
    }
    default_free(p, size);
}

void pkv__log(pkv_log_fn log, void *ctx, int level, const char *fmt, ...) {
    if (!log) return;
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    log(ctx, level, buf);
}

/* ---- cpu ------------------------------------------------------------------------------------ */
static uint32_t g_cpu;
static pthread_once_t g_cpu_once = PTHREAD_ONCE_INIT;

#if defined(__x86_64__) || defined(__i386__)
/* CPUID leaf, subleaf: r = eax, ebx, ecx, edx */
static void cpuid(uint32_t leaf, uint32_t sub, uint32_t r[4]) {
    __asm__ volatile("cpuid" : "=a"(r[0]), "=b"(r[1]), "=c"(r[2]), "=d"(r[3]) : "a"(leaf), "c"(sub));
}
#endif

static void detect_cpu(void) {
    uint32_t f = 0;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) f |= PKV_CPU_AVX2;
    if (__builtin_cpu_supports("fma")) f |= PKV_CPU_FMA;
    if (__builtin_cpu_supports("avx512f")) f |= PKV_CPU_AVX512F;
    if (__builtin_cpu_supports("avx512bw")) f |= PKV_CPU_AVX512BW;
    if (__builtin_cpu_supports("avx512vl")) f |= PKV_CPU_AVX512VL;
    if (__builtin_cpu_supports("avx512dq")) f |= PKV_CPU_AVX512DQ;
    if (__builtin_cpu_supports("avx512vnni")) f |= PKV_CPU_AVX512VNNI;
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
    if (__builtin_cpu_supports("avx512fp16")) f |= PKV_CPU_AVX512FP16;
#endif
    /* F16C: CPUID.1:ECX bit 29. The family from EAX: base (bits 8-11), plus the extended family
     * (bits 20-27) where base is 0xF; read here for both AMD families the kernels tune for, as
     * GCC 12 and clang 14 know __builtin_cpu_is("amdfam19h") but not "amdfam1ah". */
    uint32_t r[4];
    cpuid(1, 0, r);
    if (r[2] & (1u << 29)) f |= PKV_CPU_F16C;
    const uint32_t ecx1 = r[2];
    uint32_t family = (r[0] >> 8) & 0xFu;
    if (family == 0xFu) family += (r[0] >> 20) & 0xFFu;
    /* leaf 7 where it exists (CPUID.0:EAX, the last leaf): l7 its subleaf 0, zeros elsewhere */
    uint32_t l7[4] = {0, 0, 0, 0};
    cpuid(0, 0, r);
    if (r[0] >= 7) cpuid(7, 0, l7);
    /* AVX-VNNI: CPUID.(7, 1):EAX bit 4 (read here: __builtin_cpu_supports has no name for it in
     * clang 14), where leaf 7 has subleaf 1 (CPUID.(7, 0):EAX, the last subleaf); only with AVX2,
     * whose check above includes the OS's YMM state */
    if (l7[0] >= 1 && (f & PKV_CPU_AVX2)) {
        cpuid(7, 1, r);
        if (r[0] & (1u << 4)) f |= PKV_CPU_AVXVNNI;
        /* AVX512_BF16: CPUID.(7, 1):EAX bit 5, read here too (clang 14 has no name for it), with
           AVX-512, whose check above includes the OS's ZMM state */
        if ((r[0] & (1u << 5)) && (f & PKV_CPU_AVX512F)) f |= PKV_CPU_AVX512BF16;
    }
#if defined(__x86_64__)
    /* AMX: CPUID.(7, 0):EDX bits 24 (tiles) and 22 (bf16), and XCR0 bits 17-18 (the OS saves
     * XTILECFG and XTILEDATA; OSXSAVE, CPUID.1:ECX bit 27, says xgetbv may be executed) */
    if ((l7[3] & (1u << 24)) && (l7[3] & (1u << 22)) && (ecx1 & (1u << 27))) {
        uint32_t lo, hi;
        __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        if ((lo & (3u << 17)) == (3u << 17)) f |= PKV_CPU_AMX_BF16;
    }
#else
    (void)ecx1;
#endif
    if (__builtin_cpu_is("amd")) {
        if (family == 0x19u) f |= PKV_CPU_AVX512_HALVES | PKV_CPU_VICTIM_L3; /* Zen 3 and 4 */
        if (family == 0x1Au) f |= PKV_CPU_PREFETCH_L1 | PKV_CPU_WIDE_SWEEP | PKV_CPU_TWO_PASS; /* Zen 5 */
    }
    if (__builtin_cpu_is("intel")) f |= PKV_CPU_LEAD_HEAD | PKV_CPU_PIECES;
#elif defined(__aarch64__)
    f |= PKV_CPU_NEON;
#if defined(__linux__)
    if (getauxval(AT_HWCAP) & PKV_HWCAP_ASIMDDP) f |= PKV_CPU_ASIMDDP;
    if (getauxval(AT_HWCAP2) & PKV_HWCAP2_BF16) f |= PKV_CPU_ARM_BF16;
#endif
#endif
    g_cpu = f;
}

uint32_t pkv__cpu_features(void) {
    pthread_once(&g_cpu_once, detect_cpu);
    return g_cpu;
}

static bool g_amx;
static pthread_once_t g_amx_once = PTHREAD_ONCE_INIT;

static void amx_request(void) {
#if defined(__x86_64__) && defined(__linux__)
    enum { ARCH_GET_XCOMP_PERM = 0x1022, ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
    if (!(pkv__cpu_features() & PKV_CPU_AMX_BF16)) return;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return;
    unsigned long granted = 0;
    if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &granted) != 0) return;
    g_amx = (granted >> XFEATURE_XTILEDATA) & 1u;
#endif
}

bool pkv__amx_enable(void) {
    pthread_once(&g_amx_once, amx_request);
    return g_amx;
}

bool pkv__force_ref(void) {
    const char *e = getenv("PKV_FORCE_REF");
    return e && *e && strcmp(e, "0") != 0;
}

const char *pkv__env_backend(void) {
    const char *e = getenv("PKV_ATTN_BACKEND");
    return e && *e ? e : NULL;
}

uint32_t pkv__n_cpus(void) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (uint32_t)n : 1u;
}

uint64_t pkv__now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
