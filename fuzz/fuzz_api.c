/* fuzz_api.c: libFuzzer target: decodes the input into pagedkv API calls (create with salts,
 * append + write, commit, match, fork, truncate, release, pin, unpin, attention decode and
 * prefill, bad calls) against a small cache and the shadow model of prefix_model.h; checks the
 * cache after every call and each attention result against the model's reference.
 *
 * Input: byte 0 picks block size, dtypes and layers, byte 1 the pool size, byte 2 whether the
 * prefix cache is on (0xff: off) and, bit 2, whether attention reads in pool order
 * (PKV_ATTN_ORDER=pool, else auto), bit 3, whether a tier stands behind the cache (pm_tier_on:
 * saves and loads among the calls), bit 4, whether the tier's thread runs (prefetches before
 * loads, saves written back) and, bit 5, whether it keeps files (in a new /tmp/pkvfuzz-XXXXXX,
 * removed after each input) rather than host memory, and, bit 6, whether context shifts
 * (pkv_seq_shift) are among the calls; the rest is the call script (pm_step).
 * Any disagreement with the model or a failing pkv_cache_check aborts (a finding); no input may
 * crash the library. */
#include "prefix_model.h"

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static pm_world g_world; /* large scratch: keep it off the stack */

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 3) return 0;
    pm_src src = {.p = data + 3, .n = size - 3};
    pkv_config cfg = pm_config(data[0], data[1], data[2] == 0xff);
    pm_world *w = &g_world;
    if (setenv("PKV_ATTN_ORDER", data[2] & 4 ? "pool" : "auto", 1) != 0) abort();
    if (pm_init(w, &cfg, 0x5eed + (data[2] & 3)) < 0) {
        fprintf(stderr, "fuzz_api: %s\n", w->err);
        abort();
    }
    char dir[64] = "";
    if (data[2] != 0xff && (data[2] & 8) && (data[2] & 32)) { /* a new one: one left by an input killed on the way
                                                                  would hold entries never saved here */
        snprintf(dir, sizeof dir, "/tmp/pkvfuzz-XXXXXX");
        if (!mkdtemp(dir)) abort();
    }
    if (data[2] != 0xff && (data[2] & 8) && pm_tier_on(w, data[2] & 16, dir[0] ? dir : NULL) < 0) {
        fprintf(stderr, "fuzz_api: %s\n", w->err);
        abort();
    }
    w->shift_on = data[2] != 0xff && (data[2] & 64);
    w->trace = getenv("PM_TRACE") && atoi(getenv("PM_TRACE")); /* each step said, to follow a crash */
    int bad = 0;
    for (int steps = 0; steps < 400 && !src.done; steps++) {
        if (pm_step(w, &src) < 0) {
            bad = 1;
            break;
        }
    }
    if (!bad) {
        /* releasing everything leaves only FREE and CACHED blocks, and a reset only FREE ones */
        for (int i = 0; i < PM_MAX_SEQS && !bad; i++) {
            pm_seq *q = &w->s[i];
            if (!q->live) continue;
            int rc = q->is_pin ? pkv_pin_release(w->c, q->id) : pkv_seq_release(w->c, q->id);
            if (rc != 0) {
                pm_fail(w, "final release: %s", pkv_strerror(rc));
                bad = 1;
            }
            q->live = 0;
        }
        pkv_stats st;
        if (!bad && (pm_verify(w) < 0 || pkv_cache_get_stats(w->c, &st) < 0 || st.n_active != 0)) {
            if (!w->err[0]) pm_fail(w, "%u blocks active after releasing everything", st.n_active);
            bad = 1;
        }
        if (!bad && (pkv_cache_reset(w->c) != 0 || pkv_cache_get_stats(w->c, &st) < 0 ||
                     st.n_free != st.n_blocks || st.n_indexed != 0)) {
            pm_fail(w, "reset left %u of %u blocks free, %llu indexed", st.n_free, st.n_blocks,
                    (unsigned long long)st.n_indexed);
            bad = 1;
        }
    }
    if (bad) {
        fprintf(stderr, "fuzz_api: B=%u k=%s v=%s layers=%u n_blocks=%u prefix=%d: %s\n", cfg.block_tokens,
                pkv_dtype_name(cfg.k_dtype), pkv_dtype_name(cfg.v_dtype), cfg.n_layers, cfg.n_blocks,
                cfg.enable_prefix_cache, w->err);
        abort();
    }
    pm_fini(w);
    return 0;
}
