/* bench_share.c: `pkv bench share`: decode of a batch of forks (parallel sampling), of R requests
 * after one system prompt, with the shared-prefix groups pkv_attn_decode makes, against the same
 * batch in a cache where PKV_ATTN_SHARE=off, built alike and called in turn. */
#include "tool.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { NQH = 32, NKV = 8, HD = 128, BT = 16, MAX_FORKS = 64, MAX_LAYERS = 256 };

static void usage(FILE *f) {
    fprintf(f,
            "usage: pkv bench share [--json] [--ctx LIST] [--forks LIST] [--threads LIST] [--dtype LIST]\n"
            "                       [--requests N] [--prompt N] [--own N] [--mib N] [--rounds N]\n"
            "\n"
            "Decode of F forks of one sequence of CTX positions, each with OWN positions of its own after\n"
            "the fork (parallel sampling, beam search), n_q_heads 32, n_kv_heads 8, head_dim 128,\n"
            "block_tokens 16, over as many layers as make the K/V of one cache at least MIB MiB (up to\n"
            "256), so that calls read it from memory. Two caches built alike: `shared` as\n"
            "pkv_attn_decode runs by default (the forks' common blocks read once for all of them, as the\n"
            "environment's PKV_ATTN_SHARE says: auto where unset), `plain` with PKV_ATTN_SHARE=off. Each\n"
            "round decodes every layer of both, the caches in turn; times are medians of the calls. Reports\n"
            "shared / plain and the positions each shared call read once rather than once a fork\n"
            "(pkv_stats.attn_shared_keys over the calls). With --requests R, R requests of PROMPT positions\n"
            "each after one system prompt of CTX positions, F forks each: a batch of R x F sequences whose\n"
            "groups nest (the system prompt read once for all, each request's prompt once a request).\n"
            "\n"
            "  --ctx LIST      prefix lengths [4096,32768]\n"
            "  --forks LIST    forks F, 2..64 (R x F at most 64) [2,4,16]\n"
            "  --threads LIST  attention threads [1,2]\n"
            "  --dtype LIST    K/V dtypes (f32, f16, bf16, fp8_e4m3, q8_0, q4_0) [f16]\n"
            "  --requests N    requests R after the system prompt, 1..32 [1]\n"
            "  --prompt N      each request's own prompt positions, at most 65536 [0]\n"
            "  --own N         each fork's own positions [16]\n"
            "  --mib N         the K/V one cache's calls read, MiB, 1..65536 [1024]\n"
            "  --rounds N      rounds, 3..99 [5]\n"
            "  --json          one JSON object per line\n");
}

/* The batch's shape: R requests of `prompt` positions after a system prompt of ctx, F forks of
 * each, `own` positions each fork. */
typedef struct shape {
    uint32_t ctx, R, prompt, F, own;
} shape;

/* A cache of the forks: the system prompt, each request a fork of it with its prompt, each
 * request's F forks (the request itself the first) in ids[r * F + f]. share_off: made with
 * PKV_ATTN_SHARE=off (the variable restored after). NULL on failure (said). */
static pkv_cache *make(const pkv_config *cfg, const shape *sp, bool share_off, pkv_seq *ids, float *kv) {
    const char *was = getenv("PKV_ATTN_SHARE");
    char *keep = was ? strdup(was) : NULL;
    if (share_off) setenv("PKV_ATTN_SHARE", "off", 1);
    pkv_cache *c = NULL;
    const int rc = pkv_cache_create(cfg, &c);
    if (share_off) {
        if (keep) setenv("PKV_ATTN_SHARE", keep, 1);
        else unsetenv("PKV_ATTN_SHARE");
    }
    free(keep);
    if (tool_check(rc, "pkv_cache_create") < 0) return NULL;
    uint64_t rng = 12345; /* both caches alike */
    pkv_seq sys;
    const uint32_t F = sp->F;
    int ok = tool_check(pkv_seq_create(c, NULL, 0, &sys), "pkv_seq_create") >= 0 && tool_fill_seq(c, sys, sp->ctx, 0, kv, &rng) == 0;
    for (uint32_t r = 0; ok && r < sp->R; r++) {
        pkv_seq *req = &ids[r * F];
        ok = tool_check(pkv_seq_fork(c, sys, req), "pkv_seq_fork") >= 0 &&
             tool_fill_seq(c, *req, sp->prompt, 2000000 + (int32_t)(r * sp->prompt), kv, &rng) == 0;
        for (uint32_t f = 1; ok && f < F; f++) ok = tool_check(pkv_seq_fork(c, *req, &req[f]), "pkv_seq_fork") >= 0;
    }
    for (uint32_t x = 0; ok && x < sp->R * F; x++) ok = tool_fill_seq(c, ids[x], sp->own, 1000000 + (int32_t)(x * sp->own), kv, &rng) == 0;
    if (!ok) {
        pkv_cache_destroy(c);
        return NULL;
    }
    return c;
}

int tool_bench_share(int argc, char **argv) {
    uint32_t ctx[8] = {4096, 32768}, forks[8] = {2, 4, 16}, thr[4] = {1, 2}, own = 16, mib = 1024, rounds = 5;
    uint32_t n_req = 1, prompt = 0;
    int n_ctx = 2, n_f = 3, n_thr = 2, n_dt = 1, json = 0;
    pkv_dtype dts[8] = {PKV_DTYPE_F16};
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
        else if (!strcmp(a, "--forks")) bad = tool_parse_u32_list(val, forks, 8, MAX_FORKS, &n_f);
        else if (!strcmp(a, "--threads")) bad = tool_parse_u32_list(val, thr, 4, 256, &n_thr);
        else if (!strcmp(a, "--dtype")) bad = tool_parse_dtype_list(val, dts, 8, &n_dt);
        else if (!strcmp(a, "--own")) bad = tool_parse_u32(val, &own) || own > 4096;
        else if (!strcmp(a, "--requests")) bad = tool_parse_u32(val, &n_req) || n_req < 1 || n_req > 32;
        else if (!strcmp(a, "--prompt")) bad = tool_parse_u32(val, &prompt) || prompt > 65536;
        else if (!strcmp(a, "--mib")) bad = tool_parse_u32(val, &mib) || mib < 1 || mib > 65536;
        else if (!strcmp(a, "--rounds")) bad = tool_parse_u32(val, &rounds) || rounds < 3 || rounds > 99;
        else {
            fprintf(stderr, "pkv bench share: unknown option '%s'\n\n", a);
            usage(stderr);
            return TOOL_USAGE;
        }
        if (!bad && !strcmp(a, "--forks"))
            for (int j = 0; j < n_f; j++) bad |= forks[j] < 2;
        if (!bad && (!strcmp(a, "--forks") || !strcmp(a, "--requests")))
            for (int j = 0; j < n_f; j++) bad |= forks[j] * n_req > MAX_FORKS;
        if (bad) {
            fprintf(stderr, "pkv bench share: bad value '%s' for %s\n", val, a);
            return TOOL_USAGE;
        }
        i++;
    }
    if (!json)
        printf("pkv bench share: %s on %s; n_q_heads %d, n_kv_heads %d, head_dim %d, block_tokens %d, %u requests of "
               "%u positions, own %u, %u MiB, %u rounds\n%-8s %8s %5s %4s %6s %12s %12s %13s %12s\n",
               tool_build_info(), tool_cpu_name(), NQH, NKV, HD, BT, n_req, prompt, own, mib, rounds, "dtype", "ctx",
               "forks", "thr", "layers", "plain_us", "shared_us", "shared/plain", "shared_keys");
    float *kv = malloc(sizeof(float) * TOOL_FILL_CHUNK * NKV * HD), *q = malloc(sizeof(float) * MAX_FORKS * NQH * HD);
    float *out = malloc(sizeof(float) * MAX_FORKS * NQH * HD);
    double *t[2] = {malloc(sizeof(double) * rounds * MAX_LAYERS), malloc(sizeof(double) * rounds * MAX_LAYERS)};
    int status = TOOL_FAIL;
    if (!kv || !q || !out || !t[0] || !t[1]) goto done;
    for (size_t i = 0; i < (size_t)MAX_FORKS * NQH * HD; i++) q[i] = (float)((i * 2654435761u) % 1000) / 1000.0f - 0.5f;
    for (int di = 0; di < n_dt; di++)
        for (int ci = 0; ci < n_ctx; ci++)
            for (int fi = 0; fi < n_f; fi++)
                for (int ti = 0; ti < n_thr; ti++) {
                    const uint32_t C = ctx[ci], F = forks[fi], N = n_req * F;
                    const shape sp = {.ctx = C, .R = n_req, .prompt = prompt, .F = F, .own = own};
                    const pkv_dtype dt = dts[di];
                    /* one layer's K/V: the system prompt once, each request's prompt, each fork's own */
                    const double row = (double)pkv_dtype_row_bytes(dt, HD);
                    const double layer = ((double)C + (double)n_req * prompt + (double)N * own) * NKV * 2.0 * row;
                    uint32_t L = (uint32_t)((double)mib * 1048576.0 / layer + 0.999);
                    L = L < 1 ? 1 : L > MAX_LAYERS ? MAX_LAYERS : L;
                    pkv_config cfg = pkv_config_default();
                    cfg.n_layers = L, cfg.n_kv_heads = NKV, cfg.head_dim = HD, cfg.block_tokens = BT;
                    cfg.k_dtype = cfg.v_dtype = dt;
                    cfg.n_threads = thr[ti], cfg.max_seqs = N + 1, cfg.enable_prefix_cache = 0;
                    cfg.max_blocks_per_seq = (C + prompt + own) / BT + 3;
                    cfg.n_blocks = C / BT + 1 + n_req * (prompt / BT + 2) + N * (own / BT + 2) + 4;
                    pkv_seq ids[2][MAX_FORKS];
                    pkv_cache *c[2] = {make(&cfg, &sp, false, ids[0], kv), NULL};
                    if (c[0]) c[1] = make(&cfg, &sp, true, ids[1], kv);
                    if (!c[1]) {
                        pkv_cache_destroy(c[0]);
                        goto done;
                    }
                    pkv_stats st0, st1;
                    int ok = tool_check(pkv_cache_get_stats(c[0], &st0), "pkv_cache_get_stats") >= 0;
                    pkv_attn_params p = pkv_attn_params_default();
                    p.n_q_heads = NQH;
                    size_t n = 0;
                    for (uint32_t r = 0; ok && r < rounds + 1; r++) /* round 0 warms up */
                        for (uint32_t l = 0; ok && l < L; l++, n += r > 0)
                            for (int k = 0; ok && k < 2; k++) {
                                const int which = (int)((r + l + (uint32_t)k) % 2); /* the order turns */
                                const uint64_t t0 = tool_now_ns();
                                ok = tool_check(pkv_attn_decode(c[which], l, ids[which], N, q, out, &p),
                                                "pkv_attn_decode") >= 0;
                                if (r) t[which][n] = (double)(tool_now_ns() - t0) * 1e-3;
                            }
                    ok = ok && tool_check(pkv_cache_get_stats(c[0], &st1), "pkv_cache_get_stats") >= 0;
                    pkv_cache_destroy(c[0]);
                    pkv_cache_destroy(c[1]);
                    if (!ok) goto done;
                    const double ms = tool_median(t[0], n), mp = tool_median(t[1], n);
                    const double keys = (double)(st1.attn_shared_keys - st0.attn_shared_keys) / ((double)(rounds + 1) * L);
                    if (json)
                        printf("{\"bench\":\"share\",\"kv_dtype\":\"%s\",\"ctx\":%u,\"requests\":%u,\"prompt\":%u,"
                               "\"forks\":%u,\"own\":%u,\"threads\":%u,\"layers\":%u,\"plain_us\":%.1f,\"shared_us\":%.1f,"
                               "\"shared_over_plain\":%.3f,\"shared_keys\":%.0f}\n",
                               pkv_dtype_name(dt), C, n_req, prompt, F, own, thr[ti], L, mp, ms, ms / mp, keys);
                    else
                        printf("%-8s %8u %5u %4u %6u %12.1f %12.1f %13.3f %12.0f\n", pkv_dtype_name(dt), C, F, thr[ti], L,
                               mp, ms, ms / mp, keys);
                    fflush(stdout);
                }
    status = TOOL_OK;
done:
    free(kv), free(q), free(out), free(t[0]), free(t[1]);
    return status;
}
