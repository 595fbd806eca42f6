/* sim.c: `pkv sim`: serving replay comparing paged + prefix caching, paged, and contiguous
 * max-length reservation on the same pool; options, the report table, --json and --plot. */
#include "sim.h"
#include "tool.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct sim_cli {
    sim_workload_opts wo;
    sim_opts so;
    const char *trace, *plot;
    int json, policies[SIM_N_POLICIES], n_policies, no_progress;
    double step_ms;
} sim_cli;

static void defaults(sim_cli *c) {
    memset(c, 0, sizeof *c);
    c->wo = (sim_workload_opts){.n_requests = 100, .rate = 20.0, .prompt_mean = 160, .prompt_sigma = 1.0,
                                .output_mean = 340, .output_sigma = 0.9, .max_len = 2048, .n_sys = 4,
                                .sys_len = 256, .sys_frac = 0.5, .n_frac = 0.1, .n_samples = 4, .seed = 1,
                                .turns = 1, .turn_gap_s = 20.0, .turn_mean = 64};
    c->so = (sim_opts){.model = {.n_layers = 2, .n_kv_heads = 2, .n_q_heads = 8, .head_dim = 64, .dtype = PKV_DTYPE_F16},
                       .block_tokens = 16, .n_blocks = 768, .max_len = 2048, .step_tokens = 2048, .max_seqs = 256,
                       .watermark = 0.01, .headroom = 1.0, .n_threads = 0, .spin_us = 50, .attn = 1};
    c->step_ms = 20.0;
    c->n_policies = SIM_N_POLICIES;
    for (int i = 0; i < SIM_N_POLICIES; i++) c->policies[i] = i;
}

/* --compact's modes (sim_opts.compact): the option, and its name in the JSON */
static const char *const compact_opt[] = {"", "--compact", "--compact-evict", "--compact-cached"};
static const char *const compact_json[] = {"off", "on", "evict", "cached"};

static void usage(FILE *f) {
    sim_cli d;
    defaults(&d);
    fprintf(f,
            "usage: pkv sim [options]\n"
            "\n"
            "Serving replay: the same requests and the same pool (number of blocks) under three KV\n"
            "policies, side by side, on the real library (block allocation, prefix matching, forks,\n"
            "K/V writes, commits, paged attention):\n"
            "  paged_prefix  paged blocks + automatic prefix caching\n"
            "  paged         paged blocks, prefix cache disabled\n"
            "  contiguous    each request reserves max-len slots per sample up front, as engines\n"
            "                without paging do (accounting on top of the same library: admission\n"
            "                needs ceil(max_len/B) free blocks per sample; the work is paged underneath)\n"
            "Continuous batching: each step runs one decode token per running sequence plus chunked\n"
            "prefill within --step-tokens; waiting requests are admitted FIFO after a prefix match\n"
            "while blocks allow; when an append finds no block (PKV_ENOSPC) the newest running request\n"
            "is preempted by recompute (released, requeued first, restarted from its prompt), or with\n"
            "--preempt swap by swapping (below).\n"
            "\n"
            "workload (built in, seeded; ShareGPT-like log-normal lengths):\n"
            "  --requests N        requests [%u]\n"
            "  --rate R            Poisson arrivals per second [%g]\n"
            "  --step-ms MS        simulated duration of one step, maps arrival times to steps [%g]\n"
            "  --prompt-mean N     mean prompt tokens (own part) [%g]   --prompt-sigma S  [%g]\n"
            "  --output-mean N     mean output tokens [%g]              --output-sigma S  [%g]\n"
            "  --max-len N         model max length: prompt + output cap, 2 to 2^31 - 1 [%u]\n"
            "  --sys-prompts N     shared system prompts, at most 2^31 - 1 [%u]\n"
            "  --sys-len N         tokens per system prompt [%u]\n"
            "  --sys-frac F        fraction of requests starting with one [%g]\n"
            "  --n-frac F          fraction of requests asking for several samples [%g]\n"
            "  --samples N         samples for those (forked after the prompt) [%u]\n"
            "  --turns N           requests a conversation: each later one (single-sample ones\n"
            "                      only) arrives --turn-gap after the one before, its prompt that\n"
            "                      one's prompt and output, then new tokens (log-normal, mean\n"
            "                      --turn-mean, --prompt-sigma); a conversation ends where the next\n"
            "                      would pass --max-len; --requests counts first turns [%u]\n"
            "  --turn-gap S        seconds between a conversation's turns [%g]\n"
            "  --turn-mean N       mean new tokens of a later turn [%g]\n"
            "  --seed N            seed of the workload and of the K/V data [%llu]\n"
            "  --trace FILE        JSON lines instead of the built-in workload, one request a line:\n"
            "                      {\"arrival\": SECONDS, \"prompt\": [IDS...], \"max_tokens\": N}  or\n"
            "                      {\"arrival\": S, \"prompt_len\": N, \"prefix_group\": G, \"prefix_len\": P,\n"
            "                       \"max_tokens\": N, \"n\": SAMPLES}   (prefix_len defaults to --sys-len,\n"
            "                       at most prompt_len: a shorter prompt is all prefix)\n"
            "                      A malformed line is reported as FILE:LINE and exits 2.\n"
            "model and pool:\n"
            "  --layers N [%u]  --kv-heads N [%u]  --q-heads N [%u]  --head-dim N [%u]  --dtype T [%s]\n"
            "  --block-tokens B    tokens per block [%u]\n"
            "  --blocks N          pool blocks, the same for every policy [%u]\n"
            "scheduler:\n"
            "  --step-tokens N     token budget per step (prefill chunks + decodes) [%u]\n"
            "  --max-seqs N        running sequences at most [%u]\n"
            "  --watermark F       fraction of the pool kept free when admitting [%g]\n"
            "  --headroom F        blocks per running sequence also kept free when admitting, so\n"
            "                      the running ones can grow without preempting the newcomer,\n"
            "                      at most 1e6 [%g]\n"
            "  --threads N         attention threads, 0 = all cpus [%u]\n"
            "  --spin-us US        how long the attention threads poll for the next call\n"
            "                      before they sleep (pkv_config.spin_us), at most 1000000 [%u]\n"
            "  --policies LIST     comma-separated subset of paged_prefix,paged,contiguous [all]\n"
            "  --preempt MODE      recompute (default) or swap: a preempted single-sample request's\n"
            "                      K/V goes to host memory as the pool stores it (pkv_seq_read_stored)\n"
            "                      and comes back at readmission (pkv_seq_write_stored, after a prefix\n"
            "                      match for what the index still holds; read back and compared)\n"
            "                      instead of being recomputed; requests with several samples, and\n"
            "                      --no-attn runs, recompute\n"
            "  --tier host:MIB | file:DIR:MIB\n"
            "                      paged_prefix keeps prompt prefixes in a storage tier of MIB MiB\n"
            "                      behind the pool (host memory, or files in DIR, made if missing):\n"
            "                      what the prefix match does not find in the pool is loaded from it\n"
            "                      (pkv_tier_load; under --window, pkv_tier_load_window: only what\n"
            "                      the window reads), and each computed prompt's full blocks are saved\n"
            "                      to it (pkv_tier_save: under --window, those the window still holds)\n"
            "  --window W          a sliding window on every layer (Mistral 7B v0.1's 4096): attention\n"
            "                      sees the last W positions, and paged and paged_prefix let go of\n"
            "                      the blocks before them after each step (pkv_seq_drop_front; their\n"
            "                      admission counts a prompt's chunk and the window before it, not\n"
            "                      the whole prompt; paged_prefix's stay indexed until evicted);\n"
            "                      contiguous still reserves max_len; not with --preempt swap [0: off]\n"
            "  --match M           under --window, paged_prefix's prefix match and tier load: window\n"
            "                      (the default: pkv_seq_match_prefix_window, past tombstones, and\n"
            "                      pkv_tier_load_window) or plain (pkv_seq_match_prefix and\n"
            "                      pkv_tier_load, the whole chain; to compare)\n"
            "  --no-attn           skip K/V writes and attention: memory-only replay (the pool then\n"
            "                      holds a 1-layer head_dim-8 shape; block accounting is the same)\n"
            "  --compact           before each step, pkv_seq_compact on every decoding sequence (its\n"
            "                      copies count in pkv s); reported: blocks moved, and how often a\n"
            "                      decode batch's neighbouring blocks in id order belong to different\n"
            "                      sequences (what pool-order decode pays for; always reported), and\n"
            "                      how many of those pairs hold a block several of the batch share\n"
            "                      (decode_shared: no layout can part them)\n"
            "  --compact-evict     the same with PKV_COMPACT_EVICT: CACHED leaf blocks may be targets\n"
            "                      (evicted; counted in evictions)\n"
            "  --compact-cached    the same with PKV_COMPACT_CACHED: CACHED blocks may be targets\n"
            "                      (exchanged, so they stay in the prefix index)\n"
            "  --batch-compact N   every N steps, before the slots are taken, pkv_batch_compact of the\n"
            "                      decoding sequences, oldest first (after --compact's moves) [0: never]\n"
            "  --slack K           ids left free after each sequence by --batch-compact [0]\n"
            "  --repack            --batch-compact with PKV_BATCH_REPACK: every sequence laid out again\n"
            "  --batch-cached      --batch-compact with PKV_BATCH_CACHED: CACHED blocks are targets too\n"
            "                      (exchanged, so they stay in the prefix index)\n"
            "output:\n"
            "  --json              one JSON object per policy per line on stdout, no table\n"
            "  --plot FILE.png     blocks in use and running sequences over time (gnuplot; a name\n"
            "                      without quotes or control characters)\n"
            "  --no-progress       no progress bar (it is drawn only when stderr is a terminal)\n"
            "  -h, --help          this help\n"
            "\n"
            "Times are in steps (TTFT) or seconds spent inside pkv calls (decode tok/s). Exit status:\n"
            "0 ok, 1 usage error, 2 runtime error (library failure, unreadable or malformed trace,\n"
            "a failing pkv_cache_check at the end of a policy, gnuplot failure).\n",
            d.wo.n_requests, d.wo.rate, d.step_ms, d.wo.prompt_mean, d.wo.prompt_sigma, d.wo.output_mean,
            d.wo.output_sigma, d.wo.max_len, d.wo.n_sys, d.wo.sys_len, d.wo.sys_frac, d.wo.n_frac, d.wo.n_samples,
            d.wo.turns, d.wo.turn_gap_s, d.wo.turn_mean, (unsigned long long)d.wo.seed, d.so.model.n_layers,
            d.so.model.n_kv_heads, d.so.model.n_q_heads, d.so.model.head_dim, pkv_dtype_name(d.so.model.dtype), d.so.block_tokens, d.so.n_blocks,
            d.so.step_tokens, d.so.max_seqs, d.so.watermark, d.so.headroom, d.so.n_threads, d.so.spin_us);
}

static int parse_policies(sim_cli *c, const char *s) {
    c->n_policies = 0;
    int seen[SIM_N_POLICIES] = {0};
    while (*s) {
        size_t n = strcspn(s, ",");
        int found = -1;
        for (int i = 0; i < SIM_N_POLICIES; i++)
            if (strlen(sim_policy_names[i]) == n && !strncmp(s, sim_policy_names[i], n)) found = i;
        if (found < 0 || seen[found]) return -1;
        seen[found] = 1;
        c->policies[c->n_policies++] = found;
        s += n;
        if (*s == ',') s++;
    }
    return c->n_policies ? 0 : -1;
}

static int parse_args(sim_cli *c, int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 1;
        }
        if (!strcmp(a, "--json")) { c->json = 1; continue; }
        if (!strcmp(a, "--no-attn")) { c->so.attn = 0; continue; }
        int mode = 3;
        while (mode > 0 && strcmp(a, compact_opt[mode])) mode--;
        if (mode) { c->so.compact = mode; continue; }
        if (!strcmp(a, "--repack")) { c->so.repack = 1; continue; }
        if (!strcmp(a, "--batch-cached")) { c->so.batch_cached = 1; continue; }
        if (!strcmp(a, "--no-progress")) { c->no_progress = 1; continue; }
        /* a missing value is said after the name is known: a typo last is an unknown option */
        const int missing = i + 1 >= argc;
        const char *v = missing ? "" : argv[++i];
        int bad = 0;
        double d;
        if (!strcmp(a, "--tier")) {
            double mib = 0;
            const char *last = strrchr(v, ':');
            bad = !last || tool_parse_f64(last + 1, &mib) || !(mib > 0) || mib > 1e9;
            if (!bad && !strncmp(v, "host:", 5) && last == v + 4) c->so.tier_dir = NULL;
            else if (!bad && !strncmp(v, "file:", 5) && last > v + 5) {
                static char dir[4096];
                const size_t n = (size_t)(last - (v + 5));
                bad = n >= sizeof dir;
                if (!bad) memcpy(dir, v + 5, n), dir[n] = 0, c->so.tier_dir = dir;
            } else bad = 1;
            if (!bad) c->so.tier_bytes = (uint64_t)(mib * 1048576.0);
        } else if (!strcmp(a, "--preempt")) {
            bad = strcmp(v, "swap") && strcmp(v, "recompute");
            c->so.swap = !strcmp(v, "swap");
        } else if (!strcmp(a, "--window")) bad = tool_parse_u32(v, &c->so.window);
        else if (!strcmp(a, "--batch-compact")) bad = tool_parse_u32(v, &c->so.batch_compact);
        else if (!strcmp(a, "--slack")) bad = tool_parse_u32(v, &c->so.slack);
        else if (!strcmp(a, "--requests")) bad = tool_parse_u32(v, &c->wo.n_requests) || c->wo.n_requests == 0;
        else if (!strcmp(a, "--rate")) bad = tool_parse_f64(v, &c->wo.rate) || c->wo.rate <= 0;
        else if (!strcmp(a, "--step-ms")) bad = tool_parse_f64(v, &c->step_ms) || c->step_ms <= 0;
        else if (!strcmp(a, "--prompt-mean")) bad = tool_parse_f64(v, &c->wo.prompt_mean) || c->wo.prompt_mean < 1;
        else if (!strcmp(a, "--prompt-sigma")) bad = tool_parse_f64(v, &c->wo.prompt_sigma) || c->wo.prompt_sigma < 0;
        else if (!strcmp(a, "--output-mean")) bad = tool_parse_f64(v, &c->wo.output_mean) || c->wo.output_mean < 1;
        else if (!strcmp(a, "--output-sigma")) bad = tool_parse_f64(v, &c->wo.output_sigma) || c->wo.output_sigma < 0;
        else if (!strcmp(a, "--max-len")) bad = tool_parse_u32(v, &c->wo.max_len) || c->wo.max_len < 2 || c->wo.max_len > INT32_MAX;
        else if (!strcmp(a, "--sys-prompts")) bad = tool_parse_u32(v, &c->wo.n_sys) || c->wo.n_sys > INT32_MAX; /* group ids are int32 */
        else if (!strcmp(a, "--sys-len")) bad = tool_parse_u32(v, &c->wo.sys_len);
        else if (!strcmp(a, "--sys-frac")) bad = tool_parse_f64(v, &c->wo.sys_frac) || c->wo.sys_frac < 0 || c->wo.sys_frac > 1;
        else if (!strcmp(a, "--n-frac")) bad = tool_parse_f64(v, &c->wo.n_frac) || c->wo.n_frac < 0 || c->wo.n_frac > 1;
        else if (!strcmp(a, "--samples")) bad = tool_parse_u32(v, &c->wo.n_samples) || c->wo.n_samples == 0;
        else if (!strcmp(a, "--seed")) bad = tool_parse_u64(v, &c->wo.seed);
        else if (!strcmp(a, "--turns")) bad = tool_parse_u32(v, &c->wo.turns) || c->wo.turns == 0;
        else if (!strcmp(a, "--turn-gap")) bad = tool_parse_f64(v, &c->wo.turn_gap_s) || c->wo.turn_gap_s < 0;
        else if (!strcmp(a, "--turn-mean")) bad = tool_parse_f64(v, &c->wo.turn_mean) || c->wo.turn_mean < 1;
        else if (!strcmp(a, "--match")) {
            bad = strcmp(v, "window") && strcmp(v, "plain");
            c->so.plain_match = !strcmp(v, "plain");
        }
        else if (!strcmp(a, "--trace")) c->trace = v;
        else if (!strcmp(a, "--layers")) bad = tool_parse_u32(v, &c->so.model.n_layers) || !c->so.model.n_layers;
        else if (!strcmp(a, "--kv-heads")) bad = tool_parse_u32(v, &c->so.model.n_kv_heads) || !c->so.model.n_kv_heads;
        else if (!strcmp(a, "--q-heads")) bad = tool_parse_u32(v, &c->so.model.n_q_heads) || !c->so.model.n_q_heads;
        else if (!strcmp(a, "--head-dim")) bad = tool_parse_u32(v, &c->so.model.head_dim) || !c->so.model.head_dim;
        else if (!strcmp(a, "--dtype")) bad = pkv_dtype_from_name(v, &c->so.model.dtype) < 0;
        else if (!strcmp(a, "--block-tokens")) bad = tool_parse_u32(v, &c->so.block_tokens) || !c->so.block_tokens;
        else if (!strcmp(a, "--blocks")) bad = tool_parse_u32(v, &c->so.n_blocks) || !c->so.n_blocks;
        else if (!strcmp(a, "--step-tokens")) bad = tool_parse_u32(v, &c->so.step_tokens) || !c->so.step_tokens;
        else if (!strcmp(a, "--max-seqs")) bad = tool_parse_u32(v, &c->so.max_seqs) || !c->so.max_seqs;
        else if (!strcmp(a, "--watermark")) bad = tool_parse_f64(v, &d) || d < 0 || d >= 1 || ((c->so.watermark = d), 0);
        else if (!strcmp(a, "--headroom")) bad = tool_parse_f64(v, &c->so.headroom) || c->so.headroom < 0 || c->so.headroom > 1e6;
        else if (!strcmp(a, "--threads")) bad = tool_parse_u32(v, &c->so.n_threads);
        else if (!strcmp(a, "--spin-us")) bad = tool_parse_u32(v, &c->so.spin_us) || c->so.spin_us > 1000000;
        else if (!strcmp(a, "--policies")) bad = parse_policies(c, v);
        else if (!strcmp(a, "--plot")) {
            /* the name goes into gnuplot's script in single quotes: no quote or control byte */
            c->plot = v;
            for (const unsigned char *q = (const unsigned char *)v; *q; q++) bad |= *q == '\'' || *q < 0x20 || *q == 0x7f;
            bad |= !*v;
        }
        else {
            fprintf(stderr, "pkv sim: unknown option '%s' (see pkv sim --help)\n", a);
            return -1;
        }
        if (missing) {
            fprintf(stderr, "pkv sim: %s needs a value (see pkv sim --help)\n", a);
            return -1;
        }
        if (bad) {
            fprintf(stderr, "pkv sim: bad value '%s' for %s\n", v, a);
            return -1;
        }
    }
    if (c->so.window && c->so.swap) { /* a swapped request is read from position 0 */
        fprintf(stderr, "pkv sim: --window with --preempt swap: paged has dropped the positions a swap reads\n");
        return -1;
    }
    if (c->so.model.n_q_heads % c->so.model.n_kv_heads) {
        fprintf(stderr, "pkv sim: --q-heads %u is not a multiple of --kv-heads %u\n", c->so.model.n_q_heads,
                c->so.model.n_kv_heads);
        return -1;
    }
    if (!pkv_dtype_row_bytes(c->so.model.dtype, c->so.model.head_dim)) {
        fprintf(stderr, "pkv sim: --dtype %s needs --head-dim a multiple of 32, not %u\n",
                pkv_dtype_name(c->so.model.dtype), c->so.model.head_dim);
        return -1;
    }
    return 0;
}

static double rss_mib(void) {
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru)) return 0;
    return (double)ru.ru_maxrss / 1024.0; /* Linux: KiB */
}

static double decode_switch(const sim_result *r) {
    return r->dec_pairs ? (double)r->dec_switches / (double)r->dec_pairs : 0.0;
}

static double decode_shared(const sim_result *r) {
    return r->dec_pairs ? (double)r->dec_shared / (double)r->dec_pairs : 0.0;
}

static void print_json(const sim_result *r, const sim_cli *c, uint32_t n_requests) {
    printf("{\"policy\":\"%s\",\"requests\":%u,\"completed\":%u,\"rejected\":%u,\"peak_seqs\":%u,\"mean_seqs\":%.2f,"
           "\"peak_blocks\":%u,\"n_blocks\":%u,\"kv_utilization\":%.4f,\"waste\":%.4f,\"prefix_hit_rate\":%.4f,"
           "\"prefix_hit_tokens\":%llu,\"prompt_tokens\":%llu,\"preemptions\":%u,\"steps\":%llu,"
           "\"decode_tokens\":%llu,\"prefill_tokens\":%llu,\"cow_copies\":%llu,\"evictions\":%llu,\"shared_keys\":%llu,"
           "\"ttft_p50_steps\":%.1f,\"ttft_p90_steps\":%.1f,\"ttft_p99_steps\":%.1f,\"pkv_s\":%.4f,\"attn_s\":%.4f,"
           "\"wall_s\":%.3f,\"decode_tok_s\":%.1f,\"attn\":%s,\"check\":\"%s\",\"peak_rss_mib\":%.1f,\"seed\":%llu,"
           "\"decode_switch\":%.4f,\"decode_shared\":%.4f,\"compact\":\"%s\",\"batch_compact\":%u,\"slack\":%u,\"repack\":%s,\"batch_cached\":%s,"
           "\"compacted_blocks\":%llu,\"compact_s\":%.4f,\"preempt\":\"%s\",\"swap_outs\":%u,\"swap_in_tokens\":%llu,"
           "\"swap_peak_bytes\":%llu,\"tier_bytes_cap\":%llu,\"tier_hit_tokens\":%llu,\"tier_saved_blocks\":%llu,"
           "\"tier_evictions\":%llu,\"tier_bytes\":%llu,\"window\":%u,\"tomb_hits\":%llu,\"tombstones\":%llu}\n",
           sim_policy_names[r->policy], n_requests, r->completed, r->rejected, r->peak_seqs, r->mean_seqs,
           r->peak_blocks, c->so.n_blocks, r->kv_utilization, r->waste, r->prefix_hit_rate,
           (unsigned long long)r->prefix_hit_tokens, (unsigned long long)r->prompt_tokens, r->preemptions,
           (unsigned long long)r->steps, (unsigned long long)r->decode_tokens, (unsigned long long)r->prefill_tokens,
           (unsigned long long)r->cow_copies, (unsigned long long)r->evictions, (unsigned long long)r->shared_keys,
           r->ttft_p50, r->ttft_p90, r->ttft_p99,
           r->pkv_s, r->attn_s, r->wall_s, r->decode_tok_s, c->so.attn ? "true" : "false",
           r->check_rc == 0 ? "ok" : "failed", rss_mib(), (unsigned long long)c->wo.seed, decode_switch(r), decode_shared(r),
           compact_json[c->so.compact], c->so.batch_compact, c->so.slack,
           c->so.repack ? "true" : "false", c->so.batch_cached ? "true" : "false", (unsigned long long)r->compact_moved, r->compact_s,
           c->so.swap ? "swap" : "recompute", r->swap_outs, (unsigned long long)r->swap_in_tokens,
           (unsigned long long)r->swap_peak_bytes, (unsigned long long)(r->policy == SIM_PAGED_PREFIX ? c->so.tier_bytes : 0),
           (unsigned long long)r->tier_hit_tokens, (unsigned long long)r->tier_saved_blocks,
           (unsigned long long)r->tier_evictions, (unsigned long long)r->tier_bytes, c->so.window,
           (unsigned long long)r->tomb_hits, (unsigned long long)r->tombstones);
}

/* What would fail the plot, checked before the run rather than after it: gnuplot on PATH, and
 * the file writable (opened without truncating, so a run that fails leaves an existing file as
 * it was) and not the trace. A TOOL_* status. */
static int plot_check(const sim_cli *c) {
    if (system("command -v gnuplot >/dev/null 2>&1") != 0) {
        fprintf(stderr, "pkv sim: --plot needs gnuplot, which is not on PATH (Debian: apt install gnuplot-nox)\n");
        return TOOL_FAIL;
    }
    struct stat before, tr;
    const int existed = stat(c->plot, &before) == 0;
    if (existed && c->trace && stat(c->trace, &tr) == 0 && tr.st_dev == before.st_dev && tr.st_ino == before.st_ino) {
        fprintf(stderr, "pkv sim: --plot '%s' is the trace file\n", c->plot);
        return TOOL_USAGE;
    }
    const int fd = open(c->plot, O_WRONLY | O_CREAT, 0666);
    if (fd < 0) {
        fprintf(stderr, "pkv sim: --plot: cannot write '%s': %s\n", c->plot, strerror(errno));
        return TOOL_FAIL;
    }
    close(fd);
    if (!existed) unlink(c->plot); /* gnuplot makes it at the end */
    return TOOL_OK;
}

/* Draws the run's series with gnuplot (plot_check passed before the run). */
static int plot(const sim_cli *c, const sim_result *res, int n) {
    char dir[] = "/tmp/pkv-sim-XXXXXX";
    if (!mkdtemp(dir)) {
        fprintf(stderr, "pkv sim: --plot: cannot create a temporary directory: %s\n", strerror(errno));
        return -1;
    }
    char path[SIM_N_POLICIES][64];
    for (int i = 0; i < n; i++) {
        snprintf(path[i], sizeof path[i], "%s/%s.dat", dir, sim_policy_names[res[i].policy]);
        FILE *f = fopen(path[i], "w");
        if (!f) return -1;
        for (uint32_t k = 0; k < res[i].n_series; k++)
            fprintf(f, "%llu %u %u\n", (unsigned long long)res[i].series[k].step, res[i].series[k].blocks,
                    res[i].series[k].seqs);
        fclose(f);
    }
    FILE *g = popen("gnuplot", "w");
    if (!g) {
        fprintf(stderr, "pkv sim: --plot: cannot start gnuplot\n");
        return -1;
    }
    fprintf(g, "set terminal pngcairo size 1000,800 noenhanced\nset output '%s'\n", c->plot);
    fprintf(g, "set multiplot layout 2,1 title 'pkv sim: %u blocks of %u tokens, seed %llu'\n", c->so.n_blocks,
            c->so.block_tokens, (unsigned long long)c->wo.seed);
    fprintf(g, "set grid\nset key outside right\nset xlabel 'step'\nset ylabel 'blocks in use (reserved)'\n");
    fprintf(g, "set yrange [0:%u]\nplot ", c->so.n_blocks);
    for (int i = 0; i < n; i++)
        fprintf(g, "%s'%s' using 1:2 with lines lw 2 title '%s'", i ? ", " : "", path[i], sim_policy_names[res[i].policy]);
    fprintf(g, "\nset ylabel 'running sequences'\nset yrange [0:*]\nplot ");
    for (int i = 0; i < n; i++)
        fprintf(g, "%s'%s' using 1:3 with lines lw 2 title '%s'", i ? ", " : "", path[i], sim_policy_names[res[i].policy]);
    fprintf(g, "\nunset multiplot\n");
    int st = pclose(g);
    for (int i = 0; i < n; i++) remove(path[i]);
    rmdir(dir);
    if (st != 0) {
        fprintf(stderr, "pkv sim: gnuplot failed writing '%s'\n", c->plot);
        return -1;
    }
    fprintf(stderr, "pkv sim: wrote %s\n", c->plot);
    return 0;
}

int tool_sim(int argc, char **argv) {
    sim_cli c;
    defaults(&c);
    int pr = parse_args(&c, argc, argv);
    if (pr) return pr > 0 ? TOOL_OK : TOOL_USAGE;
    c.wo.step_s = c.step_ms / 1000.0;
    c.so.max_len = c.wo.max_len;
    c.so.seed = c.wo.seed;
    c.so.progress = !c.no_progress && isatty(STDERR_FILENO);
    c.so.want_series = c.plot != NULL;
    if (c.plot) {
        const int pc = plot_check(&c);
        if (pc != TOOL_OK) return pc;
    }

    sim_workload w;
    if (c.trace) {
        if (sim_workload_read_trace(c.trace, &c.wo, &w)) return TOOL_FAIL;
    } else {
        const int rc = sim_workload_generate(&c.wo, &w);
        if (rc == SIM_WORKLOAD_FAR) {
            fprintf(stderr, "pkv sim: --rate %g and --step-ms %g put arrivals past 2^53 steps\n", c.wo.rate, c.step_ms);
            return TOOL_USAGE;
        }
        if (rc) {
            fprintf(stderr, "pkv sim: out of memory for the workload\n");
            return TOOL_FAIL;
        }
    }
    uint64_t prompt_sum = 0, out_sum = 0, multi = 0, grouped = 0;
    for (uint32_t i = 0; i < w.n; i++) {
        prompt_sum += w.reqs[i].prompt_len;
        out_sum += w.reqs[i].output_len;
        multi += w.reqs[i].n_samples > 1;
        grouped += w.reqs[i].group >= 0;
    }
    const sim_model *md = &c.so.model;
    double block_kib = (double)c.so.block_tokens * md->n_layers * 2.0 *
                       (double)pkv_dtype_row_bytes(md->dtype, md->head_dim) * md->n_kv_heads / 1024.0;
    char window_note[64] = "";
    if (c.so.window) snprintf(window_note, sizeof window_note, "; window %u (paged policies drop what it passed)", c.so.window);
    if (!c.json) {
        printf("pkv sim: %u requests (%s, seed %llu): prompt mean %.0f, output mean %.0f tokens, %llu with a shared "
               "prefix, %llu with n > 1\n",
               w.n, c.trace ? c.trace : "built-in", (unsigned long long)c.wo.seed, (double)prompt_sum / w.n,
               (double)out_sum / w.n, (unsigned long long)grouped, (unsigned long long)multi);
        printf("pkv sim: model %u layers x %u kv heads x %u (%u q heads), %s; pool %u blocks x %u tokens = %.1f MiB; "
               "max_len %u, %u tokens/step, max %u seqs%s%s\n",
               md->n_layers, md->n_kv_heads, md->head_dim, md->n_q_heads, pkv_dtype_name(md->dtype), c.so.n_blocks,
               c.so.block_tokens, block_kib * c.so.n_blocks / 1024.0, c.so.max_len, c.so.step_tokens, c.so.max_seqs,
               c.so.attn ? "" : "; --no-attn (no K/V writes, no attention)", window_note);
        fflush(stdout);
    }
    sim_result res[SIM_N_POLICIES];
    memset(res, 0, sizeof res);
    int status = TOOL_OK;
    int n_run = 0;
    for (int i = 0; i < c.n_policies; i++) {
        int rc = sim_run_policy(&c.so, &w, c.policies[i], &res[i]);
        n_run = i + 1;
        if (rc < 0) {
            status = TOOL_FAIL;
            break;
        }
        if (res[i].check_rc < 0) {
            fprintf(stderr, "pkv sim: %s: pkv_cache_check failed: %s\n", sim_policy_names[c.policies[i]], res[i].check_msg);
            status = TOOL_FAIL;
        }
    }
    if (status == TOOL_OK || n_run == c.n_policies) {
        if (c.json) {
            for (int i = 0; i < n_run; i++) print_json(&res[i], &c, w.n);
        } else {
            printf("\n%-13s %6s %5s %6s %7s %6s %6s %7s %7s %6s %14s %9s %13s %7s\n", "policy", "done", "peak",
                   "mean", "peak", "kv", "waste", "prefix", "preempt", "steps", "ttft p50/90/99", "decode", "pkv s",
                   "wall s");
            printf("%-13s %6s %5s %6s %7s %6s %6s %7s %7s %6s %14s %9s %13s %7s\n", "", "", "seqs", "seqs", "blocks",
                   "util", "", "hit", "", "", "(steps)", "tok/s", "(attn s)", "");
            for (int i = 0; i < n_run; i++) {
                const sim_result *r = &res[i];
                char ttft[32], pkvs[32];
                snprintf(ttft, sizeof ttft, "%.0f/%.0f/%.0f", r->ttft_p50, r->ttft_p90, r->ttft_p99);
                snprintf(pkvs, sizeof pkvs, "%.2f (%.2f)", r->pkv_s, r->attn_s);
                printf("%-13s %6u %5u %6.1f %7u %5.1f%% %5.1f%% %6.1f%% %7u %6llu %14s %9.0f %13s %7.2f\n",
                       sim_policy_names[r->policy], r->completed, r->peak_seqs, r->mean_seqs, r->peak_blocks,
                       100.0 * r->kv_utilization, 100.0 * r->waste, 100.0 * r->prefix_hit_rate, r->preemptions,
                       (unsigned long long)r->steps, ttft, r->decode_tok_s, pkvs, r->wall_s);
            }
            printf("\nkv util: slots holding live tokens / slots reserved (ACTIVE blocks; contiguous: reserved blocks),\n"
                   "averaged over steps; waste: mean share of the pool reserved but empty; prefix hit: prompt tokens\n"
                   "reused by pkv_seq_match_prefix; decode tok/s: decode tokens / seconds inside pkv calls.\n");
            for (int i = 0; i < n_run; i++)
                printf("%s: %u rejected (too large for the pool), %llu copy-on-write copies, %llu evictions, "
                       "%llu positions decode read once a group of sequences sharing them, %llu matches through a "
                       "tombstone (%llu at the end), checker %s\n",
                       sim_policy_names[res[i].policy], res[i].rejected, (unsigned long long)res[i].cow_copies,
                       (unsigned long long)res[i].evictions, (unsigned long long)res[i].shared_keys,
                       (unsigned long long)res[i].tomb_hits, (unsigned long long)res[i].tombstones,
                       res[i].check_rc == 0 ? "ok" : "FAILED");
            for (int i = 0; i < n_run; i++) {
                printf("%s: decode batches in block id order: %.1f%% of neighbouring blocks belong to different "
                       "sequences (%.1f%% with a block several share)",
                       sim_policy_names[res[i].policy], 100.0 * decode_switch(&res[i]), 100.0 * decode_shared(&res[i]));
                if (c.so.compact || c.so.batch_compact)
                    printf("; %s%s%s%s copied %llu blocks in %.3f s",
                           compact_opt[c.so.compact],
                           c.so.compact && c.so.batch_compact ? " and " : "",
                           c.so.batch_compact ? (c.so.repack ? "--batch-compact --repack" : "--batch-compact") : "",
                           c.so.batch_compact && c.so.batch_cached ? " --batch-cached" : "",
                           (unsigned long long)res[i].compact_moved, res[i].compact_s);
                printf("\n");
            }
            for (int i = 0; c.so.swap && i < n_run; i++)
                printf("%s: --preempt swap: %u of %u preemptions swapped out, %llu positions written back from the "
                       "host (not recomputed; %llu prefill tokens in all), at most %.1f MiB on the host\n",
                       sim_policy_names[res[i].policy], res[i].swap_outs, res[i].preemptions,
                       (unsigned long long)res[i].swap_in_tokens, (unsigned long long)res[i].prefill_tokens,
                       (double)res[i].swap_peak_bytes / 1048576.0);
            for (int i = 0; c.so.tier_bytes && i < n_run; i++)
                if (res[i].policy == SIM_PAGED_PREFIX)
                    printf("%s: --tier %s of %.1f MiB: %llu prompt positions from it (loaded, or a windowed load's "
                           "skipped front; beside %llu matched in the pool), %llu blocks saved, %llu dropped for "
                           "room, %.1f MiB held at the end\n",
                           sim_policy_names[res[i].policy], c.so.tier_dir ? "file" : "host",
                           (double)c.so.tier_bytes / 1048576.0, (unsigned long long)res[i].tier_hit_tokens,
                           (unsigned long long)res[i].prefix_hit_tokens, (unsigned long long)res[i].tier_saved_blocks,
                           (unsigned long long)res[i].tier_evictions, (double)res[i].tier_bytes / 1048576.0);
            printf("peak RSS %.1f MiB\n", rss_mib());
        }
    }
    if (c.plot && n_run > 0 && status == TOOL_OK && plot(&c, res, n_run)) status = TOOL_FAIL;
    for (int i = 0; i < SIM_N_POLICIES; i++) free(res[i].series);
    sim_workload_free(&w);
    return status;
}
