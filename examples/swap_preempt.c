/* swap_preempt.c: preemption by swapping, as vLLM's swap_out / swap_in: a running sequence's
 * K/V leaves the pool for host memory and comes back later, with no recompute. The pool holds
 * three running requests and is full; a fourth (half as long) arrives, so the newest running
 * one is swapped out (pkv_seq_read_stored: its rows as the pool stores them, every layer) and
 * released. The fourth runs to the end and leaves. The swapped request then comes back: a prefix match takes
 * whatever of its committed blocks the prefix index still holds, the rest is appended and its
 * rows written back (pkv_seq_write_stored), bit for bit, in f16 K and q8_0 V alike. The example
 * fails unless the rows come back byte for byte, its decode output matches the one before the
 * swap, and the checker passes after every step. */
#include <pkv.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { NL = 2, H = 2, D = 64, HQ = 4, BT = 16, BLOCKS = 12, PROMPT = 60, N_RUN = 3 };

/* K/V for positions [from, from + n) of s, every layer, from the token ids; then committed. */
static int compute(pkv_cache *c, pkv_seq s, const int32_t *tok, uint32_t from, uint32_t n) {
    static float k[PROMPT][H][D], v[PROMPT][H][D];
    int rc = pkv_seq_append(c, s, tok + from, n, NULL);
    for (uint32_t l = 0; l < NL && !rc; l++) {
        for (uint32_t i = 0; i < n; i++)
            for (int h = 0; h < H; h++)
                for (int d = 0; d < D; d++) {
                    k[i][h][d] = sinf(0.37f * (float)(tok[from + i] + 3 * h + d + 11 * l));
                    v[i][h][d] = cosf(0.23f * (float)(tok[from + i] * 5 + h - d + 7 * l));
                }
        rc = pkv_seq_write_kv(c, s, l, from, n, k, v, PKV_DTYPE_F32);
    }
    return rc ? rc : pkv_seq_commit(c, s, from + n);
}

static int checked(pkv_cache *c, int rc) {
    char msg[256];
    if (!rc && pkv_cache_check(c, msg, sizeof msg)) {
        fprintf(stderr, "swap_preempt: checker: %s\n", msg);
        return PKV_ECORRUPT;
    }
    return rc;
}

int main(void) {
    pkv_config cfg = pkv_config_default(); /* prefix cache on */
    cfg.n_layers = NL, cfg.n_kv_heads = H, cfg.head_dim = D, cfg.block_tokens = BT, cfg.n_blocks = BLOCKS;
    cfg.k_dtype = PKV_DTYPE_F16, cfg.v_dtype = PKV_DTYPE_Q8_0, cfg.n_threads = 1;
    pkv_cache *c = NULL;
    if (pkv_cache_create(&cfg, &c)) return 1;
    static int32_t tok[N_RUN + 1][PROMPT];
    for (int r = 0; r <= N_RUN; r++)
        for (int p = 0; p < PROMPT; p++) tok[r][p] = 1000 * (r + 1) + p;
    static float q[N_RUN][HQ][D], out[N_RUN][HQ][D], before[HQ][D];
    for (int i = 0; i < N_RUN; i++)
        for (int h = 0; h < HQ; h++)
            for (int d = 0; d < D; d++) q[i][h][d] = (float)((i + 2 * h + d) % 9) / 9.0f - 0.4f;
    pkv_attn_params p = pkv_attn_params_default();
    p.n_q_heads = HQ;
    pkv_seq run[N_RUN];
    int rc = 0;
    for (int r = 0; r < N_RUN && !rc; r++) /* three requests fill the pool: 4 blocks each */
        if (!(rc = pkv_seq_create(c, NULL, 0, &run[r]))) rc = checked(c, compute(c, run[r], tok[r], 0, PROMPT));
    if (!rc) rc = pkv_attn_decode(c, NL - 1, run, N_RUN, &q[0][0][0], &out[0][0][0], &p);
    if (!rc) memcpy(before, out[N_RUN - 1], sizeof before);

    /* swap out the newest: every layer's rows to host memory, then release it */
    const size_t kb = H * pkv_dtype_row_bytes(cfg.k_dtype, D), vb = H * pkv_dtype_row_bytes(cfg.v_dtype, D);
    uint8_t *host_k = malloc(NL * PROMPT * kb), *host_v = malloc(NL * PROMPT * vb);
    if (!host_k || !host_v) rc = PKV_ENOMEM;
    for (uint32_t l = 0; l < NL && !rc; l++)
        rc = pkv_seq_read_stored(c, run[N_RUN - 1], l, 0, PROMPT, host_k + l * PROMPT * kb, host_v + l * PROMPT * vb);
    if (!rc) rc = checked(c, pkv_seq_release(c, run[N_RUN - 1]));

    /* the fourth request runs in its place (its second block evicts one of the swapped one's
     * CACHED blocks: the last, a leaf) */
    pkv_seq fourth = 0;
    if (!rc) rc = pkv_seq_create(c, NULL, 0, &fourth);
    if (!rc) rc = checked(c, compute(c, fourth, tok[N_RUN], 0, PROMPT / 2));
    if (!rc) rc = checked(c, pkv_seq_release(c, fourth));

    /* swap in: what the prefix index still holds is matched, the rest written back */
    uint32_t hit = 0;
    if (!rc) rc = pkv_seq_create(c, NULL, 0, &run[N_RUN - 1]);
    if (!rc) rc = pkv_seq_match_prefix(c, run[N_RUN - 1], tok[N_RUN - 1], PROMPT, &hit);
    if (!rc) rc = pkv_seq_append(c, run[N_RUN - 1], tok[N_RUN - 1] + hit, PROMPT - hit, NULL);
    for (uint32_t l = 0; l < NL && !rc; l++)
        rc = pkv_seq_write_stored(c, run[N_RUN - 1], l, hit, PROMPT - hit, host_k + (l * PROMPT + hit) * kb,
                                  host_v + (l * PROMPT + hit) * vb);
    if (!rc) rc = checked(c, pkv_seq_commit(c, run[N_RUN - 1], PROMPT));

    /* the rows are back byte for byte, and the decode sees what it saw before */
    static uint8_t again_k[PROMPT * H * D * 4], again_v[PROMPT * H * D * 4]; /* room for f32 rows */
    for (uint32_t l = 0; l < NL && !rc; l++) {
        rc = pkv_seq_read_stored(c, run[N_RUN - 1], l, 0, PROMPT, again_k, again_v);
        if (!rc && (memcmp(again_k, host_k + l * PROMPT * kb, PROMPT * kb) ||
                    memcmp(again_v, host_v + l * PROMPT * vb, PROMPT * vb))) {
            fprintf(stderr, "swap_preempt: layer %u's rows differ after the swap\n", l);
            rc = PKV_ECORRUPT;
        }
    }
    if (!rc) rc = pkv_attn_decode(c, NL - 1, run, N_RUN, &q[0][0][0], &out[0][0][0], &p);
    double worst = 0.0;
    for (int h = 0; h < HQ && !rc; h++)
        for (int d = 0; d < D; d++) {
            const double diff = fabs((double)out[N_RUN - 1][h][d] - before[h][d]);
            if (diff > worst) worst = diff; /* not fmax: aarch64 GCC 12 -O3 ICEs vectorizing that */
        }
    if (!rc && hit != 2 * BT) rc = PKV_ECORRUPT; /* two of its three full blocks were left */
    if (!rc && worst > 1e-6) { /* the same rows in other blocks: only the batch's order differs */
        fprintf(stderr, "swap_preempt: decode after the swap differs by %g\n", worst);
        rc = PKV_ECORRUPT;
    }
    printf("swap_preempt: %u positions x %u layers swapped out and in: %zu bytes on the host (f16 K, q8_0 V; "
           "%zu as f32), %u positions matched from the prefix index, decode within %g of before\n",
           PROMPT, NL, NL * PROMPT * (kb + vb), (size_t)NL * PROMPT * H * D * 8, hit, worst);
    if (rc) fprintf(stderr, "swap_preempt: %s\n", pkv_strerror(rc));
    free(host_k), free(host_v);
    pkv_cache_destroy(c);
    return rc ? 1 : 0;
}
