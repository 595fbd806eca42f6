/* softmax_x86.h: the online-softmax primitive of the x86 backends, written once over a vector
 * of VF_N floats. A template by #include: the including file (attn_avx2.c, attn_avx512.c)
 * first defines
 *   vf                        the vector type; VF_N its lanes (8 or 16);
 *   vf_load, vf_store, vf_set1, vf_zero, vf_max, vf_sub, vf_add, vf_mul, vf_div, vf_fmadd, vf_abs;
 *   vf_copysign(t, x)         t (>= 0) with the sign of x;
 *   vf_if_lt(a, b, x, y), vf_if_eq(a, b, x, y)   lane-wise a < b (a == b) ? x : y;
 *   vf_exp(x)                 e^x lane-wise (0 below -87.3, and for -inf);
 *   vf_hmax(x), vf_hsum(x)    the max / sum of one vector's lanes, as a float;
 *   vf_hmax4, vf_hsum4        the same of four vectors, as the lanes of an __m128;
 *   exp4(x)                   e^x of the 4 lanes of an __m128;
 *   vf_all_le(x, t)           every lane of x <= the lane of t (a nan lane passes);
 *   LAZY_T                    how far above a row's max a block's scores may be and the max stay;
 * then includes this file, which defines vf_softcap and softmax_vec: the table's softmax entry
 * (attn.h). */

/* c * tanh(x / c), m2ic = -2 / c, -inf kept: c * sign(x) * tanh(y), y = |x| / c. For y >= 1/4,
 * (1 - e) / (1 + e) with e = exp(-2y) (1 - e loses at most 2 bits there); below, where 1 - e
 * would cancel (at a cap of 1e8 every logit's y rounds e to 1), the odd series y - y^3/3 +
 * 2y^5/15 - 17y^7/315 + 62y^9/2835, whose first omitted term is under 2e-8 of tanh(y). (The
 * NEON softcap4 in arm/attn_neon.c is the same.) */
static inline vf vf_softcap(vf x, vf c, vf m2ic) {
    const vf u = vf_mul(vf_abs(x), m2ic); /* -2y */
    const vf e = vf_exp(u), one = vf_set1(1.0f);
    const vf y = vf_mul(u, vf_set1(-0.5f)), y2 = vf_mul(y, y);
    vf p = vf_fmadd(y2, vf_set1(62.0f / 2835.0f), vf_set1(-17.0f / 315.0f));
    p = vf_fmadd(p, y2, vf_set1(2.0f / 15.0f));
    p = vf_fmadd(p, y2, vf_set1(-1.0f / 3.0f));
    p = vf_fmadd(vf_mul(p, y2), y, y);
    vf t = vf_if_lt(y, vf_set1(0.25f), p, vf_div(vf_sub(one, e), vf_add(one, e)));
    t = vf_copysign(t, x);
    return vf_if_eq(x, vf_set1(-INFINITY), x, vf_mul(c, t)); /* masked keys (-inf) stay masked */
}

/* One row after soft-capping: the online-softmax step of attn.h for a row on its own. */
static void softmax_row(float *sr, uint32_t n_pad, float *m, float *l, float *acc_row, uint32_t D) {
    vf mx = vf_set1(-INFINITY);
    for (uint32_t t = 0; t < n_pad; t += VF_N) mx = vf_max(mx, vf_load(sr + t));
    float mnew = vf_hmax(mx);
    if (mnew < *m) mnew = *m;
    if (mnew == -INFINITY) {
        for (uint32_t t = 0; t < n_pad; t++) sr[t] = 0.0f;
        return;
    }
    const vf vm = vf_set1(mnew);
    vf sum = vf_zero();
    for (uint32_t t = 0; t < n_pad; t += VF_N) {
        const vf e = vf_exp(vf_sub(vf_load(sr + t), vm));
        vf_store(sr + t, e);
        sum = vf_add(sum, e);
    }
    pkv__attn_softmax_commit(m, l, acc_row, D, mnew, vf_hsum(sum));
}

/* p = exp(s - v_r) in place over the n_pad scores of 4 rows (interleaved), and the 4 rows' sums. */
static inline __m128 exp_rows4(float *s0, float *s1, float *s2, float *s3, uint32_t n_pad, vf v0, vf v1, vf v2,
                               vf v3) {
    vf u0 = vf_zero(), u1 = u0, u2 = u0, u3 = u0;
    for (uint32_t t = 0; t < n_pad; t += VF_N) {
        const vf e0 = vf_exp(vf_sub(vf_load(s0 + t), v0));
        const vf e1 = vf_exp(vf_sub(vf_load(s1 + t), v1));
        const vf e2 = vf_exp(vf_sub(vf_load(s2 + t), v2));
        const vf e3 = vf_exp(vf_sub(vf_load(s3 + t), v3));
        vf_store(s0 + t, e0), vf_store(s1 + t, e1), vf_store(s2 + t, e2), vf_store(s3 + t, e3);
        u0 = vf_add(u0, e0), u1 = vf_add(u1, e1), u2 = vf_add(u2, e2), u3 = vf_add(u3, e3);
    }
    return vf_hsum4(u0, u1, u2, u3);
}

/* Four rows at once: their max, exp and sum chains interleave instead of running one row after
 * the other (each is a long chain of dependent steps), and m, l are updated as one vector. */
static void softmax_rows4(float *s, uint32_t ss, uint32_t n_pad, float *m, float *l, float *acc, uint32_t D) {
    float *s0 = s, *s1 = s + ss, *s2 = s + 2 * (size_t)ss, *s3 = s + 3 * (size_t)ss;
    /* Lazy rescale: where every row has a max already and no score of this block is more than
     * LAZY_T above its row's, the max stays: p = exp(s - m) <= e^LAZY_T, and no horizontal max,
     * no broadcast of a new max, no rescale of acc (the result differs only by rounding; the
     * log-sum-exp m + log l is the same). In cache 2.5-6% faster f16 decode (ab-decode, stop 19). */
    {
        const __m128 mo = _mm_loadu_ps(m);
        if (!_mm_movemask_ps(_mm_cmpeq_ps(mo, _mm_set1_ps(-INFINITY)))) {
            float mv[4];
            _mm_storeu_ps(mv, mo);
            const vf v0 = vf_set1(mv[0]), v1 = vf_set1(mv[1]), v2 = vf_set1(mv[2]), v3 = vf_set1(mv[3]);
            const vf T = vf_set1(LAZY_T);
            vf y0 = vf_set1(-INFINITY), y1 = y0, y2 = y0, y3 = y0;
            for (uint32_t t = 0; t < n_pad; t += VF_N) {
                y0 = vf_max(y0, vf_sub(vf_load(s0 + t), v0));
                y1 = vf_max(y1, vf_sub(vf_load(s1 + t), v1));
                y2 = vf_max(y2, vf_sub(vf_load(s2 + t), v2));
                y3 = vf_max(y3, vf_sub(vf_load(s3 + t), v3));
            }
            if (vf_all_le(vf_max(vf_max(y0, y1), vf_max(y2, y3)), T)) {
                const __m128 sum = exp_rows4(s0, s1, s2, s3, n_pad, v0, v1, v2, v3);
                _mm_storeu_ps(l, _mm_add_ps(_mm_loadu_ps(l), sum));
                return;
            }
        }
    }
    vf x0 = vf_set1(-INFINITY), x1 = x0, x2 = x0, x3 = x0;
    for (uint32_t t = 0; t < n_pad; t += VF_N) {
        x0 = vf_max(x0, vf_load(s0 + t));
        x1 = vf_max(x1, vf_load(s1 + t));
        x2 = vf_max(x2, vf_load(s2 + t));
        x3 = vf_max(x3, vf_load(s3 + t));
    }
    const __m128 mold = _mm_loadu_ps(m);
    const __m128 mnew = _mm_max_ps(mold, vf_hmax4(x0, x1, x2, x3));
    if (_mm_movemask_ps(_mm_cmpeq_ps(mnew, _mm_set1_ps(-INFINITY)))) { /* a row sees nothing yet */
        for (uint32_t r = 0; r < 4; r++) softmax_row(s + (size_t)r * ss, n_pad, m + r, l + r, acc + (size_t)r * D, D);
        return;
    }
    float mv[4];
    _mm_storeu_ps(mv, mnew);
    const vf v0 = vf_set1(mv[0]), v1 = vf_set1(mv[1]), v2 = vf_set1(mv[2]), v3 = vf_set1(mv[3]);
    const __m128 sum = exp_rows4(s0, s1, s2, s3, n_pad, v0, v1, v2, v3);
    /* Some row's max moved here: a block where none moves (every score <= its row's max, every
       row past its first key) took the lazy path above. */
    const int moved = _mm_movemask_ps(_mm_cmpneq_ps(mnew, mold));
    /* f = exp(m - m'): 1 where the max stayed, 0 where m was -inf */
    const __m128 f = exp4(_mm_sub_ps(mold, mnew));
    _mm_storeu_ps(l, _mm_add_ps(_mm_mul_ps(_mm_loadu_ps(l), f), sum));
    _mm_storeu_ps(m, mnew);
    float fr[4];
    _mm_storeu_ps(fr, f);
    for (uint32_t r = 0; r < 4; r++)
        if (moved >> r & 1) {
            float *a = acc + (size_t)r * D;
            for (uint32_t d = 0; d < D; d++) a[d] *= fr[r];
        }
}

/* Rows [0, n_rows) of s, padded to n_pad: four at a time, then one at a time. */
static inline __attribute__((always_inline)) void softmax_rows(float *s, uint32_t ss, uint32_t n_rows, uint32_t n_pad,
                                                               float *m, float *l, float *acc, uint32_t D) {
    uint32_t r = 0;
    for (; r + 4 <= n_rows; r += 4)
        softmax_rows4(s + (size_t)r * ss, ss, n_pad, m + r, l + r, acc + (size_t)r * D, D);
    for (; r < n_rows; r++) softmax_row(s + (size_t)r * ss, n_pad, m + r, l + r, acc + (size_t)r * D, D);
}

static void softmax_vec(float *s, uint32_t ss, uint32_t n_rows, uint32_t n_keys, float softcap, float *m, float *l,
                        float *acc, uint32_t D) {
    /* A full 16-token block with no soft-cap (every decode head's block at the default block
     * size) needs no padding and no soft-cap pass: its rows go straight to the row kernels with
     * n_pad a constant. For 4 rows (4 query heads a kv head) against the general path: ab-decode
     * f16 256 x 16 (in cache, 1 thread) paged 0.980 and contiguous 0.981 of the time, 4096 x 16
     * paged from memory 0.975, f32 256 x 16 0.986 (stop 45). */
    if (n_keys == 16 && !(softcap > 0.0f)) {
        softmax_rows(s, ss, n_rows, 16, m, l, acc, D);
        return;
    }
    const uint32_t n_pad = (n_keys + VF_N - 1) & ~(uint32_t)(VF_N - 1); /* rows of s are padded to a multiple of 16 */
    const vf c = vf_set1(softcap), m2ic = vf_set1(softcap > 0.0f ? -2.0f / softcap : 0.0f);
    for (uint32_t r = 0; r < n_rows; r++) {
        float *sr = s + (size_t)r * ss;
        for (uint32_t t = n_keys; t < n_pad; t++) sr[t] = -INFINITY;
        if (softcap > 0.0f)
            for (uint32_t t = 0; t < n_pad; t += VF_N) vf_store(sr + t, vf_softcap(vf_load(sr + t), c, m2ic));
    }
    softmax_rows(s, ss, n_rows, n_pad, m, l, acc, D);
}
