/* compact_prefix.c: compaction in the decode loop of an engine with the prefix cache on (the
 * default). Requests share a system prompt, arrive while others decode, and leave; what they
 * leave behind stays in the pool as CACHED blocks for later prompts to reuse, so the pool is soon
 * full of them and decode's new blocks land wherever the allocator finds room. Pool-order decode
 * pays for every change of sequence between two of the batch's blocks in id order
 * (docs/design.md, "Attention"). Each time a sequence's decode opens a new block, the engine calls
 * pkv_seq_compact with PKV_COMPACT_CACHED: the block joins its run where a FREE or CACHED id lies
 * next to it, and a CACHED block there is exchanged, not evicted, so no prefix is lost. The same
 * workload runs twice, without and with the call: the prefix reuse is the same, the switches
 * fall. */
#include <pkv.h>
#include <stdio.h>
#include <string.h>

enum { BT = 4, H = 2, D = 32, HQ = 4, SYS = 8, OWN = 10, MAXR = 8, NREQ = 40, NBLK = 160 };

typedef struct {
    pkv_seq s;
    uint32_t len, left; /* tokens held; decode steps left */
    int live;
} req;

/* K/V of token t at position p: what a model would compute from them (so a reused prefix
 * holds what the prompt would have written). */
static void kv_of(int32_t t, uint32_t p, float *k, float *v) {
    for (int h = 0; h < H; h++)
        for (int d = 0; d < D; d++) {
            k[h * D + d] = (float)((t * 7 + (int32_t)p + d) % 11) * 0.1f;
            v[h * D + d] = (float)((t + h * 3 + d) % 5);
        }
}

/* Appends tok[0 .. n) to s at positions pos.., writes their K/V and commits them. */
static int feed(pkv_cache *c, pkv_seq s, const int32_t *tok, uint32_t pos, uint32_t n) {
    int32_t slots[SYS + OWN];
    static float k[SYS + OWN][H * D], v[SYS + OWN][H * D];
    for (uint32_t i = 0; i < n; i++) kv_of(tok[i], pos + i, k[i], v[i]);
    int rc = pkv_seq_append(c, s, tok, n, slots);
    if (!rc) rc = pkv_write_kv(c, 0, slots, n, k, v, PKV_DTYPE_F32);
    if (!rc) rc = pkv_seq_commit(c, s, pos + n);
    return rc;
}

/* Of the decode batch's blocks in id order, the neighbours that belong to different sequences
 * (a block several hold counts as a change on both sides). */
static int count_switches(pkv_cache *c, const req *r, uint64_t *pairs, uint64_t *switches) {
    static int owner[NBLK];
    int32_t tab[64];
    memset(owner, 0, sizeof owner);
    for (int i = 0; i < MAXR; i++) {
        uint32_t n = 0;
        if (!r[i].live) continue;
        int rc = pkv_seq_block_table(c, r[i].s, tab, 64, &n);
        if (rc) return rc;
        for (uint32_t j = 0; j < n; j++) owner[tab[j]] = owner[tab[j]] ? -1 : i + 1;
    }
    for (int b = 0, prev = 0; b < NBLK; b++) {
        if (!owner[b]) continue;
        if (prev) *pairs += 1, *switches += owner[b] != prev || owner[b] < 0;
        prev = owner[b];
    }
    return 0;
}

/* The workload: without compaction (mode 0), with pkv_seq_compact at each new block with no flag
 * (1: FREE ids only) or with PKV_COMPACT_CACHED (2); returns a status, the switches' share, the
 * block copies and the prefix tokens reused. */
static int run(int mode, double *share, uint32_t *copies, uint64_t *reused) {
    pkv_config cfg = pkv_config_default();
    cfg.n_layers = 1, cfg.n_kv_heads = H, cfg.head_dim = D, cfg.block_tokens = BT, cfg.n_blocks = NBLK;
    cfg.n_threads = 1;
    pkv_cache *c = NULL;
    req r[MAXR] = {{0}};
    static float q[MAXR][HQ][D], out[MAXR][HQ][D];
    for (int i = 0; i < MAXR; i++)
        for (int h = 0; h < HQ; h++) q[i][h][0] = 0.25f * (float)(i + h);
    pkv_attn_params p = pkv_attn_params_default();
    p.n_q_heads = HQ;
    uint64_t pairs = 0, switches = 0;
    uint32_t seed = 12345, next = 0;
    *copies = 0;
    int rc = pkv_cache_create(&cfg, &c);
    for (uint32_t step = 0; !rc && step < 100000; step++) {
        int running = 0;
        for (int i = 0; i < MAXR && !rc; i++) { /* admit: the shared system prompt, then its own */
            if (r[i].live || next >= NREQ || (step % 3 && step > 0)) continue;
            int32_t prompt[SYS + OWN];
            uint32_t hit = 0;
            for (uint32_t j = 0; j < SYS + OWN; j++) prompt[j] = j < SYS ? (int32_t)(1 + j) : (int32_t)(1000 * next + j);
            rc = pkv_seq_create(c, NULL, 0, &r[i].s);
            if (!rc) rc = pkv_seq_match_prefix(c, r[i].s, prompt, SYS + OWN, &hit);
            if (!rc) rc = feed(c, r[i].s, prompt + hit, hit, SYS + OWN - hit);
            seed = seed * 1664525u + 1013904223u;
            r[i].len = SYS + OWN, r[i].left = 8 + (seed >> 8) % 48, r[i].live = !rc;
            next++;
        }
        for (int i = 0; i < MAXR && !rc; i++) { /* a decode step: one token each */
            if (!r[i].live) continue;
            const int32_t t = (int32_t)(50000 + 100 * i + r[i].len);
            rc = feed(c, r[i].s, &t, r[i].len, 1);
            if (!rc && mode && r[i].len % BT == 0) { /* the token opened a new block */
                uint32_t m = 0;
                rc = pkv_seq_compact(c, r[i].s, mode == 2 ? PKV_COMPACT_CACHED : 0u, &m);
                *copies += m;
            }
            r[i].len++, running++;
        }
        pkv_seq batch[MAXR];
        int nb = 0;
        for (int i = 0; i < MAXR; i++)
            if (r[i].live) batch[nb++] = r[i].s;
        if (!rc && nb) rc = pkv_attn_decode(c, 0, batch, (uint32_t)nb, &q[0][0][0], &out[0][0][0], &p);
        if (!rc) rc = count_switches(c, r, &pairs, &switches);
        for (int i = 0; i < MAXR && !rc; i++) /* finished ones leave their blocks to the cache */
            if (r[i].live && --r[i].left == 0) rc = pkv_seq_release(c, r[i].s), r[i].live = 0;
        if (!running && next >= NREQ) break;
    }
    pkv_stats st;
    if (!rc) rc = pkv_cache_check(c, NULL, 0);
    if (!rc) rc = pkv_cache_get_stats(c, &st);
    if (!rc) *reused = st.prefix_tokens_hit, *share = pairs ? (double)switches / (double)pairs : 0.0;
    pkv_cache_destroy(c);
    return rc;
}

int main(void) {
    double share[3] = {0};
    uint32_t copies[3] = {0};
    uint64_t reused[3] = {0};
    int rc = 0;
    for (int mode = 0; mode < 3 && !rc; mode++) rc = run(mode, &share[mode], &copies[mode], &reused[mode]);
    if (rc) {
        fprintf(stderr, "pkv: %s\n", pkv_strerror(rc));
        return 1;
    }
    printf("decode batches' neighbouring blocks from different sequences: %.1f%% without compaction, %.1f%% "
           "with pkv_seq_compact at each new block (%u block copies), %.1f%% with PKV_COMPACT_CACHED (%u); "
           "prefix tokens reused: %llu, %llu, %llu\n",
           100.0 * share[0], 100.0 * share[1], copies[1], 100.0 * share[2], copies[2], (unsigned long long)reused[0],
           (unsigned long long)reused[1], (unsigned long long)reused[2]);
    return share[2] < share[1] && share[1] <= share[0] && reused[0] > 0 && reused[1] == reused[0] &&
                   reused[2] == reused[0]
               ? 0
               : 1;
}
