/* test_core_stress.c: seeded random operations (create, append, write K/V, commit, fork,
 * truncate, release, gather, pins, prefix matches, compaction, dropped fronts) on a small pool, with pkv_cache_check after
 * EVERY step and a shadow model of every sequence (token ids, K/V per position per layer,
 * block refcounts) that the library's answers must match exactly. PKV_STRESS_OPS sets the
 * number of operations (default 200000, split between a prefix-cache-off and -on run);
 * PKV_STRESS_SEED the seed. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include "support_util.h"
#include "cache/cache_int.h" /* only to print a failing block's internal state */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* 1: pkv.h's rule for pkv_write_kv ("a position not yet committed") is per sequence, so a
 * refusal because a departed co-holder committed the position is a failure (BUGS-core.md #3).
 * 0: the per-block rule (a position committed by any holder stays immutable) is the contract;
 * the shadow model predicts that one exactly either way. */
#ifndef STRESS_SEQ_LEVEL_COMMIT
#define STRESS_SEQ_LEVEL_COMMIT 0 /* the lead chose the per-block rule (pkv.h, pkv_write_kv) */
#endif

#define PKV_MIN_U(a, b) ((a) < (b) ? (a) : (b))
#define PKV_MAX_U(a, b) ((a) > (b) ? (a) : (b))

enum { NBLK = 64, B = 4, NL = 2, NH = 2, HD = 8, ROW = NH * HD, MAXS = 16, MAXLEN = 120, NBASE = 4, VOCAB = 6 };

typedef struct {
    int live, is_pin, salt, base;
    pkv_seq id;
    uint32_t len, committed, nb;
    uint32_t dropped; /* positions [0, dropped) let go by pkv_seq_drop_front (a multiple of B) */
    int32_t tok[MAXLEN];
    uint64_t ph[MAXLEN];       /* hash of (salt, tokens[0..p]): defines the canonical K/V */
    int16_t ver[NL][MAXLEN];   /* -1 unwritten, 0 canonical, > 0 a noise version */
    int32_t tab[NBLK];
} sh_seq;

typedef struct {
    pkv_cache *c;
    int prefix;
    tu_rng r;
    sh_seq s[MAXS];
    int32_t base[NBASE][MAXLEN];
    uint32_t ref[NBLK];
    /* per block: how many leading positions some holder committed (the library keeps this per
       block, pkv.h speaks of a sequence's committed positions); -1 = not knowable here */
    int bc[NBLK];
    uint64_t n_dev; /* writes pkv.h allows (position >= the sequence's committed count, block
                       private and unindexed) that the library refused: see BUGS-core.md */
    char first_dev[200];
    pkv_seq dead[8]; /* released ids, for stale-id probes */
    uint32_t n_dead;
    uint64_t step;
    uint64_t n_ok[16], n_fail[16];
    uint64_t n_compact_evicted, n_batch_moved;
} world;

enum { OP_CREATE, OP_APPEND, OP_WRITE, OP_COMMIT, OP_FORK, OP_TRUNCATE, OP_RELEASE, OP_GATHER, OP_PIN, OP_UNPIN,
       OP_MATCH, OP_STALE, OP_FILL, OP_COMPACT, OP_DROP, OP_COUNT };

static uint64_t mix(uint64_t h, uint64_t x) {
    h ^= x + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
    h *= 0xff51afd7ed558ccdull;
    return h ^ (h >> 33);
}

static float kv_val(const sh_seq *s, uint32_t l, uint32_t p, int ver, uint32_t e, int is_v) {
    uint64_t h = s->ph[p];
    return tu_pat((uint32_t)(h ^ (h >> 32)) + (uint32_t)ver * 7777u, l, p, e, is_v);
}

static void set_token(sh_seq *s, uint32_t p, int32_t t) {
    s->tok[p] = t;
    s->ph[p] = mix(p ? s->ph[p - 1] : 0x1234567ull + (uint64_t)s->salt * 0xABCDEFull, (uint64_t)(uint32_t)t);
    for (int l = 0; l < NL; l++) s->ver[l][p] = -1;
}

static void recount(world *w) {
    memset(w->ref, 0, sizeof w->ref);
    for (int i = 0; i < MAXS; i++)
        if (w->s[i].live)
            for (uint32_t j = 0; j < w->s[i].nb; j++)
                if (w->s[i].tab[j] >= 0) w->ref[w->s[i].tab[j]]++; /* (-1: a dropped front's) */
}

/* The last operations, printed when a step fails (the minimal repro is usually in there). */
static int g_debug;
static char g_trace[4096][160];
static uint64_t g_ntrace;
#define TRACE(...) snprintf(g_trace[g_ntrace++ % 4096], sizeof g_trace[0], __VA_ARGS__)

static void fail_at(world *w, const char *what) {
    for (uint64_t i = g_ntrace > 4096 ? g_ntrace - 4096 : 0; i < g_ntrace; i++) print_error("  %s\n", g_trace[i % 4096]);
    fail_msg("stress (prefix %s) step %llu: %s", w->prefix ? "on" : "off", (unsigned long long)w->step, what);
}

/* Reads s's table from the library and checks length / committed / block count. */
static void sync_seq(world *w, sh_seq *s) {
    if (s->is_pin) return; /* pins have no block_table access; their table is set at creation */
    uint32_t n = 0;
    int rc = pkv_seq_block_table(w->c, s->id, s->tab, NBLK, &n);
    if (rc) fail_at(w, "block_table of a live sequence failed");
    s->nb = n;
    pkv_seq_info in = tu_info(w->c, s->id);
    if (in.n_tokens != s->len || in.n_committed != s->committed || in.n_blocks != (s->len + B - 1) / B ||
        n != in.n_blocks || in.n_dropped != s->dropped) {
        char m[200];
        snprintf(m, sizeof m,
                 "info {len %u, committed %u, blocks %u, table %u, dropped %u}, shadow {len %u, committed %u, dropped %u}",
                 in.n_tokens, in.n_committed, in.n_blocks, n, in.n_dropped, s->len, s->committed, s->dropped);
        fail_at(w, m);
    }
    for (uint32_t j = 0; j < n; j++)
        if ((s->tab[j] < 0) != (j < s->dropped / B)) fail_at(w, "table: -1 entries other than the dropped front");
}

/* Global invariants the shadow predicts, after every step. */
static void check_world(world *w) {
    TU_CHECK(w->c);
    recount(w);
    uint32_t active = 0, seqs = 0, pins = 0;
    uint64_t tokens = 0;
    for (int b = 0; b < NBLK; b++) active += w->ref[b] > 0;
    for (int i = 0; i < MAXS; i++)
        if (w->s[i].live) {
            if (w->s[i].is_pin) pins++;
            else {
                seqs++;
                tokens += w->s[i].len;
            }
        }
    pkv_stats st = tu_stats(w->c);
    if (st.n_active != active || st.n_free + st.n_cached != NBLK - active || st.n_seqs != seqs ||
        st.n_pins != pins || st.n_tokens != tokens || (!w->prefix && (st.n_cached || st.n_indexed))) {
        char m[300];
        snprintf(m, sizeof m,
                 "stats active %u free %u cached %u seqs %u pins %u tokens %llu; shadow active %u seqs %u pins %u "
                 "tokens %llu",
                 st.n_active, st.n_free, st.n_cached, st.n_seqs, st.n_pins, (unsigned long long)st.n_tokens, active,
                 seqs, pins, (unsigned long long)tokens);
        fail_at(w, m);
    }
    if (st.frag_slots != (uint64_t)st.n_active * B - st.n_slots_used) fail_at(w, "frag_slots");
    if (g_debug) /* PKV_STRESS_DEBUG=1: the per-block commit model against the library's internals */
        for (int b = 0; b < NBLK; b++)
            if (w->ref[b] && w->bc[b] >= 0 && w->bc[b] != w->c->blk[b].n_commit) {
                char m[200];
                int o = snprintf(m, sizeof m, "model commit count of block %d is %d, library %u; held by", b,
                                 w->bc[b], w->c->blk[b].n_commit);
                for (int i = 0; i < MAXS; i++)
                    for (uint32_t j = 0; w->s[i].live && j < w->s[i].nb; j++)
                        if (w->s[i].tab[j] == b && o < 180)
                            o += snprintf(m + o, sizeof m - (size_t)o, " seq%d[%u]", i, j);
                fail_at(w, m);
            }
}

/* Compares [p0, p0 + n) of layer l of s with the shadow (written positions only). */
static void verify_range(world *w, sh_seq *s, uint32_t l, uint32_t p0, uint32_t n) {
    float k[MAXLEN * ROW], v[MAXLEN * ROW];
    if (p0 < s->dropped && n) { /* a read from the dropped front is refused; the rest is compared */
        if (pkv_seq_gather(w->c, s->id, l, p0, n, k, v) != PKV_EINVAL) fail_at(w, "gather from a dropped front");
        n = p0 + n > s->dropped ? p0 + n - s->dropped : 0;
        p0 = s->dropped;
    }
    int rc = pkv_seq_gather(w->c, s->id, l, p0, n, k, v);
    if (rc) fail_at(w, "gather of a valid range failed");
    for (uint32_t t = 0; t < n; t++) {
        uint32_t p = p0 + t;
        int ver = s->ver[l][p];
        if (ver < 0) continue;
        for (uint32_t e = 0; e < ROW; e++)
            if (k[t * ROW + e] != kv_val(s, l, p, ver, e, 0) || v[t * ROW + e] != kv_val(s, l, p, ver, e, 1)) {
                char m[200];
                snprintf(m, sizeof m, "K/V mismatch: seq slot %d layer %u position %u (version %d, len %u)",
                         (int)(s - w->s), l, p, ver, s->len);
                fail_at(w, m);
            }
    }
}

static void verify_all(world *w) {
    for (int i = 0; i < MAXS; i++)
        if (w->s[i].live && !w->s[i].is_pin && w->s[i].len > w->s[i].dropped)
            for (uint32_t l = 0; l < NL; l++) verify_range(w, &w->s[i], l, w->s[i].dropped, w->s[i].len - w->s[i].dropped);
}

static int pick(world *w, int want_live, int allow_pin) {
    int cand[MAXS], n = 0;
    for (int i = 0; i < MAXS; i++)
        if (w->s[i].live == want_live && (want_live == 0 || allow_pin || !w->s[i].is_pin)) cand[n++] = i;
    return n ? cand[tu_rng_below(&w->r, (uint32_t)n)] : -1;
}

/* Is block bi of s possibly in the prefix index (only knowable from the library's dedup
   decisions)? Only a block some holder committed in full can be: this sequence (committed
   past the block's start: it may since have truncated into it) or a co-holder (bc == B). */
static int maybe_indexed(const world *w, const sh_seq *s, uint32_t bi) {
    int bc = w->bc[s->tab[bi]];
    return w->prefix && (s->committed > bi * B || bc < 0 || bc >= B);
}

static int own_committed(const sh_seq *s, uint32_t bi) {
    return s->committed <= bi * B ? 0 : (int)PKV_MIN_U(B, s->committed - bi * B);
}

/* The library trims a private, unindexed tail's commit count to the sequence's own. */
static void model_claim_tail(world *w, sh_seq *s, uint32_t len) {
    if (len % B == 0) return;
    uint32_t bi = (len - 1) / B;
    int32_t b = s->tab[bi];
    if (w->ref[b] != 1) return;
    if (maybe_indexed(w, s, bi)) {
        w->bc[b] = -1;
        return;
    }
    if (w->bc[b] > own_committed(s, bi)) w->bc[b] = own_committed(s, bi);
}

static void bury(world *w, sh_seq *s) {
    w->dead[w->n_dead++ % 8] = s->id;
    s->live = 0;
}

static void do_append(world *w, sh_seq *s) {
    uint32_t n = tu_rng_chance(&w->r, 0.5) ? 1 : 1 + tu_rng_below(&w->r, 9);
    if (tu_rng_chance(&w->r, 0.05)) n = 0;
    if (s->len + n > MAXLEN) n = MAXLEN - s->len; /* keep the shadow bounded (30 blocks < the table cap) */
    int32_t toks[16];
    for (uint32_t j = 0; j < n; j++) {
        uint32_t p = s->len + j;
        toks[j] = (p < MAXLEN && tu_rng_chance(&w->r, 0.9)) ? w->base[s->base][p] : (int32_t)tu_rng_below(&w->r, VOCAB);
    }
    pkv_stats st0 = tu_stats(w->c);
    uint64_t new_len = s->len + n;
    uint32_t nb_need = (uint32_t)((new_len + B - 1) / B);
    uint32_t tail = s->len % B ? s->nb - 1 : UINT32_MAX;
    int cow_must = tail != UINT32_MAX && w->ref[s->tab[tail]] > 1;
    int cow_maybe = tail != UINT32_MAX && !cow_must && maybe_indexed(w, s, tail);
    uint32_t need_lo = nb_need - s->nb + (uint32_t)cow_must, need_hi = need_lo + (uint32_t)cow_maybe;
    uint32_t avail = st0.n_free + st0.n_cached;
    int32_t old_tab[NBLK];
    memcpy(old_tab, s->tab, sizeof old_tab);
    uint32_t old_nb = s->nb;
    int32_t slots[16];
    uint32_t counted = UINT32_MAX;
    const int rc_count = pkv_seq_append_blocks(w->c, s->id, n, &counted);
    if (rc_count != PKV_OK) fail_at(w, "append_blocks: unexpected status");
    /* the copied tail of an indexed block held alone is counted back (it turns CACHED): need_lo */
    if (n ? counted < need_lo || counted > need_hi : counted != 0)
        fail_at(w, "append_blocks: a count outside the model's bounds");
    /* a third of the appends go through pkv_batch_append, one request (its batches of several
       are test_core_seq's oracle): the same append, and the same refusal */
    int rc;
    if (tu_rng_below(&w->r, 3) == 0) {
        const pkv_append_req rq = {s->id, toks, n, slots};
        uint32_t done = 99;
        rc = pkv_batch_append(w->c, &rq, 1, 0, &done);
        if (done != (rc ? 99u : 1u)) fail_at(w, "batch append: n_done wrong");
    } else {
        rc = pkv_seq_append(w->c, s->id, toks, n, slots);
    }
    if ((rc == PKV_ENOSPC) != (counted > avail)) fail_at(w, "append_blocks and the append disagree");
    TRACE("append seq%d n=%u -> %d (len %u)", (int)(s - w->s), n, rc, s->len);
    int want_fail = n > 0 && need_lo > avail, may_fail = n > 0 && need_hi > avail;
    if (rc == PKV_ENOSPC) {
        if (!may_fail) fail_at(w, "append: PKV_ENOSPC with enough blocks");
        pkv_stats st1 = tu_stats(w->c);
        TU_STATS_EQ(&st0, &st1);
        sync_seq(w, s);
        if (s->nb != old_nb || memcmp(old_tab, s->tab, old_nb * sizeof(int32_t))) fail_at(w, "failed append changed the table");
        w->n_fail[OP_APPEND]++;
        return;
    }
    if (rc != PKV_OK) fail_at(w, "append: unexpected status");
    if (want_fail) fail_at(w, "append succeeded without enough blocks");
    pkv_stats st1 = tu_stats(w->c);
    uint64_t cows = st1.cow_copies - st0.cow_copies;
    if (n == 0 && cows) fail_at(w, "empty append copied");
    if (n && cow_must && cows != 1) fail_at(w, "append into a shared tail did not copy it once");
    if (n && !cow_must && !cow_maybe && cows != 0) {
        const pkv__blk *kb = &w->c->blk[old_tab[tail]];
        print_error("  old tail block %d: ref %u flags %u fill %u commit %u; seq len %u committed %u\n",
                    old_tab[tail], kb->ref, kb->flags, kb->n_fill, kb->n_commit, s->len, s->committed);
        fail_at(w, "append copied a private tail");
    }
    for (uint32_t j = 0; j < n; j++) set_token(s, s->len + j, toks[j]);
    s->len += n;
    sync_seq(w, s);
    /* the table: old entries kept (the tail replaced by a copy iff CoW), new ones fresh */
    for (uint32_t j = 0; j < old_nb; j++) {
        int replaced = cows && j == tail;
        if (!replaced && s->tab[j] != old_tab[j]) fail_at(w, "append changed an old table entry");
        if (replaced && (s->tab[j] == old_tab[j] || w->ref[s->tab[j]] != 0)) fail_at(w, "CoW did not take a free block");
    }
    for (uint32_t j = old_nb; j < s->nb; j++) {
        /* a copied tail that this sequence alone held is CACHED once copied, and the same append
           may evict it for a new entry (pkv_seq_append counts it among the blocks it can have) */
        const int old_tail = cows && s->tab[j] == old_tab[tail] && w->ref[old_tab[tail]] == 1;
        if (w->ref[s->tab[j]] != 0 && !old_tail) fail_at(w, "append took a block in use");
        w->bc[s->tab[j]] = 0;
    }
    if (cows) {
        uint32_t off = (s->len - n) % B;
        w->bc[s->tab[tail]] = (int)PKV_MIN_U((uint32_t)own_committed(s, tail), off);
    } else if (n && tail != UINT32_MAX) {
        recount(w); /* claim_tail runs before the positions are added: the old tail */
        model_claim_tail(w, s, s->len - n);
    }
    for (uint32_t j = 0; j < n; j++) {
        uint32_t p = s->len - n + j;
        if (slots[j] != s->tab[p / B] * B + (int32_t)(p % B)) fail_at(w, "append returned a wrong slot");
    }
    w->n_ok[OP_APPEND]++;
}

static void dump_blocks(world *w, sh_seq *s, uint32_t p0, uint32_t n) {
    for (uint32_t j = 0; j < n; j++) {
        uint32_t b = (uint32_t)s->tab[(p0 + j) / B];
        const pkv__blk *kb = &w->c->blk[b];
        print_error("  position %u: block %u state %u ref %u flags %u fill %u commit %u (model ref %u commit %d)\n",
                    p0 + j, b, kb->state, kb->ref, kb->flags, kb->n_fill, kb->n_commit, w->ref[b], w->bc[b]);
    }
}

/* Writes layer l of positions [p0, p0 + n) (n <= 8) with version ver, plus a -1 padding row
   when pad <= n (at that index), and checks the status against the model. */
static void write_range(world *w, sh_seq *s, uint32_t l, uint32_t p0, uint32_t n, int ver, uint32_t pad) {
    int32_t slots[9];
    float k[9 * ROW], v[9 * ROW];
    TU_OK(pkv_seq_slots(w->c, s->id, p0, n, slots));
    int32_t call_slots[9];
    uint32_t m = 0, pos_of[9];
    int valid = 1, maybe = 0, seq_valid = 1;
    for (uint32_t j = 0; j <= n; j++) {
        if (j == pad) {
            call_slots[m] = -1;
            for (uint32_t e = 0; e < ROW; e++) k[m * ROW + e] = v[m * ROW + e] = 12345.0f;
            pos_of[m++] = UINT32_MAX;
        }
        if (j == n) break;
        uint32_t p = p0 + j, bi = p / B;
        call_slots[m] = slots[j];
        for (uint32_t e = 0; e < ROW; e++) {
            k[m * ROW + e] = kv_val(s, l, p, ver, e, 0);
            v[m * ROW + e] = kv_val(s, l, p, ver, e, 1);
        }
        pos_of[m++] = p;
        int32_t b = s->tab[bi];
        if (w->ref[b] != 1 || p < s->committed) valid = seq_valid = 0;
        else if (maybe_indexed(w, s, bi) || w->bc[b] < 0) maybe = 1;
        else if ((int)(p % B) < w->bc[b]) valid = 0; /* committed by a co-holder that left */
    }
    /* every third step, a write without padding goes by position (pkv_seq_write_kv): held to
       the same model */
    const bool by_pos = pad > n && w->step % 3 == 1;
    int rc = by_pos ? pkv_seq_write_kv(w->c, s->id, l, p0, n, k, v, PKV_DTYPE_F32)
                    : pkv_write_kv(w->c, l, call_slots, m, k, v, PKV_DTYPE_F32);
    TRACE("write seq%d layer %u pos %u..%u ver %d -> %d (len %u committed %u)", (int)(s - w->s), l, p0, p0 + n - 1,
          ver, rc, s->len, s->committed);
    if (rc == PKV_OK) {
        if (!valid) {
            dump_blocks(w, s, p0, n);
            fail_at(w, "write into a shared block or a committed position was accepted");
        }
        for (uint32_t j = 0; j < m; j++)
            if (pos_of[j] != UINT32_MAX) s->ver[l][pos_of[j]] = (int16_t)ver;
        w->n_ok[OP_WRITE]++;
    } else if (rc == PKV_EINVAL) {
        if (!valid && seq_valid && !maybe) {
            if (!w->n_dev++)
                snprintf(w->first_dev, sizeof w->first_dev,
                         "step %llu: write of positions %u..%u refused (len %u, committed %u), block private and "
                         "unindexed, its leading positions committed by a co-holder that has left",
                         (unsigned long long)w->step, p0, p0 + n - 1, s->len, s->committed);
        }
        if (valid && !maybe) {
            dump_blocks(w, s, p0, n);
            char msg[200];
            snprintf(msg, sizeof msg,
                     "write refused: positions %u..%u (len %u, committed %u), all blocks refcount 1, none indexed",
                     p0, p0 + n - 1, s->len, s->committed);
            fail_at(w, msg);
        }
        w->n_fail[OP_WRITE]++;
    } else {
        fail_at(w, "write: unexpected status");
    }
}

static void do_write(world *w, sh_seq *s) {
    if (s->len == 0) return;
    uint32_t l = tu_rng_below(&w->r, NL);
    uint32_t p0 = tu_rng_below(&w->r, s->len);
    if (tu_rng_chance(&w->r, 0.7) && s->committed < s->len) p0 = s->committed + tu_rng_below(&w->r, s->len - s->committed);
    uint32_t n = 1 + tu_rng_below(&w->r, PKV_MIN_U(8, s->len - p0));
    int ver = tu_rng_chance(&w->r, 0.85) ? 0 : 1 + (int)tu_rng_below(&w->r, 100);
    uint32_t pad = tu_rng_chance(&w->r, 0.2) ? tu_rng_below(&w->r, n + 1) : UINT32_MAX; /* a -1 row */
    if (p0 < s->dropped) { /* the dropped front: no slots, no write by position, nothing changes */
        int32_t slots[9];
        float k[9 * ROW] = {0}, v[9 * ROW] = {0};
        const pkv_stats st0 = tu_stats(w->c);
        if (pkv_seq_slots(w->c, s->id, p0, n, slots) != PKV_EINVAL ||
            pkv_seq_write_kv(w->c, s->id, l, p0, n, k, v, PKV_DTYPE_F32) != PKV_EINVAL)
            fail_at(w, "slots or a write of a dropped position not refused");
        const pkv_stats st1 = tu_stats(w->c);
        TU_STATS_EQ(&st0, &st1); /* (the K/V: verify_all, every 997 steps) */
        w->n_fail[OP_WRITE]++;
        return;
    }
    write_range(w, s, l, p0, n, ver, pad);
}

static void do_commit(world *w, sh_seq *s);

/* What an engine does after a forward pass: canonical K/V of every uncommitted position, every
   layer, then commit (drives the prefix index, matches and evictions). */
static void do_fill(world *w, sh_seq *s) {
    for (uint32_t l = 0; l < NL; l++)
        for (uint32_t p = PKV_MAX_U(s->committed, s->dropped); p < s->len; p += 8)
            write_range(w, s, l, p, PKV_MIN_U(8, s->len - p), 0, UINT32_MAX);
    do_commit(w, s);
}

static void do_commit(world *w, sh_seq *s) {
    if (tu_rng_chance(&w->r, 0.05)) {
        pkv_stats st0 = tu_stats(w->c);
        TU_RC(pkv_seq_commit(w->c, s->id, s->len + 1 + tu_rng_below(&w->r, 5)), PKV_EINVAL);
        pkv_stats st1 = tu_stats(w->c);
        TU_STATS_EQ(&st0, &st1);
        w->n_fail[OP_COMMIT]++;
        return;
    }
    /* only canonical, fully written positions are committed (the index trusts them) */
    uint32_t ok = 0;
    while (ok < s->len) {
        int all = 1;
        for (int l = 0; l < NL; l++) all &= s->ver[l][ok] == 0;
        if (!all) break;
        ok++;
    }
    uint32_t n_pos = tu_rng_chance(&w->r, 0.7) ? ok : tu_rng_below(&w->r, ok + 1);
    TU_OK(pkv_seq_commit(w->c, s->id, n_pos));
    for (uint32_t i = PKV_MAX_U(s->committed, s->dropped) / B; i < s->nb && i * B < n_pos; i++) {
        int in_block = (int)PKV_MIN_U(B, n_pos - i * B);
        if (w->bc[s->tab[i]] >= 0 && w->bc[s->tab[i]] < in_block) w->bc[s->tab[i]] = in_block;
    }
    TRACE("commit seq%d %u (len %u)", (int)(s - w->s), n_pos, s->len);
    if (n_pos > s->committed) s->committed = n_pos;
    sync_seq(w, s);
    w->n_ok[OP_COMMIT]++;
}

static void do_fork(world *w, sh_seq *p) {
    int i = pick(w, 0, 0);
    pkv_seq child = 0;
    int rc = pkv_seq_fork(w->c, p->id, &child);
    if (i < 0) {
        if (rc != PKV_ELIMIT) fail_at(w, "fork past max_seqs did not return PKV_ELIMIT");
        w->n_fail[OP_FORK]++;
        return;
    }
    if (rc) fail_at(w, "fork failed");
    sh_seq *c = &w->s[i];
    TRACE("fork seq%d -> seq%d (len %u committed %u)", (int)(p - w->s), i, p->len, p->committed);
    *c = *p;
    c->id = child;
    sync_seq(w, c);
    if (c->nb != p->nb || memcmp(c->tab, p->tab, p->nb * sizeof(int32_t))) fail_at(w, "fork table differs");
    w->n_ok[OP_FORK]++;
}

static void do_truncate(world *w, sh_seq *s) {
    uint32_t n = tu_rng_chance(&w->r, 0.1) ? s->len + tu_rng_below(&w->r, 4) : tu_rng_below(&w->r, s->len + 1);
    int32_t old_tab[NBLK];
    memcpy(old_tab, s->tab, sizeof old_tab);
    uint32_t old_len = s->len;
    if (n < s->len && n < s->dropped) { /* into the dropped front: refused, nothing changes */
        pkv_stats st0 = tu_stats(w->c);
        TU_RC(pkv_seq_truncate(w->c, s->id, n), PKV_EINVAL);
        pkv_stats st1 = tu_stats(w->c);
        TU_STATS_EQ(&st0, &st1);
        sync_seq(w, s);
        if (memcmp(old_tab, s->tab, s->nb * sizeof(int32_t))) fail_at(w, "a refused truncate changed the table");
        w->n_fail[OP_TRUNCATE]++;
        return;
    }
    TU_OK(pkv_seq_truncate(w->c, s->id, n));
    TRACE("truncate seq%d %u (len %u committed %u)", (int)(s - w->s), n, s->len, s->committed);
    if (n < s->len) {
        s->len = n;
        if (s->committed > n) s->committed = n;
    }
    sync_seq(w, s);
    if (memcmp(old_tab, s->tab, s->nb * sizeof(int32_t))) fail_at(w, "truncate changed kept entries");
    recount(w);
    if (n < old_len) model_claim_tail(w, s, s->len); /* a no-op truncate claims nothing */
    w->n_ok[OP_TRUNCATE]++;
}

/* pkv_seq_drop_front: PKV_EINVAL past the length, changing nothing; else the blocks wholly before
 * pos lose s's reference (-1 in its table; the counts check_world compares follow; with the
 * prefix cache on, an indexed one held by s alone goes CACHED above blocks s still holds, and a
 * later eviction takes its subtree out of the index: the checker after every step), every later
 * entry stays, and the dropped front is refused to a read, a truncate into it and a pin. */
static void do_drop(world *w, sh_seq *s) {
    const uint32_t pos = tu_rng_chance(&w->r, 0.1) ? s->len + 1 + tu_rng_below(&w->r, 3) : tu_rng_below(&w->r, s->len + 1);
    int32_t old_tab[NBLK];
    memcpy(old_tab, s->tab, sizeof old_tab);
    const pkv_stats st0 = tu_stats(w->c);
    const int rc = pkv_seq_drop_front(w->c, s->id, pos);
    TRACE("drop_front seq%d %u -> %d (len %u dropped %u)", (int)(s - w->s), pos, rc, s->len, s->dropped);
    if (pos > s->len) {
        if (rc != PKV_EINVAL) fail_at(w, "drop_front: not the refusal expected");
        const pkv_stats st1 = tu_stats(w->c);
        TU_STATS_EQ(&st0, &st1);
        sync_seq(w, s);
        if (memcmp(old_tab, s->tab, s->nb * sizeof(int32_t))) fail_at(w, "a refused drop_front changed the table");
        w->n_fail[OP_DROP]++;
        return;
    }
    if (rc) fail_at(w, "drop_front failed");
    s->dropped = PKV_MAX_U(s->dropped, pos / B * B);
    sync_seq(w, s); /* -1 exactly before dropped / B */
    for (uint32_t j = s->dropped / B; j < s->nb; j++)
        if (s->tab[j] != old_tab[j]) fail_at(w, "drop_front changed a kept entry");
    if (s->dropped) {
        const pkv_stats st1 = tu_stats(w->c);
        float k[ROW];
        pkv_seq pin;
        TU_RC(pkv_seq_gather(w->c, s->id, 0, s->dropped - 1, 1, k, NULL), PKV_EINVAL);
        TU_RC(pkv_seq_truncate(w->c, s->id, s->dropped - 1), PKV_EINVAL);
        TU_RC(pkv_pin_create(w->c, s->id, s->len, &pin), PKV_EINVAL);
        const pkv_stats st2 = tu_stats(w->c);
        TU_STATS_EQ(&st1, &st2);
    }
    w->n_ok[OP_DROP]++;
}

static void do_pin(world *w, sh_seq *s) {
    int i = pick(w, 0, 0);
    pkv_seq pin = 0;
    uint32_t n_pos = tu_rng_below(&w->r, s->len + 3);
    const pkv_stats st0 = tu_stats(w->c);
    int rc = pkv_pin_create(w->c, s->id, n_pos, &pin);
    if (s->dropped) { /* no prefix left to pin */
        if (rc != PKV_EINVAL) fail_at(w, "a pin of a sequence with a dropped front not refused");
        const pkv_stats st1 = tu_stats(w->c);
        TU_STATS_EQ(&st0, &st1);
        return;
    }
    if (i < 0) {
        if (rc != PKV_ELIMIT) fail_at(w, "pin past max_seqs did not return PKV_ELIMIT");
        return;
    }
    if (rc) fail_at(w, "pin_create failed");
    TRACE("pin seq%d n_pos %u -> seq%d", (int)(s - w->s), n_pos, i);
    sh_seq *p = &w->s[i];
    memset(p, 0, sizeof *p);
    p->live = p->is_pin = 1;
    p->id = pin;
    p->nb = PKV_MIN_U(n_pos, s->committed) / B;
    memcpy(p->tab, s->tab, p->nb * sizeof(int32_t));
    /* the pin's references are visible in the shared counts of s */
    pkv_seq_info in = tu_info(w->c, s->id);
    recount(w);
    uint32_t shared = 0;
    for (uint32_t j = 0; j < s->nb; j++) shared += w->ref[s->tab[j]] > 1;
    if (in.n_shared != shared) fail_at(w, "n_shared after pin");
    w->n_ok[OP_PIN]++;
}

static void do_match(world *w) {
    int i = pick(w, 0, 0);
    if (i < 0) return;
    sh_seq *s = &w->s[i];
    memset(s, 0, sizeof *s);
    s->salt = (int)tu_rng_below(&w->r, 2);
    s->base = (int)tu_rng_below(&w->r, NBASE);
    char salt = (char)('a' + s->salt);
    TU_OK(pkv_seq_create(w->c, &salt, 1, &s->id));
    s->live = 1;
    uint32_t n = 1 + tu_rng_below(&w->r, 48);
    int32_t prompt[48];
    for (uint32_t p = 0; p < n; p++)
        prompt[p] = tu_rng_chance(&w->r, 0.97) ? w->base[s->base][p] : (int32_t)tu_rng_below(&w->r, VOCAB);
    uint32_t reused = 0xdead;
    pkv_stats st0 = tu_stats(w->c);
    TU_OK(pkv_seq_match_prefix(w->c, s->id, prompt, n, &reused));
    TRACE("match seq%d salt %d n %u -> reused %u", i, s->salt, n, reused);
    pkv_stats st1 = tu_stats(w->c);
    if (reused > n - 1) fail_at(w, "match reused the whole prompt");
    if (!w->prefix && reused) fail_at(w, "match reused tokens with the prefix cache off");
    if ((w->prefix && st1.prefix_lookups != st0.prefix_lookups + 1) ||
        st1.prefix_tokens_hit != st0.prefix_tokens_hit + reused)
        fail_at(w, "prefix stats");
    for (uint32_t p = 0; p < reused; p++) {
        set_token(s, p, prompt[p]);
        for (int l = 0; l < NL; l++) s->ver[l][p] = 0; /* committed = canonical */
    }
    s->len = s->committed = reused;
    sync_seq(w, s);
    for (uint32_t j = 0; j < s->nb; j++) w->bc[s->tab[j]] = -1;
    pkv_seq_info in = tu_info(w->c, s->id);
    if (in.n_reused != reused) fail_at(w, "info.n_reused");
    for (uint32_t l = 0; l < NL && reused; l++) verify_range(w, s, l, 0, reused);
    /* the matched blocks hold the prompt's token ids: a fork + gather is not enough to see
       them, but the prefix index compared them; n_reused full blocks must be shared ones
       or private copies, never FREE blocks */
    recount(w);
    w->n_ok[OP_MATCH] += reused > 0;
    w->n_fail[OP_MATCH] += reused == 0;
}

/* The compaction rule of pkv.h, on a copy of the table and the blocks' states: FREE, held once
 * (movable), CACHED; each indexed or partial block's parent and number of children, so that a
 * CACHED leaf (what PKV_COMPACT_EVICT may take) is known as evictions and moves change them.
 * Tombstones (ids NBLK and up, prefix.c) count as children too; one whose last child is
 * evicted goes, and its parent loses a child. */
typedef struct {
    int32_t *t;
    uint32_t nb, flags, evicted, pruned; /* pruned: tombstones that went with the evicted */
    uint8_t free_[NBLK], mov[NBLK], cached[NBLK];
    int par[5 * NBLK], kids[5 * NBLK];
    int *bc;
} cmodel;

static uint32_t cm_run(const cmodel *m, uint32_t i) {
    uint32_t len = 1;
    while (i + len < m->nb && m->t[i + len] == m->t[i + len - 1] + 1) len++;
    return len;
}

static int cm_fits(const cmodel *m, int from, uint32_t len, int to) {
    if (to < 0 || to == from || to + (int)len > NBLK) return 0;
    for (int j = 0; j < (int)len; j++) {
        const int t = to + j;
        const int leaf = m->cached[t] && m->kids[t] == 0 && (m->flags & PKV_COMPACT_EVICT);
        const int any = m->cached[t] && (m->flags & PKV_COMPACT_CACHED);
        if (!m->mov[from + j] || (!m->free_[t] && (t < from || t >= from + (int)len) && !leaf && !any)) return 0;
    }
    return 1;
}

/* Moves table entry i to id `to`; returns the copies (2 where a CACHED block is exchanged). */
static uint32_t cm_move_block(cmodel *m, uint32_t i, int to) {
    const int from = m->t[i];
    if (m->cached[to] && (m->flags & PKV_COMPACT_CACHED)) { /* exchanged: ids renamed */
        const int p = m->par[from], k = m->kids[from];
        m->par[from] = m->par[to], m->kids[from] = m->kids[to];
        m->par[to] = p, m->kids[to] = k;
        for (int b = 0; b < 5 * NBLK; b++) m->par[b] = m->par[b] == from ? to : m->par[b] == to ? from : m->par[b];
        m->cached[from] = 1, m->mov[from] = 0;
        m->cached[to] = 0, m->mov[to] = 1;
        m->bc[to] = m->bc[from], m->bc[from] = 0;
        m->t[i] = to;
        return 2;
    }
    if (m->cached[to]) { /* evicted: its parent loses a child, and a tombstone left with none goes */
        m->cached[to] = 0;
        for (int p = m->par[to]; p >= 0 && --m->kids[p] == 0 && p >= NBLK; p = m->par[p]) m->pruned++;
        m->evicted++;
    }
    m->par[to] = m->par[from], m->kids[to] = m->kids[from];
    for (int b = 0; b < 5 * NBLK; b++)
        if (m->par[b] == from) m->par[b] = to;
    m->par[from] = -1, m->kids[from] = 0;
    m->free_[from] = 1, m->mov[from] = 0;
    m->free_[to] = 0, m->mov[to] = 1;
    m->bc[to] = m->bc[from], m->bc[from] = 0;
    m->t[i] = to;
    return 1;
}

static uint32_t cm_move(cmodel *m, uint32_t i, uint32_t len, int to) {
    const int down = to < m->t[i];
    uint32_t copies = 0;
    for (uint32_t j = 0; j < len; j++) {
        const uint32_t k = down ? j : len - 1 - j;
        copies += cm_move_block(m, i + k, to + (int)k);
    }
    return copies;
}

static uint32_t n_runs(const int32_t *t, uint32_t n) {
    uint32_t r = n > 0;
    for (uint32_t j = 1; j < n; j++) r += t[j] != t[j - 1] + 1;
    return r;
}

/* pkv_seq_compact against pkv.h's rule, worked out here from the blocks' states before the
 * call (read through the internals), then the table, the counts and the data of every layer.
 * With the prefix cache on, half the calls may evict. */
static void do_compact(world *w, sh_seq *s) {
    const pkv_cache *c = w->c;
    int32_t want[NBLK];
    cmodel m = {.t = want, .nb = s->nb, .bc = w->bc};
    m.flags = w->prefix ? tu_rng_below(&w->r, 4) : 0; /* EVICT, CACHED, both */
    for (int b = 0; b < 5 * NBLK; b++) m.par[b] = -1, m.kids[b] = 0;
    assert_true(c->n_blocks == NBLK && c->tomb_cap <= 4 * NBLK);
    for (int b = 0; b < NBLK + (int)c->tomb_cap; b++) {
        const pkv__blk *k = &c->blk[b];
        if (b < NBLK) {
            m.free_[b] = k->state == PKV_BLK_FREE;
            m.cached[b] = k->state == PKV_BLK_CACHED;
            m.mov[b] = k->state == PKV_BLK_ACTIVE && k->ref == 1;
        }
        if (k->flags && k->parent != PKV_NONE) m.par[b] = (int)k->parent, m.kids[k->parent]++;
    }
    memcpy(want, s->tab, s->nb * sizeof *want);
    uint32_t n_want = 0;
    const uint32_t d = s->dropped / B; /* the dropped front's -1 entries: no blocks, never moved */
    for (uint32_t p0 = d, i = d < s->nb ? d + cm_run(&m, d) : d; i < s->nb;) {
        const uint32_t len = cm_run(&m, i), plen = i - p0;
        if (want[i] == want[i - 1] + 1) {
            i += len;
            continue;
        }
        const int a = cm_fits(&m, want[i], len, want[i - 1] + 1);
        const int b = cm_fits(&m, want[p0], plen, want[i] - (int)plen);
        if (a && (!b || len <= plen)) n_want += cm_move(&m, i, len, want[i - 1] + 1);
        else if (b) n_want += cm_move(&m, p0, plen, want[i] - (int)plen);
        else p0 = i;
        i += len;
    }
    const uint32_t runs0 = n_runs(s->tab + d, s->nb - d);
    pkv_stats st0 = tu_stats(w->c);
    uint32_t moved = UINT32_MAX;
    if (pkv_seq_compact(w->c, s->id, m.flags, &moved)) fail_at(w, "compact failed");
    TRACE("compact seq%d flags %u: %u moved, %u evicted", (int)(s - w->s), m.flags, moved, m.evicted);
    sync_seq(w, s);
    if (moved != n_want || memcmp(want, s->tab, s->nb * sizeof *want)) fail_at(w, "compact: not the rule's table");
    if (n_runs(s->tab + d, s->nb - d) > runs0) fail_at(w, "compact: more runs");
    const pkv_stats st1 = tu_stats(w->c);
    st0.evictions += m.evicted, st0.n_cached -= m.evicted, st0.n_free += m.evicted, st0.n_indexed -= m.evicted;
    st0.n_tombstones -= m.pruned;
    TU_STATS_EQ(&st0, &st1);
    for (uint32_t l = 0; l < NL && s->len > s->dropped; l++) verify_range(w, s, l, s->dropped, s->len - s->dropped);
    w->n_ok[OP_COMPACT] += moved > 0;
    w->n_fail[OP_COMPACT] += moved == 0;
    w->n_compact_evicted += m.evicted;
}

/* Whether sequence idx[j] of a batch is laid out as pkv_batch_compact leaves it in place: the
 * blocks it alone holds ascend in table order and none that another of the batch alone holds lies
 * between them (w->ref current). */
static int laid_out(const world *w, const int *idx, int n, int j) {
    const sh_seq *s = &w->s[idx[j]];
    int32_t lo = -1, hi = -1;
    for (uint32_t p = 0; p < s->nb; p++) {
        const int32_t b = s->tab[p];
        if (b < 0 || w->ref[b] != 1) continue;
        if (hi >= 0 && b <= hi) return 0;
        if (lo < 0) lo = b;
        hi = b;
    }
    for (int k = 0; k < n && lo >= 0; k++)
        for (uint32_t p = 0; k != j && p < w->s[idx[k]].nb; p++) {
            const int32_t b = w->s[idx[k]].tab[p];
            if (b >= 0 && w->ref[b] == 1 && lo < b && b < hi) return 0;
        }
    return 1;
}

/* pkv_batch_compact over a few live sequences: every count stays, every listed sequence keeps
 * its K/V in every layer, and the model's per-block commit counts follow their blocks. Without
 * PKV_BATCH_REPACK the sequences laid out already keep their tables. CACHED blocks that
 * PKV_BATCH_CACHED moves are checked where a later match reads them. */
static void do_batch_compact(world *w) {
    int idx[MAXS], n = 0;
    for (int i = 0; i < MAXS; i++)
        if (w->s[i].live && !w->s[i].is_pin && tu_rng_chance(&w->r, 0.5)) idx[n++] = i;
    pkv_seq ids[MAXS];
    static int saved[MAXS][NBLK];
    static int32_t kept[MAXS][NBLK];
    int keep[MAXS];
    recount(w);
    for (int j = 0; j < n; j++) {
        ids[j] = w->s[idx[j]].id;
        for (uint32_t p = w->s[idx[j]].dropped / B; p < w->s[idx[j]].nb; p++) saved[j][p] = w->bc[w->s[idx[j]].tab[p]];
        keep[j] = laid_out(w, idx, n, j);
        memcpy(kept[j], w->s[idx[j]].tab, sizeof kept[j]);
    }
    const pkv_stats st0 = tu_stats(w->c);
    const uint32_t slack = tu_rng_below(&w->r, 3), flags = tu_rng_below(&w->r, 4); /* REPACK, CACHED */
    uint32_t moved = 0;
    if (pkv_batch_compact(w->c, ids, (uint32_t)n, slack, flags, &moved)) fail_at(w, "batch compact failed");
    TRACE("batch compact(%u) of %d sequences, slack %u: %u copies", flags, n, slack, moved);
    const pkv_stats st1 = tu_stats(w->c);
    TU_STATS_EQ(&st0, &st1);
    for (int j = 0; j < n; j++) {
        sh_seq *s = &w->s[idx[j]];
        sync_seq(w, s);
        for (uint32_t p = s->dropped / B; p < s->nb; p++) w->bc[s->tab[p]] = saved[j][p];
        for (uint32_t l = 0; l < NL && s->len > s->dropped; l++)
            verify_range(w, s, l, s->dropped, s->len - s->dropped);
        if (!(flags & PKV_BATCH_REPACK) && keep[j] && memcmp(kept[j], s->tab, s->nb * sizeof *s->tab))
            fail_at(w, "batch compact moved a sequence laid out already");
    }
    w->n_ok[OP_COMPACT] += moved > 0;
    w->n_batch_moved += moved;
}

static void step(world *w) {
    uint32_t r = tu_rng_below(&w->r, 100);
    int op;
    if (r < 6) op = OP_CREATE;
    else if (r < 30) op = OP_APPEND;
    else if (r < 53) op = OP_WRITE;
    else if (r < 55) op = OP_DROP;
    else if (r < 59) op = OP_COMMIT;
    else if (r < 63) op = OP_FILL;
    else if (r < 69) op = OP_FORK;
    else if (r < 76) op = OP_TRUNCATE;
    else if (r < 82) op = OP_RELEASE;
    else if (r < 88) op = OP_GATHER;
    else if (r < 91) op = OP_PIN;
    else if (r < 94) op = OP_UNPIN;
    else if (r < 97) op = OP_MATCH;
    else if (r < 99) op = OP_COMPACT;
    else op = OP_STALE;
    recount(w);
    int i;
    switch (op) {
    case OP_CREATE: {
        i = pick(w, 0, 0);
        pkv_seq id = 0;
        int salt = (int)tu_rng_below(&w->r, 2);
        char sb = (char)('a' + salt);
        int rc = pkv_seq_create(w->c, &sb, 1, &id);
        if (i < 0) {
            if (rc != PKV_ELIMIT) fail_at(w, "create past max_seqs");
            break;
        }
        if (rc) fail_at(w, "create failed");
        sh_seq *s = &w->s[i];
        memset(s, 0, sizeof *s);
        s->live = 1;
        s->id = id;
        s->salt = salt;
        s->base = (int)tu_rng_below(&w->r, NBASE);
        sync_seq(w, s);
        TRACE("create seq%d salt %d", i, salt);
        w->n_ok[op]++;
        break;
    }
    case OP_APPEND:
        if ((i = pick(w, 1, 0)) >= 0) do_append(w, &w->s[i]);
        break;
    case OP_WRITE:
        if ((i = pick(w, 1, 0)) >= 0) do_write(w, &w->s[i]);
        break;
    case OP_COMMIT:
        if ((i = pick(w, 1, 0)) >= 0) do_commit(w, &w->s[i]);
        break;
    case OP_FILL:
        if ((i = pick(w, 1, 0)) >= 0) do_fill(w, &w->s[i]);
        break;
    case OP_FORK:
        if ((i = pick(w, 1, 0)) >= 0) do_fork(w, &w->s[i]);
        break;
    case OP_TRUNCATE:
        if ((i = pick(w, 1, 0)) >= 0) do_truncate(w, &w->s[i]);
        break;
    case OP_RELEASE:
        if ((i = pick(w, 1, 0)) >= 0) {
            TU_OK(pkv_seq_release(w->c, w->s[i].id));
            TRACE("release seq%d", i);
            bury(w, &w->s[i]);
            w->n_ok[op]++;
        }
        break;
    case OP_GATHER:
        if ((i = pick(w, 1, 0)) >= 0 && w->s[i].len) {
            sh_seq *s = &w->s[i];
            uint32_t p0 = tu_rng_below(&w->r, s->len); /* (in a dropped front: refused, then the rest) */
            verify_range(w, s, tu_rng_below(&w->r, NL), p0, 1 + tu_rng_below(&w->r, s->len - p0));
            w->n_ok[op]++;
        }
        break;
    case OP_PIN:
        if ((i = pick(w, 1, 0)) >= 0) do_pin(w, &w->s[i]);
        break;
    case OP_DROP:
        if ((i = pick(w, 1, 0)) >= 0) do_drop(w, &w->s[i]);
        break;
    case OP_UNPIN: {
        int cand[MAXS], n = 0;
        for (int j = 0; j < MAXS; j++)
            if (w->s[j].live && w->s[j].is_pin) cand[n++] = j;
        if (n) {
            i = cand[tu_rng_below(&w->r, (uint32_t)n)];
            TU_OK(pkv_pin_release(w->c, w->s[i].id));
            TRACE("unpin seq%d", i);
            bury(w, &w->s[i]);
            w->n_ok[op]++;
        }
        break;
    }
    case OP_MATCH:
        do_match(w);
        break;
    case OP_COMPACT:
        if (tu_rng_chance(&w->r, 0.25)) do_batch_compact(w);
        else if ((i = pick(w, 1, 0)) >= 0) do_compact(w, &w->s[i]);
        break;
    case OP_STALE:
        if (w->n_dead) {
            pkv_seq id = w->dead[tu_rng_below(&w->r, PKV_MIN_U(w->n_dead, 8))];
            pkv_stats st0 = tu_stats(w->c);
            int32_t t = 1;
            TU_RC(pkv_seq_append(w->c, id, &t, 1, NULL), PKV_ENOENT);
            TU_RC(pkv_seq_release(w->c, id), PKV_ENOENT);
            pkv_seq x;
            TU_RC(pkv_seq_fork(w->c, id, &x), PKV_ENOENT);
            pkv_stats st1 = tu_stats(w->c);
            TU_STATS_EQ(&st0, &st1);
            w->n_ok[op]++;
        }
        break;
    }
    check_world(w);
}

static void run(int prefix, uint64_t n_ops, uint64_t seed) {
    g_debug = (int)tu_env_u64("PKV_STRESS_DEBUG", 0);
    world *w = calloc(1, sizeof *w);
    w->prefix = prefix;
    tu_rng_seed(&w->r, seed);
    pkv_config cfg = tu_config(NBLK, B, NL, NH, HD, PKV_DTYPE_F32);
    cfg.enable_prefix_cache = prefix;
    cfg.max_seqs = MAXS;
    w->c = tu_create(&cfg);
    for (int b = 0; b < NBASE; b++)
        for (int p = 0; p < MAXLEN; p++) w->base[b][p] = (int32_t)tu_rng_below(&w->r, VOCAB);
    for (w->step = 0; w->step < n_ops; w->step++) {
        step(w);
        if (w->step % 997 == 0) verify_all(w);
        if (w->step % 50000 == 49999 && tu_rng_chance(&w->r, 0.5)) { /* occasionally start over */
            TU_OK(pkv_cache_reset(w->c));
            for (int i = 0; i < MAXS; i++)
                if (w->s[i].live) bury(w, &w->s[i]);
            memset(w->bc, 0, sizeof w->bc);
            check_world(w);
        }
    }
    verify_all(w);
    pkv_stats st = tu_stats(w->c);
    print_message("prefix %s, seed %llu: %llu ops; ok/fail: append %llu/%llu write %llu/%llu commit %llu fork %llu "
                  "truncate %llu release %llu gather %llu pin %llu match hit/miss %llu/%llu compact moved/not %llu/%llu "
                  "drop_front ok/refused %llu/%llu; cow %llu evictions %llu peak %u\n",
                  prefix ? "on" : "off", (unsigned long long)seed, (unsigned long long)n_ops,
                  (unsigned long long)w->n_ok[OP_APPEND], (unsigned long long)w->n_fail[OP_APPEND],
                  (unsigned long long)w->n_ok[OP_WRITE], (unsigned long long)w->n_fail[OP_WRITE],
                  (unsigned long long)w->n_ok[OP_COMMIT], (unsigned long long)w->n_ok[OP_FORK],
                  (unsigned long long)w->n_ok[OP_TRUNCATE], (unsigned long long)w->n_ok[OP_RELEASE],
                  (unsigned long long)w->n_ok[OP_GATHER], (unsigned long long)w->n_ok[OP_PIN],
                  (unsigned long long)w->n_ok[OP_MATCH], (unsigned long long)w->n_fail[OP_MATCH],
                  (unsigned long long)w->n_ok[OP_COMPACT], (unsigned long long)w->n_fail[OP_COMPACT],
                  (unsigned long long)w->n_ok[OP_DROP], (unsigned long long)w->n_fail[OP_DROP],
                  (unsigned long long)st.cow_copies, (unsigned long long)st.evictions, st.peak_active);
    /* the run must have exercised the paths it exists for */
    assert_true(w->n_fail[OP_APPEND] > 0 || n_ops < 20000); /* exhaustion */
    assert_true(st.cow_copies > 0 || n_ops < 20000);
    if (prefix) assert_true(st.evictions > 0 || n_ops < 20000);
    if (prefix) assert_true(w->n_ok[OP_MATCH] > 0 || n_ops < 20000);
    assert_true(w->n_ok[OP_COMPACT] > 0 || n_ops < 20000);
    if (prefix) assert_true(w->n_compact_evicted > 0 || n_ops < 20000);
    assert_true(w->n_batch_moved > 0 || n_ops < 20000);
    assert_true(w->n_ok[OP_DROP] > 0 || prefix || n_ops < 20000);
    pkv_cache_destroy(w->c);
    uint64_t n_dev = w->n_dev;
    char first[200];
    memcpy(first, w->first_dev, sizeof first);
    free(w);
    if (n_dev) print_message("%llu write(s) refused under the per-block commit rule; first at %s\n",
                             (unsigned long long)n_dev, first);
    if (STRESS_SEQ_LEVEL_COMMIT && n_dev)
        fail_msg("%llu K/V write(s) that pkv.h allows were refused (BUGS-core.md #3); first at %s",
                 (unsigned long long)n_dev, first);
}

/* The generation before g, 0 skipped (ids never have generation 0). */
static uint32_t gen_before(uint32_t g) { return g - 1u ? g - 1u : UINT32_MAX; }

/* A slot whose generations are used up is retired, not wrapped: ids of it stay stale forever
 * (pkv.h), the slot no longer counts in max_seqs, the checker agrees, and a reset keeps it
 * retired. A slot counts up from its cache's base generation and past 2^32 - 1 to 1 (never 0),
 * so it is used up one short of its base again. The generation is moved near its end through
 * the internals (2^32 cycles take minutes). */
static void test_generation_used_up(void **state) {
    (void)state;
    pkv_config cfg = tu_config(8, 4, 1, 1, 32, PKV_DTYPE_F32);
    cfg.max_seqs = 2;
    pkv_cache *c = tu_create(&cfg);
    const uint32_t base = c->gen_base, last = gen_before(base);
    assert_int_not_equal(base, 0);
    assert_int_equal(c->seqs[0].gen, base);
    assert_int_equal(c->seqs[1].gen, base);
    c->seqs[0].gen = gen_before(last); /* slot 0 is the free list's head */
    pkv_seq s1 = tu_seq(c);
    assert_int_equal(s1, (uint64_t)gen_before(last) << 32);
    TU_OK(pkv_seq_release(c, s1));
    pkv_seq s2 = tu_seq(c); /* slot 0 again, its last generation */
    assert_int_equal(s2, (uint64_t)last << 32);
    TU_OK(pkv_seq_release(c, s2));
    TU_CHECK(c);
    pkv_seq x = tu_seq(c), y = PKV_SEQ_NONE;
    assert_int_equal(x & 0xffffffffu, 1);
    assert_int_equal(pkv_seq_create(c, NULL, 0, &y), PKV_ELIMIT); /* slot 0 is gone */
    pkv_seq_info in;
    assert_int_equal(pkv_seq_get_info(c, s1, &in), PKV_ENOENT);
    assert_int_equal(pkv_seq_get_info(c, s2, &in), PKV_ENOENT);
    assert_int_equal(pkv_seq_release(c, s2), PKV_ENOENT);
    TU_OK(pkv_cache_reset(c));
    TU_CHECK(c);
    y = tu_seq(c);
    assert_int_equal(y & 0xffffffffu, 1);
    assert_int_equal(pkv_seq_create(c, NULL, 0, &x), PKV_ELIMIT);
    pkv_cache_destroy(c);
}

/* Past generation 2^32 - 1 a slot goes on at 1, not 0 (0 is no id's); and caches created one
 * after another start their generations far apart, so a handle of one is refused by the other
 * even where the same slot is live there. */
static void test_generation_wraps_and_caches_differ(void **state) {
    (void)state;
    pkv_config cfg = tu_config(8, 4, 1, 1, 32, PKV_DTYPE_F32);
    cfg.max_seqs = 2;
    pkv_cache *a = tu_create(&cfg), *b = tu_create(&cfg);
    assert_int_not_equal(a->gen_base, b->gen_base);
    const uint32_t d = b->gen_base - a->gen_base;
    assert_true(d > (1u << 24) && d < UINT32_MAX - (1u << 24)); /* far apart, either way round */
    pkv_seq sa = tu_seq(a), sb = tu_seq(b);
    assert_int_equal(sa & 0xffffffffu, sb & 0xffffffffu);
    assert_int_not_equal(sa, sb);
    pkv_seq_info in;
    assert_int_equal(pkv_seq_get_info(a, sb, &in), PKV_ENOENT);
    assert_int_equal(pkv_seq_get_info(b, sa, &in), PKV_ENOENT);
    TU_OK(pkv_seq_release(a, sa));
    if (a->gen_base != 1u) { /* base 1 retires at 2^32 - 1: test_generation_used_up's case */
        a->seqs[0].gen = UINT32_MAX; /* slot 0 heads the free list again */
        pkv_seq s = tu_seq(a);
        assert_int_equal(s, (uint64_t)UINT32_MAX << 32);
        TU_OK(pkv_seq_release(a, s));
        s = tu_seq(a);
        assert_int_equal(s, (uint64_t)1 << 32);
        TU_OK(pkv_seq_get_info(a, s, &in));
        TU_CHECK(a);
    }
    pkv_cache_destroy(a);
    pkv_cache_destroy(b);
}

static void test_stress_prefix_off(void **state) {
    (void)state;
    uint64_t n = tu_env_u64("PKV_STRESS_OPS", 200000);
    run(0, n / 2, tu_env_u64("PKV_STRESS_SEED", 1));
}

static void test_stress_prefix_on(void **state) {
    (void)state;
    uint64_t n = tu_env_u64("PKV_STRESS_OPS", 200000);
    run(1, n - n / 2, tu_env_u64("PKV_STRESS_SEED", 1) + 1000);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_generation_used_up),
        cmocka_unit_test(test_generation_wraps_and_caches_differ),
        cmocka_unit_test(test_stress_prefix_off),
        cmocka_unit_test(test_stress_prefix_on),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
