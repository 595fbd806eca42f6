/* tool_util.c: small helpers the CLI's subcommands share: clocks, medians, an RNG, build info. */
#if defined(__linux__) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE /* madvise, MADV_HUGEPAGE */
#endif
#include "tool.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef __linux__
#include <sys/mman.h>
#endif

uint64_t tool_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double tool_percentile(double *v, size_t n, double pct) {
    if (n == 0) return 0.0;
    qsort(v, n, sizeof *v, cmp_double);
    double pos = pct / 100.0 * (double)(n - 1);
    size_t lo = (size_t)pos;
    if (lo + 1 >= n) return v[n - 1];
    double frac = pos - (double)lo;
    return v[lo] * (1.0 - frac) + v[lo + 1] * frac;
}

double tool_median(double *v, size_t n) { return tool_percentile(v, n, 50.0); }

int tool_parse_u64(const char *s, uint64_t *out) {
    if (!s || *s < '0' || *s > '9') return -1;
    uint64_t v = 0;
    for (; *s; s++) {
        if (*s < '0' || *s > '9') return -1;
        const uint64_t d = (uint64_t)(*s - '0');
        if (v > (UINT64_MAX - d) / 10) return -1;
        v = v * 10 + d;
    }
    *out = v;
    return 0;
}

int tool_parse_u32(const char *s, uint32_t *out) {
    uint64_t v;
    if (tool_parse_u64(s, &v) || v > UINT32_MAX) return -1;
    *out = (uint32_t)v;
    return 0;
}

int tool_parse_u32_list(const char *s, uint32_t *out, int cap, uint32_t max, int *n) {
    *n = 0;
    while (*s) {
        char *end;
        unsigned long v = strtoul(s, &end, 10);
        /* digits only: no sign, no blanks, no empty item ("4,", ",4", "4,,8") */
        if (*s < '0' || *s > '9' || v == 0 || v > max || *n == cap || (*end && *end != ',')) return -1;
        out[(*n)++] = (uint32_t)v;
        if (*end == ',' && !end[1]) return -1;
        s = *end ? end + 1 : end;
    }
    return *n ? 0 : -1;
}

int tool_parse_dtype_list(const char *s, pkv_dtype *out, int cap, int *n) {
    *n = 0;
    while (*s) {
        const char *end = strchr(s, ',');
        const size_t len = end ? (size_t)(end - s) : strlen(s);
        int found = -1;
        for (int d = 0; d < PKV_DTYPE_COUNT && found < 0; d++) {
            const char *name = pkv_dtype_name((pkv_dtype)d);
            if (strlen(name) == len && !strncmp(s, name, len)) found = d;
        }
        if (found < 0 || *n == cap || (end && !end[1])) return -1; /* unknown, too many, "f16," */
        out[(*n)++] = (pkv_dtype)found;
        s = end ? end + 1 : s + len;
    }
    return *n ? 0 : -1;
}

int tool_parse_f64(const char *s, double *out) {
    if (!s || !*s) return -1;
    char *e;
    errno = 0;
    const double v = strtod(s, &e);
    if (*e || errno || !isfinite(v)) return -1;
    *out = v;
    return 0;
}

int tool_check(int rc, const char *what) {
    if (rc < 0) fprintf(stderr, "pkv: %s failed: %s\n", what, pkv_strerror(rc));
    return rc;
}

int tool_fill_seq(pkv_cache *c, pkv_seq s, uint32_t n, int32_t tok0, float *kv, uint64_t *rng) {
    pkv_config cfg;
    if (tool_check(pkv_cache_config(c, &cfg), "pkv_cache_config") < 0) return -1;
    const size_t row = (size_t)cfg.n_kv_heads * cfg.head_dim;
    for (uint32_t done = 0; done < n;) {
        const uint32_t m = n - done < TOOL_FILL_CHUNK ? n - done : TOOL_FILL_CHUNK;
        int32_t tok[TOOL_FILL_CHUNK], slots[TOOL_FILL_CHUNK];
        for (uint32_t i = 0; i < m; i++) tok[i] = tok0 + (int32_t)(done + i);
        if (tool_check(pkv_seq_append(c, s, tok, m, slots), "pkv_seq_append") < 0) return -1;
        for (size_t i = 0; i < (size_t)m * row; i++) {
            *rng = *rng * 6364136223846793005ull + 1442695040888963407ull;
            kv[i] = (float)(int32_t)(*rng >> 40) / 8388608.0f;
        }
        for (uint32_t l = 0; l < cfg.n_layers; l++)
            if (tool_check(pkv_write_kv(c, l, slots, m, kv, kv, PKV_DTYPE_F32), "pkv_write_kv") < 0) return -1;
        done += m;
    }
    return 0;
}

static void log_errors(void *ctx, int level, const char *msg) {
    if (level <= PKV_LOG_WARN) fprintf(stderr, "%s: %s\n", (const char *)ctx, msg);
}

void tool_log_errors(pkv_config *cfg, const char *who) {
    cfg->log = log_errors;
    cfg->log_ctx = (void *)(uintptr_t)who;
}

void tool_rng_seed(tool_rng *r, uint64_t seed) { r->s = seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull; }

uint64_t tool_rng_u64(tool_rng *r) { /* splitmix64 */
    uint64_t z = (r->s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

double tool_rng_unit(tool_rng *r) { return (double)(tool_rng_u64(r) >> 11) * (1.0 / 9007199254740992.0); }

double tool_rng_normal(tool_rng *r) {
    double u1 = tool_rng_unit(r), u2 = tool_rng_unit(r);
    if (u1 < 1e-300) u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

const char *tool_build_info(void) {
    static char buf[128];
#ifdef __clang__
    snprintf(buf, sizeof buf, "pkv %s clang %d.%d", pkv_version(), __clang_major__, __clang_minor__);
#elif defined(__GNUC__)
    snprintf(buf, sizeof buf, "pkv %s gcc %d.%d", pkv_version(), __GNUC__, __GNUC_MINOR__);
#else
    snprintf(buf, sizeof buf, "pkv %s", pkv_version());
#endif
    return buf;
}

const char *tool_cpu_name(void) {
    static char name[128] = "unknown";
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f) return name;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        if (!strncmp(line, "model name", 10)) {
            char *p = strchr(line, ':');
            if (p) {
                p++;
                while (*p == ' ') p++;
                size_t n = strcspn(p, "\n");
                if (n >= sizeof name) n = sizeof name - 1;
                memcpy(name, p, n);
                name[n] = 0;
            }
            break;
        }
    }
    fclose(f);
    return name;
}

/* ---- one pool lent to a second cache (tool.h) ----------------------------------------------- */
int tool_pool_loan_from(pkv_cache *lender, tool_pool_loan *loan) {
    pkv_layout L;
    pkv_stats st;
    int rc = pkv_cache_layout(lender, &L);
    if (rc == 0) rc = pkv_cache_get_stats(lender, &st);
    if (rc < 0) return rc;
    loan->base = L.k_base, loan->size = (size_t)st.kv_bytes; /* the pool starts with layer 0's K */
    return 0;
}

static void *loan_alloc(void *ctx, size_t size, size_t align) {
    const tool_pool_loan *loan = ctx;
    if (loan->base && size == loan->size) return loan->base;
    if (align < sizeof(void *)) align = sizeof(void *);
    const size_t rounded = (size + align - 1) & ~(align - 1);
    return rounded < size ? NULL : aligned_alloc(align, rounded);
}

static void loan_free(void *ctx, void *ptr, size_t size) {
    const tool_pool_loan *loan = ctx;
    (void)size;
    if (ptr != loan->base) free(ptr); /* the lender frees its pool */
}

pkv_allocator tool_loan_allocator(tool_pool_loan *loan) {
    return (pkv_allocator){.alloc = loan_alloc, .free = loan_free, .ctx = loan};
}

void *tool_map_huge(size_t bytes) {
    const size_t huge = (size_t)2 << 20;
#ifdef __linux__
    uint8_t *m = mmap(NULL, bytes + huge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return NULL;
    uint8_t *p = (uint8_t *)(((uintptr_t)m + huge - 1) & ~(uintptr_t)(huge - 1));
#ifdef MADV_HUGEPAGE
    (void)madvise(p, bytes, MADV_HUGEPAGE);
#endif
    return p;
#else
    return aligned_alloc(huge, (bytes + huge - 1) / huge * huge);
#endif
}

uint64_t tool_sum_run(const uint8_t *p, const uint8_t *pf, const uint8_t *near, size_t n, int l1) {
    uint64_t a = 0, b = 0, c = 0, d = 0;
    for (size_t o = 0; o < n; o += 64) {
        const uint64_t *w = (const uint64_t *)(const void *)(p + o);
        if (pf && near) /* the library's two levels: the lead with the NTA hint, the next run into L1 */
            __builtin_prefetch(pf + o, 0, 0), __builtin_prefetch(near + o, 0, 3);
        else if (pf && l1)
            __builtin_prefetch(pf + o, 0, 3);
        else if (pf)
            __builtin_prefetch(pf + o, 0, 2);
        a += w[0] + w[4], b += w[1] + w[5], c += w[2] + w[6], d += w[3] + w[7];
    }
    return a + b + c + d;
}

uint64_t tool_sum_block(const uint8_t *k, const uint8_t *v, const uint8_t *kn, const uint8_t *vn, uint32_t n_heads,
                        size_t k_run, size_t v_run, int l1, uint32_t min_ahead) {
    const size_t run = k_run + v_run, heads = (PKV_ATTN_PF_LEAD + run - 1) / run; /* the lead in heads */
    const size_t lead = heads < min_ahead ? min_ahead : heads;
    const uint32_t ahead = l1 == 3 ? 1 : l1 != 2 || lead >= n_heads ? n_heads : (uint32_t)lead;
    if (l1 == 3) l1 = 0; /* one head on, into L2 */
    uint64_t sum = 0;
    for (uint32_t h = 0; h < n_heads; h++) {
        const uint32_t hf = h + ahead; /* the run led to: this block's head hf, or the next block's */
        const uint8_t *kf = hf < n_heads ? k + hf * k_run : kn ? kn + (hf - n_heads) * k_run : NULL;
        const uint8_t *vf = hf < n_heads ? v + hf * v_run : vn ? vn + (hf - n_heads) * v_run : NULL;
        /* at two levels, the next head's runs into L1: this block's h + 1, or the next block's first */
        const bool here = h + 1 < n_heads, two = kf && l1 == 2 && ahead > 1 && (here || kn);
        const uint8_t *kh = two ? (here ? k + (h + 1) * k_run : kn) : NULL;
        const uint8_t *vh = two ? (here ? v + (h + 1) * v_run : vn) : NULL;
        sum += tool_sum_run(k + h * k_run, kf, kh, k_run, l1) + tool_sum_run(v + h * v_run, vf, vh, v_run, l1);
    }
    return sum;
}
