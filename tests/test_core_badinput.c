/* test_core_badinput.c: every public function of pkv.h called with each kind of bad argument
 * (NULL cache / out pointers / buffers, stale, forged and zero ids, pins where sequences are
 * expected, layer / slot / range out of bounds, slots in free, shared, committed or indexed
 * blocks, bad dtypes, sizes past the limits, bad config fields one by one). Each row checks
 * the exact status, then that the checker passes and nothing observable changed. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include "support_util.h"

#include <float.h>
#include <stdio.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { NB = 16, BT = 4, NL = 2, NH = 2, HD = 8 };

/* The log hook's record: how many messages of each level, and the last error. */
typedef struct {
    int n[4];
    char last_error[512];
} cfg_log;

static void cfg_log_fn(void *ctx, int level, const char *msg) {
    cfg_log *l = ctx;
    assert_true(level >= PKV_LOG_ERROR && level <= PKV_LOG_DEBUG);
    l->n[level]++;
    if (level == PKV_LOG_ERROR) snprintf(l->last_error, sizeof l->last_error, "%s", msg);
}

typedef struct fx {
    pkv_cache *c;
    pkv_seq live;    /* 10 tokens, written, committed 8 (2 full blocks indexed) */
    pkv_seq parent;  /* 6 tokens, written, forked into child: both share 2 blocks */
    pkv_seq child;
    pkv_seq empty;   /* length 0 */
    pkv_seq part;    /* 3 tokens in one block of its own, committed 2 (a partial block: not indexed) */
    pkv_seq stale;   /* released */
    pkv_seq forged;  /* live's index with another generation */
    pkv_seq foreign; /* a live sequence of another cache, at live's index */
    pkv_cache *other; /* foreign's cache */
    pkv_seq out_of_range; /* index >= max_seqs */
    pkv_seq pin;     /* a pin of live */
    int32_t free_slot;      /* a slot in a FREE block */
    int32_t cached_slot;    /* a slot in a CACHED block (indexed, refcount 0) */
    int32_t shared_slot;    /* an uncommitted position of a shared block */
    int32_t committed_slot; /* a committed position of live's own tail */
    int32_t live_slot;      /* a valid slot: live position 9 (uncommitted, own, unindexed) */
    int32_t tok[64];
    float kv[64 * NH * HD];
    float out[64 * NH * HD];
    int32_t ibuf[256];
    pkv_seq list[4];
    cfg_log said; /* f->c's log hook, during a row */
} fx;

static pkv_seq all_ids(const fx *f, int i) {
    const pkv_seq ids[] = {f->live, f->parent, f->child, f->empty};
    return ids[i];
}

static int setup(void **state) {
    fx *f = calloc(1, sizeof *f);
    pkv_config cfg = tu_config(NB, BT, NL, NH, HD, PKV_DTYPE_F32);
    cfg.enable_prefix_cache = 1;
    cfg.max_seqs = 8;
    cfg.log = cfg_log_fn;
    cfg.log_ctx = &f->said;
    f->c = tu_create(&cfg);
    pkv_cache *c = f->c;
    tu_tokens(f->tok, 64, 1000);
    /* a released sequence with committed blocks: they stay indexed as CACHED */
    pkv_seq gone = tu_seq(c);
    tu_append(c, gone, 4, 5000, NULL);
    TU_WRITE_PAT(c, gone, 0, 4, 99);
    TU_OK(pkv_seq_commit(c, gone, 4));
    int32_t gone_tab[1];
    tu_table(c, gone, gone_tab, 1);
    TU_OK(pkv_seq_release(c, gone));
    f->cached_slot = gone_tab[0] * BT + 1;
    assert_int_equal(tu_stats(c).n_cached, 1);

    f->live = tu_seq(c);
    tu_append(c, f->live, 10, 0, NULL);
    TU_WRITE_PAT(c, f->live, 0, 9, 1);
    TU_OK(pkv_seq_commit(c, f->live, 8));
    TU_OK(pkv_seq_slots(c, f->live, 9, 1, &f->live_slot));
    TU_OK(pkv_seq_slots(c, f->live, 7, 1, &f->committed_slot));
    f->parent = tu_seq(c);
    tu_append(c, f->parent, 6, 100, NULL);
    TU_WRITE_PAT(c, f->parent, 0, 6, 2);
    TU_OK(pkv_seq_fork(c, f->parent, &f->child));
    TU_OK(pkv_seq_slots(c, f->parent, 5, 1, &f->shared_slot));
    f->empty = tu_seq(c);
    f->part = tu_seq(c);
    tu_append(c, f->part, 3, 200, NULL);
    TU_WRITE_PAT(c, f->part, 0, 3, 3);
    TU_OK(pkv_seq_commit(c, f->part, 2));
    f->stale = tu_seq(c);
    TU_OK(pkv_seq_release(c, f->stale));
    f->forged = f->live ^ (7ull << 32);
    /* another cache with a live sequence at live's index and as many generations past its first
       (gone was c's first): each cache's generations start far from the others', so its handles
       are refused here */
    f->other = tu_create(&cfg);
    f->foreign = tu_seq(f->other);
    const uint32_t first_gen = (uint32_t)(f->foreign >> 32);
    while ((f->foreign & 0xffffffffu) != (f->live & 0xffffffffu) ||
           (uint32_t)(f->foreign >> 32) - first_gen != (uint32_t)(f->live >> 32) - (uint32_t)(gone >> 32)) {
        if ((f->foreign & 0xffffffffu) == (f->live & 0xffffffffu))
            TU_OK(pkv_seq_release(f->other, f->foreign)); /* its slot again, one generation on */
        f->foreign = tu_seq(f->other);
    }
    f->out_of_range = (f->live & ~0xffffffffull) | 0x00ffffffu;
    TU_OK(pkv_pin_create(c, f->live, 8, &f->pin));
    /* a FREE block: the last one of the FIFO queue is never handed out here */
    f->free_slot = (NB - 1) * BT + 2;
    pkv_stats st = tu_stats(c);
    assert_true(st.n_free > 0 && st.n_cached == 1);
    for (int i = 0; i < 64 * NH * HD; i++) f->kv[i] = (float)i;
    TU_CHECK(c);
    *state = f;
    return 0;
}

static int teardown(void **state) {
    fx *f = *state;
    pkv_cache_destroy(f->c);
    pkv_cache_destroy(f->other);
    free(f);
    return 0;
}

/* A row: name, expected status, the call (f is the fixture). */
/* A decode of the live sequence with n_q_heads query heads, on buffers of their size (so no
 * overlap of q and out can be what refuses it). */
static int decode_q_heads(fx *f, uint32_t n_q_heads) {
    pkv_attn_params p = pkv_attn_params_default();
    p.n_q_heads = n_q_heads;
    float *q = calloc((size_t)n_q_heads * HD, sizeof(float)), *out = calloc((size_t)n_q_heads * HD, sizeof(float));
    const int rc = q && out ? pkv_attn_decode(f->c, 0, &f->live, 1, q, out, &p) : PKV_ENOMEM;
    free(q);
    free(out);
    return rc;
}

/* fx's K/V rows (one token: NH x HD floats) with element at set to x, written at slots (n of
 * them, live's own uncommitted positions 8 and 9, or padding), K or V. */
static int write_with(fx *f, uint32_t n, const int32_t *slots, int v_side, uint32_t at, float x) {
    float b[2 * NH * HD];
    memcpy(b, f->kv, sizeof b);
    b[at] = x;
    return pkv_write_kv(f->c, 0, slots, n, v_side ? f->kv : b, v_side ? b : f->kv, PKV_DTYPE_F32);
}

/* A one-token write of 16-bit input (f16 or bf16 codes) with code at element 5. */
static int write16_with(fx *f, pkv_dtype in, uint16_t code) {
    uint16_t b[NH * HD];
    for (int i = 0; i < NH * HD; i++) b[i] = in == PKV_DTYPE_F16 ? 0x3c00 : 0x3f80; /* 1.0 */
    b[5] = code;
    return pkv_write_kv(f->c, 0, &f->live_slot, 1, b, b, in);
}

/* pkv_seq_write_kv of live's positions 8 and 9 (uncommitted, its own) with element at of the
 * two rows set to x, K or V (v_side); in f16 codes when code is non-zero (element at = code). */
static int seqwrite_with(fx *f, int v_side, uint32_t at, float x, uint16_t code) {
    float b[2 * NH * HD];
    uint16_t h[2 * NH * HD];
    memcpy(b, f->kv, sizeof b);
    b[at] = x;
    for (int i = 0; i < 2 * NH * HD; i++) h[i] = 0x3c00;
    h[at] = code;
    if (code) return pkv_seq_write_kv(f->c, f->live, 1, 8, 2, v_side ? NULL : h, v_side ? h : NULL, PKV_DTYPE_F16);
    return pkv_seq_write_kv(f->c, f->live, 1, 8, 2, v_side ? f->kv : b, v_side ? b : f->kv, PKV_DTYPE_F32);
}

/* pkv_seq_write_kv of part's uncommitted position 2, layer 1, with the K/V it holds: accepted,
 * and nothing observable changes. */
static int seqwrite_same(fx *f) {
    float k[NH * HD], v[NH * HD];
    const int rc = pkv_seq_gather(f->c, f->part, 1, 2, 1, k, v);
    return rc ? rc : pkv_seq_write_kv(f->c, f->part, 1, 2, 1, k, v, PKV_DTYPE_F32);
}

/* pkv_seq_write_stored of live's positions 8 and 9 (f32 rows: the fixture's pool) with element
 * at of the two rows set to x, K or V (v_side). */
static int storedwrite_with(fx *f, int v_side, uint32_t at, float x) {
    float b[2 * NH * HD];
    memcpy(b, f->kv, sizeof b);
    b[at] = x;
    return pkv_seq_write_stored(f->c, f->live, 1, 8, 2, v_side ? f->kv : b, v_side ? b : f->kv);
}

/* pkv_seq_write_stored of part's uncommitted position 2, layer 1, with the rows it holds (read
 * by pkv_seq_read_stored): accepted, and nothing observable changes. */
static int storedwrite_same(fx *f) {
    float k[NH * HD], v[NH * HD];
    const int rc = pkv_seq_read_stored(f->c, f->part, 1, 2, 1, k, v);
    return rc ? rc : pkv_seq_write_stored(f->c, f->part, 1, 2, 1, k, v);
}

/* A decode (or, with two queries, a prefill of live's positions 8 and 9) whose query element at
 * is x. */
static int attn_q_with(fx *f, int prefill, uint32_t at, float x) {
    float q[2 * NH * HD];
    for (int i = 0; i < 2 * NH * HD; i++) q[i] = 0.125f * (float)(i % 5);
    q[at] = x;
    const pkv_attn_req r = {f->live, 8, 2};
    return prefill ? pkv_attn_prefill(f->c, 0, &r, 1, q, f->out, NULL) : pkv_attn_decode(f->c, 0, &f->live, 1, q, f->out, NULL);
}

/* A decode of live whose query elements are all x, at the given scale. */
static int attn_q_scaled(fx *f, float x, float scale) {
    float q[NH * HD];
    for (int i = 0; i < NH * HD; i++) q[i] = i % 2 ? x : -x;
    pkv_attn_params p = pkv_attn_params_default();
    p.scale = scale;
    return pkv_attn_decode(f->c, 0, &f->live, 1, q, f->out, &p);
}

/* A batch append of one token to live, then n tokens (tokens tok, NULL where tok is) to s. */
static int batch_with(fx *f, pkv_seq s, const int32_t *tok, uint32_t n, uint32_t flags, uint32_t *done) {
    const pkv_append_req r[2] = {{f->live, f->tok, 1, NULL}, {s, tok, n, NULL}};
    return pkv_batch_append(f->c, r, 2, flags, done);
}

#define ROWS(X)                                                                                                       \
    /* dtype helpers */                                                                                               \
    X(dtype_from_name_null_name, PKV_EINVAL, ({ pkv_dtype d; pkv_dtype_from_name(NULL, &d); }))                       \
    X(dtype_from_name_null_out, PKV_EINVAL, pkv_dtype_from_name("f16", NULL))                                         \
    X(dtype_from_name_unknown, PKV_EINVAL, ({ pkv_dtype d; pkv_dtype_from_name("f17", &d); }))                       \
    X(dtype_from_name_empty, PKV_EINVAL, ({ pkv_dtype d; pkv_dtype_from_name("", &d); }))                            \
    /* cache-level */                                                                                                 \
    X(create_null_cfg, PKV_EINVAL, ({ pkv_cache *x = NULL; pkv_cache_create(NULL, &x); }))                           \
    X(create_null_out, PKV_EINVAL, ({ pkv_config cf = pkv_config_default(); pkv_cache_create(&cf, NULL); }))         \
    X(reset_null, PKV_EINVAL, pkv_cache_reset(NULL))                                                                  \
    X(config_null_cache, PKV_EINVAL, ({ pkv_config cf; pkv_cache_config(NULL, &cf); }))                             \
    X(config_null_out, PKV_EINVAL, pkv_cache_config(f->c, NULL))                                                      \
    X(layout_null_cache, PKV_EINVAL, ({ pkv_layout L; pkv_cache_layout(NULL, &L); }))                               \
    X(layout_null_out, PKV_EINVAL, pkv_cache_layout(f->c, NULL))                                                      \
    X(stats_null_cache, PKV_EINVAL, ({ pkv_stats s; pkv_cache_get_stats(NULL, &s); }))                              \
    X(stats_null_out, PKV_EINVAL, pkv_cache_get_stats(f->c, NULL))                                                    \
    X(check_null_cache, PKV_EINVAL, ({ char m[64]; pkv_cache_check(NULL, m, sizeof m); }))                          \
    X(check_null_msg_ok, PKV_OK, pkv_cache_check(f->c, NULL, 0))                                                      \
    X(check_tiny_msg_ok, PKV_OK, ({ char m[1]; pkv_cache_check(f->c, m, 1); }))                                     \
    /* seq_create */                                                                                                  \
    X(seq_create_null_cache, PKV_EINVAL, ({ pkv_seq s; pkv_seq_create(NULL, NULL, 0, &s); }))                       \
    X(seq_create_null_out, PKV_EINVAL, pkv_seq_create(f->c, NULL, 0, NULL))                                           \
    X(seq_create_null_salt, PKV_EINVAL, ({ pkv_seq s; pkv_seq_create(f->c, NULL, 4, &s); }))                        \
    X(seq_create_salt_too_long, PKV_EINVAL, ({ pkv_seq s; char salt[257] = {0}; pkv_seq_create(f->c, salt, 257, &s); })) \
    /* append */                                                                                                      \
    X(append_null_cache, PKV_EINVAL, pkv_seq_append(NULL, f->live, f->tok, 1, NULL))                                  \
    X(append_null_tokens, PKV_EINVAL, pkv_seq_append(f->c, f->live, NULL, 1, NULL))                                   \
    X(append_stale, PKV_ENOENT, pkv_seq_append(f->c, f->stale, f->tok, 1, NULL))                                      \
    X(append_forged, PKV_ENOENT, pkv_seq_append(f->c, f->forged, f->tok, 1, NULL))                                    \
    X(append_foreign, PKV_ENOENT, pkv_seq_append(f->c, f->foreign, f->tok, 1, NULL))                                  \
    X(append_id0, PKV_ENOENT, pkv_seq_append(f->c, 0, f->tok, 1, NULL))                                               \
    X(append_index_out_of_range, PKV_ENOENT, pkv_seq_append(f->c, f->out_of_range, f->tok, 1, NULL))                  \
    X(append_pin, PKV_EINVAL, pkv_seq_append(f->c, f->pin, f->tok, 1, NULL))                                          \
    X(append_past_table, PKV_ELIMIT, pkv_seq_append(f->c, f->empty, f->tok, NB * BT + 1, NULL))                       \
    X(append_u32_max, PKV_ELIMIT, pkv_seq_append(f->c, f->live, f->tok, UINT32_MAX, NULL))                            \
    X(append_no_space, PKV_ENOSPC, pkv_seq_append(f->c, f->empty, f->tok, 60, NULL))                                  \
    X(append_blocks_null_cache, PKV_EINVAL, ({ uint32_t n; pkv_seq_append_blocks(NULL, f->live, 1, &n); }))           \
    X(append_blocks_null_out, PKV_EINVAL, pkv_seq_append_blocks(f->c, f->live, 1, NULL))                              \
    X(append_blocks_stale, PKV_ENOENT, ({ uint32_t n; pkv_seq_append_blocks(f->c, f->stale, 1, &n); }))               \
    X(append_blocks_forged, PKV_ENOENT, ({ uint32_t n; pkv_seq_append_blocks(f->c, f->forged, 1, &n); }))             \
    X(append_blocks_foreign, PKV_ENOENT, ({ uint32_t n; pkv_seq_append_blocks(f->c, f->foreign, 1, &n); }))           \
    X(append_blocks_pin, PKV_EINVAL, ({ uint32_t n; pkv_seq_append_blocks(f->c, f->pin, 1, &n); }))                   \
    X(append_blocks_past_table, PKV_ELIMIT, ({ uint32_t n; pkv_seq_append_blocks(f->c, f->empty, NB * BT + 1, &n); }))\
    X(append_blocks_u32_max, PKV_ELIMIT, ({ uint32_t n; pkv_seq_append_blocks(f->c, f->live, UINT32_MAX, &n); }))     \
    X(batch_append_null_cache, PKV_EINVAL, ({ pkv_append_req r = {f->live, f->tok, 1, NULL}; pkv_batch_append(NULL, &r, 1, 0, NULL); }))\
    X(batch_append_null_reqs, PKV_EINVAL, pkv_batch_append(f->c, NULL, 1, 0, NULL))                                   \
    X(batch_append_null_tokens, PKV_EINVAL, batch_with(f, f->empty, NULL, 1, 0, NULL))                                \
    X(batch_append_unknown_flags, PKV_EINVAL, ({ uint32_t d; batch_with(f, f->empty, f->tok, 1, 2, &d); }))           \
    X(batch_append_fit_null_done, PKV_EINVAL, batch_with(f, f->empty, f->tok, 1, PKV_APPEND_FIT, NULL))               \
    X(batch_append_stale, PKV_ENOENT, batch_with(f, f->stale, f->tok, 1, 0, NULL))                                    \
    X(batch_append_forged, PKV_ENOENT, batch_with(f, f->forged, f->tok, 1, 0, NULL))                                  \
    X(batch_append_foreign, PKV_ENOENT, batch_with(f, f->foreign, f->tok, 1, 0, NULL))                                \
    X(batch_append_pin, PKV_EINVAL, batch_with(f, f->pin, f->tok, 1, 0, NULL))                                        \
    X(batch_append_twice, PKV_EINVAL, batch_with(f, f->live, f->tok, 1, 0, NULL))                                     \
    X(batch_append_past_table, PKV_ELIMIT, ({ uint32_t d; batch_with(f, f->empty, f->tok, NB * BT + 1, PKV_APPEND_FIT, &d); }))\
    X(batch_append_no_space, PKV_ENOSPC, batch_with(f, f->empty, f->tok, 60, 0, NULL))                                \
    /* write_kv */                                                                                                    \
    X(write_null_cache, PKV_EINVAL, pkv_write_kv(NULL, 0, &f->live_slot, 1, f->kv, f->kv, PKV_DTYPE_F32))             \
    X(write_layer_out_of_range, PKV_EINVAL, pkv_write_kv(f->c, NL, &f->live_slot, 1, f->kv, f->kv, PKV_DTYPE_F32))    \
    X(write_layer_huge, PKV_EINVAL, pkv_write_kv(f->c, UINT32_MAX, &f->live_slot, 1, f->kv, f->kv, PKV_DTYPE_F32))   \
    X(write_null_slots, PKV_EINVAL, pkv_write_kv(f->c, 0, NULL, 1, f->kv, f->kv, PKV_DTYPE_F32))                      \
    X(write_null_k_and_v, PKV_EINVAL, pkv_write_kv(f->c, 0, &f->live_slot, 1, NULL, NULL, PKV_DTYPE_F32))             \
    X(write_dtype_q8, PKV_EINVAL, pkv_write_kv(f->c, 0, &f->live_slot, 1, f->kv, f->kv, PKV_DTYPE_Q8_0))              \
    X(write_dtype_fp8, PKV_EINVAL, pkv_write_kv(f->c, 0, &f->live_slot, 1, f->kv, f->kv, PKV_DTYPE_FP8_E4M3))         \
    X(write_dtype_99, PKV_EINVAL, pkv_write_kv(f->c, 0, &f->live_slot, 1, f->kv, f->kv, (pkv_dtype)99))               \
    X(write_dtype_neg, PKV_EINVAL, pkv_write_kv(f->c, 0, &f->live_slot, 1, f->kv, f->kv, (pkv_dtype)-1))              \
    X(write_slot_past_pool, PKV_EINVAL, ({ int32_t s = NB * BT; pkv_write_kv(f->c, 0, &s, 1, f->kv, f->kv, PKV_DTYPE_F32); })) \
    X(write_slot_int_max, PKV_EINVAL, ({ int32_t s = INT32_MAX; pkv_write_kv(f->c, 0, &s, 1, f->kv, f->kv, PKV_DTYPE_F32); })) \
    X(write_slot_minus2, PKV_EINVAL, ({ int32_t s = -2; pkv_write_kv(f->c, 0, &s, 1, f->kv, f->kv, PKV_DTYPE_F32); })) \
    X(write_slot_int_min, PKV_EINVAL, ({ int32_t s = INT32_MIN; pkv_write_kv(f->c, 0, &s, 1, f->kv, f->kv, PKV_DTYPE_F32); })) \
    X(write_slot_free_block, PKV_EINVAL, pkv_write_kv(f->c, 0, &f->free_slot, 1, f->kv, f->kv, PKV_DTYPE_F32))        \
    X(write_slot_cached_block, PKV_EINVAL, pkv_write_kv(f->c, 0, &f->cached_slot, 1, f->kv, f->kv, PKV_DTYPE_F32))    \
    X(write_slot_shared_block, PKV_EINVAL, pkv_write_kv(f->c, 0, &f->shared_slot, 1, f->kv, f->kv, PKV_DTYPE_F32))    \
    X(write_slot_committed, PKV_EINVAL, pkv_write_kv(f->c, 0, &f->committed_slot, 1, f->kv, f->kv, PKV_DTYPE_F32))    \
    X(write_slot_committed_own, PKV_EINVAL, ({ int32_t s; pkv_seq_slots(f->c, f->part, 1, 1, &s) ? -100 :             \
                                               pkv_write_kv(f->c, 0, &s, 1, f->kv, f->kv, PKV_DTYPE_F32); }))        \
    X(write_one_bad_among_good, PKV_EINVAL, ({ int32_t s[3] = {f->live_slot, -1, f->shared_slot};                     \
                                              pkv_write_kv(f->c, 1, s, 3, f->kv, f->kv, PKV_DTYPE_F32); }))          \
    X(write_pinned_block, PKV_EINVAL, ({ int32_t s; pkv_seq_slots(f->c, f->live, 3, 1, &s) ? -100 :                  \
                                         pkv_write_kv(f->c, 0, &s, 1, f->kv, NULL, PKV_DTYPE_F32); }))               \
    /* values that are not finite: refused before a byte is written (padding rows are not read) */                   \
    X(write_nan_k, PKV_EINVAL, write_with(f, 1, &f->live_slot, 0, 3, NAN))                                             \
    X(write_inf_v, PKV_EINVAL, write_with(f, 1, &f->live_slot, 1, NH * HD - 1, INFINITY))                             \
    X(write_neg_inf_k, PKV_EINVAL, write_with(f, 1, &f->live_slot, 0, 0, -INFINITY))                                  \
    /* finite, but past PKV_VALUE_MAX (2^56), where attention's sums could overflow */                                \
    X(write_past_value_max_k, PKV_EINVAL, write_with(f, 1, &f->live_slot, 0, 3, 0x1.000002p56f))                      \
    X(write_neg_flt_max_v, PKV_EINVAL, write_with(f, 1, &f->live_slot, 1, 2, -FLT_MAX))                               \
    X(write_nan_second_row, PKV_EINVAL, ({ int32_t s[2] = {-1, -1}; pkv_seq_slots(f->c, f->live, 8, 2, s) ? -100 :    \
                                           write_with(f, 2, s, 1, NH * HD + 7, -NAN); }))                            \
    X(write_f16_nan_code, PKV_EINVAL, write16_with(f, PKV_DTYPE_F16, 0x7e00))                                         \
    X(write_f16_inf_code, PKV_EINVAL, write16_with(f, PKV_DTYPE_F16, 0xfc00))                                         \
    X(write_bf16_nan_code, PKV_EINVAL, write16_with(f, PKV_DTYPE_BF16, 0x7fc1))                                       \
    X(write_bf16_inf_code, PKV_EINVAL, write16_with(f, PKV_DTYPE_BF16, 0x7f80))                                       \
    /* seq_write_kv: positions of a sequence */                                                                       \
    X(seqwrite_null_cache, PKV_EINVAL, pkv_seq_write_kv(NULL, f->live, 0, 8, 1, f->kv, f->kv, PKV_DTYPE_F32))         \
    X(seqwrite_null_k_and_v, PKV_EINVAL, pkv_seq_write_kv(f->c, f->live, 0, 8, 1, NULL, NULL, PKV_DTYPE_F32))         \
    X(seqwrite_layer, PKV_EINVAL, pkv_seq_write_kv(f->c, f->live, NL, 8, 1, f->kv, f->kv, PKV_DTYPE_F32))             \
    X(seqwrite_dtype_q8, PKV_EINVAL, pkv_seq_write_kv(f->c, f->live, 0, 8, 1, f->kv, f->kv, PKV_DTYPE_Q8_0))          \
    X(seqwrite_dtype_99, PKV_EINVAL, pkv_seq_write_kv(f->c, f->live, 0, 8, 1, f->kv, f->kv, (pkv_dtype)99))           \
    X(seqwrite_stale, PKV_ENOENT, pkv_seq_write_kv(f->c, f->stale, 0, 0, 0, f->kv, f->kv, PKV_DTYPE_F32))             \
    X(seqwrite_forged, PKV_ENOENT, pkv_seq_write_kv(f->c, f->forged, 0, 8, 1, f->kv, f->kv, PKV_DTYPE_F32))           \
    X(seqwrite_foreign, PKV_ENOENT, pkv_seq_write_kv(f->c, f->foreign, 0, 8, 1, f->kv, f->kv, PKV_DTYPE_F32))         \
    X(seqwrite_id0, PKV_ENOENT, pkv_seq_write_kv(f->c, 0, 0, 0, 0, f->kv, f->kv, PKV_DTYPE_F32))                      \
    X(seqwrite_out_of_range, PKV_ENOENT, pkv_seq_write_kv(f->c, f->out_of_range, 0, 0, 0, f->kv, f->kv, PKV_DTYPE_F32)) \
    X(seqwrite_pin, PKV_EINVAL, pkv_seq_write_kv(f->c, f->pin, 0, 0, 1, f->kv, f->kv, PKV_DTYPE_F32))                 \
    X(seqwrite_past_length, PKV_EINVAL, pkv_seq_write_kv(f->c, f->live, 0, 9, 2, f->kv, f->kv, PKV_DTYPE_F32))        \
    X(seqwrite_start_past_length, PKV_EINVAL, pkv_seq_write_kv(f->c, f->live, 0, 11, 0, f->kv, f->kv, PKV_DTYPE_F32)) \
    X(seqwrite_empty_seq, PKV_EINVAL, pkv_seq_write_kv(f->c, f->empty, 0, 0, 1, f->kv, f->kv, PKV_DTYPE_F32))         \
    X(seqwrite_overflow, PKV_EINVAL, pkv_seq_write_kv(f->c, f->live, 0, UINT32_MAX, 2, f->kv, f->kv, PKV_DTYPE_F32))  \
    X(seqwrite_committed_first, PKV_EINVAL, pkv_seq_write_kv(f->c, f->live, 0, 7, 3, f->kv, f->kv, PKV_DTYPE_F32))    \
    X(seqwrite_indexed_pinned, PKV_EINVAL, pkv_seq_write_kv(f->c, f->live, 1, 3, 1, f->kv, NULL, PKV_DTYPE_F32))      \
    X(seqwrite_committed_own, PKV_EINVAL, pkv_seq_write_kv(f->c, f->part, 0, 1, 2, f->kv, f->kv, PKV_DTYPE_F32))      \
    X(seqwrite_uncommitted_own_ok, PKV_OK, seqwrite_same(f))                                                         \
    X(seqwrite_shared_fork, PKV_EINVAL, pkv_seq_write_kv(f->c, f->child, 0, 4, 2, f->kv, f->kv, PKV_DTYPE_F32))       \
    X(seqwrite_shared_parent, PKV_EINVAL, pkv_seq_write_kv(f->c, f->parent, 1, 5, 1, NULL, f->kv, PKV_DTYPE_F32))     \
    X(seqwrite_nan_second_row_k, PKV_EINVAL, seqwrite_with(f, 0, NH * HD + 3, NAN, 0))                                \
    X(seqwrite_past_value_max_v, PKV_EINVAL, seqwrite_with(f, 1, 1, -0x1.000002p56f, 0))                              \
    X(seqwrite_f16_inf_code_v, PKV_EINVAL, seqwrite_with(f, 1, NH * HD + 1, 0, 0x7c00))                               \
    X(seqwrite_zero_rows, PKV_OK, pkv_seq_write_kv(f->c, f->empty, 0, 0, 0, f->kv, NULL, PKV_DTYPE_F32))              \
    /* seq_write_stored: the pool's own rows, by position */                                                          \
    X(storedw_null_cache, PKV_EINVAL, pkv_seq_write_stored(NULL, f->live, 0, 8, 1, f->kv, f->kv))                     \
    X(storedw_null_k_and_v, PKV_EINVAL, pkv_seq_write_stored(f->c, f->live, 0, 8, 1, NULL, NULL))                     \
    X(storedw_layer, PKV_EINVAL, pkv_seq_write_stored(f->c, f->live, NL, 8, 1, f->kv, f->kv))                         \
    X(storedw_stale, PKV_ENOENT, pkv_seq_write_stored(f->c, f->stale, 0, 0, 0, f->kv, f->kv))                         \
    X(storedw_forged, PKV_ENOENT, pkv_seq_write_stored(f->c, f->forged, 0, 8, 1, f->kv, f->kv))                       \
    X(storedw_foreign, PKV_ENOENT, pkv_seq_write_stored(f->c, f->foreign, 0, 8, 1, f->kv, f->kv))                     \
    X(storedw_pin, PKV_EINVAL, pkv_seq_write_stored(f->c, f->pin, 0, 0, 1, f->kv, f->kv))                             \
    X(storedw_past_length, PKV_EINVAL, pkv_seq_write_stored(f->c, f->live, 0, 9, 2, f->kv, f->kv))                    \
    X(storedw_overflow, PKV_EINVAL, pkv_seq_write_stored(f->c, f->live, 0, UINT32_MAX, 2, f->kv, f->kv))              \
    X(storedw_committed_first, PKV_EINVAL, pkv_seq_write_stored(f->c, f->live, 0, 7, 3, f->kv, f->kv))                \
    X(storedw_indexed_pinned, PKV_EINVAL, pkv_seq_write_stored(f->c, f->live, 1, 3, 1, f->kv, NULL))                  \
    X(storedw_shared_fork, PKV_EINVAL, pkv_seq_write_stored(f->c, f->child, 0, 4, 2, f->kv, f->kv))                   \
    X(storedw_nan_second_row_k, PKV_EINVAL, storedwrite_with(f, 0, NH * HD + 3, NAN))                                 \
    X(storedw_inf_v, PKV_EINVAL, storedwrite_with(f, 1, 2, -INFINITY))                                                \
    X(storedw_past_value_max_v, PKV_EINVAL, storedwrite_with(f, 1, 1, 0x1.000002p56f))                                \
    X(storedw_uncommitted_own_ok, PKV_OK, storedwrite_same(f))                                                        \
    X(storedw_zero_rows, PKV_OK, pkv_seq_write_stored(f->c, f->empty, 0, 0, 0, f->kv, NULL))                          \
    /* commit */                                                                                                      \
    X(commit_null_cache, PKV_EINVAL, pkv_seq_commit(NULL, f->live, 9))                                                \
    X(commit_stale, PKV_ENOENT, pkv_seq_commit(f->c, f->stale, 0))                                                    \
    X(commit_forged, PKV_ENOENT, pkv_seq_commit(f->c, f->forged, 9))                                                  \
    X(commit_foreign, PKV_ENOENT, pkv_seq_commit(f->c, f->foreign, 9))                                                \
    X(commit_id0, PKV_ENOENT, pkv_seq_commit(f->c, 0, 0))                                                             \
    X(commit_pin, PKV_EINVAL, pkv_seq_commit(f->c, f->pin, 0))                                                        \
    X(commit_past_length, PKV_EINVAL, pkv_seq_commit(f->c, f->live, 11))                                              \
    X(commit_u32_max, PKV_EINVAL, pkv_seq_commit(f->c, f->live, UINT32_MAX))                                          \
    /* fork */                                                                                                        \
    X(fork_null_cache, PKV_EINVAL, ({ pkv_seq s; pkv_seq_fork(NULL, f->live, &s); }))                               \
    X(fork_null_out, PKV_EINVAL, pkv_seq_fork(f->c, f->live, NULL))                                                   \
    X(fork_stale, PKV_ENOENT, ({ pkv_seq s; pkv_seq_fork(f->c, f->stale, &s); }))                                   \
    X(fork_forged, PKV_ENOENT, ({ pkv_seq s; pkv_seq_fork(f->c, f->forged, &s); }))                                 \
    X(fork_foreign, PKV_ENOENT, ({ pkv_seq s; pkv_seq_fork(f->c, f->foreign, &s); }))                               \
    X(fork_id0, PKV_ENOENT, ({ pkv_seq s; pkv_seq_fork(f->c, 0, &s); }))                                            \
    X(fork_out_of_range, PKV_ENOENT, ({ pkv_seq s; pkv_seq_fork(f->c, f->out_of_range, &s); }))                     \
    X(fork_pin, PKV_EINVAL, ({ pkv_seq s; pkv_seq_fork(f->c, f->pin, &s); }))                                       \
    /* truncate */                                                                                                    \
    X(truncate_null_cache, PKV_EINVAL, pkv_seq_truncate(NULL, f->live, 0))                                            \
    X(truncate_stale, PKV_ENOENT, pkv_seq_truncate(f->c, f->stale, 0))                                                \
    X(truncate_forged, PKV_ENOENT, pkv_seq_truncate(f->c, f->forged, 0))                                              \
    X(truncate_foreign, PKV_ENOENT, pkv_seq_truncate(f->c, f->foreign, 0))                                            \
    X(truncate_id0, PKV_ENOENT, pkv_seq_truncate(f->c, 0, 0))                                                         \
    X(truncate_pin, PKV_EINVAL, pkv_seq_truncate(f->c, f->pin, 0))                                                    \
    X(truncate_past_length_noop, PKV_OK, pkv_seq_truncate(f->c, f->live, UINT32_MAX))                                 \
    X(drop_front_null_cache, PKV_EINVAL, pkv_seq_drop_front(NULL, f->live, 4))                                        \
    X(drop_front_stale, PKV_ENOENT, pkv_seq_drop_front(f->c, f->stale, 4))                                            \
    X(drop_front_forged, PKV_ENOENT, pkv_seq_drop_front(f->c, f->forged, 4))                                          \
    X(drop_front_foreign, PKV_ENOENT, pkv_seq_drop_front(f->c, f->foreign, 4))                                        \
    X(drop_front_pin, PKV_EINVAL, pkv_seq_drop_front(f->c, f->pin, 4))                                                \
    X(drop_front_past_length, PKV_EINVAL, pkv_seq_drop_front(f->c, f->live, UINT32_MAX))                              \
    /* release */                                                                                                     \
    X(release_null_cache, PKV_EINVAL, pkv_seq_release(NULL, f->live))                                                 \
    X(release_stale, PKV_ENOENT, pkv_seq_release(f->c, f->stale))                                                     \
    X(release_forged, PKV_ENOENT, pkv_seq_release(f->c, f->forged))                                                   \
    X(release_foreign, PKV_ENOENT, pkv_seq_release(f->c, f->foreign))                                                 \
    X(release_id0, PKV_ENOENT, pkv_seq_release(f->c, 0))                                                              \
    X(release_out_of_range, PKV_ENOENT, pkv_seq_release(f->c, f->out_of_range))                                       \
    X(release_pin, PKV_EINVAL, pkv_seq_release(f->c, f->pin))                                                         \
    /* get_info */                                                                                                    \
    X(info_null_cache, PKV_EINVAL, ({ pkv_seq_info i; pkv_seq_get_info(NULL, f->live, &i); }))                      \
    X(info_null_out, PKV_EINVAL, pkv_seq_get_info(f->c, f->live, NULL))                                               \
    X(info_stale, PKV_ENOENT, ({ pkv_seq_info i; pkv_seq_get_info(f->c, f->stale, &i); }))                          \
    X(info_forged, PKV_ENOENT, ({ pkv_seq_info i; pkv_seq_get_info(f->c, f->forged, &i); }))                        \
    X(info_foreign, PKV_ENOENT, ({ pkv_seq_info i; pkv_seq_get_info(f->c, f->foreign, &i); }))                      \
    X(info_id0, PKV_ENOENT, ({ pkv_seq_info i; pkv_seq_get_info(f->c, 0, &i); }))                                   \
    X(info_pin, PKV_EINVAL, ({ pkv_seq_info i; pkv_seq_get_info(f->c, f->pin, &i); }))                              \
    /* slots */                                                                                                       \
    X(slots_null_cache, PKV_EINVAL, pkv_seq_slots(NULL, f->live, 0, 1, f->ibuf))                                      \
    X(slots_null_buf, PKV_EINVAL, pkv_seq_slots(f->c, f->live, 0, 1, NULL))                                           \
    X(slots_stale, PKV_ENOENT, pkv_seq_slots(f->c, f->stale, 0, 0, f->ibuf))                                          \
    X(slots_forged, PKV_ENOENT, pkv_seq_slots(f->c, f->forged, 0, 1, f->ibuf))                                        \
    X(slots_foreign, PKV_ENOENT, pkv_seq_slots(f->c, f->foreign, 0, 1, f->ibuf))                                      \
    X(slots_pin, PKV_EINVAL, pkv_seq_slots(f->c, f->pin, 0, 1, f->ibuf))                                              \
    X(slots_past_length, PKV_EINVAL, pkv_seq_slots(f->c, f->live, 5, 6, f->ibuf))                                     \
    X(slots_start_past_length, PKV_EINVAL, pkv_seq_slots(f->c, f->live, 11, 0, f->ibuf))                              \
    X(slots_overflow, PKV_EINVAL, pkv_seq_slots(f->c, f->live, UINT32_MAX, 2, f->ibuf))                               \
    /* block_table */                                                                                                 \
    X(table_null_cache, PKV_EINVAL, ({ uint32_t n; pkv_seq_block_table(NULL, f->live, f->ibuf, 8, &n); }))          \
    X(table_null_out, PKV_EINVAL, ({ uint32_t n; pkv_seq_block_table(f->c, f->live, NULL, 8, &n); }))               \
    X(table_null_n_out, PKV_EINVAL, pkv_seq_block_table(f->c, f->live, f->ibuf, 8, NULL))                             \
    X(table_cap_too_small, PKV_EINVAL, ({ uint32_t n; pkv_seq_block_table(f->c, f->live, f->ibuf, 2, &n); }))       \
    X(table_stale, PKV_ENOENT, ({ uint32_t n; pkv_seq_block_table(f->c, f->stale, f->ibuf, 8, &n); }))              \
    X(table_forged, PKV_ENOENT, ({ uint32_t n; pkv_seq_block_table(f->c, f->forged, f->ibuf, 8, &n); }))            \
    X(table_foreign, PKV_ENOENT, ({ uint32_t n; pkv_seq_block_table(f->c, f->foreign, f->ibuf, 8, &n); }))          \
    X(table_pin, PKV_EINVAL, ({ uint32_t n; pkv_seq_block_table(f->c, f->pin, f->ibuf, 8, &n); }))                  \
    /* gather */                                                                                                      \
    X(gather_null_cache, PKV_EINVAL, pkv_seq_gather(NULL, f->live, 0, 0, 1, f->out, f->out))                          \
    X(gather_null_both, PKV_EINVAL, pkv_seq_gather(f->c, f->live, 0, 0, 1, NULL, NULL))                               \
    X(gather_layer, PKV_EINVAL, pkv_seq_gather(f->c, f->live, NL, 0, 1, f->out, NULL))                                \
    X(gather_past_length, PKV_EINVAL, pkv_seq_gather(f->c, f->live, 0, 9, 2, f->out, NULL))                           \
    X(gather_overflow, PKV_EINVAL, pkv_seq_gather(f->c, f->live, 0, UINT32_MAX, 2, f->out, NULL))                     \
    X(gather_stale, PKV_ENOENT, pkv_seq_gather(f->c, f->stale, 0, 0, 0, f->out, NULL))                                \
    X(gather_forged, PKV_ENOENT, pkv_seq_gather(f->c, f->forged, 0, 0, 1, f->out, NULL))                              \
    X(gather_foreign, PKV_ENOENT, pkv_seq_gather(f->c, f->foreign, 0, 0, 1, f->out, NULL))                            \
    X(gather_pin, PKV_EINVAL, pkv_seq_gather(f->c, f->pin, 0, 0, 1, f->out, NULL))                                    \
    /* read_stored */                                                                                                 \
    X(readst_null_cache, PKV_EINVAL, pkv_seq_read_stored(NULL, f->live, 0, 0, 1, f->out, f->out))                     \
    X(readst_null_both, PKV_EINVAL, pkv_seq_read_stored(f->c, f->live, 0, 0, 1, NULL, NULL))                          \
    X(readst_layer, PKV_EINVAL, pkv_seq_read_stored(f->c, f->live, NL, 0, 1, f->out, NULL))                           \
    X(readst_past_length, PKV_EINVAL, pkv_seq_read_stored(f->c, f->live, 0, 9, 2, f->out, NULL))                      \
    X(readst_overflow, PKV_EINVAL, pkv_seq_read_stored(f->c, f->live, 0, UINT32_MAX, 2, NULL, f->out))                \
    X(readst_stale, PKV_ENOENT, pkv_seq_read_stored(f->c, f->stale, 0, 0, 0, f->out, NULL))                           \
    X(readst_forged, PKV_ENOENT, pkv_seq_read_stored(f->c, f->forged, 0, 0, 1, f->out, NULL))                         \
    X(readst_foreign, PKV_ENOENT, pkv_seq_read_stored(f->c, f->foreign, 0, 0, 1, f->out, NULL))                       \
    X(readst_pin, PKV_EINVAL, pkv_seq_read_stored(f->c, f->pin, 0, 0, 1, f->out, NULL))                               \
    /* export dense */                                                                                                \
    X(dense_null_cache, PKV_EINVAL, pkv_export_dense(NULL, f->list, 2, 8, f->ibuf, f->ibuf + 128))                    \
    X(dense_null_seqs, PKV_EINVAL, pkv_export_dense(f->c, NULL, 2, 8, f->ibuf, f->ibuf + 128))                        \
    X(dense_null_tables, PKV_EINVAL, pkv_export_dense(f->c, f->list, 2, 8, NULL, f->ibuf + 128))                      \
    X(dense_null_lens, PKV_EINVAL, pkv_export_dense(f->c, f->list, 2, 8, f->ibuf, NULL))                              \
    X(dense_too_narrow, PKV_EINVAL, pkv_export_dense(f->c, f->list, 2, 2, f->ibuf, f->ibuf + 128))                    \
    X(dense_stale_in_list, PKV_ENOENT, ({ pkv_seq l[2] = {f->live, f->stale};                                         \
                                          pkv_export_dense(f->c, l, 2, 8, f->ibuf, f->ibuf + 128); }))               \
    X(dense_foreign_in_list, PKV_ENOENT, ({ pkv_seq l[2] = {f->live, f->foreign};                                     \
                                            pkv_export_dense(f->c, l, 2, 8, f->ibuf, f->ibuf + 128); }))              \
    X(dense_pin_in_list, PKV_EINVAL, ({ pkv_seq l[2] = {f->live, f->pin};                                             \
                                        pkv_export_dense(f->c, l, 2, 8, f->ibuf, f->ibuf + 128); }))                 \
    /* export csr */                                                                                                  \
    X(csr_null_cache, PKV_EINVAL, pkv_export_csr(NULL, f->list, 2, f->ibuf, f->ibuf + 8, 64, f->ibuf + 100, NULL))   \
    X(csr_null_seqs, PKV_EINVAL, pkv_export_csr(f->c, NULL, 2, f->ibuf, f->ibuf + 8, 64, f->ibuf + 100, NULL))       \
    X(csr_null_indptr, PKV_EINVAL, pkv_export_csr(f->c, f->list, 2, NULL, f->ibuf + 8, 64, f->ibuf + 100, NULL))     \
    X(csr_null_indices, PKV_EINVAL, pkv_export_csr(f->c, f->list, 2, f->ibuf, NULL, 64, f->ibuf + 100, NULL))        \
    X(csr_null_last, PKV_EINVAL, pkv_export_csr(f->c, f->list, 2, f->ibuf, f->ibuf + 8, 64, NULL, NULL))             \
    X(csr_cap_too_small, PKV_EINVAL, pkv_export_csr(f->c, f->list, 2, f->ibuf, f->ibuf + 8, 4, f->ibuf + 100, NULL)) \
    X(csr_stale_in_list, PKV_ENOENT, ({ pkv_seq l[2] = {f->stale, f->live};                                           \
                                        pkv_export_csr(f->c, l, 2, f->ibuf, f->ibuf + 8, 64, f->ibuf + 100, NULL); })) \
    /* match_prefix */                                                                                                \
    X(match_null_cache, PKV_EINVAL, ({ uint32_t r; pkv_seq_match_prefix(NULL, f->empty, f->tok, 8, &r); }))         \
    X(match_null_tokens, PKV_EINVAL, ({ uint32_t r; pkv_seq_match_prefix(f->c, f->empty, NULL, 8, &r); }))          \
    X(match_null_out, PKV_EINVAL, pkv_seq_match_prefix(f->c, f->empty, f->tok, 8, NULL))                              \
    X(match_not_empty, PKV_EINVAL, ({ uint32_t r; pkv_seq_match_prefix(f->c, f->live, f->tok, 8, &r); }))           \
    X(match_stale, PKV_ENOENT, ({ uint32_t r; pkv_seq_match_prefix(f->c, f->stale, f->tok, 8, &r); }))              \
    X(match_forged, PKV_ENOENT, ({ uint32_t r; pkv_seq_match_prefix(f->c, f->forged, f->tok, 8, &r); }))            \
    X(match_foreign, PKV_ENOENT, ({ uint32_t r; pkv_seq_match_prefix(f->c, f->foreign, f->tok, 8, &r); }))          \
    X(match_pin, PKV_EINVAL, ({ uint32_t r; pkv_seq_match_prefix(f->c, f->pin, f->tok, 8, &r); }))                  \
    /* pins */                                                                                                        \
    X(pin_null_cache, PKV_EINVAL, ({ pkv_seq p; pkv_pin_create(NULL, f->live, 8, &p); }))                           \
    X(pin_null_out, PKV_EINVAL, pkv_pin_create(f->c, f->live, 8, NULL))                                               \
    X(pin_stale, PKV_ENOENT, ({ pkv_seq p; pkv_pin_create(f->c, f->stale, 8, &p); }))                               \
    X(pin_forged, PKV_ENOENT, ({ pkv_seq p; pkv_pin_create(f->c, f->forged, 8, &p); }))                             \
    X(pin_foreign, PKV_ENOENT, ({ pkv_seq p; pkv_pin_create(f->c, f->foreign, 8, &p); }))                           \
    X(pin_of_pin, PKV_EINVAL, ({ pkv_seq p; pkv_pin_create(f->c, f->pin, 8, &p); }))                                \
    X(pin_release_null, PKV_EINVAL, pkv_pin_release(NULL, f->pin))                                                    \
    X(pin_release_seq, PKV_EINVAL, pkv_pin_release(f->c, f->live))                                                    \
    X(pin_release_stale, PKV_ENOENT, pkv_pin_release(f->c, f->stale))                                                 \
    X(pin_release_id0, PKV_ENOENT, pkv_pin_release(f->c, 0))                                                          \
    /* attention */                                                                                                   \
    X(decode_null_cache, PKV_EINVAL, pkv_attn_decode(NULL, 0, &f->live, 1, f->kv, f->out, NULL))                      \
    X(decode_layer, PKV_EINVAL, pkv_attn_decode(f->c, NL, &f->live, 1, f->kv, f->out, NULL))                          \
    X(decode_null_seqs, PKV_EINVAL, pkv_attn_decode(f->c, 0, NULL, 1, f->kv, f->out, NULL))                           \
    X(decode_null_q, PKV_EINVAL, pkv_attn_decode(f->c, 0, &f->live, 1, NULL, f->out, NULL))                           \
    X(decode_null_out, PKV_EINVAL, pkv_attn_decode(f->c, 0, &f->live, 1, f->kv, NULL, NULL))                          \
    X(decode_stale, PKV_ENOENT, pkv_attn_decode(f->c, 0, &f->stale, 1, f->kv, f->out, NULL))                          \
    X(decode_foreign, PKV_ENOENT, pkv_attn_decode(f->c, 0, &f->foreign, 1, f->kv, f->out, NULL))                      \
    X(decode_pin, PKV_EINVAL, pkv_attn_decode(f->c, 0, &f->pin, 1, f->kv, f->out, NULL))                              \
    X(decode_empty_seq, PKV_EINVAL, pkv_attn_decode(f->c, 0, &f->empty, 1, f->kv, f->out, NULL))                      \
    X(decode_bad_q_heads, PKV_EINVAL, ({ pkv_attn_params p = pkv_attn_params_default(); p.n_q_heads = NH + 1;         \
                                         pkv_attn_decode(f->c, 0, &f->live, 1, f->kv, f->out, &p); }))              \
    X(decode_q_heads_past_1024x, PKV_EINVAL, decode_q_heads(f, NH * 1025)) /* buffers big enough for them */         \
    X(decode_negative_scale, PKV_EINVAL, ({ pkv_attn_params p = pkv_attn_params_default(); p.scale = -1.0f;           \
                                            pkv_attn_decode(f->c, 0, &f->live, 1, f->kv, f->out, &p); }))           \
    X(prefill_null_cache, PKV_EINVAL, ({ pkv_attn_req r = {f->live, 0, 1};                                            \
                                         pkv_attn_prefill(NULL, 0, &r, 1, f->kv, f->out, NULL); }))                 \
    X(prefill_null_reqs, PKV_EINVAL, pkv_attn_prefill(f->c, 0, NULL, 1, f->kv, f->out, NULL))                         \
    X(prefill_layer, PKV_EINVAL, ({ pkv_attn_req r = {f->live, 0, 1};                                                 \
                                    pkv_attn_prefill(f->c, NL, &r, 1, f->kv, f->out, NULL); }))                     \
    X(prefill_past_length, PKV_EINVAL, ({ pkv_attn_req r = {f->live, 5, 6};                                           \
                                          pkv_attn_prefill(f->c, 0, &r, 1, f->kv, f->out, NULL); }))                \
    X(prefill_overflow, PKV_EINVAL, ({ pkv_attn_req r = {f->live, UINT32_MAX, 2};                                     \
                                       pkv_attn_prefill(f->c, 0, &r, 1, f->kv, f->out, NULL); }))                   \
    X(prefill_stale, PKV_ENOENT, ({ pkv_attn_req r = {f->stale, 0, 0};                                                \
                                    pkv_attn_prefill(f->c, 0, &r, 1, f->kv, f->out, NULL); }))                      \
    X(prefill_foreign, PKV_ENOENT, ({ pkv_attn_req r = {f->foreign, 0, 1};                                            \
                                      pkv_attn_prefill(f->c, 0, &r, 1, f->kv, f->out, NULL); }))                      \
    X(prefill_null_q, PKV_EINVAL, ({ pkv_attn_req r = {f->live, 0, 1};                                                \
                                     pkv_attn_prefill(f->c, 0, &r, 1, NULL, f->out, NULL); }))                      \
    X(masked_null_cache, PKV_EINVAL, ({ pkv_attn_req r = {f->live, 0, 1}; const uint8_t *m[1] = {NULL};              \
                                        pkv_attn_prefill_masked(NULL, 0, &r, 1, m, f->kv, f->out, NULL); }))        \
    X(masked_null_masks, PKV_EINVAL, ({ pkv_attn_req r = {f->live, 0, 1};                                             \
                                        pkv_attn_prefill_masked(f->c, 0, &r, 1, NULL, f->kv, f->out, NULL); }))     \
    X(masked_null_reqs, PKV_EINVAL, ({ const uint8_t *m[1] = {NULL};                                                  \
                                       pkv_attn_prefill_masked(f->c, 0, NULL, 1, m, f->kv, f->out, NULL); }))       \
    X(masked_past_length, PKV_EINVAL, ({ pkv_attn_req r = {f->live, 5, 6}; static const uint8_t b[8] = {0xff};        \
                                         const uint8_t *m[1] = {b};                                                   \
                                         pkv_attn_prefill_masked(f->c, 0, &r, 1, m, f->kv, f->out, NULL); }))       \
    X(masked_window, PKV_EINVAL, ({ pkv_attn_req r = {f->live, 0, 1}; static const uint8_t b[1] = {1};                \
                                    const uint8_t *m[1] = {b}; pkv_attn_params p = pkv_attn_params_default();         \
                                    p.window = 4; pkv_attn_prefill_masked(f->c, 0, &r, 1, m, f->kv, f->out, &p); })) \
    X(masked_stale, PKV_ENOENT, ({ pkv_attn_req r = {f->stale, 0, 0}; const uint8_t *m[1] = {NULL};                   \
                                   pkv_attn_prefill_masked(f->c, 0, &r, 1, m, f->kv, f->out, NULL); }))             \
    /* queries that are not finite */                                                                                 \
    X(decode_nan_q, PKV_EINVAL, attn_q_with(f, 0, 5, NAN))                                                             \
    X(decode_inf_q, PKV_EINVAL, attn_q_with(f, 0, NH * HD - 1, INFINITY))                                             \
    X(prefill_nan_second_query, PKV_EINVAL, attn_q_with(f, 1, NH * HD + 2, NAN))                                      \
    X(prefill_neg_inf_q, PKV_EINVAL, attn_q_with(f, 1, 0, -INFINITY))                                                 \
    /* queries whose magnitude times the scale passes PKV_VALUE_MAX (q.k could overflow) */                           \
    X(decode_q_scaled_past_value_max, PKV_EINVAL, attn_q_scaled(f, 0x1.000002p58f, 0.25f))                            \
    X(decode_q_1e38_scale_4, PKV_EINVAL, attn_q_scaled(f, 1e38f, 4.0f))                                               \
    X(prefill_q_3e38_default_scale, PKV_EINVAL, attn_q_with(f, 1, 3, 3e38f))

#define DEF_ROW(name, want, expr) \
    static int row_##name(fx *f) { (void)f; return (expr); }
ROWS(DEF_ROW)
#undef DEF_ROW

typedef struct {
    const char *name;
    int want;
    int (*fn)(fx *);
} row;

#define TABLE_ROW(name, want, expr) {#name, want, row_##name},
static const row g_rows[] = {ROWS(TABLE_ROW)};
#undef TABLE_ROW

typedef struct {
    pkv_stats st;
    pkv_seq_info info[4];
    int32_t tab[4][NB];
    uint32_t ntab[4];
    float k[NL][16 * NH * HD], v[NL][16 * NH * HD];
    float xk[3][NL][6 * NH * HD], xv[3][NL][6 * NH * HD]; /* part's 3 positions, parent's and child's 6 */
} obs;

static void observe(fx *f, obs *o) {
    memset(o, 0, sizeof *o);
    o->st = tu_stats(f->c);
    for (int i = 0; i < 4; i++) {
        o->info[i] = tu_info(f->c, all_ids(f, i));
        o->ntab[i] = tu_table(f->c, all_ids(f, i), o->tab[i], NB);
    }
    for (uint32_t l = 0; l < NL; l++) TU_OK(pkv_seq_gather(f->c, f->live, l, 0, 10, o->k[l], o->v[l]));
    const pkv_seq x[3] = {f->part, f->parent, f->child};
    for (int i = 0; i < 3; i++)
        for (uint32_t l = 0; l < NL; l++)
            TU_OK(pkv_seq_gather(f->c, x[i], l, 0, i ? 6 : 3, o->xk[i][l], o->xv[i][l]));
}

static void test_bad_inputs(void **state) {
    fx *f = *state;
    f->list[0] = f->live;
    f->list[1] = f->parent;
    size_t n = sizeof g_rows / sizeof g_rows[0];
    for (size_t i = 0; i < n; i++) {
        obs before, after;
        observe(f, &before);
        memset(&f->said, 0, sizeof f->said);
        int rc = g_rows[i].fn(f);
        if (rc != g_rows[i].want)
            fail_msg("row %s: got %d (%s), want %d (%s)", g_rows[i].name, rc, pkv_strerror(rc), g_rows[i].want,
                     pkv_strerror(g_rows[i].want));
        /* a refusal on the cache says why once, through its log hook (pkv.h); not a call that
           succeeds, a sizing answer, or a call without the cache */
        const char *nm = g_rows[i].name;
        const bool unsaid = rc == PKV_OK || strstr(nm, "null_cache") || strstr(nm, "cap_too_small") ||
                            !strncmp(nm, "dtype_", 6) || !strncmp(nm, "create_", 7) || !strcmp(nm, "reset_null") ||
                            !strcmp(nm, "pin_release_null");
        const int n_said = f->said.n[PKV_LOG_ERROR];
        const char *said = f->said.last_error;
        if (n_said != (unsaid ? 0 : 1))
            fail_msg("row %s: %d messages said, want %d (last: %s)", nm, n_said, unsaid ? 0 : 1, said);
        if (!unsaid && strncmp(said, "pkv_", 4) != 0) fail_msg("row %s: said \"%s\"", nm, said);
        if (getenv("PKV_TEST_SHOW_SAID") && !unsaid) print_message("%-28s %s\n", nm, said);
        char msg[256] = "";
        if (pkv_cache_check(f->c, msg, sizeof msg) != 0) fail_msg("row %s: checker: %s", g_rows[i].name, msg);
        observe(f, &after);
        if (memcmp(&before.st, &after.st, sizeof before.st) != 0) {
            print_error("row %s changed the stats\n", g_rows[i].name);
            TU_STATS_EQ(&before.st, &after.st);
        }
        if (memcmp(&before, &after, sizeof before) != 0) fail_msg("row %s changed a sequence", g_rows[i].name);
    }
    print_message("%zu bad-input rows checked\n", n);
}

/* Functions without a status: documented answers for bad values. */
static void test_bad_inputs_no_status(void **state) {
    (void)state;
    assert_non_null(pkv_strerror(12345));
    assert_non_null(pkv_strerror(-12345));
    assert_non_null(pkv_strerror(INT32_MIN));
    for (int rc = 0; rc >= PKV_EBUSY; rc--) assert_true(strlen(pkv_strerror(rc)) > 0);
    assert_null(pkv_dtype_name(PKV_DTYPE_COUNT));
    assert_null(pkv_dtype_name((pkv_dtype)-1));
    assert_int_equal(pkv_dtype_row_bytes(PKV_DTYPE_COUNT, 128), 0);
    assert_int_equal(pkv_dtype_row_bytes((pkv_dtype)-1, 128), 0);
    assert_int_equal(pkv_dtype_row_bytes(PKV_DTYPE_Q8_0, 33), 0);
    assert_int_equal(pkv_dtype_row_bytes(PKV_DTYPE_Q4_0, 16), 0);
    assert_int_equal(pkv_dtype_row_bytes(PKV_DTYPE_F16, 0), 0);
    assert_int_equal(pkv_dtype_row_bytes(PKV_DTYPE_F32, 128), 512);
    assert_int_equal(pkv_dtype_row_bytes(PKV_DTYPE_Q8_0, 64), 68);
    assert_int_equal(pkv_dtype_row_bytes(PKV_DTYPE_Q4_0, 64), 36);
    assert_int_equal(pkv_dtype_row_bytes(PKV_DTYPE_FP8_E4M3, 64), 68);
    for (int d = 0; d < PKV_DTYPE_COUNT; d++) {
        pkv_dtype back;
        TU_OK(pkv_dtype_from_name(pkv_dtype_name((pkv_dtype)d), &back));
        assert_int_equal(back, d);
    }
    pkv_dtype alias = PKV_DTYPE_F32;
    TU_OK(pkv_dtype_from_name("fp8", &alias)); /* the short name (pkv sim --dtype fp8) */
    assert_int_equal(alias, PKV_DTYPE_FP8_E4M3);
    pkv_cache_destroy(NULL); /* a no-op */
    assert_non_null(pkv_attn_backend(NULL));
    assert_string_equal(pkv_version(), PKV_VERSION_STRING);
}

/* Bad config fields one by one: PKV_EINVAL, nothing allocated (counting hook), nothing leaked,
 * and one PKV_LOG_ERROR message through the log hook that says what was wrong (says). */
typedef struct {
    const char *name;
    void (*mutate)(pkv_config *);
    int want;
    const char *says;
} cfg_row;

static void cfg_serial_for(void *ctx, pkv_task_fn fn, void *job, uint32_t n) {
    (void)ctx;
    for (uint32_t i = 0; i < n; i++) fn(job, i, 0);
}

/* create refuses cfg with want, leaves nothing allocated through the counting hook as, and
 * logs exactly one error containing says */
static void expect_refused(const char *name, pkv_config cfg, const tu_alloc_state *as, int want, const char *says) {
    cfg_log log = {{0}, ""};
    cfg.log = cfg_log_fn, cfg.log_ctx = &log;
    pkv_cache *c = NULL;
    int rc = pkv_cache_create(&cfg, &c);
    if (rc != want) fail_msg("config %s: got %d (%s), want %d", name, rc, pkv_strerror(rc), want);
    assert_null(c);
    assert_int_equal(as->n_live, 0);
    assert_int_equal(as->n_bad_free, 0);
    if (log.n[PKV_LOG_ERROR] != 1 || log.n[PKV_LOG_INFO] != 0 || !strstr(log.last_error, says))
        fail_msg("config %s: %d error messages, the last \"%s\", want one saying \"%s\"", name, log.n[PKV_LOG_ERROR],
                 log.last_error, says);
    assert_non_null(strstr(log.last_error, "pkv_cache_create: "));
}

#define CFG(name, want, says, stmt) \
    static void cfg_##name(pkv_config *c) { stmt; }
#define CFG_ROWS(X) \
    X(n_layers_0, PKV_EINVAL, "n_layers 0", c->n_layers = 0)                                                          \
    X(n_kv_heads_0, PKV_EINVAL, "n_kv_heads 0", c->n_kv_heads = 0)                                                    \
    X(head_dim_0, PKV_EINVAL, "head_dim 0", c->head_dim = 0)                                                          \
    X(head_dim_1025, PKV_EINVAL, "head_dim 1025", c->head_dim = 1025)                                                 \
    X(block_tokens_0, PKV_EINVAL, "block_tokens 0", c->block_tokens = 0)                                              \
    X(block_tokens_1025, PKV_EINVAL, "block_tokens 1025", c->block_tokens = 1025)                                     \
    X(no_blocks_no_budget, PKV_EINVAL, "mem_budget_bytes 0", (c->n_blocks = 0, c->mem_budget_bytes = 0))              \
    X(budget_below_one_block, PKV_EINVAL, "less than one block", (c->n_blocks = 0, c->mem_budget_bytes = 100))        \
    X(n_blocks_slots_overflow, PKV_EINVAL, "n_blocks 134217728 x block_tokens 16",                                    \
      (c->block_tokens = 16, c->n_blocks = (1u << 31) / 16))                                                          \
    X(max_seqs_0, PKV_EINVAL, "max_seqs 0", c->max_seqs = 0)                                                          \
    X(max_seqs_too_many, PKV_EINVAL, "max_seqs 16777217", c->max_seqs = (1u << 24) + 1)                               \
    X(k_dtype_count, PKV_EINVAL, "k_dtype 6 is not", c->k_dtype = PKV_DTYPE_COUNT)                                    \
    X(v_dtype_neg, PKV_EINVAL, "v_dtype -1 is not", c->v_dtype = (pkv_dtype)-1)                                       \
    X(k_dtype_99, PKV_EINVAL, "k_dtype 99", c->k_dtype = (pkv_dtype)99)                                               \
    X(q8_head_dim_40, PKV_EINVAL, "k_dtype q8_0 needs head_dim a multiple of 32, not 40",                             \
      (c->k_dtype = PKV_DTYPE_Q8_0, c->head_dim = 40))                                                                \
    X(q4_head_dim_16, PKV_EINVAL, "v_dtype q4_0 needs head_dim a multiple of 32, not 16",                             \
      (c->v_dtype = PKV_DTYPE_Q4_0, c->head_dim = 16))                                                                \
    X(n_threads_257, PKV_EINVAL, "n_threads 257", c->n_threads = 257)                                                 \
    X(n_layers_4097, PKV_EINVAL, "n_layers 4097", c->n_layers = 4097)                                                 \
    X(n_kv_heads_4097, PKV_EINVAL, "n_kv_heads 4097", c->n_kv_heads = 4097)                                           \
    X(prefix_cache_2, PKV_EINVAL, "enable_prefix_cache 2", c->enable_prefix_cache = 2)                                \
    X(huge_pages_neg, PKV_EINVAL, "huge_pages -1", c->huge_pages = -1)                                                \
    X(spin_us_over, PKV_EINVAL, "spin_us 1000001 is over 1000000", c->spin_us = 1000001)                              \
    X(table_slots_overflow, PKV_EINVAL, "max_blocks_per_seq 2097152 x block_tokens 1024",                             \
      (c->block_tokens = 1024, c->max_blocks_per_seq = 1u << 21))                                                     \
    X(alloc_without_free, PKV_EINVAL, "allocator.alloc without allocator.free", c->allocator.free = NULL)             \
    X(workers_without_executor, PKV_EINVAL, "executor.n_workers 2 without", c->executor.n_workers = 2)                \
    X(executor_no_workers, PKV_EINVAL, "executor.n_workers 0 not in",                                                 \
      (c->executor.parallel_for = cfg_serial_for, c->executor.n_workers = 0))                                         \
    X(executor_threads_differ, PKV_EINVAL, "n_threads 3 with an executor of 2 workers",                               \
      (c->executor.parallel_for = cfg_serial_for, c->executor.n_workers = 2, c->n_threads = 3))

CFG_ROWS(CFG)
#undef CFG
#define CFG_TABLE(name, want, says, stmt) {#name, cfg_##name, want, says},
static const cfg_row g_cfg_rows[] = {CFG_ROWS(CFG_TABLE)};
#undef CFG_TABLE

static void test_bad_config(void **state) {
    (void)state;
    for (size_t i = 0; i < sizeof g_cfg_rows / sizeof g_cfg_rows[0]; i++) {
        tu_alloc_state as;
        tu_alloc_reset(&as, -1);
        pkv_config cfg = tu_config(8, 4, 1, 1, 32, PKV_DTYPE_F32);
        cfg.allocator = tu_allocator(&as);
        g_cfg_rows[i].mutate(&cfg);
        expect_refused(g_cfg_rows[i].name, cfg, &as, g_cfg_rows[i].want, g_cfg_rows[i].says);
    }
    { /* block tables of 2^22 sequences x 4096 blocks: 64 GiB, past a 32-bit size_t (refused as
         such: the product wrapped there, and an append wrote past the tables) */
        tu_alloc_state as;
        tu_alloc_reset(&as, -1);
        as.refuse_over = (size_t)1 << 30;
        pkv_config cfg = tu_config(4096, 4, 1, 1, 32, PKV_DTYPE_F32);
        cfg.allocator = tu_allocator(&as);
        cfg.max_seqs = 1u << 22;
        cfg.max_blocks_per_seq = 4096;
        pkv_cache *c = NULL;
        assert_int_equal(pkv_cache_create(&cfg, &c), sizeof(size_t) < 8 ? PKV_EINVAL : PKV_ENOMEM);
        assert_null(c);
        assert_int_equal(as.n_live, 0);
    }
    /* the environment's settings for attention, read at create: a bad one is refused and named */
    static const struct {
        const char *var, *value, *says;
        int want;
    } env[] = {
        {"PKV_ATTN_BACKEND", "nonesuch", "attention backend \"nonesuch\"", PKV_ENOTSUP},
        {"PKV_ATTN_ORDER", "sideways", "PKV_ATTN_ORDER (auto, table or pool)", PKV_EINVAL},
        {"PKV_ATTN_SWEEP", "both", "PKV_ATTN_SWEEP (auto, wide or narrow)", PKV_EINVAL},
        {"PKV_ATTN_PASSES", "three", "PKV_ATTN_PASSES", PKV_EINVAL},
        {"PKV_ATTN_LEAD", "x", "PKV_ATTN_LEAD", PKV_EINVAL},
        {"PKV_ATTN_PIECES", "x", "PKV_ATTN_PIECES", PKV_EINVAL},
    };
    for (size_t i = 0; i < sizeof env / sizeof env[0]; i++) {
        const char *old = getenv(env[i].var);
        char *saved = old ? strdup(old) : NULL;
        assert_int_equal(setenv(env[i].var, env[i].value, 1), 0);
        tu_alloc_state as;
        tu_alloc_reset(&as, -1);
        pkv_config cfg = tu_config(8, 4, 1, 1, 32, PKV_DTYPE_F32);
        cfg.allocator = tu_allocator(&as);
        expect_refused(env[i].var, cfg, &as, env[i].want, env[i].says);
        if (saved) assert_int_equal(setenv(env[i].var, saved, 1), 0);
        else assert_int_equal(unsetenv(env[i].var), 0);
        free(saved);
    }
    /* a good config logs no error, one info line */
    {
        cfg_log log = {{0}, ""};
        pkv_config cfg = tu_config(8, 4, 1, 1, 32, PKV_DTYPE_F32);
        cfg.log = cfg_log_fn, cfg.log_ctx = &log;
        pkv_cache *c = tu_create(&cfg);
        assert_int_equal(log.n[PKV_LOG_ERROR], 0);
        assert_int_equal(log.n[PKV_LOG_INFO], 1);
        pkv_cache_destroy(c);
    }
    /* a budget past what int32 slots can name gives the largest pool they can (1024-token blocks:
       2^21 - 1 of them), not PKV_EINVAL: the hook refuses the first request over 64 MiB, the
       per-block metadata, whose size is then a multiple of that count */
    {
        tu_alloc_state as;
        tu_alloc_reset(&as, -1);
        as.refuse_over = (size_t)64 << 20;
        pkv_config cfg = tu_config(0, 1024, 1, 1, 1, PKV_DTYPE_F16);
        cfg.mem_budget_bytes = UINT64_MAX / 2;
        cfg.allocator = tu_allocator(&as);
        cfg_log log = {{0}, ""};
        cfg.log = cfg_log_fn, cfg.log_ctx = &log;
        pkv_cache *c = NULL;
#if SIZE_MAX < UINT64_MAX
        /* a 32-bit size_t cannot hold that pool: refused before any allocation */
        assert_int_equal(pkv_cache_create(&cfg, &c), PKV_EINVAL);
        assert_null(c);
        assert_int_equal(log.n[PKV_LOG_ERROR], 1);
        assert_non_null(strstr(log.last_error, "the pool's size overflows size_t"));
        assert_int_equal(as.n_live, 0);
#else
        assert_int_equal(pkv_cache_create(&cfg, &c), PKV_ENOMEM);
        assert_null(c);
        assert_int_equal(log.n[PKV_LOG_ERROR], 1); /* and says so */
        assert_non_null(strstr(log.last_error, "gave no memory"));
        const size_t r = as.first_refused;
        assert_true(r > 0 && r % ((1u << 21) - 1) == 0 && r / ((1u << 21) - 1) <= 256);
        assert_int_equal(as.n_live, 0);
#endif
    }
    /* the edges that are valid */
    const uint32_t hd[] = {1, 1024}, bt[] = {1, 1024};
    for (int i = 0; i < 2; i++) {
        pkv_config cfg = tu_config(4, bt[i], 1, 1, hd[i], PKV_DTYPE_F16);
        pkv_cache *c = tu_create(&cfg);
        pkv_seq s = tu_seq(c);
        tu_append(c, s, bt[i] + 1, 0, NULL);
        TU_WRITE_PAT(c, s, 0, bt[i] + 1, 3);
        TU_SAME_PAT(c, s, 0, bt[i] + 1, 3);
        TU_CHECK(c);
        pkv_cache_destroy(c);
    }
}

/* Output arrays may be NULL where their capacity is 0: with nothing to copy (an empty
 * sequence) the calls succeed and touch nothing (they passed NULL to memcpy: UB, which the
 * sanitizer build traps). */
static void test_empty_outputs_null(void **state) {
    (void)state;
    pkv_config cfg = tu_config(8, 4, 1, 1, 32, PKV_DTYPE_F32);
    pkv_cache *c = tu_create(&cfg);
    pkv_seq s = tu_seq(c);
    uint32_t n = 99;
    TU_OK(pkv_seq_block_table(c, s, NULL, 0, &n));
    assert_int_equal(n, 0);
    int32_t indptr[2] = {-1, -1}, lpl[1] = {-1};
    n = 99;
    TU_OK(pkv_export_csr(c, &s, 1, indptr, NULL, 0, lpl, &n));
    assert_int_equal(n, 0);
    assert_int_equal(indptr[0], 0);
    assert_int_equal(indptr[1], 0);
    assert_int_equal(lpl[0], 0);
    pkv_cache_destroy(c);
}

/* ---- an id whose index is exactly max_seqs (one past the last slot) ----
 * Every allocation of this cache is followed by bytes of 0x01 that the library never writes:
 * read as a sequence slot they look live (live = 1, generation 0x01010101, a pin). An index
 * check off by one would take the slot past the end of the array for a live one; the id must
 * be unknown, whatever lies after the array. */
static void test_id_index_max_seqs(void **state) {
    (void)state;
    enum { MS = 4 };
    pkv_config cfg = tu_config(NB, BT, NL, NH, HD, PKV_DTYPE_F32);
    cfg.max_seqs = MS;
    tu_alloc_state as;
    tu_alloc_reset(&as, -1);
    as.pad = 4096;
    cfg.allocator = tu_allocator(&as);
    pkv_cache *c = tu_create(&cfg);
    pkv_seq s[MS];
    for (int i = 0; i < MS; i++) s[i] = tu_seq(c); /* every slot live: indexes 0 .. MS - 1 */
    tu_append(c, s[0], 5, 0, NULL);
    pkv_stats before = tu_stats(c);
    const pkv_seq past[] = {((pkv_seq)0x01010101u << 32) | MS, (s[0] & ~0xffffffffull) | MS,
                            ((pkv_seq)0x01010101u << 32) | (MS + 1)};
    for (size_t i = 0; i < sizeof past / sizeof past[0]; i++) {
        pkv_seq_info in;
        int32_t slot, tab[4];
        uint32_t n_tab = 0, reused = 0;
        pkv_seq id = past[i], pin = 0, child = 0;
        TU_RC(pkv_seq_get_info(c, id, &in), PKV_ENOENT);
        TU_RC(pkv_seq_release(c, id), PKV_ENOENT);
        TU_RC(pkv_pin_release(c, id), PKV_ENOENT);
        TU_RC(pkv_seq_slots(c, id, 0, 0, &slot), PKV_ENOENT);
        TU_RC(pkv_seq_block_table(c, id, tab, 4, &n_tab), PKV_ENOENT);
        TU_RC(pkv_seq_truncate(c, id, 0), PKV_ENOENT);
        TU_RC(pkv_seq_commit(c, id, 0), PKV_ENOENT);
        TU_RC(pkv_seq_fork(c, id, &child), PKV_ENOENT);
        TU_RC(pkv_pin_create(c, id, 0, &pin), PKV_ENOENT);
        TU_RC(pkv_seq_match_prefix(c, id, NULL, 0, &reused), PKV_ENOENT);
    }
    pkv_stats after = tu_stats(c);
    TU_STATS_EQ(&before, &after);
    TU_CHECK(c);
    pkv_cache_destroy(c);
}

/* pkv_export_csr over more than INT32_MAX ids in all (one sequence named many times): refused
 * and said, with no size given (a caller would allocate for a second call refused the same). */
static void test_csr_past_int32(void **state) {
    (void)state;
    cfg_log log = {{0}, ""};
    pkv_config cfg = tu_config(4096, 1, 1, 1, 8, PKV_DTYPE_F32);
    cfg.log = cfg_log_fn, cfg.log_ctx = &log;
    pkv_cache *c = tu_create(&cfg);
    pkv_seq s = tu_seq(c);
    tu_append(c, s, 4096, 0, NULL);
    const uint32_t n = (1u << 31) / 4096 + 1; /* 2^31 + 4096 ids */
    pkv_seq *list = malloc(n * sizeof *list);
    assert_non_null(list);
    for (uint32_t i = 0; i < n; i++) list[i] = s;
    int32_t *indptr = malloc((n + 1) * sizeof *indptr), *last = malloc(n * sizeof *last);
    assert_non_null(indptr);
    assert_non_null(last);
    uint32_t need = 12345;
    assert_int_equal(pkv_export_csr(c, list, n, indptr, NULL, 0, last, &need), PKV_EINVAL);
    assert_int_equal(need, 12345);
    assert_int_equal(log.n[PKV_LOG_ERROR], 1);
    assert_string_equal(log.last_error, "pkv_export_csr: 2147487744 indices, past int32");
    /* 2^31 - 4096 ids: a size, not said (the sizing answer) */
    assert_int_equal(pkv_export_csr(c, list, n - 2, indptr, NULL, 0, last, &need), PKV_EINVAL);
    assert_int_equal(need, (n - 2) * 4096u);
    assert_int_equal(log.n[PKV_LOG_ERROR], 1);
    free(list), free(indptr), free(last);
    pkv_cache_destroy(c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_bad_inputs, setup, teardown),
        cmocka_unit_test(test_bad_inputs_no_status),
        cmocka_unit_test(test_bad_config),
        cmocka_unit_test(test_empty_outputs_null),
        cmocka_unit_test(test_id_index_max_seqs),
        cmocka_unit_test(test_csr_past_int32),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
