/* core.h: internals shared by every layer: allocation through the hook, logging, asserts,
 * CPU feature detection, small helpers. Depends on nothing but pkv.h and libc. */
#ifndef PKV_CORE_H
#define PKV_CORE_H

#include "pkv.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define PKV_INTERNAL __attribute__((visibility("hidden")))

#define PKV_LIKELY(x) __builtin_expect(!!(x), 1)
#define PKV_UNLIKELY(x) __builtin_expect(!!(x), 0)
#define PKV_MIN(a, b) ((a) < (b) ? (a) : (b))
#define PKV_MAX(a, b) ((a) > (b) ? (a) : (b))
#define PKV_CACHELINE 64
#define PKV_HUGEPAGE (2u << 20)
#define PKV_MAX_THREADS 256u /* attention threads of a cache, the caller included */
#define PKV__SPIN_US_DEFAULT 50u    /* pkv_config.spin_us: the attention threads' poll after a job */
#define PKV__SPIN_US_MAX 1000000u

/* x rounded up to a multiple of a (a power of two); less than x when that wraps */
static inline size_t pkv__align_up(size_t x, size_t a) { return (x + a - 1) & ~(a - 1); }

/* A broken internal invariant (never a user error): abort with the place. User errors are
 * statuses; this fires only on library bugs. */
void pkv__assert_fail(const char *expr, const char *file, int line) __attribute__((noreturn));
#define pkv_assert(e) ((e) ? (void)0 : pkv__assert_fail(#e, __FILE__, __LINE__))

/* Allocation through the user's hook (cfg.allocator; alloc == NULL means the default, which
 * maps sizes >= 2 MiB with mmap: zeroed, lazily committed, huge-page friendly). */
void *pkv__alloc(const pkv_allocator *a, size_t size, size_t align);
void *pkv__calloc(const pkv_allocator *a, size_t size, size_t align); /* zeroed */
void pkv__free(const pkv_allocator *a, void *p, size_t size);
/* Checked size arithmetic: false on overflow. */
static inline bool pkv__mul_ok(size_t a, size_t b, size_t *out) { return !__builtin_mul_overflow(a, b, out); }
static inline bool pkv__add_ok(size_t a, size_t b, size_t *out) { return !__builtin_add_overflow(a, b, out); }
/* Bytes of n rows of `width` floats each (the caller's arrays): false on overflow. */
static inline bool pkv__f32_rows_bytes(uint64_t n, size_t width, size_t *out) {
    size_t elems;
    return (uint64_t)(size_t)n == n && pkv__mul_ok((size_t)n, width, &elems) && pkv__mul_ok(elems, sizeof(float), out);
}
/* Bit arrays as custom masks give them (pkv_attn_prefill_masked): bit i is bit i % 8 of byte i / 8.
 * The first set bit of bits [from, to) of m, or to if none. */
static inline uint64_t pkv__bits_first(const uint8_t *m, uint64_t from, uint64_t to) {
    while (from < to) {
        const unsigned b = m[from >> 3] >> (from & 7u); /* from's bit and those after it in its byte */
        if (b) return PKV_MIN(from + (uint64_t)__builtin_ctz(b), to);
        from = (from | 7u) + 1;
    }
    return to;
}

/* The last set bit of bits [from, to) of m, or UINT64_MAX if none. */
static inline uint64_t pkv__bits_last(const uint8_t *m, uint64_t from, uint64_t to) {
    while (to > from) {
        const uint64_t i = to - 1;
        const unsigned b = m[i >> 3] & (0xFFu >> (7u - (i & 7u))); /* i's bit and those before it */
        if (b) {
            const uint64_t x = (i & ~(uint64_t)7) + (uint64_t)(31 - __builtin_clz(b));
            return x >= from ? x : UINT64_MAX;
        }
        to = i & ~(uint64_t)7;
    }
    return UINT64_MAX;
}

/* Rows r0 .. r0 + nr - 1 of a bit array of row_bits bits a row (a custom mask's queries over its
 * keys): the least and the greatest column within [*lo, *hi] that any of them sets, into *lo and
 * *hi; false where none does (both left as they were). Each row is read up to the least found so
 * far from its front and down to the greatest from its back. */
static inline bool pkv__bits_rows_span(const uint8_t *m, uint64_t row_bits, uint64_t r0, uint32_t nr, uint32_t *lo,
                                       uint32_t *hi) {
    uint64_t l = (uint64_t)*hi + 1, h = UINT64_MAX; /* l: none found yet */
    for (uint64_t r = r0; r < r0 + nr; r++) {
        const uint64_t base = r * row_bits;
        l = pkv__bits_first(m, base + *lo, base + l) - base;
        const uint64_t from = h == UINT64_MAX ? *lo : PKV_MAX((uint64_t)*lo, h + 1);
        const uint64_t x = pkv__bits_last(m, base + from, base + *hi + 1);
        if (x != UINT64_MAX) h = x - base;
    }
    if (h == UINT64_MAX) return false;
    *lo = (uint32_t)l, *hi = (uint32_t)h;
    return true;
}

/* Whether the byte ranges [a, a + na) and [b, b + nb) share a byte (the caller's arrays: an
 * aliasing check, by address). */
static inline bool pkv__overlap(const void *a, size_t na, const void *b, size_t nb) {
    const uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return x < y ? y - x < na : x - y < nb;
}
/* Whether two arrays of n bytes share a byte without being the same array (in place allowed). */
static inline bool pkv__overlap_unequal(const void *a, const void *b, size_t n) {
    return a != b && pkv__overlap(a, n, b, n);
}

/* Logging through the hook; a no-op when log == NULL. printf-style. */
void pkv__log(pkv_log_fn log, void *ctx, int level, const char *fmt, ...) __attribute__((format(printf, 4, 5)));

/* CPU features, detected once (thread-safe, cached). */
enum {
    PKV_CPU_AVX2 = 1u << 0,
    PKV_CPU_FMA = 1u << 1,
    PKV_CPU_F16C = 1u << 2,
    PKV_CPU_AVX512F = 1u << 3,
    PKV_CPU_AVX512BW = 1u << 4,
    PKV_CPU_AVX512VL = 1u << 5,
    PKV_CPU_AVX512DQ = 1u << 6,
    PKV_CPU_AVX512BF16 = 1u << 7,
    PKV_CPU_AVX512FP16 = 1u << 8,
    PKV_CPU_AVX512VNNI = 1u << 9,
    PKV_CPU_AVXVNNI = 1u << 10,
    PKV_CPU_NEON = 1u << 11,
    PKV_CPU_ASIMDDP = 1u << 12, /* Armv8.2 int8 dot product (SDOT); read from AT_HWCAP on Linux */
    PKV_CPU_AVX512_HALVES = 1u << 13, /* 512-bit ops run as two 256-bit halves: AMD family 19h (Zen 4) */
    /* each core's L2 backed by its core complex's large L3, which takes the lines L2 evicts (a victim
     * cache): AMD family 19h (Zen 3 and 4; measured on Zen 4) */
    PKV_CPU_VICTIM_L3 = 1u << 14,
    /* decode's software prefetch of the next block pays more into L1 (T0) than into L2 (T1), and
     * in a decode head's score in 8 shares a tile rather than 4: AMD family 1Ah (Zen 5; measured
     * there, stop 35). Elsewhere T1 and 4: T0 made decode 1.43x as slow on Zen 4 (f32) and 1.19x
     * on Intel, and 4 shares beat 2 by 8% on Zen 4. */
    PKV_CPU_PREFETCH_L1 = 1u << 15,
    /* a decode sweep pays more for gaps between the blocks a core reads than for the sequences'
     * states it keeps: a group takes as many sequences as a sweep holds, its threads sweep one
     * set cut into ranges of the pool, and no state is prefetched: AMD family 1Ah (Zen 5;
     * measured there, stop 38: f16 4096 x 16 paged 1.10x -> 1.06x contiguous at 1 thread). */
    PKV_CPU_WIDE_SWEEP = 1u << 16,
    /* decode reads a window of blocks' K and then their V (src/attn/attn.c, the two passes),
     * not each block's K and V together: AMD family 1Ah (Zen 5; measured there, stop 44: f16
     * 4096 x 16 0.90-0.94 of the time, f32 0.86-0.91, contiguous and paged alike). Unmeasured
     * elsewhere; one pass (PKV_ATTN_PASSES=two turns it on anywhere). */
    PKV_CPU_TWO_PASS = 1u << 17,
    /* decode's software prefetch (one pass, the row path) leads by one kv head, the next (block,
     * head) of the walk, into L2, not by a block (the same head of the next block): Intel
     * (measured on a Xeon under KVM, family 6 model 167 as reported, stop 52: f16 contiguous and
     * batch-1 paged 0.83-0.85 of the time at 1 and 2 threads, batch-16 paged 0.93-0.95, f32 and
     * the quantized types 0.99-1.00; a lead of 2 heads gained nothing). Unmeasured on AMD but
     * Zen 5, which leads by bytes at two levels (PKV_CPU_PREFETCH_L1). PKV_ATTN_LEAD=head|block
     * overrides it. */
    PKV_CPU_LEAD_HEAD = 1u << 18,
    /* with 16-bit K and V (f16, bf16), the one-pass row path takes each (block, head) run longer
     * than 4 KiB of K in pieces of 4 KiB (score, softmax, accum a piece; the prefetch leads by
     * a piece): Intel (the Xeon of PKV_CPU_LEAD_HEAD, stop 53: f16 4096 x 16 paged at 32-token
     * blocks 0.92-0.93 of the time, 64-token 0.86, contiguous 0.82-0.83; 16-token blocks, whose
     * runs are 4 KiB, unchanged; 2 KiB pieces lost 5-7% there; f32 gained nothing, whole runs
     * kept). Unmeasured on AMD. PKV_ATTN_PIECES=on|off overrides it. */
    PKV_CPU_PIECES = 1u << 19,
    PKV_CPU_ARM_BF16 = 1u << 20, /* Armv8.6 bf16 (BFDOT, BFCVT); read from AT_HWCAP2 on Linux */
    /* AMX-TILE and AMX-BF16 (CPUID.(7, 0):EDX bits 24, 22) with the OS saving tile state
     * (XCR0 bits 17, 18): Intel Sapphire Rapids and later Xeons, 64-bit. Using the tiles also
     * needs Linux's leave (pkv__amx_enable). */
    PKV_CPU_AMX_BF16 = 1u << 21,
};
uint32_t pkv__cpu_features(void);
/* Asks Linux (5.16 and later) once per process for the AMX tile state (arch_prctl
 * ARCH_REQ_XCOMP_PERM, XTILEDATA): true where it was granted and the CPU has AMX-BF16, false
 * elsewhere (another OS, a 32-bit build, a kernel that refuses: one where a thread's signal
 * stack is too small for the larger signal frame AMX brings). Granted, the process's signal
 * frames grow by the 8 KiB of tile data. */
bool pkv__amx_enable(void);
/* True when PKV_FORCE_REF is set to a non-empty value other than "0". */
bool pkv__force_ref(void);
/* PKV_ATTN_BACKEND from the environment: a backend name to use instead of the detected one, or
 * NULL when unset or empty. */
const char *pkv__env_backend(void);
/* Online cpus (>= 1). */
uint32_t pkv__n_cpus(void);
/* Monotonic nanoseconds. */
uint64_t pkv__now_ns(void);

#endif
