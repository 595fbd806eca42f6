/* test_quant_cache.c: quantized K/V through the public API: caches with q8_0 / q4_0 / fp8 K
 * and V (mixed too), K/V writes from f32 / f16 / bf16 input (pool bytes equal the scalar
 * reference encoding of the converted input), gather (dequantized, bit-exact decode, within
 * each format's bound), fork + append copy-on-write (quantized bytes copied, not
 * re-quantized) and decode / prefill attention against a double-precision oracle. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pkv.h"
#include "quant/quant.h"
#include "support_util.h"

static const pkv_dtype k_qdts[3] = {PKV_DTYPE_Q8_0, PKV_DTYPE_Q4_0, PKV_DTYPE_FP8_E4M3};

static uint64_t rng = 0x853c49e6748fea9bull;
static uint32_t rnd(void) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (uint32_t)(rng >> 11);
}
static float rnd_normal(void) {
    float u = ((float)(rnd() >> 8) + 0.5f) / 16777216.0f, w = (float)(rnd() >> 8) / 16777216.0f;
    return sqrtf(-2.0f * logf(u)) * cosf(6.2831853f * w);
}

/* Scalar reference encoders, independent of the dispatched (SIMD) path the cache uses. */
static void ref_encode(pkv_dtype dt, const float *x, uint32_t d, void *dst) {
    switch (dt) {
    case PKV_DTYPE_Q8_0: pkv__q8_0_encode_ref(x, d, dst); break;
    case PKV_DTYPE_Q4_0: pkv__q4_0_encode_ref(x, d, dst); break;
    case PKV_DTYPE_FP8_E4M3: pkv__fp8_encode_ref(x, d, dst); break;
    default: pkv__row_encode(dt, x, d, dst); break;
    }
}
static void ref_decode(pkv_dtype dt, const void *src, uint32_t d, float *y) {
    switch (dt) {
    case PKV_DTYPE_Q8_0: pkv__q8_0_decode_ref(src, d, y); break;
    case PKV_DTYPE_Q4_0: pkv__q4_0_decode_ref(src, d, y); break;
    case PKV_DTYPE_FP8_E4M3: pkv__fp8_decode_ref(src, d, y); break;
    default: pkv__row_decode(dt, src, d, y); break;
    }
}

/* The per-element bound quant.h states, read from the stored row (d normal here). */
static float elem_bound(pkv_dtype dt, const uint8_t *row, uint32_t i, float x) {
    switch (dt) {
    case PKV_DTYPE_Q8_0: {
        uint16_t h;
        memcpy(&h, row + (i / 32) * 34, 2);
        return pkv__f16_to_f32(h) / 2 * (1 + 1e-6f) + 1e-30f;
    }
    case PKV_DTYPE_Q4_0: {
        uint16_t h;
        memcpy(&h, row + (i / 32) * 18, 2);
        return fabsf(pkv__f16_to_f32(h)) * (1 + 1e-6f) + 1e-30f; /* |d| / 2 except the clamped top */
    }
    case PKV_DTYPE_FP8_E4M3: {
        float s;
        memcpy(&s, row, 4);
        return fmaxf(fabsf(x) / 16, s / 1024) * (1 + 1e-5f);
    }
    case PKV_DTYPE_F16: return fabsf(x) * 0x1p-11f + 0x1p-25f;
    case PKV_DTYPE_BF16: return fabsf(x) * 0x1p-8f;
    default: return 0;
    }
}

static const uint8_t *row_addr(const pkv_layout *L, int is_v, uint32_t layer, int32_t slot, uint32_t h) {
    const uint32_t B = L->block_tokens;
    const uint8_t *base = (is_v ? L->v_base : L->k_base) + (size_t)layer * L->layer_stride_bytes;
    size_t blk = is_v ? L->v_block_bytes : L->k_block_bytes, row = is_v ? L->v_row_bytes : L->k_row_bytes;
    return base + (size_t)(slot / (int32_t)B) * blk + ((size_t)h * B + (size_t)(slot % (int32_t)B)) * row;
}

/* ---- configs and sizes ---- */
static void test_create_and_row_bytes(void **state) {
    (void)state;
    for (int kd = 0; kd < PKV_DTYPE_COUNT; kd++)
        for (int vd = 0; vd < PKV_DTYPE_COUNT; vd++) {
            pkv_config cfg = tu_config(8, 16, 2, 2, 64, (pkv_dtype)kd);
            cfg.v_dtype = (pkv_dtype)vd;
            pkv_cache *c = tu_create(&cfg);
            pkv_layout L;
            assert_int_equal(pkv_cache_layout(c, &L), 0);
            assert_int_equal(L.k_row_bytes, pkv_dtype_row_bytes((pkv_dtype)kd, 64));
            assert_int_equal(L.v_row_bytes, pkv_dtype_row_bytes((pkv_dtype)vd, 64));
            assert_int_equal(L.k_block_bytes, 2 * 16 * L.k_row_bytes);
            pkv_cache_destroy(c);
        }
    /* q8_0 / q4_0 need head_dim % 32 == 0; fp8 takes any head_dim */
    for (int i = 0; i < 2; i++) {
        pkv_config cfg = tu_config(8, 16, 1, 2, 48, k_qdts[i]);
        cfg.v_dtype = PKV_DTYPE_F16;
        pkv_cache *c = NULL;
        assert_int_equal(pkv_cache_create(&cfg, &c), PKV_EINVAL);
        assert_null(c);
        cfg.k_dtype = PKV_DTYPE_F16, cfg.v_dtype = k_qdts[i];
        assert_int_equal(pkv_cache_create(&cfg, &c), PKV_EINVAL);
    }
    pkv_config cfg = tu_config(8, 16, 1, 2, 48, PKV_DTYPE_FP8_E4M3);
    pkv_cache *c = tu_create(&cfg);
    pkv_cache_destroy(c);
    /* bytes per token per layer (K + V), Llama-like 8 kv heads x 128: the report's table */
    static const size_t want[PKV_DTYPE_COUNT] = {8192, 4096, 4096, 2176, 1152, 2112};
    for (int dt = 0; dt < PKV_DTYPE_COUNT; dt++) {
        size_t b = pkv_dtype_row_bytes((pkv_dtype)dt, 128) * 8 * 2;
        assert_int_equal(b, want[dt]);
        print_message("  %-8s %5zu bytes per token per layer (8 kv heads x 128, K + V): %.3fx f16\n",
                      pkv_dtype_name((pkv_dtype)dt), b, (double)b / 4096);
    }
}

/* ---- writes and gather ---- */
/* shift: the input's byte offset from an aligned address (pkv_write_kv takes k and v at any
 * address: const void *). */
static void write_gather_case_at(pkv_dtype kdt, pkv_dtype vdt, pkv_dtype in, uint32_t D, size_t shift) {
    const uint32_t H = 2, NT = 37, LAYER = 1;
    pkv_config cfg = tu_config(8, 16, 2, H, D, kdt);
    cfg.v_dtype = vdt;
    pkv_cache *c = tu_create(&cfg);
    pkv_seq s = tu_seq(c);
    int32_t slots[37];
    tu_append(c, s, NT, 100, slots);
    const size_t E = (size_t)NT * H * D;
    float *xk = malloc(E * 4), *xv = malloc(E * 4), *ck = malloc(E * 4), *cv = malloc(E * 4);
    uint16_t *hk = malloc(E * 2), *hv = malloc(E * 2);
    for (size_t i = 0; i < E; i++) {
        xk[i] = rnd_normal() * (1 + (float)(i % D) / 16), xv[i] = rnd_normal();
        if (rnd() % 500 == 0) xk[i] *= 30;
    }
    /* the input as the caller passes it, and the f32 values the library must see */
    for (size_t i = 0; i < E; i++) {
        if (in == PKV_DTYPE_F16) hk[i] = pkv__f32_to_f16(xk[i]), hv[i] = pkv__f32_to_f16(xv[i]);
        if (in == PKV_DTYPE_BF16) hk[i] = pkv__f32_to_bf16(xk[i]), hv[i] = pkv__f32_to_bf16(xv[i]);
    }
    if (in == PKV_DTYPE_F32) memcpy(ck, xk, E * 4), memcpy(cv, xv, E * 4);
    else pkv__to_f32(in, hk, E, ck), pkv__to_f32(in, hv, E, cv);
    const size_t in_bytes = E * (in == PKV_DTYPE_F32 ? 4 : 2);
    uint8_t *buf_k = malloc(in_bytes + 8), *buf_v = malloc(in_bytes + 8);
    memcpy(buf_k + shift, in == PKV_DTYPE_F32 ? (const void *)xk : (const void *)hk, in_bytes);
    memcpy(buf_v + shift, in == PKV_DTYPE_F32 ? (const void *)xv : (const void *)hv, in_bytes);
    const void *src_k = buf_k + shift, *src_v = buf_v + shift;
    /* token 5 is padding (slot -1): its rows keep whatever bytes they had */
    int32_t wslots[37];
    memcpy(wslots, slots, sizeof wslots);
    wslots[5] = -1;
    pkv_layout L;
    assert_int_equal(pkv_cache_layout(c, &L), 0);
    uint8_t before[2][2][4 + 2 * 256];
    for (int is_v = 0; is_v < 2; is_v++)
        for (uint32_t h = 0; h < H; h++)
            memcpy(before[is_v][h], row_addr(&L, is_v, LAYER, slots[5], h), is_v ? L.v_row_bytes : L.k_row_bytes);
    assert_int_equal(pkv_write_kv(c, LAYER, wslots, NT, src_k, src_v, in), 0);
    float *gk = malloc(E * 4), *gv = malloc(E * 4), *dec = malloc(D * 4);
    assert_int_equal(pkv_seq_gather(c, s, LAYER, 0, NT, gk, gv), 0);
    uint8_t *want = malloc(pkv_dtype_row_bytes(kdt, D) + pkv_dtype_row_bytes(vdt, D));
    for (uint32_t t = 0; t < NT; t++)
        for (uint32_t h = 0; h < H; h++) {
            const size_t o = ((size_t)t * H + h) * D;
            for (int is_v = 0; is_v < 2; is_v++) {
                const pkv_dtype dt = is_v ? vdt : kdt;
                const size_t rb = pkv_dtype_row_bytes(dt, D);
                const uint8_t *row = row_addr(&L, is_v, LAYER, slots[t], h);
                const float *x = (is_v ? cv : ck) + o, *g = (is_v ? gv : gk) + o;
                if (t == 5) { /* skipped */
                    assert_memory_equal(row, before[is_v][h], rb);
                    continue;
                }
                ref_encode(dt, x, D, want);
                if (memcmp(row, want, rb) != 0)
                    fail_msg("%s pool bytes differ from the reference encoding (in %s, t %u, h %u)", pkv_dtype_name(dt),
                             pkv_dtype_name(in), t, h);
                ref_decode(dt, row, D, dec);
                assert_memory_equal(g, dec, D * 4); /* gather = exact decode of the stored row */
                for (uint32_t i = 0; i < D; i++) {
                    float err = fabsf(g[i] - x[i]), b = elem_bound(dt, row, i, x[i]);
                    if (!(err <= b)) /* written so that NaN fails */
                        fail_msg("%s gather err %g > bound %g (x %g)", pkv_dtype_name(dt), (double)err, (double)b, (double)x[i]);
                }
            }
        }
    TU_CHECK(c);
    free(xk), free(xv), free(ck), free(cv), free(hk), free(hv), free(gk), free(gv), free(dec), free(want);
    free(buf_k), free(buf_v);
    pkv_cache_destroy(c);
}

static void write_gather_case(pkv_dtype kdt, pkv_dtype vdt, pkv_dtype in, uint32_t D) {
    write_gather_case_at(kdt, vdt, in, D, 0);
}

static void test_write_gather_every_input(void **state) {
    (void)state;
    const pkv_dtype ins[3] = {PKV_DTYPE_F32, PKV_DTYPE_F16, PKV_DTYPE_BF16};
    for (int a = 0; a < 3; a++)
        for (int i = 0; i < 3; i++) {
            write_gather_case(k_qdts[a], k_qdts[a], ins[i], 64);
            write_gather_case(k_qdts[a], k_qdts[(a + 1) % 3], ins[i], 128); /* K and V differ */
        }
    write_gather_case(PKV_DTYPE_FP8_E4M3, PKV_DTYPE_F16, PKV_DTYPE_F32, 72); /* fp8, head_dim % 32 != 0 */
    write_gather_case(PKV_DTYPE_BF16, PKV_DTYPE_Q4_0, PKV_DTYPE_F16, 96);
    /* input at odd addresses: the same bytes stored (the sanitizer stage's UBSan checks that no
     * read of it assumes its type's alignment), head_dim 35 so vector bodies leave tails */
    const pkv_dtype pools[4] = {PKV_DTYPE_F32, PKV_DTYPE_F16, PKV_DTYPE_BF16, PKV_DTYPE_Q8_0};
    for (size_t shift = 1; shift < 4; shift++)
        for (int i = 0; i < 3; i++)
            for (int p = 0; p < 3; p++) {
                write_gather_case_at(pools[p], pools[(p + 1) % 3], ins[i], 35, shift);
                write_gather_case_at(pools[p], pools[3], ins[i], 64, shift);
            }
}

/* ---- fork + append: copy-on-write copies the quantized bytes ---- */
static void test_fork_cow_keeps_bytes(void **state) {
    (void)state;
    for (int a = 0; a < 3; a++) {
        const uint32_t H = 2, D = 64, NL = 2;
        pkv_config cfg = tu_config(8, 16, NL, H, D, k_qdts[a]);
        cfg.v_dtype = k_qdts[(a + 2) % 3];
        pkv_cache *c = tu_create(&cfg);
        pkv_seq p = tu_seq(c);
        int32_t slots[21];
        tu_append(c, p, 20, 0, slots);
        float *k = malloc(20 * H * D * 4), *v = malloc(20 * H * D * 4);
        for (uint32_t l = 0; l < NL; l++) {
            for (uint32_t i = 0; i < 20 * H * D; i++) k[i] = rnd_normal(), v[i] = rnd_normal() * 3;
            assert_int_equal(pkv_write_kv(c, l, slots, 20, k, v, PKV_DTYPE_F32), 0);
        }
        assert_int_equal(pkv_seq_commit(c, p, 20), 0);
        float *pk0 = malloc(20 * H * D * 4), *pv0 = malloc(20 * H * D * 4);
        float *g1 = malloc(21 * H * D * 4), *g2 = malloc(21 * H * D * 4);
        assert_int_equal(pkv_seq_gather(c, p, 1, 0, 20, pk0, pv0), 0);

        pkv_seq ch;
        assert_int_equal(pkv_seq_fork(c, p, &ch), 0);
        pkv_stats st0 = tu_stats(c);
        int32_t cslot;
        tu_append(c, ch, 1, 20, &cslot); /* the shared tail block (positions 16..19) is copied */
        pkv_stats st1 = tu_stats(c);
        assert_int_equal(st1.cow_copies, st0.cow_copies + 1);
        int32_t tp[2], tc[2];
        assert_int_equal(tu_table(c, p, tp, 2), 2);
        assert_int_equal(tu_table(c, ch, tc, 2), 2);
        assert_int_equal(tp[0], tc[0]);
        assert_true(tp[1] != tc[1]);
        assert_int_equal(cslot, tc[1] * 16 + 4);
        pkv_layout L;
        assert_int_equal(pkv_cache_layout(c, &L), 0);
        for (uint32_t l = 0; l < NL; l++)
            for (uint32_t pos = 16; pos < 20; pos++)
                for (uint32_t h = 0; h < H; h++) {
                    assert_memory_equal(row_addr(&L, 0, l, tc[1] * 16 + (int32_t)(pos % 16), h),
                                        row_addr(&L, 0, l, tp[1] * 16 + (int32_t)(pos % 16), h), L.k_row_bytes);
                    assert_memory_equal(row_addr(&L, 1, l, tc[1] * 16 + (int32_t)(pos % 16), h),
                                        row_addr(&L, 1, l, tp[1] * 16 + (int32_t)(pos % 16), h), L.v_row_bytes);
                }
        /* the child writes its new position; the parent reads what it read before */
        for (uint32_t l = 0; l < NL; l++) {
            for (uint32_t i = 0; i < H * D; i++) k[i] = 100 + rnd_normal(), v[i] = -100 + rnd_normal();
            assert_int_equal(pkv_write_kv(c, l, &cslot, 1, k, v, PKV_DTYPE_F32), 0);
        }
        assert_int_equal(pkv_seq_gather(c, p, 1, 0, 20, g1, g2), 0);
        assert_memory_equal(g1, pk0, 20 * H * D * 4);
        assert_memory_equal(g2, pv0, 20 * H * D * 4);
        assert_int_equal(pkv_seq_gather(c, ch, 1, 0, 21, g1, g2), 0);
        assert_memory_equal(g1, pk0, 20 * H * D * 4);
        assert_memory_equal(g2, pv0, 20 * H * D * 4);
        for (uint32_t i = 0; i < H * D; i++) assert_true(fabsf(g1[20 * H * D + i] - k[i]) < 100 / 16.0f + 0.5f);
        TU_CHECK(c);
        free(k), free(v), free(pk0), free(pv0), free(g1), free(g2);
        pkv_cache_destroy(c);
    }
}

/* Compaction copies quantized rows (inline scales included) as bytes: a sequence interleaved
 * with another, whose blocks move once the other leaves, gathers the same bits in every layer,
 * a partly filled tail too, for every quantized K and V dtype. */
static void test_compact_keeps_bytes(void **state) {
    (void)state;
    enum { H = 2, D = 64, NL = 2, N = 40, E = N * H * D };
    for (int a = 0; a < 3; a++) {
        pkv_config cfg = tu_config(8, 16, NL, H, D, k_qdts[a]);
        cfg.v_dtype = k_qdts[(a + 1) % 3];
        pkv_cache *c = tu_create(&cfg);
        pkv_seq s = tu_seq(c), o = tu_seq(c);
        int32_t slots[N];
        tu_append(c, s, 16, 0, slots);            /* 0 */
        tu_append(c, o, 16, 100, NULL);           /* 1 */
        tu_append(c, s, N - 16, 16, slots + 16);  /* 2, 3 (8 of 16 slots) */
        float *k = malloc(E * 4), *v = malloc(E * 4), *before = malloc(2 * NL * E * 4), *after = malloc(2 * E * 4);
        for (uint32_t l = 0; l < NL; l++) {
            for (uint32_t i = 0; i < E; i++) k[i] = rnd_normal(), v[i] = rnd_normal() * 3;
            assert_int_equal(pkv_write_kv(c, l, slots, N, k, v, PKV_DTYPE_F32), 0);
            assert_int_equal(pkv_seq_gather(c, s, l, 0, N, before + 2 * l * E, before + (2 * l + 1) * E), 0);
        }
        TU_OK(pkv_seq_release(c, o));
        uint32_t moved = 0;
        TU_OK(pkv_seq_compact(c, s, 0, &moved)); /* 0 moves to 1: one copy, where 2, 3 to 1, 2 is two */
        assert_int_equal(moved, 1);
        int32_t tab[3];
        assert_int_equal(tu_table(c, s, tab, 3), 3);
        assert_int_equal(tab[0], 1);
        for (uint32_t l = 0; l < NL; l++) {
            assert_int_equal(pkv_seq_gather(c, s, l, 0, N, after, after + E), 0);
            assert_memory_equal(after, before + 2 * l * E, 2 * E * 4);
        }
        TU_CHECK(c);
        free(k), free(v), free(before), free(after);
        pkv_cache_destroy(c);
    }
}

/* ---- attention through the public API ---- */
/* Double-precision causal attention of one query over K/V [pos][H][D] (unquantized f32). */
static void oracle(const float *K, const float *V, uint32_t H, uint32_t G, uint32_t D, uint32_t n_vis, uint32_t qh,
                   const float *q, double *out) {
    const uint32_t h = qh / G;
    double mx = -INFINITY, l = 0, *s = malloc(n_vis * sizeof(double));
    for (uint32_t t = 0; t < n_vis; t++) {
        double a = 0;
        for (uint32_t d = 0; d < D; d++) a += (double)q[d] * K[((size_t)t * H + h) * D + d];
        s[t] = a / sqrt((double)D);
        mx = fmax(mx, s[t]);
    }
    for (uint32_t d = 0; d < D; d++) out[d] = 0;
    for (uint32_t t = 0; t < n_vis; t++) {
        double p = exp(s[t] - mx);
        l += p;
        for (uint32_t d = 0; d < D; d++) out[d] += p * V[((size_t)t * H + h) * D + d];
    }
    for (uint32_t d = 0; d < D; d++) out[d] /= l;
    free(s);
}

static void test_attention_public(void **state) {
    (void)state;
    /* (K, V) pairs and the NMSE bound of test_quant_attn.c's plain regime (the larger of K, V) */
    const struct {
        pkv_dtype k, v;
        double bound;
    } cases[] = {
        {PKV_DTYPE_Q8_0, PKV_DTYPE_Q8_0, 2e-3},       {PKV_DTYPE_Q4_0, PKV_DTYPE_Q4_0, 0.2},
        {PKV_DTYPE_FP8_E4M3, PKV_DTYPE_FP8_E4M3, 1e-2}, {PKV_DTYPE_Q8_0, PKV_DTYPE_Q4_0, 0.2},
        {PKV_DTYPE_FP8_E4M3, PKV_DTYPE_F16, 1e-2},      {PKV_DTYPE_F16, PKV_DTYPE_Q8_0, 2e-3},
    };
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const uint32_t H = 2, G = 4, D = 128, B = 16, NS = 3, NQH = H * G;
        double nmse[2] = {0};
        float *outs[2];
        for (int force_ref = 0; force_ref < 2; force_ref++) {
            rng = 0x1234567ull + ci; /* both caches get the same data */
            if (force_ref) setenv("PKV_FORCE_REF", "1", 1);
            pkv_config cfg = tu_config(64, B, 1, H, D, cases[ci].k);
            cfg.v_dtype = cases[ci].v;
            cfg.n_threads = 2;
            pkv_cache *c = tu_create(&cfg);
            unsetenv("PKV_FORCE_REF");
            if (force_ref) assert_string_equal(pkv_attn_backend(c), "ref");
            pkv_seq seqs[3];
            uint32_t len[3] = {1 + rnd() % 300, 1 + rnd() % 300, 1 + rnd() % 300};
            float *K[3], *V[3];
            /* fragment: interleave appends of the three sequences in small chunks */
            for (uint32_t s = 0; s < NS; s++) seqs[s] = tu_seq(c), K[s] = malloc((size_t)len[s] * H * D * 4), V[s] = malloc((size_t)len[s] * H * D * 4);
            uint32_t done[3] = {0};
            for (int more = 1; more;) {
                more = 0;
                for (uint32_t s = 0; s < NS; s++) {
                    const uint32_t chunk = 1 + rnd() % 20; /* not inside PKV_MIN: it evaluates twice */
                    const uint32_t n = PKV_MIN(len[s] - done[s], chunk);
                    if (!n) continue;
                    more = 1;
                    int32_t sl[20];
                    tu_append(c, seqs[s], n, (int32_t)done[s], sl);
                    float *k = K[s] + (size_t)done[s] * H * D, *v = V[s] + (size_t)done[s] * H * D;
                    for (uint32_t i = 0; i < n * H * D; i++) k[i] = rnd_normal() * (1 + (float)(i % D) / 64), v[i] = rnd_normal();
                    assert_int_equal(pkv_write_kv(c, 0, sl, n, k, v, PKV_DTYPE_F32), 0);
                    done[s] += n;
                }
            }
            float *q = malloc((size_t)NS * NQH * D * 4), *o = malloc((size_t)NS * NQH * D * 4);
            for (uint32_t i = 0; i < NS * NQH * D; i++) q[i] = rnd_normal();
            pkv_attn_params ap = pkv_attn_params_default();
            ap.n_q_heads = NQH;
            assert_int_equal(pkv_attn_decode(c, 0, seqs, NS, q, o, &ap), 0);
            double num = 0, den = 0, ref[128];
            for (uint32_t s = 0; s < NS; s++)
                for (uint32_t qh = 0; qh < NQH; qh++) {
                    oracle(K[s], V[s], H, G, D, len[s], qh, q + ((size_t)s * NQH + qh) * D, ref);
                    for (uint32_t d = 0; d < D; d++) {
                        double e = o[((size_t)s * NQH + qh) * D + d] - ref[d];
                        num += e * e, den += ref[d] * ref[d];
                    }
                }
            nmse[force_ref] = num / den;
            if (!(nmse[force_ref] <= cases[ci].bound)) /* written so that NaN fails */
                fail_msg("%s/%s decode (%s): NMSE %.3g > %.3g", pkv_dtype_name(cases[ci].k), pkv_dtype_name(cases[ci].v),
                         pkv_attn_backend(c), nmse[force_ref], cases[ci].bound);
            /* prefill of the last 7 positions of sequence 0 (or fewer) against the oracle */
            uint32_t nq = PKV_MIN(7u, len[0]);
            pkv_attn_req req = {seqs[0], len[0] - nq, nq};
            float *qp = malloc((size_t)nq * NQH * D * 4), *op = malloc((size_t)nq * NQH * D * 4);
            for (uint32_t i = 0; i < nq * NQH * D; i++) qp[i] = rnd_normal();
            assert_int_equal(pkv_attn_prefill(c, 0, &req, 1, qp, op, &ap), 0);
            num = den = 0;
            for (uint32_t i = 0; i < nq; i++)
                for (uint32_t qh = 0; qh < NQH; qh++) {
                    oracle(K[0], V[0], H, G, D, len[0] - nq + i + 1, qh, qp + ((size_t)i * NQH + qh) * D, ref);
                    for (uint32_t d = 0; d < D; d++) {
                        double e = op[((size_t)i * NQH + qh) * D + d] - ref[d];
                        num += e * e, den += ref[d] * ref[d];
                    }
                }
            if (!(num / den <= cases[ci].bound))
                fail_msg("%s/%s prefill: NMSE %.3g > %.3g", pkv_dtype_name(cases[ci].k), pkv_dtype_name(cases[ci].v),
                         num / den, cases[ci].bound);
            outs[force_ref] = o;
            free(q), free(qp), free(op);
            for (uint32_t s = 0; s < NS; s++) free(K[s]), free(V[s]);
            TU_CHECK(c);
            pkv_cache_destroy(c);
        }
        /* the chosen backend and the scalar reference agree to float rounding */
        double md = 0, rms = 0;
        for (uint32_t i = 0; i < NS * NQH * D; i++) {
            const double di = fabs(outs[0][i] - outs[1][i]);
            md = di <= md ? md : isnan(di) ? INFINITY : di; /* fmax would drop a NaN */
            rms += (double)outs[1][i] * outs[1][i];
        }
        rms = sqrt(rms / (NS * NQH * D));
        if (!(md <= 2e-4 * rms)) fail_msg("backend vs ref: max diff %.3g, rms %.3g", md, rms);
        print_message("  %-8s K / %-8s V: decode NMSE %.2e (bound %.0e), backend vs ref max diff / rms %.1e\n",
                      pkv_dtype_name(cases[ci].k), pkv_dtype_name(cases[ci].v), nmse[0], cases[ci].bound, md / rms);
        free(outs[0]), free(outs[1]);
    }
}

/* What pkv_write_kv takes into each pool dtype: values up to PKV_VALUE_MAX only (finite), and
 * none that would round to infinity in an f16 pool; the largest that fit are stored as the format's largest
 * finite values, the quantized formats saturate everything finite, a refused write leaves the
 * position as it was, and padding rows (slot -1) are never read, NaN or not. */
typedef struct {
    pkv_dtype in;
    uint32_t bits; /* the value at element 0 (f32 bits, or a 16-bit code) */
    int ok_mask;   /* bit d: accepted into a pool of dtype d */
} range_case;

static void test_write_range(void **state) {
    (void)state;
    enum { D = 32 };
    const int all = (1 << PKV_DTYPE_COUNT) - 1, no_f16 = all & ~(1 << PKV_DTYPE_F16);
    const range_case cases[] = {
        {PKV_DTYPE_F32, 0x477fefffu, all},    /* 65519.996: rounds to 65504 */
        {PKV_DTYPE_F32, 0x477ff000u, no_f16}, /* 65520: the f16 midpoint to infinity, rounds up */
        {PKV_DTYPE_F32, 0xc77ff000u, no_f16},
        {PKV_DTYPE_F32, 0x5b800000u, no_f16}, /* PKV_VALUE_MAX, 2^56 */
        {PKV_DTYPE_F32, 0xdb800000u, no_f16}, /* -2^56 */
        {PKV_DTYPE_F32, 0x5b800001u, 0},      /* one ulp past it */
        {PKV_DTYPE_F32, 0x7f7f7fffu, 0},      /* finite, but past PKV_VALUE_MAX */
        {PKV_DTYPE_F32, 0xff7fffffu, 0},      /* -FLT_MAX */
        {PKV_DTYPE_F32, 0x7f800000u, 0},      /* +inf */
        {PKV_DTYPE_F32, 0xff800000u, 0},      /* -inf */
        {PKV_DTYPE_F32, 0x7fc00000u, 0},      /* NaN */
        {PKV_DTYPE_F32, 0xffa00001u, 0},      /* a negative signalling NaN */
        {PKV_DTYPE_F16, 0x7bffu, all},        /* 65504 */
        {PKV_DTYPE_F16, 0x7c00u, 0},
        {PKV_DTYPE_F16, 0xfe01u, 0},
        {PKV_DTYPE_BF16, 0x477fu, all},       /* 65280 */
        {PKV_DTYPE_BF16, 0x4780u, no_f16},    /* 65536 */
        {PKV_DTYPE_BF16, 0x5b80u, no_f16},    /* 2^56 */
        {PKV_DTYPE_BF16, 0x5b81u, 0},
        {PKV_DTYPE_BF16, 0x7f7fu, 0},
        {PKV_DTYPE_BF16, 0xff80u, 0},
        {PKV_DTYPE_BF16, 0x7fc0u, 0},
    };
    for (int pd = 0; pd < PKV_DTYPE_COUNT; pd++) {
        pkv_config cfg = tu_config(8, 4, 1, 2, D, (pkv_dtype)pd);
        pkv_cache *c = tu_create(&cfg);
        pkv_seq s = tu_seq(c);
        int32_t slot[2];
        tu_append(c, s, 2, 0, slot);
        float one[2 * D], back_k[2 * D], back_v[2 * D], was_k[2 * D], was_v[2 * D];
        for (int i = 0; i < 2 * D; i++) one[i] = 0.25f * (float)(i % 7) - 0.5f;
        TU_OK(pkv_write_kv(c, 0, slot, 1, one, one, PKV_DTYPE_F32));
        for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
            const range_case *rc = &cases[ci];
            uint8_t in[2 * D * 4];
            const size_t el = rc->in == PKV_DTYPE_F32 ? 4 : 2;
            for (int i = 0; i < 2 * D; i++) {
                const uint32_t w = el == 4 ? 0x3f800000u : rc->in == PKV_DTYPE_F16 ? 0x3c00u : 0x3f80u; /* 1.0 */
                memcpy(in + i * el, &w, el);
            }
            memcpy(in + D * el, &rc->bits, el); /* kv head 1, element 0 (little-endian) */
            TU_OK(pkv_seq_gather(c, s, 0, 0, 1, was_k, was_v));
            const int want_ok = rc->ok_mask >> pd & 1;
            for (int side = 0; side < 2; side++) {
                const int got = pkv_write_kv(c, 0, slot, 1, side ? NULL : in, side ? in : NULL, rc->in);
                if (got != (want_ok ? PKV_OK : PKV_EINVAL))
                    fail_msg("pool %s, %s input 0x%x (%s): status %d", pkv_dtype_name((pkv_dtype)pd),
                             pkv_dtype_name(rc->in), rc->bits, side ? "V" : "K", got);
                TU_OK(pkv_seq_gather(c, s, 0, 0, 1, back_k, back_v));
                const float *back = side ? back_v : back_k, *was = side ? was_v : was_k;
                for (int i = 0; i < 2 * D; i++) {
                    if (!want_ok) {
                        assert_memory_equal(&back[i], &was[i], 4); /* refused: nothing written */
                    } else if (!isfinite(back[i])) {
                        fail_msg("pool %s: 0x%x stored as %g", pkv_dtype_name((pkv_dtype)pd), rc->bits, (double)back[i]);
                    }
                }
            }
            if (want_ok && pd == PKV_DTYPE_F16 && rc->in == PKV_DTYPE_F32 && rc->bits == 0x477fefffu)
                assert_true(back_k[D] == 65504.0f);
            if (want_ok && (pd == PKV_DTYPE_BF16 || pd == PKV_DTYPE_F32) && rc->bits == 0x5b800000u)
                assert_true(back_k[D] == 0x1p56f);
            /* the other side is untouched by a K-only (V-only) write: put the old row back */
            TU_OK(pkv_write_kv(c, 0, slot, 1, one, one, PKV_DTYPE_F32));
        }
        /* padding rows are not read: a NaN there does not refuse the write */
        float rows[2][2 * D];
        for (int i = 0; i < 2 * D; i++) rows[0][i] = NAN, rows[1][i] = one[i];
        const int32_t pad[2] = {-1, slot[1]};
        TU_OK(pkv_write_kv(c, 0, pad, 2, rows, rows, PKV_DTYPE_F32));
        TU_CHECK(c);
        pkv_cache_destroy(c);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_create_and_row_bytes),
        cmocka_unit_test(test_write_gather_every_input),
        cmocka_unit_test(test_fork_cow_keeps_bytes),
        cmocka_unit_test(test_compact_keeps_bytes),
        cmocka_unit_test(test_attention_public),
        cmocka_unit_test(test_write_range),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
