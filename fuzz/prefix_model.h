/* prefix_model.h: a shadow model of a pagedkv cache (token history per sequence, K/V as a pure
 * function of the prefix) and a byte-driven interpreter of API calls over it, shared by the
 * libFuzzer target (fuzz/fuzz_api.c) and the seeded randomized test (tests/test_prefix_random.c).
 *
 * The oracle: the K/V written at position p of a sequence is a deterministic function of
 * (layer, K or V, head, dim, H(salt, tokens[0..p])). So a correct prefix reuse (same namespace,
 * same tokens) gathers exactly the values the sequence would hold had it computed them itself,
 * and any wrong reuse (other tenant, other tokens, stale or overwritten block) shows up as a
 * value mismatch. Values are k/8 with |k| <= 128: exact in f32, f16 and bf16.
 *
 * After every call the interpreter runs pkv_cache_check, gathers every layer of every live
 * sequence and compares with the model, and compares the stats it can predict. Its attention
 * step (pm_op_attn) runs decode or ragged prefill over some live sequences and compares each
 * output and log-sum-exp with a double-precision reference over the model's K/V, or makes a
 * call with one bad input and checks its status and that nothing was written. With a host tier
 * behind the cache (pm_tier_on), its saves and its loads (plain, windowed, after a match): what
 * a load gives is checked as any sequence's K/V is, and each block it gives must have been
 * saved. Public API only.
 * Header-only (static functions) so both users compile it without build-system changes. */
#ifndef PKV_PREFIX_MODEL_H
#define PKV_PREFIX_MODEL_H

#include "pkv.h"

/* cache_int.h's test hook: shared-prefix groups of at least min_blocks blocks (0: none), a scratch
 * of rows query rows (0: all it holds) */
void pkv__cache_test_share(pkv_cache *c, uint32_t min_blocks, uint32_t rows);

#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <dirent.h>
#include <unistd.h>
#include <string.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#define PM_MAX_SEQS 12    /* max_seqs of the cache: sequences and pins together */
#define PM_MAX_TOK 384    /* tokens per sequence the model holds */
#define PM_MAX_H 2        /* kv heads */
#define PM_MAX_D 4        /* head_dim */
#define PM_MAX_L 2        /* layers */
#define PM_N_PROMPTS 6
#define PM_PROMPT_MAX 72
#define PM_N_SALTS 4
#define PM_N_STALE 8
#define PM_ATTN_MAX_Q 256             /* queries of one attention call */
#define PM_ATTN_MAX_SEQS 20           /* its requests (more than max_seqs, PM_MAX_SEQS) */
#define PM_ATTN_MAX_HQ (2 * PM_MAX_H) /* query heads: 1 or 2 a kv head */

/* The oracle's arithmetic and comparison loops are not fuzzing targets: keep libFuzzer's
   comparison tracing out of them (it cost most of the run time), the library stays instrumented. */
#if defined(__clang__) && __clang_major__ >= 13
#define PM_NOCOV __attribute__((no_sanitize("coverage")))
#else
#define PM_NOCOV
#endif

typedef struct pm_seq {
    pkv_seq id;
    int live, is_pin, salt;
    uint32_t len, committed;
    uint32_t dropped; /* positions [0, dropped) let go (pkv_seq_drop_front; a multiple of B) */
    int shifted;      /* a shift (pkv_seq_shift) moved positions [exact, len): their K/V are no
                         prefill of their ids, and s indexes and saves no block from exact / B on */
    uint32_t exact;
    int32_t tok[PM_MAX_TOK];
    uint64_t h[PM_MAX_TOK];  /* h[p] = H(salt, tok[0..p]): the identity of the prefix to p */
    uint64_t kv[PM_MAX_TOK]; /* the K/V position p holds: pm_val(kv[p], ...); h[p] where p was
                                computed in this sequence's own prefix, another's after a shift */
} pm_seq;

typedef struct pm_src {
    const uint8_t *p;
    size_t n, i;
    uint64_t rng;
    int use_rng, done;
} pm_src;

/* A consumer's mirror of a cache's prefix index, built from its events alone (pm_ev_drain) and
 * compared with a snapshot (pm_ev_compare): every STORED event's hash recomputed from its token
 * ids (the parent's hash as the seed, or one of the salts' roots), STORED new, REMOVED known and
 * a leaf, seqnos one by one but after an OVERFLOW (then rebuilt from a snapshot). */
#define PM_EV_MAX 1024 /* index entries at most (the pools here hold fewer blocks) */
#define PM_EV_B 16     /* block tokens at most */
typedef struct pm_ev_ent {
    uint64_t hash, parent;
    uint32_t depth, n_children;
    int32_t toks[PM_EV_B];
} pm_ev_ent;

typedef struct pm_ev {
    pm_ev_ent e[PM_EV_MAX];
    uint32_t n, B;
    uint64_t last_seqno;
    uint64_t n_stored, n_removed, n_cleared, n_overflow;
    /* scratch */
    pkv_event ev[PM_EV_MAX];
    int32_t toks[PM_EV_MAX * PM_EV_B];
} pm_ev;

/* A set of hashes (open addressing; once half full, no longer kept: full, and then unknown). */
typedef struct pm_hset {
    uint64_t *slot;
    uint32_t n;
    int full;
} pm_hset;

typedef struct pm_world {
    pkv_cache *c;
    pm_ev *ev; /* the event mirror, when cfg.event_capacity > 0 (pm_init) */
    pkv_config cfg;
    uint32_t B, max_tok;
    pm_seq s[PM_MAX_SEQS];
    pkv_seq stale[PM_N_STALE];
    uint32_t n_stale;
    int32_t prompt[PM_N_PROMPTS][PM_PROMPT_MAX];
    uint32_t prompt_len[PM_N_PROMPTS];
    /* what the model predicts of the stats */
    uint64_t lookups, tokens_hit, tokens_queried;
    /* coverage, so a test can insist the workload did exercise reuse */
    uint64_t n_steps, n_matches, n_full_block_hits, n_partial_hits, n_root_hits, n_enospc, n_forks, n_pins, n_truncs;
    uint64_t n_compact_moved; /* blocks pkv_seq_compact moved */
    uint64_t n_drops;         /* pkv_seq_drop_front calls taken */
    uint64_t n_window_matches, n_window_fronts; /* pkv_seq_match_prefix_window calls taken, those that dropped a front */
    uint64_t n_tomb_matches;  /* matches made while the index held tombstones */
    uint64_t n_attn_front;    /* attention calls checked over a sequence with a dropped front */
    uint64_t n_attn_masked;   /* prefill calls checked through pkv_attn_prefill_masked */
    /* attention calls checked, their queries, bad calls, calls with out == q */
    uint64_t n_attn, n_attn_queries, n_attn_bad, n_attn_in_place;
    uint64_t n_attn_shared; /* attention calls that read a shared prefix once for a group */
    /* a host tier behind the cache (pm_tier_on; NULL: no tier ops), and the identities (the
       model's hash of a block's last position) of the blocks any save may have stored (a load
       gives no other) and of those a save surely stored (a plain load gives all it can reach) */
    pkv_tier *tier;
    int tier_thread; /* the tier's thread runs (pm_tier_on): prefetches, write-back */
    char tier_dir[200]; /* a file tier's directory ("": none) */
    pm_hset saved, sure;
    uint64_t n_tier_saves, n_tier_saved_blocks, n_tier_loads, n_tier_loaded_blocks, n_tier_window_loads,
        n_tier_window_fronts, n_tier_reloads, n_tier_async, n_tier_prefetches;
    uint64_t n_tier_bounded; /* loads held to what the store surely had */
    uint64_t n_tier_window_bounded; /* windowed loads into empty sequences so held */
    int shift_on;             /* pkv_seq_shift among the ops (pm_op_shift) */
    uint64_t n_shifts, n_shift_moves, n_shift_copies; /* shifts taken, those that moved rows, blocks they copied */
    char err[600];
    int trace; /* print every call to stderr (PM_TRACE=1 in the tests, -trace in the fuzzer) */
    /* scratch */
    float kbuf[PM_MAX_TOK * PM_MAX_H * PM_MAX_D], vbuf[PM_MAX_TOK * PM_MAX_H * PM_MAX_D];
    float kexp[PM_MAX_TOK * PM_MAX_H * PM_MAX_D], vexp[PM_MAX_TOK * PM_MAX_H * PM_MAX_D];
    int32_t slots[PM_MAX_TOK], table[PM_MAX_TOK];
    float aq[PM_ATTN_MAX_Q * PM_ATTN_MAX_HQ * PM_MAX_D], aout[PM_ATTN_MAX_Q * PM_ATTN_MAX_HQ * PM_MAX_D];
    float alse[PM_ATTN_MAX_Q * PM_ATTN_MAX_HQ];
} pm_world;

static const char *const pm_salts[PM_N_SALTS] = {"", "tenant-a", "tenant-b", "tenant-a\0x"};
static const size_t pm_salt_lens[PM_N_SALTS] = {0, 8, 8, 10};

PM_NOCOV static inline uint64_t pm_mix(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

PM_NOCOV static inline uint64_t pm_root(int salt) { return pm_mix(0x5A17ull * 131 + (uint64_t)salt); }
PM_NOCOV static inline uint64_t pm_next(uint64_t prev, int32_t tok, uint32_t pos) {
    return pm_mix(prev ^ pm_mix((uint64_t)(uint32_t)tok * 0x100000001B3ull + pos));
}

/* The K (kv = 0) or V (kv = 1) element of one position: k/8, k in [-128, 127]. */
PM_NOCOV static inline float pm_val(uint64_t h, uint32_t layer, uint32_t kv, uint32_t head, uint32_t d) {
    uint64_t x = pm_mix(h ^ ((uint64_t)layer << 40 | (uint64_t)kv << 32 | (uint64_t)head << 16 | d));
    return (float)((int)(x & 255) - 128) / 8.0f;
}

static inline uint32_t pm_byte(pm_src *s) {
    if (s->use_rng) {
        s->rng = pm_mix(s->rng);
        return (uint32_t)(s->rng >> 56);
    }
    if (s->i < s->n) return s->p[s->i++];
    s->done = 1;
    return 0;
}
static inline uint32_t pm_u16(pm_src *s) { return pm_byte(s) | pm_byte(s) << 8; }
static inline uint32_t pm_below(pm_src *s, uint32_t n) { return n ? pm_u16(s) % n : 0; }

static int pm_fail(pm_world *w, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int pm_fail(pm_world *w, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int k = snprintf(w->err, sizeof w->err, "step %llu: ", (unsigned long long)w->n_steps);
    vsnprintf(w->err + k, sizeof w->err - (size_t)k, fmt, ap);
    va_end(ap);
    return -1;
}

#define PM_TR(w, ...)                                                                              \
    do {                                                                                           \
        if ((w)->trace) fprintf(stderr, __VA_ARGS__);                                              \
    } while (0)
#define PM_SI(w, q) ((int)((q) - (w)->s))

#define PM_EXPECT(w, cond, ...)                                                                    \
    do {                                                                                           \
        if (!(cond)) return pm_fail((w), __VA_ARGS__);                                             \
    } while (0)

static inline int pm_ev_find(const pm_ev *m, uint64_t h) {
    for (uint32_t i = 0; i < m->n; i++)
        if (m->e[i].hash == h) return (int)i;
    return -1;
}

/* Whether a STORED or REMOVED event's hash is its tokens' under its parent (or a root's). */
PM_NOCOV static inline int pm_ev_hash_ok(const pm_ev *m, const pkv_event *e, const int32_t *toks) {
    if (e->depth) return XXH3_64bits_withSeed(toks, m->B * sizeof(int32_t), e->parent_hash) == e->hash;
    for (int s = 0; s < PM_N_SALTS; s++) {
        uint64_t h;
        size_t n;
        if (pkv_prefix_hashes(pm_salts[s], pm_salt_lens[s], m->B, toks, m->B, &h, 1, &n) == 0 && h == e->hash)
            return 1;
    }
    return 0;
}

/* m := the index now (a snapshot: the ring forgotten with it), or -1 with w->err said. */
PM_NOCOV static inline int pm_ev_snapshot(pm_world *w, pm_ev *m) {
    size_t n = 0;
    int rc = pkv_prefix_snapshot(w->c, m->ev, PM_EV_MAX, m->toks, &n);
    PM_EXPECT(w, rc == 0, "pkv_prefix_snapshot: %s", pkv_strerror(rc));
    m->n = 0;
    for (size_t i = 0; i < n; i++) {
        pm_ev_ent *x = &m->e[m->n++];
        x->hash = m->ev[i].hash, x->parent = m->ev[i].parent_hash, x->depth = m->ev[i].depth, x->n_children = 0;
        memcpy(x->toks, m->toks + i * m->B, m->B * sizeof(int32_t));
        if (!m->ev[i].depth) continue;
        int p = pm_ev_find(m, m->ev[i].parent_hash);
        PM_EXPECT(w, p >= 0 && (uint32_t)p < m->n - 1, "snapshot: block %zu before its parent", i);
        m->e[p].n_children++;
    }
    return 0;
}

/* Applies every held event to m, checking each. */
PM_NOCOV static inline int pm_ev_drain(pm_world *w, pm_ev *m) {
    for (;;) {
        size_t n = 0;
        int rc = pkv_cache_take_events(w->c, m->ev, 64, m->toks, &n);
        PM_EXPECT(w, rc == 0 && n <= 64, "pkv_cache_take_events: %s", pkv_strerror(rc));
        if (!n) return 0;
        for (size_t i = 0; i < n; i++) {
            const pkv_event *e = &m->ev[i];
            const int32_t *t = m->toks + i * m->B;
            PM_EXPECT(w, e->kind == PKV_EVENT_OVERFLOW || !m->last_seqno || e->seqno == m->last_seqno + 1,
                      "event seqno %llu after %llu", (unsigned long long)e->seqno, (unsigned long long)m->last_seqno);
            m->last_seqno = e->seqno;
            if (e->kind == PKV_EVENT_OVERFLOW) {
                m->n_overflow++;
                PM_EXPECT(w, e->lost >= 1, "OVERFLOW of %llu lost", (unsigned long long)e->lost);
                m->last_seqno = 0; /* the snapshot forgets the ring: a gap follows */
                if (pm_ev_snapshot(w, m) < 0) return -1;
                break; /* the snapshot holds what the rest of this batch said */
            }
            if (e->kind == PKV_EVENT_CLEARED) {
                m->n = 0, m->n_cleared++;
                continue;
            }
            const int at = pm_ev_find(m, e->hash), pa = e->depth ? pm_ev_find(m, e->parent_hash) : -1;
            if (e->kind == PKV_EVENT_STORED) {
                m->n_stored++;
                PM_EXPECT(w, at < 0 && m->n < PM_EV_MAX, "STORED %016llx twice", (unsigned long long)e->hash);
                PM_EXPECT(w, pm_ev_hash_ok(m, e, t), "STORED %016llx: not its tokens' hash", (unsigned long long)e->hash);
                PM_EXPECT(w, e->depth ? pa >= 0 && m->e[pa].depth + 1 == e->depth : e->parent_hash == 0,
                          "STORED %016llx at depth %u without its parent", (unsigned long long)e->hash, e->depth);
                if (pa >= 0) m->e[pa].n_children++;
                pm_ev_ent *x = &m->e[m->n++];
                x->hash = e->hash, x->parent = e->parent_hash, x->depth = e->depth, x->n_children = 0;
                memcpy(x->toks, t, m->B * sizeof(int32_t));
            } else {
                PM_EXPECT(w, e->kind == PKV_EVENT_REMOVED, "event kind %u", e->kind);
                m->n_removed++;
                PM_EXPECT(w, at >= 0, "REMOVED %016llx unknown", (unsigned long long)e->hash);
                const pm_ev_ent *x = &m->e[at];
                PM_EXPECT(w, x->n_children == 0 && x->parent == e->parent_hash && x->depth == e->depth &&
                                 !memcmp(x->toks, t, m->B * sizeof(int32_t)),
                          "REMOVED %016llx: not the leaf STORED", (unsigned long long)e->hash);
                if (pa >= 0) m->e[pa].n_children--;
                m->e[at] = m->e[--m->n];
            }
        }
    }
}

/* The drained mirror equals the index (a snapshot: which also empties the drained ring). */
PM_NOCOV static inline int pm_ev_compare(pm_world *w, const pm_ev *m) {
    static pm_ev snap;
    snap.B = m->B;
    if (pm_ev_snapshot(w, &snap) < 0) return -1;
    PM_EXPECT(w, snap.n == m->n, "events say %u indexed blocks, the index holds %u", m->n, snap.n);
    for (uint32_t i = 0; i < snap.n; i++) {
        const int at = pm_ev_find(m, snap.e[i].hash);
        PM_EXPECT(w, at >= 0, "indexed %016llx: no event said so", (unsigned long long)snap.e[i].hash);
        const pm_ev_ent *x = &m->e[at];
        PM_EXPECT(w, x->parent == snap.e[i].parent && x->depth == snap.e[i].depth &&
                         x->n_children == snap.e[i].n_children && !memcmp(x->toks, snap.e[i].toks, m->B * sizeof(int32_t)),
                  "indexed %016llx: not as its events said", (unsigned long long)snap.e[i].hash);
    }
    return 0;
}

/* Config choice from one byte: block size, pool dtype, pool size; prefix cache on unless
 * `prefix_off`. */
static inline pkv_config pm_config(uint32_t b0, uint32_t b1, int prefix_off) {
    static const uint32_t bs[4] = {4, 1, 3, 16};
    static const pkv_dtype dt[3] = {PKV_DTYPE_F16, PKV_DTYPE_F32, PKV_DTYPE_BF16};
    pkv_config cfg = pkv_config_default();
    cfg.n_layers = 1 + (b0 >> 7);
    cfg.n_kv_heads = PM_MAX_H;
    cfg.head_dim = PM_MAX_D;
    cfg.block_tokens = bs[b0 & 3];
    cfg.k_dtype = dt[(b0 >> 2) % 3];
    cfg.v_dtype = dt[((b0 >> 2) + (b0 >> 4)) % 3];
    cfg.n_blocks = 6 + b1 % 48;
    if (cfg.block_tokens == 1) cfg.n_blocks *= 3;
    uint32_t cap = PM_MAX_TOK / cfg.block_tokens;
    cfg.max_blocks_per_seq = cfg.n_blocks < cap ? cfg.n_blocks : cap;
    cfg.max_seqs = PM_MAX_SEQS;
    cfg.n_threads = 1;
    cfg.huge_pages = 0;
    cfg.enable_prefix_cache = !prefix_off;
    /* events: off, a ring of 5 (overflows all along) or of 512, by b1 (each pool size meets
       all three over b1's range) */
    const uint32_t ev = (b1 / 48 + b1) % 3;
    cfg.event_capacity = ev == 0 ? 0 : ev == 1 ? 5 : 512;
    return cfg;
}

/* Prompts that share prefixes: P1 and P2 extend P0's first 21 and 9 tokens, P4 extends P3,
 * P5 is P0 plus a tail. Small vocabulary so random appends sometimes coincide with them. P4
 * holds a media's ids at [26, 38) (negative, as pkv_media_tokens makes), from three values, so
 * that a divergence inside it leaves a few agreeing: the match's media guard. */
static inline void pm_make_prompts(pm_world *w, uint64_t seed) {
    uint64_t r = seed;
#define PM_TOK() ((int32_t)((r = pm_mix(r)) % 24))
    w->prompt_len[0] = 37;
    for (uint32_t i = 0; i < 37; i++) w->prompt[0][i] = PM_TOK();
    w->prompt_len[1] = 45;
    memcpy(w->prompt[1], w->prompt[0], 21 * sizeof(int32_t));
    for (uint32_t i = 21; i < 45; i++) w->prompt[1][i] = 100 + PM_TOK();
    w->prompt_len[2] = 30;
    memcpy(w->prompt[2], w->prompt[0], 9 * sizeof(int32_t));
    for (uint32_t i = 9; i < 30; i++) w->prompt[2][i] = 200 + PM_TOK();
    w->prompt_len[3] = 20;
    for (uint32_t i = 0; i < 20; i++) w->prompt[3][i] = 300 + PM_TOK();
    w->prompt_len[4] = 52;
    memcpy(w->prompt[4], w->prompt[3], 20 * sizeof(int32_t));
    for (uint32_t i = 20; i < 52; i++) w->prompt[4][i] = 300 + PM_TOK();
    for (uint32_t i = 26; i < 38; i++) w->prompt[4][i] = -1 - PM_TOK() % 3; /* a media's ids */
    w->prompt[4][26] = INT32_MIN + PM_TOK() % 2;                              /* its first */
    w->prompt_len[5] = 70;
    memcpy(w->prompt[5], w->prompt[0], 37 * sizeof(int32_t));
    for (uint32_t i = 37; i < 70; i++) w->prompt[5][i] = PM_TOK();
#undef PM_TOK
}

static inline int pm_init(pm_world *w, const pkv_config *cfg, uint64_t prompt_seed) {
    memset(w, 0, sizeof *w);
    w->cfg = *cfg;
    w->B = cfg->block_tokens;
    w->max_tok = cfg->max_blocks_per_seq * cfg->block_tokens;
    if (w->max_tok > PM_MAX_TOK) w->max_tok = PM_MAX_TOK;
    pm_make_prompts(w, prompt_seed);
    int rc = pkv_cache_create(cfg, &w->c);
    if (rc < 0) return pm_fail(w, "pkv_cache_create: %s", pkv_strerror(rc));
    if (cfg->event_capacity && cfg->block_tokens <= PM_EV_B) {
        static pm_ev mirror; /* one world at a time (the tests' and the fuzzer's) */
        memset(&mirror, 0, sizeof mirror);
        mirror.B = cfg->block_tokens;
        w->ev = &mirror;
    }
    return 0;
}

static inline void pm_fini(pm_world *w) {
    pkv_tier_destroy(w->tier);
    if (w->tier_dir[0]) { /* a file tier's directory and its entries */
        DIR *d = opendir(w->tier_dir);
        char path[sizeof w->tier_dir + 300];
        for (struct dirent *e; d && (e = readdir(d));)
            if (e->d_name[0] != '.' && snprintf(path, sizeof path, "%s/%s", w->tier_dir, e->d_name) < (int)sizeof path)
                (void)unlink(path);
        if (d) closedir(d);
        (void)rmdir(w->tier_dir);
        w->tier_dir[0] = 0;
    }
    free(w->saved.slot);
    free(w->sure.slot);
    w->tier = NULL;
    w->saved.slot = w->sure.slot = NULL;
    pkv_cache_destroy(w->c);
    w->c = NULL;
    w->ev = NULL;
}

/* ---- a storage tier behind the cache ---- */
#define PM_SAVED_SLOTS (1u << 15)

/* Puts a tier behind w's cache, which enables the tier ops of pm_step: host memory, or files in
 * the directory dir (made; pm_fini removes it and its files), room for every entry (it never
 * drops one); with thread, its thread too (staging of 64 KiB: prefetched entries are dropped
 * for room often), for prefetches before loads and saves written back by it. */
static inline int pm_tier_on(pm_world *w, int thread, const char *dir) {
    int rc;
    if (dir) {
        if (strlen(dir) >= sizeof w->tier_dir) return pm_fail(w, "tier directory name too long");
        strcpy(w->tier_dir, dir);
        rc = pkv_tier_file_create(dir, 1ull << 30, NULL, &w->tier);
    } else {
        rc = pkv_tier_host_create(1ull << 30, NULL, &w->tier);
    }
    if (rc) return pm_fail(w, "pkv_tier_%s_create: %s", dir ? "file" : "host", pkv_strerror(rc));
    if (thread && (rc = pkv_tier_prefetch_start(w->tier, 64u << 10)))
        return pm_fail(w, "pkv_tier_prefetch_start: %s", pkv_strerror(rc));
    w->tier_thread = thread;
    w->saved.slot = (uint64_t *)calloc(PM_SAVED_SLOTS, sizeof(uint64_t));
    w->sure.slot = (uint64_t *)calloc(PM_SAVED_SLOTS, sizeof(uint64_t));
    if (!w->saved.slot || !w->sure.slot) return pm_fail(w, "no memory for the saved sets");
    return 0;
}

PM_NOCOV static inline void pm_hset_add(pm_hset *set, uint64_t h) {
    if (set->full || set->n >= PM_SAVED_SLOTS / 2) {
        set->full = 1;
        return;
    }
    h |= !h; /* (0 marks an empty slot) */
    for (uint32_t i = (uint32_t)h & (PM_SAVED_SLOTS - 1);; i = (i + 1) & (PM_SAVED_SLOTS - 1)) {
        if (set->slot[i] == h) return;
        if (!set->slot[i]) {
            set->slot[i] = h;
            set->n++;
            return;
        }
    }
}

/* Whether h is in the set: 1, 0, or -1 once the set is no longer kept. */
PM_NOCOV static inline int pm_hset_has(const pm_hset *set, uint64_t h) {
    if (set->full) return -1;
    h |= !h;
    for (uint32_t i = (uint32_t)h & (PM_SAVED_SLOTS - 1);; i = (i + 1) & (PM_SAVED_SLOTS - 1)) {
        if (set->slot[i] == h) return 1;
        if (!set->slot[i]) return 0;
    }
}

/* The blocks a save may have stored (by the hash of a block's last position), and those one
 * surely stored. */
PM_NOCOV static inline void pm_saved_add(pm_world *w, uint64_t h) { pm_hset_add(&w->saved, h); }
PM_NOCOV static inline int pm_saved_has(const pm_world *w, uint64_t h) { return pm_hset_has(&w->saved, h) != 0; }

static inline uint32_t pm_n_live(const pm_world *w) {
    uint32_t n = 0;
    for (int i = 0; i < PM_MAX_SEQS; i++) n += w->s[i].live;
    return n;
}

/* A live sequence (not a pin), chosen by the source, or NULL if none. */
static inline pm_seq *pm_pick(pm_world *w, pm_src *src, int want_pin) {
    uint32_t k = pm_byte(src);
    for (int j = 0; j < PM_MAX_SEQS; j++) {
        pm_seq *q = &w->s[(k + (uint32_t)j) % PM_MAX_SEQS];
        if (q->live && q->is_pin == want_pin) return q;
    }
    return NULL;
}

static inline pm_seq *pm_free_slot(pm_world *w) {
    for (int i = 0; i < PM_MAX_SEQS; i++)
        if (!w->s[i].live) return &w->s[i];
    return NULL;
}

PM_NOCOV static inline void pm_push_tokens(pm_seq *q, const int32_t *tok, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) {
        uint32_t p = q->len + i;
        q->tok[p] = tok[i];
        q->h[p] = pm_next(p ? q->h[p - 1] : pm_root(q->salt), tok[i], p);
        q->kv[p] = q->h[p];
    }
    q->len += n;
}

static inline void pm_add_stale(pm_world *w, pkv_seq id) {
    w->stale[w->n_stale % PM_N_STALE] = id;
    w->n_stale++;
}

/* One of the remembered released ids (n_stale > 0), chosen by the source. */
static inline pkv_seq pm_stale_id(pm_world *w, pm_src *src) {
    return w->stale[pm_below(src, w->n_stale < PM_N_STALE ? w->n_stale : PM_N_STALE)];
}

/* Whether bytes [from, n) of p all still hold PM_UNTOUCHED (the pattern pm_op_attn fills its
 * outputs with). */
#define PM_UNTOUCHED 0x5a
PM_NOCOV static inline int pm_untouched(const void *p, size_t from, size_t n) {
    for (size_t i = from; i < n; i++)
        if (((const uint8_t *)p)[i] != PM_UNTOUCHED) return 0;
    return 1;
}

/* Writes the model's K/V of positions [start, start + n) of q at `slots`, every layer. */
PM_NOCOV static inline int pm_write(pm_world *w, pm_seq *q, uint32_t start, uint32_t n, const int32_t *slots) {
    const uint32_t H = w->cfg.n_kv_heads, D = w->cfg.head_dim;
    for (uint32_t l = 0; l < w->cfg.n_layers; l++) {
        for (uint32_t i = 0; i < n; i++)
            for (uint32_t h = 0; h < H; h++)
                for (uint32_t d = 0; d < D; d++) {
                    w->kbuf[(i * H + h) * D + d] = pm_val(q->kv[start + i], l, 0, h, d);
                    w->vbuf[(i * H + h) * D + d] = pm_val(q->kv[start + i], l, 1, h, d);
                }
        /* odd steps write by position (pkv_seq_write_kv): the same rows, the same contract */
        int rc = w->n_steps % 2 ? pkv_seq_write_kv(w->c, q->id, l, start, n, w->kbuf, w->vbuf, PKV_DTYPE_F32)
                                : pkv_write_kv(w->c, l, slots, n, w->kbuf, w->vbuf, PKV_DTYPE_F32);
        PM_EXPECT(w, rc == 0, "%s layer %u of %u fresh positions [%u,%u): %s",
                  w->n_steps % 2 ? "seq_write_kv" : "write_kv", l, n, start, start + n, pkv_strerror(rc));
        if (w->n_steps % 4 == 3) { /* and the rows as stored, out and back in (bit for bit: pm_verify) */
            rc = pkv_seq_read_stored(w->c, q->id, l, start, n, w->kbuf, w->vbuf);
            if (!rc) rc = pkv_seq_write_stored(w->c, q->id, l, start, n, w->kbuf, w->vbuf);
            PM_EXPECT(w, rc == 0, "stored rows of layer %u, positions [%u,%u): %s", l, start, start + n,
                      pkv_strerror(rc));
        }
    }
    return 0;
}

/* The cache agrees with the model: checker, per-sequence info and gathered K/V, stats. */
PM_NOCOV static inline int pm_verify(pm_world *w) {
    char msg[256] = "";
    int rc = pkv_cache_check(w->c, msg, sizeof msg);
    PM_EXPECT(w, rc == 0, "pkv_cache_check: %s (%s)", pkv_strerror(rc), msg);
    const uint32_t H = w->cfg.n_kv_heads, D = w->cfg.head_dim;
    uint64_t n_tokens = 0;
    uint32_t n_seqs = 0, n_pins = 0;
    for (int i = 0; i < PM_MAX_SEQS; i++) {
        pm_seq *q = &w->s[i];
        if (!q->live) continue;
        if (q->is_pin) {
            n_pins++;
            continue;
        }
        n_seqs++;
        n_tokens += q->len;
        pkv_seq_info info;
        rc = pkv_seq_get_info(w->c, q->id, &info);
        PM_EXPECT(w, rc == 0, "get_info: %s", pkv_strerror(rc));
        PM_EXPECT(w, info.n_tokens == q->len && info.n_committed == q->committed,
                  "seq %d: cache says len %u committed %u, model %u %u", i, info.n_tokens, info.n_committed, q->len,
                  q->committed);
        PM_EXPECT(w, info.n_blocks == (q->len + w->B - 1) / w->B, "seq %d: %u blocks for %u tokens", i, info.n_blocks,
                  q->len);
        PM_EXPECT(w, info.n_dropped == q->dropped, "seq %d: %u positions dropped, model %u", i, info.n_dropped,
                  q->dropped);
        if (q->len == q->dropped) continue;
        for (uint32_t l = 0; l < w->cfg.n_layers; l++) { /* (kbuf from the front's end: its row 0 is position dropped) */
            rc = pkv_seq_gather(w->c, q->id, l, q->dropped, q->len - q->dropped, w->kbuf, w->vbuf);
            PM_EXPECT(w, rc == 0, "gather: %s", pkv_strerror(rc));
            for (uint32_t p = q->dropped; p < q->len; p++)
                for (uint32_t h = 0; h < H; h++)
                    for (uint32_t d = 0; d < D; d++) {
                        size_t o = ((size_t)(p - q->dropped) * H + h) * D + d;
                        float ke = pm_val(q->kv[p], l, 0, h, d), ve = pm_val(q->kv[p], l, 1, h, d);
                        PM_EXPECT(w, w->kbuf[o] == ke && w->vbuf[o] == ve,
                                  "seq %d layer %u pos %u head %u dim %u: K %g V %g, expected %g %g (len %u, "
                                  "committed %u)",
                                  i, l, p, h, d, w->kbuf[o], w->vbuf[o], ke, ve, q->len, q->committed);
                    }
        }
    }
    pkv_stats st;
    rc = pkv_cache_get_stats(w->c, &st);
    PM_EXPECT(w, rc == 0, "get_stats: %s", pkv_strerror(rc));
    PM_EXPECT(w, st.n_free + st.n_cached + st.n_active == st.n_blocks && st.n_blocks == w->cfg.n_blocks,
              "stats: free %u + cached %u + active %u != %u", st.n_free, st.n_cached, st.n_active, st.n_blocks);
    PM_EXPECT(w, st.n_seqs == n_seqs && st.n_pins == n_pins, "stats: %u seqs %u pins, model %u %u", st.n_seqs,
              st.n_pins, n_seqs, n_pins);
    PM_EXPECT(w, st.n_tokens == n_tokens, "stats: n_tokens %llu, model %llu", (unsigned long long)st.n_tokens,
              (unsigned long long)n_tokens);
    /* with the prefix cache off, whether a match counts as a lookup is left open */
    PM_EXPECT(w, (st.prefix_lookups == w->lookups || !w->cfg.enable_prefix_cache) && st.prefix_tokens_hit == w->tokens_hit,
              "stats: lookups %llu hit %llu, model %llu %llu", (unsigned long long)st.prefix_lookups,
              (unsigned long long)st.prefix_tokens_hit, (unsigned long long)w->lookups,
              (unsigned long long)w->tokens_hit);
    PM_EXPECT(w, st.prefix_tokens_hit <= st.prefix_tokens_queried, "stats: hit %llu > queried %llu",
              (unsigned long long)st.prefix_tokens_hit, (unsigned long long)st.prefix_tokens_queried);
    PM_EXPECT(w, st.n_cached <= st.n_indexed, "stats: %u cached but %llu indexed", st.n_cached,
              (unsigned long long)st.n_indexed);
    if (!w->cfg.enable_prefix_cache)
        PM_EXPECT(w, st.n_indexed == 0 && st.n_cached == 0 && st.prefix_tokens_hit == 0,
                  "prefix cache off but %llu indexed", (unsigned long long)st.n_indexed);
    if (w->ev && (pm_ev_drain(w, w->ev) < 0 || pm_ev_compare(w, w->ev) < 0)) return -1;
    return 0;
}

/* Appends n tokens to q (and writes their K/V); checks the all-or-nothing contract on failure.
 * Returns 0 (appended), 1 (refused as allowed), -1 (broken contract). */
static inline int pm_append(pm_world *w, pm_seq *q, const int32_t *tok, uint32_t n) {
    pkv_stats before, after;
    pkv_seq_info ib, ia;
    if (pkv_cache_get_stats(w->c, &before) < 0 || pkv_seq_get_info(w->c, q->id, &ib) < 0)
        return pm_fail(w, "stats/info before append");
    uint32_t counted = UINT32_MAX;
    const int rc_count = pkv_seq_append_blocks(w->c, q->id, n, &counted);
    /* every third step's appends go through pkv_batch_append, one request: the same contract */
    int rc;
    if (w->n_steps % 3 == 0) {
        const pkv_append_req rq = {q->id, tok, n, w->slots};
        uint32_t done = 99;
        rc = pkv_batch_append(w->c, &rq, 1, 0, &done);
        PM_EXPECT(w, done == (rc ? 99u : 1u), "batch append: n_done %u, status %s", done, pkv_strerror(rc));
    } else {
        rc = pkv_seq_append(w->c, q->id, tok, n, w->slots);
    }
    PM_TR(w, "   s%d append(%u) to %u -> %s (counted %u)\n", PM_SI(w, q), n, q->len, pkv_strerror(rc), counted);
    /* the count says what the append does: ELIMIT alike, else ENOSPC iff more than can be had */
    PM_EXPECT(w,
              rc_count == PKV_ELIMIT ? rc == PKV_ELIMIT
                                     : rc_count == PKV_OK && rc != PKV_ELIMIT &&
                                           (rc == PKV_ENOSPC) == (counted > before.n_free + before.n_cached),
              "append %u to len %u: %s, append_blocks %s counted %u of %u", n, q->len, pkv_strerror(rc),
              pkv_strerror(rc_count), counted, before.n_free + before.n_cached);
    uint32_t new_len = q->len + n;
    uint32_t need = (new_len + w->B - 1) / w->B - (q->len + w->B - 1) / w->B; /* without CoW */
    uint32_t avail = before.n_free + before.n_cached;
    int over_limit = (new_len + w->B - 1) / w->B > w->cfg.max_blocks_per_seq;
    if (rc < 0) {
        PM_EXPECT(w, (rc == PKV_ELIMIT && over_limit) || (rc == PKV_ENOSPC && need + 1 > avail),
                  "append %u to len %u: %s (need %u, avail %u, over_limit %d)", n, q->len, pkv_strerror(rc), need,
                  avail, over_limit);
        if (pkv_cache_get_stats(w->c, &after) < 0 || pkv_seq_get_info(w->c, q->id, &ia) < 0)
            return pm_fail(w, "stats/info after append");
        PM_EXPECT(w,
                  ia.n_tokens == ib.n_tokens && ia.n_blocks == ib.n_blocks && after.n_free == before.n_free &&
                      after.n_cached == before.n_cached && after.evictions == before.evictions &&
                      after.cow_copies == before.cow_copies,
                  "failed append changed state");
        if (rc == PKV_ENOSPC) w->n_enospc++;
        return 1;
    }
    PM_EXPECT(w, rc == 0, "append: %s", pkv_strerror(rc));
    PM_EXPECT(w, !over_limit && need <= avail, "append past the limits succeeded (need %u avail %u)", need, avail);
    uint32_t nb = 0;
    rc = pkv_seq_block_table(w->c, q->id, w->table, PM_MAX_TOK, &nb);
    PM_EXPECT(w, rc == 0 && nb == (new_len + w->B - 1) / w->B, "block_table: %s, %u blocks", pkv_strerror(rc), nb);
    for (uint32_t i = 0; i < n; i++) {
        uint32_t p = q->len + i;
        PM_EXPECT(w, w->slots[i] == w->table[p / w->B] * (int32_t)w->B + (int32_t)(p % w->B),
                  "append slot of pos %u is %d, table says block %d", p, w->slots[i], w->table[p / w->B]);
    }
    uint32_t start = q->len;
    pm_push_tokens(q, tok, n);
    return pm_write(w, q, start, n, w->slots) < 0 ? -1 : 0;
}

/* New sequence with a salt; 1 if the cache is full (allowed), -1 on a broken contract. */
static inline int pm_create(pm_world *w, int salt, pm_seq **out) {
    pm_seq *q = pm_free_slot(w);
    pkv_seq id = 0;
    int rc = pkv_seq_create(w->c, pm_salts[salt], pm_salt_lens[salt], &id);
    if (!q) {
        PM_EXPECT(w, rc == PKV_ELIMIT, "create with %u live: %s, expected ELIMIT", pm_n_live(w), pkv_strerror(rc));
        return 1;
    }
    PM_EXPECT(w, rc == 0 && id != 0, "create: %s", pkv_strerror(rc));
    memset(q, 0, offsetof(pm_seq, tok));
    q->id = id;
    q->live = 1;
    q->salt = salt;
    *out = q;
    return 0;
}

/* One prompt from the source: a stored prompt, a length, maybe one changed token. */
static inline uint32_t pm_prompt(pm_world *w, pm_src *src, int32_t *out) {
    uint32_t k = pm_byte(src) % PM_N_PROMPTS;
    uint32_t n = 1 + pm_below(src, w->prompt_len[k]);
    if (pm_byte(src) & 1) n = w->prompt_len[k]; /* whole prompts more often */
    if (n > w->max_tok) n = w->max_tok;
    memcpy(out, w->prompt[k], n * sizeof(int32_t));
    uint32_t m = pm_byte(src);
    if (m < 48 && n) /* diverge inside some block (inside the media: another media id) */
        out[m % n] = out[m % n] < 0 ? -100 - (int32_t)(m % 3) : 1000 + (int32_t)(m % 3);
    else if (k == 4 && m >= 128 && n > 30) /* P4's media diverging after 1 to 3 of its ids */
        out[27 + m % 3] = -100 - (int32_t)(m % 3);
    return n;
}

enum {
    PM_OP_MATCH,
    PM_OP_CREATE_PROMPT,
    PM_OP_APPEND,
    PM_OP_COMMIT,
    PM_OP_FORK,
    PM_OP_TRUNCATE,
    PM_OP_RELEASE,
    PM_OP_PIN,
    PM_OP_UNPIN,
    PM_OP_NEGATIVE,
    PM_OP_REWRITE,
    PM_OP_MATCH2,
    PM_OP_ATTN,
    PM_OP_COMPACT,
    PM_OP_DROP,
    PM_OP_COUNT,
    /* with a tier (pm_tier_on) only: drawn from PM_OP_COUNT_TIER ops, so that the corpus's
       inputs without one keep their meaning */
    PM_OP_TIER_SAVE = PM_OP_COUNT,
    PM_OP_TIER_LOAD,
    PM_OP_COUNT_TIER
};
/* with shifts on (w->shift_on), one op more past those: pm_op_shift */

/* The attention oracle: query row qv (Hq heads x D) at position pos of q, layer l, in double
 * from the model's K/V (exact in every pool dtype the model uses), into ref (Hq x D) and lse. */
PM_NOCOV static inline float pm_bf16(float x) { /* to bf16, nearest even (pkv.h: PKV_ATTN_BF16_DOT) */
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&x, &u, sizeof x);
    return x;
}
/* Attention of one query over the keys at positions keys[0, nk) of q (the window is the
 * caller's). With bf16q, the queries times scale rounded to bf16 (the f32 product, as the kernels
 * round). */
PM_NOCOV static inline void pm_attn_ref_keys(const pm_world *w, const pm_seq *q, uint32_t l, const uint32_t *keys,
                                             uint32_t nk, uint32_t Hq, const pkv_attn_params *ap, const float *qv,
                                             int bf16q, double *ref, double *lse) {
    const uint32_t H = w->cfg.n_kv_heads, D = w->cfg.head_dim, G = Hq / H;
    const double scale = ap->scale > 0.0f ? ap->scale : 1.0 / sqrt((double)D);
    const float fscale = ap->scale > 0.0f ? ap->scale : 1.0f / sqrtf((float)D); /* as pkv_attn_* resolve it */
    static double sc[PM_MAX_TOK];
    for (uint32_t h = 0; h < Hq; h++) {
        double mx = -INFINITY, sum = 0.0;
        for (uint32_t x_ = 0; x_ < nk; x_++) {
            const uint32_t j = keys[x_];
            double x = 0.0;
            if (bf16q)
                for (uint32_t d = 0; d < D; d++) x += (double)pm_bf16(qv[h * D + d] * fscale) * pm_val(q->kv[j], l, 0, h / G, d);
            else {
                for (uint32_t d = 0; d < D; d++) x += (double)qv[h * D + d] * pm_val(q->kv[j], l, 0, h / G, d);
                x *= scale;
            }
            if (ap->softcap > 0.0f) x = ap->softcap * tanh(x / ap->softcap);
            sc[x_] = x;
            if (x > mx) mx = x;
        }
        if (ap->sinks && ap->sinks[h] > mx) mx = ap->sinks[h]; /* a key of value 0 */
        if (ap->sinks) sum = exp(ap->sinks[h] - mx);
        for (uint32_t d = 0; d < D; d++) ref[h * D + d] = 0.0;
        for (uint32_t x_ = 0; x_ < nk; x_++) {
            const uint32_t j = keys[x_];
            const double e = exp(sc[x_] - mx);
            sum += e;
            for (uint32_t d = 0; d < D; d++) ref[h * D + d] += e * pm_val(q->kv[j], l, 1, h / G, d);
        }
        if (!(sum > 0.0)) { /* no key and no sink (a mask's empty row): 0, lse -inf */
            lse[h] = -INFINITY;
            continue;
        }
        for (uint32_t d = 0; d < D; d++) ref[h * D + d] /= sum;
        lse[h] = mx + log(sum);
    }
}

/* The first key a query at pos sees: the window's, max(0, pos - window + 1), or its chunk's
 * first, pos - pos % attn_chunk, the later. */
PM_NOCOV static inline uint32_t pm_key_lo(const pkv_attn_params *ap, uint32_t pos) {
    const uint32_t w = ap->window && pos + 1 > ap->window ? pos + 1 - ap->window : 0;
    const uint32_t c = ap->attn_chunk ? pos / ap->attn_chunk * ap->attn_chunk : 0;
    return w > c ? w : c;
}

/* The same for a query at pos: keys [pm_key_lo, pos]. */
PM_NOCOV static inline void pm_attn_ref(const pm_world *w, const pm_seq *q, uint32_t l, uint32_t pos, uint32_t Hq,
                                        const pkv_attn_params *ap, const float *qv, int bf16q, double *ref,
                                        double *lse) {
    static uint32_t keys[PM_MAX_TOK];
    const uint32_t lo = pm_key_lo(ap, pos);
    for (uint32_t j = lo; j <= pos; j++) keys[j - lo] = j;
    pm_attn_ref_keys(w, q, l, keys, pos - lo + 1, Hq, ap, qv, bf16q, ref, lse);
}

/* An attention call's scale, soft-cap, window, chunks and lse (into w->alse) drawn from b and src. */
static inline pkv_attn_params pm_draw_params(pm_world *w, pm_src *src, uint32_t b) {
    pkv_attn_params ap = pkv_attn_params_default();
    ap.scale = b & 2 ? 0.0f : 0.125f * (float)(1 + b % 8);
    ap.softcap = b % 3 == 0 ? 4.0f + (float)(pm_byte(src) % 16) : 0.0f;
    ap.window = b % 5 == 0 ? 1 + pm_byte(src) % 20 : 0;
    ap.attn_chunk = b % 7 == 0 ? 1 + pm_byte(src) % 24 : 0;
    ap.lse = b & 4 ? w->alse : NULL;
    return ap;
}

/* Hq attention-sink logits of -8 .. 8, about where the logits lie, into sinks; returns sinks. */
static inline const float *pm_draw_sinks(pm_src *src, uint32_t Hq, float *sinks) {
    for (uint32_t h = 0; h < Hq; h++) sinks[h] = (float)((int)pm_byte(src) - 128) / 16.0f;
    return sinks;
}

/* n query elements into w->aq; out and lse start as a pattern a bad call must leave, and a good
 * one past its queries. */
static inline void pm_draw_queries(pm_world *w, pm_src *src, size_t n) {
    for (size_t i = 0; i < n; i++) w->aq[i] = (float)((int)pm_byte(src) - 128) / 64.0f;
    memset(w->aout, PM_UNTOUCHED, sizeof w->aout);
    memset(w->alse, PM_UNTOUCHED, sizeof w->alse);
}

/* Tree attention (pkv_attn_tree) over the last n positions of a live sequence as draft nodes of
 * a random tree (branches, chains, several roots), with random scale, soft-cap, window, lse and
 * sinks, compared with pm_attn_ref_keys over each node's prefix and path; or a parent outside
 * [-1, i), which must fail and leave out and lse as they were. */
static inline int pm_op_tree(pm_world *w, pm_src *src) {
    const uint32_t H = w->cfg.n_kv_heads, D = w->cfg.head_dim;
    pm_seq *q = pm_pick(w, src, 0);
    if (!q || !q->len) return 0;
    const uint32_t n = 1 + pm_below(src, q->len < 24 ? q->len : 24), q_start = q->len - n;
    int32_t par[24];
    uint32_t depth[24];
    for (uint32_t i = 0; i < n; i++) {
        const uint32_t b = pm_byte(src);
        par[i] = i == 0 || b < 30 ? -1 : b < 150 ? (int32_t)i - 1 : (int32_t)pm_below(src, i);
        depth[i] = par[i] < 0 ? 0 : depth[par[i]] + 1;
    }
    const uint32_t G = 1 + pm_byte(src) % 2, Hq = H * G, layer = pm_byte(src) % w->cfg.n_layers;
    const uint32_t b = pm_byte(src);
    pkv_attn_params ap = pm_draw_params(w, src, b);
    ap.n_q_heads = Hq;
    float sinks[PM_ATTN_MAX_HQ];
    if (b & 8) ap.sinks = pm_draw_sinks(src, Hq, sinks);
    pm_draw_queries(w, src, (size_t)n * Hq * D);
    const int bad = n > 1 && pm_byte(src) < 24;
    if (bad) par[1 + pm_below(src, n - 1)] = pm_byte(src) & 1 ? -2 : (int32_t)n; /* outside [-1, i) */
    if (q->dropped && q_start + 1 > q->dropped && (pm_byte(src) & 1)) /* the widest window the root takes */
        ap.window = q_start + 1 - q->dropped, ap.attn_chunk = 0;
    const pkv_attn_tree_req r = {.seq = q->id, .q_start = q_start, .n_nodes = n, .parent = par};
    const int front = pm_key_lo(&ap, q_start) < q->dropped; /* the root sees a dropped position */
    const int rc = pkv_attn_tree(w->c, layer, &r, 1, w->aq, w->aout, &ap);
    PM_TR(w, "   tree over seq %d's last %u positions (Hq %u, layer %u, window %u, chunk %u, sinks %d, bad %d, front %d) -> %s\n",
          PM_SI(w, q), n, Hq, layer, ap.window, ap.attn_chunk, ap.sinks != NULL, bad, front,
          pkv_strerror(rc));
    if (bad || front) {
        PM_EXPECT(w, rc == PKV_EINVAL, "tree with a bad parent or over a dropped front: %s", pkv_strerror(rc));
        PM_EXPECT(w, pm_untouched(w->aout, 0, sizeof w->aout), "tree with a bad parent wrote out");
        PM_EXPECT(w, pm_untouched(w->alse, 0, sizeof w->alse), "tree with a bad parent wrote lse");
        w->n_attn_bad++;
        return 0;
    }
    PM_EXPECT(w, rc == 0, "tree over seq %d: %s", PM_SI(w, q), pkv_strerror(rc));
    PM_EXPECT(w, pm_untouched(w->aout, (size_t)n * Hq * D * sizeof(float), sizeof w->aout),
              "tree wrote out past its %u nodes", n);
    double ref[PM_ATTN_MAX_HQ * PM_MAX_D], lse[PM_ATTN_MAX_HQ];
    static uint32_t keys[PM_MAX_TOK];
    for (uint32_t i = 0; i < n; i++) {
        const uint32_t pos = q_start + depth[i];
        uint32_t nk = 0;
        const uint32_t lo = pm_key_lo(&ap, pos); /* a node's window and chunk from its position */
        for (uint32_t t = lo; t < q_start; t++) keys[nk++] = t;
        for (int32_t j = (int32_t)i; j >= 0; j = par[j])
            if (q_start + depth[j] >= lo) keys[nk++] = q_start + (uint32_t)j;
        pm_attn_ref_keys(w, q, layer, keys, nk, Hq, &ap, w->aq + (size_t)i * Hq * D, 0, ref, lse);
        for (uint32_t e = 0; e < Hq * D; e++)
            PM_EXPECT(w, fabs((double)w->aout[(size_t)i * Hq * D + e] - ref[e]) <= 5e-4,
                      "tree seq %d node %u (of %u, q_start %u) head %u dim %u: %.7g, reference %.7g", PM_SI(w, q), i,
                      n, q_start, e / D, e % D, (double)w->aout[(size_t)i * Hq * D + e], ref[e]);
        if (ap.lse)
            for (uint32_t h = 0; h < Hq; h++)
                PM_EXPECT(w, fabs((double)w->alse[(size_t)i * Hq + h] - lse[h]) <= 1e-4 * (1.0 + fabs(lse[h])),
                          "tree lse seq %d node %u head %u: %.7g, reference %.7g", PM_SI(w, q), i, h,
                          (double)w->alse[(size_t)i * Hq + h], lse[h]);
    }
    w->n_attn++;
    w->n_attn_queries += n;
    w->n_attn_front += q->dropped > 0;
    return 0;
}

/* The ids a match ending before prompt[r] gives back (pkv.h, pkv_media_tokens: a match that
 * would end 1 to 3 ids into a media the prompt goes on with ends before them): where prompt[r]
 * is a media's id other than its first (those are below -2^30) and 1 to 3 of that media's ids
 * come before r, back to its first, their count; else 0. */
static inline uint32_t pm_media_trim(const int32_t *prompt, uint32_t n, uint32_t r) {
    const int32_t first_max = -(INT32_C(1) << 30) - 1;
    if (r >= n || prompt[r] >= 0 || prompt[r] <= first_max) return 0;
    uint32_t run = 0;
    while (run < r && prompt[r - 1 - run] < 0) {
        if (++run >= 4) return 0;
        if (prompt[r - run] <= first_max) break; /* the media's first */
    }
    return run;
}

/* Attention over the live sequences: a decode or a ragged prefill batch of some of them, with
 * random parameters, compared with pm_attn_ref; or a call with one bad input, which must fail
 * with its status and leave out and lse as they were. */
static inline int pm_op_attn(pm_world *w, pm_src *src) {
    const uint32_t H = w->cfg.n_kv_heads, D = w->cfg.head_dim;
    pm_seq *pick[PM_ATTN_MAX_SEQS];
    uint32_t n = 0, want = 1 + pm_byte(src) % 8, k0 = pm_byte(src);
    for (int j = 0; j < PM_MAX_SEQS && n < want; j++) {
        pm_seq *q = &w->s[(k0 + (uint32_t)j) % PM_MAX_SEQS];
        if (q->live && !q->is_pin && q->len) pick[n++] = q;
    }
    if (!n) return 0;
    if (pm_byte(src) < 32) /* repeats, past max_seqs: a batch the cache runs in groups */
        for (uint32_t m = n; n < PM_ATTN_MAX_SEQS; n++) pick[n] = pick[pm_below(src, m)];
    const uint32_t G = 1 + pm_byte(src) % 2, Hq = H * G, layer = pm_byte(src) % w->cfg.n_layers;
    const uint32_t b = pm_byte(src);
    pkv_attn_params ap = pm_draw_params(w, src, b);
    ap.n_q_heads = G == 1 && (b & 1) ? 0 : Hq;
    float sinks[PM_ATTN_MAX_HQ];
    if (pm_byte(src) & 1) ap.sinks = pm_draw_sinks(src, Hq, sinks);
    const int prefill = pm_byte(src) & 1;
    /* bf16 arithmetic allowed (decode, and prefill in both the row and the transposed kernels) */
    if (b & 16) ap.flags = PKV_ATTN_BF16_DOT;
    const int used = ap.flags && pkv_attn_flags_used(w->c);
    const int bf16q = used && w->cfg.k_dtype == PKV_DTYPE_BF16, bf16p = used && w->cfg.v_dtype == PKV_DTYPE_BF16;
    pkv_seq seqs[PM_ATTN_MAX_SEQS];
    pkv_attn_req reqs[PM_ATTN_MAX_SEQS];
    uint32_t nq = 0;
    for (uint32_t i = 0; i < n; i++) {
        seqs[i] = pick[i]->id;
        uint32_t len = pick[i]->len, q0 = len - 1, m = 1;
        if (prefill) {
            q0 = pm_below(src, len);
            m = 1 + pm_below(src, len - q0);
            if (pm_byte(src) < 40) q0 = len - 1, m = 1; /* a decode beside the extends */
            else if (pm_byte(src) < 20) m = 0;          /* an empty request */
            if (m > PM_ATTN_MAX_Q - nq) m = PM_ATTN_MAX_Q - nq;
        }
        reqs[i] = (pkv_attn_req){.seq = pick[i]->id, .q_start = q0, .n_q = m};
        nq += m;
    }
    /* over dropped fronts, half the time the widest window every request's first query takes
       (else the call is refused, below) */
    uint32_t fit = UINT32_MAX, fronts = 0;
    for (uint32_t i = 0; i < n; i++) {
        const uint32_t q0 = prefill ? reqs[i].q_start : pick[i]->len - 1;
        fronts += pick[i]->dropped > 0;
        const uint32_t wi = q0 + 1 > pick[i]->dropped ? q0 + 1 - pick[i]->dropped : 0; /* 0: none fits */
        if (wi < fit) fit = wi;
    }
    if (fronts && fit && (pm_byte(src) & 1)) ap.window = fit, ap.attn_chunk = 0;
    /* non-causal (PKV_ATTN_NONCAUSAL, without a window or chunks): every query over the whole
       sequence, q_start 0 */
    const int noncausal = prefill && (b & 32) && !ap.window && !ap.attn_chunk;
    if (noncausal) {
        ap.flags |= PKV_ATTN_NONCAUSAL;
        for (uint32_t i = 0; i < n; i++) {
            reqs[i].q_start = 0;
            if (pm_byte(src) < 64 && nq < PM_ATTN_MAX_Q) { /* more queries than the sequence has positions */
                uint32_t more = 1 + pm_below(src, 8);
                if (more > PM_ATTN_MAX_Q - nq) more = PM_ATTN_MAX_Q - nq;
                reqs[i].n_q += more, nq += more;
            }
        }
    }
    pm_draw_queries(w, src, (size_t)nq * Hq * D);
    const uint32_t bad = pm_byte(src) < 48 ? 1 + pm_byte(src) % 8 : 0;
    int want_rc = 0;
    uint32_t l = layer;
    const float *qp = w->aq;
    if (bad == 1) l = w->cfg.n_layers, want_rc = PKV_EINVAL;
    if (bad == 2) ap.n_q_heads = Hq + 1, want_rc = PKV_EINVAL; /* not a multiple of H (2) */
    if (bad == 3) { /* no q, or lse over q's second float (overlaps other than out == q fail) */
        if ((b & 8) && nq) ap.lse = w->aq + 1;
        else qp = NULL;
        want_rc = PKV_EINVAL;
    }
    if (bad == 4 && (b & 8)) { /* a sink that is not finite */
        for (uint32_t h = 0; h < Hq; h++) sinks[h] = 0.0f;
        sinks[pm_below(src, Hq)] = pm_byte(src) & 1 ? NAN : -INFINITY;
        ap.sinks = sinks, want_rc = PKV_EINVAL;
    } else if (bad == 4)
        ap.softcap = -1.0f, want_rc = PKV_EINVAL;
    if (bad == 5 && w->n_stale) {
        seqs[n - 1] = reqs[n - 1].seq = pm_stale_id(w, src);
        want_rc = PKV_ENOENT;
    }
    if (bad == 6 && noncausal) reqs[n - 1].q_start = 1, want_rc = PKV_EINVAL; /* q_start past 0 */
    else if (bad == 6 && prefill) reqs[n - 1].n_q = pick[n - 1]->len - reqs[n - 1].q_start + 1, want_rc = PKV_EINVAL;
    if (bad == 7 && nq) { /* a query element that is not finite (NaN, +inf or -inf), or whose
                             magnitude times scale (at least 2^-3 here) is past PKV_VALUE_MAX */
        static const float refused[5] = {NAN, INFINITY, -INFINITY, 1e30f, -0x1p60f};
        w->aq[pm_below(src, nq * Hq * D)] = refused[pm_byte(src) % 5];
        want_rc = PKV_EINVAL;
    }
    if (bad == 8) ap.flags = 8u, want_rc = PKV_EINVAL; /* a flag pkv.h does not define */
    /* non-causal queries past the positions a sequence may hold (pkv.h: max_blocks_per_seq x
       block_tokens), as the queries added above make of a full sequence; requests are checked in
       order, a stale id (bad 5, the last) before its own count */
    for (uint32_t i = 0; noncausal && i < n && want_rc != PKV_EINVAL; i++)
        if (!(bad == 5 && want_rc == PKV_ENOENT && i == n - 1) &&
            reqs[i].n_q > (uint64_t)w->cfg.max_blocks_per_seq * w->B)
            want_rc = PKV_EINVAL;
    /* custom masks (pkv_attn_prefill_masked) for some requests (NULL for the others), where the
       call has no window or chunks, over keys [0, q_start + n_q) or (non-causal) the sequence:
       the reference's own rule (causal, or every key), random bits (dense or sparse), causal
       within two documents; now and then a row cleared (it sees nothing). The reference then
       takes each row's keys (pm_attn_ref_keys) */
    static uint8_t mbits[PM_ATTN_MAX_Q * (PM_MAX_TOK + 1) / 8 + PM_ATTN_MAX_SEQS];
    const uint8_t *masks[PM_ATTN_MAX_SEQS] = {NULL};
    uint32_t mask_len[PM_ATTN_MAX_SEQS] = {0}; /* a mask's rows: kv_len bits */
    const int masked = prefill && !ap.window && !ap.attn_chunk && (pm_byte(src) & 3) == 0;
    for (size_t i = 0, at = 0; masked && i < n; i++) {
        const uint64_t kv = noncausal ? pick[i]->len : (uint64_t)reqs[i].q_start + reqs[i].n_q;
        const uint64_t bytes = ((uint64_t)reqs[i].n_q * kv + 7) / 8;
        const uint32_t shape = pm_byte(src) % 5, edge = kv ? pm_below(src, (uint32_t)kv) : 0;
        if (shape == 4 || kv > pick[i]->len || at + bytes > sizeof mbits) continue;
        uint8_t *m = mbits + at;
        memset(m, 0, bytes);
        for (uint64_t j = 0; j < reqs[i].n_q; j++) {
            const uint64_t p = reqs[i].q_start + j;
            const int cleared = pm_byte(src) < 16;
            for (uint64_t t = 0; t < kv && !cleared; t++) {
                const int on = shape == 0   ? noncausal || t <= p
                               : shape == 1 ? pm_byte(src) & 1
                               : shape == 2 ? pm_byte(src) < 32
                                            : t <= p && (t < edge) == (p < edge);
                if (on) m[(j * kv + t) >> 3] |= (uint8_t)(1u << ((j * kv + t) & 7u));
            }
        }
        masks[i] = m, mask_len[i] = (uint32_t)kv, at += bytes;
    }
    /* a request whose first query sees a dropped position (pkv_seq_drop_front) is refused; the
       sequences are checked in order, so one before a stale id (bad 5) says EINVAL first */
    for (uint32_t i = 0; i < n && want_rc != PKV_EINVAL; i++) {
        const uint32_t m = prefill ? reqs[i].n_q : 1, q0 = prefill ? reqs[i].q_start : pick[i]->len - 1;
        const int stale = bad == 5 && want_rc == PKV_ENOENT && i == n - 1;
        if (m && !stale && !masks[i] && (noncausal ? 0 : pm_key_lo(&ap, q0)) < pick[i]->dropped) want_rc = PKV_EINVAL;
    }
    /* a masked request's least key (none where its mask sets no bit) is checked after every
       request passed the rest */
    for (uint32_t i = 0; i < n && !want_rc; i++)
        for (uint64_t x = 0; masks[i] && x < (uint64_t)reqs[i].n_q * mask_len[i]; x++)
            if (masks[i][x >> 3] >> (x & 7u) & 1u && x % mask_len[i] < pick[i]->dropped) {
                want_rc = PKV_EINVAL;
                break;
            }
    if (!want_rc && b >= 192) { /* in place: out is q, the queries copied there first */
        memcpy(w->aout, w->aq, (size_t)nq * Hq * D * sizeof(float));
        qp = w->aout;
    }
    /* shared-prefix groups (decodes and extends): of any whole block, none, or by the default rule
       (512 positions); now and then a scratch of two queries' rows, so that groups are refused */
    const uint32_t shb = pm_byte(src), sh_min = shb % 3 == 0 ? 0 : shb % 3 == 1 ? 1 : (512 + w->B - 1) / w->B;
    pkv__cache_test_share(w->c, sh_min, shb & 64 ? 2 * Hq : 0);
    /* PKV_ATTN_F16_AS_BF16 now and then: at head_dim PM_MAX_D (not a multiple of 32) no backend
       takes it, so the results stay the reference's within the tolerance below */
    if (shb & 128) ap.flags |= PKV_ATTN_F16_AS_BF16;
    PM_EXPECT(w, !(pkv_attn_flags_used(w->c) & PKV_ATTN_F16_AS_BF16), "PKV_ATTN_F16_AS_BF16 used at head_dim %u", D);
    pkv_stats st0;
    PM_EXPECT(w, pkv_cache_get_stats(w->c, &st0) == 0, "pkv_cache_get_stats");
    int rc = masked    ? pkv_attn_prefill_masked(w->c, l, reqs, n, masks, qp, w->aout, &ap)
             : prefill ? pkv_attn_prefill(w->c, l, reqs, n, qp, w->aout, &ap)
                       : pkv_attn_decode(w->c, l, seqs, n, qp, w->aout, &ap);
    PM_TR(w,
          "   attn %s of %u seqs (%u queries, Hq %u, layer %u, scale %g cap %g window %u chunk %u lse %d, sinks %d,"
          " in place %d, flags %u (used %d), bad %u, share %u %d) -> %s\n",
          masked ? "masked prefill" : prefill ? "prefill" : "decode", n, nq, Hq, l, (double)ap.scale, (double)ap.softcap, ap.window,
          ap.attn_chunk, ap.lse != NULL, ap.sinks != NULL, qp == w->aout, ap.flags, used, bad, sh_min, (shb & 64) != 0, pkv_strerror(rc));
    pkv_stats st1;
    PM_EXPECT(w, pkv_cache_get_stats(w->c, &st1) == 0, "pkv_cache_get_stats");
    PM_EXPECT(w, st1.attn_shared_keys == st0.attn_shared_keys || (!rc && sh_min),
              "attn_shared_keys moved on a call that could not group (rc %d, share %u)", rc, sh_min);
    w->n_attn_shared += st1.attn_shared_keys != st0.attn_shared_keys;
    if (want_rc) {
        PM_EXPECT(w, rc == want_rc, "attn with bad input %u: %s, want %s", bad, pkv_strerror(rc), pkv_strerror(want_rc));
        PM_EXPECT(w, pm_untouched(w->aout, 0, sizeof w->aout), "attn with bad input %u wrote out", bad);
        PM_EXPECT(w, pm_untouched(w->alse, 0, sizeof w->alse), "attn with bad input %u wrote lse", bad);
        w->n_attn_bad++;
        return 0;
    }
    PM_EXPECT(w, rc == 0, "attn %s of %u seqs: %s", prefill ? "prefill" : "decode", n, pkv_strerror(rc));
    PM_EXPECT(w, pm_untouched(w->aout, (size_t)nq * Hq * D * sizeof(float), sizeof w->aout),
              "attn wrote out past its %u queries", nq);
    PM_EXPECT(w, pm_untouched(w->alse, ap.lse ? (size_t)nq * Hq * sizeof(float) : 0, sizeof w->alse),
              "attn wrote lse past its %u queries (or unasked)", nq);
    /* f32 arithmetic over at most PM_MAX_TOK keys of values up to 16; weights rounded to bf16 (bf16
       V under PKV_ATTN_BF16_DOT) move an output by up to 2^-8 of max |V| <= 16: twice that */
    const double tol = 5e-4 + (bf16p ? 16.0 / 128.0 : 0.0);
    double ref[PM_ATTN_MAX_HQ * PM_MAX_D], lse[PM_ATTN_MAX_HQ];
    size_t row = 0;
    for (uint32_t i = 0; i < n; i++)
        for (uint32_t t = 0; t < reqs[i].n_q; t++, row++) {
            const uint32_t pos = noncausal ? pick[i]->len - 1 : reqs[i].q_start + t; /* non-causal: the last's */
            if (masks[i]) { /* the keys its row sets */
                static uint32_t keys[PM_MAX_TOK];
                uint32_t nk = 0;
                for (uint32_t k = 0; k < mask_len[i]; k++) {
                    const uint64_t bit = (uint64_t)t * mask_len[i] + k;
                    if (masks[i][bit >> 3] >> (bit & 7u) & 1u) keys[nk++] = k;
                }
                pm_attn_ref_keys(w, pick[i], layer, keys, nk, Hq, &ap, w->aq + row * Hq * D, bf16q, ref, lse);
            } else
                pm_attn_ref(w, pick[i], layer, pos, Hq, &ap, w->aq + row * Hq * D, bf16q, ref, lse);
            for (uint32_t e = 0; e < Hq * D; e++) {
                const float o = w->aout[row * Hq * D + e];
                PM_EXPECT(w, fabs((double)o - ref[e]) <= tol,
                          "attn %s seq %d pos %u (len %u) head %u dim %u: %.7g, reference %.7g",
                          prefill ? "prefill" : "decode", PM_SI(w, pick[i]), pos, pick[i]->len, e / D, e % D,
                          (double)o, ref[e]);
            }
            if (ap.lse)
                for (uint32_t h = 0; h < Hq; h++)
                    PM_EXPECT(w, isinf(lse[h]) ? w->alse[row * Hq + h] == -INFINITY /* a row that saw nothing */
                                                : fabs((double)w->alse[row * Hq + h] - lse[h]) <= 1e-4 * (1.0 + fabs(lse[h])),
                              "attn lse seq %d pos %u head %u: %.7g, reference %.7g", PM_SI(w, pick[i]), pos, h,
                              (double)w->alse[row * Hq + h], lse[h]);
        }
    w->n_attn++;
    for (uint32_t i = 0; masked && i < n; i++)
        if (masks[i]) { /* a call whose masks all came out NULL is pkv_attn_prefill's */
            w->n_attn_masked++;
            break;
        }
    w->n_attn_queries += nq;
    w->n_attn_in_place += qp == w->aout;
    for (uint32_t i = 0; i < n; i++)
        if (pick[i]->dropped) {
            w->n_attn_front++;
            break;
        }
    return 0;
}

/* The front a windowed match of reused positions leaves (pkv_seq_match_prefix_window): the whole
 * blocks before the first key a query at reused sees, never past the last whole block matched. */
static inline uint32_t pm_window_front(const pm_world *w, uint32_t reused, uint32_t window) {
    const uint32_t first_key = reused - (reused < window - 1 ? reused : window - 1);
    const uint32_t last_full = reused / w->B ? reused / w->B - 1 : 0;
    return (first_key / w->B < last_full ? first_key / w->B : last_full) * w->B;
}

static inline int pm_op_match(pm_world *w, pm_src *src) {
    int32_t prompt[PM_PROMPT_MAX];
    int salt = (int)(pm_byte(src) % PM_N_SALTS);
    uint32_t n = pm_prompt(w, src, prompt);
    pm_seq *q = NULL;
    int r = pm_create(w, salt, &q);
    if (r) return r < 0 ? -1 : 0;
    pkv_stats before;
    if (pkv_cache_get_stats(w->c, &before) < 0) return pm_fail(w, "stats");
    uint32_t reused = 0xdeadbeef;
    /* a third of the matches under a window (pkv_seq_match_prefix_window: through tombstones,
       its front dropped) */
    const uint32_t window = pm_byte(src) % 3 == 0 ? 1 + pm_below(src, 3 * w->B) : 0;
    int rc = window ? pkv_seq_match_prefix_window(w->c, q->id, prompt, n, window, &reused)
                    : pkv_seq_match_prefix(w->c, q->id, prompt, n, &reused);
    PM_TR(w, "%llu: s%d = create(salt %d) + match(%u tokens, window %u) -> %s, reused %u\n",
          (unsigned long long)w->n_steps, PM_SI(w, q), salt, n, window, pkv_strerror(rc), reused);
    if (rc == PKV_ENOSPC) {
        /* only a token-granular copy needs a block; allowed only when none can be had */
        PM_EXPECT(w, before.n_free + before.n_cached == 0, "match: ENOSPC with %u free %u cached", before.n_free,
                  before.n_cached);
        w->lookups++; /* counted or not is unspecified: resync from the cache */
        pkv_stats st;
        if (pkv_cache_get_stats(w->c, &st) < 0) return pm_fail(w, "stats");
        w->lookups = st.prefix_lookups;
        w->tokens_queried = st.prefix_tokens_queried;
        PM_EXPECT(w, st.prefix_tokens_hit == w->tokens_hit, "ENOSPC match counted hits");
    } else {
        PM_EXPECT(w, rc == 0, "match of %u tokens: %s", n, pkv_strerror(rc));
        PM_EXPECT(w, reused <= n - 1, "match reused %u of %u tokens", reused, n);
        if (!w->cfg.enable_prefix_cache) PM_EXPECT(w, reused == 0, "prefix cache off, reused %u", reused);
        pkv_seq_info info;
        rc = pkv_seq_get_info(w->c, q->id, &info);
        PM_EXPECT(w, rc == 0 && info.n_reused == reused, "info.n_reused %u, match said %u", info.n_reused, reused);
        pm_push_tokens(q, prompt, reused);
        q->committed = reused;
        if (window) {
            const uint32_t front = pm_window_front(w, reused, window);
            PM_EXPECT(w, info.n_dropped == front, "windowed match (%u) of %u: front %u, want %u", window, reused,
                      info.n_dropped, front);
            q->dropped = info.n_dropped;
            w->n_window_matches++;
            if (before.n_tombstones) w->n_tomb_matches++;
            if (info.n_dropped) w->n_window_fronts++;
        }
        w->lookups++;
        w->tokens_queried += n;
        w->tokens_hit += reused;
        w->n_matches++;
        if (reused >= w->B) w->n_full_block_hits++;
        if (reused % w->B) w->n_partial_hits++;
        if (reused && reused < w->B) w->n_root_hits++; /* token-granular within block 0 */
        if (reused % w->B && !(reused == n - 1 && n % w->B == 0) &&
            !(reused < n && prompt[reused] < 0)) {
            /* the token-granular copy lives in a fresh, unshared block (unless the whole prompt
               matched: then the tail is the attached indexed block, length n - 1; or the media
               guard gave back the last few ids of a matched block, which stays attached: the
               match then ends before a media's id, its first where all it had matched went) */
            PM_EXPECT(w, info.n_shared <= info.n_blocks - 1, "partial tail block shared");
        }
    }
    if (pm_verify(w) < 0) return -1;
    if (rc == 0 && pm_byte(src) < 80 && pm_free_slot(w)) {
        /* the same lookup again at once must find at least as much: the first match holds its
           full blocks and registered its token-granular copy; only a missing block for the
           copy may cost the partial part */
        pkv_stats b2;
        if (pkv_cache_get_stats(w->c, &b2) < 0) return pm_fail(w, "stats");
        pm_seq *q2 = NULL;
        r = pm_create(w, salt, &q2);
        if (r) return r < 0 ? -1 : 0;
        uint32_t reused2 = 0xdeadbeef;
        rc = window ? pkv_seq_match_prefix_window(w->c, q2->id, prompt, n, window, &reused2)
                    : pkv_seq_match_prefix(w->c, q2->id, prompt, n, &reused2);
        PM_TR(w, "   s%d = create(salt %d) + same match -> %s, reused %u\n", PM_SI(w, q2), salt, pkv_strerror(rc),
              reused2);
        PM_EXPECT(w, rc == 0, "second match: %s", pkv_strerror(rc));
        if (window) {
            pkv_seq_info i2;
            PM_EXPECT(w, pkv_seq_get_info(w->c, q2->id, &i2) == 0 && i2.n_dropped == pm_window_front(w, reused2, window),
                      "same windowed match right after: front %u for %u", i2.n_dropped, reused2);
            q2->dropped = i2.n_dropped;
        }
        pkv_stats a2;
        if (pkv_cache_get_stats(w->c, &a2) < 0) return pm_fail(w, "stats");
        /* the blocks a copy could have had: those FREE or CACHED before, less the CACHED ones the
           match took back itself (its blocks from the front on; and its copy's, where it made
           one: then the match is the same, and either branch holds) */
        const uint32_t took = a2.n_active - b2.n_active;
        if (b2.n_free + b2.n_cached > took) {
            PM_EXPECT(w, reused2 == reused, "same match right after reused %u, first %u (%u free, %u cached, %u taken)",
                      reused2, reused, b2.n_free, b2.n_cached, took);
        } else { /* the full blocks, less the media ids a match may not end in there */
            const uint32_t full = reused / w->B * w->B, lo = full - pm_media_trim(prompt, n, full);
            PM_EXPECT(w, reused2 <= reused && reused2 >= lo,
                      "same match right after (no block free) reused %u, first %u (at least %u)", reused2, reused, lo);
        }
        pm_push_tokens(q2, prompt, reused2);
        q2->committed = reused2;
        w->lookups++;
        w->tokens_queried += n;
        w->tokens_hit += reused2;
        if (pm_verify(w) < 0) return -1;
    }
    /* compute the rest of the prompt, as an engine would, and commit some of it */
    if (q->len < n) {
        r = pm_append(w, q, prompt + q->len, n - q->len);
        if (r < 0) return -1;
    }
    uint32_t c = pm_byte(src) < 200 ? q->len : pm_below(src, q->len + 1);
    rc = pkv_seq_commit(w->c, q->id, c);
    PM_TR(w, "   s%d commit(%u) of %u -> %s\n", PM_SI(w, q), c, q->len, pkv_strerror(rc));
    PM_EXPECT(w, rc == 0, "commit %u of %u: %s", c, q->len, pkv_strerror(rc));
    if (c > q->committed) q->committed = c;
    return 0;
}


/* Whether any of tok[0, n) is a media's id (pkv_media_tokens: negative). */
PM_NOCOV static inline int pm_has_media(const int32_t *tok, uint32_t n) {
    for (uint32_t i = 0; i < n; i++)
        if (tok[i] < 0) return 1;
    return 0;
}

/* A tier load into q (empty, or as a match left it) of prompt[0, n): plain, or under window (0:
 * plain). Checks the status, the count, the front of a windowed load into an empty sequence,
 * that every block it gave was saved (the K/V it gave: pm_verify) and, where the pool has room,
 * that it gave at least what whole-prompt saves surely stored (w->sure); adds the positions to q.
 * With the tier's thread, prefetch 1 or 3 has the prompt prefetched first (3: and waited for).
 * *loaded: the positions it added. */
static inline int pm_tier_load_into(pm_world *w, pm_seq *q, const int32_t *prompt, uint32_t n, uint32_t window,
                                    uint32_t prefetch, uint32_t *loaded) {
    const uint32_t B = w->B, m = q->len;
    if (w->tier_thread && prefetch) { /* the prompt's entries staged first (or on their way) */
        const char *salt = pm_salts[q->salt];
        const size_t salt_len = pm_salt_lens[q->salt];
        const int pr = window && !m ? pkv_tier_prefetch_window(w->tier, w->c, salt, salt_len, prompt, n, window)
                                    : pkv_tier_prefetch(w->tier, w->c, salt, salt_len, prompt, n);
        PM_TR(w, "   tier prefetch%s(%u tokens) -> %s\n", window && !m ? "_window" : "", n, pkv_strerror(pr));
        PM_EXPECT(w, pr == 0 || pr == PKV_EBUSY, "tier prefetch: %s", pkv_strerror(pr));
        if (prefetch & 2) PM_EXPECT(w, pkv_tier_prefetch_wait(w->tier) == 0, "tier prefetch_wait");
        w->n_tier_prefetches++;
    }
    pkv_tier_stats tb, ta;
    pkv_stats pb;
    if (pkv_tier_get_stats(w->tier, &tb) < 0 || pkv_cache_get_stats(w->c, &pb) < 0) return pm_fail(w, "stats");
    uint32_t got = 0xdeadbeef;
    const int rc = window ? pkv_tier_load_window(w->tier, w->c, q->id, prompt, n, window, &got)
                          : pkv_tier_load(w->tier, w->c, q->id, prompt, n, &got);
    PM_TR(w, "   s%d tier load%s(%u tokens, window %u) from %u -> %s, loaded %u\n", PM_SI(w, q),
          window ? "_window" : "", n, window, m, pkv_strerror(rc), got);
    PM_EXPECT(w, rc == 0, "tier load of %u tokens (window %u) into %u: %s", n, window, m, pkv_strerror(rc));
    PM_EXPECT(w, m + got <= (n ? n - 1 : 0) || !got, "tier load gave %u past %u of %u tokens", got, m, n);
    if (pkv_tier_get_stats(w->tier, &ta) < 0) return pm_fail(w, "tier stats");
    /* a plain load (a windowed one into a sequence holding positions is one) of a text prompt into
       a sequence with no front gives the blocks from the one holding m on that a save surely
       stored, up to the first it did not, where the pool has room (a copy on write besides) */
    if (!(window && !m) && !q->dropped && n >= 2 && !pm_has_media(prompt, n)) {
        const uint32_t full = n / B < w->cfg.max_blocks_per_seq ? n / B : w->cfg.max_blocks_per_seq;
        uint64_t h = 0;
        uint32_t e = 0; /* the end (blocks) of what the store surely has from block m / B on */
        for (uint32_t p = 0; e < full; e++) {
            for (; p < (e + 1) * B; p++) h = pm_next(p ? h : pm_root(q->salt), prompt[p], p);
            if (e >= m / B && pm_hset_has(&w->sure, h) != 1) break;
        }
        const uint32_t target = e * B < n - 1 ? e * B : n - 1, need = (target + B - 1) / B - (m + B - 1) / B + 1;
        if (target > m && pb.n_free + pb.n_cached >= need) {
            PM_EXPECT(w, m + got >= target, "tier load from %u gave %u, but the store has blocks to %u (%u free, %u cached)",
                      m, got, e, pb.n_free, pb.n_cached);
            w->n_tier_bounded++;
        }
    }
    /* a windowed load of a text prompt into an empty sequence gives at least the latest window
       whose blocks a save surely stored, where the pool has room for any window it may try
       first (it tries the latest, then searches down from a block the store lacks) */
    if (window && !m && n >= 2 && !pm_has_media(prompt, n)) {
        const uint32_t full = n / B < w->cfg.max_blocks_per_seq ? n / B : w->cfg.max_blocks_per_seq;
        const uint32_t last = (n - 1 + B - 1) / B, E = full < last ? full : last; /* the latest end */
        uint64_t hb[PM_MAX_TOK], h = 0;
        for (uint32_t p = 0; p < E * B; p++) {
            h = pm_next(p ? h : pm_root(q->salt), prompt[p], p);
            if (p % B == B - 1) hb[p / B] = h;
        }
        uint32_t e = E, room = 0; /* room: the most blocks a window ending in [e, E] holds */
        for (; e; e--) {
            const uint32_t lo = pm_window_front(w, e * B < n - 1 ? e * B : n - 1, window) / B;
            if (e - lo > room) room = e - lo;
            uint32_t k = e;
            while (k > lo && pm_hset_has(&w->sure, hb[k - 1]) == 1) k--;
            if (k == lo) break;
        }
        const uint32_t target = e * B < n - 1 ? e * B : n - 1;
        if (e && pb.n_free + pb.n_cached >= room) {
            PM_EXPECT(w, got >= target,
                      "tier load (window %u) gave %u, but the store has the window ending at block %u (%u free, %u cached)",
                      window, got, e, pb.n_free, pb.n_cached);
            w->n_tier_window_bounded++;
        }
    }
    pkv_seq_info info;
    if (pkv_seq_get_info(w->c, q->id, &info) < 0) return pm_fail(w, "info");
    /* into an empty sequence under a window, the front as a windowed match of as many positions
       sets it (none where nothing loaded); else the sequence's front stays */
    const uint32_t front = window && !m ? (got ? pm_window_front(w, got, window) : 0) : q->dropped;
    PM_EXPECT(w, info.n_dropped == front, "tier load (window %u) of %u: front %u, want %u", window, got,
              info.n_dropped, front);
    PM_EXPECT(w, ta.loaded_tokens - tb.loaded_tokens == (got ? m + got - (m ? m : front) : 0),
              "tier stats: %llu positions loaded, the call says %u (from %u, front %u)",
              (unsigned long long)(ta.loaded_tokens - tb.loaded_tokens), got, m, front);
    pm_push_tokens(q, prompt + m, got);
    q->committed = q->len;
    q->dropped = front;
    /* each block the load gave (from the front, or the one holding m, on; the last may be part
       of a whole block of the prompt) was saved */
    uint64_t h = 0;
    for (uint32_t p = 0, i = (m ? m : front) / B; got && i < (q->len + B - 1) / B; i++) {
        for (; p < (i + 1) * B; p++) h = pm_next(p ? h : pm_root(q->salt), prompt[p], p);
        PM_EXPECT(w, pm_saved_has(w, h), "tier load gave block %u (positions to %u of %u), never saved", i, q->len, n);
    }
    w->n_tier_loads++;
    w->n_tier_loaded_blocks += ta.loaded_blocks - tb.loaded_blocks;
    if (window && !m) w->n_tier_window_loads++;
    if (front) w->n_tier_window_fronts++;
    *loaded = got;
    return 0;
}

/* The end (blocks) of what a save of q may store: its full committed blocks, none from the first
 * a shift moved on. */
static inline uint32_t pm_save_end(const pm_world *w, const pm_seq *q) {
    const uint32_t full = q->committed / w->B, cap = q->shifted ? q->exact / w->B : full;
    return full < cap ? full : cap;
}

/* pkv_tier_save of a live sequence: the cache unchanged; the count as stored; each full committed
 * block from the front on in the saved set. Of a sequence with no front and no media, every such
 * block is stored or found; then, sometimes, the prompt of its committed positions is loaded
 * into a new sequence (plain or windowed), which must give it all where the pool has room. With
 * the tier's thread, half the saves are written back by it (pkv_tier_save_async, sometimes
 * flushed at once); the others flush the writes queued before them first. */
static inline int pm_op_tier_save(pm_world *w, pm_src *src) {
    pm_seq *q = pm_pick(w, src, 0);
    if (!q) return 0;
    const uint32_t B = w->B;
    pkv_stats before, after;
    pkv_tier_stats tb, ta;
    if (pkv_cache_get_stats(w->c, &before) < 0) return pm_fail(w, "stats");
    const uint32_t how = pm_byte(src);
    if (w->tier_thread && (how & 1)) { /* written back by the tier's thread */
        uint32_t n_queued = 0xdeadbeef;
        const int rc = pkv_tier_save_async(w->tier, w->c, q->id, &n_queued);
        PM_TR(w, "%llu: s%d tier save_async (len %u, committed %u, front %u) -> %s, queued %u\n",
              (unsigned long long)w->n_steps, PM_SI(w, q), q->len, q->committed, q->dropped, pkv_strerror(rc),
              n_queued);
        PM_EXPECT(w, rc == 0, "tier save_async: %s", pkv_strerror(rc));
        const uint32_t from = q->dropped / B, full = pm_save_end(w, q);
        PM_EXPECT(w, n_queued <= (full > from ? full - from : 0), "tier save_async queued %u of %u..%u", n_queued, from,
                  full);
        for (uint32_t i = from; i < full; i++) pm_saved_add(w, q->h[(i + 1) * B - 1]);
        if (how & 2) PM_EXPECT(w, pkv_tier_flush(w->tier) == 0, "tier flush");
        w->n_tier_async++;
        return pm_verify(w);
    }
    /* (the writes queued before are put first: the thread's counts do not move under this) */
    if (w->tier_thread) PM_EXPECT(w, pkv_tier_flush(w->tier) == 0, "tier flush");
    if (pkv_tier_get_stats(w->tier, &tb) < 0) return pm_fail(w, "stats");
    uint32_t n_saved = 0xdeadbeef;
    int rc = pkv_tier_save(w->tier, w->c, q->id, &n_saved);
    PM_TR(w, "%llu: s%d tier save (len %u, committed %u, front %u) -> %s, saved %u\n", (unsigned long long)w->n_steps,
          PM_SI(w, q), q->len, q->committed, q->dropped, pkv_strerror(rc), n_saved);
    PM_EXPECT(w, rc == 0, "tier save: %s", pkv_strerror(rc));
    if (pkv_cache_get_stats(w->c, &after) < 0 || pkv_tier_get_stats(w->tier, &ta) < 0) return pm_fail(w, "stats");
    PM_EXPECT(w, after.n_free == before.n_free && after.n_cached == before.n_cached &&
                     after.evictions == before.evictions && after.n_indexed == before.n_indexed &&
                     after.n_tombstones == before.n_tombstones,
              "tier save changed the cache");
    const uint32_t from = q->dropped / B, full = pm_save_end(w, q), blocks = full > from ? full - from : 0;
    const uint64_t stored = ta.saved - tb.saved, present = ta.save_present - tb.save_present,
                   no_room = ta.save_no_room - tb.save_no_room;
    PM_EXPECT(w, n_saved == stored && no_room == 0 && stored + present <= blocks,
              "tier save: %u said, %llu stored, %llu present, %llu refused, of %u full committed blocks", n_saved,
              (unsigned long long)stored, (unsigned long long)present, (unsigned long long)no_room, blocks);
    const int whole = !q->dropped && !q->shifted && !pm_has_media(q->tok, q->committed);
    if (whole)
        PM_EXPECT(w, stored + present == blocks, "tier save of %u full committed blocks: %llu stored, %llu present",
                  blocks, (unsigned long long)stored, (unsigned long long)present);
    for (uint32_t i = from; i < full; i++) pm_saved_add(w, q->h[(i + 1) * B - 1]);
    for (uint32_t i = from; whole && i < full; i++) pm_hset_add(&w->sure, q->h[(i + 1) * B - 1]); /* (never dropped) */
    w->n_tier_saves++;
    w->n_tier_saved_blocks += stored;
    if (pm_verify(w) < 0) return -1;
    const uint32_t pick = pm_byte(src);
    if (!whole || q->committed < 2 || pick >= 96 || !pm_free_slot(w)) return 0;
    /* the same prompt again, into a new sequence of its namespace */
    static int32_t prompt[PM_MAX_TOK];
    const uint32_t n = q->committed, window = pick & 1 ? 1 + pm_below(src, 3 * B) : 0;
    memcpy(prompt, q->tok, n * sizeof(int32_t));
    pm_seq *q2 = NULL;
    int r = pm_create(w, q->salt, &q2);
    if (r) return r < 0 ? -1 : 0;
    PM_TR(w, "   s%d = create(salt %d)\n", PM_SI(w, q2), q2->salt);
    pkv_stats b2;
    if (pkv_cache_get_stats(w->c, &b2) < 0) return pm_fail(w, "stats");
    uint32_t got = 0;
    if (pm_tier_load_into(w, q2, prompt, n, window, (pick >> 2) & 3, &got) < 0) return -1;
    const uint32_t want = full * B < n - 1 ? full * B : n - 1;
    const uint32_t front = window ? pm_window_front(w, want, window) : 0, need = (want + B - 1) / B - front / B;
    if (b2.n_free + b2.n_cached >= need)
        PM_EXPECT(w, got == want, "tier load (window %u) right after its save: %u of %u positions, %u blocks to be had",
                  window, got, want, b2.n_free + b2.n_cached);
    w->n_tier_reloads++;
    return pm_verify(w);
}

/* A new sequence given a prompt from the tier: into it empty (plain or windowed), or after a
 * plain or windowed match (then a plain load, or pkv_tier_load_window, which is one there). */
static inline int pm_op_tier_load(pm_world *w, pm_src *src) {
    int32_t prompt[PM_PROMPT_MAX];
    const int salt = (int)(pm_byte(src) % PM_N_SALTS);
    const uint32_t n = pm_prompt(w, src, prompt), how = pm_byte(src) % 4;
    const uint32_t window = how & 1 ? 1 + pm_below(src, 3 * w->B) : 0;
    pm_seq *q = NULL;
    const int r = pm_create(w, salt, &q);
    if (r) return r < 0 ? -1 : 0;
    PM_TR(w, "%llu: s%d = create(salt %d) + tier load (how %u)\n", (unsigned long long)w->n_steps, PM_SI(w, q), salt,
          how);
    if (how >= 2) { /* a match first: the pool's blocks, then the tier's */
        pkv_stats st;
        uint32_t reused = 0xdeadbeef;
        const int rc = window ? pkv_seq_match_prefix_window(w->c, q->id, prompt, n, window, &reused)
                              : pkv_seq_match_prefix(w->c, q->id, prompt, n, &reused);
        PM_TR(w, "   s%d match(%u tokens, window %u) -> %s, reused %u\n", PM_SI(w, q), n, window, pkv_strerror(rc),
              reused);
        PM_EXPECT(w, rc == 0 || rc == PKV_ENOSPC, "match before a tier load: %s", pkv_strerror(rc));
        if (pkv_cache_get_stats(w->c, &st) < 0) return pm_fail(w, "stats");
        w->lookups = st.prefix_lookups; /* (pm_op_match checks the counts) */
        w->tokens_queried = st.prefix_tokens_queried;
        w->tokens_hit = st.prefix_tokens_hit;
        if (rc == 0) {
            pkv_seq_info info;
            if (pkv_seq_get_info(w->c, q->id, &info) < 0) return pm_fail(w, "info");
            pm_push_tokens(q, prompt, reused);
            q->committed = reused;
            q->dropped = info.n_dropped;
        }
    }
    uint32_t got = 0;
    if (pm_tier_load_into(w, q, prompt, n, window, pm_byte(src) % 4, &got) < 0) return -1;
    return pm_verify(w);
}

/* pkv_seq_shift of a live sequence (no rope: the rows move as stored, so pm_verify reads them
 * exactly): refused (nothing changed) where [from, to) is not within its positions past the front,
 * PKV_ENOSPC (nothing changed) only where fewer blocks can be had than it writes; else the
 * positions after to move down, their ids with them (the identities after from are those of
 * the new ids, the K/V the rows' own), the committed count loses the committed positions
 * removed, and from from on nothing is indexed or saved (the checker, pm_save_end) until a
 * truncate to the exact part. */
static inline int pm_op_shift(pm_world *w, pm_src *src) {
    pm_seq *q = pm_pick(w, src, 0);
    if (!q) return 0;
    const uint32_t B = w->B, from = pm_below(src, q->len + 1), to = from + pm_below(src, q->len - from + 3);
    pkv_stats before, after;
    if (pkv_cache_get_stats(w->c, &before) < 0) return pm_fail(w, "stats");
    const int rc = pkv_seq_shift(w->c, q->id, from, to, NULL);
    PM_TR(w, "%llu: s%d shift(%u, %u) of %u (committed %u, front %u) -> %s\n", (unsigned long long)w->n_steps,
          PM_SI(w, q), from, to, q->len, q->committed, q->dropped, pkv_strerror(rc));
    if (pkv_cache_get_stats(w->c, &after) < 0) return pm_fail(w, "stats");
    if (to > q->len || from < q->dropped) {
        PM_EXPECT(w, rc == PKV_EINVAL, "shift(%u, %u) of %u (front %u): %s", from, to, q->len, q->dropped,
                  pkv_strerror(rc));
        PM_EXPECT(w, memcmp(&before, &after, sizeof before) == 0, "a refused shift changed the statistics");
        return pm_verify(w);
    }
    const uint32_t d = to - from, len = q->len - d, nb = (len + B - 1) / B;
    if (rc == PKV_ENOSPC) {
        PM_EXPECT(w, d && to < q->len && before.n_free + before.n_cached < nb - from / B,
                  "shift(%u, %u) of %u: ENOSPC with %u free, %u cached", from, to, q->len, before.n_free,
                  before.n_cached);
        PM_EXPECT(w, memcmp(&before, &after, sizeof before) == 0, "a shift refused for room changed the statistics");
        w->n_enospc++;
        return pm_verify(w);
    }
    PM_EXPECT(w, rc == 0, "shift(%u, %u) of %u: %s", from, to, q->len, pkv_strerror(rc));
    if (!d) return pm_verify(w);
    if (to == q->len) { /* a truncate */
        if (q->shifted && from <= q->exact) q->shifted = 0;
    } else {
        q->exact = q->shifted && q->exact < from ? q->exact : from;
        q->shifted = 1;
        memmove(q->tok + from, q->tok + to, (q->len - to) * sizeof(int32_t));
        memmove(q->kv + from, q->kv + to, (q->len - to) * sizeof(uint64_t));
        for (uint32_t p = from; p < len; p++) q->h[p] = pm_next(p ? q->h[p - 1] : pm_root(q->salt), q->tok[p], p);
        w->n_shift_moves++;
        w->n_shift_copies += after.cow_copies - before.cow_copies;
    }
    q->committed = q->committed <= from ? q->committed : q->committed >= to ? q->committed - d : from;
    q->len = len;
    w->n_shifts++;
    return pm_verify(w);
}

static inline int pm_step(pm_world *w, pm_src *src) {
    w->n_steps++;
    const uint32_t n_ops = (w->tier ? (uint32_t)PM_OP_COUNT_TIER : (uint32_t)PM_OP_COUNT) + (w->shift_on ? 1 : 0);
    uint32_t op = pm_byte(src) % n_ops;
    if (w->shift_on && op == n_ops - 1) return pm_op_shift(w, src);
    int rc, r;
    switch (op) {
    case PM_OP_MATCH:
    case PM_OP_MATCH2:
        if (pm_op_match(w, src) < 0) return -1;
        break;
    case PM_OP_TIER_SAVE:
        if (pm_op_tier_save(w, src) < 0) return -1;
        break;
    case PM_OP_TIER_LOAD:
        if (pm_op_tier_load(w, src) < 0) return -1;
        break;
    case PM_OP_CREATE_PROMPT: { /* a sequence that computes its prompt without looking it up */
        int32_t prompt[PM_PROMPT_MAX];
        int salt = (int)(pm_byte(src) % PM_N_SALTS);
        uint32_t n = pm_prompt(w, src, prompt);
        pm_seq *q = NULL; /* set by pm_create when it returns 0 (GCC cannot tell) */
        r = pm_create(w, salt, &q);
        if (r) return r < 0 ? -1 : 0;
        PM_TR(w, "%llu: s%d = create(salt %d)\n", (unsigned long long)w->n_steps, PM_SI(w, q), salt);
        if (pm_append(w, q, prompt, n) < 0) return -1;
        uint32_t c = pm_below(src, q->len + 1);
        if (pm_byte(src) & 1) c = q->len;
        rc = pkv_seq_commit(w->c, q->id, c);
        PM_TR(w, "   s%d commit(%u) -> %s\n", PM_SI(w, q), c, pkv_strerror(rc));
        PM_EXPECT(w, rc == 0, "commit: %s", pkv_strerror(rc));
        if (c > q->committed) q->committed = c;
        break;
    }
    case PM_OP_APPEND: {
        pm_seq *q = pm_pick(w, src, 0);
        if (!q) break;
        int32_t tok[64];
        uint32_t n = 1 + pm_below(src, 2 * w->B + 3);
        uint32_t k = pm_byte(src) % PM_N_PROMPTS;
        for (uint32_t i = 0; i < n; i++) {
            /* continue a stored prompt where it lines up, else small random ids */
            uint32_t p = q->len + i;
            tok[i] = (p < w->prompt_len[k] && (k & 1)) ? w->prompt[k][p] : (int32_t)pm_below(src, 24);
        }
        if (q->len + n > w->max_tok) {
            if (q->len + n > PM_MAX_TOK) break;
        }
        PM_TR(w, "%llu: append\n", (unsigned long long)w->n_steps);
        if (pm_append(w, q, tok, n) < 0) return -1;
        if (pm_byte(src) < 128) {
            PM_TR(w, "   s%d commit(%u)\n", PM_SI(w, q), q->len);
            rc = pkv_seq_commit(w->c, q->id, q->len);
            PM_EXPECT(w, rc == 0, "commit: %s", pkv_strerror(rc));
            q->committed = q->len;
        }
        break;
    }
    case PM_OP_COMMIT: {
        pm_seq *q = pm_pick(w, src, 0);
        if (!q) break;
        uint32_t c = pm_below(src, q->len + 2);
        rc = pkv_seq_commit(w->c, q->id, c);
        PM_TR(w, "%llu: s%d commit(%u) of %u -> %s\n", (unsigned long long)w->n_steps, PM_SI(w, q), c, q->len,
              pkv_strerror(rc));
        if (c > q->len) {
            PM_EXPECT(w, rc == PKV_EINVAL, "commit %u past length %u: %s", c, q->len, pkv_strerror(rc));
        } else {
            PM_EXPECT(w, rc == 0, "commit %u of %u: %s", c, q->len, pkv_strerror(rc));
            if (c > q->committed) q->committed = c;
        }
        break;
    }
    case PM_OP_FORK: {
        pm_seq *p = pm_pick(w, src, 0);
        if (!p) break;
        pm_seq *q = pm_free_slot(w);
        pkv_seq id = 0;
        rc = pkv_seq_fork(w->c, p->id, &id);
        PM_TR(w, "%llu: s%d = fork(s%d) -> %s\n", (unsigned long long)w->n_steps, q ? PM_SI(w, q) : -1, PM_SI(w, p),
              pkv_strerror(rc));
        if (!q) {
            PM_EXPECT(w, rc == PKV_ELIMIT, "fork when full: %s", pkv_strerror(rc));
            break;
        }
        PM_EXPECT(w, rc == 0, "fork: %s", pkv_strerror(rc));
        memcpy(q, p, sizeof *q);
        q->id = id;
        w->n_forks++;
        break;
    }
    case PM_OP_TRUNCATE: {
        pm_seq *q = pm_pick(w, src, 0);
        if (!q) break;
        uint32_t n = pm_below(src, q->len + 3);
        rc = pkv_seq_truncate(w->c, q->id, n);
        PM_TR(w, "%llu: s%d truncate(%u) of %u -> %s\n", (unsigned long long)w->n_steps, PM_SI(w, q), n, q->len,
              pkv_strerror(rc));
        if (n < q->len && n < q->dropped) { /* into the dropped front */
            PM_EXPECT(w, rc == PKV_EINVAL, "truncate %u into a front dropped to %u: %s", n, q->dropped, pkv_strerror(rc));
            break;
        }
        PM_EXPECT(w, rc == 0, "truncate %u of %u: %s", n, q->len, pkv_strerror(rc));
        if (n < q->len && q->shifted && n <= q->exact) q->shifted = 0; /* what is left is exact */
        if (n < q->len) q->len = n;
        if (q->committed > q->len) q->committed = q->len;
        w->n_truncs++;
        break;
    }
    case PM_OP_COMPACT: { /* moves blocks, changes no K/V (pm_verify reads them) and no count but
                             those of the blocks PKV_COMPACT_EVICT evicts (PKV_COMPACT_CACHED
                             exchanges CACHED blocks instead); an unknown flag nothing */
        pm_seq *q = pm_pick(w, src, 0);
        if (!q) break;
        static const uint32_t pick[7] = {0, 0, PKV_COMPACT_EVICT, PKV_COMPACT_EVICT, PKV_COMPACT_CACHED,
                                         PKV_COMPACT_CACHED | PKV_COMPACT_EVICT, 4u};
        const uint32_t f = pm_byte(src) % 8, flags = f < 7 ? pick[f] : 0; /* 7: the batch */
        pkv_stats before, after;
        uint32_t moved = 0;
        if (pkv_cache_get_stats(w->c, &before) < 0) return pm_fail(w, "stats");
        if (f == 7) { /* the whole batch of live sequences at once: no count changes */
            pkv_seq ids[PM_MAX_SEQS];
            uint32_t n = 0;
            for (int i = 0; i < PM_MAX_SEQS; i++)
                if (w->s[i].live && !w->s[i].is_pin) ids[n++] = w->s[i].id;
            const uint32_t slack = pm_byte(src) % 3, bflags = pm_byte(src) % 5; /* 4: an unknown flag */
            rc = pkv_batch_compact(w->c, ids, n, slack, bflags, &moved);
            PM_TR(w, "%llu: batch compact(%u) of %u -> %s, %u copies\n", (unsigned long long)w->n_steps, bflags, n,
                  pkv_strerror(rc), moved);
            PM_EXPECT(w, rc == (bflags > 3 ? PKV_EINVAL : 0), "batch compact(%u): %s", bflags, pkv_strerror(rc));
            if (pkv_cache_get_stats(w->c, &after) < 0) return pm_fail(w, "stats");
            PM_EXPECT(w, memcmp(&before, &after, sizeof before) == 0, "batch compact changed the statistics");
            w->n_compact_moved += moved;
            break;
        }
        rc = pkv_seq_compact(w->c, q->id, flags, &moved);
        PM_TR(w, "%llu: s%d compact(%u) -> %s, %u moved\n", (unsigned long long)w->n_steps, PM_SI(w, q), flags,
              pkv_strerror(rc), moved);
        PM_EXPECT(w, rc == (flags > 3 ? PKV_EINVAL : 0), "compact(%u): %s", flags, pkv_strerror(rc));
        if (pkv_cache_get_stats(w->c, &after) < 0) return pm_fail(w, "stats");
        const uint64_t ev = after.evictions - before.evictions;
        PM_EXPECT(w, flags == PKV_COMPACT_EVICT || ev == 0, "compact(%u) evicted %llu", flags, (unsigned long long)ev);
        PM_EXPECT(w, before.n_cached - after.n_cached == ev && after.n_free - before.n_free == ev &&
                         before.n_indexed - after.n_indexed == ev,
                  "compact's evictions (%llu) against the counts", (unsigned long long)ev);
        /* a leaf evicted below a tombstone takes the tombstones it was the last entry below */
        PM_EXPECT(w, after.n_tombstones <= before.n_tombstones && (ev || after.n_tombstones == before.n_tombstones),
                  "compact: tombstones %llu -> %llu with %llu evicted", (unsigned long long)before.n_tombstones,
                  (unsigned long long)after.n_tombstones, (unsigned long long)ev);
        before.evictions = after.evictions, before.n_cached = after.n_cached, before.n_free = after.n_free;
        before.n_indexed = after.n_indexed, before.n_tombstones = after.n_tombstones;
        PM_EXPECT(w, memcmp(&before, &after, sizeof before) == 0, "compact changed the statistics (%u moved)", moved);
        w->n_compact_moved += moved;
        break;
    }
    case PM_OP_DROP: { /* pkv_seq_drop_front: EINVAL past the length, changing nothing (pm_verify);
                          else the front grows (where prefixes are indexed, its indexed blocks stay
                          findable until evicted, and every match is checked against the model) */
        pm_seq *q = pm_pick(w, src, 0);
        if (!q) break;
        const uint32_t pos = pm_below(src, q->len + 3);
        pkv_stats before, after;
        if (pkv_cache_get_stats(w->c, &before) < 0) return pm_fail(w, "stats");
        rc = pkv_seq_drop_front(w->c, q->id, pos);
        PM_TR(w, "%llu: s%d drop_front(%u) of %u (dropped %u) -> %s\n", (unsigned long long)w->n_steps, PM_SI(w, q),
              pos, q->len, q->dropped, pkv_strerror(rc));
        const int want = pos > q->len ? PKV_EINVAL : 0;
        PM_EXPECT(w, rc == want, "drop_front(%u) of %u: %s, want %s", pos, q->len, pkv_strerror(rc), pkv_strerror(want));
        if (pkv_cache_get_stats(w->c, &after) < 0) return pm_fail(w, "stats");
        if (rc) {
            PM_EXPECT(w, memcmp(&before, &after, sizeof before) == 0, "a refused drop_front changed the statistics");
            break;
        }
        if (pos / w->B * w->B > q->dropped) q->dropped = pos / w->B * w->B;
        w->n_drops++;
        break;
    }
    case PM_OP_RELEASE: {
        pm_seq *q = pm_pick(w, src, 0);
        if (!q) break;
        rc = pkv_seq_release(w->c, q->id);
        PM_TR(w, "%llu: s%d release -> %s\n", (unsigned long long)w->n_steps, PM_SI(w, q), pkv_strerror(rc));
        PM_EXPECT(w, rc == 0, "release: %s", pkv_strerror(rc));
        q->live = 0;
        pm_add_stale(w, q->id);
        break;
    }
    case PM_OP_PIN: {
        pm_seq *p = pm_pick(w, src, 0);
        if (!p) break;
        uint32_t n_pos = pm_below(src, p->len + 1);
        pm_seq *q = pm_free_slot(w);
        pkv_seq id = 0;
        pkv_stats before, after;
        if (pkv_cache_get_stats(w->c, &before) < 0) return pm_fail(w, "stats");
        rc = pkv_pin_create(w->c, p->id, n_pos, &id);
        PM_TR(w, "%llu: s%d = pin(s%d, %u) of %u -> %s\n", (unsigned long long)w->n_steps, q ? PM_SI(w, q) : -1,
              PM_SI(w, p), n_pos, p->len, pkv_strerror(rc));
        if (p->dropped) { /* no prefix left to pin */
            PM_EXPECT(w, rc == PKV_EINVAL, "pin of a sequence with a dropped front: %s", pkv_strerror(rc));
            break;
        }
        if (!q) {
            PM_EXPECT(w, rc == PKV_ELIMIT, "pin when full: %s", pkv_strerror(rc));
            break;
        }
        PM_EXPECT(w, rc == 0 && id != 0, "pin_create(%u of %u): %s", n_pos, p->len, pkv_strerror(rc));
        if (pkv_cache_get_stats(w->c, &after) < 0) return pm_fail(w, "stats");
        /* the sequence already holds the blocks: pinning changes no state counts */
        PM_EXPECT(w, after.n_active == before.n_active && after.n_cached == before.n_cached,
                  "pinning held blocks changed active %u->%u", before.n_active, after.n_active);
        memset(q, 0, offsetof(pm_seq, tok));
        q->id = id;
        q->live = 1;
        q->is_pin = 1;
        w->n_pins++;
        pkv_seq_info info;
        rc = pkv_seq_get_info(w->c, id, &info);
        PM_EXPECT(w, rc == PKV_EINVAL, "get_info on a pin: %s, expected EINVAL", pkv_strerror(rc));
        rc = pkv_pin_release(w->c, p->id);
        PM_EXPECT(w, rc == PKV_EINVAL, "pin_release on a sequence: %s, expected EINVAL", pkv_strerror(rc));
        break;
    }
    case PM_OP_UNPIN: {
        pm_seq *q = pm_pick(w, src, 1);
        if (!q) break;
        rc = pkv_pin_release(w->c, q->id);
        PM_TR(w, "%llu: s%d unpin -> %s\n", (unsigned long long)w->n_steps, PM_SI(w, q), pkv_strerror(rc));
        PM_EXPECT(w, rc == 0, "pin_release: %s", pkv_strerror(rc));
        q->live = 0;
        pm_add_stale(w, q->id);
        break;
    }
    case PM_OP_NEGATIVE: {
        uint32_t kind = pm_byte(src) % 5;
        pm_seq *q = pm_pick(w, src, 0);
        if (kind == 0 && w->n_stale) { /* stale ids */
            pkv_seq id = pm_stale_id(w, src);
            pkv_seq_info info;
            rc = pkv_seq_get_info(w->c, id, &info);
            PM_EXPECT(w, rc == PKV_ENOENT, "get_info on a stale id: %s", pkv_strerror(rc));
            int32_t t = 1;
            rc = pkv_seq_append(w->c, id, &t, 1, NULL);
            PM_EXPECT(w, rc == PKV_ENOENT, "append on a stale id: %s", pkv_strerror(rc));
            rc = pkv_pin_release(w->c, id);
            PM_EXPECT(w, rc == PKV_ENOENT, "pin_release on a stale id: %s", pkv_strerror(rc));
        } else if (kind == 1 && q && q->len) { /* match into a non-empty sequence */
            uint32_t reused = 7;
            rc = pkv_seq_match_prefix(w->c, q->id, q->tok, q->len, &reused);
            PM_EXPECT(w, rc == PKV_EINVAL, "match into a sequence of %u tokens: %s", q->len, pkv_strerror(rc));
        } else if (kind == 2 && q) { /* gather past the end */
            rc = pkv_seq_gather(w->c, q->id, 0, q->len, 1, w->kbuf, w->vbuf);
            PM_EXPECT(w, rc == PKV_EINVAL, "gather past length %u: %s", q->len, pkv_strerror(rc));
        } else if (kind == 3 && q && q->committed > q->dropped) { /* write into a committed position */
            uint32_t p = q->dropped + pm_below(src, q->committed - q->dropped);
            int32_t slot;
            rc = pkv_seq_slots(w->c, q->id, p, 1, &slot);
            PM_EXPECT(w, rc == 0, "slots: %s", pkv_strerror(rc));
            for (uint32_t i = 0; i < w->cfg.n_kv_heads * w->cfg.head_dim; i++) w->kbuf[i] = 99.0f;
            rc = pkv_write_kv(w->c, 0, &slot, 1, w->kbuf, w->kbuf, PKV_DTYPE_F32);
            PM_EXPECT(w, rc == PKV_EINVAL, "write into committed pos %u (committed %u): %s", p, q->committed,
                      pkv_strerror(rc));
            rc = pkv_seq_write_kv(w->c, q->id, 0, p, 1, w->kbuf, w->kbuf, PKV_DTYPE_F32);
            PM_EXPECT(w, rc == PKV_EINVAL, "seq_write_kv of committed pos %u (committed %u): %s", p, q->committed,
                      pkv_strerror(rc));
        } else if (kind == 4) { /* an out-of-range slot among good ones changes nothing */
            int32_t bad = (int32_t)(w->cfg.n_blocks * w->B);
            for (uint32_t i = 0; i < w->cfg.n_kv_heads * w->cfg.head_dim; i++) w->kbuf[i] = 99.0f;
            rc = pkv_write_kv(w->c, 0, &bad, 1, w->kbuf, w->kbuf, PKV_DTYPE_F32);
            PM_EXPECT(w, rc == PKV_EINVAL, "write to slot %d: %s", bad, pkv_strerror(rc));
        }
        break;
    }
    case PM_OP_ATTN:
        if ((pm_byte(src) < 64 ? pm_op_tree(w, src) : pm_op_attn(w, src)) < 0) return -1;
        break;
    case PM_OP_REWRITE: {
        /* rewrite one position with the value it already holds: allowed only for an uncommitted
           position of a block nobody else holds; either way the data must stay the same */
        pm_seq *q = pm_pick(w, src, 0);
        if (!q || !q->len) break;
        uint32_t p = pm_below(src, q->len);
        int32_t slot;
        rc = pkv_seq_slots(w->c, q->id, p, 1, &slot);
        if (p < q->dropped) { /* no slot: the block is gone; nor a write by position */
            PM_EXPECT(w, rc == PKV_EINVAL, "slots of dropped position %u: %s", p, pkv_strerror(rc));
            rc = pkv_seq_write_kv(w->c, q->id, 0, p, 1, w->kbuf, w->vbuf, PKV_DTYPE_F32);
            PM_EXPECT(w, rc == PKV_EINVAL, "write of dropped position %u: %s", p, pkv_strerror(rc));
            break;
        }
        PM_EXPECT(w, rc == 0, "slots: %s", pkv_strerror(rc));
        int shared = 0;
        uint32_t nb;
        for (int i = 0; i < PM_MAX_SEQS; i++) {
            pm_seq *o = &w->s[i];
            if (!o->live || o->is_pin || o == q) continue;
            rc = pkv_seq_block_table(w->c, o->id, w->table, PM_MAX_TOK, &nb);
            PM_EXPECT(w, rc == 0, "block_table: %s", pkv_strerror(rc));
            for (uint32_t b = 0; b < nb; b++) shared |= w->table[b] == slot / (int32_t)w->B;
        }
        int32_t s2[1] = {slot};
        rc = 0;
        for (uint32_t l = 0; l < w->cfg.n_layers && rc == 0; l++) {
            for (uint32_t h = 0; h < w->cfg.n_kv_heads; h++)
                for (uint32_t d = 0; d < w->cfg.head_dim; d++) {
                    w->kbuf[h * w->cfg.head_dim + d] = pm_val(q->kv[p], l, 0, h, d);
                    w->vbuf[h * w->cfg.head_dim + d] = pm_val(q->kv[p], l, 1, h, d);
                }
            rc = pkv_write_kv(w->c, l, s2, 1, w->kbuf, w->vbuf, PKV_DTYPE_F32);
        }
        if (p < q->committed || shared)
            PM_EXPECT(w, rc == PKV_EINVAL, "rewrite pos %u (committed %u, shared %d) accepted: %s", p, q->committed,
                      shared, pkv_strerror(rc));
        else
            PM_EXPECT(w, rc == 0 || rc == PKV_EINVAL, "rewrite: %s", pkv_strerror(rc));
        break;
    }
    }
    return pm_verify(w);
}

#endif
