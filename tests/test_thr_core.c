/* test_thr_core.c: several pthreads hammer one cache (create, append, write K/V, commit, fork,
 * CoW, truncate, batch append, gather, prefix match, compaction, release) on their own
 * sequences plus forks of shared parents that are only read (forks, gathers and decodes of them
 * from every thread at once: reads of one sequence may overlap); every thread verifies its
 * data; at the end the checker passes and the shared parents are intact. Runs under ThreadSanitizer in CI (label "thread"). */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include "support_util.h"
#include "cache/cache_int.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { NTHR = 4, NPARENT = 3, PARENT_LEN = 10, B = 4, LAYERS = 2, KVH = 2, HD = 8, QH = 4 };
enum { DEC_N = NPARENT * QH * HD }; /* one decode of the parents: their queries or outputs */

typedef struct {
    pkv_cache *c;
    pkv_seq parents[NPARENT];
    int32_t parent_tok[NPARENT][PARENT_LEN];
    const float *q, *want; /* the parents' queries; their decode by layer, computed before the threads */
    int tid;
    uint32_t iters;
    long errors;
    long enospc;
    uint32_t shift_every; /* iterations a fork is shifted: one in shift_every */
    long ok_iters, match_hits, moved, front_hits, window_matches, shifts;
    char first_error[200];
} targ;

#define TFAIL(a, ...)                                                                                                \
    do {                                                                                                             \
        if (!(a)->errors++) snprintf((a)->first_error, sizeof (a)->first_error, __VA_ARGS__);                        \
        goto done;                                                                                                   \
    } while (0)
#define TCALL(a, expr)                                                                                               \
    do {                                                                                                             \
        int rc_ = (expr);                                                                                            \
        if (rc_ == PKV_ENOSPC) {                                                                                     \
            (a)->enospc++;                                                                                           \
            goto done;                                                                                               \
        }                                                                                                            \
        if (rc_) TFAIL(a, "thread %d: %s -> %s", (a)->tid, #expr, pkv_strerror(rc_));                               \
    } while (0)

/* Whether h's first len positions are what a shift of [from, from + d) left of the pattern
 * written before it (tag below n, tag2 from n on, then removed and moved down): V and, where
 * rope turned K's values [HD / 2, HD), K's values [0, HD / 2) bit for bit; with no rope all of K.
 * 0, or -1. */
static int check_shifted_len(pkv_cache *c, pkv_seq h, uint32_t len, uint32_t from, uint32_t d, uint32_t n,
                             uint32_t tag, uint32_t tag2, int turned) {
    enum { ROW = KVH * HD };
    float *k = malloc(sizeof(float) * ROW * (len + 1)), *v = malloc(sizeof(float) * ROW * (len + 1));
    int rc = k && v ? 0 : -1;
    for (uint32_t l = 0; !rc && l < LAYERS; l++) {
        if (pkv_seq_gather(c, h, l, 0, len, k, v)) rc = -1;
        for (uint32_t p = 0; !rc && p < len; p++) {
            const uint32_t src = p < from ? p : p + d, t = src < n ? tag : tag2;
            for (uint32_t e = 0; e < ROW; e++) {
                if (v[p * ROW + e] != tu_pat(t, l, src, e, 1)) rc = -1;
                if ((!turned || e % HD < HD / 2) && k[p * ROW + e] != tu_pat(t, l, src, e, 0)) rc = -1;
            }
        }
    }
    free(k);
    free(v);
    return rc;
}

static void *worker(void *p) {
    targ *a = p;
    pkv_cache *c = a->c;
    tu_rng r;
    tu_rng_seed(&r, 777 + (uint64_t)a->tid);
    int32_t toks[64];
    for (uint32_t it = 0; it < a->iters && a->errors == 0; it++) {
        pkv_seq s = 0, f = 0, g = 0, m = 0;
        uint32_t tag = (uint32_t)(a->tid * 100000 + (int)it * 4);
        uint32_t n = 1 + tu_rng_below(&r, 20);
        for (uint32_t i = 0; i < n + 8; i++) toks[i] = (int32_t)(tag * 64 + i); /* private tokens */
        TCALL(a, pkv_seq_create(c, NULL, 0, &s));
        TCALL(a, pkv_seq_append(c, s, toks, n, NULL));
        TCALL(a, tu_write_pattern(c, s, 0, n, tag));
        TCALL(a, pkv_seq_commit(c, s, n));
        /* fork and grow the fork: copy-on-write of a partly filled tail */
        TCALL(a, pkv_seq_fork(c, s, &f));
        uint32_t extra = 1 + tu_rng_below(&r, 6);
        TCALL(a, pkv_seq_append(c, f, toks + n, extra, NULL));
        TCALL(a, tu_write_pattern(c, f, n, extra, tag + 1));
        if (tu_cmp_pattern(c, f, 0, n, tag) != 0) TFAIL(a, "thread %d: fork lost the parent's K/V", a->tid);
        if (tu_cmp_pattern(c, f, n, extra, tag + 1) != 0) TFAIL(a, "thread %d: fork's own K/V wrong", a->tid);
        if (tu_cmp_pattern(c, s, 0, n, tag) != 0) TFAIL(a, "thread %d: parent changed by its fork", a->tid);
        if (it % a->shift_every == 0) { /* a context shift of a fork of s (its blocks shared with s: copied first), with a rope
             over half of each K row or none, while the others work: the rows move without the
             cache's lock (pkv_seq_shift), and s keeps its own. Out of blocks (the small pool),
             the iteration goes on without it; there, one iteration in four shifts, so that the
             others still reach the matches below. */
            pkv_seq h = 0;
            const uint32_t more = 1 + tu_rng_below(&r, 8), len0 = n + more;
            const uint32_t from = tu_rng_below(&r, len0), d = 1 + tu_rng_below(&r, len0 - from);
            const int turned = (int)tu_rng_below(&r, 2);
            const pkv_rope rope = {.dim0 = HD / 2, .n_rot = HD / 2, .style = PKV_ROPE_NEOX, .theta = 10000.0f};
            int rc = pkv_seq_fork(c, s, &h);
            if (!rc) rc = pkv_seq_append(c, h, toks + n, more, NULL);
            if (!rc) rc = tu_write_pattern(c, h, n, more, tag + 5);
            if (!rc) rc = pkv_seq_shift(c, h, from, from + d, turned ? &rope : NULL);
            if (!rc && check_shifted_len(c, h, len0 - d, from, d, n, tag, tag + 5, turned)) rc = PKV_ECORRUPT;
            a->shifts += rc == PKV_OK;
            if (h && pkv_seq_release(c, h) && !rc) rc = PKV_EINVAL;
            if (rc == PKV_ENOSPC) a->enospc++;
            else if (rc) TFAIL(a, "thread %d: a shifted fork (from %u, d %u): %s", a->tid, from, d, pkv_strerror(rc));
            if (tu_cmp_pattern(c, s, 0, n, tag) != 0) TFAIL(a, "thread %d: a fork's shift changed s", a->tid);
        }
        /* truncate and rewrite the fork */
        uint32_t keep = n + tu_rng_below(&r, extra);
        TCALL(a, pkv_seq_truncate(c, f, keep));
        TCALL(a, pkv_seq_append(c, f, toks + keep, 2, NULL));
        TCALL(a, tu_write_pattern(c, f, keep, 2, tag + 2));
        if (tu_cmp_pattern(c, f, keep, 2, tag + 2) != 0 || tu_cmp_pattern(c, f, 0, n, tag) != 0)
            TFAIL(a, "thread %d: truncate + rewrite wrong", a->tid);
        /* a fork of a shared parent that every thread reads */
        int k = (int)tu_rng_below(&r, NPARENT);
        TCALL(a, pkv_seq_fork(c, a->parents[k], &g));
        { /* in a batch (copy-on-write of the shared tail inside it) with an empty request */
            const pkv_append_req rq[2] = {{g, toks, 3, NULL}, {s, NULL, 0, NULL}};
            uint32_t done;
            TCALL(a, pkv_batch_append(c, rq, 2, 0, &done));
            if (done != 2) TFAIL(a, "thread %d: batch append did %u of 2", a->tid, done);
        }
        TCALL(a, tu_write_pattern(c, g, PARENT_LEN, 3, tag + 3));
        if (tu_cmp_pattern(c, g, 0, PARENT_LEN, 9000 + (uint32_t)k) != 0)
            TFAIL(a, "thread %d: fork of shared parent %d has wrong K/V", a->tid, k);
        if (tu_cmp_pattern(c, g, PARENT_LEN, 3, tag + 3) != 0)
            TFAIL(a, "thread %d: K/V appended to a shared parent's fork wrong", a->tid);
        /* every thread decodes the shared parents while the others fork, gather and decode them:
           the same bits as before the threads started */
        {
            float out[DEC_N];
            const uint32_t layer = it % LAYERS;
            pkv_attn_params ap = pkv_attn_params_default();
            ap.n_q_heads = QH;
            TCALL(a, pkv_attn_decode(c, layer, a->parents, NPARENT, a->q, out, &ap));
            if (memcmp(out, a->want + layer * DEC_N, sizeof out) != 0)
                TFAIL(a, "thread %d: decode of the shared parents changed (layer %u)", a->tid, layer);
        }
        { /* a fork of a shared parent drops its front (indexed blocks, in the prefix-caching
             runs) while the others decode the parent: a decode whose window starts past the
             front reads the same blocks as the parent's, the same bits */
            pkv_seq d = 0;
            TCALL(a, pkv_seq_fork(c, a->parents[k], &d));
            const uint32_t front = tu_rng_below(&r, PARENT_LEN);
            TCALL(a, pkv_seq_drop_front(c, d, front));
            pkv_attn_params ap = pkv_attn_params_default();
            ap.n_q_heads = QH, ap.window = PARENT_LEN - front / B * B; /* the query at PARENT_LEN - 1 sees the front on */
            float od[QH * HD], op[QH * HD]; /* one sequence's */
            TCALL(a, pkv_attn_decode(c, it % LAYERS, &d, 1, a->q, od, &ap));
            TCALL(a, pkv_attn_decode(c, it % LAYERS, &a->parents[k], 1, a->q, op, &ap));
            if (memcmp(od, op, sizeof od) != 0) TFAIL(a, "thread %d: decode past a dropped front differs", a->tid);
            TCALL(a, pkv_seq_release(c, d));
        }
        /* compaction of this thread's sequences while the others work (the shared parents'
           blocks never move): their K/V stays */
        uint32_t moved = 0;
        TCALL(a, pkv_seq_compact(c, g, tu_rng_below(&r, 4) /* EVICT, CACHED */, &moved));
        a->moved += moved;
        TCALL(a, pkv_seq_compact(c, f, 0, &moved));
        a->moved += moved;
        const pkv_seq mine[2] = {f, g};
        TCALL(a, pkv_batch_compact(c, mine, 2, 1, (uint32_t)it % 4u /* REPACK, CACHED */, &moved));
        a->moved += moved;
        if (tu_cmp_pattern(c, g, 0, PARENT_LEN, 9000 + (uint32_t)k) != 0 ||
            tu_cmp_pattern(c, g, PARENT_LEN, 3, tag + 3) != 0 || tu_cmp_pattern(c, f, 0, n, tag) != 0 ||
            tu_cmp_pattern(c, f, keep, 2, tag + 2) != 0)
            TFAIL(a, "thread %d: K/V changed by compaction", a->tid);
        /* a prefix match against the shared parents' committed blocks */
        TCALL(a, pkv_seq_create(c, NULL, 0, &m));
        uint32_t reused = 0;
        TCALL(a, pkv_seq_match_prefix(c, m, a->parent_tok[k], PARENT_LEN, &reused));
        if (reused > PARENT_LEN - 1) TFAIL(a, "thread %d: match reused too much", a->tid);
        if (reused && tu_cmp_pattern(c, m, 0, reused, 9000 + (uint32_t)k) != 0)
            TFAIL(a, "thread %d: prefix match attached wrong K/V", a->tid);
        a->match_hits += reused > 0;
        if (tu_rng_chance(&r, 0.5)) {
            TCALL(a, pkv_seq_truncate(c, s, tu_rng_below(&r, n + 1)));
            pkv_seq_info in;
            TCALL(a, pkv_seq_get_info(c, s, &in));
            if (tu_cmp_pattern(c, s, 0, in.n_tokens, tag) != 0) TFAIL(a, "thread %d: truncated parent wrong", a->tid);
        }
        if (tu_rng_chance(&r, 0.5)) { /* s drops its front (its fork gone first, so s holds its
                                          blocks alone: the indexed ones go CACHED and stay in the
                                          index while the other threads evict): what is left reads
                                          the same, and s's tokens are matched again into a new
                                          sequence, reading s's K/V */
            TCALL(a, pkv_seq_release(c, f));
            f = 0;
            pkv_seq_info in;
            TCALL(a, pkv_seq_get_info(c, s, &in));
            const uint32_t front = tu_rng_below(&r, in.n_tokens + 1);
            TCALL(a, pkv_seq_drop_front(c, s, front));
            TCALL(a, pkv_seq_get_info(c, s, &in));
            if (in.n_dropped != front / B * B ||
                tu_cmp_pattern(c, s, in.n_dropped, in.n_tokens - in.n_dropped, tag) != 0)
                TFAIL(a, "thread %d: what a dropped front left reads wrong", a->tid);
            pkv_seq m2 = 0;
            TCALL(a, pkv_seq_create(c, NULL, 0, &m2));
            uint32_t again = 0, from = 0;
            /* half the time under a window (tombstones the others' evictions leave passed): what
               it attached, from its front, reads s's K/V */
            const uint32_t window = tu_rng_chance(&r, 0.5) ? 1 + tu_rng_below(&r, in.n_tokens + 1) : 0;
            int rc = window ? pkv_seq_match_prefix_window(c, m2, toks, in.n_tokens, window, &again)
                            : pkv_seq_match_prefix(c, m2, toks, in.n_tokens, &again);
            pkv_seq_info i2;
            if (rc == PKV_OK && window && (rc = pkv_seq_get_info(c, m2, &i2)) == PKV_OK) from = i2.n_dropped;
            if (rc == PKV_OK && again > from && tu_cmp_pattern(c, m2, from, again - from, tag) != 0) rc = PKV_ECORRUPT;
            a->window_matches += window && rc == PKV_OK && from > 0;
            if (pkv_seq_release(c, m2) && rc == PKV_OK) rc = PKV_EINVAL;
            if (rc == PKV_ENOSPC) a->enospc++;
            else if (rc) TFAIL(a, "thread %d: a match over a dropped front: %s", a->tid, pkv_strerror(rc));
            a->front_hits += in.n_dropped >= B && again >= B; /* s's dropped block 0, CACHED, taken */
        }
        { /* g's 3 uncommitted positions verified as a chain of drafts (tree attention over the
             shared parent's blocks while the others read them): what prefill gives; then the
             first kept (pkv_seq_keep) and the rest dropped */
            float t_out[DEC_N], p_out[DEC_N];
            const int32_t chain[3] = {-1, 0, 1};
            const pkv_attn_tree_req tr = {g, PARENT_LEN, 3, chain};
            const pkv_attn_req pr = {g, PARENT_LEN, 3};
            pkv_attn_params ap = pkv_attn_params_default();
            ap.n_q_heads = QH;
            TCALL(a, pkv_attn_tree(c, it % LAYERS, &tr, 1, a->q, t_out, &ap));
            TCALL(a, pkv_attn_prefill(c, it % LAYERS, &pr, 1, a->q, p_out, &ap));
            for (int i = 0; i < DEC_N; i++)
                if (!(fabsf(t_out[i] - p_out[i]) <= 1e-4f * (1.0f + fabsf(p_out[i]))))
                    TFAIL(a, "thread %d: tree attention %g, prefill %g", a->tid, (double)t_out[i], (double)p_out[i]);
            const uint32_t first = 0;
            TCALL(a, pkv_seq_keep(c, g, PARENT_LEN, &first, 1));
            pkv_seq_info in;
            TCALL(a, pkv_seq_get_info(c, g, &in));
            if (in.n_tokens != PARENT_LEN + 1 || tu_cmp_pattern(c, g, PARENT_LEN, 1, tag + 3) != 0)
                TFAIL(a, "thread %d: kept draft wrong", a->tid);
        }
        a->ok_iters++;
    done:
        {
            pkv_seq ids[4] = {s, f, g, m};
            for (int i = 0; i < 4; i++)
                if (ids[i] && pkv_seq_release(c, ids[i]) && !a->errors++)
                    snprintf(a->first_error, sizeof a->first_error, "thread %d: release failed", a->tid);
        }
    }
    return NULL;
}

/* The event consumer: a thread that takes the prefix index's events while the workers run and
 * keeps the set of indexed hashes they describe (a STORED hash new to it, a REMOVED one known;
 * seqnos increasing by one but after an OVERFLOW, where it resyncs from a snapshot). */
typedef struct consumer {
    pkv_cache *c;
    atomic_int stop;
    uint64_t set[1024];
    uint32_t n;
    uint64_t events, overflows;
    char error[200];
} consumer;

static int cons_find(const consumer *k, uint64_t h) {
    for (uint32_t i = 0; i < k->n; i++)
        if (k->set[i] == h) return (int)i;
    return -1;
}

static int cons_snapshot(consumer *k) {
    static pkv_event ev[1024];
    size_t n = 0;
    int rc = pkv_prefix_snapshot(k->c, ev, 1024, NULL, &n);
    if (rc) return snprintf(k->error, sizeof k->error, "pkv_prefix_snapshot: %s", pkv_strerror(rc)), -1;
    k->n = 0;
    for (size_t i = 0; i < n; i++) k->set[k->n++] = ev[i].hash;
    return 0;
}

/* Takes every held event; 0, or -1 with k->error set. */
static int cons_drain(consumer *k, uint64_t *last) {
    pkv_event ev[32];
    for (;;) {
        size_t n = 0;
        int rc = pkv_cache_take_events(k->c, ev, 32, NULL, &n);
        if (rc) return snprintf(k->error, sizeof k->error, "pkv_cache_take_events: %s", pkv_strerror(rc)), -1;
        if (!n) return 0;
        k->events += n;
        for (size_t i = 0; i < n; i++) {
            const pkv_event *e = &ev[i];
            if (e->kind != PKV_EVENT_OVERFLOW && *last && e->seqno != *last + 1)
                return snprintf(k->error, sizeof k->error, "seqno %llu after %llu", (unsigned long long)e->seqno,
                                (unsigned long long)*last), -1;
            *last = e->seqno;
            const int at = cons_find(k, e->hash);
            if (e->kind == PKV_EVENT_OVERFLOW) {
                k->overflows++;
                *last = 0; /* the snapshot forgets the ring: a gap follows */
                if (cons_snapshot(k)) return -1;
                break;
            } else if (e->kind == PKV_EVENT_STORED) {
                if (at >= 0 || k->n == 1024) return snprintf(k->error, sizeof k->error, "STORED twice"), -1;
                k->set[k->n++] = e->hash;
            } else if (e->kind == PKV_EVENT_REMOVED) {
                if (at < 0) return snprintf(k->error, sizeof k->error, "REMOVED unknown"), -1;
                k->set[at] = k->set[--k->n];
            } else {
                return snprintf(k->error, sizeof k->error, "event kind %u", e->kind), -1;
            }
        }
    }
}

static void *consume(void *p) {
    consumer *k = p;
    uint64_t last = 0;
    while (!atomic_load(&k->stop))
        if (cons_drain(k, &last)) return NULL;
    cons_drain(k, &last);
    return NULL;
}

static void run_threads(int prefix, uint32_t n_blocks, uint32_t iters, int roomy) {
    pkv_config cfg = tu_config(n_blocks, B, LAYERS, KVH, HD, PKV_DTYPE_F32);
    cfg.enable_prefix_cache = prefix;
    cfg.max_seqs = 64;
    cfg.event_capacity = 48; /* small: the consumer falls behind and resyncs now and then */
    cfg.n_threads = 2;        /* attention on the cache's pool, every call (below) */
    pkv_cache *c = tu_create(&cfg);
    pkv__cache_test_inline_work(c, 0); /* the 3-node trees' path parts too (tree_task) */
    targ args[NTHR];
    memset(args, 0, sizeof args);
    pkv_seq parents[NPARENT];
    int32_t ptok[NPARENT][PARENT_LEN];
    for (int k = 0; k < NPARENT; k++) {
        parents[k] = tu_seq(c);
        for (int i = 0; i < PARENT_LEN; i++) ptok[k][i] = 1000000 + k * 100 + i;
        TU_OK(pkv_seq_append(c, parents[k], ptok[k], PARENT_LEN, NULL));
        TU_WRITE_PAT(c, parents[k], 0, PARENT_LEN, 9000 + (uint32_t)k);
        TU_OK(pkv_seq_commit(c, parents[k], PARENT_LEN));
    }
    float q[DEC_N], want[LAYERS * DEC_N];
    for (int i = 0; i < DEC_N; i++) q[i] = (float)((i * 7) % 11) * 0.25f - 1.0f;
    pkv_attn_params ap = pkv_attn_params_default();
    ap.n_q_heads = QH;
    for (uint32_t l = 0; l < LAYERS; l++) TU_OK(pkv_attn_decode(c, l, parents, NPARENT, q, want + l * DEC_N, &ap));
    static consumer ec;
    memset(&ec, 0, sizeof ec);
    ec.c = c;
    assert_int_equal(cons_snapshot(&ec), 0);
    pthread_t th[NTHR], kth;
    assert_int_equal(pthread_create(&kth, NULL, consume, &ec), 0);
    for (int t = 0; t < NTHR; t++) {
        args[t].c = c;
        args[t].q = q, args[t].want = want;
        memcpy(args[t].parents, parents, sizeof parents);
        memcpy(args[t].parent_tok, ptok, sizeof ptok);
        args[t].tid = t;
        args[t].iters = iters;
        args[t].shift_every = roomy ? 1 : 4;
        assert_int_equal(pthread_create(&th[t], NULL, worker, &args[t]), 0);
    }
    long errors = 0, ok = 0, enospc = 0, hits = 0, moved = 0, front_hits = 0, window_matches = 0, shifts = 0;
    for (int t = 0; t < NTHR; t++) {
        assert_int_equal(pthread_join(th[t], NULL), 0);
        if (args[t].errors) print_error("%s\n", args[t].first_error);
        errors += args[t].errors;
        ok += args[t].ok_iters;
        enospc += args[t].enospc;
        hits += args[t].match_hits;
        front_hits += args[t].front_hits;
        window_matches += args[t].window_matches;
        moved += args[t].moved;
        shifts += args[t].shifts;
    }
    atomic_store(&ec.stop, 1);
    assert_int_equal(pthread_join(kth, NULL), 0);
    if (ec.error[0]) fail_msg("event consumer: %s", ec.error);
    { /* what it took is the index */
        static consumer snap;
        snap.c = c;
        assert_int_equal(cons_snapshot(&snap), 0);
        assert_int_equal(snap.n, ec.n);
        for (uint32_t i = 0; i < snap.n; i++) assert_true(cons_find(&ec, snap.set[i]) >= 0);
    }
    print_message("events: %llu taken, %llu overflows, %u blocks indexed at the end\n", (unsigned long long)ec.events,
                  (unsigned long long)ec.overflows, ec.n);
    if (prefix) assert_true(ec.events > 0);
    print_message("prefix %s: %d threads x %u iterations: %ld complete, %ld out of blocks, %ld prefix hits (%ld "
                  "over dropped fronts, %ld windowed matches with a front), %ld blocks compacted, %ld shifts\n",
                  prefix ? "on" : "off", NTHR, iters, ok, enospc, hits, front_hits, window_matches, moved, shifts);
    assert_int_equal(errors, 0);
    if (roomy) assert_true(ok > (long)(NTHR * iters) / 2);
    else assert_true(ok > 0); /* how many hit PKV_ENOSPC depends on the interleaving */
    if (prefix) assert_true(hits > 0 && front_hits > 0 && window_matches > 0);
    if (roomy) assert_true(moved > 0 && shifts > 0);
    TU_CHECK(c);
    pkv_stats st = tu_stats(c);
    assert_int_equal(st.n_seqs, NPARENT);
    assert_int_equal(st.n_active, NPARENT * ((PARENT_LEN + B - 1) / B));
    for (int k = 0; k < NPARENT; k++) {
        TU_SAME_PAT(c, parents[k], 0, PARENT_LEN, 9000 + (uint32_t)k);
        pkv_seq_info in = tu_info(c, parents[k]);
        assert_int_equal(in.n_tokens, PARENT_LEN);
        assert_int_equal(in.n_shared, 0);
    }
    pkv_cache_destroy(c);
}

static void test_threads_prefix_off(void **state) {
    (void)state;
    run_threads(0, 512, (uint32_t)tu_env_u64("PKV_THR_ITERS", 2000), 1);
}

static void test_threads_prefix_on(void **state) {
    (void)state;
    run_threads(1, 512, (uint32_t)tu_env_u64("PKV_THR_ITERS", 2000), 1);
}

static void test_threads_small_pool(void **state) {
    (void)state; /* exhaustion under contention: failures must be clean PKV_ENOSPC */
    run_threads(1, 20, (uint32_t)tu_env_u64("PKV_THR_ITERS", 2000) / 2, 0);
}

/* pkv_cache_check from another thread, in a loop, while this one shifts forks of a committed,
 * indexed sequence (the shift copies their shared, indexed blocks, then moves rows without the
 * cache's lock, its record midway meanwhile): every check passes, and the forks read as shifted. */
typedef struct checker {
    pkv_cache *c;
    atomic_int stop, shifting;
    atomic_long during; /* read by the shifting thread as its stop rule */
    long checks, failed;
    char msg[200];
} checker;

static void *check_loop(void *p) {
    checker *k = p;
    while (!atomic_load(&k->stop)) {
        const int during = atomic_load(&k->shifting);
        char msg[200];
        const int rc = pkv_cache_check(k->c, msg, sizeof msg);
        k->checks++;
        if (during && atomic_load(&k->shifting)) atomic_fetch_add(&k->during, 1);
        if (rc && !k->failed++) snprintf(k->msg, sizeof k->msg, "%s", msg);
    }
    return NULL;
}

static void test_check_during_shift(void **state) {
    (void)state;
    enum { LEN = 4096, MAX_SHIFTS = 200, WANT_DURING = 8 };
    pkv_config cfg = tu_config(2 * LEN / B + 64, B, LAYERS, KVH, HD, PKV_DTYPE_F32);
    cfg.max_seqs = 8;
    pkv_cache *c = tu_create(&cfg);
    const pkv_seq s = tu_seq(c);
    int32_t *toks = malloc(sizeof(int32_t) * LEN);
    assert_non_null(toks);
    for (uint32_t i = 0; i < LEN; i++) toks[i] = (int32_t)i;
    TU_OK(pkv_seq_append(c, s, toks, LEN, NULL));
    free(toks);
    TU_WRITE_PAT(c, s, 0, LEN, 4242);
    TU_OK(pkv_seq_commit(c, s, LEN));
    static checker k;
    memset(&k, 0, sizeof k);
    k.c = c;
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, check_loop, &k), 0);
    const pkv_rope rope = {.dim0 = HD / 2, .n_rot = HD / 2, .style = PKV_ROPE_NEOX, .theta = 10000.0f};
    uint32_t i = 0;
    for (; i < MAX_SHIFTS && (i < 4 || atomic_load(&k.during) < WANT_DURING); i++) {
        pkv_seq f;
        TU_OK(pkv_seq_fork(c, s, &f));
        const uint32_t from = 4 + i % 64, d = LEN / 2 - 3 * (i % 64);
        atomic_store(&k.shifting, 1);
        TU_OK(pkv_seq_shift(c, f, from, from + d, i % 2 ? &rope : NULL));
        atomic_store(&k.shifting, 0);
        if (i < 4) assert_int_equal(check_shifted_len(c, f, LEN - d, from, d, LEN, 4242, 4242, (int)(i % 2)), 0);
        TU_OK(pkv_seq_release(c, f));
    }
    atomic_store(&k.stop, 1);
    assert_int_equal(pthread_join(th, NULL), 0);
    print_message("%u shifts; %ld checks, %ld of them during a shift, %ld failed%s%s\n", i, k.checks, atomic_load(&k.during),
                  k.failed, k.failed ? ": " : "", k.msg);
    assert_int_equal(k.failed, 0);
    if (sysconf(_SC_NPROCESSORS_ONLN) > 1) assert_true(atomic_load(&k.during) > 0); /* the checks met the shifts */
    TU_SAME_PAT(c, s, 0, LEN, 4242);
    TU_CHECK(c);
    pkv_cache_destroy(c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_threads_prefix_off),
        cmocka_unit_test(test_threads_prefix_on),
        cmocka_unit_test(test_threads_small_pool),
        cmocka_unit_test(test_check_during_shift),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
