/* bench_mla.c: `pkv bench mla`: decode over a cache whose V lives in K (pkv_config.v_dim: multi-head
 * latent attention, DeepSeek-V2 / V3's shape by default) against the same attention over a cache of
 * the classic layout that holds V as rows of its own (copies of K's rows: what an engine without
 * v_dim would have to store), built alike and called in turn. */
#include "tool.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { BT = 16, MAX_BATCH = 64, MAX_LAYERS = 64, MAX_HEADS = 128 };

static void usage(FILE *f) {
    fprintf(f,
            "usage: pkv bench mla [--json] [--ctx LIST] [--batch LIST] [--heads LIST] [--threads LIST]\n"
            "                     [--dtype LIST] [--head-dim N] [--v-dim N] [--mib N] [--rounds N]\n"
            "\n"
            "Decode of BATCH sequences of CTX positions each, one kv head of HEAD_DIM values a token\n"
            "([c_kv | k_pe]: 576 = 512 + 64, DeepSeek-V2 / V3), HEADS query heads, outputs of V_DIM values\n"
            "(c_kv's), block_tokens 16, over as many layers as make the MLA cache's K at least MIB MiB (up\n"
            "to 64), so that calls read it from memory. Two caches built alike: `mla` with\n"
            "pkv_config.v_dim = V_DIM (the pool holds K alone; V is each K row's first V_DIM values), and\n"
            "`classic` with V rows of their own holding the same values (outputs of HEAD_DIM values, their\n"
            "first V_DIM the same). Each round decodes every layer of both, the caches in turn; times are\n"
            "medians of the calls. Reports each median, mla / classic, the MLA call's rate in GB/s of the\n"
            "pool it reads (K) and in GFLOP/s (2 x HEADS x (HEAD_DIM + V_DIM) a key), and the pool bytes a\n"
            "token takes a layer in each (B/tok).\n"
            "\n"
            "  --ctx LIST      context lengths, 1..2^20 [4096,32768]\n"
            "  --batch LIST    sequences a call, 1..64 [1,16]\n"
            "  --heads LIST    query heads, 1..128 [16,128]\n"
            "  --threads LIST  attention threads [1,2]\n"
            "  --dtype LIST    the dtype of K (and V) (f32, f16, bf16, fp8_e4m3, q8_0, q4_0) [f16]\n"
            "  --head-dim N    values a K row holds, 1..1024 [576]\n"
            "  --v-dim N       values of V, the first of K's, 1..HEAD_DIM [512, or HEAD_DIM where that is less]\n"
            "  --mib N         the K one MLA cache's calls read, MiB, 1..65536 [512]\n"
            "  --rounds N      rounds, 3..99 [5]\n"
            "  --json          one JSON object per line\n");
}

/* Appends ctx tokens to s and writes the same random K (and V, the same rows) in every layer. */
static int fill(pkv_cache *c, pkv_seq s, uint32_t ctx, uint32_t D, uint32_t n_layers, bool with_v, float *kv,
                uint64_t *rng) {
    for (uint32_t done = 0; done < ctx;) {
        const uint32_t m = ctx - done < 256 ? ctx - done : 256;
        int32_t tok[256], slots[256];
        for (uint32_t i = 0; i < m; i++) tok[i] = (int32_t)(done + i);
        if (tool_check(pkv_seq_append(c, s, tok, m, slots), "pkv_seq_append") < 0) return -1;
        for (uint32_t l = 0; l < n_layers; l++) {
            for (size_t i = 0; i < (size_t)m * D; i++) {
                *rng = *rng * 6364136223846793005ull + 1442695040888963407ull;
                kv[i] = (float)(int32_t)(*rng >> 40) / 8388608.0f;
            }
            if (tool_check(pkv_write_kv(c, l, slots, m, kv, with_v ? kv : NULL, PKV_DTYPE_F32), "pkv_write_kv") < 0)
                return -1;
        }
        done += m;
    }
    return 0;
}

/* A cache of batch sequences of ctx positions (ids), V in K where cfg->v_dim is set; NULL on failure (said). */
static pkv_cache *make(const pkv_config *cfg, uint32_t ctx, uint32_t batch, pkv_seq *ids, float *kv) {
    pkv_cache *c = NULL;
    if (tool_check(pkv_cache_create(cfg, &c), "pkv_cache_create") < 0) return NULL;
    uint64_t rng = 12345; /* both caches alike */
    int ok = 1;
    for (uint32_t i = 0; ok && i < batch; i++)
        ok = tool_check(pkv_seq_create(c, NULL, 0, &ids[i]), "pkv_seq_create") >= 0 &&
             fill(c, ids[i], ctx, cfg->head_dim, cfg->n_layers, cfg->v_dim == 0, kv, &rng) == 0;
    if (!ok) {
        pkv_cache_destroy(c);
        return NULL;
    }
    return c;
}

int tool_bench_mla(int argc, char **argv) {
    uint32_t ctx[8] = {4096, 32768}, batch[8] = {1, 16}, heads[8] = {16, 128}, thr[4] = {1, 2};
    uint32_t D = 576, Dv = 0, mib = 512, rounds = 5; /* Dv 0: --v-dim not given */
    int n_ctx = 2, n_b = 2, n_h = 2, n_thr = 2, n_dt = 1, json = 0;
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
        else if (!strcmp(a, "--batch")) bad = tool_parse_u32_list(val, batch, 8, MAX_BATCH, &n_b);
        else if (!strcmp(a, "--heads")) bad = tool_parse_u32_list(val, heads, 8, MAX_HEADS, &n_h);
        else if (!strcmp(a, "--threads")) bad = tool_parse_u32_list(val, thr, 4, 256, &n_thr);
        else if (!strcmp(a, "--dtype")) bad = tool_parse_dtype_list(val, dts, 8, &n_dt);
        else if (!strcmp(a, "--head-dim")) bad = tool_parse_u32(val, &D) || D < 1 || D > 1024;
        else if (!strcmp(a, "--v-dim")) bad = tool_parse_u32(val, &Dv) || Dv < 1 || Dv > 1024;
        else if (!strcmp(a, "--mib")) bad = tool_parse_u32(val, &mib) || mib < 1 || mib > 65536;
        else if (!strcmp(a, "--rounds")) bad = tool_parse_u32(val, &rounds) || rounds < 3 || rounds > 99;
        else {
            fprintf(stderr, "pkv bench mla: unknown option '%s'\n\n", a);
            usage(stderr);
            return TOOL_USAGE;
        }
        if (bad) {
            fprintf(stderr, "pkv bench mla: bad value '%s' for %s\n", val, a);
            return TOOL_USAGE;
        }
        i++;
    }
    if (!Dv) Dv = D < 512 ? D : 512;
    if (Dv > D) {
        fprintf(stderr, "pkv bench mla: --v-dim %u is over --head-dim %u\n", Dv, D);
        return TOOL_USAGE;
    }
    for (int di = 0; di < n_dt; di++)
        if (!pkv_dtype_row_bytes(dts[di], D) || !pkv_dtype_row_bytes(dts[di], Dv)) {
            fprintf(stderr, "pkv bench mla: %s needs --head-dim and --v-dim multiples of 32\n", pkv_dtype_name(dts[di]));
            return TOOL_USAGE;
        }
    if (!json)
        printf("pkv bench mla: %s on %s; 1 kv head, head_dim %u, v_dim %u, block_tokens %d, %u MiB, %u rounds\n"
               "%-8s %6s %5s %5s %4s %6s %12s %12s %11s %8s %8s %8s %8s\n",
               tool_build_info(), tool_cpu_name(), D, Dv, BT, mib, rounds, "dtype", "ctx", "batch", "heads", "thr",
               "layers", "classic_us", "mla_us", "mla/classic", "GB/s", "GFLOP/s", "B/tok", "B/tok_c");
    float *kv = malloc(sizeof(float) * 256 * D), *q = malloc(sizeof(float) * MAX_BATCH * MAX_HEADS * D);
    float *out = malloc(sizeof(float) * MAX_BATCH * MAX_HEADS * D);
    double *t[2] = {malloc(sizeof(double) * rounds * MAX_LAYERS), malloc(sizeof(double) * rounds * MAX_LAYERS)};
    int status = TOOL_FAIL;
    if (!kv || !q || !out || !t[0] || !t[1]) goto done;
    for (size_t i = 0; i < (size_t)MAX_BATCH * MAX_HEADS * D; i++) q[i] = (float)((i * 2654435761u) % 1000) / 1000.0f - 0.5f;
    for (int di = 0; di < n_dt; di++)
        for (int ci = 0; ci < n_ctx; ci++)
            for (int bi = 0; bi < n_b; bi++)
                for (int hi = 0; hi < n_h; hi++)
                    for (int ti = 0; ti < n_thr; ti++) {
                        const uint32_t C = ctx[ci], N = batch[bi], H = heads[hi];
                        const pkv_dtype dt = dts[di];
                        const double row = (double)pkv_dtype_row_bytes(dt, D), layer = (double)C * N * row;
                        uint32_t L = (uint32_t)ceil((double)mib * 1048576.0 / layer);
                        L = L < 1 ? 1 : L > MAX_LAYERS ? MAX_LAYERS : L;
                        pkv_config cfg = pkv_config_default();
                        tool_log_errors(&cfg, "pkv bench mla");
                        cfg.n_layers = L, cfg.n_kv_heads = 1, cfg.head_dim = D, cfg.block_tokens = BT;
                        cfg.k_dtype = cfg.v_dtype = dt;
                        cfg.n_threads = thr[ti], cfg.max_seqs = N, cfg.enable_prefix_cache = 0;
                        cfg.max_blocks_per_seq = C / BT + 1;
                        cfg.n_blocks = N * (C / BT + 1);
                        pkv_seq ids[2][MAX_BATCH];
                        pkv_config mc = cfg;
                        mc.v_dim = Dv;
                        pkv_cache *c[2] = {make(&mc, C, N, ids[0], kv), NULL}; /* [0] mla, [1] classic */
                        if (c[0]) c[1] = make(&cfg, C, N, ids[1], kv);
                        if (!c[1]) {
                            pkv_cache_destroy(c[0]);
                            goto done;
                        }
                        pkv_stats st[2];
                        int ok = tool_check(pkv_cache_get_stats(c[0], &st[0]), "pkv_cache_get_stats") >= 0 &&
                                 tool_check(pkv_cache_get_stats(c[1], &st[1]), "pkv_cache_get_stats") >= 0;
                        pkv_attn_params p = pkv_attn_params_default();
                        p.n_q_heads = H;
                        p.scale = 0.0721688f; /* 1 / sqrt(192): DeepSeek's qk_nope + qk_rope dims */
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
                        pkv_cache_destroy(c[0]);
                        pkv_cache_destroy(c[1]);
                        if (!ok) goto done;
                        const double mm = tool_median(t[0], n), mc_us = tool_median(t[1], n);
                        const double gbps = layer / (mm * 1e-6) * 1e-9;
                        const double gflops = 2.0 * H * (D + Dv) * (double)C * N / (mm * 1e-6) * 1e-9;
                        const double bt[2] = {(double)st[0].kv_bytes_per_block / BT / L,
                                              (double)st[1].kv_bytes_per_block / BT / L};
                        if (json)
                            printf("{\"bench\":\"mla\",\"kv_dtype\":\"%s\",\"head_dim\":%u,\"v_dim\":%u,\"ctx\":%u,"
                                   "\"batch\":%u,\"heads\":%u,\"threads\":%u,\"layers\":%u,\"classic_us\":%.1f,"
                                   "\"mla_us\":%.1f,\"mla_over_classic\":%.3f,\"gbps\":%.2f,\"gflops\":%.1f,"
                                   "\"bytes_per_token\":%.0f,\"bytes_per_token_classic\":%.0f}\n",
                                   pkv_dtype_name(dt), D, Dv, C, N, H, thr[ti], L, mc_us, mm, mm / mc_us, gbps, gflops,
                                   bt[0], bt[1]);
                        else
                            printf("%-8s %6u %5u %5u %4u %6u %12.1f %12.1f %11.3f %8.2f %8.1f %8.0f %8.0f\n",
                                   pkv_dtype_name(dt), C, N, H, thr[ti], L, mc_us, mm, mm / mc_us, gbps, gflops, bt[0],
                                   bt[1]);
                        fflush(stdout);
                    }
    status = TOOL_OK;
done:
    free(kv), free(q), free(out), free(t[0]), free(t[1]);
    return status;
}
