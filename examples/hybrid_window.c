/* hybrid_window.c: a model that mixes sliding-window layers with global ones (Gemma 2 and 3,
 * gpt-oss, Mistral's window, Llama 4's chunked layers), its windowed layers' K/V in a cache of
 * their own that lets go of what the window has passed (pkv_seq_drop_front), both caches
 * indexing prefixes, checked against a direct computation.
 *
 * A block holds every layer of its cache, so one cache for all layers keeps every position of
 * the global layers and, with them, of the windowed ones. Here layers 0 and 2 are global and
 * layers 1 and 3 see the last W positions: after each step a sequence drops, in their cache, the
 * blocks its next query no longer sees. Four sequences take a 40-token prompt, then decode 160
 * steps each; every step's output of every layer is compared with attention over a plain copy of
 * the K/V. The windowed cache holds at most ceil(W / B) + 1 blocks a sequence in use, where the
 * global one holds the whole length. The windowed cache's pool has room for two blocks more than
 * that: as the sequences grow, their dropped blocks are evicted and leave tombstones in its index
 * (token ids, no K/V), so a second turn of sequence 0's conversation (its 200 positions and 8 new
 * ones) is matched whole in the global cache and, under the window
 * (pkv_seq_match_prefix_window), in the windowed one, where a plain match stops at block 0, as
 * an engine needs before it skips the prefill; it decodes over the matched K/V. Then the engine
 * restarts: that turn, saved to a host tier from each cache beforehand (the windowed cache's from
 * its front on), comes back whole in the global cache and, under the window
 * (pkv_tier_load_window), only as far back as the window reads in the windowed one, and the
 * turn's last query decodes again over it. The example fails if an output differs from the
 * direct computation by more than float rounding, if the windowed cache holds more than that, if
 * no tombstone was left, if either cache matches less than the 200 positions, or if the restore
 * gives less than the turn's positions or stores as much for the windowed layers as for the
 * global ones. */
#include <pkv.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

enum { SEQS = 4, PROMPT = 40, STEPS = 160, LEN = PROMPT + STEPS, TURN = 8, H = 2, HQ = 4, D = 32, BT = 16, W = 48 };

static float rnd(unsigned *s) {
    *s = *s * 1103515245u + 12345u;
    return (float)((*s >> 8) & 0xffff) / 32768.0f - 1.0f;
}

/* The example's own copy of the K/V: [model layer][seq][position][H][D]; sequence SEQS is the
 * second turn of sequence 0. */
static float K[4][SEQS + 1][LEN + TURN][H][D], V[4][SEQS + 1][LEN + TURN][H][D];

/* The largest difference between out ([HQ][D]) and attention of q ([HQ][D]) at position pos of
 * sequence i over layer l's positions [lo, pos]. */
static double check(const float *q, const float *out, int l, int i, int pos, int lo) {
    double worst = 0;
    for (int h = 0; h < HQ; h++) {
        const int kh = h / (HQ / H);
        double s[LEN + TURN], mx = -INFINITY, sum = 0;
        for (int t = lo; t <= pos; t++) {
            double dot = 0;
            for (int d = 0; d < D; d++) dot += (double)q[h * D + d] * K[l][i][t][kh][d];
            s[t] = dot / sqrt((double)D);
            mx = s[t] > mx ? s[t] : mx;
        }
        for (int t = lo; t <= pos; t++) sum += (s[t] = exp(s[t] - mx));
        for (int d = 0; d < D; d++) {
            double o = 0;
            for (int t = lo; t <= pos; t++) o += s[t] / sum * V[l][i][t][kh][d];
            worst = fmax(worst, fabs(o - out[h * D + d]));
        }
    }
    return worst;
}

/* Appends n positions (token ids 1 + position % 500) to sequence i in both caches, writes every
 * model layer's K/V for them (random where fresh, else as K and V hold them already): layers 0, 2
 * to the global cache's 0, 1, layers 1, 3 to the local one's; commits. */
static int append(pkv_cache *g, pkv_cache *w, const pkv_seq *sg, const pkv_seq *sw, int i, int start, int n,
                  int fresh, unsigned *seed) {
    int32_t tok[LEN + TURN], slots[LEN + TURN];
    for (int j = 0; j < n; j++) tok[j] = 1 + (start + j) % 500;
    for (int l = 0; l < 4 && fresh; l++)
        for (int j = start; j < start + n; j++)
            for (int h = 0; h < H; h++)
                for (int d = 0; d < D; d++) K[l][i][j][h][d] = rnd(seed), V[l][i][j][h][d] = rnd(seed);
    for (int side = 0; side < 2; side++) {
        pkv_cache *c = side ? w : g;
        const pkv_seq s = side ? sw[i] : sg[i];
        int rc = pkv_seq_append(c, s, tok, (uint32_t)n, slots);
        for (int cl = 0; cl < 2 && !rc; cl++) {
            const int l = 2 * cl + side;
            rc = pkv_write_kv(c, (uint32_t)cl, slots, (uint32_t)n, &K[l][i][start][0][0], &V[l][i][start][0][0],
                              PKV_DTYPE_F32);
        }
        if (!rc) rc = pkv_seq_commit(c, s, (uint32_t)(start + n));
        if (rc) return rc;
    }
    return 0;
}

/* Decodes the query at pos of each of the n sequences from i0 through the model's 4 layers (one
 * batch a layer) and returns the worst difference from the direct computation in *worst. */
static int decode(pkv_cache *g, pkv_cache *w, const pkv_seq *sg, const pkv_seq *sw, int i0, int n, int pos,
                  unsigned *seed, double *worst) {
    static float q[SEQS][HQ][D], out[SEQS][HQ][D];
    pkv_attn_params pg = pkv_attn_params_default(), pw = pkv_attn_params_default();
    pg.n_q_heads = pw.n_q_heads = HQ;
    pw.window = W;
    int rc = 0;
    for (int l = 0; l < 4 && !rc; l++) {
        for (int j = 0; j < n * HQ * D; j++) (&q[0][0][0])[j] = rnd(seed);
        const int local = l % 2;
        rc = pkv_attn_decode(local ? w : g, (uint32_t)(l / 2), (local ? sw : sg) + i0, (uint32_t)n, &q[0][0][0],
                             &out[0][0][0], local ? &pw : &pg);
        for (int i = 0; i < n && !rc; i++)
            *worst = fmax(*worst, check(&q[i][0][0], &out[i][0][0], l, i0 + i, pos, local && pos + 1 > W ? pos + 1 - W : 0));
    }
    return rc;
}

int main(void) {
    pkv_config cfg = pkv_config_default();
    cfg.n_layers = 2, cfg.n_kv_heads = H, cfg.head_dim = D, cfg.block_tokens = BT;
    cfg.k_dtype = cfg.v_dtype = PKV_DTYPE_F32;
    cfg.enable_prefix_cache = 1;
    cfg.n_blocks = SEQS * (LEN / BT + 1) + (LEN + TURN) / BT + 2; /* every position, and the second turn */
    pkv_cache *g = NULL, *w = NULL;
    int rc = pkv_cache_create(&cfg, &g);
    /* the window's blocks and one a step appends to, a sequence, and two more: the sequences'
       dropped blocks (CACHED, above the blocks they hold) are evicted as they grow */
    cfg.n_blocks = SEQS * ((W + BT - 1) / BT + 2) + 2;
    if (!rc) rc = pkv_cache_create(&cfg, &w);
    pkv_seq sg[SEQS + 1], sw[SEQS + 1];
    unsigned seed = 11;
    for (int i = 0; i < SEQS && !rc; i++) {
        rc = pkv_seq_create(g, NULL, 0, &sg[i]);
        if (!rc) rc = pkv_seq_create(w, NULL, 0, &sw[i]);
        if (!rc) rc = append(g, w, sg, sw, i, 0, PROMPT, 1, &seed);
        if (!rc) rc = pkv_seq_drop_front(w, sw[i], PROMPT + 1 > W ? PROMPT + 1 - W : 0);
    }
    if (rc) {
        fprintf(stderr, "hybrid_window: set-up failed: %s\n", pkv_strerror(rc));
        return 1;
    }
    double worst = 0;
    uint32_t most_local = 0;
    for (int step = 0; step < STEPS && !rc; step++) {
        const int pos = PROMPT + step; /* the position each sequence decodes */
        for (int i = 0; i < SEQS && !rc; i++) rc = append(g, w, sg, sw, i, pos, 1, 1, &seed);
        pkv_stats st; /* the windowed cache's peak: after the appends, before the drops */
        if (!rc) rc = pkv_cache_get_stats(w, &st);
        if (!rc && st.n_active > most_local) most_local = st.n_active;
        if (!rc) rc = decode(g, w, sg, sw, 0, SEQS, pos, &seed, &worst);
        /* the next query, at pos + 1, sees from pos + 2 - W on: the blocks wholly before go */
        for (int i = 0; i < SEQS && !rc && pos + 2 > W; i++) rc = pkv_seq_drop_front(w, sw[i], (uint32_t)(pos + 2 - W));
    }
    pkv_stats sg_st, sw_st;
    if (!rc) rc = pkv_cache_get_stats(g, &sg_st);
    if (!rc) rc = pkv_cache_get_stats(w, &sw_st);
    /* the second turn of sequence 0: its LEN positions and TURN new ones, matched in each cache
       (the windowed one past its tombstones, up to the global match); an engine takes the shorter
       match of the two and computes the rest (here: writes the K/V sequence 0 had there, which a
       model would compute again). Sequences 1-3 are done: their blocks go back first */
    for (int i = 1; i < SEQS && !rc; i++) {
        rc = pkv_seq_release(g, sg[i]);
        if (!rc) rc = pkv_seq_release(w, sw[i]);
    }
    uint32_t hit_g = 0, hit_w = 0, hit_plain = 0;
    const int t = SEQS, n_turn = LEN + TURN;
    for (int l = 0; l < 4; l++)
        for (int j = 0; j < n_turn; j++)
            for (int h = 0; h < H; h++)
                for (int d = 0; d < D; d++) {
                    K[l][t][j][h][d] = j < LEN ? K[l][0][j][h][d] : rnd(&seed);
                    V[l][t][j][h][d] = j < LEN ? V[l][0][j][h][d] : rnd(&seed);
                }
    int32_t prompt[LEN + TURN];
    for (int j = 0; j < n_turn; j++) prompt[j] = 1 + j % 500;
    if (!rc) rc = pkv_seq_create(g, NULL, 0, &sg[t]);
    if (!rc) rc = pkv_seq_create(w, NULL, 0, &sw[t]);
    pkv_stats tomb_st;
    if (!rc) rc = pkv_cache_get_stats(w, &tomb_st);
    pkv_seq plain = 0; /* what a plain match finds in the windowed cache: it stops at a tombstone */
    if (!rc) rc = pkv_seq_create(w, NULL, 0, &plain);
    if (!rc) rc = pkv_seq_match_prefix(w, plain, prompt, (uint32_t)n_turn, &hit_plain);
    if (!rc) rc = pkv_seq_release(w, plain);
    if (!rc) rc = pkv_seq_match_prefix(g, sg[t], prompt, (uint32_t)n_turn, &hit_g);
    /* the windowed cache matches at most what the global one did (a windowed match's front may
       not be truncated into), its front dropped before what the window sees */
    if (!rc) rc = pkv_seq_match_prefix_window(w, sw[t], prompt, hit_g + 1, W, &hit_w);
    const uint32_t hit = hit_w;
    if (!rc) rc = pkv_seq_truncate(g, sg[t], hit);
    if (!rc) rc = append(g, w, sg, sw, t, (int)hit, n_turn - (int)hit, 0, &seed);
    if (!rc) rc = pkv_seq_drop_front(w, sw[t], (uint32_t)(n_turn - W)); /* its query sees the last W */
    if (!rc) rc = decode(g, w, sg, sw, t, 1, n_turn - 1, &seed, &worst);
    /* an engine restart: the pools forget (pkv_cache_reset), host tiers do not. The second turn
       was saved from both caches, each to a tier of its own (a key takes the cache's shape and
       namespace, not which layers it holds: the same here). The windowed cache's save stores
       the blocks from its front on (their keys take the ids before the front from its index).
       The conversation comes back from the tiers: whole in the global cache (pkv_tier_load),
       only what the window reads in the windowed one (pkv_tier_load_window: the front dropped
       before it), and its last query decodes again over what came back */
    pkv_tier *tg = NULL, *tw = NULL;
    uint32_t saved_g = 0, saved_w = 0, got_g = 0, got_w = 0;
    pkv_seq_info rw = {0};
    if (!rc) rc = pkv_tier_host_create(64u << 20, NULL, &tg);
    if (!rc) rc = pkv_tier_host_create(64u << 20, NULL, &tw);
    if (!rc) rc = pkv_tier_save(tg, g, sg[t], &saved_g);
    if (!rc) rc = pkv_tier_save(tw, w, sw[t], &saved_w);
    for (int i = 0; i <= SEQS && !rc; i += SEQS) {
        rc = pkv_seq_release(g, sg[i]);
        if (!rc) rc = pkv_seq_release(w, sw[i]);
    }
    if (!rc) rc = pkv_cache_reset(g);
    if (!rc) rc = pkv_cache_reset(w);
    if (!rc) rc = pkv_seq_create(g, NULL, 0, &sg[t]);
    if (!rc) rc = pkv_seq_create(w, NULL, 0, &sw[t]);
    if (!rc) rc = pkv_tier_load(tg, g, sg[t], prompt, (uint32_t)n_turn, &got_g);
    if (!rc) rc = pkv_tier_load_window(tw, w, sw[t], prompt, got_g + 1, W, &got_w);
    if (!rc) rc = pkv_seq_get_info(w, sw[t], &rw);
    if (!rc) rc = pkv_seq_truncate(g, sg[t], got_w); /* (the same here: n_turn - 1) */
    if (!rc) rc = append(g, w, sg, sw, t, (int)got_w, n_turn - (int)got_w, 0, &seed);
    if (!rc) rc = pkv_seq_drop_front(w, sw[t], (uint32_t)(n_turn - W));
    if (!rc) rc = decode(g, w, sg, sw, t, 1, n_turn - 1, &seed, &worst);
    if (rc) {
        fprintf(stderr, "hybrid_window: %s\n", pkv_strerror(rc));
        return 1;
    }
    const uint32_t bound = SEQS * ((W + BT - 1) / BT + 1); /* a block-aligned front: < W + BT positions */
    printf("hybrid_window: %d sequences of %d positions, window %d: global layers' cache %u blocks, windowed "
           "layers' %u in use (at most %u during the run, bound %u), %u cached, %llu tombstones; a second turn of "
           "sequence 0 matched %u positions in the global cache, %u in the windowed one under the window (%u "
           "plainly); after a restart, restored from host tiers: %u positions in the global cache (%u blocks "
           "saved), %u in the windowed one (%u blocks saved, front %u); worst |out - direct| %.2e\n",
           SEQS, LEN, W, sg_st.n_active, sw_st.n_active, most_local, bound, sw_st.n_cached,
           (unsigned long long)tomb_st.n_tombstones, hit_g, hit_w, hit_plain, got_g, saved_g, got_w, saved_w,
           rw.n_dropped, worst);
    if (worst > 1e-4 || most_local > bound || hit < LEN || tomb_st.n_tombstones == 0 || got_w != (uint32_t)n_turn - 1 ||
        saved_w >= saved_g || rw.n_dropped == 0) {
        fprintf(stderr, "hybrid_window: FAILED\n");
        return 1;
    }
    pkv_tier_destroy(tg);
    pkv_tier_destroy(tw);
    pkv_cache_destroy(g);
    pkv_cache_destroy(w);
    return 0;
}
