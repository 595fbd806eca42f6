/* support_util.h: helpers every test links: a seeded RNG, a counting / fault-injecting
 * allocator hook, small-config builders and "the checker passes" / "stats unchanged" asserts. */
#ifndef PKV_SUPPORT_UTIL_H
#define PKV_SUPPORT_UTIL_H

#include "pkv.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* ---- RNG (splitmix64; the same seed gives the same stream on every platform) ---- */
typedef struct tu_rng {
    uint64_t s;
} tu_rng;
void tu_rng_seed(tu_rng *r, uint64_t seed);
uint64_t tu_rng_u64(tu_rng *r);
uint32_t tu_rng_below(tu_rng *r, uint32_t n); /* uniform in [0, n); n > 0 */
float tu_rng_float(tu_rng *r);                /* uniform in [-1, 1) */
bool tu_rng_chance(tu_rng *r, double p);      /* true with probability p */
/* Seed from the environment variable `name` (decimal) when set, else `dflt`. */
uint64_t tu_env_u64(const char *name, uint64_t dflt);

/* ---- allocator hook: counts calls and live bytes, fails the k-th call on request ----
 * Every pointer it hands out is recorded with its size so a free with the wrong size, a
 * double free or an unknown pointer is caught (recorded in n_bad_free). Thread-safe. */
typedef struct tu_alloc_state {
    long fail_at;        /* 0-based index of the alloc call to fail; -1 = never */
    long n_calls;        /* alloc calls so far (including the failed one) */
    long n_failed;       /* calls answered with NULL */
    long n_live;         /* allocations not yet freed */
    size_t live_bytes;   /* bytes not yet freed */
    size_t peak_bytes;
    long n_bad_free;     /* frees of unknown pointers or with the wrong size */
    long n_bad_align;    /* requests with an alignment that is not a power of two >= sizeof(void*) */
    /* options, set after tu_alloc_reset */
    size_t refuse_over;   /* requests over this many bytes are answered with NULL (0: none) */
    size_t first_refused; /* the size of the first request refuse_over refused */
    size_t pad;           /* bytes of 0x01 after each allocation, which the library never owns */
} tu_alloc_state;
void tu_alloc_reset(tu_alloc_state *st, long fail_at);
pkv_allocator tu_allocator(tu_alloc_state *st);

/* ---- configs ---- */
/* A small, deterministic config: prefix cache off, 1 attention thread, huge pages off. */
pkv_config tu_config(uint32_t n_blocks, uint32_t block_tokens, uint32_t n_layers, uint32_t n_kv_heads,
                     uint32_t head_dim, pkv_dtype dtype);
/* pkv_cache_create that must succeed (cmocka failure otherwise). */
pkv_cache *tu_create(const pkv_config *cfg);
pkv_seq tu_seq(pkv_cache *c);                           /* pkv_seq_create with no salt, must succeed */
void tu_tokens(int32_t *t, uint32_t n, int32_t first);  /* t[i] = first + i */
/* Appends n tokens (ids first..first+n-1), must succeed; slots_out may be NULL. */
void tu_append(pkv_cache *c, pkv_seq s, uint32_t n, int32_t first, int32_t *slots_out);
pkv_seq_info tu_info(pkv_cache *c, pkv_seq s);
pkv_stats tu_stats(pkv_cache *c);
/* Block table of s into out (cap entries); returns its length. */
uint32_t tu_table(pkv_cache *c, pkv_seq s, int32_t *out, uint32_t cap);

/* ---- assertions ---- */
void tu_assert_check_(pkv_cache *c, const char *file, int line);
#define TU_CHECK(c) tu_assert_check_((c), __FILE__, __LINE__)
/* Every field of two stats snapshots equal (names the first differing field). */
void tu_assert_stats_eq_(const pkv_stats *a, const pkv_stats *b, const char *file, int line);
#define TU_STATS_EQ(a, b) tu_assert_stats_eq_((a), (b), __FILE__, __LINE__)
/* Status equality with both codes named on failure. */
void tu_assert_rc_(int got, int want, const char *expr, const char *file, int line);
#define TU_RC(expr, want) tu_assert_rc_((expr), (want), #expr, __FILE__, __LINE__)
#define TU_OK(expr) tu_assert_rc_((expr), PKV_OK, #expr, __FILE__, __LINE__)

/* ---- independent reference conversions (not the library's) for oracle checks ---- */
float tu_f16_to_f32(uint16_t h);
float tu_bf16_to_f32(uint16_t b);
/* Round-to-nearest-even f32 -> f16 / bf16 for finite inputs in range, via double arithmetic. */
uint16_t tu_f32_to_f16(float f);
uint16_t tu_f32_to_bf16(float f);

/* ---- K/V patterns: exact f32 values that depend on (tag, layer, position, element, K/V) ----
 * Usable from any thread (no cmocka calls): they return statuses / mismatch counts. */
float tu_pat(uint32_t tag, uint32_t layer, uint32_t pos, uint32_t elem, int is_v);
/* Writes the pattern `tag` for positions [start, start + n) of s, every layer (f32 input): even
 * layers through pkv_seq_slots and pkv_write_kv, odd ones through pkv_seq_write_kv. */
int tu_write_pattern(pkv_cache *c, pkv_seq s, uint32_t start, uint32_t n, uint32_t tag);
/* Gathers [start, start + n) of every layer; returns the number of elements differing from
 * pattern `tag`, or a negative status. */
long tu_cmp_pattern(pkv_cache *c, pkv_seq s, uint32_t start, uint32_t n, uint32_t tag);
#define TU_WRITE_PAT(c, s, start, n, tag) TU_OK(tu_write_pattern((c), (s), (start), (n), (tag)))
#define TU_SAME_PAT(c, s, start, n, tag) assert_int_equal(tu_cmp_pattern((c), (s), (start), (n), (tag)), 0)

#endif
