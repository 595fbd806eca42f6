/* readme_example.c: the README's tour of the API: a cache, a prompt's K/V, attention, a fork. */
#include <pkv.h>
#include <stdio.h>

int main(void) {
    pkv_config cfg = pkv_config_default(); /* f16 pool, 16-token blocks, prefix cache on */
    cfg.n_layers = 1, cfg.n_kv_heads = 2, cfg.head_dim = 64, cfg.n_blocks = 64;
    pkv_cache *c = NULL;
    pkv_seq s, child;
    uint32_t reused = 0;
    int32_t prompt[20], slots[20];
    static float k[20][2][64], v[20][2][64], q[8][64], out[8][64]; /* 8 query heads (GQA) */
    for (int i = 0; i < 20; i++) prompt[i] = 100 + i, v[i][1][0] = 1.0f;
    int rc = pkv_cache_create(&cfg, &c);
    if (!rc) rc = pkv_seq_create(c, NULL, 0, &s);
    if (!rc) rc = pkv_seq_match_prefix(c, s, prompt, 20, &reused); /* 0 on a cold cache */
    if (!rc) rc = pkv_seq_append(c, s, prompt + reused, 20 - reused, slots);
    if (!rc) rc = pkv_write_kv(c, 0, slots, 20 - reused, k[reused], v[reused], PKV_DTYPE_F32);
    if (!rc) rc = pkv_seq_commit(c, s, 20); /* its full block now serves later prompts */
    pkv_attn_params p = pkv_attn_params_default();
    p.n_q_heads = 8;
    if (!rc) rc = pkv_attn_decode(c, 0, &s, 1, &q[0][0], &out[0][0], &p); /* query at position 19 */
    if (!rc && (out[4][0] < 0.999f || out[4][0] > 1.001f)) rc = PKV_ECORRUPT; /* heads 4-7 read kv head 1 */
    if (!rc) rc = pkv_seq_fork(c, s, &child); /* shares every block, copies nothing */
    if (!rc) rc = pkv_seq_release(c, child);
    if (!rc) rc = pkv_seq_release(c, s);
    if (rc) fprintf(stderr, "pkv: %s\n", pkv_strerror(rc));
    pkv_cache_destroy(c);
    return rc ? 1 : 0;
}
