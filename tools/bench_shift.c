/* bench_shift.c: `pkv bench shift`: what a context shift (pkv_seq_shift) costs, against a plain
 * copy of the bytes it moves, measured in the same rounds. */
#include "tool.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { NKV = 8, HD = 128, BT = 16, KEEP = 4 };

static void usage(FILE *f) {
    fprintf(f,
            "usage: pkv bench shift [--json] [--ctx LIST] [--dtype LIST] [--layers N] [--rounds N]\n"
            "\n"
            "A context shift of a full sequence of CTX positions: the first %d kept, half of the rest\n"
            "removed, the others moved down (n_kv_heads %d, head_dim %d, block_tokens %d, N layers, prefix\n"
            "cache off). Times, calls interleaved in each round, the median over rounds:\n"
            "  shift  pkv_seq_shift with RoPE (NEOX, all %d values): K decoded, turned, encoded\n"
            "  move   pkv_seq_shift with no rope: K and V rows moved as stored\n"
            "  copy   memcpy of as many bytes (every moved K and V row, one buffer to another, on huge\n"
            "         pages as the pool): the floor\n"
            "and the bytes moved per second of each, shift / copy and move / copy. After each round the\n"
            "sequence is filled to CTX again.\n"
            "\n"
            "  --ctx LIST      context lengths [4096,32768]\n"
            "  --dtype LIST    K/V dtypes [f16,q8_0]\n"
            "  --layers N      layers, 1..64 [8]\n"
            "  --rounds N      rounds, 3..99 [7]\n"
            "  --json          one JSON object per line\n",
            KEEP, NKV, HD, BT, HD);
}

int tool_bench_shift(int argc, char **argv) {
    uint32_t ctx[8] = {4096, 32768}, layers = 8, rounds = 7;
    pkv_dtype dts[8] = {PKV_DTYPE_F16, PKV_DTYPE_Q8_0};
    int n_ctx = 2, n_dt = 2, json = 0;
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
        else if (!strcmp(a, "--dtype")) bad = tool_parse_dtype_list(val, dts, 8, &n_dt);
        else if (!strcmp(a, "--layers")) bad = tool_parse_u32(val, &layers) || layers < 1 || layers > 64;
        else if (!strcmp(a, "--rounds")) bad = tool_parse_u32(val, &rounds) || rounds < 3 || rounds > 99;
        else {
            fprintf(stderr, "pkv bench shift: unknown option '%s'\n\n", a);
            usage(stderr);
            return TOOL_USAGE;
        }
        if (bad) {
            fprintf(stderr, "pkv bench shift: bad value '%s' for %s\n", val, a);
            return TOOL_USAGE;
        }
        i++;
    }
    for (int ci = 0; ci < n_ctx; ci++)
        if (ctx[ci] < KEEP + 4) {
            fprintf(stderr, "pkv bench shift: --ctx %u: at least %d\n", ctx[ci], KEEP + 4);
            return TOOL_USAGE;
        }
    if (!json)
        printf("pkv bench shift: %s on %s; n_kv_heads %d, head_dim %d, block_tokens %d, %u layers, keep %d, %u rounds\n"
               "%6s %8s %10s %11s %11s %11s %9s %9s %9s %11s %10s\n",
               tool_build_info(), tool_cpu_name(), NKV, HD, BT, layers, KEEP, rounds, "dtype", "ctx", "moved_MB",
               "shift_us", "move_us", "copy_us", "shift_GBs", "move_GBs", "copy_GBs", "shift/copy", "move/copy");
    float *kv = malloc(sizeof(float) * TOOL_FILL_CHUNK * NKV * HD);
    double *t[3] = {malloc(sizeof(double) * rounds), malloc(sizeof(double) * rounds), malloc(sizeof(double) * rounds)};
    int status = TOOL_FAIL;
    if (!kv || !t[0] || !t[1] || !t[2]) goto done;
    /* the copy's buffers, on huge pages as the pool is, once for the largest configuration */
    size_t most = 0;
    for (int di = 0; di < n_dt; di++)
        for (int ci = 0; ci < n_ctx; ci++) {
            const size_t b = (size_t)(ctx[ci] - KEEP - (ctx[ci] - KEEP) / 2) * layers * NKV * pkv_dtype_row_bytes(dts[di], HD) * 2;
            most = b > most ? b : most;
        }
    uint8_t *src = tool_map_huge(most), *dst = tool_map_huge(most); /* (never freed: tool.h) */
    if (!src || !dst) goto done;
    uint64_t rng = 12345;
    const pkv_rope rope = {.dim0 = 0, .n_rot = HD, .style = PKV_ROPE_NEOX, .theta = 10000.0f, .inv_freq = NULL};
    for (int di = 0; di < n_dt; di++)
        for (int ci = 0; ci < n_ctx; ci++) {
            const uint32_t C = ctx[ci], discard = (C - KEEP) / 2, moved = C - KEEP - discard;
            pkv_config cfg = pkv_config_default();
            cfg.n_layers = layers, cfg.n_kv_heads = NKV, cfg.head_dim = HD, cfg.block_tokens = BT;
            cfg.k_dtype = cfg.v_dtype = dts[di];
            cfg.n_threads = 1, cfg.max_seqs = 2, cfg.enable_prefix_cache = 0;
            cfg.max_blocks_per_seq = C / BT + 2;
            cfg.n_blocks = cfg.max_blocks_per_seq + 2;
            tool_log_errors(&cfg, "pkv bench shift");
            pkv_cache *c = NULL;
            if (tool_check(pkv_cache_create(&cfg, &c), "pkv_cache_create") < 0) goto done;
            /* the copy's floor: every moved row of K and V, as the pool stores them */
            const size_t row = pkv_dtype_row_bytes(dts[di], HD), bytes = (size_t)moved * layers * NKV * row * 2;
            pkv_seq s;
            int ok = tool_check(pkv_seq_create(c, NULL, 0, &s), "pkv_seq_create") >= 0 &&
                     tool_fill_seq(c, s, C, 0, kv, &rng) == 0;
            if (ok) memset(src, 1, bytes), memset(dst, 2, bytes);
            for (uint32_t r = 0; ok && r < rounds + 1; r++) /* round 0 warms up */
                for (int k = 0; ok && k < 3; k++) {
                    const int which = (int)((r + (uint32_t)k) % 3); /* the order turns each round */
                    const uint64_t t0 = tool_now_ns();
                    if (which == 2) {
                        memcpy(dst, src, bytes);
                    } else {
                        ok = tool_check(pkv_seq_shift(c, s, KEEP, KEEP + discard, which ? NULL : &rope), "pkv_seq_shift") >= 0;
                    }
                    const uint64_t t1 = tool_now_ns();
                    if (r) t[which][r - 1] = (double)(t1 - t0) * 1e-3;
                    if (ok && which != 2) ok = tool_fill_seq(c, s, discard, 0, kv, &rng) == 0; /* full again */
                }
            pkv_cache_destroy(c);
            if (!ok) goto done;
            const double ms = tool_median(t[0], rounds), mm = tool_median(t[1], rounds), mc = tool_median(t[2], rounds);
            const double mb = (double)bytes / 1e6;
            if (json)
                printf("{\"bench\":\"shift\",\"kv_dtype\":\"%s\",\"ctx\":%u,\"layers\":%u,\"moved_bytes\":%zu,"
                       "\"shift_us\":%.3f,\"move_us\":%.3f,\"copy_us\":%.3f,\"shift_over_copy\":%.3f,"
                       "\"move_over_copy\":%.3f}\n",
                       pkv_dtype_name(dts[di]), C, layers, bytes, ms, mm, mc, ms / mc, mm / mc);
            else
                printf("%6s %8u %10.1f %11.1f %11.1f %11.1f %9.2f %9.2f %9.2f %11.3f %10.3f\n", pkv_dtype_name(dts[di]), C,
                       mb, ms, mm, mc, mb / ms * 1e3, mb / mm * 1e3, mb / mc * 1e3, ms / mc, mm / mc);
            fflush(stdout);
        }
    status = TOOL_OK;
done:
    free(kv), free(t[0]), free(t[1]), free(t[2]);
    return status;
}
