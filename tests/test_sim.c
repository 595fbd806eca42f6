/* test_sim.c: `pkv sim` end to end: with a fixed seed the three policies complete the same
 * requests, paging admits at least as many sequences as contiguous reservation, the checker
 * passes, runs are deterministic, preemption works, and traces are read or rejected by line. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include "test_run_spawn.h"

#include <math.h>

/* small model and pool so the test is quick; max_len 512 => contiguous reserves 32 blocks */
#define SMALL "--layers", "1", "--kv-heads", "1", "--q-heads", "2", "--head-dim", "32", "--dtype", "f32", \
              "--max-len", "512", "--prompt-mean", "60", "--output-mean", "80", "--sys-len", "64",     \
              "--no-progress", "--json"

/* a pool too small for the arrivals: the paged policies preempt */
#define PRESSURE "--requests", "60", "--blocks", "150", "--headroom", "0", "--rate", "1000", "--seed", "3"

static double field(const char *line, const char *key) {
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\":", key);
    const char *p = strstr(line, pat);
    if (!p) fail_msg("no %s in %s", key, line);
    p += strlen(pat);
    if (*p == '"') return strncmp(p, "\"ok\"", 4) == 0 ? 1.0 : 0.0; /* only "check" is a string we read */
    if (!strncmp(p, "true", 4) || !strncmp(p, "false", 5)) return *p == 't';
    return strtod(p, NULL);
}

typedef struct runs {
    char *out;
    char *line[3]; /* paged_prefix, paged, contiguous */
} runs;

static void split(runs *r) {
    static const char *names[3] = {"paged_prefix", "paged", "contiguous"};
    memset(r->line, 0, sizeof r->line);
    for (char *p = r->out; p && *p;) {
        char *nl = strchr(p, '\n');
        if (nl) *nl = 0;
        for (int i = 0; i < 3; i++) {
            char pat[64];
            snprintf(pat, sizeof pat, "\"policy\":\"%s\"", names[i]);
            if (strstr(p, pat)) r->line[i] = p;
        }
        p = nl ? nl + 1 : NULL;
    }
    for (int i = 0; i < 3; i++)
        if (!r->line[i]) fail_msg("no JSON line for %s in:\n%s", names[i], r->out);
}

static void sim(char **argv, runs *r) {
    char *err = NULL;
    int rc = run_cli(argv, &r->out, &err);
    if (rc != 0) fail_msg("pkv sim exited %d: %s", rc, err ? err : "");
    free(err);
    split(r);
}

/* The run under PRESSURE alone, which four tests compare with: run once and kept (never freed). */
static const runs *pressure_run(void) {
    static runs r;
    if (!r.out) {
        char *argv[] = {"pkv", "sim", SMALL, PRESSURE, NULL};
        sim(argv, &r);
    }
    return &r;
}

static void test_policies_complete_same_requests(void **state) {
    (void)state;
    char *argv[] = {"pkv", "sim", SMALL, "--requests", "80", "--blocks", "400", "--seed", "5", NULL};
    runs r;
    sim(argv, &r);
    double req = field(r.line[0], "requests");
    assert_true(req == 80);
    for (int i = 0; i < 3; i++) {
        assert_true(field(r.line[i], "check") == 1.0);
        assert_true(field(r.line[i], "completed") + field(r.line[i], "rejected") == req);
        assert_true(field(r.line[i], "completed") == field(r.line[0], "completed"));
        assert_true(field(r.line[i], "completed") > 0);
        assert_true(field(r.line[i], "decode_tokens") > 0);
        assert_true(field(r.line[i], "kv_utilization") > 0 && field(r.line[i], "kv_utilization") <= 1.0);
    }
    assert_true(field(r.line[1], "peak_seqs") >= field(r.line[2], "peak_seqs"));
    assert_true(field(r.line[0], "peak_seqs") >= field(r.line[2], "peak_seqs"));
    assert_true(field(r.line[1], "mean_seqs") > field(r.line[2], "mean_seqs"));
    assert_true(field(r.line[1], "kv_utilization") > field(r.line[2], "kv_utilization"));
    assert_true(field(r.line[0], "prefix_hit_rate") > 0.05); /* shared system prompts are reused */
    assert_true(field(r.line[1], "prefix_hit_rate") == 0);
    assert_true(field(r.line[2], "prefix_hit_rate") == 0);
    assert_true(field(r.line[2], "preemptions") == 0); /* reservation never runs out */
    assert_true(field(r.line[2], "peak_blocks") <= 400);
    free(r.out);
}

/* Same seed => same schedule (every count); the kernels do not influence scheduling, so
 * --no-attn replays the identical schedule. Another seed => another workload. */
static void test_deterministic_and_attn_independent(void **state) {
    (void)state;
    char *a[] = {"pkv", "sim", SMALL, "--requests", "50", "--blocks", "300", "--seed", "9", NULL};
    char *b[] = {"pkv", "sim", SMALL, "--requests", "50", "--blocks", "300", "--seed", "9", "--no-attn", NULL};
    char *d[] = {"pkv", "sim", SMALL, "--requests", "50", "--blocks", "300", "--seed", "10", "--no-attn", NULL};
    runs ra, rb, rd;
    sim(a, &ra);
    sim(b, &rb);
    sim(d, &rd);
    static const char *keys[] = {"completed", "peak_seqs", "mean_seqs", "peak_blocks", "kv_utilization",
                                 "prefix_hit_tokens", "preemptions", "steps", "decode_tokens", "prefill_tokens",
                                 "cow_copies", "ttft_p50_steps", "ttft_p99_steps"};
    int differs = 0;
    for (int i = 0; i < 3; i++) {
        for (size_t k = 0; k < sizeof keys / sizeof keys[0]; k++) {
            double x = field(ra.line[i], keys[k]), y = field(rb.line[i], keys[k]);
            if (x != y) fail_msg("%s: %s %g with attention, %g without", keys[k], ra.line[i], x, y);
            differs |= x != field(rd.line[i], keys[k]);
        }
    }
    assert_true(differs);
    free(ra.out), free(rb.out), free(rd.out);
}

/* Requests of 4 samples after a 600-token system prompt: decode reads the forks' shared prompt
 * once a group (shared_keys > 0 under every policy: the forks share their request's blocks even
 * without the prefix cache); --no-attn runs no attention and reads nothing. */
static void test_shared_keys(void **state) {
    (void)state;
    char *a[] = {"pkv", "sim", SMALL, "--requests", "12", "--blocks", "2000", "--max-len", "2048", "--sys-len", "600",
                 "--sys-frac", "1", "--n-frac", "0.5", "--samples", "4", NULL};
    char *b[] = {"pkv", "sim", SMALL, "--requests", "12", "--blocks", "2000", "--max-len", "2048", "--sys-len", "600",
                 "--sys-frac", "1", "--n-frac", "0.5", "--samples", "4", "--no-attn", NULL};
    runs ra, rb;
    sim(a, &ra);
    sim(b, &rb);
    for (int i = 0; i < 3; i++) {
        assert_true(field(ra.line[i], "shared_keys") > 0);
        assert_true(field(rb.line[i], "shared_keys") == 0);
    }
    free(ra.out), free(rb.out);
}

/* --compact and --batch-compact change where blocks lie, never the schedule: every count is the
 * same, the checker passes (with attention over the moved blocks), blocks move under the paged
 * policy and its decode batches switch sequences less often in block id order. */
static void test_compact_keeps_schedule(void **state) {
    (void)state;
    char *a[] = {"pkv", "sim", SMALL, "--requests", "50", "--blocks", "300", "--seed", "9", NULL};
    char *b[] = {"pkv", "sim", SMALL, "--requests", "50", "--blocks", "300", "--seed", "9", "--compact", NULL};
    runs ra, rb;
    sim(a, &ra);
    sim(b, &rb);
    static const char *keys[] = {"completed", "peak_seqs", "mean_seqs", "peak_blocks", "kv_utilization",
                                 "prefix_hit_tokens", "preemptions", "steps", "decode_tokens", "prefill_tokens",
                                 "cow_copies", "evictions", "ttft_p50_steps", "ttft_p99_steps"};
    for (int i = 0; i < 3; i++) {
        assert_true(field(rb.line[i], "check") == 1.0);
        assert_true(field(ra.line[i], "compacted_blocks") == 0);
        for (size_t k = 0; k < sizeof keys / sizeof keys[0]; k++)
            if (field(ra.line[i], keys[k]) != field(rb.line[i], keys[k]))
                fail_msg("%s: %g without --compact, %g with", keys[k], field(ra.line[i], keys[k]),
                         field(rb.line[i], keys[k]));
    }
    assert_true(field(rb.line[1], "compacted_blocks") > 0);
    assert_true(field(ra.line[1], "decode_switch") > 0.3);
    assert_true(field(rb.line[1], "decode_switch") < 0.5 * field(ra.line[1], "decode_switch"));
    /* --batch-compact every 4 steps, as laid out (leaving what is in place) and with --repack
       (everything laid out again): the same schedule, fewer switches under both paged
       policies, and repacking copies more for the same */
    char *c[] = {"pkv", "sim", SMALL, "--requests", "50", "--blocks", "300", "--seed", "9", "--batch-compact", "4",
                 "--slack", "1", NULL};
    char *d[] = {"pkv", "sim", SMALL, "--requests", "50", "--blocks", "300", "--seed", "9", "--batch-compact", "4",
                 "--slack", "1", "--repack", NULL};
    runs rc, rd;
    sim(c, &rc);
    sim(d, &rd);
    for (int i = 0; i < 3; i++) {
        assert_true(field(rc.line[i], "check") == 1.0 && field(rd.line[i], "check") == 1.0);
        assert_true(field(rc.line[i], "batch_compact") == 4 && field(rc.line[i], "slack") == 1);
        assert_true(field(rc.line[i], "repack") == 0 && field(rd.line[i], "repack") == 1);
        for (size_t k = 0; k < sizeof keys / sizeof keys[0]; k++)
            if (field(ra.line[i], keys[k]) != field(rc.line[i], keys[k]) ||
                field(ra.line[i], keys[k]) != field(rd.line[i], keys[k]))
                fail_msg("%s: %g without --batch-compact, %g with, %g with --repack", keys[k],
                         field(ra.line[i], keys[k]), field(rc.line[i], keys[k]), field(rd.line[i], keys[k]));
    }
    for (int i = 0; i < 2; i++) {
        assert_true(field(rc.line[i], "decode_switch") < 0.7 * field(ra.line[i], "decode_switch"));
        assert_true(field(rd.line[i], "decode_switch") < 0.7 * field(ra.line[i], "decode_switch"));
        assert_true(field(rd.line[i], "compacted_blocks") > field(rc.line[i], "compacted_blocks"));
    }
    /* --batch-cached: CACHED blocks move too, and stay in the index: the same schedule (prefix
       hits and evictions included); without the prefix cache (paged) there are none to move */
    char *e[] = {"pkv", "sim", SMALL, "--requests", "50", "--blocks", "300", "--seed", "9", "--batch-compact", "4",
                 "--slack", "1", "--batch-cached", NULL};
    runs re;
    sim(e, &re);
    for (int i = 0; i < 3; i++) {
        assert_true(field(re.line[i], "check") == 1.0 && field(re.line[i], "batch_cached") == 1);
        assert_true(field(rc.line[i], "batch_cached") == 0);
        for (size_t k = 0; k < sizeof keys / sizeof keys[0]; k++)
            if (field(ra.line[i], keys[k]) != field(re.line[i], keys[k]))
                fail_msg("%s: %g without --batch-compact, %g with --batch-cached", keys[k], field(ra.line[i], keys[k]),
                         field(re.line[i], keys[k]));
    }
    assert_true(field(re.line[1], "compacted_blocks") == field(rc.line[1], "compacted_blocks"));
    assert_true(field(re.line[1], "decode_switch") == field(rc.line[1], "decode_switch"));
    assert_true(field(re.line[0], "decode_switch") < 0.7 * field(ra.line[0], "decode_switch"));
    /* --compact-cached: pkv_seq_compact exchanges with CACHED blocks (none evicted): the same
       schedule, the paged run as with --compact, and the prefix run's switches below its */
    char *f[] = {"pkv", "sim", SMALL, "--requests", "50", "--blocks", "300", "--seed", "9", "--compact-cached", NULL};
    runs rf;
    sim(f, &rf);
    for (int i = 0; i < 3; i++) {
        assert_true(field(rf.line[i], "check") == 1.0);
        for (size_t k = 0; k < sizeof keys / sizeof keys[0]; k++)
            if (field(ra.line[i], keys[k]) != field(rf.line[i], keys[k]))
                fail_msg("%s: %g without --compact-cached, %g with", keys[k], field(ra.line[i], keys[k]),
                         field(rf.line[i], keys[k]));
    }
    assert_true(field(rf.line[1], "compacted_blocks") == field(rb.line[1], "compacted_blocks"));
    assert_true(field(rf.line[1], "decode_switch") == field(rb.line[1], "decode_switch"));
    assert_true(field(rf.line[0], "decode_switch") < field(rb.line[0], "decode_switch"));
    /* the pairs with a shared block are switches whatever the layout: part of them, never more */
    runs *all[] = {&ra, &rb, &rc, &rd, &re, &rf};
    for (size_t r = 0; r < sizeof all / sizeof all[0]; r++)
        for (int i = 0; i < 3; i++) {
            const double sw = field(all[r]->line[i], "decode_switch"), sh = field(all[r]->line[i], "decode_shared");
            if (!(sh >= 0 && sh <= sw)) fail_msg("decode_shared %g against decode_switch %g", sh, sw);
        }
    assert_true(field(ra.line[0], "decode_shared") > 0); /* the system prompts */
    free(ra.out), free(rb.out), free(rc.out), free(rd.out), free(re.out), free(rf.out);
}

/* A pool too small for the offered load: the paged policies preempt (recompute) and still
 * complete everything with a clean checker. */
static void test_preemption_under_pressure(void **state) {
    (void)state;
    const runs *r = pressure_run();
    assert_true(field(r->line[0], "preemptions") + field(r->line[1], "preemptions") > 0);
    for (int i = 0; i < 3; i++) {
        assert_true(field(r->line[i], "check") == 1.0);
        assert_true(field(r->line[i], "completed") == field(r->line[0], "completed"));
        assert_true(field(r->line[i], "completed") + field(r->line[i], "rejected") == 60);
        assert_true(field(r->line[i], "peak_blocks") <= 150);
    }
}

/* --preempt swap under the same pressure: the same requests complete with a clean checker, and
 * preempted single-sample requests come back from host memory (the sim reads each restored row
 * back and compares it, failing the run on a difference) instead of being recomputed, so the
 * paged policies prefill fewer tokens than with recompute. */
static void test_preempt_swap(void **state) {
    (void)state;
    char *argv_s[] = {"pkv", "sim", SMALL, PRESSURE, "--preempt", "swap", NULL};
    const runs *rr = pressure_run();
    runs rs;
    sim(argv_s, &rs);
    for (int i = 0; i < 3; i++) {
        assert_true(field(rs.line[i], "check") == 1.0);
        assert_true(field(rs.line[i], "completed") == field(rr->line[i], "completed"));
        assert_true(field(rs.line[i], "completed") + field(rs.line[i], "rejected") == 60);
        assert_true(field(rr->line[i], "swap_outs") == 0 && field(rr->line[i], "swap_in_tokens") == 0);
        assert_true(field(rs.line[i], "swap_outs") <= field(rs.line[i], "preemptions"));
    }
    for (int i = 0; i < 2; i++) { /* the paged policies */
        assert_true(field(rs.line[i], "swap_outs") > 0);
        assert_true(field(rs.line[i], "swap_in_tokens") > 0);
        assert_true(field(rs.line[i], "swap_peak_bytes") > 0);
        assert_true(field(rs.line[i], "prefill_tokens") < field(rr->line[i], "prefill_tokens"));
    }
    assert_true(field(rs.line[2], "swap_outs") == 0); /* reservation never preempts */
    free(rs.out);
}

/* --window under the same pressure: every layer sees the last 64 positions and paged and
 * paged_prefix drop the blocks before them (pkv_seq_drop_front) after each step. The same requests
 * complete with a clean checker (which checks the dropped fronts); the paged policies hold fewer
 * blocks a sequence, so they are preempted less, recompute less and run more sequences at once,
 * and paged_prefix still matches prompts (here not through dropped blocks: `pkv sim --window 256`
 * does, test_api_drop_front_indexed tests it). contiguous keeps every block, and
 * scheduling never depends on what attention computes: its counts are those of the run without a
 * window. With --preempt swap it is a usage error. */
static void test_window(void **state) {
    (void)state;
    char *argv_w[] = {"pkv", "sim", SMALL, PRESSURE, "--window", "64", NULL};
    const runs *ra = pressure_run();
    runs rw;
    sim(argv_w, &rw);
    static const char *same[] = {"completed", "preemptions", "peak_seqs", "mean_seqs", "peak_blocks", "prefill_tokens",
                                 "steps"};
    for (int i = 0; i < 3; i++) {
        assert_true(field(rw.line[i], "check") == 1.0);
        assert_true(field(rw.line[i], "window") == 64 && field(ra->line[i], "window") == 0);
        assert_true(field(rw.line[i], "completed") + field(rw.line[i], "rejected") == 60);
        assert_true(field(rw.line[i], "completed") == field(ra->line[i], "completed"));
        for (size_t k = 0; i == 2 && k < sizeof same / sizeof same[0]; k++)
            if (field(rw.line[i], same[k]) != field(ra->line[i], same[k]))
                fail_msg("policy %d: %s %g with the window, %g without", i, same[k], field(rw.line[i], same[k]),
                         field(ra->line[i], same[k]));
    }
    for (int i = 0; i < 2; i++) { /* paged_prefix and paged drop what the window passed */
        print_message("%s, window 64 / none: preemptions %g / %g, prefill tokens %g / %g, mean seqs %g / %g, "
                      "prefix hit tokens %g / %g\n",
                      i ? "paged" : "paged_prefix", field(rw.line[i], "preemptions"), field(ra->line[i], "preemptions"),
                      field(rw.line[i], "prefill_tokens"), field(ra->line[i], "prefill_tokens"),
                      field(rw.line[i], "mean_seqs"), field(ra->line[i], "mean_seqs"),
                      field(rw.line[i], "prefix_hit_tokens"), field(ra->line[i], "prefix_hit_tokens"));
        assert_true(field(rw.line[i], "preemptions") < field(ra->line[i], "preemptions"));
        assert_true(field(rw.line[i], "prefill_tokens") < field(ra->line[i], "prefill_tokens"));
        assert_true(field(rw.line[i], "mean_seqs") > field(ra->line[i], "mean_seqs"));
    }
    assert_true(field(rw.line[0], "prefix_hit_tokens") > 0); /* prompts still matched with the window */
    free(rw.out);
    char *argv_s[] = {"pkv", "sim", SMALL, "--requests", "5", "--window", "64", "--preempt", "swap", NULL}, *out, *err;
    assert_int_equal(run_cli(argv_s, &out, &err), 1);
    assert_non_null(strstr(err, "--window with --preempt swap"));
    free(out), free(err);
}

/* --turns: conversations whose later turns' prompts hold the earlier turn's prompt and output;
 * paged_prefix reuses a larger share of its prompts than without turns, and under --window the
 * windowed match (past tombstones) reuses more than a plain one (--match plain) on the same
 * requests; bad values are refused */
static void test_turns(void **state) {
    (void)state;
    char *argv1[] = {"pkv", "sim", SMALL, "--requests", "30", "--blocks", "150", "--rate", "20", "--turn-gap", "2",
                     "--seed", "4", NULL};
    char *argv3[] = {"pkv", "sim", SMALL, "--requests", "30", "--blocks", "150", "--rate", "20", "--turn-gap", "2",
                     "--seed", "4", "--turns", "3", NULL};
    char *argvw[] = {"pkv", "sim", SMALL, "--requests", "30", "--blocks", "150", "--rate", "20", "--turn-gap", "2",
                     "--seed", "4", "--turns", "3", "--window", "64", NULL};
    char *argvp[] = {"pkv", "sim", SMALL, "--requests", "30", "--blocks", "150", "--rate", "20", "--turn-gap", "2",
                     "--seed", "4", "--turns", "3", "--window", "64", "--match", "plain", NULL};
    /* the same under the window with a host tier: its loads under the window too, or plain */
    char *argvt[] = {"pkv", "sim", SMALL, "--requests", "30", "--blocks", "150", "--rate", "20", "--turn-gap", "2",
                     "--seed", "4", "--turns", "3", "--window", "64", "--tier", "host:8", NULL};
    char *argvtp[] = {"pkv", "sim", SMALL, "--requests", "30", "--blocks", "150", "--rate", "20", "--turn-gap", "2",
                      "--seed", "4", "--turns", "3", "--window", "64", "--tier", "host:8", "--match", "plain", NULL};
    runs r1, r3, rw, rp, rt, rtp;
    sim(argv1, &r1), sim(argv3, &r3), sim(argvw, &rw), sim(argvp, &rp), sim(argvt, &rt), sim(argvtp, &rtp);
    const double n = field(r3.line[0], "requests");
    assert_true(field(r1.line[0], "requests") == 30 && n > 30 && n <= 90);
    for (int i = 0; i < 3; i++) {
        assert_true(field(r3.line[i], "check") == 1.0 && field(rw.line[i], "check") == 1.0);
        assert_true(field(r3.line[i], "completed") + field(r3.line[i], "rejected") == n);
    }
    const double h1 = field(r1.line[0], "prefix_hit_tokens"), h3 = field(r3.line[0], "prefix_hit_tokens");
    const double hw = field(rw.line[0], "prefix_hit_tokens"), hp = field(rp.line[0], "prefix_hit_tokens");
    print_message("turns: %g requests; prefix hit tokens %g without turns, %g with; window 64: %g matched under the "
                  "window (%g matches through a tombstone), %g plainly\n",
                  n, h1, h3, hw, field(rw.line[0], "tomb_hits"), hp);
    assert_true(h3 > h1);
    assert_true(hw > hp && field(rw.line[0], "tomb_hits") > 0 && field(rp.line[0], "tomb_hits") == 0);
    /* with the tier: fronts dropped and saved, restored under the window (pkv_tier_load_window) */
    const double pw = field(rw.line[0], "prefill_tokens"), pt = field(rt.line[0], "prefill_tokens"),
                 ptp = field(rtp.line[0], "prefill_tokens");
    print_message("turns, window 64: prefill tokens %g without a tier, %g with one (%g positions from it), %g with "
                  "it and plain matches and loads\n",
                  pw, pt, field(rt.line[0], "tier_hit_tokens"), ptp);
    assert_true(field(rt.line[0], "check") == 1.0 && field(rtp.line[0], "check") == 1.0);
    assert_true(field(rt.line[0], "tier_hit_tokens") > 0 && field(rt.line[0], "tier_saved_blocks") > 0);
    assert_true(pt < pw && pt < ptp);
    free(r1.out), free(r3.out), free(rw.out), free(rp.out), free(rt.out), free(rtp.out);
    static const char *bad[][2] = {{"--turns", "0"}, {"--turn-gap", "-1"}, {"--turn-mean", "0"}, {"--match", "all"}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char *argv[] = {"pkv", "sim", (char *)bad[i][0], (char *)bad[i][1], NULL}, *out, *err;
        assert_int_equal(run_cli(argv, &out, &err), 1);
        free(out), free(err);
    }
}

/* --tier: paged_prefix loads from a host (or file) tier what its pool evicted, so it prefills
 * fewer tokens and preempts less; the other policies do not use it; bad values are refused */
static void test_tier(void **state) {
    (void)state;
    char dir[] = "/tmp/pkv-sim-tier-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char file_opt[128];
    snprintf(file_opt, sizeof file_opt, "file:%s/t:8", dir);
    char *argv_h[] = {"pkv", "sim", SMALL, PRESSURE, "--tier", "host:8", NULL};
    char *argv_f[] = {"pkv", "sim", SMALL, PRESSURE, "--tier", file_opt, NULL};
    const runs *rr = pressure_run();
    runs rh, rf;
    sim(argv_h, &rh);
    sim(argv_f, &rf);
    for (int i = 0; i < 3; i++) {
        assert_true(field(rh.line[i], "check") == 1.0 && field(rf.line[i], "check") == 1.0);
        assert_true(field(rh.line[i], "completed") == field(rr->line[i], "completed"));
        assert_true(field(rr->line[i], "tier_hit_tokens") == 0);
    }
    assert_true(field(rh.line[0], "tier_hit_tokens") > 0);
    assert_true(field(rh.line[0], "tier_saved_blocks") > 0);
    assert_true(field(rh.line[0], "prefill_tokens") < field(rr->line[0], "prefill_tokens"));
    /* the file tier holds the same entries: the same run, the same counts */
    assert_true(field(rf.line[0], "tier_hit_tokens") == field(rh.line[0], "tier_hit_tokens"));
    assert_true(field(rf.line[0], "prefill_tokens") == field(rh.line[0], "prefill_tokens"));
    for (int i = 1; i < 3; i++) /* paged and contiguous: no tier */
        assert_true(field(rh.line[i], "tier_hit_tokens") == 0 && field(rh.line[i], "tier_saved_blocks") == 0 &&
                    field(rh.line[i], "prefill_tokens") == field(rr->line[i], "prefill_tokens"));
    free(rh.out), free(rf.out);
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    assert_int_equal(system(cmd), 0);
    const char *bad[] = {"host:0", "host:", "host", "file::8", "file:/tmp", "disk:/tmp:8", "host:-1", "host:x"};
    for (size_t k = 0; k < sizeof bad / sizeof *bad; k++) {
        char *argv[] = {"pkv", "sim", SMALL, "--requests", "5", "--tier", (char *)bad[k], NULL}, *out, *err;
        assert_int_equal(run_cli(argv, &out, &err), 1); /* TOOL_USAGE */
        assert_non_null(strstr(err, "--tier"));
        free(out), free(err);
    }
}

static const char *write_file(const char *text) {
    static char path[64];
    snprintf(path, sizeof path, "/tmp/pkv-trace-XXXXXX");
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, text, strlen(text)), (ssize_t)strlen(text));
    close(fd);
    return path;
}

static void test_trace_replay(void **state) {
    (void)state;
    /* three explicit prompts sharing 40 tokens, two group-prefix requests, one n=2 */
    char text[8192];
    size_t n = 0;
    for (int r = 0; r < 3; r++) {
        n += (size_t)snprintf(text + n, sizeof text - n, "{\"arrival\": %d.5, \"prompt\": [1", r);
        for (int i = 1; i < 48; i++) n += (size_t)snprintf(text + n, sizeof text - n, ", %d", i < 40 ? 100 + i : 1000 * (r + 1) + i);
        n += (size_t)snprintf(text + n, sizeof text - n, "], \"max_tokens\": %d, \"note\": {\"x\": [1, \"y\"]}}\n", 10 + r);
    }
    n += (size_t)snprintf(text + n, sizeof text - n,
                          "\n{\"arrival\": 0.1, \"prompt_len\": 90, \"prefix_group\": 7, \"prefix_len\": 64, \"max_tokens\": 5}\n"
                          "  {\"prefix_group\": 7, \"prompt_len\": 70, \"arrival\": 3, \"max_tokens\": 20, \"n\": 2}\r\n");
    const char *path = write_file(text);
    char *argv[] = {"pkv", "sim", SMALL, "--blocks", "200", "--trace", (char *)path, NULL};
    runs r;
    sim(argv, &r);
    for (int i = 0; i < 3; i++) {
        assert_true(field(r.line[i], "requests") == 5);
        assert_true(field(r.line[i], "completed") == 5);
        assert_true(field(r.line[i], "check") == 1.0);
        /* 10+11+12 + 5 + 2*20 tokens, the first of each sample from the prefill */
        assert_true(field(r.line[i], "decode_tokens") == (10 + 11 + 12 + 5 + 40) - 6);
    }
    assert_true(field(r.line[0], "prefix_hit_tokens") >= 32); /* later prompts reuse the shared 40 */
    free(r.out);
    unlink(path);
}

/* A group's prefix without "prefix_len" is --sys-len tokens, cut to the prompt: two 40-token
 * prompts of group 3 under --sys-len 64 are the same 40 tokens, so the later one reuses the
 * earlier one's two full 16-token blocks (its third block holds output tokens); a third prompt,
 * of group 4, shares nothing with them. */
static void test_trace_group_shorter_than_sys_len(void **state) {
    (void)state;
    const char *path = write_file("{\"arrival\": 0, \"prompt_len\": 40, \"prefix_group\": 3, \"max_tokens\": 4}\n"
                                  "{\"arrival\": 5, \"prompt_len\": 40, \"prefix_group\": 3, \"max_tokens\": 4}\n"
                                  "{\"arrival\": 9, \"prompt_len\": 40, \"prefix_group\": 4, \"max_tokens\": 4}\n");
    char *argv[] = {"pkv", "sim", SMALL, "--blocks", "64", "--trace", (char *)path, NULL};
    runs r;
    sim(argv, &r);
    assert_true(field(r.line[0], "completed") == 3);
    assert_true(field(r.line[0], "check") == 1.0);
    assert_true(field(r.line[0], "prompt_tokens") == 120);
    assert_true(field(r.line[0], "prefix_hit_tokens") == 32);
    free(r.out);
    unlink(path);
}

static void test_malformed_trace_names_line(void **state) {
    (void)state;
    const char *good = "{\"arrival\": 0, \"prompt_len\": 10, \"max_tokens\": 4}\n";
    struct { const char *bad; const char *want; } cases[] = {
        {"{\"arrival\": 1, \"prompt_len\": 10}\n", "missing \"max_tokens\""},
        {"{\"arrival\": 1, \"prompt_len\": 10, \"max_tokens\": 4\n", "expected ',' or '}'"},
        {"{\"arrival\": 1, \"prompt\": [1, 2, x], \"max_tokens\": 4}\n", "expected a number"},
        {"{\"arrival\": 1, \"prompt_len\": 2.5, \"max_tokens\": 4}\n", "prompt_len must be an integer"},
        {"{\"arrival\": -1, \"prompt_len\": 2, \"max_tokens\": 4}\n", "arrival must be >= 0"},
        {"[1, 2]\n", "expected a JSON object"},
        {"{\"arrival\": 1, \"prompt\": 5, \"max_tokens\": 4}\n", "prompt must be an array"},
        {"{\"arrival\": 1, \"prompt_len\": 10, \"max_tokens\": 4} x\n", "trailing characters"},
        {"{\"arrival\": 1, \"prompt_len\": 9999, \"max_tokens\": 4}\n", "does not fit --max-len"},
        {"{\"arrival\": 1, \"prompt_len\": 10, \"prefix_group\": 0, \"prefix_len\": 11, \"max_tokens\": 4}\n",
         "prefix_len 11 is over prompt_len 10"},
        /* a step count a double cannot hold exactly (the cast was undefined past 2^64) */
        {"{\"arrival\": 4e17, \"prompt_len\": 10, \"max_tokens\": 4}\n", "past 2^53 steps"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char text[512];
        snprintf(text, sizeof text, "%s\n%s%s", good, cases[i].bad, good); /* the bad one is line 3 */
        const char *path = write_file(text);
        char *argv[] = {"pkv", "sim", SMALL, "--trace", (char *)path, NULL};
        char *out, *err;
        int rc = run_cli(argv, &out, &err);
        char where[128];
        snprintf(where, sizeof where, "%s:3: ", path);
        if (rc != 2 || !strstr(err, where) || !strstr(err, cases[i].want))
            fail_msg("case %zu: exit %d, stderr '%s' (want 2, '%s%s')", i, rc, err, where, cases[i].want);
        assert_string_equal(out, "");
        free(out), free(err);
        unlink(path);
    }
    char *argv[] = {"pkv", "sim", "--trace", "/nonexistent/trace.jsonl", NULL};
    char *err;
    assert_int_equal(run_cli(argv, NULL, &err), 2);
    assert_non_null(strstr(err, "cannot open trace"));
    free(err);
}

static void test_help_and_usage_errors(void **state) {
    (void)state;
    char *h[] = {"pkv", "sim", "--help", NULL};
    char *out;
    assert_int_equal(run_cli(h, &out, NULL), 0);
    static const char *opts[] = {"--requests", "--rate", "--trace", "--blocks", "--block-tokens", "--no-attn", "--json",
                                 "--plot", "--policies", "--seed", "--step-tokens", "--max-seqs", "--preempt", "requests [100]",
                                 "--spin-us"};
    for (size_t i = 0; i < sizeof opts / sizeof opts[0]; i++)
        if (!strstr(out, opts[i])) fail_msg("--help does not mention %s", opts[i]);
    free(out);
    char *bad[][5] = {{"pkv", "sim", "--policies", "paged,bogus", NULL},
                      {"pkv", "sim", "--blocks", "0", NULL},
                      {"pkv", "sim", "--preempt", "swapp", NULL},
                      {"pkv", "sim", "--frobnicate", NULL},
                      {"pkv", "sim", "--requests", NULL},
                      {"pkv", "sim", "--q-heads", "3", NULL},
                      /* non-finite or out-of-range values, which went on as NaN, 0 or a wrapped count */
                      {"pkv", "sim", "--headroom", "inf", NULL},
                      {"pkv", "sim", "--headroom", "1e300", NULL},
                      {"pkv", "sim", "--prompt-sigma", "inf", NULL},
                      {"pkv", "sim", "--rate", "nan", NULL},
                      {"pkv", "sim", "--max-len", "4294967295", NULL},
                      {"pkv", "sim", "--sys-prompts", "2147483648", NULL}, /* a group id past int32 meant none */
                      {"pkv", "sim", "--step-ms", "1e-300", NULL},
                      /* strtoull took "-1" as 2^64 - 1 */
                      {"pkv", "sim", "--seed", "-1", NULL},
                      {"pkv", "sim", "--seed", "18446744073709551616", NULL},
                      /* the name goes into gnuplot's script between single quotes */
                      {"pkv", "sim", "--plot", "/tmp/x.png'; system 'true", NULL},
                      {"pkv", "sim", "--plot", "/tmp/x\n.png", NULL},
                      {"pkv", "sim", "--plot", "", NULL},
                      {"pkv", "sim", "--spin-us", "1000001", NULL}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char *err;
        int rc = run_cli(bad[i], NULL, &err);
        if (rc != 1) fail_msg("case %zu: exit %d (want 1): %s", i, rc, err);
        free(err);
    }
    /* what the message says: an unknown name placed last is unknown, not short of a value */
    struct { /* writable: run_cli puts the binary's path in argv[0] */
        char *argv[7];
        const char *says;
    } said[] = {{{"pkv", "sim", "--no-atn", NULL}, "unknown option '--no-atn'"},
                {{"pkv", "sim", "extra", NULL}, "unknown option 'extra'"},
                {{"pkv", "sim", "--frobnicate", "5", NULL}, "unknown option '--frobnicate'"},
                {{"pkv", "sim", "--requests", NULL}, "--requests needs a value"},
                {{"pkv", "sim", "--dtype", "q8_0", "--head-dim", "48", NULL},
                 "--dtype q8_0 needs --head-dim a multiple of 32"}};
    for (size_t i = 0; i < sizeof said / sizeof said[0]; i++) {
        char *e;
        int rc = run_cli(said[i].argv, NULL, &e);
        if (rc != 1 || !strstr(e, said[i].says))
            fail_msg("case %zu: exit %d, \"%s\" (want 1, \"%s\")", i, rc, e, said[i].says);
        free(e);
    }
    /* a system prompt near 2^32 tokens is clamped to max-len - 1 (its sum with the own part wrapped) */
    char *big[] = {"pkv", "sim", "--sys-len", "4294967295", "--sys-frac", "1", "--requests", "10", "--no-attn",
                   "--no-progress", "--max-len", "2048", NULL};
    char *err;
    assert_int_equal(run_cli(big, &out, &err), 0);
    if (!strstr(out, "prompt mean 2047,")) fail_msg("prompts not clamped to max-len: %s", out);
    free(out), free(err);
}

static void test_plot_writes_png(void **state) {
    (void)state;
    if (system("command -v gnuplot >/dev/null 2>&1") != 0) {
        skip();
        return;
    }
    char png[] = "/tmp/pkv-sim-plot-XXXXXX";
    int fd = mkstemp(png);
    close(fd);
    char *argv[] = {"pkv", "sim", SMALL, "--requests", "20", "--blocks", "300", "--no-attn", "--plot", png, NULL};
    char *out, *err;
    int rc = run_cli(argv, &out, &err);
    if (rc != 0) fail_msg("exit %d: %s", rc, err);
    FILE *f = fopen(png, "rb");
    assert_non_null(f);
    unsigned char magic[8] = {0};
    assert_int_equal(fread(magic, 1, 8, f), 8);
    fclose(f);
    assert_memory_equal(magic, "\x89PNG\r\n\x1a\n", 8);
    free(out), free(err);
    unlink(png);
    /* a name that cannot be written fails before the run, not after it */
    char *nowhere[] = {"pkv", "sim", SMALL, "--no-attn", "--plot", "/nonexistent-dir/x.png", NULL};
    assert_int_equal(run_cli(nowhere, &out, &err), 2);
    if (!strstr(err, "cannot write '/nonexistent-dir/x.png'") || *out) fail_msg("out '%s', err '%s'", out, err);
    free(out), free(err);
    /* a run that fails leaves an existing file as it was, and the trace is never the plot */
    const char *kept = write_file("precious");
    char *failing[] = {"pkv", "sim", "--plot", (char *)kept, "--trace", "/nonexistent/trace.jsonl", NULL};
    assert_int_equal(run_cli(failing, &out, &err), 2);
    free(out), free(err);
    char buf[16] = {0};
    FILE *kf = fopen(kept, "rb");
    assert_non_null(kf);
    assert_int_equal(fread(buf, 1, sizeof buf - 1, kf), 8);
    fclose(kf);
    assert_string_equal(buf, "precious");
    char *same[] = {"pkv", "sim", "--trace", (char *)kept, "--plot", (char *)kept, NULL};
    assert_int_equal(run_cli(same, &out, &err), 1);
    if (!strstr(err, "is the trace file")) fail_msg("err '%s'", err);
    free(out), free(err);
    unlink(kept);
}

/* `pkv route`: the router's predictions from events alone are exact while it drains them after
 * every request; KV-aware routing reuses more than round robin on the same requests; bounded
 * loads keep every replica busy; a stale router (events taken rarely, through a small ring)
 * resyncs from snapshots and still routes; bad options are refused. */
static void test_route(void **state) {
    (void)state;
    char *argv[] = {"pkv", "route", "--json", "--chats", "48", "--active", "16", "--turns", "4", "--replicas", "4",
                    "--blocks", "128", "--sys-len", "128", "--user-mean", "40", "--reply-mean", "60", NULL};
    char *out, *err;
    int rc = run_cli(argv, &out, &err);
    if (rc != 0) fail_msg("pkv route exited %d: %s", rc, err);
    static const char *names[3] = {"round_robin", "prefix", "prefix_bounded"};
    double hit[3] = {0}, req_min[3] = {0};
    int n = 0;
    for (char *save = NULL, *line = strtok_r(out, "\n", &save); line; line = strtok_r(NULL, "\n", &save), n++) {
        assert_true(n < 3);
        char pat[64];
        snprintf(pat, sizeof pat, "\"policy\":\"%s\"", names[n]);
        assert_non_null(strstr(line, pat));
        assert_int_equal((int)field(line, "requests"), 48 * 4);
        assert_int_equal(field(line, "predicted_exact"), field(line, "predicted"));
        assert_int_equal((int)field(line, "overflows"), 0);
        const double prompt = field(line, "prompt_tokens"), reused = field(line, "reused_tokens");
        assert_true(fabs(field(line, "hit_rate") - reused / prompt) < 1e-4);
        assert_true(reused <= prompt && field(line, "events") > 0);
        hit[n] = field(line, "hit_rate");
        req_min[n] = field(line, "req_min");
    }
    assert_int_equal(n, 3);
    assert_true(hit[1] > hit[0] + 0.1 && hit[2] > hit[0] + 0.1);
    assert_true(req_min[0] == 48 && req_min[2] > 0);
    free(out), free(err);
    /* events taken every 50 requests through a ring of 64: overflows, resynced */
    char *stale[] = {"pkv", "route", "--json", "--chats", "48", "--active", "16", "--turns", "4", "--replicas", "4",
                     "--blocks", "128", "--sys-len", "128", "--user-mean", "40", "--reply-mean", "60", "--drain", "50",
                     "--events", "64", "--policies", "prefix_bounded", NULL};
    rc = run_cli(stale, &out, &err);
    if (rc != 0) fail_msg("pkv route exited %d: %s", rc, err);
    assert_true(field(out, "overflows") > 0);
    assert_true(field(out, "predicted_exact") < field(out, "predicted"));
    assert_true(field(out, "hit_rate") > hit[0]);
    free(out), free(err);
    char *bad[][5] = {{"pkv", "route", "--replicas", "0", NULL},
                      {"pkv", "route", "--policies", "prefix,prefix", NULL},
                      {"pkv", "route", "--balance", "nan", NULL},
                      {"pkv", "route", "--drain", NULL},
                      {"pkv", "route", "--bogus", "1", NULL}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(run_cli(bad[i], &out, &err), 1);
        assert_true(strlen(err) > 0);
        free(out), free(err);
    }
    /* a pool smaller than one chat: a runtime error that says what to change */
    char *tiny[] = {"pkv", "route", "--blocks", "8", NULL};
    assert_int_equal(run_cli(tiny, &out, &err), 2);
    assert_non_null(strstr(err, "--blocks"));
    free(out), free(err);
    char *help[] = {"pkv", "route", "--help", NULL};
    assert_int_equal(run_cli(help, &out, NULL), 0);
    assert_non_null(strstr(out, "prefix_bounded"));
    free(out);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_policies_complete_same_requests),
        cmocka_unit_test(test_deterministic_and_attn_independent),
        cmocka_unit_test(test_shared_keys),
        cmocka_unit_test(test_compact_keeps_schedule),
        cmocka_unit_test(test_preemption_under_pressure),
        cmocka_unit_test(test_preempt_swap),
        cmocka_unit_test(test_tier),
        cmocka_unit_test(test_trace_replay),
        cmocka_unit_test(test_trace_group_shorter_than_sys_len),
        cmocka_unit_test(test_malformed_trace_names_line),
        cmocka_unit_test(test_help_and_usage_errors),
        cmocka_unit_test(test_plot_writes_png),
        cmocka_unit_test(test_route),
        cmocka_unit_test(test_window),
        cmocka_unit_test(test_turns),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
