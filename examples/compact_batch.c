/* compact_batch.c: compaction in an engine's decode loop. Prompts arrive in chunks, so their
 * blocks interleave in the pool; before a long decode the batch is repacked once
 * (pkv_batch_compact), so each sequence's table is one run of block ids and pool-order decode
 * switches sequences less often. The decode results are the same bits before and after. The
 * repack leaves FREE ids after each run (its slack) for the blocks decode will add: the free
 * queue hands a new block out anywhere, and pkv_seq_compact then moves it next to its run (one
 * block copy per block_tokens tokens). Packed tight (slack 0) the decode steps would interleave
 * the sequences again, with no room for pkv_seq_compact to mend it. When the batch changes (one
 * sequence finishes, a new one is prefilled next to decode steps), a second pkv_batch_compact
 * moves the new sequence's blocks and the odd block decode added away from its run: what is
 * laid out already stays where it is. */
#include <pkv.h>
#include <stdio.h>
#include <string.h>

enum { N_SEQ = 6, PROMPT = 40, CHUNK = 8, STEPS = 24, SLACK = 8, BT = 4, H = 2, D = 32, HQ = 4, RUN = (PROMPT + STEPS) / BT };

/* Fraction of neighbouring table entries that are neighbouring block ids, over the batch. */
static double adjacency(pkv_cache *c, const pkv_seq *s) {
    int32_t tab[64];
    uint32_t n = 0, adj = 0, pairs = 0;
    for (int i = 0; i < N_SEQ; i++) {
        if (pkv_seq_block_table(c, s[i], tab, 64, &n)) return -1.0;
        for (uint32_t j = 1; j < n; j++) adj += tab[j] == tab[j - 1] + 1, pairs++;
    }
    return pairs ? (double)adj / pairs : 1.0;
}

/* Appends n tokens to s and writes K/V for them (values from the position). */
static int feed(pkv_cache *c, pkv_seq s, uint32_t pos, uint32_t n) {
    int32_t tok[CHUNK], slots[CHUNK];
    static float k[CHUNK][H][D], v[CHUNK][H][D];
    for (uint32_t t = 0; t < n; t++) {
        tok[t] = (int32_t)(pos + t);
        for (int h = 0; h < H; h++)
            for (int d = 0; d < D; d++)
                k[t][h][d] = (float)((pos + t + d) % 7) * 0.1f, v[t][h][d] = (float)((pos + t) % 5 + h);
    }
    int rc = pkv_seq_append(c, s, tok, n, slots);
    if (!rc) rc = pkv_write_kv(c, 0, slots, n, k, v, PKV_DTYPE_F32);
    if (!rc) rc = pkv_seq_commit(c, s, pos + n);
    return rc;
}

int main(void) {
    pkv_config cfg = pkv_config_default();
    cfg.n_layers = 1, cfg.n_kv_heads = H, cfg.head_dim = D, cfg.block_tokens = BT, cfg.n_blocks = 128;
    cfg.enable_prefix_cache = 0;
    pkv_cache *c = NULL;
    pkv_seq s[N_SEQ];
    static float q[N_SEQ][HQ][D], out[2][N_SEQ][HQ][D];
    for (int i = 0; i < N_SEQ; i++)
        for (int h = 0; h < HQ; h++) q[i][h][0] = 0.5f * (float)(i + h);
    pkv_attn_params p = pkv_attn_params_default();
    p.n_q_heads = HQ;
    uint32_t moved = 0, len = 0;
    int rc = pkv_cache_create(&cfg, &c);
    for (int i = 0; i < N_SEQ && !rc; i++) rc = pkv_seq_create(c, NULL, 0, &s[i]);
    for (; len < PROMPT && !rc; len += CHUNK) /* chunked prefill, the batch in turns */
        for (int i = 0; i < N_SEQ && !rc; i++) rc = feed(c, s[i], len, CHUNK);
    const double before = rc ? 0 : adjacency(c, s);
    if (!rc) rc = pkv_attn_decode(c, 0, s, N_SEQ, &q[0][0][0], &out[0][0][0][0], &p);
    if (!rc) rc = pkv_batch_compact(c, s, N_SEQ, SLACK, 0, &moved); /* room for STEPS tokens and more */
    if (!rc) rc = pkv_attn_decode(c, 0, s, N_SEQ, &q[0][0][0], &out[1][0][0][0], &p);
    if (!rc && memcmp(out[0], out[1], sizeof out[0])) rc = PKV_ECORRUPT; /* the same bits */
    const double after = rc ? 0 : adjacency(c, s);
    uint32_t seq_moved = 0;
    for (int step = 0; step < STEPS && !rc; step++, len++) {
        for (int i = 0; i < N_SEQ && !rc; i++) {
            uint32_t m = 0;
            rc = feed(c, s[i], len, 1);
            if (!rc && len % cfg.block_tokens == 0) rc = pkv_seq_compact(c, s[i], 0, &m); /* a new block */
            seq_moved += m;
        }
        if (!rc) rc = pkv_attn_decode(c, 0, s, N_SEQ, &q[0][0][0], &out[0][0][0][0], &p);
    }
    if (!rc) rc = pkv_cache_check(c, NULL, 0);
    const double end = rc ? 0 : adjacency(c, s);
    /* the batch changes: sequence 2 finishes, a new one takes its place and is prefilled */
    static int32_t tabs[N_SEQ][64];
    uint32_t n_tab[N_SEQ] = {0}, moved2 = 0, kept = 0;
    if (!rc) rc = pkv_seq_release(c, s[2]);
    if (!rc) rc = pkv_seq_create(c, NULL, 0, &s[2]);
    for (uint32_t pos = 0; pos < PROMPT && !rc; pos += CHUNK, len++) { /* chunked, next to decode */
        rc = feed(c, s[2], pos, CHUNK);
        for (int i = 0; i < N_SEQ && !rc; i++) {
            uint32_t m = 0;
            if (i != 2) rc = feed(c, s[i], len, 1);
            if (!rc && i != 2 && len % cfg.block_tokens == 0) rc = pkv_seq_compact(c, s[i], 0, &m);
            seq_moved += m;
        }
    }
    for (int i = 0; i < N_SEQ && !rc; i++) rc = pkv_seq_block_table(c, s[i], tabs[i], 64, &n_tab[i]);
    if (!rc) rc = pkv_batch_compact(c, s, N_SEQ, SLACK, 0, &moved2);
    for (int i = 0; i < N_SEQ && !rc; i++) {
        int32_t tab[64];
        uint32_t n = 0;
        rc = pkv_seq_block_table(c, s[i], tab, 64, &n);
        kept += i != 2 && n == n_tab[i] && !memcmp(tab, tabs[i], RUN * sizeof *tab); /* its run stayed */
    }
    if (!rc) rc = pkv_cache_check(c, NULL, 0);
    const double changed = rc ? 0 : adjacency(c, s);
    if (!rc)
        printf("adjacent blocks: %.2f after chunked prefill, %.2f after pkv_batch_compact (%u block copies), "
               "%.2f after %d decode steps (pkv_seq_compact moved %u blocks); a new sequence in the batch: "
               "%.2f after pkv_batch_compact again (%u block copies; %u of the %d others kept their runs)\n",
               before, after, moved, end, STEPS, seq_moved, changed, moved2, kept, N_SEQ - 1);
    if (rc) fprintf(stderr, "pkv: %s\n", pkv_strerror(rc));
    pkv_cache_destroy(c);
    return rc || after < 0.99 || end < 0.99 || changed < 0.95 || kept != N_SEQ - 1 ? 1 : 0;
}
