/* image_mask.c: a vision-language prompt whose image tokens attend to each other both ways
 * (Gemma 3, PaliGemma), and two documents packed into one sequence that must not see each other,
 * each prefilled in one call with a custom mask (pkv_attn_prefill_masked), checked against a
 * direct computation.
 *
 * The prompt is 8 text tokens, 16 image tokens (one image's patch embeddings) and 8 text tokens.
 * Text is causal; an image token sees every earlier token and every token of its own image,
 * those after it included. The mask is built from the tokens' types, as a model's forward pass
 * builds it, one bit a (query, key), packed as numpy's packbits(bitorder="little") packs (bit i
 * is bit i % 8 of byte i / 8). The packed sequence holds documents of 20 and 12 tokens: each
 * query sees the earlier tokens of its own document.
 *
 * The image's positions hold ids from pkv_media_tokens of the image's content id (a model's
 * <image> placeholder is the same for every image: a prompt with another image would match this
 * one whole and get its K/V), so once the prompt is committed a second request with the same
 * image matches all of it and one with another image only the 8 text tokens before it. The
 * example fails if an output differs from the direct computation by more than float rounding, if
 * a mask beside a window is taken, or if a match reuses other than that. */
#include <pkv.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

enum { N = 32, IMG0 = 8, IMG1 = 24, DOC = 20, H = 2, HQ = 4, D = 32, BT = 16 };

static float rnd(unsigned *s) {
    *s = *s * 1103515245u + 12345u;
    return (float)((*s >> 8) & 0xffff) / 32768.0f - 1.0f;
}

/* Whether query i sees key t: the image prompt (layer 0) or the packed documents (layer 1). */
static bool sees(int layer, int i, int t) {
    if (layer == 1) return t <= i && (i < DOC) == (t < DOC);
    const bool img_i = i >= IMG0 && i < IMG1, img_t = t >= IMG0 && t < IMG1;
    return t <= i || (img_i && img_t);
}

/* The rows of q ([N][HQ][D]) over the keys their mask sets in k, v ([N][H][D]), directly; the
 * largest difference from out. */
static double check(int layer, const float *q, const float *out, const float *k, const float *v) {
    double worst = 0;
    for (int i = 0; i < N; i++)
        for (int h = 0; h < HQ; h++) {
            const float *qr = q + ((size_t)i * HQ + h) * D;
            double s[N], mx = -INFINITY, sum = 0;
            for (int t = 0; t < N; t++) {
                double dot = 0;
                for (int d = 0; d < D; d++) dot += (double)qr[d] * k[((size_t)t * H + h / (HQ / H)) * D + d];
                s[t] = sees(layer, i, t) ? dot / sqrt((double)D) : -INFINITY;
                mx = s[t] > mx ? s[t] : mx;
            }
            for (int t = 0; t < N; t++) sum += (s[t] = exp(s[t] - mx));
            for (int d = 0; d < D; d++) {
                double o = 0;
                for (int t = 0; t < N; t++) o += s[t] / sum * v[((size_t)t * H + h / (HQ / H)) * D + d];
                worst = fmax(worst, fabs(o - out[((size_t)i * HQ + h) * D + d]));
            }
        }
    return worst;
}

int main(void) {
    static float k[2][N][H][D], v[2][N][H][D], q[N][HQ][D], out[N][HQ][D];
    unsigned seed = 11;
    for (int i = 0; i < 2 * N * H * D; i++) (&k[0][0][0][0])[i] = rnd(&seed), (&v[0][0][0][0])[i] = rnd(&seed);
    for (int i = 0; i < N * HQ * D; i++) (&q[0][0][0])[i] = rnd(&seed);
    pkv_config cfg = pkv_config_default();
    cfg.n_layers = 2, cfg.n_kv_heads = H, cfg.head_dim = D, cfg.block_tokens = BT, cfg.n_blocks = 16;
    cfg.k_dtype = cfg.v_dtype = PKV_DTYPE_F32;
    pkv_cache *c;
    pkv_seq s;
    int32_t ids[N], slots[N];
    for (int t = 0; t < N; t++) ids[t] = 100 + t;
    /* the image's positions: ids from what identifies its content (a digest of its bytes and its
       preprocessing), the string's bytes without its NUL (as Python's media_tokens(str) takes) */
    static const char image_a[] = "sha256:4f0c...image a", image_b[] = "sha256:9e71...image b";
    if (pkv_media_tokens(image_a, sizeof image_a - 1, 0, IMG1 - IMG0, ids + IMG0)) return 1;
    if (pkv_cache_create(&cfg, &c) || pkv_seq_create(c, NULL, 0, &s) || pkv_seq_append(c, s, ids, N, slots) ||
        pkv_write_kv(c, 0, slots, N, &k[0][0][0][0], &v[0][0][0][0], PKV_DTYPE_F32) ||
        pkv_write_kv(c, 1, slots, N, &k[1][0][0][0], &v[1][0][0][0], PKV_DTYPE_F32)) {
        fprintf(stderr, "image_mask: set-up failed\n");
        return 1;
    }
    pkv_attn_params p = pkv_attn_params_default();
    p.n_q_heads = HQ;
    const pkv_attn_req req = {s, 0, N}; /* kv_len = q_start + n_q = N: rows of N bits */
    double worst = 0;
    for (int layer = 0; layer < 2; layer++) {
        uint8_t bits[N * N / 8];
        memset(bits, 0, sizeof bits);
        for (int i = 0; i < N; i++)
            for (int t = 0; t < N; t++)
                if (sees(layer, i, t)) bits[(i * N + t) / 8] |= (uint8_t)(1u << ((i * N + t) % 8));
        const uint8_t *const masks[1] = {bits};
        if (pkv_attn_prefill_masked(c, (uint32_t)layer, &req, 1, masks, &q[0][0][0], &out[0][0][0], &p)) {
            fprintf(stderr, "image_mask: pkv_attn_prefill_masked failed\n");
            return 1;
        }
        worst = fmax(worst, check(layer, &q[0][0][0], &out[0][0][0], &k[layer][0][0][0], &v[layer][0][0][0]));
    }
    /* a window is a causal rule: beside a mask it is refused (its bits go into the mask) */
    uint8_t all[N * N / 8];
    memset(all, 0xff, sizeof all);
    const uint8_t *const one[1] = {all};
    p.window = 8;
    const bool refused = pkv_attn_prefill_masked(c, 0, &req, 1, one, &q[0][0][0], &out[0][0][0], &p) == PKV_EINVAL;
    /* the prompt committed, the same text with the same image, then with another image */
    int32_t other[N];
    memcpy(other, ids, sizeof ids);
    uint32_t same_img = 0, other_img = 0;
    pkv_seq s2, s3;
    if (pkv_seq_commit(c, s, N) || pkv_media_tokens(image_b, sizeof image_b - 1, 0, IMG1 - IMG0, other + IMG0) ||
        pkv_seq_create(c, NULL, 0, &s2) || pkv_seq_match_prefix(c, s2, ids, N, &same_img) ||
        pkv_seq_create(c, NULL, 0, &s3) || pkv_seq_match_prefix(c, s3, other, N, &other_img)) {
        fprintf(stderr, "image_mask: prefix matching failed\n");
        return 1;
    }
    printf("image_mask: %d tokens, image [%d, %d) bidirectional, then documents of %d and %d packed: max |diff| "
           "%.2e against the direct computation; a window beside a mask %s; the prompt again matched %u "
           "positions with the same image, %u with another\n",
           N, IMG0, IMG1, DOC, N - DOC, worst, refused ? "refused" : "ACCEPTED", same_img, other_img);
    pkv_cache_destroy(c);
    if (!(worst <= 1e-5) || !refused || same_img != N - 1 || other_img != IMG0) {
        fprintf(stderr, "image_mask: wrong\n");
        return 1;
    }
    return 0;
}
