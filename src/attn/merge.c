/* merge.c: pkv_attn_merge, two partial attention results over disjoint key sets of the same
 * queries combined by their log-sum-exps (cascade and split attention on the caller's side). The
 * kernels merge their own split-K and sweep states inside a call (attn.c: merge_write); this is
 * the same step for results that have left the library. Portable C: the work is one pass over the
 * rows, bound by memory. */
#include "core/core.h"

#include <math.h>
#include <stdint.h>

/* A part's weight must be a real log-sum-exp: finite, or -inf for a part over no keys. */
static bool lse_ok(float v) { return !isnan(v) && v != INFINITY; }

PKV_API int pkv_attn_merge(uint32_t n_rows, uint32_t head_dim, const float *out_a, const float *lse_a,
                           const float *out_b, const float *lse_b, float *out, float *lse) {
    if (head_dim == 0) return PKV_EINVAL;
    if (n_rows == 0) return PKV_OK;
    if (!out_a || !lse_a || !out_b || !lse_b || !out) return PKV_EINVAL;
    size_t vbytes;
    const size_t lbytes = (size_t)n_rows * sizeof(float);
    if (!pkv__f32_rows_bytes(n_rows, head_dim, &vbytes)) return PKV_EINVAL;
    /* out may be out_a or out_b, and lse lse_a or lse_b (in place); no other overlap */
    if (pkv__overlap_unequal(out, out_a, vbytes) || pkv__overlap_unequal(out, out_b, vbytes) ||
        pkv__overlap(out, vbytes, lse_a, lbytes) || pkv__overlap(out, vbytes, lse_b, lbytes))
        return PKV_EINVAL;
    if (lse && (pkv__overlap_unequal(lse, lse_a, lbytes) || pkv__overlap_unequal(lse, lse_b, lbytes) ||
                pkv__overlap(lse, lbytes, out, vbytes) || pkv__overlap(lse, lbytes, out_a, vbytes) ||
                pkv__overlap(lse, lbytes, out_b, vbytes)))
        return PKV_EINVAL;
    for (uint32_t r = 0; r < n_rows; r++) /* checked first: a call that fails writes nothing */
        if (!lse_ok(lse_a[r]) || !lse_ok(lse_b[r])) return PKV_EINVAL;

    for (uint32_t r = 0; r < n_rows; r++) {
        const double la = lse_a[r], lb = lse_b[r], m = la > lb ? la : lb;
        const size_t o = (size_t)r * head_dim;
        if (m == -INFINITY) { /* both parts saw no keys: so does the union */
            for (uint32_t d = 0; d < head_dim; d++) out[o + d] = 0.0f;
            if (lse) lse[r] = -INFINITY;
            continue;
        }
        const double wa = exp(la - m), wb = exp(lb - m), sum = wa + wb; /* the larger is 1: sum in [1, 2] */
        const float ca = (float)(wa / sum), cb = (float)(wb / sum);
        if (cb == 0.0f || ca == 0.0f) { /* one part weighs nothing: its values are not read (may be NaN) */
            const float *src = (cb == 0.0f ? out_a : out_b) + o;
            if (src != out + o)
                for (uint32_t d = 0; d < head_dim; d++) out[o + d] = src[d];
        } else {
            for (uint32_t d = 0; d < head_dim; d++) out[o + d] = ca * out_a[o + d] + cb * out_b[o + d];
        }
        if (lse) lse[r] = (float)(m + log(sum));
    }
    return PKV_OK;
}
