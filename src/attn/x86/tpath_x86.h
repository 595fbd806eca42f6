/* tpath_x86.h: the transposed primitives of the x86 backends (attn.h: score_t, softmax_t,
 * accum_t), written once over a vector of VF_N floats, as softmax_x86.h is. For units of many
 * rows (prefill tiles; decode with 16 or more query heads a kv head, as MLA's). The row path's
 * score tiles end on trees of shuffles and adds (45 for 128 FMAs in AVX-512's 4 x 4 tile at
 * head_dim 128), which take one of the two FMA pipes of an Intel core, and widen each 16-bit K
 * vector for 4 rows only. Here a block's 16-bit K and V rows are widened to f32 once (kbuf, vbuf:
 * PKV__ATTN_T_KEYS rows at a time, whole or in parts of TP_DC columns (below); fp8 e4m3 rows too,
 * each code's value times its row's scale), score is an outer product (a K value broadcast
 * against VF_N rows of qt, tiles of TP_NK keys x 2 vectors of rows or TP_NK1 keys x 1, no sums
 * across lanes), softmax works on VF_N rows a vector down the keys, and accum is the row path's
 * tile over the widened rows with the weights read down a key's row of scores.
 *
 * A template by #include, after softmax_x86.h (its vf_* and vf_softcap). The including file
 * first defines:
 *   vf_exp_t(x)               e^x for the softmax (0 below -87.3, for -inf and nan);
 *   vf_ne_bits(a, b)          the lanes where a != b (or either is nan), as bits of an unsigned;
 *   TP_NK                     keys a score tile against 2 vectors of rows (at most 8): 2 * TP_NK
 *                             accumulators and 2 qt vectors, with a broadcast, fit the registers;
 *   TP_NK1                    keys a score tile against one vector of rows (at most 16; the last
 *                             vector where rp is an odd number of them, as 16 query heads a kv
 *                             head in decode), where the K rows' stride is a constant;
 *   TP_WHOLE_MAX              the widest K and V rows widened whole (wider ones: in parts, below);
 *   TP_WIDEN_LD(T, row, d, D) the VF_N values of a K or V row of dtype T from column d, in
 *                             the order prep_q and acc use (d a multiple of VF_N under D);
 *   TP_E4M3_LD(p)             the values of VF_N fp8 e4m3 codes at p times 2^-8 (fp8_x86.h);
 *   accum_rows_pts_f32(p, ps, pts, R, v, vrb, n_keys, D, acc, as, pf)  the row path's accum over
 *                             f32 rows, D columns, with the weights at p[r * ps + t * pts] and
 *                             acc's rows as floats apart, and
 *                             PKV__ATTN_ACCUM_TILES(D), its prefetch steps per key;
 *   sc_T(row, i), elem_T      a scalar of a row, and the element type, for f16 and bf16;
 * and gets static functions, and tpath_fill(kt), which sets the table's entries. */

/* Rows of more than TP_WHOLE_MAX values are widened and used TP_DC columns at a time (rows TP_DC
 * floats apart in kbuf), each part's scores added to the last's, and V's parts accumulated into
 * their columns of acc (accum_t): a part of PKV__ATTN_T_KEYS widened rows (4 KiB) and its columns
 * of qt stay in L1, where whole rows of 576 values do not (DeepSeek's MLA: 36 KiB of widened K,
 * and 36 KiB of qt at 16 rows). AVX-512 takes parts past 128 values: MLA decode at 16 heads
 * (scripts/ab-decode.sh, AB_SHAPE=16,1,576,512, f16 4096 x 1, 1 thread) took 0.77-0.81 of the time
 * of whole rows with 8-key tiles. AVX2 keeps whole rows (its 6 x 2 tiles, TP_NK1 6): in parts the
 * same decode took 1.04-1.06 of the time. */
#define TP_DC 64u

/* Columns [d0, d0 + dn) of n rows of K or V (row stride rb, D values a row) widened to f32 rows
 * of dn floats, ds floats apart, at dst (d0 a multiple of 32, so that bf16's even-odd groups stay whole), a
 * prefetch step of pf after each row (the caller starts and finishes pf). */
#define TP_DEF_WIDEN(T)                                                                                         \
    static inline __attribute__((always_inline)) void widen_rows_##T(const uint8_t *src, size_t rb, uint32_t n, \
                                                                     uint32_t d0, uint32_t dn, uint32_t D,      \
                                                                     float *dst, size_t ds, pkv__attn_pf *pf) { \
        const uint32_t d1 = d0 + dn, DV = PKV_MIN(d1, D & ~(uint32_t)(VF_N - 1));                               \
        for (uint32_t t = 0; t < n; t++) {                                                                      \
            const uint8_t *row = src + t * rb;                                                                  \
            float *o = dst + t * ds;                                                                            \
            uint32_t d = d0;                                                                                    \
            for (; d < DV; d += VF_N) vf_store(o + (d - d0), TP_WIDEN_LD(T, row, d, D));                        \
            for (; d < d1; d++) o[d - d0] = sc_##T(row, d);                                                     \
            pkv__attn_pf_step(pf);                                                                              \
        }                                                                                                       \
    }
TP_DEF_WIDEN(f16)
TP_DEF_WIDEN(bf16)

/* The same for fp8 e4m3 rows (an f32 scale, then head_dim codes). V (widen_rows_fp8): each
 * code's value times the row's scale, as pkv__row_decode gives them; TP_E4M3_LD's values carry
 * 2^-8 and the scale times 2^8 takes it off, both exact, so each product is the same rounding of
 * the same real number. K (scaled false): the codes' values times 2^-8 alone, exact, and
 * score_t_fp8 multiplies each key's scores by its scale times 2^8 after the sums, as the row
 * path and attn_q_ref.c do: with the scale folded into K instead, a test case of outliers (one
 * value in 1000 times 20) differed from the reference by 2.0e-4 of the output's rms, against at
 * most 7e-5 for the row path. The prepared query is plain f32 (prep_q of attn_q_avx2.c). */
static inline __attribute__((always_inline)) void widen_rows_fp8_as(const uint8_t *src, size_t rb, uint32_t n,
                                                                   uint32_t d0, uint32_t dn, uint32_t D, float *dst,
                                                                   size_t ds, pkv__attn_pf *pf, const bool scaled) {
    const uint32_t d1 = d0 + dn, DV = PKV_MIN(d1, D & ~(uint32_t)(VF_N - 1));
    for (uint32_t t = 0; t < n; t++) {
        const uint8_t *row = src + t * rb, *e = row + PKV_FP8_ROW_HEADER;
        float *o = dst + t * ds;
        float sk = 1.0f / 256.0f;
        if (scaled) memcpy(&sk, row, sizeof sk);
        const vf sv = vf_set1(sk * 256.0f);
        uint32_t d = d0;
        for (; d < DV; d += VF_N) vf_store(o + (d - d0), scaled ? vf_mul(TP_E4M3_LD(e + d), sv) : TP_E4M3_LD(e + d));
        for (; d < d1; d++) o[d - d0] = pkv__e4m3_to_f32(e[d]) * sk;
        pkv__attn_pf_step(pf);
    }
}
/* V's (TP_DEF_ACCUM_T16 names it widen_rows_##T) */
static inline __attribute__((always_inline)) void widen_rows_fp8(const uint8_t *src, size_t rb, uint32_t n, uint32_t d0,
                                                                uint32_t dn, uint32_t D, float *dst, size_t ds,
                                                                pkv__attn_pf *pf) {
    widen_rows_fp8_as(src, rb, n, d0, dn, D, dst, ds, pf, true);
}

/* Keys t < NK (<= 16) of f32 rows k (stride ks floats) against NV (1 or 2) vectors of VF_N
 * rows of qt (columns from qt): s[t * rp + r] for those rows, or added to them where add; a
 * prefetch step of pf after each 16 columns (pf NULL: none). */
static inline __attribute__((always_inline)) void score_t_tile(const float *qt, uint32_t rp, const float *k, size_t ks,
                                                              const uint32_t NK, const uint32_t NV, uint32_t D,
                                                              float *s, bool add, pkv__attn_pf *pf) {
    vf a[16][2];
    _Pragma("GCC unroll 16") for (uint32_t t = 0; t < NK; t++)
        _Pragma("GCC unroll 2") for (uint32_t v = 0; v < NV; v++) a[t][v] = add ? vf_load(s + t * rp + VF_N * v)
                                                                                : vf_zero();
    for (uint32_t d0 = 0; d0 < D;) { /* one span of all D columns where pf is NULL */
        const uint32_t d1 = pf ? PKV_MIN(d0 + 16, D) : D;
        for (uint32_t d = d0; d < d1; d++) {
            const float *qd = qt + (size_t)d * rp;
            vf x[2];
            _Pragma("GCC unroll 2") for (uint32_t v = 0; v < NV; v++) x[v] = vf_load(qd + VF_N * v);
            _Pragma("GCC unroll 16") for (uint32_t t = 0; t < NK; t++) {
                const vf kb = vf_set1(k[t * ks + d]);
                _Pragma("GCC unroll 2") for (uint32_t v = 0; v < NV; v++) a[t][v] = vf_fmadd(kb, x[v], a[t][v]);
            }
        }
        pkv__attn_pf_step(pf);
        d0 = d1;
    }
    _Pragma("GCC unroll 16") for (uint32_t t = 0; t < NK; t++)
        _Pragma("GCC unroll 2") for (uint32_t v = 0; v < NV; v++) vf_store(s + t * rp + VF_N * v, a[t][v]);
}

/* The tiles score_t_keys takes for n keys, NKT at a time (then 8, then the rest). */
static inline uint32_t tp_tiles(uint32_t n, uint32_t nkt) {
    const uint32_t r = n % nkt;
    return n / nkt + (nkt > 8 && r >= 8) + (r % 8 != 0);
}

/* Every key of the block against NV vectors of rows: tiles of NKT keys (TP_NK against 2 vectors,
 * NK1 against one), then tiles of 8 and one of the rest; a prefetch step of pf after each tile,
 * and of pft in the tiles (score_t_tile: each 16 columns) where pft is not NULL. */
static inline __attribute__((always_inline)) void score_t_keys(const float *qt, uint32_t rp, const float *k, size_t ks,
                                                              uint32_t n_keys, uint32_t D, float *s,
                                                              const uint32_t NV, const uint32_t NK1, pkv__attn_pf *pf,
                                                              bool add, pkv__attn_pf *pft) {
    const uint32_t NKT = NV == 1 ? NK1 : TP_NK;
    uint32_t t = 0;
    for (; t + NKT <= n_keys; t += NKT) {
        score_t_tile(qt, rp, k + t * ks, ks, NKT, NV, D, s + t * rp, add, pft);
        pkv__attn_pf_step(pf);
    }
    if (NKT > 8 && t + 8 <= n_keys) {
        score_t_tile(qt, rp, k + t * ks, ks, 8, NV, D, s + t * rp, add, pft);
        pkv__attn_pf_step(pf);
        t += 8;
    }
    const float *kt = k + t * ks;
    float *st = s + t * rp;
    switch (n_keys - t) { /* below 8 */
    case 7: score_t_tile(qt, rp, kt, ks, 7, NV, D, st, add, pft); break;
    case 6: score_t_tile(qt, rp, kt, ks, 6, NV, D, st, add, pft); break;
    case 5: score_t_tile(qt, rp, kt, ks, 5, NV, D, st, add, pft); break;
    case 4: score_t_tile(qt, rp, kt, ks, 4, NV, D, st, add, pft); break;
    case 3: score_t_tile(qt, rp, kt, ks, 3, NV, D, st, add, pft); break;
    case 2: score_t_tile(qt, rp, kt, ks, 2, NV, D, st, add, pft); break;
    case 1: score_t_tile(qt, rp, kt, ks, 1, NV, D, st, add, pft); break;
    default: return;
    }
    pkv__attn_pf_step(pf);
}

/* The tiles of n keys against rp rows: rp / (2 VF_N) groups of 2 vectors, and one of one vector
 * (tiles of NK1) where rp is an odd number of vectors. */
static inline uint32_t tp_row_tiles(uint32_t rp, uint32_t n, uint32_t NK1) {
    return rp / (2 * VF_N) * tp_tiles(n, TP_NK) + (rp % (2 * VF_N) ? tp_tiles(n, NK1) : 0);
}

/* f32 K rows (stride ks floats) against all rp rows of qt (a multiple of 16), 2 vectors of rows
 * at a time, then one (tiles of NK1 keys); the scores added to s where add; a step of pf after
 * each tile (pf started and finished here), and of pft each 16 columns in the tiles. */
static inline __attribute__((always_inline)) void score_t_rows_in(const float *qt, uint32_t rp, const float *k,
                                                                 size_t ks, uint32_t n_keys, uint32_t D, float *s,
                                                                 pkv__attn_pf *pf, bool add, const uint32_t NK1,
                                                                 pkv__attn_pf *pft) {
    pkv__attn_pf_start(pf, tp_row_tiles(rp, n_keys, NK1));
    uint32_t v = 0;
    for (; v + 2 * VF_N <= rp; v += 2 * VF_N) score_t_keys(qt + v, rp, k, ks, n_keys, D, s + v, 2, NK1, pf, add, pft);
    if (v < rp) score_t_keys(qt + v, rp, k, ks, n_keys, D, s + v, 1, NK1, pf, add, pft);
    pkv__attn_pf_finish(pf);
}
/* Tiles of TP_NK1 keys against one vector of rows need the stride a constant: then a tile's keys
 * are offsets from one register (with 16 keys' offsets in variables the inner loop ran out of
 * registers and reloaded them from the stack). Other strides keep tiles of TP_NK. */
static void score_t_rows(const float *qt, uint32_t rp, const float *k, size_t ks, uint32_t n_keys, uint32_t D, float *s,
                         pkv__attn_pf *pf) {
    if (TP_NK1 > TP_NK && ks == 128 && D == 128) /* widened rows of the common head_dim */
        score_t_rows_in(qt, rp, k, 128, n_keys, 128, s, pf, false, TP_NK1, NULL);
    else
        score_t_rows_in(qt, rp, k, ks, n_keys, D, s, pf, false, TP_NK, NULL);
}
/* The same over rows TP_DC floats apart (the widened parts below), D columns of them, added to s
 * where add, with steps of pft (started by the caller) in the tiles. */
static void score_t_rows_dc(const float *qt, uint32_t rp, const float *k, uint32_t n_keys, uint32_t D, float *s,
                            bool add, pkv__attn_pf *pft) {
    if (D == TP_DC)
        score_t_rows_in(qt, rp, k, TP_DC, n_keys, TP_DC, s, NULL, add, TP_NK1, pft);
    else
        score_t_rows_in(qt, rp, k, TP_DC, n_keys, D, s, NULL, add, TP_NK1, pft);
}

static void score_t_f32(const float *qt, uint32_t rp, const uint8_t *k, size_t krb, uint32_t n_keys, uint32_t D,
                        float *s, float *kbuf, pkv__attn_pf *pf) {
    (void)kbuf;
    score_t_rows(qt, rp, (const float *)(const void *)k, krb / sizeof(float), n_keys, D, s, pf);
}

/* The 16-bit and fp8 K's score_t: its rows widened (wid(src, rb, n, d0, dn, D, dst, ds, pf)) and
 * scored PKV__ATTN_T_KEYS at a time, whole or in parts of TP_DC columns. */
#define TP_SCORE_WIDENED(wid)                                                                                   \
    do {                                                                                                        \
        if (D <= TP_WHOLE_MAX) {                                                                                \
            pkv__attn_pf_start(pf, n_keys);                                                                     \
            for (uint32_t t = 0; t < n_keys; t += PKV__ATTN_T_KEYS) { /* kbuf holds PKV__ATTN_T_KEYS rows */    \
                const uint32_t nk = PKV_MIN(PKV__ATTN_T_KEYS, n_keys - t);                                      \
                wid(k + t * krb, krb, nk, 0, D, D, kbuf, D, pf);                                                \
                score_t_rows(qt, rp, kbuf, D, nk, D, s + (size_t)t * rp, NULL);                                 \
            }                                                                                                   \
            pkv__attn_pf_finish(pf);                                                                            \
            break;                                                                                              \
        }                                                                                                       \
        /* a prefetch step each 16 columns of a tile: spread over the arithmetic, not in bursts */              \
        uint32_t n_steps = 0;                                                                                   \
        for (uint32_t t = 0; t < n_keys; t += PKV__ATTN_T_KEYS)                                                 \
            n_steps += tp_row_tiles(rp, PKV_MIN(PKV__ATTN_T_KEYS, n_keys - t), TP_NK1) * ((D + 15) / 16);       \
        pkv__attn_pf_start(pf, n_steps);                                                                        \
        for (uint32_t t = 0; t < n_keys; t += PKV__ATTN_T_KEYS) {                                               \
            const uint32_t nk = PKV_MIN(PKV__ATTN_T_KEYS, n_keys - t);                                          \
            for (uint32_t d0 = 0; d0 < D; d0 += TP_DC) {                                                        \
                const uint32_t dn = PKV_MIN(TP_DC, D - d0);                                                     \
                wid(k + t * krb, krb, nk, d0, dn, D, kbuf, TP_DC, NULL);                                        \
                score_t_rows_dc(qt + (size_t)d0 * rp, rp, kbuf, nk, dn, s + (size_t)t * rp, d0 > 0, pf);        \
            }                                                                                                   \
        }                                                                                                       \
        pkv__attn_pf_finish(pf);                                                                                \
    } while (0)
#define TP_DEF_SCORE_T16(T)                                                                                     \
    static void score_t_##T(const float *qt, uint32_t rp, const uint8_t *k, size_t krb, uint32_t n_keys, uint32_t D, \
                            float *s, float *kbuf, pkv__attn_pf *pf) {                                          \
        TP_SCORE_WIDENED(widen_rows_##T);                                                                       \
    }
TP_DEF_SCORE_T16(f16)
TP_DEF_SCORE_T16(bf16)
/* fp8 K: the scores of the codes' values (times 2^-8), then each key's row of scores times its
 * scale times 2^8 (the rp lanes, a multiple of 16, pad rows included) */
static inline __attribute__((always_inline)) void widen_rows_fp8_k(const uint8_t *src, size_t rb, uint32_t n,
                                                                  uint32_t d0, uint32_t dn, uint32_t D, float *dst,
                                                                  size_t ds, pkv__attn_pf *pf) {
    widen_rows_fp8_as(src, rb, n, d0, dn, D, dst, ds, pf, false);
}
static void score_t_fp8(const float *qt, uint32_t rp, const uint8_t *k, size_t krb, uint32_t n_keys, uint32_t D,
                        float *s, float *kbuf, pkv__attn_pf *pf) {
    TP_SCORE_WIDENED(widen_rows_fp8_k);
    for (uint32_t t = 0; t < n_keys; t++) {
        float sk;
        memcpy(&sk, k + t * krb, sizeof sk);
        const vf sv = vf_set1(sk * 256.0f);
        float *st = s + (size_t)t * rp;
        for (uint32_t r = 0; r < rp; r += VF_N) vf_store(st + r, vf_mul(vf_load(st + r), sv));
    }
}

/* softmax's step (attn.h) on VF_N rows a vector, each lane a row, down the keys s[t * rp + r].
 * The lazy rescale is taken lane by lane: a row keeps its max where it is finite and no score of
 * the block is more than LAZY_T above it. A row that has seen no key yet (max still -inf) takes
 * 0 as its reference, so its p and its factor are 0 and its l, acc stay 0. The max and the sum
 * run as two chains each (even and odd keys). */
static void softmax_t(float *s, uint32_t rp, uint32_t n_rows, uint32_t n_keys, float softcap, float *m, float *l,
                      float *acc, uint32_t D) {
    const vf ninf = vf_set1(-INFINITY), zero = vf_zero(), one = vf_set1(1.0f), lazy = vf_set1(LAZY_T);
    const vf cap = vf_set1(softcap), m2ic = vf_set1(softcap > 0.0f ? -2.0f / softcap : 0.0f);
    for (uint32_t r0 = 0; r0 < n_rows; r0 += VF_N) {
        const uint32_t nr = PKV_MIN((uint32_t)VF_N, n_rows - r0);
        float *col = s + r0;
        if (softcap > 0.0f)
            for (uint32_t t = 0; t < n_keys; t++)
                vf_store(col + (size_t)t * rp, vf_softcap(vf_load(col + (size_t)t * rp), cap, m2ic));
        float mb[VF_N], lb[VF_N], fb[VF_N];
        vf mo, lo;
        if (nr == VF_N) {
            mo = vf_load(m + r0), lo = vf_load(l + r0);
        } else { /* the rows past n_rows are another head's: not read, not written */
            for (uint32_t i = 0; i < VF_N; i++)
                mb[i] = i < nr ? m[r0 + i] : -INFINITY, lb[i] = i < nr ? l[r0 + i] : 0.0f;
            mo = vf_load(mb), lo = vf_load(lb);
        }
        vf mx0 = ninf, mx1 = ninf;
        uint32_t t = 0;
        for (; t + 2 <= n_keys; t += 2) {
            mx0 = vf_max(mx0, vf_load(col + (size_t)t * rp));
            mx1 = vf_max(mx1, vf_load(col + (size_t)(t + 1) * rp));
        }
        if (t < n_keys) mx0 = vf_max(mx0, vf_load(col + (size_t)t * rp));
        const vf mx = vf_max(mx0, mx1);
        /* the new max where a score is more than LAZY_T above the old one (always where the old
         * one is -inf and a key is seen), else the old one */
        const vf mn = vf_if_lt(lazy, vf_sub(mx, mo), vf_max(mo, mx), mo);
        const vf ref = vf_if_eq(mn, ninf, zero, mn);
        vf sum0 = zero, sum1 = zero;
        for (t = 0; t + 2 <= n_keys; t += 2) {
            float *c0 = col + (size_t)t * rp, *c1 = c0 + rp;
            const vf e0 = vf_exp_t(vf_sub(vf_load(c0), ref));
            const vf e1 = vf_exp_t(vf_sub(vf_load(c1), ref));
            vf_store(c0, e0), vf_store(c1, e1);
            sum0 = vf_add(sum0, e0), sum1 = vf_add(sum1, e1);
        }
        if (t < n_keys) {
            float *c0 = col + (size_t)t * rp;
            const vf e0 = vf_exp_t(vf_sub(vf_load(c0), ref));
            vf_store(c0, e0);
            sum0 = vf_add(sum0, e0);
        }
        const vf f = vf_exp_t(vf_sub(mo, ref)); /* 1 where the max stayed, 0 where it was -inf */
        const vf ln = vf_fmadd(lo, f, vf_add(sum0, sum1));
        if (nr == VF_N) {
            vf_store(m + r0, mn), vf_store(l + r0, ln);
        } else {
            vf_store(mb, mn), vf_store(lb, ln);
            for (uint32_t i = 0; i < nr; i++) m[r0 + i] = mb[i], l[r0 + i] = lb[i];
        }
        uint32_t moved = vf_ne_bits(f, one) & ((1u << nr) - 1u);
        if (!moved) continue;
        vf_store(fb, f);
        for (; moved; moved &= moved - 1u) {
            const uint32_t i = (uint32_t)__builtin_ctz(moved);
            float *a = acc + (size_t)(r0 + i) * D;
            const vf fv = vf_set1(fb[i]);
            uint32_t d = 0;
            for (; d + VF_N <= D; d += VF_N) vf_store(a + d, vf_mul(vf_load(a + d), fv));
            for (; d < D; d++) a[d] *= fb[i];
        }
    }
}

/* The row path's accum tiles over f32 V rows (stride vrb bytes) of D columns, the weights of row r
 * and key t at p[t * rp + r], acc's rows as (floats) apart. */
static void accum_t_rows(const float *p, uint32_t rp, uint32_t n_rows, const uint8_t *v, size_t vrb, uint32_t n_keys,
                         uint32_t D, float *acc, size_t as, pkv__attn_pf *pf) {
    uint32_t r = 0;
    pkv__attn_pf_start(pf, (n_rows / 4 + n_rows % 4) * n_keys * PKV__ATTN_ACCUM_TILES(D));
    if (D == 128 && as == 128)
        for (; r + 4 <= n_rows; r += 4)
            accum_rows_pts_f32(p + r, 1, rp, 4, v, vrb, n_keys, 128, acc + (size_t)r * 128, 128, pf);
    else if (D == TP_DC)
        for (; r + 4 <= n_rows; r += 4)
            accum_rows_pts_f32(p + r, 1, rp, 4, v, vrb, n_keys, TP_DC, acc + (size_t)r * as, as, pf);
    for (; r + 4 <= n_rows; r += 4)
        accum_rows_pts_f32(p + r, 1, rp, 4, v, vrb, n_keys, D, acc + (size_t)r * as, as, pf);
    for (; r < n_rows; r++) accum_rows_pts_f32(p + r, 1, rp, 1, v, vrb, n_keys, D, acc + (size_t)r * as, as, pf);
    pkv__attn_pf_finish(pf);
}

static void accum_t_f32(const float *p, uint32_t rp, uint32_t n_rows, const uint8_t *v, size_t vrb, uint32_t n_keys,
                        uint32_t D, float *acc, float *vbuf, pkv__attn_pf *pf) {
    (void)vbuf;
    accum_t_rows(p, rp, n_rows, v, vrb, n_keys, D, acc, D, pf);
}
/* 16-bit and fp8 V: rows widened PKV__ATTN_T_KEYS at a time, in parts of TP_DC columns where D is
 * more than TP_WHOLE_MAX (as score_t's K), each part accumulated into its columns of acc. */
#define TP_DEF_ACCUM_T16(T)                                                                                     \
    static void accum_t_##T(const float *p, uint32_t rp, uint32_t n_rows, const uint8_t *v, size_t vrb,         \
                            uint32_t n_keys, uint32_t D, float *acc, float *vbuf, pkv__attn_pf *pf) {           \
        const uint32_t dc = D > TP_WHOLE_MAX ? TP_DC : D, n_parts = (D + dc - 1) / dc;                          \
        pkv__attn_pf_start(pf, n_parts == 1 ? n_keys : (n_keys + PKV__ATTN_T_KEYS - 1) / PKV__ATTN_T_KEYS * n_parts); \
        for (uint32_t t = 0; t < n_keys; t += PKV__ATTN_T_KEYS) { /* vbuf holds PKV__ATTN_T_KEYS rows */        \
            const uint32_t nk = PKV_MIN(PKV__ATTN_T_KEYS, n_keys - t);                                          \
            for (uint32_t d0 = 0; d0 < D; d0 += dc) { /* a prefetch step a row, or a part where there are parts */ \
                const uint32_t dn = PKV_MIN(dc, D - d0);                                                        \
                widen_rows_##T(v + t * vrb, vrb, nk, d0, dn, D, vbuf, dn, n_parts == 1 ? pf : NULL);            \
                accum_t_rows(p + (size_t)t * rp, rp, n_rows, (const uint8_t *)vbuf, (size_t)dn * sizeof(float), nk, \
                             dn, acc + d0, D, NULL);                                                            \
                if (n_parts > 1) pkv__attn_pf_step(pf);                                                         \
            }                                                                                                   \
        }                                                                                                       \
        pkv__attn_pf_finish(pf);                                                                                \
    }
TP_DEF_ACCUM_T16(f16)
TP_DEF_ACCUM_T16(bf16)
TP_DEF_ACCUM_T16(fp8)

static void tpath_fill(pkv__attn_kernels *kt) {
    kt->score_t[PKV_DTYPE_F32] = score_t_f32;
    kt->score_t[PKV_DTYPE_F16] = score_t_f16;
    kt->score_t[PKV_DTYPE_BF16] = score_t_bf16;
    kt->accum_t[PKV_DTYPE_F32] = accum_t_f32;
    kt->accum_t[PKV_DTYPE_F16] = accum_t_f16;
    kt->accum_t[PKV_DTYPE_BF16] = accum_t_bf16;
    kt->score_t[PKV_DTYPE_FP8_E4M3] = score_t_fp8;
    kt->accum_t[PKV_DTYPE_FP8_E4M3] = accum_t_fp8;
    kt->softmax_t = softmax_t;
}
