/* bench_tier.c: `pkv bench tier`: what moving a prompt's blocks through a storage tier costs:
 * pkv_tier_save out of a cache and pkv_tier_load into another, for the host tier, the file tier
 * (in the page cache: the files are just written) and, given a server, Redis; beside them, in
 * the same rounds, a plain memcpy of the same bytes (the ceiling of a copy on this machine) and
 * the direct move of the same rows between two caches (pkv_seq_read_stored then
 * pkv_seq_write_stored, no tier). Public API only. */
#include "tool.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void usage(FILE *f) {
    fprintf(f,
            "usage: pkv bench tier [--json] [--quick] [--rounds N] [--dir DIR] [--redis HOST:PORT]\n"
            "\n"
            "A 2048-token prompt (128 blocks of 16) of a model with 8 layers, 8 kv heads and head_dim\n"
            "128, f16 K and V (512 KiB an entry, 64 MiB in all), saved from one cache into a tier\n"
            "(pkv_tier_save, into a new tier each round) and loaded into an empty cache\n"
            "(pkv_tier_load); medians over the rounds, GB/s of entry bytes, and that as a fraction\n"
            "of a memcpy of the same bytes timed in the same rounds (copy_frac). direct: the same\n"
            "rows read out of one cache and written into another (pkv_seq_read_stored,\n"
            "pkv_seq_write_stored), no tier: what the tier adds is the rest. save host-full: the\n"
            "steady state of a full host tier, each save's 128 entries replacing the last's (the\n"
            "memory of the entries it drops is reused; a new tier's entries are fresh pages).\n"
            "prefetch file / redis: pkv_tier_prefetch of the prompt and pkv_tier_prefetch_wait (the\n"
            "tier's thread staging the entries in host memory: the work an engine overlaps with\n"
            "others'); load file-staged / redis-staged: the pkv_tier_load after it. save\n"
            "file-async / redis-async: pkv_tier_save_async (the caller's part: the entries made in host\n"
            "memory, in the buffers of another prompt's save before it), flush: the pkv_tier_flush\n"
            "after it (the thread's puts).\n"
            "\n"
            "  --json          one JSON object per line (keys: op, tier, median_ms, gbps, copy_gbps,\n"
            "                  copy_frac, bytes, rounds)\n"
            "  --quick         512 tokens, 3 rounds (a smoke run)\n"
            "  --rounds N      rounds (default 7)\n"
            "  --dir DIR       the file tier's directory (default a new one under /tmp; removed after)\n"
            "  --redis H:P     also a Redis tier on that server (keys under \"pkvbench:<pid>:\", deleted\n"
            "                  by the rounds' own tier objects only as the server evicts: use a scratch\n"
            "                  server)\n"
            "  --help          this text\n");
}

enum { LAYERS = 8, KVH = 8, HD = 128, BT = 16 };

static pkv_cache *mk(uint32_t n_blocks) {
    pkv_config cfg = pkv_config_default();
    cfg.n_layers = LAYERS, cfg.n_kv_heads = KVH, cfg.head_dim = HD, cfg.block_tokens = BT;
    cfg.n_blocks = n_blocks;
    cfg.n_threads = 1;
    cfg.k_dtype = cfg.v_dtype = PKV_DTYPE_F16;
    pkv_cache *c = NULL;
    int rc = pkv_cache_create(&cfg, &c);
    if (rc) fprintf(stderr, "pkv bench tier: pkv_cache_create: %s\n", pkv_strerror(rc));
    return c;
}

typedef struct tier_kind {
    const char *name;
    const char *dir;
    const char *redis_host;
    int redis_port;
} tier_kind;

static int open_tier(const tier_kind *k, int round, pkv_tier **t) {
    char path[4200], prefix[64];
    if (k->redis_host) {
        snprintf(prefix, sizeof prefix, "pkvbench:%ld:%d:", (long)getpid(), round);
        return pkv_tier_redis_create(k->redis_host, k->redis_port, prefix, 5000, NULL, t);
    }
    if (k->dir) {
        snprintf(path, sizeof path, "%s/r%d", k->dir, round);
        return pkv_tier_file_create(path, (uint64_t)1 << 40, NULL, t);
    }
    return pkv_tier_host_create((uint64_t)1 << 40, NULL, t);
}

/* removes DIR/rROUND and the files in it (the file tier's entries: no subdirectories) */
static void remove_round_dir(const char *dir, int round) {
    char path[4200], file[4500];
    snprintf(path, sizeof path, "%s/r%d", dir, round);
    DIR *d = opendir(path);
    if (d) {
        for (struct dirent *de; (de = readdir(d));) {
            if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
            snprintf(file, sizeof file, "%s/%s", path, de->d_name);
            unlink(file);
        }
        closedir(d);
    }
    if (rmdir(path) != 0) fprintf(stderr, "pkv bench tier: could not remove %s\n", path);
}

int tool_bench_tier(int argc, char **argv) {
    int json = 0, quick = 0;
    uint32_t rounds = 0;
    const char *dir_arg = NULL, *redis = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--json")) json = 1;
        else if (!strcmp(a, "--quick")) quick = 1;
        else if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return TOOL_OK;
        } else if (!strcmp(a, "--rounds") || !strcmp(a, "--dir") || !strcmp(a, "--redis")) {
            const char *v = i + 1 < argc ? argv[++i] : NULL;
            if (!v || (!strcmp(a, "--rounds") && (tool_parse_u32(v, &rounds) || rounds < 1 || rounds > 1000))) {
                fprintf(stderr, "pkv bench tier: bad value for %s\n", a);
                return TOOL_USAGE;
            }
            if (!strcmp(a, "--dir")) dir_arg = v;
            if (!strcmp(a, "--redis")) redis = v;
        } else {
            fprintf(stderr, "pkv bench tier: unknown option '%s'\n\n", a);
            usage(stderr);
            return TOOL_USAGE;
        }
    }
    if (!rounds) rounds = quick ? 3 : 7;
    const uint32_t n_tok = quick ? 512 : 2048, n_blk = n_tok / BT;
    tier_kind kinds[3] = {{"host", NULL, NULL, 0}, {"file", NULL, NULL, 0}, {"redis", NULL, NULL, 0}};
    int n_kinds = 2;
    char tmpdir[] = "/tmp/pkv-bench-tier-XXXXXX", host[256];
    if (redis) {
        const char *colon = strrchr(redis, ':');
        uint32_t port;
        if (!colon || colon == redis || (size_t)(colon - redis) >= sizeof host || tool_parse_u32(colon + 1, &port) ||
            !port || port > 65535) {
            fprintf(stderr, "pkv bench tier: --redis wants HOST:PORT, got '%s'\n", redis);
            return TOOL_USAGE;
        }
        memcpy(host, redis, (size_t)(colon - redis));
        host[colon - redis] = 0;
        kinds[2].redis_host = host, kinds[2].redis_port = (int)port;
        n_kinds = 3;
    }
    if (dir_arg) kinds[1].dir = dir_arg;
    else if (!(kinds[1].dir = mkdtemp(tmpdir))) {
        fprintf(stderr, "pkv bench tier: mkdtemp failed\n");
        return TOOL_FAIL;
    }
    int status = TOOL_FAIL;
    pkv_cache *a = mk(2 * n_blk + 8), *b = mk(n_blk + 8);
    pkv_tier *full = NULL; /* the steady state: a host tier with room for one prompt, two alternating */
    int32_t *toks = malloc(n_tok * sizeof *toks);
    const size_t rowe = (size_t)KVH * HD, bytes_f16 = (size_t)n_tok * rowe * 2;
    uint16_t *kb = malloc(bytes_f16), *vb = malloc(bytes_f16);
    const size_t entry = 88 + BT * 4 + (size_t)LAYERS * BT * rowe * 2 * 2, total = entry * n_blk;
    unsigned char *src = malloc(total), *dst = malloc(total);
    double *t_copy = calloc(rounds, sizeof(double)), *t_direct = calloc(rounds, sizeof(double));
    double *t_save = calloc((size_t)rounds * 3, sizeof(double)), *t_load = calloc((size_t)rounds * 3, sizeof(double));
    double *t_full = calloc(rounds, sizeof(double));
    /* file and Redis: the prefetch (staging the prompt, timed to its end) and the load after it */
    double *t_pf = calloc((size_t)rounds * 3, sizeof(double)), *t_staged = calloc((size_t)rounds * 3, sizeof(double));
    /* and write-back: the pkv_tier_save_async call, then the pkv_tier_flush after it */
    double *t_async = calloc((size_t)rounds * 3, sizeof(double)), *t_flush = calloc((size_t)rounds * 3, sizeof(double));
    pkv_seq sa, sa2;
    if (!a || !b || !toks || !kb || !vb || !src || !dst || !t_copy || !t_direct || !t_save || !t_load || !t_full || !t_pf || !t_staged || !t_async || !t_flush)
        goto out;
    for (uint32_t i = 0; i < n_tok; i++) toks[i] = (int32_t)(i * 2654435761u % 30000);
    for (size_t i = 0; i < (size_t)n_tok * rowe; i++) kb[i] = (uint16_t)(0x3000 + i % 0x0fff), vb[i] = (uint16_t)(0xb000 + i % 0x0fff);
    memset(src, 1, total);
    memset(dst, 2, total);
    int rc = pkv_seq_create(a, NULL, 0, &sa);
    if (!rc) rc = pkv_seq_append(a, sa, toks, n_tok, NULL);
    for (uint32_t l = 0; !rc && l < LAYERS; l++) rc = pkv_seq_write_kv(a, sa, l, 0, n_tok, kb, vb, PKV_DTYPE_F16);
    if (!rc) rc = pkv_seq_commit(a, sa, n_tok);
    for (uint32_t i = 0; !rc && i < n_tok; i++) toks[i] += 30000; /* the second prompt: other tokens */
    if (!rc) rc = pkv_seq_create(a, NULL, 0, &sa2);
    if (!rc) rc = pkv_seq_append(a, sa2, toks, n_tok, NULL);
    for (uint32_t l = 0; !rc && l < LAYERS; l++) rc = pkv_seq_write_kv(a, sa2, l, 0, n_tok, kb, vb, PKV_DTYPE_F16);
    if (!rc) rc = pkv_seq_commit(a, sa2, n_tok);
    for (uint32_t i = 0; i < n_tok; i++) toks[i] -= 30000;
    if (!rc) rc = pkv_tier_host_create(total + entry / 2, NULL, &full);
    if (!rc) rc = pkv_tier_save(full, a, sa, NULL); /* full from the start */
    if (rc) {
        fprintf(stderr, "pkv bench tier: filling the source cache: %s\n", pkv_strerror(rc));
        goto out;
    }
    for (uint32_t r = 0; r < rounds; r++) {
        uint64_t t0 = tool_now_ns();
        memcpy(dst, src, total);
        t_copy[r] = (double)(tool_now_ns() - t0) * 1e-9;
        unsigned char tmp = src[r % total];
        src[r % total] = dst[(r * 7) % total], dst[(r * 7) % total] = tmp; /* keep the copy live */
        /* direct: the rows read from a and written into b, no tier */
        pkv_seq sb;
        if ((rc = pkv_cache_reset(b)) || (rc = pkv_seq_create(b, NULL, 0, &sb))) break;
        t0 = tool_now_ns();
        rc = pkv_seq_append(b, sb, toks, n_tok - 1, NULL);
        for (uint32_t l = 0; !rc && l < LAYERS; l++) {
            rc = pkv_seq_read_stored(a, sa, l, 0, n_tok - 1, kb, vb);
            if (!rc) rc = pkv_seq_write_stored(b, sb, l, 0, n_tok - 1, kb, vb);
        }
        if (!rc) rc = pkv_seq_commit(b, sb, n_tok - 1);
        t_direct[r] = (double)(tool_now_ns() - t0) * 1e-9;
        if (rc) break;
        /* the steady state: the other prompt's 128 entries replace this one's */
        t0 = tool_now_ns();
        uint32_t n_full = 0;
        rc = pkv_tier_save(full, a, r % 2 ? sa : sa2, &n_full);
        t_full[r] = (double)(tool_now_ns() - t0) * 1e-9;
        if (!rc && n_full != n_blk) rc = PKV_EIO;
        if (rc) {
            fprintf(stderr, "pkv bench tier: the full host tier: saved %u: %s\n", n_full, pkv_strerror(rc));
            break;
        }
        for (int k = 0; k < n_kinds && !rc; k++) {
            pkv_tier *t = NULL;
            if ((rc = open_tier(&kinds[k], (int)r, &t))) {
                fprintf(stderr, "pkv bench tier: the %s tier: %s\n", kinds[k].name, pkv_strerror(rc));
                break;
            }
            uint32_t saved = 0, loaded = 0;
            t0 = tool_now_ns();
            rc = pkv_tier_save(t, a, sa, &saved);
            t_save[(size_t)k * rounds + r] = (double)(tool_now_ns() - t0) * 1e-9;
            if (!rc && saved != n_blk) rc = PKV_EIO;
            if (!rc && !(rc = pkv_cache_reset(b)) && !(rc = pkv_seq_create(b, NULL, 0, &sb))) {
                t0 = tool_now_ns();
                rc = pkv_tier_load(t, b, sb, toks, n_tok, &loaded);
                t_load[(size_t)k * rounds + r] = (double)(tool_now_ns() - t0) * 1e-9;
                if (!rc && loaded != n_tok - 1) rc = PKV_EIO;
            }
            if (!rc && k > 0) { /* prefetched into staging, then loaded from there */
                rc = pkv_tier_prefetch_start(t, total + entry);
                if (!rc && !(rc = pkv_cache_reset(b)) && !(rc = pkv_seq_create(b, NULL, 0, &sb))) {
                    t0 = tool_now_ns();
                    rc = pkv_tier_prefetch(t, b, NULL, 0, toks, n_tok);
                    if (!rc) rc = pkv_tier_prefetch_wait(t);
                    t_pf[(size_t)k * rounds + r] = (double)(tool_now_ns() - t0) * 1e-9;
                    t0 = tool_now_ns();
                    if (!rc) rc = pkv_tier_load(t, b, sb, toks, n_tok, &loaded);
                    t_staged[(size_t)k * rounds + r] = (double)(tool_now_ns() - t0) * 1e-9;
                    pkv_tier_stats ts;
                    if (!rc && (loaded != n_tok - 1 || pkv_tier_get_stats(t, &ts) || ts.prefetch_hits != n_blk))
                        rc = PKV_EIO;
                }
            }
            if (rc) fprintf(stderr, "pkv bench tier: the %s tier: saved %u, loaded %u: %s\n", kinds[k].name, saved, loaded,
                            pkv_strerror(rc));
            pkv_tier_destroy(t);
            if (kinds[k].dir) remove_round_dir(kinds[k].dir, (int)r);
            if (!rc && k > 0) { /* write-back into a new tier of its own: one prompt's save and flush
                                   (untimed: its buffers are fresh pages), then the other's, timed */
                pkv_tier *w = NULL;
                uint32_t queued = 0;
                if (!(rc = open_tier(&kinds[k], (int)(rounds + r), &w)) && !(rc = pkv_tier_prefetch_start(w, total + entry)) &&
                    !(rc = pkv_tier_save_async(w, a, sa2, &queued)) && !(rc = pkv_tier_flush(w))) {
                    t0 = tool_now_ns();
                    rc = pkv_tier_save_async(w, a, sa, &queued);
                    t_async[(size_t)k * rounds + r] = (double)(tool_now_ns() - t0) * 1e-9;
                    t0 = tool_now_ns();
                    if (!rc) rc = pkv_tier_flush(w);
                    t_flush[(size_t)k * rounds + r] = (double)(tool_now_ns() - t0) * 1e-9;
                    pkv_tier_stats ts;
                    if (!rc && (queued != n_blk || pkv_tier_get_stats(w, &ts) || ts.saved != 2 * n_blk)) rc = PKV_EIO;
                }
                if (rc) fprintf(stderr, "pkv bench tier: the %s tier's write-back: queued %u: %s\n", kinds[k].name, queued,
                                pkv_strerror(rc));
                pkv_tier_destroy(w);
                if (kinds[k].dir) remove_round_dir(kinds[k].dir, (int)(rounds + r));
            }
        }
        if (rc) break;
    }
    if (rc) goto out;
    const double copy = tool_median(t_copy, rounds), copy_gbps = (double)total / copy * 1e-9;
    if (json)
        printf("{\"bench\":\"tier\",\"build\":\"%s\",\"cpu\":\"%s\",\"tokens\":%u,\"blocks\":%u,\"entry_bytes\":%zu,"
               "\"layers\":%u,\"kv_heads\":%u,\"head_dim\":%u,\"block_tokens\":%u,\"dtype\":\"f16\"}\n",
               tool_build_info(), tool_cpu_name(), n_tok, n_blk, entry, LAYERS, KVH, HD, BT);
    else
        printf("pkv bench tier: %s, %s; %u tokens = %u entries of %zu bytes (%.1f MiB), %u rounds\n"
               "%-8s %-12s %10s %8s %10s %9s\n",
               tool_build_info(), tool_cpu_name(), n_tok, n_blk, entry, (double)total / 1048576.0, rounds, "op", "tier",
               "median_ms", "GB/s", "copy_GB/s", "copy_frac");
    typedef struct row {
        const char *op, *tier;
        double *t;
    } row_t;
    static const char *const staged_name[3] = {"", "file-staged", "redis-staged"};
    static const char *const async_name[3] = {"", "file-async", "redis-async"};
    row_t rows[20];
    int n_rows = 0;
    rows[n_rows++] = (row_t){"copy", "-", t_copy};
    rows[n_rows++] = (row_t){"direct", "-", t_direct};
    for (int k = 0; k < n_kinds; k++) {
        rows[n_rows++] = (row_t){"save", kinds[k].name, t_save + (size_t)k * rounds};
        rows[n_rows++] = (row_t){"load", kinds[k].name, t_load + (size_t)k * rounds};
        if (k == 0) rows[n_rows++] = (row_t){"save", "host-full", t_full};
        if (k > 0) {
            rows[n_rows++] = (row_t){"prefetch", kinds[k].name, t_pf + (size_t)k * rounds};
            rows[n_rows++] = (row_t){"load", staged_name[k], t_staged + (size_t)k * rounds};
            rows[n_rows++] = (row_t){"save", async_name[k], t_async + (size_t)k * rounds};
            rows[n_rows++] = (row_t){"flush", kinds[k].name, t_flush + (size_t)k * rounds};
        }
    }
    for (int i = 0; i < n_rows; i++) {
        /* a flush can find its writes done already (the tier's thread ran while the caller was
           descheduled): a time of about 0, reported as such, with a rate of 0 */
        const double med = i == 0 ? copy : tool_median(rows[i].t, rounds);
        const double gbps = med > 1e-9 ? (double)total / med * 1e-9 : 0.0;
        if (json)
            printf("{\"bench\":\"tier\",\"op\":\"%s\",\"tier\":\"%s\",\"median_ms\":%.3f,\"gbps\":%.3f,\"copy_gbps\":%.3f,"
                   "\"copy_frac\":%.4f,\"bytes\":%zu,\"rounds\":%u}\n",
                   rows[i].op, rows[i].tier, med * 1e3, gbps, copy_gbps, gbps / copy_gbps, total, rounds);
        else
            printf("%-8s %-12s %10.3f %8.2f %10.2f %8.1f%%\n", rows[i].op, rows[i].tier, med * 1e3, gbps, copy_gbps,
                   100.0 * gbps / copy_gbps);
    }
    status = TOOL_OK;
out:
    if (!dir_arg && kinds[1].dir) rmdir(kinds[1].dir);
    pkv_tier_destroy(full);
    pkv_cache_destroy(a);
    pkv_cache_destroy(b);
    free(t_full), free(t_pf), free(t_staged), free(t_async), free(t_flush), free(toks), free(kb), free(vb), free(src), free(dst), free(t_copy), free(t_direct), free(t_save), free(t_load);
    return status;
}
