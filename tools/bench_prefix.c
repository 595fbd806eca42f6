/* bench_prefix.c: `pkv bench prefix`: cost of pkv_seq_match_prefix per prompt token, on a full
 * hit and on a miss, for short and long prompts, with a small and a large prefix index.
 *
 * The index is filled cheaply: a tiny block shape (1 layer, 1 kv head, head_dim 8, f16), and
 * sequences that append + commit distinct tokens without writing K/V (commit needs no write),
 * then release, so their blocks stay indexed as CACHED. Each repetition creates an empty
 * sequence (untimed), matches (timed), releases (untimed). Hit prompts rotate over the filled
 * sequences, so the index memory a match walks is not always hot. Public API only. */
#include "tool.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FILL_TOKENS 8192u /* tokens per filling sequence (512 blocks of 16) */
#define BLOCK 16u

static void usage(FILE *f) {
    fprintf(f,
            "usage: pkv bench prefix [--json] [--quick] [--reps N]\n"
            "\n"
            "Median ns per prompt token of pkv_seq_match_prefix on a full hit (the prompt was\n"
            "committed before: all its blocks are attached) and on a miss (a prompt never seen),\n"
            "for prompts of 256 and 8192 tokens, with 10,000 and 1,000,000 blocks in the index\n"
            "(B = 16). hit: prompts rotate over the filled sequences (index memory cold-ish);\n"
            "hit_hot: the same prompt every time (it stays in cache: the algorithm alone).\n"
            "The ratio column compares with the smallest index of the same run: ~1.0 means\n"
            "the cost does not grow with the index. Then what recording the index's events costs\n"
            "(event_capacity 1024 against 0): a commit that indexes 512 blocks (commit_index) and\n"
            "an append that evicts 512 cached ones (append_evict), with the ratio on / off. Then an\n"
            "append that evicts 256 cached blocks a sequence dropped from its front above 256 it still\n"
            "holds (pkv_seq_drop_front: the first eviction takes those 256 out of the index) against\n"
            "256 of a released sequence (evict_front, ratio dropped / released).\n"
            "\n"
            "  --json     one JSON object per line (keys: op, prompt_tokens, index_blocks,\n"
            "             ns_per_token, median_ns, p10_ns_per_token, p90_ns_per_token, reps,\n"
            "             ratio_vs_smallest_index; the events' lines: op, events, blocks, reps,\n"
            "             median_ns, ns_per_block, ratio_vs_no_events; the dropped front's: op,\n"
            "             blocks, reps, median_ns, ns_per_block, ratio_vs_released)\n"
            "  --quick    index sizes 10,000 and 100,000, fewer repetitions (a smoke run)\n"
            "  --reps N   repetitions per point (default 2001 for 256 tokens, 201 for 8192)\n"
            "  --help     this text\n");
}

/* Token t of filling sequence i: distinct across sequences, positive. */
static int32_t fill_token(uint32_t i, uint32_t t) {
    uint64_t z = ((uint64_t)i << 32 | t) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 29)) * 0xBF58476D1CE4E5B9ull;
    return (int32_t)((z ^ (z >> 32)) & 0x3fffffff);
}

typedef struct bench_point {
    const char *op;
    uint32_t prompt_tokens, index_blocks, reps;
    double median_ns, ns_per_token, p10, p90;
} bench_point;

/* A cache whose index holds exactly `blocks` blocks; the number of filled sequences in *n_fill. */
static int fill_index(uint32_t blocks, pkv_cache **out, uint32_t *n_fill) {
    pkv_config cfg = pkv_config_default();
    cfg.n_layers = 1;
    cfg.n_kv_heads = 1;
    cfg.head_dim = 8;
    cfg.block_tokens = BLOCK;
    cfg.k_dtype = cfg.v_dtype = PKV_DTYPE_F16;
    cfg.n_blocks = blocks + 2 * FILL_TOKENS / BLOCK; /* headroom: nothing gets evicted */
    cfg.max_blocks_per_seq = FILL_TOKENS / BLOCK + 1;
    cfg.max_seqs = 8;
    cfg.n_threads = 1;
    cfg.huge_pages = 0;
    pkv_cache *c = NULL;
    tool_log_errors(&cfg, "pkv bench prefix");
    if (tool_check(pkv_cache_create(&cfg, &c), "pkv_cache_create") < 0) return -1;
    int32_t *tok = malloc(FILL_TOKENS * sizeof *tok);
    if (!tok) {
        pkv_cache_destroy(c);
        return -1;
    }
    uint32_t left = blocks, i = 0;
    int rc = 0;
    while (left > 0 && rc == 0) {
        uint32_t nb = left < FILL_TOKENS / BLOCK ? left : FILL_TOKENS / BLOCK, n = nb * BLOCK;
        for (uint32_t t = 0; t < n; t++) tok[t] = fill_token(i, t);
        pkv_seq s;
        rc = tool_check(pkv_seq_create(c, NULL, 0, &s), "pkv_seq_create");
        if (rc == 0) rc = tool_check(pkv_seq_append(c, s, tok, n, NULL), "pkv_seq_append");
        if (rc == 0) rc = tool_check(pkv_seq_commit(c, s, n), "pkv_seq_commit");
        if (rc == 0) rc = tool_check(pkv_seq_release(c, s), "pkv_seq_release");
        left -= nb;
        i++;
    }
    free(tok);
    pkv_stats st;
    if (rc == 0) rc = tool_check(pkv_cache_get_stats(c, &st), "pkv_cache_get_stats");
    if (rc == 0 && st.n_indexed != blocks) {
        fprintf(stderr, "pkv bench prefix: index holds %llu blocks, wanted %u\n", (unsigned long long)st.n_indexed,
                blocks);
        rc = -1;
    }
    if (rc) {
        pkv_cache_destroy(c);
        return -1;
    }
    *out = c;
    *n_fill = i;
    return 0;
}

/* Times `reps` matches of prompts of n tokens: hits (prefixes of filled sequences, rotating) or
 * misses (fresh token ids). Checks every match reused what it must. */
static int measure(pkv_cache *c, uint32_t n_fill, uint32_t index_blocks, int hit, uint32_t n, uint32_t reps,
                   tool_rng *rng, bench_point *pt) {
    int32_t *tok = malloc(n * sizeof *tok);
    double *ns = malloc(reps * sizeof *ns);
    if (!tok || !ns) {
        free(tok);
        free(ns);
        return -1;
    }
    /* sequences that hold at least n tokens: all but possibly the last */
    uint32_t full_seqs = index_blocks / (FILL_TOKENS / BLOCK), last_blocks = index_blocks % (FILL_TOKENS / BLOCK);
    uint32_t eligible = full_seqs + (last_blocks * BLOCK >= n ? 1 : 0);
    if (hit && eligible == 0) {
        free(tok);
        free(ns);
        return 1; /* index too small for this prompt */
    }
    int rc = 0;
    for (uint32_t r = 0; r < reps && rc == 0; r++) {
        if (hit) {
            /* hit: a random filled sequence (the index memory is cold-ish); hot: always the
               first one (what the match walks stays in cache: isolates the algorithm) */
            uint32_t i = hit == 2 ? 0 : (uint32_t)(tool_rng_u64(rng) % eligible);
            for (uint32_t t = 0; t < n; t++) tok[t] = fill_token(i, t);
        } else {
            uint32_t i = n_fill + 1 + (uint32_t)(tool_rng_u64(rng) % 1000000);
            for (uint32_t t = 0; t < n; t++) tok[t] = fill_token(i, t) | 0x40000000; /* never filled */
        }
        pkv_seq s;
        rc = tool_check(pkv_seq_create(c, NULL, 0, &s), "pkv_seq_create");
        if (rc) break;
        uint32_t reused = 0;
        uint64_t t0 = tool_now_ns();
        rc = pkv_seq_match_prefix(c, s, tok, n, &reused);
        uint64_t t1 = tool_now_ns();
        tool_check(rc, "pkv_seq_match_prefix");
        ns[r] = (double)(t1 - t0);
        if (rc == 0 && reused != (hit ? n - 1 : 0)) {
            fprintf(stderr, "pkv bench prefix: %s of %u tokens reused %u\n", hit ? "hit" : "miss", n, reused);
            rc = -1;
        }
        int rc2 = tool_check(pkv_seq_release(c, s), "pkv_seq_release");
        if (rc == 0) rc = rc2;
    }
    if (rc == 0) {
        pt->op = hit == 2 ? "hit_hot" : hit ? "hit" : "miss";
        pt->prompt_tokens = n;
        pt->index_blocks = index_blocks;
        pt->reps = reps;
        pt->p10 = tool_percentile(ns, reps, 10.0) / n;
        pt->p90 = tool_percentile(ns, reps, 90.0) / n;
        pt->median_ns = tool_median(ns, reps);
        pt->ns_per_token = pt->median_ns / n;
    }
    free(tok);
    free(ns);
    return rc ? -1 : 0;
}

/* A 1-layer cache of 1 kv head of 8 for the events' and the dropped front's measurements. */
static int small_cache(uint32_t n_blocks, uint32_t max_seqs, uint32_t event_capacity, pkv_cache **out) {
    pkv_config cfg = pkv_config_default();
    cfg.n_layers = 1, cfg.n_kv_heads = 1, cfg.head_dim = 8;
    cfg.block_tokens = BLOCK;
    cfg.n_blocks = n_blocks;
    cfg.max_seqs = max_seqs;
    cfg.n_threads = 1;
    cfg.huge_pages = 0;
    cfg.event_capacity = event_capacity;
    tool_log_errors(&cfg, "pkv bench prefix");
    return tool_check(pkv_cache_create(&cfg, out), "pkv_cache_create");
}

/* What recording the prefix index's events costs: a commit that indexes a 512-block prompt
 * (commit_index) and an append that evicts 512 cached blocks (append_evict), in a cache with
 * event_capacity 0 and one with 1,024, reps interleaved (the order alternating), the events
 * taken untimed after each. out[op][events]: the median ns. */
#define EV_BLOCKS 512u
static int measure_events(uint32_t reps, double out[2][2]) {
    pkv_cache *c[2] = {NULL, NULL};
    int32_t *tok = malloc(EV_BLOCKS * BLOCK * sizeof *tok);
    double *ns = malloc(4 * (size_t)reps * sizeof *ns);
    pkv_event *ev = malloc(1024 * sizeof *ev);
    int rc = tok && ns && ev ? 0 : -1;
    for (int e = 0; e < 2 && rc == 0; e++) rc = small_cache(EV_BLOCKS, 4, e ? 1024 : 0, &c[e]);
    const uint32_t n = EV_BLOCKS * BLOCK;
    for (uint32_t r = 0; r < reps && rc == 0; r++)
        for (int k = 0; k < 2 && rc == 0; k++) {
            const int e = (int)((r + (uint32_t)k) & 1);
            pkv_seq s, s2;
            for (uint32_t t = 0; t < n; t++) tok[t] = fill_token(2000000 + r * 2 + (uint32_t)e, t);
            rc = tool_check(pkv_seq_create(c[e], NULL, 0, &s), "pkv_seq_create");
            if (rc == 0) rc = tool_check(pkv_seq_append(c[e], s, tok, n, NULL), "pkv_seq_append");
            uint64_t t0 = tool_now_ns();
            if (rc == 0) rc = tool_check(pkv_seq_commit(c[e], s, n), "pkv_seq_commit");
            ns[(0 * 2 + e) * reps + r] = (double)(tool_now_ns() - t0);
            if (rc == 0) rc = tool_check(pkv_seq_release(c[e], s), "pkv_seq_release"); /* 512 CACHED */
            for (uint32_t t = 0; t < n; t++) tok[t] |= 0x40000000;
            if (rc == 0) rc = tool_check(pkv_seq_create(c[e], NULL, 0, &s2), "pkv_seq_create");
            t0 = tool_now_ns();
            if (rc == 0) rc = tool_check(pkv_seq_append(c[e], s2, tok, n, NULL), "pkv_seq_append"); /* evicts all */
            ns[(1 * 2 + e) * reps + r] = (double)(tool_now_ns() - t0);
            if (rc == 0) rc = tool_check(pkv_seq_release(c[e], s2), "pkv_seq_release");
            size_t got = 0, total = 0;
            do {
                if (e && rc == 0) rc = tool_check(pkv_cache_take_events(c[e], ev, 1024, NULL, &got), "pkv_cache_take_events");
                total += got;
            } while (e && rc == 0 && got);
            if (rc == 0 && e && total != 2 * EV_BLOCKS) {
                fprintf(stderr, "pkv bench prefix: %zu events for %u blocks stored and removed\n", total, EV_BLOCKS);
                rc = -1;
            }
        }
    for (int op = 0; op < 2 && rc == 0; op++)
        for (int e = 0; e < 2; e++) out[op][e] = tool_median(ns + (size_t)(op * 2 + e) * reps, reps);
    pkv_cache_destroy(c[0]);
    pkv_cache_destroy(c[1]);
    free(tok), free(ns), free(ev);
    return rc ? -1 : 0;
}

/* What evicting a dropped front costs (pkv_seq_drop_front with prefix caching: stop 84): an append
 * that takes 256 CACHED blocks, (0) a released sequence's (a chain evicted leaf by leaf) and (1)
 * the front a sequence dropped above 256 blocks it still holds (the first eviction walks those
 * 256 out of the index and clamps the sequences' chains, max_seqs 256; then leaf by leaf), reps
 * interleaved. out[case]: the median ns. */
#define FR_BLOCKS 256u
static int measure_front(uint32_t reps, double out[2]) {
    pkv_cache *c = NULL;
    int32_t *tok = malloc(2 * FR_BLOCKS * BLOCK * sizeof *tok);
    double *ns = malloc(2 * (size_t)reps * sizeof *ns);
    int rc = tok && ns ? 0 : -1;
    if (rc == 0) rc = small_cache(2 * FR_BLOCKS, 256, 0, &c);
    const uint32_t half = FR_BLOCKS * BLOCK;
    for (uint32_t r = 0; r < reps && rc == 0; r++)
        for (int k = 0; k < 2 && rc == 0; k++) {
            const int front = (int)((r + (uint32_t)k) & 1);
            pkv_seq s = 0, f = 0, s2 = 0;
            for (uint32_t t = 0; t < 2 * half; t++) tok[t] = fill_token(3000000 + r * 2 + (uint32_t)front, t);
            rc = tool_check(pkv_seq_create(c, NULL, 0, &s), "pkv_seq_create");
            if (front) { /* 512 blocks committed, the first 256 dropped: CACHED above the rest */
                if (rc == 0) rc = tool_check(pkv_seq_append(c, s, tok, 2 * half, NULL), "pkv_seq_append");
                if (rc == 0) rc = tool_check(pkv_seq_commit(c, s, 2 * half), "pkv_seq_commit");
                if (rc == 0) rc = tool_check(pkv_seq_drop_front(c, s, half), "pkv_seq_drop_front");
            } else { /* 256 blocks committed and released, 256 held unindexed by another */
                if (rc == 0) rc = tool_check(pkv_seq_append(c, s, tok, half, NULL), "pkv_seq_append");
                if (rc == 0) rc = tool_check(pkv_seq_commit(c, s, half), "pkv_seq_commit");
                if (rc == 0) rc = tool_check(pkv_seq_release(c, s), "pkv_seq_release");
                s = 0;
                if (rc == 0) rc = tool_check(pkv_seq_create(c, NULL, 0, &f), "pkv_seq_create");
                if (rc == 0) rc = tool_check(pkv_seq_append(c, f, tok + half, half, NULL), "pkv_seq_append");
            }
            for (uint32_t t = 0; t < half; t++) tok[t] |= 0x40000000;
            if (rc == 0) rc = tool_check(pkv_seq_create(c, NULL, 0, &s2), "pkv_seq_create");
            const uint64_t t0 = tool_now_ns();
            if (rc == 0) rc = tool_check(pkv_seq_append(c, s2, tok, half, NULL), "pkv_seq_append"); /* evicts 256 */
            ns[front * reps + r] = (double)(tool_now_ns() - t0);
            const pkv_seq ids[3] = {s, f, s2};
            for (int i = 0; i < 3 && rc == 0; i++)
                if (ids[i]) rc = tool_check(pkv_seq_release(c, ids[i]), "pkv_seq_release");
            if (rc == 0) rc = tool_check(pkv_cache_reset(c), "pkv_cache_reset");
        }
    for (int front = 0; front < 2 && rc == 0; front++) out[front] = tool_median(ns + (size_t)front * reps, reps);
    pkv_cache_destroy(c);
    free(tok), free(ns);
    return rc ? -1 : 0;
}

int tool_bench_prefix(int argc, char **argv) {
    int json = 0, quick = 0;
    uint32_t reps_arg = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json")) json = 1;
        else if (!strcmp(argv[i], "--quick")) quick = 1;
        else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            usage(stdout);
            return TOOL_OK;
        } else if (!strcmp(argv[i], "--reps")) {
            const char *val = i + 1 < argc ? argv[++i] : "";
            uint32_t v;
            if (tool_parse_u32(val, &v) || v < 1 || v > 1000000) {
                fprintf(stderr, "pkv bench prefix: --reps wants 1..1000000, got '%s'\n", val);
                return TOOL_USAGE;
            }
            reps_arg = v;
        } else {
            fprintf(stderr, "pkv bench prefix: unknown option '%s'\n\n", argv[i]);
            usage(stderr);
            return TOOL_USAGE;
        }
    }
    const uint32_t sizes_full[2] = {10000, 1000000}, sizes_quick[2] = {10000, 100000};
    const uint32_t *sizes = quick ? sizes_quick : sizes_full;
    const uint32_t prompts[2] = {256, 8192};
    bench_point pts[12];
    uint32_t n_pts = 0;
    tool_rng rng;
    tool_rng_seed(&rng, 42);

    if (json)
        printf("{\"bench\":\"prefix\",\"build\":\"%s\",\"cpu\":\"%s\",\"block_tokens\":%u,\"quick\":%s}\n",
               tool_build_info(), tool_cpu_name(), BLOCK, quick ? "true" : "false");
    else
        printf("pkv bench prefix: %s, %s, B=%u, match cost per prompt token (median of reps)\n", tool_build_info(),
               tool_cpu_name(), BLOCK);
    for (int si = 0; si < 2; si++) {
        pkv_cache *c;
        uint32_t n_fill;
        uint64_t t0 = tool_now_ns();
        if (fill_index(sizes[si], &c, &n_fill) < 0) return TOOL_FAIL;
        if (!json)
            fprintf(stderr, "  index of %u blocks filled in %.2f s\n", sizes[si], (double)(tool_now_ns() - t0) * 1e-9);
        for (int hit = 2; hit >= 0; hit--)
            for (int pi = 0; pi < 2; pi++) {
                uint32_t reps = reps_arg ? reps_arg : prompts[pi] <= 256 ? (quick ? 51 : 2001) : (quick ? 15 : 201);
                /* warm-up: page the index and the code in */
                bench_point warm;
                if (measure(c, n_fill, sizes[si], hit, prompts[pi], 3, &rng, &warm) < 0) {
                    pkv_cache_destroy(c);
                    return TOOL_FAIL;
                }
                int rc = measure(c, n_fill, sizes[si], hit, prompts[pi], reps, &rng, &pts[n_pts]);
                if (rc < 0) {
                    pkv_cache_destroy(c);
                    return TOOL_FAIL;
                }
                if (rc == 0) n_pts++;
            }
        char msg[256];
        int rc = pkv_cache_check(c, msg, sizeof msg);
        pkv_cache_destroy(c);
        if (rc < 0) {
            fprintf(stderr, "pkv bench prefix: pkv_cache_check: %s\n", msg);
            return TOOL_FAIL;
        }
    }
    if (!json) printf("%-7s %8s %10s %12s %12s %10s %10s %8s\n", "op", "prompt", "index", "median_ns", "ns/token",
                      "p10/tok", "p90/tok", "ratio");
    for (uint32_t i = 0; i < n_pts; i++) {
        /* baseline: the same op and prompt with the smallest index of this run */
        double base = pts[i].ns_per_token;
        for (uint32_t j = 0; j < n_pts; j++)
            if (!strcmp(pts[j].op, pts[i].op) && pts[j].prompt_tokens == pts[i].prompt_tokens &&
                pts[j].index_blocks == sizes[0])
                base = pts[j].ns_per_token;
        double ratio = base > 0 ? pts[i].ns_per_token / base : 0.0;
        if (json)
            printf("{\"bench\":\"prefix\",\"op\":\"%s\",\"prompt_tokens\":%u,\"index_blocks\":%u,\"reps\":%u,"
                   "\"median_ns\":%.0f,\"ns_per_token\":%.3f,\"p10_ns_per_token\":%.3f,\"p90_ns_per_token\":%.3f,"
                   "\"ratio_vs_smallest_index\":%.3f}\n",
                   pts[i].op, pts[i].prompt_tokens, pts[i].index_blocks, pts[i].reps, pts[i].median_ns,
                   pts[i].ns_per_token, pts[i].p10, pts[i].p90, ratio);
        else
            printf("%-7s %8u %10u %12.0f %12.2f %10.2f %10.2f %8.2f\n", pts[i].op, pts[i].prompt_tokens,
                   pts[i].index_blocks, pts[i].median_ns, pts[i].ns_per_token, pts[i].p10, pts[i].p90, ratio);
    }
    if (!json) printf("goal: hit <= 20 ns/token, ratio ~1 (flat in the index size)\n");
    const uint32_t ev_reps = reps_arg ? reps_arg : quick ? 15 : 201;
    double evm[2][2];
    if (measure_events(ev_reps, evm) < 0) return TOOL_FAIL;
    static const char *const ev_ops[2] = {"commit_index", "append_evict"};
    if (!json)
        printf("\nevents: the cost of recording them (event_capacity 1024 against 0, reps interleaved)\n"
               "%-13s %7s %12s %12s %8s\n", "op", "blocks", "off ns", "on ns", "on/off");
    for (int op = 0; op < 2; op++) {
        const double ratio = evm[op][0] > 0 ? evm[op][1] / evm[op][0] : 0.0;
        if (json)
            for (int e = 0; e < 2; e++)
                printf("{\"bench\":\"prefix\",\"op\":\"%s\",\"events\":%s,\"blocks\":%u,\"reps\":%u,"
                       "\"median_ns\":%.0f,\"ns_per_block\":%.3f,\"ratio_vs_no_events\":%.3f}\n",
                       ev_ops[op], e ? "true" : "false", EV_BLOCKS, ev_reps, evm[op][e], evm[op][e] / EV_BLOCKS,
                       e ? ratio : 1.0);
        else
            printf("%-13s %7u %12.0f %12.0f %8.3f\n", ev_ops[op], EV_BLOCKS, evm[op][0], evm[op][1], ratio);
    }
    double fr[2];
    if (measure_front(ev_reps, fr) < 0) return TOOL_FAIL;
    const double fr_ratio = fr[0] > 0 ? fr[1] / fr[0] : 0.0;
    if (json)
        for (int front = 0; front < 2; front++)
            printf("{\"bench\":\"prefix\",\"op\":\"%s\",\"blocks\":%u,\"reps\":%u,\"median_ns\":%.0f,"
                   "\"ns_per_block\":%.3f,\"ratio_vs_released\":%.3f}\n",
                   front ? "evict_front" : "evict_released", FR_BLOCKS, ev_reps, fr[front], fr[front] / FR_BLOCKS,
                   front ? fr_ratio : 1.0);
    else
        printf("\ndropped fronts: an append that evicts %u CACHED blocks, released (a chain) against dropped above "
               "%u held (pkv_seq_drop_front)\n%-13s %7u %12.0f %12.0f %8.3f\n",
               FR_BLOCKS, FR_BLOCKS, "evict_front", FR_BLOCKS, fr[0], fr[1], fr_ratio);
    return TOOL_OK;
}
