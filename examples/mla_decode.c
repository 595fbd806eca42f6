/* mla_decode.c: one layer of multi-head latent attention (MLA, DeepSeek-V2 / V3) over a cache
 * whose V lives in K (pkv_config.v_dim), in the absorbed form that serving engines decode with,
 * checked against the same layer computed the plain way.
 *
 * The model caches, per token, the latent c_kv (LAT values) and the rotary key k_pe (ROPE values,
 * shared by every head): the pool row is [c_kv | k_pe], v_dim = LAT. Head h's key is
 * [W_UK[h] c_kv | k_pe] and its value W_UV[h] c_kv. Absorbed: the query [W_UK[h]^T q_nope[h] |
 * q_pe[h]] against the pool rows gives the same scores, and W_UV[h] times the attention's output
 * (a weighted sum of c_kv) gives the same head output. The plain way expands every token's keys
 * and values per head, which is what MLA's cache avoids storing. The example fails if the two
 * differ by more than float rounding, or if a V write is accepted. */
#include <pkv.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

enum { LAT = 64, ROPE = 16, NOPE = 16, VH = 16, HQ = 8, N_TOK = 200, BT = 16 };

static float rnd(unsigned *s) {
    *s = *s * 1103515245u + 12345u;
    return (float)((*s >> 8) & 0xffff) / 32768.0f - 1.0f;
}

int main(void) {
    static float wuk[HQ][NOPE][LAT], wuv[HQ][VH][LAT], row[N_TOK][LAT + ROPE];
    static float qn[HQ][NOPE], qp[HQ][ROPE], q[HQ][LAT + ROPE], out[HQ][LAT];
    unsigned seed = 1;
    for (int h = 0; h < HQ; h++)
        for (int i = 0; i < NOPE; i++)
            for (int j = 0; j < LAT; j++) wuk[h][i][j] = rnd(&seed) * 0.2f, wuv[h][i][j] = rnd(&seed) * 0.2f;
    for (int t = 0; t < N_TOK; t++)
        for (int j = 0; j < LAT + ROPE; j++) row[t][j] = rnd(&seed);
    for (int h = 0; h < HQ; h++) {
        for (int i = 0; i < NOPE; i++) qn[h][i] = rnd(&seed);
        for (int i = 0; i < ROPE; i++) qp[h][i] = rnd(&seed);
    }

    pkv_config cfg = pkv_config_default();
    cfg.n_kv_heads = 1, cfg.head_dim = LAT + ROPE, cfg.v_dim = LAT; /* [c_kv | k_pe]; V = c_kv */
    cfg.k_dtype = cfg.v_dtype = PKV_DTYPE_F32;
    cfg.block_tokens = BT, cfg.n_blocks = 64;
    pkv_cache *c;
    pkv_seq s;
    int32_t tok[N_TOK], slots[N_TOK];
    for (int t = 0; t < N_TOK; t++) tok[t] = 1000 + t;
    if (pkv_cache_create(&cfg, &c) || pkv_seq_create(c, NULL, 0, &s) || pkv_seq_append(c, s, tok, N_TOK, slots)) {
        fprintf(stderr, "mla_decode: set-up failed\n");
        return 1;
    }
    if (pkv_write_kv(c, 0, slots, N_TOK, row, row, PKV_DTYPE_F32) != PKV_EINVAL) { /* V lives in K */
        fprintf(stderr, "mla_decode: a V write was accepted\n");
        return 1;
    }
    if (pkv_write_kv(c, 0, slots, N_TOK, row, NULL, PKV_DTYPE_F32)) return 1;

    /* absorbed queries: [W_UK[h]^T q_nope[h] | q_pe[h]] */
    for (int h = 0; h < HQ; h++) {
        for (int j = 0; j < LAT; j++) {
            float a = 0;
            for (int i = 0; i < NOPE; i++) a += wuk[h][i][j] * qn[h][i];
            q[h][j] = a;
        }
        for (int i = 0; i < ROPE; i++) q[h][LAT + i] = qp[h][i];
    }
    pkv_attn_params p = pkv_attn_params_default();
    p.n_q_heads = HQ;
    p.scale = 1.0f / sqrtf((float)(NOPE + ROPE)); /* the model's head size, not the pool row's */
    if (pkv_attn_decode(c, 0, &s, 1, &q[0][0], &out[0][0], &p)) return 1; /* out: [HQ][LAT] */

    double worst = 0, big = 0;
    for (int h = 0; h < HQ; h++) {
        /* the plain way: every token's key and value for head h, expanded */
        static double sc[N_TOK];
        double mx = -INFINITY, sum = 0;
        for (int t = 0; t < N_TOK; t++) {
            double dot = 0;
            for (int i = 0; i < NOPE; i++) {
                double kn = 0;
                for (int j = 0; j < LAT; j++) kn += (double)wuk[h][i][j] * row[t][j];
                dot += qn[h][i] * kn;
            }
            for (int i = 0; i < ROPE; i++) dot += (double)qp[h][i] * row[t][LAT + i];
            sc[t] = dot * p.scale;
            mx = sc[t] > mx ? sc[t] : mx;
        }
        for (int t = 0; t < N_TOK; t++) sum += (sc[t] = exp(sc[t] - mx));
        for (int i = 0; i < VH; i++) {
            double plain = 0, absorbed = 0;
            for (int t = 0; t < N_TOK; t++) {
                double v = 0;
                for (int j = 0; j < LAT; j++) v += (double)wuv[h][i][j] * row[t][j];
                plain += sc[t] / sum * v;
            }
            for (int j = 0; j < LAT; j++) absorbed += (double)wuv[h][i][j] * out[h][j]; /* W_UV after */
            worst = fmax(worst, fabs(plain - absorbed));
            big = fmax(big, fabs(plain));
        }
    }
    pkv_layout lo;
    if (pkv_cache_layout(c, &lo)) return 1;
    printf("mla_decode: %d heads over %d tokens, %zu pool bytes a token (K alone, v_dim %u of %u): "
           "absorbed against plain, max |diff| %.2e of max |out| %.2e\n",
           HQ, N_TOK, lo.k_row_bytes, lo.v_dim, lo.head_dim, worst, big);
    pkv_cache_destroy(c);
    if (!(worst <= 1e-5 * (1.0 + big))) {
        fprintf(stderr, "mla_decode: the absorbed layer differs from the plain one\n");
        return 1;
    }
    return 0;
}
