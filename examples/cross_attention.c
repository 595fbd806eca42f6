/* cross_attention.c: an encoder-decoder model's two kinds of non-causal attention over one
 * sequence that holds the encoder's K/V (PKV_ATTN_NONCAUSAL), checked against a direct
 * computation.
 *
 * Whisper, T5 and Llama 3.2 Vision's image layers run an encoder once over the input (audio
 * frames, image patches), then decode text that attends to it. The encoder's self-attention is
 * bidirectional: every frame sees every frame (layer 0 here). The decoder's cross-attention is
 * too: every text query sees every encoder position, however many queries there are (layer 1
 * here: a prompt of 40 tokens over 24 frames, then one step of 3 beams in one request, their
 * queries reading the encoder's blocks once for all of them). The frames' "token ids" only name
 * positions (the prefix cache indexes them: a salt keeps them apart from text). The example fails
 * if an output differs from the direct computation by more than float rounding, or if a causal
 * extend past the sequence is accepted. */
#include <pkv.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

enum { N_ENC = 24, N_PROMPT = 40, BEAMS = 3, H = 2, HQ = 4, D = 32, BT = 16 };

static float rnd(unsigned *s) {
    *s = *s * 1103515245u + 12345u;
    return (float)((*s >> 8) & 0xffff) / 32768.0f - 1.0f;
}

/* Query rows q ([n][HQ][D]) against all N_ENC positions of k, v ([N_ENC][H][D]) directly; the
 * largest difference from out. */
static double check(const float *q, const float *out, uint32_t n, const float *k, const float *v) {
    double worst = 0;
    for (uint32_t i = 0; i < n; i++)
        for (uint32_t h = 0; h < HQ; h++) {
            const float *qr = q + ((size_t)i * HQ + h) * D;
            double s[N_ENC], mx = -INFINITY, sum = 0;
            for (int t = 0; t < N_ENC; t++) {
                double dot = 0;
                for (int d = 0; d < D; d++) dot += (double)qr[d] * k[((size_t)t * H + h / (HQ / H)) * D + d];
                s[t] = dot / sqrt((double)D);
                mx = s[t] > mx ? s[t] : mx;
            }
            for (int t = 0; t < N_ENC; t++) sum += (s[t] = exp(s[t] - mx));
            for (int d = 0; d < D; d++) {
                double o = 0;
                for (int t = 0; t < N_ENC; t++) o += s[t] / sum * v[((size_t)t * H + h / (HQ / H)) * D + d];
                worst = fmax(worst, fabs(o - out[((size_t)i * HQ + h) * D + d]));
            }
        }
    return worst;
}

int main(void) {
    static float k[2][N_ENC][H][D], v[2][N_ENC][H][D], q[N_PROMPT][HQ][D], out[N_PROMPT][HQ][D];
    unsigned seed = 7;
    for (int l = 0; l < 2; l++)
        for (int t = 0; t < N_ENC; t++)
            for (int h = 0; h < H; h++)
                for (int d = 0; d < D; d++) k[l][t][h][d] = rnd(&seed), v[l][t][h][d] = rnd(&seed);
    pkv_config cfg = pkv_config_default();
    cfg.n_layers = 2, cfg.n_kv_heads = H, cfg.head_dim = D, cfg.block_tokens = BT, cfg.n_blocks = 32;
    cfg.k_dtype = cfg.v_dtype = PKV_DTYPE_F32;
    pkv_cache *c;
    pkv_seq enc;
    int32_t ids[N_ENC], slots[N_ENC];
    for (int t = 0; t < N_ENC; t++) ids[t] = t;
    if (pkv_cache_create(&cfg, &c) || pkv_seq_create(c, "encoder", 7, &enc) ||
        pkv_seq_append(c, enc, ids, N_ENC, slots) ||
        pkv_write_kv(c, 0, slots, N_ENC, &k[0][0][0][0], &v[0][0][0][0], PKV_DTYPE_F32) ||
        pkv_write_kv(c, 1, slots, N_ENC, &k[1][0][0][0], &v[1][0][0][0], PKV_DTYPE_F32)) {
        fprintf(stderr, "cross_attention: set-up failed\n");
        return 1;
    }
    pkv_attn_params p = pkv_attn_params_default();
    p.n_q_heads = HQ, p.flags = PKV_ATTN_NONCAUSAL;
    double worst = 0;

    /* the encoder's self-attention: every frame's query over every frame (q_start 0) */
    for (int i = 0; i < N_ENC * HQ * D; i++) (&q[0][0][0])[i] = rnd(&seed);
    const pkv_attn_req self = {enc, 0, N_ENC};
    if (pkv_attn_prefill(c, 0, &self, 1, &q[0][0][0], &out[0][0][0], &p)) return 1;
    worst = fmax(worst, check(&q[0][0][0], &out[0][0][0], N_ENC, &k[0][0][0][0], &v[0][0][0][0]));

    /* cross-attention: the decoder's prompt, more queries than frames, then one step of 3 beams */
    for (int i = 0; i < N_PROMPT * HQ * D; i++) (&q[0][0][0])[i] = rnd(&seed);
    const pkv_attn_req prompt = {enc, 0, N_PROMPT}, step = {enc, 0, BEAMS};
    if (pkv_attn_prefill(c, 1, &prompt, 1, &q[0][0][0], &out[0][0][0], &p)) return 1;
    worst = fmax(worst, check(&q[0][0][0], &out[0][0][0], N_PROMPT, &k[1][0][0][0], &v[1][0][0][0]));
    if (pkv_attn_prefill(c, 1, &step, 1, &q[0][0][0], &out[0][0][0], &p)) return 1;
    worst = fmax(worst, check(&q[0][0][0], &out[0][0][0], BEAMS, &k[1][0][0][0], &v[1][0][0][0]));

    /* causal, the same request would query positions the sequence does not hold */
    p.flags = 0;
    const int refused = pkv_attn_prefill(c, 1, &prompt, 1, &q[0][0][0], &out[0][0][0], &p) == PKV_EINVAL;
    printf("cross_attention: %d frames, self-attention of %d queries and cross-attention of %d and %d, "
           "max |diff| %.2e against the direct computation; causal, the prompt %s\n",
           N_ENC, N_ENC, N_PROMPT, BEAMS, worst, refused ? "refused" : "ACCEPTED");
    pkv_cache_destroy(c);
    if (!(worst <= 1e-5) || !refused) {
        fprintf(stderr, "cross_attention: wrong\n");
        return 1;
    }
    return 0;
}
