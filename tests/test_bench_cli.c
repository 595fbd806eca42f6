/* test_bench_cli.c: `pkv bench attn`, `ops` and `prefix` keep their JSON contracts (the fields
 * the core, prefix-caching, attention and quantized-KV issues name, one object per line, finite
 * positive figures, bytes per token that match the library's row sizes) and reject bad options
 * with exit status 1. Timings are not checked: a benchmark is not a timed test. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>
#include "tu_shard.h"

#include "pkv.h"
#include "test_run_spawn.h"

#include <math.h>

/* The text of "key": in line (number or string), or NULL. */
static const char *field(const char *line, const char *key) {
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\":", key);
    const char *p = strstr(line, pat);
    return p ? p + strlen(pat) : NULL;
}

static double num(const char *line, const char *key) {
    const char *p = field(line, key);
    if (!p) fail_msg("no \"%s\" in %s", key, line);
    char *end;
    double v = strtod(p, &end);
    if (end == p) fail_msg("\"%s\" is not a number in %s", key, line);
    return v;
}

static int str_is(const char *line, const char *key, const char *want) {
    const char *p = field(line, key);
    if (!p || *p != '"') fail_msg("\"%s\" is not a string in %s", key, line);
    return strncmp(p + 1, want, strlen(want)) == 0 && p[1 + strlen(want)] == '"';
}

/* The index of the string line's key holds among names[0, n); fails when it is none of them. */
static int which(const char *line, const char *key, const char *const *names, int n) {
    for (int i = 0; i < n; i++)
        if (str_is(line, key, names[i])) return i;
    fail_msg("unexpected \"%s\": %s", key, line);
    return -1;
}

/* Fails unless line is one JSON object on its own (the bench commands' --json contract). */
static void one_object(const char *line) {
    const size_t n = strlen(line);
    if (n < 2 || line[0] != '{' || line[n - 1] != '}') fail_msg("not one JSON object: %s", line);
}

/* Each of n command lines (up to 4 words after "pkv", NULL where shorter) is a usage error (exit 1). */
static void expect_usage_errors(char *bad[][5], size_t n) {
    for (size_t i = 0; i < n; i++) {
        char *argv[6] = {bad[i][0], bad[i][1], bad[i][2], bad[i][3], bad[i][4], NULL};
        assert_int_equal(run_cli(argv, NULL, NULL), 1);
    }
}

static void test_json_lines(void **state) {
    (void)state;
    char *argv[] = {"pkv",       "bench", "attn",     "--quick", "--json",      "--dtype", "f16,q8_0,q4_0",
                    "--ctx",     "512",   "--threads", "1",      "--prompt",    "64",      "--occupancy",
                    "50",        "--mask", "--q-heads", "64",    NULL};
    char *out, *err;
    int rc = run_cli(argv, &out, &err);
    if (rc != 0) fail_msg("exit %d: %s", rc, err);
    int machine = 0, decode[3][2] = {{0}}, prefill[3][2] = {{0}}; /* prefill: paged, masked (--mask) */
    static const char *dts[3] = {"f16", "q8_0", "q4_0"};
    static const pkv_dtype dtv[3] = {PKV_DTYPE_F16, PKV_DTYPE_Q8_0, PKV_DTYPE_Q4_0};
    for (char *save = NULL, *line = strtok_r(out, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        one_object(line);
        if (field(line, "kind")) {
            assert_true(str_is(line, "kind", "machine"));
            assert_true(num(line, "read_gbps_1t") > 0 && num(line, "fma_gflops_1t") > 0);
            machine++;
            continue;
        }
        const int d = which(line, "kv_dtype", dts, 3);
        assert_int_equal((int)num(line, "threads"), 1);
        assert_int_equal((int)num(line, "batch"), 1);
        assert_int_equal((int)num(line, "n_q_heads"), 64);
        const double us = num(line, "median_us");
        assert_true(isfinite(us) && us > 0);
        if (str_is(line, "kernel", "decode")) {
            assert_int_equal((int)num(line, "ctx"), 512);
            assert_true(num(line, "occupancy") == 0.5);
            assert_int_equal((int)num(line, "rounds"), 3); /* --quick's default */
            const int paged = str_is(line, "layout", "paged");
            if (!paged && !str_is(line, "layout", "contig")) fail_msg("bad layout: %s", line);
            decode[d][paged]++;
            const double gbps = num(line, "gbps"), bw = num(line, "read_bw_gbps"), frac = num(line, "frac_of_bw");
            assert_true(isfinite(gbps) && gbps > 0 && isfinite(bw) && bw > 0 && isfinite(frac) && frac > 0);
            /* 8 kv heads x head_dim 128, K + V */
            assert_int_equal((size_t)num(line, "bytes_per_token_layer"), 8 * 2 * pkv_dtype_row_bytes(dtv[d], 128));
            const double hot = num(line, "hot_gbps"), hot_frac = num(line, "hot_frac_of_bw");
            assert_true(isfinite(hot) && hot > 0 && isfinite(hot_frac) && hot_frac > 0);
            if (paged) {
                const double pc = num(line, "paged_over_contig"), rpc = num(line, "read_paged_over_contig");
                assert_true(isfinite(pc) && pc > 0 && isfinite(rpc) && rpc > 0);
                /* the median of the per-round ratios lies between their quartiles */
                assert_true(num(line, "paged_over_contig_q1") <= pc && pc <= num(line, "paged_over_contig_q3"));
            }
        } else if (str_is(line, "kernel", "prefill")) {
            assert_int_equal((int)num(line, "ctx"), 64);
            const double g = num(line, "gflops");
            assert_true(isfinite(g) && g > 0);
            const int masked = str_is(line, "layout", "masked");
            if (!masked && !str_is(line, "layout", "paged")) fail_msg("bad layout: %s", line);
            const double f = num(line, masked ? "masked_over_causal" : "frac_of_peak");
            assert_true(isfinite(f) && f > 0);
            prefill[d][masked]++;
        } else {
            fail_msg("unknown kernel: %s", line);
        }
    }
    assert_int_equal(machine, 1);
    for (int d = 0; d < 3; d++) {
        assert_int_equal(decode[d][0], 1);
        assert_int_equal(decode[d][1], 1);
        assert_int_equal(prefill[d][0], 1);
        assert_int_equal(prefill[d][1], 1);
    }
    free(out), free(err);
}

static void test_usage_errors(void **state) {
    (void)state;
    char *bad[][7] = {{"pkv", "bench", "attn", "--dtype", "f17"}, {"pkv", "bench", "attn", "--ctx", "0"},
                      {"pkv", "bench", "attn", "--threads", "3"}, {"pkv", "bench", "attn", "--batch", "1,x"},
                      {"pkv", "bench", "attn", "--prompt", "-5"}, {"pkv", "bench", "attn", "--frobnicate", NULL},
                      {"pkv", "bench", "attn", "--block-tokens", "0"},
                      {"pkv", "bench", "attn", "--block-tokens", "1025"},
                      {"pkv", "bench", "attn", "--batch", "257"},
                      /* query heads: a multiple of the 8 kv heads, 8 to 128 */
                      {"pkv", "bench", "attn", "--q-heads", "12"},
                      {"pkv", "bench", "attn", "--q-heads", "0"},
                      {"pkv", "bench", "attn", "--q-heads", "136"},
                      {"pkv", "bench", "attn", "--q-heads", NULL},
                      /* empty or malformed lists: nothing to run is an error, not an empty run */
                      {"pkv", "bench", "attn", "--dtype", ""},
                      {"pkv", "bench", "attn", "--dtype", ","},
                      {"pkv", "bench", "attn", "--batch", "4,"},
                      {"pkv", "bench", "attn", "--batch", "+4"},
                      {"pkv", "bench", "attn", "--ctx", " 512"},
                      {"pkv", "bench", "attn", "--occupancy", "9"},
                      {"pkv", "bench", "attn", "--occupancy", "101"},
                      {"pkv", "bench", "attn", "--rounds", "2"},
                      {"pkv", "bench", "attn", "--rounds", "100"},
                      /* a block longer than a context, or than the prompt */
                      {"pkv", "bench", "attn", "--block-tokens", "1024", "--ctx", "512"},
                      {"pkv", "bench", "attn", "--block-tokens", "64", "--prompt", "32"},
                      /* ops and prefix: counts out of range, not digits only, or missing */
                      {"pkv", "bench", "ops", "--samples", "2"},
                      {"pkv", "bench", "ops", "--samples", "100001"},
                      {"pkv", "bench", "ops", "--samples", "5x"},
                      {"pkv", "bench", "ops", "--samples", "+5"},
                      {"pkv", "bench", "ops", "--samples", " 5"},
                      {"pkv", "bench", "ops", "--samples", NULL},
                      {"pkv", "bench", "ops", "--frobnicate", NULL},
                      {"pkv", "bench", "prefix", "--reps", "0"},
                      {"pkv", "bench", "prefix", "--reps", "1000001"},
                      {"pkv", "bench", "prefix", "--reps", "-3"},
                      {"pkv", "bench", "prefix", "--reps", "3.5"},
                      {"pkv", "bench", "prefix", "--reps", NULL},
                      {"pkv", "bench", "prefix", "--frobnicate", NULL},
                      {"pkv", "bench", "tier", "--rounds", "0"},
                      {"pkv", "bench", "tier", "--rounds", NULL},
                      {"pkv", "bench", "tier", "--redis", "localhost"},
                      {"pkv", "bench", "tier", "--redis", ":6379"},
                      {"pkv", "bench", "tier", "--redis", "h:70000"},
                      {"pkv", "bench", "tier", "--frobnicate", NULL},
                      {"pkv", "bench", "sideways", NULL}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char *argv[8] = {bad[i][0], bad[i][1], bad[i][2], bad[i][3], bad[i][4], bad[i][5], bad[i][6], NULL};
        char *out, *err;
        int rc = run_cli(argv, &out, &err);
        if (rc != 1) fail_msg("case %zu: exit %d (want 1): %s", i, rc, err);
        assert_string_equal(out, ""); /* nothing measured */
        assert_true(strlen(err) > 0);    /* but said why */
        free(out), free(err);
    }
    char *argv[] = {"pkv", "bench", "attn", "--ctx", NULL}; /* missing value */
    char *err;
    assert_int_equal(run_cli(argv, NULL, &err), 1);
    free(err);
    char *none[] = {"pkv", "bench", NULL}; /* no benchmark named: a usage error that shows the usage */
    char *out;
    assert_int_equal(run_cli(none, &out, &err), 1);
    assert_non_null(strstr(err, "usage: pkv bench"));
    free(out), free(err);
    /* `pkv --help` says each command takes --help: bench's own, and each benchmark's, on stdout */
    char *help[][4] = {{"pkv", "bench", "--help", NULL}, {"pkv", "bench", "-h", NULL},
                       {"pkv", "bench", "attn", "--help"}, {"pkv", "bench", "ops", "--help"},
                       {"pkv", "bench", "prefix", "--help"}, {"pkv", "bench", "tier", "--help"}};
    for (size_t i = 0; i < sizeof help / sizeof help[0]; i++) {
        char *hv[5] = {help[i][0], help[i][1], help[i][2], help[i][3], NULL};
        int rc = run_cli(hv, &out, &err);
        if (rc != 0) fail_msg("help case %zu: exit %d: %s", i, rc, err);
        assert_non_null(strstr(out, "usage: pkv bench"));
        free(out), free(err);
    }
}

static void large_batch_once(int wide) {
    char *argv[] = {"pkv", "bench", "attn", "--quick", "--json", "--dtype", "f16", "--ctx", "512", "--batch", "40",
                    "--threads", "1,2", "--prompt", "0", "--rounds", "4", NULL};
    char *out, *err;
    int rc = run_cli(argv, &out, &err);
    if (rc != 0) fail_msg("exit %d: %s", rc, err);
    int layouts[2] = {0}, machine = 0;
    for (char *save = NULL, *line = strtok_r(out, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        if (field(line, "kind")) {
            assert_true(str_is(line, "sweep", wide ? "wide" : "narrow"));
            assert_true(str_is(line, "passes", wide ? "two" : "one"));
            /* the lead asked for, or Zen 5's lead in bytes, which PKV_ATTN_LEAD does not move */
            assert_true(str_is(line, "lead", wide ? "head" : "block") || str_is(line, "lead", "bytes"));
            assert_true(str_is(line, "pieces", wide ? "on" : "off"));
            machine++;
            continue;
        }
        assert_true(str_is(line, "kernel", "decode"));
        assert_int_equal((int)num(line, "batch"), 40);
        assert_int_equal((int)num(line, "rounds"), 4);
        const double gbps = num(line, "gbps");
        assert_true(isfinite(gbps) && gbps > 0);
        const int paged = str_is(line, "layout", "paged");
        if (paged) {
            const double rpc = num(line, "read_paged_over_contig");
            assert_true(isfinite(rpc) && rpc > 0);
        }
        layouts[paged]++;
    }
    assert_int_equal(machine, 1);
    assert_int_equal(layouts[0], 2);
    assert_int_equal(layouts[1], 2);
    free(out), free(err);
}

/* --bf16-dot (--f16-as-bf16): every decode line carries attn_flags 1 (4), the paged one the
 * contiguous flag / plain ratio between its quartiles; the machine line says whether each flag
 * takes effect here, as the library does for a bf16 (f16) cache (pkv_attn_flags_used); without
 * the options attn_flags is 0 and no ratio is printed. */
static void test_bf16_dot_json(void **state) {
    (void)state;
    pkv_config cfg = pkv_config_default();
    cfg.n_blocks = 4, cfg.n_threads = 1;
    pkv_cache *c = NULL;
    assert_int_equal(pkv_cache_create(&cfg, &c), PKV_OK); /* f16 */
    const int used16 = (pkv_attn_flags_used(c) & PKV_ATTN_F16_AS_BF16) != 0;
    pkv_cache_destroy(c);
    cfg.k_dtype = cfg.v_dtype = PKV_DTYPE_BF16;
    assert_int_equal(pkv_cache_create(&cfg, &c), PKV_OK);
    const int used = (pkv_attn_flags_used(c) & PKV_ATTN_BF16_DOT) != 0;
    pkv_cache_destroy(c);
    for (int flag = 0; flag < 3; flag++) {
        char *argv[] = {"pkv", "bench", "attn", "--quick", "--json", "--dtype", flag == 2 ? "f16" : "bf16", "--ctx",
                        "512", "--threads", "1", "--prompt", "0", flag == 1 ? "--bf16-dot" : flag ? "--f16-as-bf16" : NULL,
                        NULL};
        char *out, *err;
        int rc = run_cli(argv, &out, &err);
        if (rc != 0) fail_msg("exit %d: %s", rc, err);
        int lines = 0;
        for (char *save = NULL, *line = strtok_r(out, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
            one_object(line);
            if (field(line, "kind")) {
                assert_true(str_is(line, "kind", "machine"));
                assert_true(!strncmp(field(line, "bf16_dot"), used ? "true," : "false,", used ? 5 : 6));
                assert_string_equal(field(line, "f16_as_bf16"), used16 ? "true}" : "false}");
                continue;
            }
            assert_true(str_is(line, "kernel", "decode"));
            assert_int_equal((int)num(line, "n_q_heads"), 32); /* the default */
            assert_int_equal((int)num(line, "attn_flags"), flag == 1 ? PKV_ATTN_BF16_DOT : flag ? PKV_ATTN_F16_AS_BF16 : 0);
            const int paged = str_is(line, "layout", "paged");
            if (paged && flag) {
                const double r = num(line, "contig_flags_over_plain");
                assert_true(isfinite(r) && r > 0);
                assert_true(num(line, "contig_flags_over_plain_q1") <= r && r <= num(line, "contig_flags_over_plain_q3"));
            } else {
                assert_null(field(line, "contig_flags_over_plain"));
            }
            lines++;
        }
        assert_int_equal(lines, 2);
        free(out), free(err);
    }
}

/* A batch of 40 sequences, more than one sweep group holds (32): both layouts measured at 1
 * and 2 threads, at the batch asked for, in the rounds asked for, and the plain read of the
 * paged layout (read_p/c) made group after group, each thread its own set, or (the wide rule)
 * its range of one set, in one pass or (with the wide rule here) two; the machine line names
 * the rules the environment asked for. */
static void test_large_batch(void **state) {
    (void)state;
    for (int wide = 0; wide < 2; wide++) {
        setenv("PKV_ATTN_SWEEP", wide ? "wide" : "narrow", 1);
        setenv("PKV_ATTN_PASSES", wide ? "two" : "one", 1);
        setenv("PKV_ATTN_LEAD", wide ? "head" : "block", 1);
        setenv("PKV_ATTN_PIECES", wide ? "on" : "off", 1);
        large_batch_once(wide);
    }
    unsetenv("PKV_ATTN_SWEEP");
    unsetenv("PKV_ATTN_PASSES");
    unsetenv("PKV_ATTN_LEAD");
    unsetenv("PKV_ATTN_PIECES");
}

/* A value of PKV_ATTN_SWEEP (or PKV_ATTN_ORDER, PKV_ATTN_PASSES, PKV_ATTN_LEAD, PKV_ATTN_PIECES)
 * that the library refuses ends the run before any measurement, with a message and exit status 2. */
static void test_refused_environment(void **state) {
    (void)state;
    static const char *vars[] = {"PKV_ATTN_SWEEP", "PKV_ATTN_ORDER", "PKV_ATTN_PASSES", "PKV_ATTN_LEAD",
                                 "PKV_ATTN_PIECES"};
    for (int i = 0; i < 5; i++) {
        setenv(vars[i], "sideways", 1);
        char *argv[] = {"pkv", "bench", "attn", "--quick", NULL};
        char *out, *err;
        const int rc = run_cli(argv, &out, &err);
        unsetenv(vars[i]);
        if (rc != 2) fail_msg("%s: exit %d (want 2): %s", vars[i], rc, err);
        assert_string_equal(out, "");
        assert_non_null(strstr(err, "refuses"));
        free(out), free(err);
    }
}

/* `pkv bench ops --json` (the core issue's contract): a header line, then one object per
 * operation and pool with op, pool_blocks and median_ns (p10 <= median <= p90, the samples asked
 * for, the 1M pool's ratio to the 1K pool's median), then the metadata fraction of the four
 * shapes, consistent with its own bytes and goal flag. */
static void test_ops_json(void **state) {
    (void)state;
    static const char *ops[6] = {"append_1", "append_16", "fork_1000_blocks", "truncate", "release", "write_kv_1"};
    char *argv[] = {"pkv", "bench", "ops", "--quick", "--json", "--samples", "5", NULL};
    char *out, *err;
    const int rc = run_cli(argv, &out, &err);
    if (rc != 0) fail_msg("exit %d: %s", rc, err);
    int header = 0, seen[6][2] = {{0}}, meta[2][2] = {{0}};
    double med_1k[6] = {0};
    for (char *save = NULL, *line = strtok_r(out, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        one_object(line);
        assert_true(str_is(line, "bench", "ops"));
        if (field(line, "build")) {
            assert_int_equal((int)num(line, "samples"), 5);
            assert_int_equal((int)num(line, "block_tokens"), 16);
            header++;
            continue;
        }
        if (field(line, "metric")) {
            assert_true(str_is(line, "metric", "meta_fraction"));
            const int layers = (int)num(line, "n_layers"), blocks = (int)num(line, "n_blocks");
            assert_true(layers == 1 || layers == 32);
            assert_true(blocks == 1000 || blocks == 4096);
            meta[layers == 32][blocks == 4096]++;
            if (field(line, "skipped")) { /* only where size_t cannot hold that pool */
                assert_true(SIZE_MAX < UINT64_MAX && (double)layers * blocks * 2 * 16 * 8 * 128 * 2 > SIZE_MAX / 2);
                continue;
            }
            const double mb = num(line, "meta_bytes"), kb = num(line, "kv_bytes"), f = num(line, "fraction");
            /* K and V of 16 tokens x 8 kv heads x 128 f16 a block and layer, plus at most the V
               array's skew and the padding a layer */
            const double kv_min = (double)layers * blocks * 2 * 16 * 8 * 128 * 2;
            assert_true(mb > 0 && kb >= kv_min && kb <= kv_min + layers * (2.0 * 1024 * 1024 + 128));
            assert_true(fabs(f - mb / kb) <= 5e-7 + 1e-6 * f);
            const char *g = field(line, "goal_met"); /* a JSON bool */
            assert_non_null(g);
            assert_true(f <= 0.01 ? !strncmp(g, "true", 4) : !strncmp(g, "false", 5));
            continue;
        }
        const int op = which(line, "op", ops, 6);
        const int blocks = (int)num(line, "pool_blocks");
        assert_true(blocks == 1000 || blocks == 1000000);
        const int big = blocks == 1000000;
        seen[op][big]++;
        assert_int_equal((int)num(line, "samples"), 5);
        const double med = num(line, "median_ns"), p10 = num(line, "p10_ns"), p90 = num(line, "p90_ns");
        assert_true(isfinite(med) && med > 0 && p10 <= med && med <= p90);
        const double ratio = num(line, "ratio_vs_1k");
        if (!big) {
            assert_true(ratio == 1.0);
            med_1k[op] = med;
        } else {
            /* the 1K line comes first; both medians printed to 0.01 ns, the ratio to 0.001 */
            assert_true(med_1k[op] > 0);
            assert_true(fabs(ratio - med / med_1k[op]) <= 5e-4 + 0.01 * ratio / med_1k[op] + 1e-3 * ratio);
        }
    }
    assert_int_equal(header, 1);
    for (int i = 0; i < 6; i++) {
        assert_int_equal(seen[i][0], 1);
        assert_int_equal(seen[i][1], 1);
    }
    for (int l = 0; l < 2; l++)
        for (int b = 0; b < 2; b++) assert_int_equal(meta[l][b], 1);
    free(out), free(err);
}

/* `pkv bench prefix --json` (the prefix-caching issue's contract): a header, then one object
 * per (op, prompt, index size): hit_hot, hit and miss at 256 and 8192 tokens over indexes of
 * 10,000 and (quick) 100,000 blocks, ns per token consistent with the median, the ratio 1 at the
 * smallest index; the events' lines and the dropped front's (evict_released, evict_front). */
static void test_prefix_json(void **state) {
    (void)state;
    static const char *ops[3] = {"hit_hot", "hit", "miss"};
    char *argv[] = {"pkv", "bench", "prefix", "--quick", "--json", "--reps", "3", NULL};
    char *out, *err;
    const int rc = run_cli(argv, &out, &err);
    if (rc != 0) fail_msg("exit %d: %s", rc, err);
    int header = 0, seen[3][2][2] = {{{0}}}, ev_seen[2][2] = {{0}}, fr_seen[2] = {0};
    for (char *save = NULL, *line = strtok_r(out, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        one_object(line);
        assert_true(str_is(line, "bench", "prefix"));
        if (field(line, "build")) {
            assert_int_equal((int)num(line, "block_tokens"), 16);
            assert_non_null(strstr(line, "\"quick\":true"));
            header++;
            continue;
        }
        if (strstr(line, "\"ratio_vs_released\":")) { /* evicting a dropped front against a released chain */
            static const char *fr_ops[2] = {"evict_released", "evict_front"};
            const int fo = which(line, "op", fr_ops, 2);
            fr_seen[fo]++;
            assert_int_equal((int)num(line, "blocks"), 256);
            assert_int_equal((int)num(line, "reps"), 3);
            const double med = num(line, "median_ns"), ratio = num(line, "ratio_vs_released");
            assert_true(med > 0 && fabs(num(line, "ns_per_block") - med / 256) <= 1.0 / 256 + 5e-4);
            assert_true(isfinite(ratio) && ratio > 0);
            if (!fo) assert_true(ratio == 1.0);
            continue;
        }
        if (strstr(line, "\"events\":")) { /* what recording the events costs: on and off, each op */
            static const char *ev_ops[2] = {"commit_index", "append_evict"};
            const int eo = which(line, "op", ev_ops, 2), on = strstr(line, "\"events\":true") != NULL;
            ev_seen[eo][on]++;
            assert_int_equal((int)num(line, "blocks"), 512);
            assert_int_equal((int)num(line, "reps"), 3);
            const double med = num(line, "median_ns"), ratio = num(line, "ratio_vs_no_events");
            assert_true(med > 0 && fabs(num(line, "ns_per_block") - med / 512) <= 1.0 / 512 + 5e-4);
            assert_true(isfinite(ratio) && ratio > 0);
            if (!on) assert_true(ratio == 1.0);
            continue;
        }
        const int op = which(line, "op", ops, 3);
        const int prompt = (int)num(line, "prompt_tokens"), index = (int)num(line, "index_blocks");
        assert_true(prompt == 256 || prompt == 8192);
        assert_true(index == 10000 || index == 100000);
        seen[op][prompt == 8192][index == 100000]++;
        assert_int_equal((int)num(line, "reps"), 3);
        const double med = num(line, "median_ns"), per = num(line, "ns_per_token");
        assert_true(isfinite(per) && per > 0);
        assert_true(fabs(per - med / prompt) <= 0.5 / prompt + 5e-4); /* median printed to 1 ns */
        assert_true(num(line, "p10_ns_per_token") <= per + 5e-4 && per <= num(line, "p90_ns_per_token") + 5e-4);
        const double ratio = num(line, "ratio_vs_smallest_index");
        assert_true(isfinite(ratio) && ratio > 0);
        if (index == 10000) assert_true(ratio == 1.0);
    }
    assert_int_equal(header, 1);
    for (int o = 0; o < 3; o++)
        for (int p = 0; p < 2; p++)
            for (int x = 0; x < 2; x++) assert_int_equal(seen[o][p][x], 1);
    for (int o = 0; o < 2; o++) assert_true(ev_seen[o][0] == 1 && ev_seen[o][1] == 1);
    assert_true(fr_seen[0] == 1 && fr_seen[1] == 1);
    free(out), free(err);
}

/* `pkv bench tree --json`: one line per (ctx, width, threads), with positive times whose ratios
 * are the ones printed, and its usage errors. */
static void test_tree_json(void **state) {
    (void)state;
    char *argv[] = {"pkv", "bench", "tree", "--json", "--ctx", "40,100", "--width", "1,3", "--threads", "1",
                    "--rounds", "3", NULL};
    char *out, *err;
    const int rc = run_cli(argv, &out, &err);
    if (rc != 0) fail_msg("exit %d: %s", rc, err);
    int seen[2][2] = {{0}};
    for (char *save = NULL, *line = strtok_r(out, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        one_object(line);
        assert_true(str_is(line, "bench", "tree"));
        const int ctx = (int)num(line, "ctx"), w = (int)num(line, "width");
        assert_true((ctx == 40 || ctx == 100) && (w == 1 || w == 3));
        assert_int_equal((int)num(line, "nodes"), 1 + 4 * w);
        assert_int_equal((int)num(line, "threads"), 1);
        seen[ctx == 100][w == 3]++;
        const double t = num(line, "tree_us"), pa = num(line, "paths_us"), pf = num(line, "prefill_us");
        assert_true(t > 0 && pa > 0 && pf > 0);
        assert_true(fabs(num(line, "tree_over_paths") - t / pa) <= 2e-3 * (1 + t / pa));
        assert_true(fabs(num(line, "tree_over_prefill") - t / pf) <= 2e-3 * (1 + t / pf));
    }
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2; j++) assert_int_equal(seen[i][j], 1);
    free(out), free(err);
    static char *bad[][5] = {{"pkv", "bench", "tree", "--width", "0"},
                             {"pkv", "bench", "tree", "--width", "64"},
                             {"pkv", "bench", "tree", "--rounds", "2"},
                             {"pkv", "bench", "tree", "--ctx", "x"},
                             {"pkv", "bench", "tree", "--bogus", NULL}};
    expect_usage_errors(bad, sizeof bad / sizeof bad[0]);
}

/* `pkv bench share --json`: one line a configuration (dtype, ctx, forks) with medians and their
 * ratio; forks of 600 positions share 37 whole blocks before their queries (the 38th, partial at
 * the fork, each copied on write), so each call reads (F - 1) x 592 positions once rather than a
 * fork; 40 are below the default rule's 512: none. Two requests of 600 positions after a system
 * prompt of 600, two forks each: the four share 37 blocks (each request's 38th a copy on write),
 * each request's forks 75, so the groups nest and read 3 x 37 + 2 x 38 blocks once, 2992
 * positions. Bad options are usage errors. */
static void test_share_json(void **state) {
    (void)state;
    char *argv[] = {"pkv", "bench", "share", "--json", "--ctx", "40,600", "--forks", "2,3", "--threads", "1",
                    "--dtype", "f16,q8_0", "--mib", "1", "--rounds", "3", NULL};
    char *out, *err;
    const int rc = run_cli(argv, &out, &err);
    if (rc != 0) fail_msg("exit %d: %s", rc, err);
    int seen[2][2][2] = {{{0}}};
    for (char *save = NULL, *line = strtok_r(out, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        one_object(line);
        assert_true(str_is(line, "bench", "share"));
        const int q8 = str_is(line, "kv_dtype", "q8_0");
        assert_true(q8 || str_is(line, "kv_dtype", "f16"));
        const int ctx = (int)num(line, "ctx"), f = (int)num(line, "forks");
        assert_true((ctx == 40 || ctx == 600) && (f == 2 || f == 3));
        assert_int_equal((int)num(line, "threads"), 1);
        assert_int_equal((int)num(line, "own"), 16);
        assert_true(num(line, "layers") >= 1);
        seen[q8][ctx == 600][f == 3]++;
        const double pl = num(line, "plain_us"), sh = num(line, "shared_us");
        assert_true(pl > 0 && sh > 0);
        assert_true(fabs(num(line, "shared_over_plain") - sh / pl) <= 2e-3 * (1 + sh / pl));
        assert_int_equal((int)num(line, "shared_keys"), ctx == 600 ? (f - 1) * 592 : 0);
        assert_int_equal((int)num(line, "requests"), 1);
        assert_int_equal((int)num(line, "prompt"), 0);
    }
    for (int i = 0; i < 8; i++) assert_int_equal(seen[i / 4][i / 2 % 2][i % 2], 1);
    free(out), free(err);
    char *nest[] = {"pkv", "bench", "share", "--json", "--ctx", "600", "--forks", "2", "--requests", "2", "--prompt", "600",
                    "--threads", "1", "--mib", "1", "--rounds", "3", NULL};
    const int rc2 = run_cli(nest, &out, &err);
    if (rc2 != 0) fail_msg("exit %d: %s", rc2, err);
    char *nl = strchr(out, '\n');
    assert_non_null(nl);
    *nl = 0;
    one_object(out);
    assert_true(str_is(out, "bench", "share"));
    assert_int_equal((int)num(out, "requests"), 2);
    assert_int_equal((int)num(out, "prompt"), 600);
    assert_int_equal((int)num(out, "shared_keys"), 3 * 37 * 16 + 2 * 38 * 16);
    free(out), free(err);
    static char *bad[][5] = {{"pkv", "bench", "share", "--forks", "1"},   {"pkv", "bench", "share", "--forks", "65"},
                             {"pkv", "bench", "share", "--rounds", "2"},  {"pkv", "bench", "share", "--dtype", "f16,"},
                             {"pkv", "bench", "share", "--mib", "0"},     {"pkv", "bench", "share", "--own", "5000"},
                             {"pkv", "bench", "share", "--dtype", "x"},   {"pkv", "bench", "share", "--bogus", NULL},
                             {"pkv", "bench", "share", "--requests", "33"}, {"pkv", "bench", "share", "--requests", "0"},
                             {"pkv", "bench", "share", "--requests", "5"}}; /* 5 x 16 forks: past 64 */
    expect_usage_errors(bad, sizeof bad / sizeof bad[0]);
}

/* `pkv bench shift --json`: one line a (dtype, ctx) with positive medians, their ratios, and the
 * bytes moved: every K and V row of the ctx - 4 - (ctx - 4) / 2 positions after the removed ones,
 * each layer and kv head (8), at the dtype's row bytes. Bad options are usage errors. */
static void test_shift_json(void **state) {
    (void)state;
    char *argv[] = {"pkv", "bench", "shift", "--json", "--ctx", "40,301", "--dtype", "f16,q8_0", "--layers", "2",
                    "--rounds", "3", NULL};
    char *out, *err;
    const int rc = run_cli(argv, &out, &err);
    if (rc != 0) fail_msg("exit %d: %s", rc, err);
    int seen[2][2] = {{0}};
    for (char *save = NULL, *line = strtok_r(out, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        one_object(line);
        assert_true(str_is(line, "bench", "shift"));
        const int q8 = str_is(line, "kv_dtype", "q8_0");
        assert_true(q8 || str_is(line, "kv_dtype", "f16"));
        const uint32_t ctx = (uint32_t)num(line, "ctx");
        assert_true(ctx == 40 || ctx == 301);
        assert_int_equal((int)num(line, "layers"), 2);
        seen[q8][ctx == 301]++;
        const uint32_t moved = ctx - 4 - (ctx - 4) / 2;
        assert_true(num(line, "moved_bytes") == (double)moved * 2 * 8 * pkv_dtype_row_bytes(q8 ? PKV_DTYPE_Q8_0 : PKV_DTYPE_F16, 128) * 2);
        const double sh = num(line, "shift_us"), mv = num(line, "move_us"), cp = num(line, "copy_us");
        assert_true(sh > 0 && mv > 0 && cp > 0);
        assert_true(fabs(num(line, "shift_over_copy") - sh / cp) <= 2e-3 * (1 + sh / cp));
        assert_true(fabs(num(line, "move_over_copy") - mv / cp) <= 2e-3 * (1 + mv / cp));
    }
    for (int i = 0; i < 4; i++) assert_int_equal(seen[i / 2][i % 2], 1);
    free(out), free(err);
    static char *bad[][5] = {{"pkv", "bench", "shift", "--ctx", "7"},     {"pkv", "bench", "shift", "--layers", "0"},
                             {"pkv", "bench", "shift", "--layers", "65"}, {"pkv", "bench", "shift", "--rounds", "2"},
                             {"pkv", "bench", "shift", "--dtype", "x"},   {"pkv", "bench", "shift", "--bogus", NULL}};
    expect_usage_errors(bad, sizeof bad / sizeof bad[0]);
}

/* `pkv bench mla --json`: one line a configuration with both medians, their ratio, rates that
 * agree with the mla median and the bytes, and the pool bytes a token takes a layer: K alone in
 * the MLA cache (row bytes), K and V in the classic one. Bad options are usage errors. */
static void test_mla_json(void **state) {
    (void)state;
    char *argv[] = {"pkv", "bench", "mla", "--json", "--ctx", "40,300", "--batch", "2", "--heads", "1,16", "--threads",
                    "1", "--dtype", "f16,q8_0", "--head-dim", "96", "--v-dim", "64", "--mib", "1", "--rounds", "3", NULL};
    char *out, *err;
    const int rc = run_cli(argv, &out, &err);
    if (rc != 0) fail_msg("exit %d: %s", rc, err);
    int seen[2][2][2] = {{{0}}};
    for (char *save = NULL, *line = strtok_r(out, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        one_object(line);
        assert_true(str_is(line, "bench", "mla"));
        const int q8 = str_is(line, "kv_dtype", "q8_0");
        assert_true(q8 || str_is(line, "kv_dtype", "f16"));
        const int ctx = (int)num(line, "ctx"), h = (int)num(line, "heads");
        assert_true((ctx == 40 || ctx == 300) && (h == 1 || h == 16));
        assert_int_equal((int)num(line, "batch"), 2);
        assert_int_equal((int)num(line, "head_dim"), 96);
        assert_int_equal((int)num(line, "v_dim"), 64);
        const double L = num(line, "layers");
        assert_true(L >= 1 && L <= 64);
        seen[q8][ctx == 300][h == 16]++;
        const double c = num(line, "classic_us"), m = num(line, "mla_us");
        assert_true(c > 0 && m > 0);
        /* the medians are printed to 0.1 us: each figure derived from them within that rounding */
        const double ulp = 0.05 / m + 0.05 / c;
        assert_true(fabs(num(line, "mla_over_classic") - m / c) <= 2e-3 + ulp * m / c);
        const double row = (double)pkv_dtype_row_bytes(q8 ? PKV_DTYPE_Q8_0 : PKV_DTYPE_F16, 96);
        const double gb = 2.0 * ctx * row / (m * 1e3), gf = 2.0 * h * (96 + 64) * 2.0 * ctx / (m * 1e3);
        assert_true(fabs(num(line, "gbps") - gb) <= (0.01 + ulp) * gb + 0.01);
        assert_true(fabs(num(line, "gflops") - gf) <= (0.01 + ulp) * gf + 0.1);
        assert_int_equal((int)num(line, "bytes_per_token"), (int)row);
        assert_int_equal((int)num(line, "bytes_per_token_classic"), 2 * (int)row);
    }
    for (int i = 0; i < 8; i++) assert_int_equal(seen[i / 4][i / 2 % 2][i % 2], 1);
    free(out), free(err);
    static char *bad[][5] = {{"pkv", "bench", "mla", "--heads", "0"},    {"pkv", "bench", "mla", "--heads", "129"},
                             {"pkv", "bench", "mla", "--rounds", "2"},   {"pkv", "bench", "mla", "--dtype", "f16,"},
                             {"pkv", "bench", "mla", "--v-dim", "600"},  {"pkv", "bench", "mla", "--batch", "65"},
                             {"pkv", "bench", "mla", "--head-dim", "0"}, {"pkv", "bench", "mla", "--bogus", NULL}};
    expect_usage_errors(bad, sizeof bad / sizeof bad[0]);
    char *odd[] = {"pkv", "bench", "mla", "--dtype", "q8_0", "--head-dim", "96", "--v-dim", "48", NULL};
    assert_int_equal(run_cli(odd, NULL, NULL), 1); /* q8_0 rows of 32 values */
}

/* `pkv bench tier --json`: a header, then copy, direct, save and load for host and file, and the
 * save of a full host tier (host-full), each
 * with a median, GB/s consistent with it and the bytes, and its fraction of the copy's rate (the
 * copy's own 1); a Redis server that does not answer fails the run and says so. */
static void test_tier_json(void **state) {
    (void)state;
    static const char *ops[6] = {"copy", "direct", "save", "load", "prefetch", "flush"};
    char *argv[] = {"pkv", "bench", "tier", "--quick", "--json", NULL};
    char *out, *err;
    int rc = run_cli(argv, &out, &err);
    if (rc != 0) fail_msg("exit %d: %s", rc, err);
    int header = 0, seen[6] = {0}, tiers = 0, full = 0, staged = 0, async = 0;
    for (char *save = NULL, *line = strtok_r(out, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        one_object(line);
        assert_true(str_is(line, "bench", "tier"));
        if (field(line, "build")) {
            assert_int_equal((int)num(line, "tokens"), 512);
            assert_int_equal((int)num(line, "blocks"), 32);
            header++;
            continue;
        }
        const int op = which(line, "op", ops, 6);
        seen[op]++;
        tiers += (str_is(line, "tier", "host") || str_is(line, "tier", "file")) && op != 4 && op != 5;
        async += str_is(line, "tier", "file-async") && op == 2;
        staged += str_is(line, "tier", "file-staged") && op == 3;
        full += str_is(line, "tier", "host-full") && op == 2; /* the steady state's save */
        const double ms = num(line, "median_ms"), gbps = num(line, "gbps"), bytes = num(line, "bytes");
        /* a flush may find its writes done already (the tier's thread ran while the bench was
           descheduled): a time of about 0 (its rate then 0, or huge and rounded); every other
           move takes time */
        if (op == 5) {
            if (!(ms >= 0 && gbps >= 0 && isfinite(gbps))) fail_msg("not a time and a rate: %s", line);
            continue;
        }
        if (!(ms > 0 && gbps > 0 && isfinite(gbps))) fail_msg("not a time and a rate: %s", line);
        assert_true(fabs(gbps - bytes / (ms * 1e-3) * 1e-9) <= 1e-3 * gbps + 2e-3);
        assert_true(fabs(num(line, "copy_frac") - gbps / num(line, "copy_gbps")) <= 1e-3);
        if (op == 0) assert_true(num(line, "copy_frac") == 1.0);
        assert_int_equal((int)num(line, "rounds"), 3);
    }
    assert_int_equal(header, 1);
    assert_true(seen[0] == 1 && seen[1] == 1 && seen[2] == 4 && seen[3] == 3 && seen[4] == 1 && seen[5] == 1 &&
                tiers == 4 && full == 1 && staged == 1 && async == 1);
    free(out), free(err);
    char *dead[] = {"pkv", "bench", "tier", "--quick", "--redis", "127.0.0.1:1", NULL};
    rc = run_cli(dead, &out, &err);
    assert_int_equal(rc, 2);
    assert_non_null(strstr(err, "redis"));
    free(out), free(err);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tier_json),
        cmocka_unit_test(test_tree_json),
        cmocka_unit_test(test_share_json),
        cmocka_unit_test(test_json_lines),
        cmocka_unit_test(test_usage_errors),
        cmocka_unit_test(test_large_batch),
        cmocka_unit_test(test_bf16_dot_json),
        cmocka_unit_test(test_refused_environment),
        cmocka_unit_test(test_ops_json),
        cmocka_unit_test(test_prefix_json),
        cmocka_unit_test(test_mla_json),
        cmocka_unit_test(test_shift_json),
    };
    return TU_RUN_TESTS(tests);
}
