/* test_media_random.c: the media guard against ids that agree by chance, randomized, with an
 * oracle of the true content. Prompts of text and media (images: pkv_media_tokens' id forms, a
 * marked first id, then the others); each media comes in variants whose ids agree with the
 * first variant's on their first 1 to 3 ids (what a chance agreement of 2^-30 an id would give)
 * and whose content differs. A request is a base prompt with some media swapped for another
 * variant, maybe cut short; it is matched (pkv_seq_match_prefix), maybe loaded from a host tier
 * (pkv_tier_load), computed (K/V a hash of the true content of its whole prefix, as a model's
 * are), committed, maybe saved to the tier, maybe released. After every step:
 * - every position a match or load handed out holds the K/V of the request's own content (a
 *   position of another variant's image is the bug the guard exists for);
 * - every live sequence's committed positions still hold their own content's K/V;
 * - no match or load ends 1 to 3 ids into a media the prompt goes on with;
 * - the same match again at once (room for its copy) reuses as much;
 * - pkv_cache_check passes.
 * Block sizes 1 to 16 (a media's first ids span blocks below 4), pools from tight to roomy,
 * sometimes max_blocks_per_seq, two namespaces; media apart and side by side. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <pkv.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "support_util.h"

static tu_rng g_rng;
static uint64_t rnd(void) { return tu_rng_u64(&g_rng); }
static uint32_t below(uint32_t n) { return tu_rng_below(&g_rng, n); }
/* the oracle's chain: a prefix's hash and one more position's content */
static uint64_t mix(uint64_t a, uint64_t b) {
    uint64_t z = a * 0x9E3779B97F4A7C15ull ^ (b + 0x632BE59BD9B4E019ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

enum { MAXN = 160, NF = 3, NV = 4, MEDIA_MAX = 12, NBASE = 10, HD = 4, MAXLIVE = 6, STEPS = 300 };

/* a media's id forms (pkv.h, pkv_media_tokens): the first INT32_MIN + v, the others -1 - v */
static int32_t media_id(uint32_t offset) {
    const int32_t v = (int32_t)(rnd() & 0x3fffffff);
    return offset == 0 ? INT32_MIN + v : -1 - v;
}

typedef struct prompt {
    uint32_t n;
    int32_t ids[MAXN];
    uint64_t truth[MAXN]; /* what decides a position's K/V besides its prefix */
    uint8_t fam[MAXN], var[MAXN], off[MAXN], media[MAXN];
} prompt;

typedef struct live {
    pkv_seq id;
    int salt, used;
    uint32_t len;
    prompt p;
} live;

typedef struct world {
    int side_by_side;
    int32_t fam_ids[NF][NV][MEDIA_MAX];
    uint64_t fam_truth[NF][NV];
    prompt bases[NBASE];
    live lv[MAXLIVE];
    pkv_cache *c;
    pkv_tier *tier;
    uint32_t B;
    /* what the run reached, so that a run that did nothing cannot pass */
    long steps, reused, loaded, guarded, rematches;
} world;

static void add_text(prompt *p, uint32_t len) {
    for (uint32_t i = 0; i < len && p->n < MAXN; i++, p->n++) {
        p->ids[p->n] = (int32_t)below(4); /* a small vocabulary: text alike across prompts */
        p->truth[p->n] = (uint64_t)p->ids[p->n];
        p->media[p->n] = 0;
    }
}

static void add_media(world *w, prompt *p, uint32_t f, uint32_t v, uint32_t len) {
    for (uint32_t o = 0; o < len && p->n < MAXN; o++, p->n++) {
        p->ids[p->n] = w->fam_ids[f][v][o];
        p->truth[p->n] = mix(w->fam_truth[f][v], o);
        p->media[p->n] = 1, p->fam[p->n] = (uint8_t)f, p->var[p->n] = (uint8_t)v, p->off[p->n] = (uint8_t)o;
    }
}

static void make_base(world *w, prompt *p) {
    p->n = 0;
    const uint32_t target = 8 + below(MAXN - 10);
    add_text(p, 1 + below(5));
    while (p->n < target) {
        /* drawn one by one: arguments are evaluated in an order C leaves open (x86-64 and
           arm64 builds drew different prompts from one seed) */
        const uint32_t f = below(NF), v = below(NV), len = 4 + below(MEDIA_MAX - 3);
        add_media(w, p, f, v, len);
        add_text(p, w->side_by_side && below(2) ? 0 : 1 + below(6));
    }
}

/* a base prompt with some of its media swapped for another variant (same length), maybe cut */
static void make_request(world *w, prompt *q) {
    *q = w->bases[below(NBASE)];
    for (uint32_t i = 0; i < q->n; i++) {
        if (!q->media[i] || q->off[i] != 0 || below(3)) continue;
        uint32_t j = i;
        while (j < q->n && q->media[j] && q->fam[j] == q->fam[i] && q->var[j] == q->var[i] && q->off[j] == j - i) j++;
        const uint32_t keep_n = q->n;
        q->n = i;
        add_media(w, q, q->fam[i], below(NV), j - i);
        q->n = keep_n;
    }
    if (below(4) == 0) q->n = 2 + below(q->n - 1);
}

/* K/V of position pos: a hash of the true content of [0, pos] (h: that of [0, pos - 1], or the
 * namespace's seed), as a model's depend on the whole prefix; returns the hash */
static uint64_t truth_kv(uint64_t h, const prompt *p, uint32_t pos, float *k, float *v) {
    h = mix(h, p->truth[pos]);
    for (int j = 0; j < HD; j++) {
        k[j] = (float)((h >> (j * 8)) & 0xff);
        v[j] = (float)((h >> (32 + j * 8)) & 0xff);
    }
    return h;
}

static uint64_t seed_of(int salt) { return 0x1234 + (uint64_t)salt; }

/* the hash truth_kv chains up to position pos - 1 */
static uint64_t chain_before(const prompt *p, int salt, uint32_t pos) {
    uint64_t h = seed_of(salt);
    for (uint32_t i = 0; i < pos; i++) h = mix(h, p->truth[i]);
    return h;
}

/* fails unless positions [0, upto) of s hold p's own K/V */
static void expect_truth(world *w, pkv_seq s, int salt, const prompt *p, uint32_t upto, const char *what) {
    uint64_t h = seed_of(salt);
    for (uint32_t i = 0; i < upto; i++) {
        float k[HD], v[HD], ek[HD], ev[HD];
        assert_int_equal(pkv_seq_read_stored(w->c, s, 0, i, 1, k, v), 0);
        h = truth_kv(h, p, i, ek, ev);
        if (memcmp(k, ek, sizeof k) || memcmp(v, ev, sizeof v))
            fail_msg("%s: step %ld, B %u: position %u of %u holds another content's K/V (%s, media offset %u)", what,
                     w->steps, w->B, i, upto, p->media[i] ? "media" : "text", p->media[i] ? p->off[i] : 0);
    }
}

/* the rule as pkv.h states it: ids of the media open at r (back to its first, under 4) where
 * the prompt goes on with that media */
static uint32_t open_ids(const int32_t *t, uint32_t n, uint32_t r) {
    if (r == 0 || r >= n || t[r] >= 0 || t[r] < -(1 << 30)) return 0;
    uint32_t run = 0;
    while (run < r && t[r - 1 - run] < 0) {
        if (++run >= 4) return 0;
        if (t[r - run] < -(1 << 30)) break;
    }
    return run;
}

static void check(world *w) {
    char msg[256];
    if (pkv_cache_check(w->c, msg, sizeof msg)) fail_msg("step %ld, B %u: %s", w->steps, w->B, msg);
}

static void release(world *w, live *L) {
    assert_int_equal(pkv_seq_release(w->c, L->id), 0);
    L->used = 0;
}

static void step(world *w) {
    w->steps++;
    live *L = NULL;
    for (int i = 0; i < MAXLIVE; i++)
        if (!w->lv[i].used) L = &w->lv[i];
    if (!L) {
        release(w, &w->lv[below(MAXLIVE)]);
        return;
    }
    make_request(w, &L->p);
    const prompt *p = &L->p;
    L->salt = (int)below(2);
    const char salt = (char)('a' + L->salt);
    assert_int_equal(pkv_seq_create(w->c, &salt, 1, &L->id), 0);
    L->used = 1;
    pkv_stats st;
    assert_int_equal(pkv_cache_get_stats(w->c, &st), 0);
    uint32_t reused = 0, loaded = 0;
    assert_int_equal(pkv_seq_match_prefix(w->c, L->id, p->ids, p->n, &reused), 0);
    check(w);
    w->reused += reused;
    expect_truth(w, L->id, L->salt, p, reused, "match");
    if (open_ids(p->ids, p->n, reused)) fail_msg("step %ld, B %u: a match ends %u ids into a media", w->steps, w->B, open_ids(p->ids, p->n, reused));
    if (reused < p->n && p->ids[reused] < 0 && p->ids[reused] >= -(1 << 30)) w->guarded++;
    /* the same match again at once, with room for its copy: as much */
    if (below(4) == 0 && st.n_free + st.n_cached >= 2) {
        pkv_seq s2;
        uint32_t again = 0;
        assert_int_equal(pkv_seq_create(w->c, &salt, 1, &s2), 0);
        assert_int_equal(pkv_seq_match_prefix(w->c, s2, p->ids, p->n, &again), 0);
        if (again != reused) fail_msg("step %ld, B %u: the same match again reused %u, first %u", w->steps, w->B, again, reused);
        assert_int_equal(pkv_seq_release(w->c, s2), 0);
        check(w);
        w->rematches++;
    }
    if (w->tier && below(2)) {
        assert_int_equal(pkv_tier_load(w->tier, w->c, L->id, p->ids, p->n, &loaded), 0);
        check(w);
        w->loaded += loaded;
        expect_truth(w, L->id, L->salt, p, reused + loaded, "tier load");
        if (loaded && open_ids(p->ids, p->n, reused + loaded))
            fail_msg("step %ld, B %u: a tier load ends inside a media's first ids", w->steps, w->B);
    }
    L->len = reused + loaded;
    /* the engine computes the rest, or part of it */
    const uint32_t upto = below(5) == 0 ? L->len + below(p->n - L->len + 1) : p->n;
    if (upto > L->len) {
        const int rc = pkv_seq_append(w->c, L->id, p->ids + L->len, upto - L->len, NULL);
        if (rc == PKV_ENOSPC || rc == PKV_ELIMIT) {
            release(w, L);
            check(w);
            return;
        }
        assert_int_equal(rc, 0);
        uint64_t h = chain_before(p, L->salt, L->len);
        for (uint32_t i = L->len; i < upto; i++) {
            float k[HD], v[HD];
            h = truth_kv(h, p, i, k, v);
            assert_int_equal(pkv_seq_write_stored(w->c, L->id, 0, i, 1, k, v), 0);
        }
        L->len = upto;
    }
    const uint32_t com = below(6) == 0 ? below(L->len + 1) : L->len;
    assert_int_equal(pkv_seq_commit(w->c, L->id, com), 0);
    check(w);
    if (w->tier && com == L->len && below(2)) {
        uint32_t saved;
        assert_int_equal(pkv_tier_save(w->tier, w->c, L->id, &saved), 0);
    }
    if (below(3)) release(w, L);
    check(w);
    for (int i = 0; i < MAXLIVE; i++)
        if (w->lv[i].used) {
            pkv_seq_info info;
            assert_int_equal(pkv_seq_get_info(w->c, w->lv[i].id, &info), 0);
            expect_truth(w, w->lv[i].id, w->lv[i].salt, &w->lv[i].p, info.n_committed, "a live sequence");
        }
}

static void run(int side_by_side, uint64_t seed, int rounds) {
    static world w; /* large: not on the stack */
    memset(&w, 0, sizeof w);
    w.side_by_side = side_by_side;
    tu_rng_seed(&g_rng, seed);
    static const uint32_t Bs[] = {1, 2, 3, 4, 5, 8, 16};
    for (int r = 0; r < rounds; r++) {
        /* variant v of a media agrees with variant 0 on its first 1 to 3 ids, content apart */
        for (int f = 0; f < NF; f++)
            for (int v = 0; v < NV; v++) {
                const uint32_t agree = v ? 1 + below(3) : 0;
                for (uint32_t o = 0; o < MEDIA_MAX; o++) w.fam_ids[f][v][o] = o < agree ? w.fam_ids[f][0][o] : media_id(o);
                w.fam_truth[f][v] = rnd();
            }
        for (int i = 0; i < NBASE; i++) make_base(&w, &w.bases[i]);
        pkv_config cfg = pkv_config_default();
        cfg.n_layers = 1, cfg.n_kv_heads = 1, cfg.head_dim = HD;
        cfg.k_dtype = cfg.v_dtype = PKV_DTYPE_F32;
        cfg.block_tokens = w.B = Bs[below(sizeof Bs / sizeof *Bs)];
        const uint32_t need = (MAXN + cfg.block_tokens - 1) / cfg.block_tokens;
        cfg.n_blocks = need + 2 + below(need * 3);
        cfg.max_blocks_per_seq = below(4) == 0 ? 1 + below(need) : 0;
        cfg.max_seqs = 16, cfg.n_threads = 1, cfg.huge_pages = 0;
        assert_int_equal(pkv_cache_create(&cfg, &w.c), 0);
        w.tier = NULL; /* a tier every other round */
        if (r & 1) assert_int_equal(pkv_tier_host_create(1u << 20, NULL, &w.tier), 0);
        memset(w.lv, 0, sizeof w.lv);
        for (int s = 0; s < STEPS; s++) step(&w);
        for (int i = 0; i < MAXLIVE; i++)
            if (w.lv[i].used) release(&w, &w.lv[i]);
        check(&w);
        pkv_tier_destroy(w.tier);
        pkv_cache_destroy(w.c);
    }
    print_message("media %s: %ld steps, %ld positions matched, %ld loaded, %ld matches ended before a media's "
                  "later id, %ld matched again\n",
                  side_by_side ? "side by side" : "apart", w.steps, w.reused, w.loaded, w.guarded, w.rematches);
    /* the run reached what it is for (a round gave about 1,000 positions matched, 300 loaded,
       9 guarded ends and 48 matches again) */
    assert_true(w.reused > 200L * rounds && w.loaded > 50L * rounds && w.guarded > rounds &&
                w.rematches > 10L * rounds);
}

/* rounds of 300 steps: PKV_STRESS_OPS / 5,000 (10 to 200) where it is set, as the stress test's
 * operations (scripts/test.sh: 200 in the Release stage, 40 under ASan, 10 under qemu and in the
 * i386 stage), else 100 */
static int rounds(void) {
    const char *e = getenv("PKV_STRESS_OPS");
    const long ops = e ? strtol(e, NULL, 10) : 0;
    return ops ? (int)(ops / 5000 < 10 ? 10 : ops / 5000 > 200 ? 200 : ops / 5000) : 100;
}

static void test_media_apart(void **state) {
    (void)state;
    run(0, 11, rounds());
}

static void test_media_side_by_side(void **state) {
    (void)state;
    run(1, 12, rounds());
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_media_apart),
        cmocka_unit_test(test_media_side_by_side),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
