/* bench_tree.c: `pkv bench tree`: a draft tree verified by tree attention (pkv_attn_tree) against
 * what an engine without it does: each root-to-leaf path prefilled as a sequence of its own (a
 * fork of the prefix holding that path), and, as the floor, one prefill of as many queries. */
#include "tool.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { NQH = 32, NKV = 8, HD = 128, BT = 16, MAX_NODES = 256 };

static void usage(FILE *f) {
    fprintf(f,
            "usage: pkv bench tree [--json] [--ctx LIST] [--width LIST] [--threads LIST] [--rounds N]\n"
            "\n"
            "Speculative decoding's verification: a draft tree of W branches of depth 4 below one root\n"
            "(1 + 4W nodes, its K/V after a prefix of CTX tokens), f16 K/V, n_q_heads 32, n_kv_heads 8,\n"
            "head_dim 128, block_tokens 16. Times, calls interleaved in each round, the median over rounds:\n"
            "  tree     pkv_attn_tree: every node sees the prefix and its own path\n"
            "  paths    the W root-to-leaf paths as W sequences (forks of the prefix, each holding\n"
            "           its path's 5 positions), one pkv_attn_prefill of W requests of 5 queries\n"
            "  prefill  one pkv_attn_prefill of 1 + 4W queries after the prefix: the same queries\n"
            "           and prefix reads with causal masks, the floor for the tree\n"
            "and reports tree / paths and tree / prefill.\n"
            "\n"
            "  --ctx LIST      prefix lengths [512,4096,32768]\n"
            "  --width LIST    branches W [1,4,16]\n"
            "  --threads LIST  attention threads [1,2]\n"
            "  --rounds N      rounds, 3..99 [7]\n"
            "  --json          one JSON object per line\n");
}

int tool_bench_tree(int argc, char **argv) {
    uint32_t ctx[8] = {512, 4096, 32768}, width[8] = {1, 4, 16}, thr[4] = {1, 2}, rounds = 7;
    int n_ctx = 3, n_w = 3, n_thr = 2, json = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *val = i + 1 < argc ? argv[i + 1] : "";
        int bad = 0;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return TOOL_OK;
        } else if (!strcmp(a, "--json")) {
            json = 1;
            continue;
        } else if (!strcmp(a, "--ctx")) bad = tool_parse_u32_list(val, ctx, 8, 1u << 20, &n_ctx);
        else if (!strcmp(a, "--width")) bad = tool_parse_u32_list(val, width, 8, (MAX_NODES - 1) / 4, &n_w);
        else if (!strcmp(a, "--threads")) bad = tool_parse_u32_list(val, thr, 4, 256, &n_thr);
        else if (!strcmp(a, "--rounds")) bad = tool_parse_u32(val, &rounds) || rounds < 3 || rounds > 99;
        else {
            fprintf(stderr, "pkv bench tree: unknown option '%s'\n\n", a);
            usage(stderr);
            return TOOL_USAGE;
        }
        if (bad) {
            fprintf(stderr, "pkv bench tree: bad value '%s' for %s\n", val, a);
            return TOOL_USAGE;
        }
        i++;
    }
    if (!json)
        printf("pkv bench tree: %s on %s; f16, n_q_heads %d, n_kv_heads %d, head_dim %d, block_tokens %d, %u rounds\n"
               "%8s %6s %6s %4s %12s %12s %12s %11s %13s\n",
               tool_build_info(), tool_cpu_name(), NQH, NKV, HD, BT, rounds, "ctx", "width", "nodes", "thr", "tree_us",
               "paths_us", "prefill_us", "tree/paths", "tree/prefill");
    /* queries: the tree's 1 + 4W, the paths' 5W */
    const size_t rows = 5 * ((MAX_NODES - 1) / 4);
    float *kv = malloc(sizeof(float) * TOOL_FILL_CHUNK * NKV * HD), *q = malloc(sizeof(float) * rows * NQH * HD);
    float *out = malloc(sizeof(float) * rows * NQH * HD);
    double *t[3] = {malloc(sizeof(double) * rounds), malloc(sizeof(double) * rounds), malloc(sizeof(double) * rounds)};
    int status = TOOL_FAIL;
    if (!kv || !q || !out || !t[0] || !t[1] || !t[2]) goto done;
    uint64_t rng = 12345;
    for (size_t i = 0; i < rows * NQH * HD; i++) q[i] = (float)((i * 2654435761u) % 1000) / 1000.0f - 0.5f;
    for (int ci = 0; ci < n_ctx; ci++)
        for (int ti = 0; ti < n_thr; ti++)
            for (int wi = 0; wi < n_w; wi++) {
                const uint32_t W = width[wi], n = 1 + 4 * W, C = ctx[ci];
                pkv_config cfg = pkv_config_default();
                cfg.n_layers = 1, cfg.n_kv_heads = NKV, cfg.head_dim = HD, cfg.block_tokens = BT;
                cfg.k_dtype = cfg.v_dtype = PKV_DTYPE_F16;
                cfg.n_threads = thr[ti], cfg.max_seqs = W + 2, cfg.enable_prefix_cache = 0;
                cfg.max_blocks_per_seq = (C + n) / BT + 2;
                cfg.n_blocks = cfg.max_blocks_per_seq + W * 2 + 4;
                pkv_cache *c = NULL;
                if (tool_check(pkv_cache_create(&cfg, &c), "pkv_cache_create") < 0) goto done;
                /* the tree: node 0 the root; branch b's nodes 1 + 4b .. 4 + 4b, a chain below it */
                int32_t par[MAX_NODES];
                par[0] = -1;
                for (uint32_t b = 0; b < W; b++)
                    for (uint32_t d = 0; d < 4; d++) par[1 + 4 * b + d] = d ? (int32_t)(4 * b + d) : 0;
                pkv_seq s, paths[MAX_NODES / 4];
                pkv_attn_req preq[MAX_NODES / 4];
                int ok = tool_check(pkv_seq_create(c, NULL, 0, &s), "pkv_seq_create") >= 0 && tool_fill_seq(c, s, C, 0, kv, &rng) == 0;
                if (ok) ok = tool_check(pkv_seq_commit(c, s, C), "pkv_seq_commit") >= 0;
                for (uint32_t b = 0; ok && b < W; b++) { /* each path: a fork holding its 5 positions */
                    ok = tool_check(pkv_seq_fork(c, s, &paths[b]), "pkv_seq_fork") >= 0 && tool_fill_seq(c, paths[b], 5, 0, kv, &rng) == 0;
                    preq[b] = (pkv_attn_req){paths[b], C, 5};
                }
                ok = ok && tool_fill_seq(c, s, n, 0, kv, &rng) == 0;
                const pkv_attn_tree_req tr = {s, C, n, par};
                const pkv_attn_req pr = {s, C, n};
                pkv_attn_params p = pkv_attn_params_default();
                p.n_q_heads = NQH;
                for (uint32_t r = 0; ok && r < rounds + 1; r++) /* round 0 warms up */
                    for (int k = 0; ok && k < 3; k++) {
                        const int which = (int)((r + (uint32_t)k) % 3); /* the order turns each round */
                        const uint64_t t0 = tool_now_ns();
                        const int rc = which == 0   ? pkv_attn_tree(c, 0, &tr, 1, q, out, &p)
                                       : which == 1 ? pkv_attn_prefill(c, 0, preq, W, q, out, &p)
                                                    : pkv_attn_prefill(c, 0, &pr, 1, q, out, &p);
                        ok = tool_check(rc, which == 0 ? "pkv_attn_tree" : "pkv_attn_prefill") >= 0;
                        if (r) t[which][r - 1] = (double)(tool_now_ns() - t0) * 1e-3;
                    }
                pkv_cache_destroy(c);
                if (!ok) goto done;
                const double mt = tool_median(t[0], rounds), mp = tool_median(t[1], rounds),
                             mf = tool_median(t[2], rounds);
                if (json)
                    printf("{\"bench\":\"tree\",\"ctx\":%u,\"width\":%u,\"nodes\":%u,\"threads\":%u,\"tree_us\":%.1f,"
                           "\"paths_us\":%.1f,\"prefill_us\":%.1f,\"tree_over_paths\":%.3f,\"tree_over_prefill\":%.3f}\n",
                           C, W, n, thr[ti], mt, mp, mf, mt / mp, mt / mf);
                else
                    printf("%8u %6u %6u %4u %12.1f %12.1f %12.1f %11.3f %13.3f\n", C, W, n, thr[ti], mt, mp, mf, mt / mp,
                           mt / mf);
                fflush(stdout);
            }
    status = TOOL_OK;
done:
    free(kv), free(q), free(out), free(t[0]), free(t[1]), free(t[2]);
    return status;
}
