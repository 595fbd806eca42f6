/* test_core_basic.c: exact arithmetic of the core: blocks per length, slot mapping, the pool
 * layout written by pkv_write_kv (reshape_and_cache) read back raw and through gather, dtype
 * conversions, the dense / CSR block-table exports and the statistics of a scripted scenario. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>
#include "tu_assert.h"

#include "support_util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* K (or V) element address of (layer, block, head, offset) per pkv.h's pkv_layout contract. */
static uint8_t *elem_addr(const pkv_layout *L, int is_v, uint32_t layer, uint32_t slot, uint32_t head) {
    uint8_t *base = is_v ? L->v_base : L->k_base;
    size_t block_bytes = is_v ? L->v_block_bytes : L->k_block_bytes;
    size_t row_bytes = is_v ? L->v_row_bytes : L->k_row_bytes;
    uint32_t b = slot / L->block_tokens, t = slot % L->block_tokens;
    return base + (size_t)layer * L->layer_stride_bytes + (size_t)b * block_bytes +
           ((size_t)head * L->block_tokens + t) * row_bytes;
}

/* ---- blocks needed per length, B = 16 (SEEDS 7 and 15) ---- */
static void test_blocks_needed(void **state) {
    (void)state;
    pkv_config cfg = tu_config(64, 16, 1, 1, 8, PKV_DTYPE_F32);
    pkv_cache *c = tu_create(&cfg);
    const uint32_t lens[] = {0, 1, 16, 17, 32, 33};
    const uint32_t want[] = {0, 1, 1, 2, 2, 3};
    /* one sequence grown step by step ... */
    pkv_seq s = tu_seq(c);
    uint32_t len = 0;
    for (size_t i = 0; i < 6; i++) {
        tu_append(c, s, lens[i] - len, (int32_t)len, NULL);
        len = lens[i];
        pkv_seq_info in = tu_info(c, s);
        assert_int_equal(in.n_tokens, lens[i]);
        assert_int_equal(in.n_blocks, want[i]);
        TU_CHECK(c);
    }
    /* ... and fresh sequences appended in one call each */
    uint32_t total_blocks = want[5];
    for (size_t i = 0; i < 6; i++) {
        pkv_seq t = tu_seq(c);
        tu_append(c, t, lens[i], 0, NULL);
        pkv_seq_info in = tu_info(c, t);
        assert_int_equal(in.n_tokens, lens[i]);
        assert_int_equal(in.n_blocks, want[i]);
        total_blocks += want[i];
        pkv_stats st = tu_stats(c);
        assert_int_equal(st.n_active, total_blocks);
        assert_int_equal(st.n_free, 64 - total_blocks);
        TU_CHECK(c);
    }
    pkv_cache_destroy(c);
}

/* pkv_seq_append_blocks(s, n), then whether an append of n succeeds with exactly that many blocks
 * to be had and fails with one fewer (the pool's other blocks held by a filler sequence) */
static uint32_t need_of(pkv_cache *c, pkv_seq s, uint32_t n) {
    uint32_t need = 77;
    TU_OK(pkv_seq_append_blocks(c, s, n, &need));
    return need;
}

static void expect_append_edge(const pkv_config *cfg, uint32_t len0, int fork, int truncate_to, uint32_t n,
                               uint32_t want) {
    for (int spare = -1; spare <= 0; spare++) { /* pool left with want - 1, then want, blocks to be had */
        pkv_cache *c = tu_create(cfg);
        pkv_seq s = tu_seq(c), f = 0;
        tu_append(c, s, len0, 0, NULL);
        TU_OK(pkv_seq_commit(c, s, len0)); /* full blocks indexed where the prefix cache is on */
        if (fork) TU_OK(pkv_seq_fork(c, s, &f));
        if (truncate_to >= 0) TU_OK(pkv_seq_truncate(c, s, (uint32_t)truncate_to));
        const uint32_t got = need_of(c, s, n);
        if (got != want)
            fail_msg("len %u, fork %d, truncate to %d, append %u: %u blocks, want %u", len0, fork, truncate_to, n, got,
                     want);
        pkv_stats st = tu_stats(c);
        const uint32_t avail = st.n_free + st.n_cached, keep = want + (uint32_t)spare;
        if (keep > avail) fail_msg("the pool has %u blocks to be had, the case needs %u", avail, keep);
        pkv_seq filler = tu_seq(c); /* takes every block but keep (FREE first, then CACHED) */
        if (avail > keep) tu_append(c, filler, (avail - keep) * cfg->block_tokens, 1000, NULL);
        st = tu_stats(c);
        assert_int_equal(st.n_free + st.n_cached, keep);
        int32_t toks[64] = {0};
        assert_true(n <= 64);
        TU_RC(pkv_seq_append(c, s, toks, n, NULL), spare < 0 ? PKV_ENOSPC : PKV_OK);
        TU_CHECK(c);
        pkv_cache_destroy(c);
    }
}

static void test_append_blocks(void **state) {
    (void)state;
    pkv_config cfg = tu_config(16, 4, 1, 1, 8, PKV_DTYPE_F32);
    pkv_cache *c = tu_create(&cfg);
    pkv_seq s = tu_seq(c);
    const uint32_t n0[] = {0, 1, 4, 5, 9}, want0[] = {0, 1, 1, 2, 3};
    for (int i = 0; i < 5; i++) assert_int_equal(need_of(c, s, n0[i]), want0[i]);
    tu_append(c, s, 6, 0, NULL); /* 2 blocks, the tail holding 2 */
    assert_int_equal(need_of(c, s, 2), 0);
    assert_int_equal(need_of(c, s, 3), 1);
    pkv_seq f;
    TU_OK(pkv_seq_fork(c, s, &f)); /* the tail shared: a copy first */
    assert_int_equal(need_of(c, s, 1), 1);
    assert_int_equal(need_of(c, s, 3), 2);
    pkv_stats before = tu_stats(c);
    assert_int_equal(need_of(c, f, 7), 3);
    pkv_stats after = tu_stats(c);
    TU_STATS_EQ(&before, &after); /* changes nothing */
    TU_OK(pkv_seq_release(c, f));
    assert_int_equal(need_of(c, s, 2), 0);
    /* past max_blocks_per_seq (16): ELIMIT, as the append would be */
    uint32_t need = 77;
    TU_RC(pkv_seq_append_blocks(c, s, 16 * 4 - 6 + 1, &need), PKV_ELIMIT);
    assert_int_equal(need, 77);
    assert_int_equal(need_of(c, s, 16 * 4 - 6), 14);
    pkv_cache_destroy(c);

    /* the edge: an append with exactly the blocks counted succeeds, one fewer is ENOSPC */
    expect_append_edge(&cfg, 6, 0, -1, 3, 1);  /* a private tail: 1 new block */
    expect_append_edge(&cfg, 6, 1, -1, 1, 1);  /* a shared tail: its copy */
    expect_append_edge(&cfg, 6, 1, -1, 7, 3);  /* its copy and 2 new */
    expect_append_edge(&cfg, 8, 0, 7, 6, 2);   /* an unindexed tail (prefix cache off), ref 1: no copy */
    pkv_config pc = cfg;
    pc.enable_prefix_cache = 1;
    expect_append_edge(&pc, 8, 0, 7, 1, 1);    /* an indexed tail held alone: its copy (needs 1) ... */
    expect_append_edge(&pc, 8, 0, 7, 2, 1);    /* ... frees it, CACHED: copy + 1 new from 1 */
    expect_append_edge(&pc, 8, 0, 7, 9, 2);    /* copy + 2 new from 2 */
    expect_append_edge(&pc, 8, 1, 7, 9, 3);    /* an indexed tail shared by a fork: nothing freed */
}

/* ---- slots of positions 14..17 with block table [5, 10], B = 16 (SEEDS 10) ---- */
static void test_slots_block_table_5_10(void **state) {
    (void)state;
    pkv_config cfg = tu_config(32, 16, 1, 1, 8, PKV_DTYPE_F32);
    pkv_cache *c = tu_create(&cfg);
    /* The free queue starts 0..n-1 (FIFO): a holds 0..4, s gets 5, b holds 6..9, s gets 10. */
    pkv_seq a = tu_seq(c), s = tu_seq(c), b = tu_seq(c);
    int32_t sl[64];
    tu_append(c, a, 5 * 16, 0, NULL);
    tu_append(c, s, 16, 100, sl);
    for (int i = 0; i < 16; i++) assert_int_equal(sl[i], 5 * 16 + i);
    tu_append(c, b, 4 * 16, 200, NULL);
    tu_append(c, s, 2, 116, sl); /* positions 16, 17 */
    assert_int_equal(sl[0], 160);
    assert_int_equal(sl[1], 161);
    int32_t tab[8];
    assert_int_equal(tu_table(c, s, tab, 8), 2);
    assert_int_equal(tab[0], 5);
    assert_int_equal(tab[1], 10);
    int32_t slots[4] = {-7, -7, -7, -7};
    TU_OK(pkv_seq_slots(c, s, 14, 4, slots));
    assert_int_equal(slots[0], 94);
    assert_int_equal(slots[1], 95);
    assert_int_equal(slots[2], 160);
    assert_int_equal(slots[3], 161);
    /* position 18 does not exist (length 18): asking for it is an error, nothing written */
    slots[0] = -7;
    TU_RC(pkv_seq_slots(c, s, 15, 4, slots), PKV_EINVAL);
    assert_int_equal(slots[0], -7);
    /* every slot equals block_table[p / B] * B + p % B */
    int32_t all[18];
    TU_OK(pkv_seq_slots(c, s, 0, 18, all));
    for (int p = 0; p < 18; p++) assert_int_equal(all[p], tab[p / 16] * 16 + p % 16);
    TU_CHECK(c);
    pkv_cache_destroy(c);
}

/* ---- the gap between K and V in pools of 2 MiB and more (cache.c: v_skew) ----
 * A layer's V array starts 68 KiB past a 2 MiB multiple from its K array (K and V rows of one
 * block would otherwise share memory banks when n_blocks has a large power-of-two factor); the
 * gap is under 2 MiB, layers stay disjoint, and rows written through pkv_write_kv are where the
 * layout says and read back alike through pkv_seq_gather. */
static void test_layout_kv_gap(void **state) {
    (void)state;
    /* k_block_bytes 16 * 1 * 64 * 2 = 2 KiB: 2048 blocks = 4 MiB of K (a 2 MiB multiple, the
     * case the gap is for), 1500 blocks = 3 MiB (not), 100 blocks = 200 KiB (no gap) */
    const uint32_t n_blocks[] = {2048, 1500, 100};
    for (int ci = 0; ci < 3; ci++) {
        pkv_config cfg = tu_config(n_blocks[ci], 16, 2, 1, 64, PKV_DTYPE_F16);
        pkv_cache *c = tu_create(&cfg);
        pkv_layout L;
        TU_OK(pkv_cache_layout(c, &L));
        const size_t k_bytes = (size_t)n_blocks[ci] * L.k_block_bytes, v_bytes = (size_t)n_blocks[ci] * L.v_block_bytes;
        const size_t dist = (size_t)(L.v_base - L.k_base);
        assert_true(dist >= k_bytes);
        if (k_bytes >= (2u << 20)) {
            assert_int_equal(dist % (2u << 20), 17u * 4096u);
            assert_true(dist - k_bytes < (2u << 20));
        } else {
            assert_int_equal(dist, k_bytes);
        }
        assert_int_equal(L.layer_stride_bytes, dist + v_bytes);
        assert_int_equal((uintptr_t)L.v_base % 64, 0);
        pkv_stats st = tu_stats(c);
        assert_int_equal(st.kv_bytes, 2 * L.layer_stride_bytes);
        /* one sequence over every block; layer 1's rows at positions 0, 1 and the last two */
        pkv_seq s = tu_seq(c);
        const uint32_t n = n_blocks[ci] * 16, pos[4] = {0, 1, n - 2, n - 1};
        tu_append(c, s, n, 0, NULL);
        int32_t slots[4];
        float k[4][64], v[4][64], kg[64], vg[64];
        for (int i = 0; i < 4; i++) {
            TU_OK(pkv_seq_slots(c, s, pos[i], 1, &slots[i]));
            for (int d = 0; d < 64; d++) k[i][d] = (float)(i * 64 + d), v[i][d] = -(float)(i * 64 + d) - 0.5f;
        }
        TU_OK(pkv_write_kv(c, 1, slots, 4, k, v, PKV_DTYPE_F32));
        for (int i = 0; i < 4; i++) {
            const uint16_t *kr = (const uint16_t *)elem_addr(&L, 0, 1, (uint32_t)slots[i], 0);
            const uint16_t *vr = (const uint16_t *)elem_addr(&L, 1, 1, (uint32_t)slots[i], 0);
            TU_OK(pkv_seq_gather(c, s, 1, pos[i], 1, kg, vg));
            for (int d = 0; d < 64; d++) {
                TU_NEAR(tu_f16_to_f32(kr[d]), k[i][d], 0.0f);
                TU_NEAR(tu_f16_to_f32(vr[d]), v[i][d], 0.0f);
                TU_NEAR(kg[d], k[i][d], 0.0f);
                TU_NEAR(vg[d], v[i][d], 0.0f);
            }
        }
        TU_CHECK(c);
        pkv_cache_destroy(c);
    }
}

/* ---- layout fields ---- */
static void test_layout_fields(void **state) {
    (void)state;
    pkv_config cfg = tu_config(10, 4, 3, 2, 8, PKV_DTYPE_F16);
    cfg.v_dtype = PKV_DTYPE_F32;
    pkv_cache *c = tu_create(&cfg);
    pkv_layout L;
    TU_OK(pkv_cache_layout(c, &L));
    assert_int_equal(L.n_blocks, 10);
    assert_int_equal(L.block_tokens, 4);
    assert_int_equal(L.n_kv_heads, 2);
    assert_int_equal(L.head_dim, 8);
    assert_int_equal(L.n_layers, 3);
    assert_int_equal(L.k_dtype, PKV_DTYPE_F16);
    assert_int_equal(L.v_dtype, PKV_DTYPE_F32);
    assert_int_equal(L.k_row_bytes, 16);
    assert_int_equal(L.v_row_bytes, 32);
    assert_int_equal(L.k_block_bytes, 2 * 4 * 16);
    assert_int_equal(L.v_block_bytes, 2 * 4 * 32);
    assert_non_null(L.k_base);
    assert_non_null(L.v_base);
    assert_true(L.layer_stride_bytes >= 10 * L.v_block_bytes);
    assert_int_equal((uintptr_t)L.k_base % 64, 0);
    assert_int_equal((uintptr_t)L.v_base % 64, 0);
    /* the K and V regions of all layers are pairwise disjoint */
    uint8_t *lo[6], *hi[6];
    for (int l = 0; l < 3; l++) {
        lo[2 * l] = L.k_base + l * L.layer_stride_bytes;
        hi[2 * l] = lo[2 * l] + 10 * L.k_block_bytes;
        lo[2 * l + 1] = L.v_base + l * L.layer_stride_bytes;
        hi[2 * l + 1] = lo[2 * l + 1] + 10 * L.v_block_bytes;
    }
    for (int i = 0; i < 6; i++)
        for (int j = i + 1; j < 6; j++) assert_true(hi[i] <= lo[j] || hi[j] <= lo[i]);
    pkv_stats st = tu_stats(c);
    assert_int_equal(st.kv_bytes_per_block, 3 * (2 * 4 * 16 + 2 * 4 * 32));
    assert_int_equal(st.kv_bytes, 10 * st.kv_bytes_per_block);
    pkv_cache_destroy(c);
}

/* Zeroes K and V of every slot of s for every layer (the pool's initial content is not part
 * of the contract, so tests that look at "everything else" write it first). */
static void zero_seq(pkv_cache *c, pkv_seq s, uint32_t n_layers, uint32_t row_elems) {
    pkv_seq_info in = tu_info(c, s);
    int32_t *slots = calloc(in.n_tokens, sizeof *slots);
    float *z = calloc((size_t)in.n_tokens * row_elems, sizeof *z);
    TU_OK(pkv_seq_slots(c, s, 0, in.n_tokens, slots));
    for (uint32_t l = 0; l < n_layers; l++) TU_OK(pkv_write_kv(c, l, slots, in.n_tokens, z, z, PKV_DTYPE_F32));
    free(slots);
    free(z);
}

/* ---- SEEDS 12: ones at slots [1, 5] of a [4 blocks, B 2, 1 head, D 4] cache ---- */
static void test_reshape_boostr12(void **state) {
    (void)state;
    pkv_config cfg = tu_config(4, 2, 1, 1, 4, PKV_DTYPE_F32);
    pkv_cache *c = tu_create(&cfg);
    pkv_seq s = tu_seq(c);
    tu_append(c, s, 6, 0, NULL); /* blocks 0, 1, 2 */
    zero_seq(c, s, 1, 4);
    const int32_t slots[2] = {1, 5};
    float ones[8];
    for (int i = 0; i < 8; i++) ones[i] = 1.0f;
    TU_OK(pkv_write_kv(c, 0, slots, 2, ones, ones, PKV_DTYPE_F32));
    pkv_layout L;
    TU_OK(pkv_cache_layout(c, &L));
    const float *kc = (const float *)L.k_base, *vc = (const float *)L.v_base;
    for (int i = 0; i < 24; i++) { /* blocks 0..2 are contiguous: [block][head][token][dim] */
        float want = ((i >= 4 && i < 8) || (i >= 20 && i < 24)) ? 1.0f : 0.0f;
        assert_true(kc[i] == want);
        assert_true(vc[i] == want);
    }
    float k[6 * 4], v[6 * 4];
    TU_OK(pkv_seq_gather(c, s, 0, 0, 6, k, v));
    for (int p = 0; p < 6; p++)
        for (int d = 0; d < 4; d++) {
            float want = (p == 1 || p == 5) ? 1.0f : 0.0f;
            assert_true(k[p * 4 + d] == want && v[p * 4 + d] == want);
        }
    TU_CHECK(c);
    pkv_cache_destroy(c);
}

/* ---- SEEDS 13: 3 tokens, H 2, D 4, k[i] = 0.1 i at slots [0, 1, 9], B 8; plus a padding
 * slot -1 carrying a sentinel that must land nowhere, and a second layer ---- */
static void test_reshape_boostr13(void **state) {
    (void)state;
    pkv_config cfg = tu_config(4, 8, 2, 2, 4, PKV_DTYPE_F32);
    pkv_cache *c = tu_create(&cfg);
    pkv_seq s = tu_seq(c);
    tu_append(c, s, 16, 0, NULL); /* blocks 0, 1 */
    zero_seq(c, s, 2, 8);
    /* token order: slot 0, pad, slot 1, slot 9 */
    const int32_t slots[4] = {0, -1, 1, 9};
    float k[4 * 8], v[4 * 8];
    int src = 0;
    for (int t = 0; t < 4; t++)
        for (int i = 0; i < 8; i++) {
            if (t == 1) {
                k[t * 8 + i] = 99.0f;
                v[t * 8 + i] = 99.0f;
            } else {
                k[t * 8 + i] = 0.1f * (float)src;
                v[t * 8 + i] = -0.1f * (float)src;
                src++;
            }
        }
    TU_OK(pkv_write_kv(c, 1, slots, 4, k, v, PKV_DTYPE_F32));
    pkv_layout L;
    TU_OK(pkv_cache_layout(c, &L));
    const float *kc = (const float *)(L.k_base + L.layer_stride_bytes);
    /* boostr's asserted values: kc[0] = 0.0, kc[1] = 0.1 */
    assert_true(kc[0] == 0.0f);
    /* the casts round to float: where float math carries excess precision (x87), 0.1f and the
       products are wider than the floats stored (C11 5.2.4.2.2) */
    assert_true(kc[1] == (float)0.1f);
    /* derived for the vLLM layout [block][head][token][dim]: slot 9 = block 1 offset 1;
       head 0 at (1*2*8 + 0*8 + 1)*4 = 68, head 1 at (16 + 8 + 1)*4 = 100 */
    for (int d = 0; d < 4; d++) {
        assert_true(kc[68 + d] == (float)(0.1f * (float)(16 + d)));
        assert_true(kc[100 + d] == (float)(0.1f * (float)(20 + d)));
        assert_true(kc[4 + d] == (float)(0.1f * (float)(8 + d))); /* slot 1 head 0: boostr's kc[8..12] here */
    }
    /* every element at the documented address; nothing else written (sentinel nowhere) */
    for (int t = 0; t < 4; t++) {
        if (slots[t] < 0) continue;
        for (uint32_t h = 0; h < 2; h++) {
            const float *kr = (const float *)elem_addr(&L, 0, 1, (uint32_t)slots[t], h);
            const float *vr = (const float *)elem_addr(&L, 1, 1, (uint32_t)slots[t], h);
            for (int d = 0; d < 4; d++) {
                assert_true(kr[d] == k[t * 8 + h * 4 + d]);
                assert_true(vr[d] == v[t * 8 + h * 4 + d]);
            }
        }
    }
    for (uint32_t layer = 0; layer < 2; layer++)
        for (uint32_t slot = 0; slot < 16; slot++)
            for (uint32_t h = 0; h < 2; h++) {
                const float *kr = (const float *)elem_addr(&L, 0, layer, slot, h);
                const float *vr = (const float *)elem_addr(&L, 1, layer, slot, h);
                int written = layer == 1 && (slot == 0 || slot == 1 || slot == 9);
                for (int d = 0; d < 4; d++) {
                    assert_true(kr[d] != 99.0f && vr[d] != 99.0f);
                    if (!written) assert_true(kr[d] == 0.0f && vr[d] == 0.0f);
                }
            }
    /* layer 0 untouched, layer 1 gathers back what was written */
    float gk[16 * 8], gv[16 * 8];
    TU_OK(pkv_seq_gather(c, s, 0, 0, 16, gk, gv));
    for (int i = 0; i < 16 * 8; i++) assert_true(gk[i] == 0.0f && gv[i] == 0.0f);
    TU_OK(pkv_seq_gather(c, s, 1, 0, 16, gk, NULL));
    TU_OK(pkv_seq_gather(c, s, 1, 0, 16, NULL, gv));
    const int pos_of[4] = {0, -1, 1, 9};
    for (int t = 0; t < 4; t++) {
        if (pos_of[t] < 0) continue;
        for (int i = 0; i < 8; i++) {
            assert_true(gk[pos_of[t] * 8 + i] == k[t * 8 + i]);
            assert_true(gv[pos_of[t] * 8 + i] == v[t * 8 + i]);
        }
    }
    /* a sub-range gather equals the corresponding rows */
    float sk[3 * 8];
    TU_OK(pkv_seq_gather(c, s, 1, 8, 3, sk, NULL));
    assert_memory_equal(sk, gk + 8 * 8, sizeof sk);
    TU_CHECK(c);
    pkv_cache_destroy(c);
}

/* ---- writing only K or only V ---- */
static void test_write_k_only_v_only(void **state) {
    (void)state;
    pkv_config cfg = tu_config(4, 4, 1, 1, 4, PKV_DTYPE_F32);
    pkv_cache *c = tu_create(&cfg);
    pkv_seq s = tu_seq(c);
    int32_t slots[2];
    tu_append(c, s, 2, 0, slots);
    zero_seq(c, s, 1, 4);
    float a[8] = {1, 2, 3, 4, 5, 6, 7, 8}, b[8] = {-1, -2, -3, -4, -5, -6, -7, -8};
    TU_OK(pkv_write_kv(c, 0, slots, 2, a, NULL, PKV_DTYPE_F32));
    float gk[8], gv[8];
    TU_OK(pkv_seq_gather(c, s, 0, 0, 2, gk, gv));
    assert_memory_equal(gk, a, sizeof a);
    for (int i = 0; i < 8; i++) assert_true(gv[i] == 0.0f);
    TU_OK(pkv_write_kv(c, 0, slots, 2, NULL, b, PKV_DTYPE_F32));
    TU_OK(pkv_seq_gather(c, s, 0, 0, 2, gk, gv));
    assert_memory_equal(gk, a, sizeof a);
    assert_memory_equal(gv, b, sizeof b);
    pkv_cache_destroy(c);
}

/* ---- pkv_seq_write_kv: writes by position, the same bytes as pkv_write_kv at their slots ---- */
/* Twin caches take the same appends (three sequences in small interleaved chunks, so the
 * tables are fragmented) and the same writes: A by position, B through pkv_seq_slots and
 * pkv_write_kv. Every row of the pool they hold then has the same bytes in both, for each pool
 * dtype and input dtype, K only, V only and both, ranges across block boundaries. */
static void run_seq_write_twins(pkv_dtype pool, pkv_dtype in, uint64_t seed) {
    enum { NBK = 24, BT = 4, NLY = 2, H = 2, D = 32, NS = 3, LEN = 20, E = LEN * H * D };
    pkv_config cfg = tu_config(NBK, BT, NLY, H, D, pool);
    pkv_cache *c[2] = {tu_create(&cfg), tu_create(&cfg)};
    pkv_seq s[2][NS];
    tu_rng r;
    tu_rng_seed(&r, seed);
    for (int t = 0; t < 2; t++)
        for (int i = 0; i < NS; i++) s[t][i] = tu_seq(c[t]);
    uint32_t len[NS] = {0};
    while (len[0] < LEN || len[1] < LEN || len[2] < LEN) {
        const uint32_t i = tu_rng_below(&r, NS), want = 1 + tu_rng_below(&r, 5);
        const uint32_t n = want < LEN - len[i] ? want : LEN - len[i];
        for (int t = 0; t < 2 && n; t++) tu_append(c[t], s[t][i], n, (int32_t)(100 * i + len[i]), NULL);
        len[i] += n;
    }
    float *x = calloc(E, sizeof *x), *z = calloc(E, sizeof *z);
    uint16_t *x16 = calloc(E, sizeof *x16);
    int32_t slots[LEN];
    for (int t = 0; t < 2; t++) /* every row defined: zeros */
        for (int i = 0; i < NS; i++)
            for (uint32_t l = 0; l < NLY; l++) TU_OK(pkv_seq_write_kv(c[t], s[t][i], l, 0, LEN, z, z, PKV_DTYPE_F32));
    for (int w = 0; w < 60; w++) {
        const uint32_t i = tu_rng_below(&r, NS), layer = tu_rng_below(&r, NLY), start = tu_rng_below(&r, LEN);
        const uint32_t n = 1 + tu_rng_below(&r, LEN - start), what = tu_rng_below(&r, 3); /* K, V, both */
        for (uint32_t e = 0; e < n * H * D; e++) {
            x[e] = tu_rng_float(&r) * 4.0f;
            x16[e] = in == PKV_DTYPE_F16 ? tu_f32_to_f16(x[e]) : tu_f32_to_bf16(x[e]);
        }
        const void *src = in == PKV_DTYPE_F32 ? (const void *)x : (const void *)x16;
        const void *k = what != 1 ? src : NULL, *v = what != 0 ? src : NULL;
        TU_OK(pkv_seq_write_kv(c[0], s[0][i], layer, start, n, k, v, in));
        TU_OK(pkv_seq_slots(c[1], s[1][i], start, n, slots));
        TU_OK(pkv_write_kv(c[1], layer, slots, n, k, v, in));
    }
    pkv_layout L[2];
    for (int t = 0; t < 2; t++) TU_OK(pkv_cache_layout(c[t], &L[t]));
    size_t n_rows = 0;
    for (int i = 0; i < NS; i++) {
        int32_t sl[2][LEN];
        for (int t = 0; t < 2; t++) TU_OK(pkv_seq_slots(c[t], s[t][i], 0, LEN, sl[t]));
        assert_memory_equal(sl[0], sl[1], sizeof sl[0]); /* the same appends, the same places */
        for (uint32_t l = 0; l < NLY; l++)
            for (uint32_t p = 0; p < LEN; p++)
                for (uint32_t h = 0; h < H; h++)
                    for (int is_v = 0; is_v < 2; is_v++) {
                        const uint8_t *a = elem_addr(&L[0], is_v, l, (uint32_t)sl[0][p], h);
                        const uint8_t *b = elem_addr(&L[1], is_v, l, (uint32_t)sl[1][p], h);
                        if (memcmp(a, b, is_v ? L[0].v_row_bytes : L[0].k_row_bytes) != 0)
                            fail_msg("pool %s in %s: seq %d layer %u position %u head %u %s differs",
                                     pkv_dtype_name(pool), pkv_dtype_name(in), i, l, p, h, is_v ? "V" : "K");
                        n_rows++;
                    }
    }
    assert_int_equal(n_rows, (size_t)NS * NLY * LEN * H * 2);
    for (int t = 0; t < 2; t++) {
        TU_CHECK(c[t]);
        pkv_cache_destroy(c[t]);
    }
    free(x);
    free(z);
    free(x16);
}

static void test_seq_write_twins(void **state) {
    (void)state;
    const pkv_dtype pools[] = {PKV_DTYPE_F32,  PKV_DTYPE_F16,  PKV_DTYPE_BF16,
                               PKV_DTYPE_Q8_0, PKV_DTYPE_Q4_0, PKV_DTYPE_FP8_E4M3};
    const pkv_dtype ins[] = {PKV_DTYPE_F32, PKV_DTYPE_F16, PKV_DTYPE_BF16};
    for (size_t p = 0; p < sizeof pools / sizeof pools[0]; p++)
        for (size_t i = 0; i < 3; i++) run_seq_write_twins(pools[p], ins[i], 17 * p + i + 1);
}

/* Slots go stale, positions do not: after a truncate hands a block to another sequence, a write
 * through the old slots lands in that sequence's rows (pkv.h says so), while the same write by
 * position is refused (past the length) and, once the position is appended again, lands in
 * the sequence's new block. */
static void test_seq_write_stale_slots(void **state) {
    (void)state;
    enum { H = 1, D = 4 };
    pkv_config cfg = tu_config(2, 4, 1, H, D, PKV_DTYPE_F32);
    pkv_cache *c = tu_create(&cfg);
    pkv_seq a = tu_seq(c), b = tu_seq(c);
    int32_t old[2];
    tu_append(c, a, 6, 0, NULL);
    TU_OK(pkv_seq_slots(c, a, 4, 2, old)); /* a's second block */
    TU_OK(pkv_seq_truncate(c, a, 4));
    tu_append(c, b, 2, 50, NULL); /* the only FREE block: a's old second one */
    int32_t bs[2];
    TU_OK(pkv_seq_slots(c, b, 0, 2, bs));
    assert_memory_equal(bs, old, sizeof bs);
    const float kb[2 * D] = {1, 2, 3, 4, 5, 6, 7, 8}, kx[2 * D] = {-1, -2, -3, -4, -5, -6, -7, -8};
    TU_OK(pkv_seq_write_kv(c, b, 0, 0, 2, kb, kb, PKV_DTYPE_F32));
    /* by position: a has 4 positions now, so 4 and 5 are past its length; b keeps its rows */
    TU_RC(pkv_seq_write_kv(c, a, 0, 4, 2, kx, kx, PKV_DTYPE_F32), PKV_EINVAL);
    float g[2 * D];
    TU_OK(pkv_seq_gather(c, b, 0, 0, 2, g, NULL));
    assert_memory_equal(g, kb, sizeof g);
    /* by the stale slots: accepted (they lie in a block held alone), and b's rows change */
    TU_OK(pkv_write_kv(c, 0, old, 2, kx, kx, PKV_DTYPE_F32));
    TU_OK(pkv_seq_gather(c, b, 0, 0, 2, g, NULL));
    assert_memory_equal(g, kx, sizeof g);
    /* a's positions 0-3 by position: its own block, b untouched */
    float ka[4 * D];
    for (int i = 0; i < 4 * D; i++) ka[i] = 0.5f * (float)i;
    TU_OK(pkv_seq_write_kv(c, a, 0, 0, 4, ka, NULL, PKV_DTYPE_F32));
    float ga[4 * D];
    TU_OK(pkv_seq_gather(c, a, 0, 0, 4, ga, NULL));
    assert_memory_equal(ga, ka, sizeof ga);
    TU_OK(pkv_seq_gather(c, b, 0, 0, 2, g, NULL));
    assert_memory_equal(g, kx, sizeof g);
    TU_CHECK(c);
    pkv_cache_destroy(c);
}

/* ---- stored rows: a sequence moved to another cache, bit for bit ---- */
/* Cache A holds a sequence written from f32 values; its rows go through pkv_seq_read_stored
 * into cache B (another pool size and block size: rows are per position; a fragmented table: a
 * filler sequence appended between the pieces), written by pkv_seq_write_stored in pieces (K
 * alone, V alone, both). B's stored rows, read back, equal A's byte for byte, and so do the
 * gathers (decoded); its decode is within f32 rounding of A's; the rows in B's pool are where
 * B's table says (checked through pkv_cache_layout). */
static void run_stored_transfer(pkv_dtype kd, pkv_dtype vd, uint64_t seed) {
    enum { BT = 4, NLY = 2, H = 2, QH = 4, D = 64, LEN = 23, E = LEN * H * D };
    pkv_config ca = tu_config(12, BT, NLY, H, D, kd), cb = tu_config(16, 2 * BT, NLY, H, D, kd); /* B: 8-token blocks */
    ca.v_dtype = cb.v_dtype = vd;
    pkv_cache *a = tu_create(&ca), *b = tu_create(&cb);
    pkv_seq sa = tu_seq(a), sb = tu_seq(b), filler = tu_seq(b);
    tu_append(a, sa, LEN, 0, NULL);
    for (uint32_t got = 0; got < LEN; got += 5) { /* sb's blocks between filler's */
        tu_append(b, sb, LEN - got < 5 ? LEN - got : 5, (int32_t)got, NULL);
        tu_append(b, filler, 3, 1000 + (int32_t)got, NULL);
    }
    tu_rng r;
    tu_rng_seed(&r, seed);
    float *x = calloc(2 * E, sizeof *x);
    for (uint32_t l = 0; l < NLY; l++) {
        for (uint32_t e = 0; e < 2 * E; e++) /* magnitudes 2^-8 .. 2^7, and rows of zeros */
            x[e] = (e / D) % 7 == 3 ? 0.0f : tu_rng_float(&r) * ldexpf(1.0f, (int)tu_rng_below(&r, 16) - 8);
        TU_OK(pkv_seq_write_kv(a, sa, l, 0, LEN, x, x + E, PKV_DTYPE_F32));
    }
    const size_t kr = pkv_dtype_row_bytes(kd, D), vr = pkv_dtype_row_bytes(vd, D);
    uint8_t *ks = malloc(LEN * H * kr), *vs = malloc(LEN * H * vr), *ks2 = malloc(LEN * H * kr),
            *vs2 = malloc(LEN * H * vr);
    float *ga = malloc(2 * E * sizeof *ga), *gb = malloc(2 * E * sizeof *gb);
    pkv_layout L;
    TU_OK(pkv_cache_layout(b, &L));
    int32_t slots[LEN];
    TU_OK(pkv_seq_slots(b, sb, 0, LEN, slots));
    for (uint32_t l = 0; l < NLY; l++) {
        TU_OK(pkv_seq_read_stored(a, sa, l, 0, LEN, ks, vs));
        const uint32_t cut = 1 + tu_rng_below(&r, LEN - 1);
        TU_OK(pkv_seq_write_stored(b, sb, l, 0, cut, ks, NULL));
        TU_OK(pkv_seq_write_stored(b, sb, l, 0, cut, NULL, vs));
        TU_OK(pkv_seq_write_stored(b, sb, l, cut, LEN - cut, ks + cut * H * kr, vs + cut * H * vr));
        TU_OK(pkv_seq_read_stored(b, sb, l, 0, LEN, ks2, vs2));
        assert_memory_equal(ks, ks2, LEN * H * kr);
        assert_memory_equal(vs, vs2, LEN * H * vr);
        for (uint32_t p = 0; p < LEN; p++) /* in B's pool where B's table puts them */
            for (uint32_t h = 0; h < H; h++) {
                assert_memory_equal(elem_addr(&L, 0, l, (uint32_t)slots[p], h), ks + (p * H + h) * kr, kr);
                assert_memory_equal(elem_addr(&L, 1, l, (uint32_t)slots[p], h), vs + (p * H + h) * vr, vr);
            }
        TU_OK(pkv_seq_read_stored(b, sb, l, 7, 3, NULL, vs2)); /* a range, V alone */
        assert_memory_equal(vs2, vs + 7 * H * vr, 3 * H * vr);
        TU_OK(pkv_seq_gather(a, sa, l, 0, LEN, ga, ga + E));
        TU_OK(pkv_seq_gather(b, sb, l, 0, LEN, gb, gb + E));
        assert_memory_equal(ga, gb, 2 * E * sizeof *ga);
        if (kd == PKV_DTYPE_F32 && l == NLY - 1) assert_memory_equal(ks, x, E * sizeof *x); /* its values */
    }
    float q[QH * D], oa[QH * D], ob[QH * D];
    for (int i = 0; i < QH * D; i++) q[i] = tu_rng_float(&r);
    pkv_attn_params ap = pkv_attn_params_default();
    ap.n_q_heads = QH;
    for (uint32_t l = 0; l < NLY; l++) {
        TU_OK(pkv_attn_decode(a, l, &sa, 1, q, oa, &ap));
        TU_OK(pkv_attn_decode(b, l, &sb, 1, q, ob, &ap));
        /* the same K/V; with other blocks the kernels' softmax steps and sums differ: f32 rounding,
           held to the attention oracle's f32 bound, 1e-5 of the output's scale */
        double scale = 0.0, worst = 0.0; /* plain compares: aarch64 GCC 12 -O3 ICEs vectorizing fmax here */
        for (int i = 0; i < QH * D; i++) {
            const double a_i = fabs(oa[i]), diff = fabs((double)oa[i] - ob[i]);
            if (a_i > scale) scale = a_i;
            if (diff > worst) worst = diff;
        }
        if (worst > 1e-5 * scale)
            fail_msg("k %s v %s layer %u: decode differs by %g, output scale %g", pkv_dtype_name(kd),
                     pkv_dtype_name(vd), l, worst, scale);
    }
    TU_CHECK(a);
    TU_CHECK(b);
    pkv_cache_destroy(a);
    pkv_cache_destroy(b);
    free(x), free(ks), free(vs), free(ks2), free(vs2), free(ga), free(gb);
}

static void test_stored_transfer(void **state) {
    (void)state;
    const pkv_dtype all[] = {PKV_DTYPE_F32,  PKV_DTYPE_F16,  PKV_DTYPE_BF16,
                             PKV_DTYPE_Q8_0, PKV_DTYPE_Q4_0, PKV_DTYPE_FP8_E4M3};
    for (size_t k = 0; k < 6; k++)
        for (size_t v = 0; v < 6; v++) run_stored_transfer(all[k], all[v], 6 * k + v + 1);
}

/* What the stored rows are, exactly (f16 codes, a q8_0 block), and which rows a write refuses:
 * one element or scale or code spoiled at a time in a valid row of each dtype, each refused
 * with PKV_EINVAL and nothing written; the edges the encoder can reach are accepted. */
static void put_f32(uint8_t *p, float x) { memcpy(p, &x, 4); }
static void put_u16(uint8_t *p, uint16_t u) { memcpy(p, &u, 2); }

/* A cache of one layer and kv head at head_dim d holding one position written from x. */
static pkv_cache *one_row_cache(pkv_dtype dt, uint32_t d, const float *x, pkv_seq *s) {
    pkv_config cfg = tu_config(4, 4, 1, 1, d, dt);
    pkv_cache *c = tu_create(&cfg);
    *s = tu_seq(c);
    tu_append(c, *s, 1, 0, NULL);
    TU_OK(pkv_seq_write_kv(c, *s, 0, 0, 1, x, x, PKV_DTYPE_F32));
    return c;
}

/* Codes [first, first + n) of s's stored row, K or V (v_side), set one at a time to bad_even or
 * bad_odd (by position): refused; to good: accepted. */
static void every_code(pkv_cache *c, pkv_seq s, uint32_t first, uint32_t n, uint8_t bad_even, uint8_t bad_odd,
                       uint8_t good, int v_side) {
    uint8_t row0[64], row[64];
    TU_OK(pkv_seq_read_stored(c, s, 0, 0, 1, v_side ? NULL : row0, v_side ? row0 : NULL));
    for (uint32_t j = first; j < first + n; j++) {
        memcpy(row, row0, sizeof row);
        row[j] = j % 2 ? bad_odd : bad_even;
        TU_RC(pkv_seq_write_stored(c, s, 0, 0, 1, v_side ? NULL : row, v_side ? row : NULL), PKV_EINVAL);
        row[j] = good;
        TU_OK(pkv_seq_write_stored(c, s, 0, 0, 1, v_side ? NULL : row, v_side ? row : NULL));
    }
    TU_CHECK(c);
}

static void test_stored_rows(void **state) {
    (void)state;
    enum { D = 32 };
    float x[D];
    for (int i = 0; i < D; i++) x[i] = (float)(i - 16) * 0.25f; /* -4 .. 3.75 */
    x[0] = 1.0f, x[1] = -2.0f, x[2] = 0.5f;
    /* f16: the codes of 1, -2, 0.5 */
    pkv_seq s;
    pkv_cache *c = one_row_cache(PKV_DTYPE_F16, D, x, &s);
    uint16_t h[D];
    TU_OK(pkv_seq_read_stored(c, s, 0, 0, 1, h, NULL));
    assert_int_equal(h[0], 0x3c00);
    assert_int_equal(h[1], 0xc000);
    assert_int_equal(h[2], 0x3800);
    assert_int_equal(h[3], 0xc280); /* -3.25 */
    pkv_cache_destroy(c);
    /* q8_0: amax 3.75 (x[31]) -> scale f16(3.75 / 127) = 0x278f (0.0295257568...), so 1 -> 34
     * (33.87), -2 -> -68, 0 -> 0, 3.75 -> 127; then a code -128 at every position, as V */
    c = one_row_cache(PKV_DTYPE_Q8_0, D, x, &s);
    uint8_t k[34];
    TU_OK(pkv_seq_read_stored(c, s, 0, 0, 1, k, NULL));
    assert_int_equal(k[0] | k[1] << 8, 0x278f);
    assert_int_equal((int8_t)k[2], 34);
    assert_int_equal((int8_t)k[3], -68);
    assert_int_equal((int8_t)k[2 + 16], 0);
    assert_int_equal((int8_t)k[2 + 31], 127);
    every_code(c, s, 2, 32, 0x80, 0x80, 0x81 /* -127 */, 1);
    pkv_cache_destroy(c);
    /* fp8 at head_dim 13: a NaN code at every position (the check's tail past the last eight) */
    c = one_row_cache(PKV_DTYPE_FP8_E4M3, 13, x, &s);
    every_code(c, s, 4, 13, 0xff, 0x7f, 0x7e /* 448 */, 0);
    pkv_cache_destroy(c);
    typedef struct {
        pkv_dtype dt;
        int spoil; /* what to spoil in the row (below) */
        int want;
    } row_case;
    static const row_case cases[] = {
        {PKV_DTYPE_F32, 0, PKV_EINVAL},      /* element NaN */
        {PKV_DTYPE_F32, 1, PKV_EINVAL},      /* element -inf */
        {PKV_DTYPE_F32, 2, PKV_EINVAL},      /* element just past 2^56 */
        {PKV_DTYPE_F32, 3, PKV_OK},          /* element 2^56 */
        {PKV_DTYPE_F16, 0, PKV_EINVAL},      /* code 0x7c00 (inf) */
        {PKV_DTYPE_F16, 1, PKV_EINVAL},      /* code 0xfe00 (NaN) */
        {PKV_DTYPE_F16, 3, PKV_OK},          /* code 0x7bff (65504) */
        {PKV_DTYPE_BF16, 0, PKV_EINVAL},     /* code 0x7fc0 (NaN) */
        {PKV_DTYPE_BF16, 2, PKV_EINVAL},     /* code 0x5b81 (just past 2^56) */
        {PKV_DTYPE_BF16, 3, PKV_OK},         /* code 0xdb80 (-2^56) */
        {PKV_DTYPE_Q8_0, 0, PKV_EINVAL},     /* scale 0x7c00 */
        {PKV_DTYPE_Q8_0, 1, PKV_EINVAL},     /* code -128 */
        {PKV_DTYPE_Q8_0, 3, PKV_OK},         /* scale 65504, code -127 */
        {PKV_DTYPE_Q4_0, 0, PKV_EINVAL},     /* scale 0xfe00 (NaN) */
        {PKV_DTYPE_Q4_0, 3, PKV_OK},         /* scale -65504 (q4_0 scales may be negative), nibbles 0xff */
        {PKV_DTYPE_FP8_E4M3, 0, PKV_EINVAL}, /* scale -1 */
        {PKV_DTYPE_FP8_E4M3, 1, PKV_EINVAL}, /* code 0xff (NaN) */
        {PKV_DTYPE_FP8_E4M3, 2, PKV_EINVAL}, /* scale past 2^56 / 448 */
        {PKV_DTYPE_FP8_E4M3, 4, PKV_EINVAL}, /* scale NaN */
        {PKV_DTYPE_FP8_E4M3, 5, PKV_EINVAL}, /* code 0x7f (NaN) */
        {PKV_DTYPE_FP8_E4M3, 3, PKV_OK},     /* scale 2^56 / 448, code 0x7e (448) */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const row_case *rc = &cases[i];
        enum { H = 2 };
        pkv_config cfg = tu_config(4, 4, 1, H, D, rc->dt);
        c = tu_create(&cfg);
        s = tu_seq(c);
        tu_append(c, s, 3, 0, NULL);
        float xs[3 * H * D];
        for (int e = 0; e < 3 * H * D; e++) xs[e] = x[e % D];
        TU_OK(pkv_seq_write_kv(c, s, 0, 0, 3, xs, xs, PKV_DTYPE_F32));
        const size_t rb = pkv_dtype_row_bytes(rc->dt, D);
        uint8_t good[3 * H * 64 * 4], row[3 * H * 64 * 4], after[3 * H * 64 * 4], vafter[3 * H * 64 * 4];
        TU_OK(pkv_seq_read_stored(c, s, 0, 0, 3, good, NULL));
        memcpy(row, good, 3 * H * rb);
        uint8_t *p = row + (1 * H + 1) * rb; /* position 1, head 1 */
        switch (rc->dt) {
        case PKV_DTYPE_F32: {
            const float bad[] = {NAN, -INFINITY, 0x1.000002p56f, 0x1p56f};
            put_f32(p + 4 * 9, bad[rc->spoil]);
            break;
        }
        case PKV_DTYPE_F16: {
            const uint16_t bad[] = {0x7c00, 0xfe00, 0, 0x7bff};
            put_u16(p + 2 * 9, bad[rc->spoil]);
            break;
        }
        case PKV_DTYPE_BF16: {
            const uint16_t bad[] = {0x7fc0, 0, 0x5b81, 0xdb80};
            put_u16(p + 2 * 9, bad[rc->spoil]);
            break;
        }
        case PKV_DTYPE_Q8_0:
            if (rc->spoil == 0) put_u16(p, 0x7c00);
            if (rc->spoil == 1) p[2 + 5] = 0x80;
            if (rc->spoil == 3) put_u16(p, 0x7bff), p[2 + 5] = 0x81;
            break;
        case PKV_DTYPE_Q4_0:
            if (rc->spoil == 0) put_u16(p, 0xfe00);
            if (rc->spoil == 3) put_u16(p, 0xfbff), p[2 + 5] = 0xff;
            break;
        default: /* fp8 */
            if (rc->spoil == 0) put_f32(p, -1.0f);
            if (rc->spoil == 1) p[4 + 3] = 0xff;
            if (rc->spoil == 2) put_f32(p, nextafterf(0x1p56f / 448.0f, INFINITY));
            if (rc->spoil == 4) put_f32(p, NAN);
            if (rc->spoil == 5) p[4 + 30] = 0x7f;
            if (rc->spoil == 3) put_f32(p, 0x1p56f / 448.0f), p[4 + 3] = 0x7e;
            break;
        }
        for (int side = 0; side < 2; side++) { /* the row as K, then as V */
            const int got = pkv_seq_write_stored(c, s, 0, 0, 3, side ? NULL : row, side ? row : NULL);
            if (got != rc->want)
                fail_msg("%s spoil %d as %s: %d, want %d", pkv_dtype_name(rc->dt), rc->spoil, side ? "V" : "K", got,
                         rc->want);
            TU_OK(pkv_seq_read_stored(c, s, 0, 0, 3, after, vafter));
            const uint8_t *now = side ? vafter : after;
            if (rc->want == PKV_OK) assert_memory_equal(now, row, 3 * H * rb);
            else assert_memory_equal(now, good, 3 * H * rb); /* nothing written, not the rows before it */
        }
        TU_CHECK(c);
        pkv_cache_destroy(c);
    }
}

/* ---- dtype conversions: pool f16 / bf16 / f32 from input f32 / f16 / bf16 ---- */
static uint16_t read_u16(const uint8_t *p) {
    uint16_t u;
    memcpy(&u, p, 2);
    return u;
}

typedef struct {
    pkv_dtype pool, in;
} conv_case;

static void run_conversion(pkv_dtype pool, pkv_dtype in, uint64_t seed) {
    enum { NT = 16, H = 2, D = 8, E = NT * H * D };
    pkv_config cfg = tu_config(8, 4, 1, H, D, pool);
    pkv_cache *c = tu_create(&cfg);
    pkv_seq s = tu_seq(c);
    int32_t slots[NT];
    tu_append(c, s, NT, 0, slots);
    /* values: wide random magnitudes for rows 0..11, exactly representable ones for 12..15 */
    static const float exact_f16[] = {0.0f, 1.0f, -1.0f, 0.5f, 1.5f, -2.25f, 1024.0f, 1.0009765625f, 65504.0f,
                                      -0.0009765625f, 3.140625f, 6.103515625e-05f};
    static const float exact_bf16[] = {0.0f, 1.0f, -1.0f, 0.5f, 1.5f, -2.25f, 1024.0f, 1.0078125f,
                                       72057594037927936.0f /* PKV_VALUE_MAX */, -0.0009765625f, 3.140625f, 1.1754943508222875e-38f};
    const float *exact = pool == PKV_DTYPE_BF16 || in == PKV_DTYPE_BF16 ? exact_bf16 : exact_f16;
    tu_rng r;
    tu_rng_seed(&r, seed);
    float x[E];          /* the values the caller means, f32 */
    uint16_t x16[E];     /* their f16 / bf16 encoding when in != f32 */
    for (int i = 0; i < E; i++) {
        float v;
        if (i < 12 * H * D) v = tu_rng_float(&r) * ldexpf(1.0f, (int)tu_rng_below(&r, 16) - 8);
        else v = exact[tu_rng_below(&r, 12)] * (tu_rng_chance(&r, 0.5) ? 1.0f : -1.0f);
        if (pool == PKV_DTYPE_F16 || in == PKV_DTYPE_F16)
            if (fabsf(v) > 65000.0f) v = copysignf(exact == exact_f16 ? 65504.0f : 65024.0f, v);
        if (in == PKV_DTYPE_F16) {
            x16[i] = tu_f32_to_f16(v);
            v = tu_f16_to_f32(x16[i]);
        } else if (in == PKV_DTYPE_BF16) {
            x16[i] = tu_f32_to_bf16(v);
            v = tu_bf16_to_f32(x16[i]);
        }
        x[i] = v;
    }
    const void *src = in == PKV_DTYPE_F32 ? (const void *)x : (const void *)x16;
    TU_OK(pkv_write_kv(c, 0, slots, NT, src, src, in));
    pkv_layout L;
    TU_OK(pkv_cache_layout(c, &L));
    float g[E];
    TU_OK(pkv_seq_gather(c, s, 0, 0, NT, g, NULL));
    for (int t = 0; t < NT; t++)
        for (int h = 0; h < H; h++) {
            const uint8_t *row = elem_addr(&L, 0, 0, (uint32_t)slots[t], (uint32_t)h);
            const uint8_t *vrow = elem_addr(&L, 1, 0, (uint32_t)slots[t], (uint32_t)h);
            for (int d = 0; d < D; d++) {
                int i = (t * H + h) * D + d;
                float want;
                if (pool == PKV_DTYPE_F32) {
                    float got;
                    memcpy(&got, row + 4 * d, 4);
                    want = x[i];
                    assert_true(got == want); /* f16 / bf16 -> f32 is exact */
                } else {
                    uint16_t want_bits = pool == PKV_DTYPE_F16 ? tu_f32_to_f16(x[i]) : tu_f32_to_bf16(x[i]);
                    uint16_t got_bits = read_u16(row + 2 * d);
                    if (got_bits != want_bits)
                        fail_msg("pool %s in %s: element %d = %.9g stored as 0x%04x, want 0x%04x (RNE)",
                                 pkv_dtype_name(pool), pkv_dtype_name(in), i, (double)x[i], got_bits, want_bits);
                    assert_int_equal(read_u16(vrow + 2 * d), want_bits);
                    want = pool == PKV_DTYPE_F16 ? tu_f16_to_f32(want_bits) : tu_bf16_to_f32(want_bits);
                    double rel = pool == PKV_DTYPE_F16 ? ldexp(1.0, -11) : ldexp(1.0, -8);
                    /* the documented precision, for normal values */
                    if (fabsf(x[i]) >= (pool == PKV_DTYPE_F16 ? 6.103515625e-05f : 1.1754943508222875e-38f))
                        if (!(fabs((double)g[i] - (double)x[i]) <= rel * fabs((double)x[i])))
                            fail_msg("pool %s in %s: element %d = %.9g gathers as %.9g: relative error above 2^%d",
                                     pkv_dtype_name(pool), pkv_dtype_name(in), i, (double)x[i], (double)g[i],
                                     pool == PKV_DTYPE_F16 ? -11 : -8);
                }
                assert_true(g[i] == want); /* gather decodes exactly what is stored */
                if (t >= 12 && (in == pool || pool == PKV_DTYPE_F32 || in == PKV_DTYPE_F32))
                    assert_true(g[i] == x[i]); /* representable values survive exactly */
            }
        }
    TU_CHECK(c);
    pkv_cache_destroy(c);
}

static void test_conversions(void **state) {
    (void)state;
    const pkv_dtype dts[3] = {PKV_DTYPE_F32, PKV_DTYPE_F16, PKV_DTYPE_BF16};
    for (int p = 0; p < 3; p++)
        for (int i = 0; i < 3; i++) run_conversion(dts[p], dts[i], 1000 + 3 * p + i);
}

/* ---- exports: dense (vLLM) and CSR (FlashInfer) against the block tables ---- */
static void test_exports(void **state) {
    (void)state;
    pkv_config cfg = tu_config(32, 4, 1, 1, 4, PKV_DTYPE_F32);
    pkv_cache *c = tu_create(&cfg);
    const uint32_t lens[5] = {0, 3, 4, 9, 1};
    pkv_seq s[5];
    for (int i = 0; i < 5; i++) s[i] = tu_seq(c);
    /* interleave growth so tables are not contiguous ranges */
    for (uint32_t step = 0; step < 9; step++)
        for (int i = 0; i < 5; i++)
            if (step < lens[i]) tu_append(c, s[i], 1, (int32_t)step, NULL);
    int32_t tabs[5][8];
    uint32_t ntab[5];
    for (int i = 0; i < 5; i++) ntab[i] = tu_table(c, s[i], tabs[i], 8);
    assert_int_equal(ntab[0], 0);
    assert_int_equal(ntab[1], 1);
    assert_int_equal(ntab[2], 1);
    assert_int_equal(ntab[3], 3);
    assert_int_equal(ntab[4], 1);
    /* dense with room for 4 blocks */
    int32_t bt[5 * 4], sl[5];
    memset(bt, 0x7f, sizeof bt);
    memset(sl, 0x7f, sizeof sl);
    TU_OK(pkv_export_dense(c, s, 5, 4, bt, sl));
    for (int i = 0; i < 5; i++) {
        assert_int_equal(sl[i], (int32_t)lens[i]);
        for (uint32_t j = 0; j < 4; j++) assert_int_equal(bt[i * 4 + j], j < ntab[i] ? tabs[i][j] : -1);
    }
    /* exactly enough room: 3 */
    int32_t bt3[5 * 3];
    TU_OK(pkv_export_dense(c, s, 5, 3, bt3, sl));
    for (int i = 0; i < 5; i++)
        for (uint32_t j = 0; j < 3; j++) assert_int_equal(bt3[i * 3 + j], j < ntab[i] ? tabs[i][j] : -1);
    /* too small: EINVAL, nothing written */
    int32_t bt2[5 * 2], sl2[5];
    memset(bt2, 0x55, sizeof bt2);
    memset(sl2, 0x55, sizeof sl2);
    TU_RC(pkv_export_dense(c, s, 5, 2, bt2, sl2), PKV_EINVAL);
    for (int i = 0; i < 10; i++) assert_int_equal(bt2[i], 0x55555555);
    for (int i = 0; i < 5; i++) assert_int_equal(sl2[i], 0x55555555);
    /* one sequence's table too small for its 3 blocks: EINVAL, nothing copied, *n_out = 3 */
    int n_checked = 0;
    for (int i = 0; i < 5; i++) {
        if (ntab[i] < 3) continue;
        n_checked++;
        int32_t one[2] = {0x55555555, 0x55555555};
        uint32_t n_out = 77;
        TU_RC(pkv_seq_block_table(c, s[i], one, 2, &n_out), PKV_EINVAL);
        assert_int_equal(n_out, ntab[i]);
        assert_int_equal(one[0], 0x55555555);
        assert_int_equal(one[1], 0x55555555);
    }
    assert_true(n_checked > 0);
    /* a subset in another order */
    pkv_seq sub[2] = {s[3], s[1]};
    TU_OK(pkv_export_dense(c, sub, 2, 3, bt3, sl));
    assert_int_equal(sl[0], 9);
    assert_int_equal(sl[1], 3);
    assert_memory_equal(bt3, tabs[3], 3 * sizeof(int32_t));
    assert_int_equal(bt3[3], tabs[1][0]);
    assert_int_equal(bt3[4], -1);

    /* CSR */
    int32_t indptr[6], idx[16], lpl[5];
    uint32_t need = 0;
    memset(idx, 0x7f, sizeof idx);
    TU_OK(pkv_export_csr(c, s, 5, indptr, idx, 16, lpl, &need));
    assert_int_equal(need, 6);
    int32_t acc = 0;
    assert_int_equal(indptr[0], 0);
    for (int i = 0; i < 5; i++) {
        for (uint32_t j = 0; j < ntab[i]; j++) assert_int_equal(idx[acc + (int32_t)j], tabs[i][j]);
        acc += (int32_t)ntab[i];
        assert_int_equal(indptr[i + 1], acc);
    }
    assert_int_equal(idx[6], 0x7f7f7f7f); /* nothing past indptr[n] */
    const int32_t want_lpl[5] = {0, 3, 4, 1, 1};
    for (int i = 0; i < 5; i++) assert_int_equal(lpl[i], want_lpl[i]);
    /* exactly enough, n_needed may be NULL */
    TU_OK(pkv_export_csr(c, s, 5, indptr, idx, 6, lpl, NULL));
    /* too small: EINVAL, n_needed says 6, nothing written to the arrays */
    int32_t indptr2[6], idx2[5], lpl2[5];
    memset(indptr2, 0x55, sizeof indptr2);
    memset(idx2, 0x55, sizeof idx2);
    memset(lpl2, 0x55, sizeof lpl2);
    need = 0;
    TU_RC(pkv_export_csr(c, s, 5, indptr2, idx2, 5, lpl2, &need), PKV_EINVAL);
    assert_int_equal(need, 6);
    for (int i = 0; i < 5; i++) assert_int_equal(idx2[i], 0x55555555);
    for (int i = 0; i < 5; i++) assert_int_equal(lpl2[i], 0x55555555);
    for (int i = 0; i < 6; i++) assert_int_equal(indptr2[i], 0x55555555);
    /* zero sequences */
    indptr[0] = 77;
    TU_OK(pkv_export_csr(c, s, 0, indptr, idx, 0, lpl, &need));
    assert_int_equal(indptr[0], 0);
    assert_int_equal(need, 0);
    TU_OK(pkv_export_dense(c, s, 0, 4, bt, sl));
    TU_CHECK(c);
    pkv_cache_destroy(c);
}

/* ---- stats on a scripted scenario (B = 4, 16 blocks) ---- */
static void assert_stats(pkv_cache *c, uint32_t active, uint32_t seqs, uint64_t tokens, uint64_t used,
                         uint64_t cow, uint32_t peak) {
    pkv_stats st = tu_stats(c);
    assert_int_equal(st.n_blocks, 16);
    assert_int_equal(st.n_active, active);
    assert_int_equal(st.n_cached, 0);
    assert_int_equal(st.n_free, 16 - active);
    assert_int_equal(st.n_seqs, seqs);
    assert_int_equal(st.n_pins, 0);
    assert_int_equal(st.n_tokens, tokens);
    assert_int_equal(st.n_slots_used, used);
    assert_int_equal(st.frag_slots, (uint64_t)active * 4 - used);
    assert_int_equal(st.cow_copies, cow);
    assert_int_equal(st.peak_active, peak);
    assert_int_equal(st.n_indexed, 0);
    assert_int_equal(st.evictions, 0);
    assert_int_equal(st.prefix_lookups, 0);
    /* 2 layers x (K + V) x 2 heads x 4 tokens x 8 dims x 4 bytes */
    assert_int_equal(st.kv_bytes_per_block, 2 * 2 * 2 * 4 * 8 * 4);
    assert_int_equal(st.kv_bytes, 16 * st.kv_bytes_per_block);
    TU_CHECK(c);
}

static void test_stats_scripted(void **state) {
    (void)state;
    tu_alloc_state as;
    tu_alloc_reset(&as, -1);
    pkv_config cfg = tu_config(16, 4, 2, 2, 8, PKV_DTYPE_F32);
    cfg.allocator = tu_allocator(&as);
    pkv_cache *c = tu_create(&cfg);
    pkv_stats st0 = tu_stats(c);
    /* every byte the cache allocated is either pool (kv_bytes) or metadata (meta_bytes) */
    assert_int_equal(st0.kv_bytes + st0.meta_bytes, as.live_bytes);
    assert_true(st0.meta_bytes > 0);
    assert_stats(c, 0, 0, 0, 0, 0, 0);

    pkv_seq s1 = tu_seq(c);
    tu_append(c, s1, 6, 0, NULL); /* [0,1], fill 4+2 */
    assert_stats(c, 2, 1, 6, 6, 0, 2);
    pkv_seq s2;
    TU_OK(pkv_seq_fork(c, s1, &s2)); /* shares [0,1]: slots counted once */
    assert_stats(c, 2, 2, 12, 6, 0, 2);
    tu_append(c, s2, 1, 6, NULL); /* CoW of block 1 into 2: fill 3 */
    assert_stats(c, 3, 2, 13, 4 + 2 + 3, 1, 3);
    pkv_seq s3 = tu_seq(c);
    tu_append(c, s3, 9, 0, NULL); /* [3,4,5] */
    assert_stats(c, 6, 3, 22, 9 + 9, 1, 6);
    TU_OK(pkv_seq_release(c, s3)); /* free queue: 6..15, then 5,4,3 (deepest first) */
    assert_stats(c, 3, 2, 13, 9, 1, 6);
    TU_OK(pkv_seq_truncate(c, s1, 4)); /* block 1 only s1's: freed -> queue ..., 5, 4, 3, 1 */
    assert_stats(c, 2, 2, 11, 4 + 3, 1, 6);
    tu_append(c, s1, 1, 4, NULL); /* new tail block from the queue front: 6 */
    int32_t tab[8];
    assert_int_equal(tu_table(c, s1, tab, 8), 2);
    assert_int_equal(tab[0], 0);
    assert_int_equal(tab[1], 6);
    assert_int_equal(tu_table(c, s2, tab, 8), 2);
    assert_int_equal(tab[0], 0);
    assert_int_equal(tab[1], 2);
    assert_stats(c, 3, 2, 12, 4 + 1 + 3, 1, 6);
    /* drain the queue: 7..15 (9 blocks), then the freed ones in their release order 5,4,3,1 */
    pkv_seq s4 = tu_seq(c);
    tu_append(c, s4, 4 * 13, 0, NULL);
    int32_t t4[16];
    assert_int_equal(tu_table(c, s4, t4, 16), 13);
    for (int i = 0; i < 9; i++) assert_int_equal(t4[i], 7 + i);
    assert_int_equal(t4[9], 5);
    assert_int_equal(t4[10], 4);
    assert_int_equal(t4[11], 3);
    assert_int_equal(t4[12], 1);
    assert_stats(c, 16, 3, 64, 8 + 52, 1, 16);
    TU_OK(pkv_seq_release(c, s4));
    TU_OK(pkv_seq_release(c, s1));
    TU_OK(pkv_seq_release(c, s2));
    assert_stats(c, 0, 0, 0, 0, 1, 16);
    pkv_stats st1 = tu_stats(c);
    assert_int_equal(st1.meta_bytes, st0.meta_bytes);
    /* reset: everything FREE, counters of blocks consistent */
    TU_OK(pkv_cache_reset(c));
    pkv_stats st2 = tu_stats(c);
    assert_int_equal(st2.n_free, 16);
    assert_int_equal(st2.n_seqs, 0);
    TU_CHECK(c);
    pkv_cache_destroy(c);
    assert_int_equal(as.live_bytes, 0);
    assert_int_equal(as.n_bad_free, 0);
}

/* ---- configuration round trip and defaults ---- */
/* Rows that do not fill whole cache lines (odd head_dim): every layer's K and V arrays still
 * start 64-byte aligned (ARCHITECTURE 3), so the kernels' typed loads of a later layer are
 * aligned (this test runs under UBSan, which traps on a misaligned float load), and attention
 * and gather on the last layer read back what was written. */
static void test_layout_odd_rows_aligned(void **state) {
    (void)state;
    static const pkv_dtype pairs[][2] = {{PKV_DTYPE_F32, PKV_DTYPE_F16},  {PKV_DTYPE_F16, PKV_DTYPE_F32},
                                         {PKV_DTYPE_BF16, PKV_DTYPE_F16}, {PKV_DTYPE_F16, PKV_DTYPE_BF16},
                                         {PKV_DTYPE_F32, PKV_DTYPE_FP8_E4M3}};
    static const uint32_t dims[] = {3, 5};
    for (size_t pi = 0; pi < sizeof pairs / sizeof *pairs; pi++)
        for (size_t di = 0; di < 2; di++) {
            const uint32_t D = dims[di], NL = 3;
            pkv_config cfg = tu_config(5, 1, NL, 1, D, PKV_DTYPE_F32);
            cfg.k_dtype = pairs[pi][0], cfg.v_dtype = pairs[pi][1];
            pkv_cache *c = tu_create(&cfg);
            pkv_layout L;
            TU_OK(pkv_cache_layout(c, &L));
            assert_int_equal(L.layer_stride_bytes % 64, 0);
            for (uint32_t l = 0; l < NL; l++) {
                assert_int_equal((uintptr_t)(L.k_base + l * L.layer_stride_bytes) % 64, 0);
                assert_int_equal((uintptr_t)(L.v_base + l * L.layer_stride_bytes) % 64, 0);
                /* the arrays do not overlap: K, then V, then the next layer's K */
                assert_true(L.v_base - L.k_base >= (ptrdiff_t)(L.n_blocks * L.k_block_bytes));
                assert_true(L.layer_stride_bytes >= (size_t)(L.v_base - L.k_base) + L.n_blocks * L.v_block_bytes);
            }
            /* 3 tokens on the last layer; values exact in every format here (fp8: one scale a row,
             * its largest value 2 maps to 448 exactly) */
            pkv_seq s = tu_seq(c);
            int32_t slots[3];
            tu_append(c, s, 3, 0, slots);
            float k[3][5], v[3][5], q[5], out[5], gk[15], gv[15];
            for (uint32_t t = 0; t < 3; t++)
                for (uint32_t d = 0; d < D; d++) k[t][d] = 0.25f * (float)(t + d), v[t][d] = d == 0 ? 2.0f : -0.5f * (float)t;
            for (uint32_t d = 0; d < D; d++) q[d] = 1.0f;
            float kk[15], vv[15];
            for (uint32_t t = 0; t < 3; t++)
                for (uint32_t d = 0; d < D; d++) kk[t * D + d] = k[t][d], vv[t * D + d] = v[t][d];
            TU_OK(pkv_write_kv(c, NL - 1, slots, 3, kk, vv, PKV_DTYPE_F32));
            pkv_attn_params p = pkv_attn_params_default();
            p.window = 1; /* the last position alone: out is its V */
            TU_OK(pkv_attn_decode(c, NL - 1, &s, 1, q, out, &p));
            for (uint32_t d = 0; d < D; d++) TU_NEAR(out[d], v[2][d], 1e-6f);
            TU_OK(pkv_seq_gather(c, s, NL - 1, 0, 3, gk, gv));
            for (uint32_t t = 0; t < 3; t++)
                for (uint32_t d = 0; d < D; d++) {
                    TU_NEAR(gk[t * D + d], k[t][d], 1e-6f);
                    TU_NEAR(gv[t * D + d], v[t][d], 1e-6f);
                }
            TU_CHECK(c);
            pkv_cache_destroy(c);
        }
}

static void test_config_roundtrip(void **state) {
    (void)state;
    pkv_config d = pkv_config_default();
    assert_int_equal(d.n_layers, 1);
    assert_int_equal(d.n_kv_heads, 8);
    assert_int_equal(d.head_dim, 128);
    assert_int_equal(d.block_tokens, 16);
    assert_int_equal(d.n_blocks, 1024);
    assert_int_equal(d.k_dtype, PKV_DTYPE_F16);
    assert_int_equal(d.v_dtype, PKV_DTYPE_F16);
    assert_int_equal(d.max_seqs, 256);
    assert_int_equal(d.enable_prefix_cache, 1);
    pkv_config cfg = tu_config(20, 8, 2, 1, 16, PKV_DTYPE_F32);
    pkv_cache *c = tu_create(&cfg);
    pkv_config e;
    TU_OK(pkv_cache_config(c, &e));
    assert_int_equal(e.n_blocks, 20);
    assert_int_equal(e.block_tokens, 8);
    assert_int_equal(e.n_layers, 2);
    assert_int_equal(e.max_blocks_per_seq, 20); /* 0 resolves to min(n_blocks, 65536) */
    assert_int_equal(e.n_threads, 1);
    pkv_cache_destroy(c);
    cfg.n_threads = 256; /* the most a cache takes (pkv.h), reported as asked */
    c = tu_create(&cfg);
    TU_OK(pkv_cache_config(c, &e));
    assert_int_equal(e.n_threads, 256);
    pkv_cache_destroy(c);
    cfg.n_threads = 0; /* all online cpus */
    c = tu_create(&cfg);
    TU_OK(pkv_cache_config(c, &e));
    assert_true(e.n_threads >= 1 && e.n_threads <= 256);
    pkv_cache_destroy(c);
    cfg.n_threads = 1;
    /* n_blocks from the budget: 1 layer, 1 head, D 16, B 8, f32: 2 * 8 * 16 * 4 = 1024 B/block */
    cfg.n_blocks = 0;
    cfg.n_layers = 1;
    cfg.mem_budget_bytes = 10 * 1024 + 1000;
    c = tu_create(&cfg);
    TU_OK(pkv_cache_config(c, &e));
    assert_int_equal(e.n_blocks, 10);
    pkv_stats st = tu_stats(c);
    assert_int_equal(st.kv_bytes, 10 * 1024);
    pkv_cache_destroy(c);
    /* pkv.h: max_blocks_per_seq 0 = min(n_blocks, 4096) */
    cfg = tu_config(70000, 1, 1, 1, 1, PKV_DTYPE_F32);
    cfg.max_seqs = 2;
    c = tu_create(&cfg);
    TU_OK(pkv_cache_config(c, &e));
    assert_int_equal(e.max_blocks_per_seq, 4096);
    pkv_cache_destroy(c);
    cfg.n_blocks = 3000;
    c = tu_create(&cfg);
    TU_OK(pkv_cache_config(c, &e));
    assert_int_equal(e.max_blocks_per_seq, 3000);
    pkv_seq s = tu_seq(c);
    tu_append(c, s, 3000, 0, NULL); /* one sequence may hold the whole pool */
    assert_int_equal(tu_info(c, s).n_blocks, 3000);
    pkv_cache_destroy(c);
}

/* The log hook (pkv.h: the library never prints, it reports through the hook): one INFO line at
 * creation that names the pool's shape and the attention backend; after it, one PKV_LOG_ERROR
 * message for each refused call saying why (none for a sizing answer, none from calls that
 * succeed); a NULL hook stays silent. */
typedef struct log_rec {
    int n, level;
    char msg[512];
} log_rec;

static void record_log(void *ctx, int level, const char *msg) {
    log_rec *r = ctx;
    r->n++;
    r->level = level;
    snprintf(r->msg, sizeof r->msg, "%s", msg);
}

static void test_log_hook(void **state) {
    (void)state;
    log_rec rec = {0};
    pkv_config cfg = tu_config(20, 8, 2, 1, 16, PKV_DTYPE_F32);
    cfg.log = record_log;
    cfg.log_ctx = &rec;
    pkv_cache *c = tu_create(&cfg);
    assert_int_equal(rec.n, 1);
    assert_int_equal(rec.level, PKV_LOG_INFO);
    const char *head = "pkv: cache of 20 blocks x 8 tokens, 2 layers, ";
    assert_memory_equal(rec.msg, head, strlen(head));
    char tail[64];
    snprintf(tail, sizeof tail, ", attention %s x1", pkv_attn_backend(c));
    const size_t n = strlen(rec.msg), m = strlen(tail);
    assert_true(n > m);
    assert_string_equal(rec.msg + n - m, tail);
    pkv_seq s = tu_seq(c);
    int32_t slots[8];
    tu_append(c, s, 8, 0, slots);
    /* each refusal says why, once, at PKV_LOG_ERROR, named after the call */
    assert_int_equal(pkv_seq_append(c, s, NULL, 3, NULL), PKV_EINVAL);
    assert_int_equal(rec.n, 2);
    assert_int_equal(rec.level, PKV_LOG_ERROR);
    assert_string_equal(rec.msg, "pkv_seq_append: tokens is NULL, n 3");
    assert_int_equal(pkv_seq_truncate(c, s + 1, 0), PKV_ENOENT);
    assert_int_equal(rec.n, 3);
    char want[160];
    snprintf(want, sizeof want, "pkv_seq_truncate: sequence %#llx is unknown: never made, released, or another cache's",
             (unsigned long long)(s + 1));
    assert_string_equal(rec.msg, want);
    float kv[8 * 16] = {0}, q[16] = {0}, out[16];
    TU_OK(pkv_write_kv(c, 0, slots, 8, kv, kv, PKV_DTYPE_F32));
    TU_OK(pkv_seq_commit(c, s, 8));
    assert_int_equal(pkv_write_kv(c, 0, slots + 5, 1, kv, kv, PKV_DTYPE_F32), PKV_EINVAL);
    assert_int_equal(rec.n, 4);
    snprintf(want, sizeof want, "pkv_write_kv: slot %d (row 0) is a committed position: read-only", slots[5]);
    assert_string_equal(rec.msg, want);
    pkv_attn_params p = pkv_attn_params_default();
    p.n_q_heads = 1025;
    assert_int_equal(pkv_attn_decode(c, 0, &s, 1, q, out, &p), PKV_EINVAL);
    assert_int_equal(rec.n, 5);
    assert_string_equal(rec.msg, "pkv_attn_decode: n_q_heads 1025 over 1024 x n_kv_heads 1");
    q[3] = NAN;
    assert_int_equal(pkv_attn_decode(c, 0, &s, 1, q, out, NULL), PKV_EINVAL);
    assert_int_equal(rec.n, 6);
    assert_string_equal(rec.msg, "pkv_attn_decode: a query element is not finite, or |q| x scale is past PKV_VALUE_MAX");
    q[3] = 0;
    /* the sizing answer of pkv_seq_block_table is not said; calls that succeed say nothing */
    uint32_t need = 0;
    assert_int_equal(pkv_seq_block_table(c, s, NULL, 0, &need), PKV_EINVAL);
    assert_int_equal(need, 1);
    TU_OK(pkv_attn_decode(c, 0, &s, 1, q, out, NULL));
    TU_OK(pkv_seq_release(c, s));
    TU_CHECK(c);
    pkv_cache_destroy(c);
    assert_int_equal(rec.n, 6);
    cfg.log = NULL; /* silent, whatever log_ctx holds */
    c = tu_create(&cfg);
    assert_int_equal(pkv_seq_append(c, PKV_SEQ_NONE, NULL, 3, NULL), PKV_EINVAL);
    pkv_cache_destroy(c);
    assert_int_equal(rec.n, 6);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_blocks_needed),
        cmocka_unit_test(test_append_blocks),
        cmocka_unit_test(test_slots_block_table_5_10),
        cmocka_unit_test(test_layout_fields),
        cmocka_unit_test(test_layout_kv_gap),
        cmocka_unit_test(test_layout_odd_rows_aligned),
        cmocka_unit_test(test_reshape_boostr12),
        cmocka_unit_test(test_reshape_boostr13),
        cmocka_unit_test(test_write_k_only_v_only),
        cmocka_unit_test(test_seq_write_twins),
        cmocka_unit_test(test_seq_write_stale_slots),
        cmocka_unit_test(test_stored_transfer),
        cmocka_unit_test(test_stored_rows),
        cmocka_unit_test(test_conversions),
        cmocka_unit_test(test_exports),
        cmocka_unit_test(test_stats_scripted),
        cmocka_unit_test(test_config_roundtrip),
        cmocka_unit_test(test_log_hook),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
