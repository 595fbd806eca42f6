/* support_util.c: shared test helpers (RNG, counting/fault allocator, config builders,
 * checker/stats asserts, reference f16/bf16 conversions). Linked into every test binary. */
#include "support_util.h"

#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- RNG ---- */
void tu_rng_seed(tu_rng *r, uint64_t seed) { r->s = seed * 0x9E3779B97F4A7C15ull + 0x2545F4914F6CDD1Dull; }

uint64_t tu_rng_u64(tu_rng *r) {
    uint64_t z = (r->s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

uint32_t tu_rng_below(tu_rng *r, uint32_t n) { return (uint32_t)(((tu_rng_u64(r) >> 32) * (uint64_t)n) >> 32); }

float tu_rng_float(tu_rng *r) { return (float)((double)(tu_rng_u64(r) >> 40) * (1.0 / 8388608.0) - 1.0); }

bool tu_rng_chance(tu_rng *r, double p) { return (double)(tu_rng_u64(r) >> 11) * (1.0 / 9007199254740992.0) < p; }

uint64_t tu_env_u64(const char *name, uint64_t dflt) {
    const char *s = getenv(name);
    if (!s || !*s) return dflt;
    char *end = NULL;
    unsigned long long v = strtoull(s, &end, 10);
    return (end && *end == '\0') ? (uint64_t)v : dflt;
}

/* ---- allocator hook ---- */
#define TU_MAX_LIVE 4096
typedef struct {
    void *p;
    size_t size;
} tu_rec;
static tu_rec g_recs[TU_MAX_LIVE];
static pthread_mutex_t g_alloc_mu = PTHREAD_MUTEX_INITIALIZER;

void tu_alloc_reset(tu_alloc_state *st, long fail_at) {
    memset(st, 0, sizeof *st);
    st->fail_at = fail_at;
}

static void *tu_hook_alloc(void *ctx, size_t size, size_t align) {
    tu_alloc_state *st = ctx;
    pthread_mutex_lock(&g_alloc_mu);
    long idx = st->n_calls++;
    void *p = NULL;
    if (align < sizeof(void *) || (align & (align - 1))) st->n_bad_align++;
    const int refuse = st->refuse_over && size > st->refuse_over;
    if (refuse && !st->first_refused) st->first_refused = size;
    if (idx == st->fail_at || refuse) {
        st->n_failed++;
    } else {
        size_t al = align < sizeof(void *) ? sizeof(void *) : align;
        size_t rounded = (size + st->pad + al - 1) / al * al;
        p = aligned_alloc(al, rounded ? rounded : al);
        if (p) memset((char *)p + size, 0x01, st->pad);
        if (p) {
            int slot = -1;
            for (int i = 0; i < TU_MAX_LIVE; i++)
                if (!g_recs[i].p) {
                    slot = i;
                    break;
                }
            if (slot < 0) { /* more live blocks than the table holds: a test bug, fail loudly */
                free(p);
                p = NULL;
                st->n_bad_free++;
            } else {
                g_recs[slot].p = p;
                g_recs[slot].size = size;
                st->n_live++;
                st->live_bytes += size;
                if (st->live_bytes > st->peak_bytes) st->peak_bytes = st->live_bytes;
            }
        }
    }
    pthread_mutex_unlock(&g_alloc_mu);
    return p;
}

static void tu_hook_free(void *ctx, void *p, size_t size) {
    tu_alloc_state *st = ctx;
    if (!p) return;
    pthread_mutex_lock(&g_alloc_mu);
    int slot = -1;
    for (int i = 0; i < TU_MAX_LIVE; i++)
        if (g_recs[i].p == p) {
            slot = i;
            break;
        }
    if (slot < 0) {
        st->n_bad_free++; /* unknown pointer or double free: do not free it */
    } else {
        if (g_recs[slot].size != size) st->n_bad_free++;
        st->n_live--;
        st->live_bytes -= g_recs[slot].size;
        g_recs[slot].p = NULL;
        free(p);
    }
    pthread_mutex_unlock(&g_alloc_mu);
}

pkv_allocator tu_allocator(tu_alloc_state *st) {
    pkv_allocator a = {tu_hook_alloc, tu_hook_free, st};
    return a;
}

/* ---- configs and wrappers ---- */
pkv_config tu_config(uint32_t n_blocks, uint32_t block_tokens, uint32_t n_layers, uint32_t n_kv_heads,
                     uint32_t head_dim, pkv_dtype dtype) {
    pkv_config cfg = pkv_config_default();
    cfg.n_blocks = n_blocks;
    cfg.block_tokens = block_tokens;
    cfg.n_layers = n_layers;
    cfg.n_kv_heads = n_kv_heads;
    cfg.head_dim = head_dim;
    cfg.k_dtype = dtype;
    cfg.v_dtype = dtype;
    cfg.enable_prefix_cache = 0;
    cfg.n_threads = 1;
    cfg.huge_pages = 0;
    return cfg;
}

pkv_cache *tu_create(const pkv_config *cfg) {
    pkv_cache *c = NULL;
    int rc = pkv_cache_create(cfg, &c);
    if (rc != 0) fail_msg("pkv_cache_create: %s (%d)", pkv_strerror(rc), rc);
    assert_non_null(c);
    return c;
}

pkv_seq tu_seq(pkv_cache *c) {
    pkv_seq s = 0;
    TU_OK(pkv_seq_create(c, NULL, 0, &s));
    assert_true(s != PKV_SEQ_NONE);
    return s;
}

void tu_tokens(int32_t *t, uint32_t n, int32_t first) {
    for (uint32_t i = 0; i < n; i++) t[i] = first + (int32_t)i;
}

void tu_append(pkv_cache *c, pkv_seq s, uint32_t n, int32_t first, int32_t *slots_out) {
    int32_t *t = malloc((n ? n : 1) * sizeof *t);
    assert_non_null(t);
    tu_tokens(t, n, first);
    int rc = pkv_seq_append(c, s, t, n, slots_out);
    free(t);
    if (rc != 0) fail_msg("pkv_seq_append(n=%u): %s (%d)", n, pkv_strerror(rc), rc);
}

pkv_seq_info tu_info(pkv_cache *c, pkv_seq s) {
    pkv_seq_info in;
    memset(&in, 0xA5, sizeof in);
    TU_OK(pkv_seq_get_info(c, s, &in));
    return in;
}

pkv_stats tu_stats(pkv_cache *c) {
    pkv_stats st;
    memset(&st, 0xA5, sizeof st);
    TU_OK(pkv_cache_get_stats(c, &st));
    return st;
}

uint32_t tu_table(pkv_cache *c, pkv_seq s, int32_t *out, uint32_t cap) {
    uint32_t n = 0xFFFFFFFFu;
    TU_OK(pkv_seq_block_table(c, s, out, cap, &n));
    assert_true(n <= cap);
    return n;
}

/* ---- assertions ---- */
void tu_assert_check_(pkv_cache *c, const char *file, int line) {
    char msg[512] = "";
    int rc = pkv_cache_check(c, msg, sizeof msg);
    if (rc != 0) {
        msg[sizeof msg - 1] = '\0';
        fail_msg("%s:%d: pkv_cache_check failed (%s): %s", file, line, pkv_strerror(rc), msg);
    }
}

void tu_assert_rc_(int got, int want, const char *expr, const char *file, int line) {
    if (got != want)
        fail_msg("%s:%d: %s returned %d (%s), expected %d (%s)", file, line, expr, got, pkv_strerror(got), want,
                 pkv_strerror(want));
}

void tu_assert_stats_eq_(const pkv_stats *a, const pkv_stats *b, const char *file, int line) {
#define TU_F(f)                                                                                                      \
    if (a->f != b->f)                                                                                                \
        fail_msg("%s:%d: stats.%s changed: %llu -> %llu", file, line, #f, (unsigned long long)a->f,                  \
                 (unsigned long long)b->f);
    TU_F(n_blocks) TU_F(n_free) TU_F(n_cached) TU_F(n_active) TU_F(n_seqs) TU_F(n_pins) TU_F(n_tokens)
    TU_F(n_slots_used) TU_F(kv_bytes) TU_F(kv_bytes_per_block) TU_F(meta_bytes) TU_F(frag_slots)
    TU_F(cow_copies) TU_F(peak_active) TU_F(prefix_lookups) TU_F(prefix_tokens_queried) TU_F(prefix_tokens_hit)
    TU_F(prefix_miss_new) TU_F(prefix_miss_evicted) TU_F(prefix_miss_namespace) TU_F(n_indexed) TU_F(evictions)
    TU_F(attn_reqs_pool) TU_F(attn_reqs_table) TU_F(attn_shared_keys) TU_F(n_tombstones) TU_F(prefix_tomb_hits)
#undef TU_F
}

/* ---- reference conversions ---- */
float tu_f16_to_f32(uint16_t h) {
    int sign = h >> 15, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    double v;
    if (e == 0x1f) v = m ? NAN : INFINITY;
    else if (e == 0) v = ldexp((double)m, -24);
    else v = ldexp((double)(m + 1024), e - 25);
    return (float)(sign ? -v : v);
}

float tu_bf16_to_f32(uint16_t b) {
    int sign = b >> 15, e = (b >> 7) & 0xff, m = b & 0x7f;
    double v;
    if (e == 0xff) v = m ? NAN : INFINITY;
    else if (e == 0) v = ldexp((double)m, -133);
    else v = ldexp((double)(m + 128), e - 134);
    return (float)(sign ? -v : v);
}

/* Generic round-to-nearest-even into a format with `mant` fraction bits, exponent bias
 * `bias` and an all-ones exponent for inf: nearbyint in the default rounding mode is RNE. */
static uint16_t ref_round(float f, int mant, int bias, int exp_bits) {
    uint16_t sign = signbit(f) ? (uint16_t)(1u << (mant + exp_bits)) : 0;
    double x = fabs((double)f);
    uint16_t inf = (uint16_t)(((1u << exp_bits) - 1) << mant);
    if (isinf(x)) return sign | inf;
    if (x == 0) return sign;
    int ex;
    frexp(x, &ex);
    int e = ex - 1; /* x = 1.f * 2^e */
    int emin = 1 - bias;
    double q;
    uint32_t bits;
    if (e < emin) {
        q = nearbyint(ldexp(x, mant - emin)); /* units of the subnormal step */
        bits = (uint32_t)q;                   /* q == 2^mant lands on the smallest normal */
    } else {
        q = nearbyint(ldexp(x, mant - e));
        if (q >= ldexp(1.0, mant + 1)) {
            q /= 2;
            e++;
        }
        if (e + bias >= (1 << exp_bits) - 1) return sign | inf;
        bits = ((uint32_t)(e + bias) << mant) | ((uint32_t)q - (1u << mant));
    }
    return (uint16_t)(sign | bits);
}

uint16_t tu_f32_to_f16(float f) { return ref_round(f, 10, 15, 5); }
uint16_t tu_f32_to_bf16(float f) { return ref_round(f, 7, 127, 8); }

/* ---- patterns ---- */
float tu_pat(uint32_t tag, uint32_t layer, uint32_t pos, uint32_t elem, int is_v) {
    uint32_t h = tag * 2654435761u ^ (layer * 40503u + pos * 977u + elem * 131u + (uint32_t)is_v * 7919u);
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    return (float)(int32_t)(h % 4001u) / 64.0f - 31.0f; /* exact in f32, and in f16 (11 bits) */
}

int tu_write_pattern(pkv_cache *c, pkv_seq s, uint32_t start, uint32_t n, uint32_t tag) {
    pkv_config cfg;
    int rc = pkv_cache_config(c, &cfg);
    if (rc) return rc;
    uint32_t row = cfg.n_kv_heads * cfg.head_dim;
    int32_t *slots = malloc((n ? n : 1) * sizeof *slots);
    float *k = malloc(((size_t)n * row + 1) * sizeof *k), *v = malloc(((size_t)n * row + 1) * sizeof *v);
    /* the stored rows of one layer, for the round trip below */
    const size_t kb = cfg.n_kv_heads * pkv_dtype_row_bytes(cfg.k_dtype, cfg.head_dim),
                 vb = cfg.n_kv_heads * pkv_dtype_row_bytes(cfg.v_dtype, cfg.head_dim);
    uint8_t *ks = malloc(n * kb + 1), *vs = malloc(n * vb + 1);
    if (!slots || !k || !v) rc = PKV_ENOMEM;
    if (!rc) rc = pkv_seq_slots(c, s, start, n, slots);
    for (uint32_t l = 0; !rc && l < cfg.n_layers; l++) {
        for (uint32_t t = 0; t < n; t++)
            for (uint32_t e = 0; e < row; e++) {
                k[(size_t)t * row + e] = tu_pat(tag, l, start + t, e, 0);
                v[(size_t)t * row + e] = tu_pat(tag, l, start + t, e, 1);
            }
        /* odd layers by position, even ones by slot: both ways in every test that writes */
        rc = l % 2 ? pkv_seq_write_kv(c, s, l, start, n, k, v, PKV_DTYPE_F32)
                   : pkv_write_kv(c, l, slots, n, k, v, PKV_DTYPE_F32);
        /* half the writes by position: the rows as stored, out and back in too */
        if (!rc && l % 2 && (tag + start) % 2) {
            rc = ks && vs ? pkv_seq_read_stored(c, s, l, start, n, ks, vs) : PKV_ENOMEM;
            if (!rc) rc = pkv_seq_write_stored(c, s, l, start, n, ks, vs);
        }
    }
    free(ks);
    free(vs);
    free(slots);
    free(k);
    free(v);
    return rc;
}

long tu_cmp_pattern(pkv_cache *c, pkv_seq s, uint32_t start, uint32_t n, uint32_t tag) {
    pkv_config cfg;
    int rc = pkv_cache_config(c, &cfg);
    if (rc) return rc;
    uint32_t row = cfg.n_kv_heads * cfg.head_dim;
    float *k = malloc(((size_t)n * row + 1) * sizeof *k), *v = malloc(((size_t)n * row + 1) * sizeof *v);
    long bad = 0;
    if (!k || !v) bad = PKV_ENOMEM;
    for (uint32_t l = 0; bad >= 0 && l < cfg.n_layers; l++) {
        rc = pkv_seq_gather(c, s, l, start, n, k, v);
        if (rc) {
            bad = rc;
            break;
        }
        for (uint32_t t = 0; t < n; t++)
            for (uint32_t e = 0; e < row; e++) {
                bad += k[(size_t)t * row + e] != tu_pat(tag, l, start + t, e, 0);
                bad += v[(size_t)t * row + e] != tu_pat(tag, l, start + t, e, 1);
            }
    }
    free(k);
    free(v);
    return bad;
}
