/* tier_prefix.c: a prefix kept in a file tier outlives the pool that computed it. Engine A
 * computes a system prompt plus a question, saves the prompt's full blocks to a file tier
 * (pkv_tier_save) and exits (its cache and tier destroyed). Engine B, a new cache and a new tier
 * object on the same directory (another process, as far as the tier can tell), gets a second
 * question behind the same system prompt: its prefix match finds nothing in its empty pool,
 * pkv_tier_load copies the shared blocks from the files, and only the rest is computed. The
 * example fails unless B loads exactly the shared full blocks, its decode output over the
 * loaded blocks equals the output over blocks it computes itself, and the checker passes. */
#include <pkv.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { NL = 2, H = 2, D = 64, HQ = 4, BT = 16, BLOCKS = 64, SYS = 70, Q = 12 };

/* K/V of positions [from, n) of s, every layer, a function of the token and its position (as a
 * model's would be of the prefix); then committed. */
static int compute(pkv_cache *c, pkv_seq s, const int32_t *tok, uint32_t from, uint32_t n) {
    static float k[SYS + Q][H][D], v[SYS + Q][H][D];
    int rc = pkv_seq_append(c, s, tok + from, n - from, NULL);
    for (uint32_t l = 0; l < NL && !rc; l++) {
        for (uint32_t i = from; i < n; i++)
            for (int h = 0; h < H; h++)
                for (int d = 0; d < D; d++) {
                    k[i - from][h][d] = sinf(0.37f * (float)(tok[i] + 3 * h + d + 11 * l) + 0.01f * (float)i);
                    v[i - from][h][d] = cosf(0.23f * (float)(tok[i] * 5 + h - d + 7 * l) - 0.02f * (float)i);
                }
        rc = pkv_seq_write_kv(c, s, l, from, n - from, k, v, PKV_DTYPE_F32);
    }
    return rc ? rc : pkv_seq_commit(c, s, n);
}

static pkv_cache *engine(void) {
    pkv_config cfg = pkv_config_default(); /* prefix cache on */
    cfg.n_layers = NL, cfg.n_kv_heads = H, cfg.head_dim = D, cfg.block_tokens = BT, cfg.n_blocks = BLOCKS;
    cfg.k_dtype = PKV_DTYPE_F16, cfg.v_dtype = PKV_DTYPE_Q8_0, cfg.n_threads = 1;
    pkv_cache *c = NULL;
    return pkv_cache_create(&cfg, &c) ? NULL : c;
}

/* decode of the last position's query over s, layer 1 */
static int decode(pkv_cache *c, pkv_seq s, float *out) {
    static float q[HQ][D];
    for (int h = 0; h < HQ; h++)
        for (int d = 0; d < D; d++) q[h][d] = sinf(0.1f * (float)(h * D + d));
    pkv_attn_params p = pkv_attn_params_default();
    p.n_q_heads = HQ;
    return pkv_attn_decode(c, 1, &s, 1, &q[0][0], out, &p);
}

int main(void) {
    char dir[] = "/tmp/pkv-tier-example-XXXXXX";
    if (!mkdtemp(dir)) return 1;
    int32_t a_prompt[SYS + Q], b_prompt[SYS + Q];
    for (int i = 0; i < SYS; i++) a_prompt[i] = b_prompt[i] = 1000 + 7 * i; /* the system prompt */
    for (int i = SYS; i < SYS + Q; i++) a_prompt[i] = 5000 + i, b_prompt[i] = 9000 + i;
    const uint64_t cap = 64u << 20;
    int rc = 0, fails = 0;
    uint32_t saved = 0, reused = 0, loaded = 0;

    /* engine A: computes its prompt, saves it, exits */
    pkv_cache *a = engine();
    pkv_tier *t = NULL;
    pkv_seq s;
    if (!a || (rc = pkv_tier_file_create(dir, cap, NULL, &t))) goto out;
    if ((rc = pkv_seq_create(a, "sys", 3, &s)) || (rc = compute(a, s, a_prompt, 0, SYS + Q)) ||
        (rc = pkv_tier_save(t, a, s, &saved)))
        goto out;
    printf("engine A: computed %d positions, saved %u blocks to %s\n", SYS + Q, saved, dir);
    pkv_tier_destroy(t), t = NULL;
    pkv_cache_destroy(a), a = NULL;

    /* engine B: another question behind the same system prompt */
    pkv_cache *b = engine(), *ref = engine();
    if (!b || !ref || (rc = pkv_tier_file_create(dir, cap, NULL, &t))) {
        pkv_cache_destroy(b), pkv_cache_destroy(ref);
        goto out;
    }
    pkv_seq sb, sr;
    float out_b[HQ * D], out_r[HQ * D];
    char msg[256];
    if (!(rc = pkv_seq_create(b, "sys", 3, &sb)) && !(rc = pkv_seq_match_prefix(b, sb, b_prompt, SYS + Q, &reused)) &&
        !(rc = pkv_tier_load(t, b, sb, b_prompt, SYS + Q, &loaded)) &&
        !(rc = compute(b, sb, b_prompt, reused + loaded, SYS + Q)) && !(rc = decode(b, sb, out_b)) &&
        !(rc = pkv_seq_create(ref, "sys", 3, &sr)) && !(rc = compute(ref, sr, b_prompt, 0, SYS + Q)) &&
        !(rc = decode(ref, sr, out_r))) {
        printf("engine B: %u positions matched in its pool, %u loaded from the tier, %u computed\n", reused, loaded,
               SYS + Q - reused - loaded);
        const uint32_t shared = SYS / BT * BT; /* the full blocks of the system prompt */
        if (reused != 0 || loaded != shared) {
            fprintf(stderr, "tier_prefix: loaded %u, want %u\n", loaded, shared);
            fails++;
        }
        float worst = 0, scale = 0;
        for (int i = 0; i < HQ * D; i++) {
            const float diff = fabsf(out_b[i] - out_r[i]), m = fabsf(out_r[i]);
            if (diff > worst) worst = diff;
            if (m > scale) scale = m;
        }
        printf("engine B: decode over the loaded blocks vs computed ones: largest difference %.3g (output scale %.3g)\n",
               worst, scale);
        if (!(worst <= 1e-6f * scale)) fails++;
        if (pkv_cache_check(b, msg, sizeof msg)) fprintf(stderr, "tier_prefix: checker: %s\n", msg), fails++;
        pkv_tier_stats st;
        if (!(rc = pkv_tier_get_stats(t, &st)))
            printf("tier: %llu entries, %llu bytes in files, %llu blocks loaded\n", (unsigned long long)st.entries,
                   (unsigned long long)st.bytes, (unsigned long long)st.loaded_blocks);
    }
    pkv_cache_destroy(b);
    pkv_cache_destroy(ref);
out:
    if (rc) fprintf(stderr, "tier_prefix: %s\n", pkv_strerror(rc));
    pkv_tier_destroy(t);
    pkv_cache_destroy(a);
    /* the files: a tier of capacity 1 byte drops them all */
    if (!pkv_tier_file_create(dir, 1, NULL, &t)) pkv_tier_destroy(t);
    rmdir(dir);
    return rc || fails ? 1 : 0;
}
