/* kv_router.c: KV-aware routing from prefix-index events, as a router in front of several
 * engines does it (llm-d, Dynamo with vLLM's KV events). Three replica caches record their
 * prefix index's events; the router keeps, per replica, only the block hashes those events name,
 * computes each prompt's hashes itself (pkv_prefix_hashes: no cache needed) and sends the prompt
 * where the most leading blocks are held. Two chats of three turns each, over one system prompt,
 * arrive interleaved: under a bound on each replica's load the chats get a replica each, every
 * later turn goes back to the one that holds its chat's history, and that replica's own prefix
 * match then reuses exactly the blocks the router counted (`pkv route` does this at scale).
 * The example fails (exit 1) if a prediction is wrong or a turn lands elsewhere. */
#include <pkv.h>
#include <stdio.h>
#include <string.h>

enum { REPLICAS = 3, BT = 16, SYS = 48, TURN = 40, TURNS = 3, MAX_TOK = SYS + TURNS * TURN, MAX_HELD = 256 };

typedef struct router {
    uint64_t held[REPLICAS][MAX_HELD]; /* the block hashes each replica's events say it holds */
    int n_held[REPLICAS];
} router;

static int holds(const router *r, int rep, uint64_t h) {
    for (int i = 0; i < r->n_held[rep]; i++)
        if (r->held[rep][i] == h) return 1;
    return 0;
}

/* Engine side: ship what changed; router side: apply it. */
static int sync_events(router *r, int rep, pkv_cache *c) {
    pkv_event ev[64];
    size_t n;
    do {
        int rc = pkv_cache_take_events(c, ev, 64, NULL, &n);
        if (rc) return rc;
        for (size_t i = 0; i < n; i++) {
            if (ev[i].kind == PKV_EVENT_STORED && r->n_held[rep] < MAX_HELD) r->held[rep][r->n_held[rep]++] = ev[i].hash;
            if (ev[i].kind == PKV_EVENT_REMOVED)
                for (int k = 0; k < r->n_held[rep]; k++)
                    if (r->held[rep][k] == ev[i].hash) r->held[rep][k] = r->held[rep][--r->n_held[rep]];
            if (ev[i].kind == PKV_EVENT_CLEARED || ev[i].kind == PKV_EVENT_OVERFLOW) return PKV_EINVAL; /* not here */
        }
    } while (n);
    return PKV_OK;
}

int main(void) {
    pkv_cache *c[REPLICAS] = {0};
    pkv_config cfg = pkv_config_default();
    cfg.n_layers = 1, cfg.n_kv_heads = 1, cfg.head_dim = 8, cfg.block_tokens = BT, cfg.n_blocks = 64;
    cfg.n_threads = 1, cfg.huge_pages = 0;
    cfg.event_capacity = 256;
    static router r;
    int rc = 0, load[REPLICAS] = {0}, home[2] = {-1, -1};
    for (int i = 0; i < REPLICAS && !rc; i++) rc = pkv_cache_create(&cfg, &c[i]);
    int32_t chat[2][MAX_TOK];
    for (int k = 0; k < 2; k++)
        for (int t = 0; t < MAX_TOK; t++) chat[k][t] = t < SYS ? 7 + t : 1000 * (k + 1) + t; /* one system prompt */
    for (int step = 0; step < 2 * TURNS && !rc; step++) {
        const int k = step % 2, turn = step / 2;
        const uint32_t n = SYS + (uint32_t)(turn + 1) * TURN; /* the history, this turn's message included */
        /* route: the replica whose events hold the most leading blocks, ties to the least loaded,
           among those under 1.5x the mean load (bounded loads: else every chat would pile onto
           the first replica that cached the system prompt) */
        const int cap = (3 * (step + 1) + 2 * REPLICAS - 1) / (2 * REPLICAS);
        uint64_t h[MAX_TOK / BT];
        size_t nh;
        rc = pkv_prefix_hashes(NULL, 0, BT, chat[k], n, h, MAX_TOK / BT, &nh);
        int pick = -1;
        uint32_t best = 0;
        for (int i = 0; i < REPLICAS && !rc; i++) {
            if (load[i] + 1 > cap) continue;
            uint32_t m = 0;
            while (m < nh && holds(&r, i, h[m])) m++;
            if (pick < 0 || m > best || (m == best && load[i] < load[pick])) pick = i, best = m;
        }
        if (pick < 0) pick = 0; /* cannot happen: the least loaded is always under the bound */
        /* serve: match, compute the rest (K/V writes left out here), commit, done */
        pkv_seq s;
        uint32_t reused = 0;
        if (!rc) rc = pkv_seq_create(c[pick], NULL, 0, &s);
        if (!rc) rc = pkv_seq_match_prefix(c[pick], s, chat[k], n, &reused);
        if (!rc) rc = pkv_seq_append(c[pick], s, chat[k] + reused, n - reused, NULL);
        if (!rc) rc = pkv_seq_commit(c[pick], s, n);
        if (!rc) rc = pkv_seq_release(c[pick], s);
        if (!rc) rc = sync_events(&r, pick, c[pick]);
        if (rc) break;
        load[pick]++;
        printf("chat %d turn %d: %u tokens -> replica %d (the router counted %u blocks held; it reused %u tokens)\n",
               k, turn, n, pick, best, reused);
        const uint32_t want = best < (n - 1) / BT ? best : (n - 1) / BT;
        if (reused / BT != want || (turn > 0 && pick != home[k])) {
            fprintf(stderr, "kv_router: chat %d turn %d went to replica %d (home %d), reused %u of %u predicted blocks\n",
                    k, turn, pick, home[k], reused / BT, want);
            rc = PKV_ECORRUPT;
        }
        if (turn == 0) home[k] = pick;
    }
    if (!rc && home[0] == home[1]) rc = PKV_ECORRUPT, fprintf(stderr, "kv_router: both chats on one replica\n");
    for (int i = 0; i < REPLICAS; i++) pkv_cache_destroy(c[i]);
    if (rc) {
        fprintf(stderr, "kv_router: %s\n", pkv_strerror(rc));
        return 1;
    }
    printf("kv_router: every later turn went home and reused what the router predicted\n");
    return 0;
}
