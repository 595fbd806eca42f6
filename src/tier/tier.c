/* tier.c: storage tiers (pkv.h, "storage tiers"): the tier object over a store's ops, its
 * counters, entries and their keys, and the two moves between a cache and a tier,
 * pkv_tier_save and pkv_tier_load. Both go through the public calls for K/V rows
 * (pkv_seq_read_stored, pkv_seq_append, pkv_seq_write_stored, pkv_seq_commit), so the cache's
 * checks and locking are the same as for any caller; only the sequence's token ids and
 * namespace are read here under the cache's lock.
 *
 * An entry: the header below, the block's B token ids (int32), then for each layer the K rows
 * [B][n_kv_heads] and the V rows [B][n_kv_heads], as pkv_seq_read_stored gives them (no V rows
 * where V lives in K: pkv_config.v_dim). */
#include "tier_int.h"

#include "../cache/cache_int.h"

#include <string.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

typedef struct pf_job pf_job;

struct pkv_tier {
    pkv_tier_ops ops;
    void *ctx;
    pkv__tier_ext ext; /* a built-in store's calls beside its ops (tier_int.h), or NULLs */
    void *tctx;        /* the tier's thread's context on the store: ctx, or its own (ext.clone) */
    pkv_allocator alloc;
    pthread_mutex_t mu; /* the counters, the scratch, and the prefetch's jobs and staging */
    pkv_tier_stats st;
    /* prefetch (pkv_tier_prefetch_start): its thread takes jobs from the queue, fetches their
       entries from the store (outside mu) and stages them; loads take staged entries */
    bool pf_on, pf_stop;
    pthread_t pf_thread;
    pthread_cond_t pf_cv;   /* a job queued, or stop */
    pthread_cond_t pf_idle; /* the queue empty and the thread idle */
    pf_job *pf_head, *pf_tail;
    uint32_t pf_n; /* prefetch jobs queued or in progress */
    pkv__tmap staged;
    uint64_t staged_cap; /* staging_bytes */
    /* what staging holds, in entries' sizes (headers included), by whom; their sum (held()) is
       at most staged_cap: staged entries (and those a load is copying out), spares, buffers of
       writes (being made, queued or being put), the fetch in flight */
    uint64_t sz_staged, sz_spare, sz_write, sz_fetch;
    /* buffers of staged entries a load took (or a fetch did not keep), for the next fetches
       (linked through hnext; counted in sz_spare): freeing them cost a load more than its
       copies (an unmapped page is every thread's TLB's business) */
    pkv__tent *spare;
    /* write-back (pkv_tier_save_async): entries waiting for the thread's put, oldest first
       (linked through hnext; counted in sz_write); failures since the last pkv_tier_flush */
    pkv__tent *wb_head, *wb_tail;
    uint64_t wb_enq, wb_done; /* writes queued, writes done, ever: a flush waits for those before it */
    uint64_t wb_failed;
    /* one entry buffer kept between calls (the largest given back while it was free): a fresh
       one a call cost more in page faults than its copies (half of a host save's time) */
    uint8_t *scratch;
    size_t scratch_size;
    bool scratch_busy;
};

typedef struct tier_hdr {
    char magic[8];       /* "PKVTIER1" */
    uint32_t byte_order; /* 0x01020304 as the writer stored it */
    uint32_t hdr_bytes;  /* sizeof(tier_hdr) */
    uint8_t key[PKV__TIER_KEY], parent[PKV__TIER_KEY];
    uint32_t k_dtype, v_dtype, head_dim, n_kv_heads, n_layers, block_tokens; /* v_dtype: TIER_V_IN_K + v_dim
                                                                                  where V lives in K */
    uint64_t entry_bytes; /* the whole entry, this header included */
    uint64_t checksum;    /* XXH3-64 of the bytes after the header */
} tier_hdr;
_Static_assert(sizeof(tier_hdr) == 88, "tier_hdr: no padding, the same on every ABI");

#define TIER_V_IN_K 0x80000000u /* the header's v_dtype of a cache whose V lives in K: this + v_dim */
static const char TIER_MAGIC[8] = {'P', 'K', 'V', 'T', 'I', 'E', 'R', '1'};

/* ---- the tier object ---- */
static int tier_new(const pkv_tier_ops *ops, void *ctx, const pkv_allocator *alloc, pkv_tier **out) {
    pkv_tier *t = pkv__alloc(alloc, sizeof *t, 64);
    if (!t) return PKV_ENOMEM;
    memset(t, 0, sizeof *t);
    t->ops = *ops;
    t->ctx = t->tctx = ctx;
    if (alloc) t->alloc = *alloc;
    pthread_mutex_init(&t->mu, NULL);
    *out = t;
    return PKV_OK;
}

/* a built-in store opened with status rc (ops and ctx set only on success): the tier over it, or
 * the store closed again */
static int tier_over(int rc, const pkv_tier_ops *ops, void *ctx, const pkv_allocator *alloc, pkv_tier **out) {
    if (!rc && (rc = tier_new(ops, ctx, alloc, out))) ops->destroy(ctx);
    return rc;
}

void pkv__tier_test_ext(pkv_tier *t, const pkv__tier_ext *ext) { t->ext = *ext; }

PKV_API int pkv_tier_create(const pkv_tier_ops *ops, void *ctx, const pkv_allocator *alloc, pkv_tier **out) {
    if (out) *out = NULL;
    if (!out || !ops || !ops->put || !ops->get || !ops->del) return PKV_EINVAL;
    return tier_new(ops, ctx, alloc, out);
}

PKV_API int pkv_tier_host_create(uint64_t capacity_bytes, const pkv_allocator *alloc, pkv_tier **out) {
    if (out) *out = NULL;
    if (!out || !capacity_bytes) return PKV_EINVAL;
    pkv_tier_ops ops;
    void *ctx;
    const int rc = pkv__tier_host_open(capacity_bytes, alloc, &ops, &ctx);
    return tier_over(rc, &ops, ctx, alloc, out);
}

PKV_API int pkv_tier_file_create(const char *dir, uint64_t capacity_bytes, const pkv_allocator *alloc,
                                 pkv_tier **out) {
    if (out) *out = NULL;
    if (!out || !dir || !*dir || !capacity_bytes || strlen(dir) > PKV__TIER_DIR_MAX) return PKV_EINVAL;
    pkv_tier_ops ops;
    void *ctx;
    const int rc = pkv__tier_file_open(dir, capacity_bytes, alloc, &ops, &ctx);
    return tier_over(rc, &ops, ctx, alloc, out);
}

PKV_API int pkv_tier_redis_create(const char *host, int port, const char *key_prefix, uint32_t timeout_ms,
                                  const pkv_allocator *alloc, pkv_tier **out) {
    if (out) *out = NULL;
    if (!out || !host || !*host || strlen(host) >= 256 || port <= 0 || port > 65535 ||
        (key_prefix && strlen(key_prefix) >= 256))
        return PKV_EINVAL;
    pkv_tier_ops ops;
    void *ctx;
    pkv__tier_ext ext = {0};
    const int rc = pkv__tier_redis_open(host, port, key_prefix ? key_prefix : "pkv:", timeout_ms,
                                        PKV__TIER_REDIS_CONNS, alloc, &ops, &ctx, &ext);
    const int r = tier_over(rc, &ops, ctx, alloc, out);
    if (!r) (*out)->ext = ext;
    return r;
}

static void prefetch_stop(pkv_tier *t);

/* The thread's context on the store given back where it was its own (ext.clone): the callers'
 * again. */
static void thread_ctx_drop(pkv_tier *t) {
    if (t->tctx != t->ctx) t->ops.destroy(t->tctx);
    t->tctx = t->ctx;
}

PKV_API void pkv_tier_destroy(pkv_tier *t) {
    if (!t) return;
    if (t->pf_on) prefetch_stop(t); /* before the store goes: the thread calls its get */
    if (t->ops.destroy) t->ops.destroy(t->ctx);
    pkv__free(&t->alloc, t->scratch, t->scratch_size);
    pthread_mutex_destroy(&t->mu);
    pkv_allocator a = t->alloc;
    pkv__free(&a, t, sizeof *t);
}

PKV_API int pkv_tier_get_stats(pkv_tier *t, pkv_tier_stats *out) {
    if (!t || !out) return PKV_EINVAL;
    pthread_mutex_lock(&t->mu);
    pkv_tier_stats st = t->st;
    st.staged_entries = t->staged.n;
    st.staged_bytes = t->sz_staged + t->sz_spare + t->sz_write + t->sz_fetch;
    pthread_mutex_unlock(&t->mu);
    st.entries = st.bytes = st.capacity = st.evictions = 0;
    if (t->ops.usage) t->ops.usage(t->ctx, &st.entries, &st.bytes, &st.capacity, &st.evictions);
    *out = st;
    return PKV_OK;
}

/* An entry buffer of at least size bytes (*got: its size): the kept one where it is free and
 * large enough, else a new one from the tier's allocator (NULL: none). */
static uint8_t *scratch_take(pkv_tier *t, size_t size, size_t *got) {
    pthread_mutex_lock(&t->mu);
    uint8_t *p = NULL;
    if (!t->scratch_busy && t->scratch && t->scratch_size >= size) {
        t->scratch_busy = true;
        p = t->scratch;
        *got = t->scratch_size;
    }
    pthread_mutex_unlock(&t->mu);
    if (!p && (p = pkv__alloc(&t->alloc, size, 64))) *got = size;
    return p;
}

/* Gives p (size bytes) back: kept where it is the kept one, or larger than it while that is
 * free; else freed. */
static void scratch_give(pkv_tier *t, uint8_t *p, size_t size) {
    if (!p) return;
    uint8_t *drop = p;
    size_t drop_size = size;
    pthread_mutex_lock(&t->mu);
    if (p == t->scratch) t->scratch_busy = false, drop = NULL;
    else if (!t->scratch_busy && size > t->scratch_size) {
        drop = t->scratch, drop_size = t->scratch_size;
        t->scratch = p, t->scratch_size = size;
    }
    pthread_mutex_unlock(&t->mu);
    pkv__free(&t->alloc, drop, drop_size);
}

#define COUNT(t, field, n)                                                                                      \
    do {                                                                                                        \
        pthread_mutex_lock(&(t)->mu);                                                                           \
        (t)->st.field += (n);                                                                                   \
        pthread_mutex_unlock(&(t)->mu);                                                                         \
    } while (0)

/* ---- keys: a chain over the blocks' token ids, seeded by the namespace and the cache's shape ---- */
typedef struct tkey {
    uint8_t b[PKV__TIER_KEY];
} tkey;
_Static_assert(sizeof(tkey) == PKV__TIER_KEY, "keys side by side: want_ahead passes them as bytes");

static void key_of(XXH128_hash_t h, tkey *out) {
    XXH128_canonical_t can;
    XXH128_canonicalFromHash(&can, h);
    memcpy(out->b, can.digest, PKV__TIER_KEY);
}

static void key_seed(const pkv_cache *c, uint64_t ns_lo, uint64_t ns_hi, tkey *out) {
    /* the last word: v_dim where V lives in K (MLA), else 0 (the keys caches without it always had) */
    const uint64_t shape[8] = {0x31726569747670ull /* "pvtier1" */, c->cfg.k_dtype, c->cfg.v_dtype, c->head_dim,
                               c->n_kv, c->n_layers, c->B, c->cfg.v_dim};
    XXH3_state_t st;
    XXH3_INITSTATE(&st);
    XXH3_128bits_reset(&st);
    XXH3_128bits_update(&st, shape, sizeof shape);
    XXH3_128bits_update(&st, &ns_lo, sizeof ns_lo);
    XXH3_128bits_update(&st, &ns_hi, sizeof ns_hi);
    key_of(XXH3_128bits_digest(&st), out);
}

/* Block i's key: its parent's, then its token ids, then, where it ends 1 to 3 ids into a media
 * (pkv__media_open), the ids after it that go on with that media, up to PKV__MEDIA_MIN of its
 * ids in all: a block whose media ids agree with another content's by chance (2^-30 each) then
 * has a key of its own, so a load cannot go through the other's entry into its own later
 * blocks. toks: the ids from position 0, known of them; false (out untouched) where an id that
 * decides the key is not known. Blocks that end on no media's first few ids keep the key they
 * always had. */
static bool key_next(const tkey *parent, const int32_t *toks, uint32_t i, uint32_t B, size_t known, tkey *out) {
    const size_t end = ((size_t)i + 1) * B;
    const uint32_t open = pkv__media_open(toks, (uint32_t)end);
    uint32_t more = 0;
    for (; open && open + more < PKV__MEDIA_MIN; more++) {
        if (end + more >= known) return false;
        if (!pkv__media_more(toks[end + more])) break; /* the media ended */
    }
    XXH3_state_t st;
    XXH3_INITSTATE(&st);
    XXH3_128bits_reset(&st);
    XXH3_128bits_update(&st, parent->b, PKV__TIER_KEY);
    XXH3_128bits_update(&st, toks + (size_t)i * B, (size_t)(B + more) * sizeof(int32_t));
    key_of(XXH3_128bits_digest(&st), out);
    return true;
}

/* Tells a store with gets ahead (t->ext.want) that the gets of blocks i, i + 1, ... (up to
 * PKV__TIER_AHEAD, below nb, as far as their keys are known) come next; key is block i's, its
 * parent's the one before it. Costs a few hashes a block where the store has no use for it: not
 * made there. */
static void want_ahead(pkv_tier *t, void *ctx, const tkey *key, const int32_t *toks, uint32_t i, uint32_t nb,
                       uint32_t B, size_t known) {
    if (!t->ext.want) return;
    tkey win[PKV__TIER_AHEAD];
    uint32_t n = 1;
    win[0] = *key;
    for (; n < PKV__TIER_AHEAD && i + n < nb && key_next(&win[n - 1], toks, i + n, B, known, &win[n]); n++) {
    }
    t->ext.want(ctx, win[0].b, n);
}

/* ---- entries ---- */
typedef struct shape {
    size_t k_rows, v_rows; /* bytes of one position's K (V) rows, every kv head */
    size_t layer;          /* bytes of one layer's K and V rows of a block */
    size_t entry;          /* bytes of an entry */
    uint32_t k_dtype, v_dtype, head_dim, n_kv_heads, n_layers, block_tokens; /* as the header says */
} shape;

static bool shape_of(const pkv_cache *c, shape *sh) {
    size_t kv, l;
    sh->k_dtype = (uint32_t)c->cfg.k_dtype;
    sh->v_dtype = c->cfg.v_dim ? TIER_V_IN_K + c->cfg.v_dim : (uint32_t)c->cfg.v_dtype;
    sh->head_dim = c->head_dim, sh->n_kv_heads = c->n_kv, sh->n_layers = c->n_layers, sh->block_tokens = c->B;
    sh->k_rows = c->k_row * c->n_kv; /* each under the pool's own sizes, which fit in memory */
    sh->v_rows = c->v_row * c->n_kv; /* 0 where V lives in K */
    return pkv__add_ok(sh->k_rows, sh->v_rows, &kv) && pkv__mul_ok(kv, c->B, &sh->layer) &&
           pkv__mul_ok(sh->layer, c->n_layers, &l) && pkv__add_ok(l, sizeof(tier_hdr) + (size_t)c->B * 4, &sh->entry);
}

static void hdr_fill(const shape *sh, const tkey *key, const tkey *parent, tier_hdr *h) {
    memset(h, 0, sizeof *h);
    memcpy(h->magic, TIER_MAGIC, sizeof h->magic);
    h->byte_order = 0x01020304u;
    h->hdr_bytes = sizeof *h;
    memcpy(h->key, key->b, PKV__TIER_KEY);
    memcpy(h->parent, parent->b, PKV__TIER_KEY);
    h->k_dtype = sh->k_dtype, h->v_dtype = sh->v_dtype;
    h->head_dim = sh->head_dim, h->n_kv_heads = sh->n_kv_heads, h->n_layers = sh->n_layers;
    h->block_tokens = sh->block_tokens;
    h->entry_bytes = sh->entry;
}

/* Whether buf (len bytes, from the store) is the entry of key under parent, for tokens. */
static bool entry_ok(const shape *sh, const uint8_t *buf, size_t len, const tkey *key, const tkey *parent,
                     const int32_t *toks) {
    if (len != sh->entry) return false;
    tier_hdr want, h;
    hdr_fill(sh, key, parent, &want);
    memcpy(&h, buf, sizeof h);
    want.checksum = h.checksum;
    return !memcmp(&h, &want, sizeof h) && !memcmp(buf + sizeof h, toks, (size_t)sh->block_tokens * sizeof(int32_t)) &&
           XXH3_64bits(buf + sizeof h, len - sizeof h) == h.checksum;
}

/* Under the cache's lock: s (live, not a pin), and its length, committed length, namespace and
 * front (blocks dropped: pkv_seq_drop_front); with cap, the blocks it may key (none at or past
 * its first position a shift moved: pkv_seq_shift, what no prefill of its ids computes). With toks: the token ids of its first nb blocks
 * into toks (a dropped block's from the index: pkv__seq_front_ids; *known false, and toks
 * unset, where the index no longer names them), once its length, committed length and front are
 * checked to be as the call before said (a call that changed s meanwhile broke pkv.h's rule;
 * refused rather than read past the buffers sized for them). */
static int seq_peek(pkv_cache *c, pkv_seq id, const char *api, uint32_t *n_tokens, uint32_t *n_committed,
                    uint64_t *ns_lo, uint64_t *ns_hi, uint32_t *front, uint32_t *cap, int32_t *toks, uint32_t nb,
                    bool *known) {
    pthread_mutex_lock(&c->mu);
    pkv__seq *s;
    int rc = pkv__get_seq(c, id, &s, api);
    if (!rc && toks &&
        (s->n_tokens != *n_tokens || s->n_committed != *n_committed || s->n_dropped != *front || nb > s->n_blocks))
        rc = pkv__say(c, PKV_EINVAL, api, "the sequence changed during the call");
    if (!rc) {
        *n_tokens = s->n_tokens, *n_committed = s->n_committed;
        *ns_lo = s->ns_lo, *ns_hi = s->ns_hi;
        *front = s->n_dropped;
        if (cap) *cap = pkv__seq_index_cap(c, s);
    }
    if (!rc && toks) {
        *known = pkv__seq_front_ids(c, s, toks); /* an entry is keyed by every token before it */
        for (uint32_t i = s->n_dropped; *known && i < nb; i++)
            memcpy(toks + (size_t)i * c->B, c->tokens + (size_t)s->table[i] * c->B, (size_t)c->B * sizeof(int32_t));
    }
    pthread_mutex_unlock(&c->mu);
    return rc;
}

/* ---- save ---- */
/* buf := the entry of block j of sequence id (keys[], its blocks' keys from seed; toks[], its
 * blocks' token ids): header, token ids, every layer's rows, checksum. */
static int fill_entry(pkv_cache *c, pkv_seq id, const shape *sh, const tkey *keys, const tkey *seed,
                      const int32_t *toks, uint32_t j, uint8_t *buf) {
    const uint32_t B = c->B;
    tier_hdr h;
    hdr_fill(sh, &keys[j], j ? &keys[j - 1] : seed, &h);
    uint8_t *p = buf + sizeof h;
    memcpy(p, toks + (size_t)j * B, (size_t)B * sizeof(int32_t));
    p += (size_t)B * sizeof(int32_t);
    int rc = PKV_OK;
    for (uint32_t l = 0; !rc && l < c->n_layers; l++, p += sh->layer)
        rc = pkv_seq_read_stored(c, id, l, j * B, B, p, sh->v_rows ? p + (size_t)B * sh->k_rows : NULL);
    if (rc) return rc;
    h.checksum = XXH3_64bits(buf + sizeof h, sh->entry - sizeof h);
    memcpy(buf, &h, sizeof h);
    return PKV_OK;
}

/* What a save of s needs: its full committed blocks' token ids and keys, the entry shape. */
typedef struct save_prep {
    uint32_t nb; /* full committed blocks, up to one whose key needs ids s lacks (key_next); 0:
                    nothing to save (and nothing allocated) */
    uint32_t first; /* the first of them saved: s's front (the blocks before it are not s's) */
    shape sh;
    tkey seed;
    int32_t *toks; /* the ids of s's committed positions, by whole blocks */
    tkey *keys;    /* [nb] */
    size_t toks_bytes, keys_bytes;
} save_prep;

static void save_done(pkv_cache *c, save_prep *p) {
    pkv__free(&c->alloc, p->keys, p->keys_bytes);
    pkv__free(&c->alloc, p->toks, p->toks_bytes);
    p->toks = NULL, p->keys = NULL;
}

/* p := what saving s takes (api names the refusal); on failure nothing is left allocated. */
static int save_prepare(pkv_cache *c, pkv_seq id, const char *api, save_prep *p) {
    memset(p, 0, sizeof *p);
    uint32_t n_tok, n_com, front, cap;
    uint64_t ns_lo, ns_hi;
    int rc = seq_peek(c, id, api, &n_tok, &n_com, &ns_lo, &ns_hi, &front, &cap, NULL, 0, NULL);
    if (rc) return rc;
    const uint32_t B = c->B, nb = PKV_MIN(n_com / B, cap);
    if (nb <= front) return PKV_OK;
    if (!shape_of(c, &p->sh)) return pkv__say(c, PKV_ENOMEM, api, "an entry's size overflows");
    /* the ids of every committed position: a key may take ids past the full blocks (a media's) */
    const uint32_t nbk = (n_com + B - 1) / B;
    p->toks_bytes = (size_t)nbk * B * sizeof(int32_t), p->keys_bytes = (size_t)nb * sizeof(tkey);
    p->toks = pkv__alloc(&c->alloc, p->toks_bytes, 64);
    p->keys = pkv__alloc(&c->alloc, p->keys_bytes, 64);
    if (!p->toks || !p->keys) rc = pkv__say(c, PKV_ENOMEM, api, "the save's keys (%u blocks)", nb);
    bool known = false;
    if (!rc) rc = seq_peek(c, id, api, &n_tok, &n_com, &ns_lo, &ns_hi, &front, NULL, p->toks, nbk, &known);
    if (rc || !known) { /* (not known: a front whose ids the index lost; nothing to key) */
        save_done(c, p);
        return rc;
    }
    key_seed(c, ns_lo, ns_hi, &p->seed);
    uint32_t keyed = 0; /* up to a block whose key needs ids past the full blocks (a media's) */
    while (keyed < nb && key_next(keyed ? &p->keys[keyed - 1] : &p->seed, p->toks, keyed, B, n_com, &p->keys[keyed]))
        keyed++;
    if (keyed <= front) {
        save_done(c, p);
        return PKV_OK;
    }
    p->nb = keyed;
    p->first = front;
    return PKV_OK;
}

/* keys[hi - 1], keys[hi - 2], ... keys[hi - n] into ask, in that order (deepest first). */
static void keys_down(const tkey *keys, uint32_t hi, uint32_t n, uint8_t (*ask)[PKV__TIER_KEY]) {
    for (uint32_t i = 0; i < n; i++) memcpy(ask[i], keys[hi - 1 - i].b, PKV__TIER_KEY);
}

/* The probes of keys[0, n) (a get with no buffer each; PKV__TIER_KEY bytes a key), got[i] each
 * one's status: together where the store takes probes together (ext.probe_many), else one at a
 * time, up to a failure (those after it PKV__TIER_UNTRIED: nothing more is asked of a failing
 * store). */
static void probe_keys(pkv_tier *t, void *ctx, uint32_t n, uint8_t (*keys)[PKV__TIER_KEY], int *got) {
    if (t->ext.probe_many) {
        t->ext.probe_many(ctx, n, keys[0], got);
        return;
    }
    bool failed = false;
    for (uint32_t i = 0; i < n; i++) {
        size_t len = 0;
        got[i] = failed ? PKV__TIER_UNTRIED : t->ops.get(ctx, keys[i], NULL, 0, &len);
        failed |= got[i] != PKV_OK && got[i] != PKV_ENOENT;
    }
}

/* The puts of keys[0, n), entry i made by make(arg, i, ...) when its turn comes, res[i] each
 * one's status as ext.put_stream's contract has it: together where the store takes puts
 * together, else one at a time. */
static void put_keys(pkv_tier *t, void *ctx, uint32_t n, uint8_t (*keys)[PKV__TIER_KEY],
                     pkv__tier_make_fn make, void *arg, int *res) {
    if (t->ext.put_stream) {
        t->ext.put_stream(ctx, n, keys[0], make, arg, res);
        return;
    }
    for (uint32_t i = 0; i < n; i++) res[i] = PKV__TIER_UNTRIED;
    for (uint32_t i = 0; i < n; i++) {
        const void *data;
        size_t len;
        if ((res[i] = make(arg, i, &data, &len))) break;
        if ((res[i] = t->ops.put(ctx, keys[i], data, len)) != PKV_OK && res[i] != PKV_ENOSPC) break;
    }
}

/* The entries a save puts at once (pkv__tier_make_fn): blocks block[0, n) of sp, each made into
 * buf in turn; failed_at: the one whose rows the cache refused (PKV_NONE: none). */
typedef struct save_make {
    pkv_cache *c;
    pkv_seq id;
    const save_prep *sp;
    uint8_t *buf;
    uint32_t block[PKV__TIER_PROBES], n, failed_at;
} save_make;

static int save_make_one(void *arg, uint32_t i, const void **data, size_t *len) {
    save_make *m = arg;
    const save_prep *sp = m->sp;
    const int rc = fill_entry(m->c, m->id, &sp->sh, sp->keys, &sp->seed, sp->toks, m->block[i], m->buf);
    m->failed_at = rc ? i : PKV_NONE;
    *data = m->buf, *len = sp->sh.entry;
    return rc;
}

PKV_API int pkv_tier_save(pkv_tier *t, pkv_cache *c, pkv_seq id, uint32_t *n_saved) {
    if (!c) return PKV_EINVAL;
    if (!t) return PKV__SAY(c, PKV_EINVAL, "t is NULL");
    if (n_saved) *n_saved = 0;
    save_prep sp;
    int rc = save_prepare(c, id, __func__, &sp);
    if (rc || !sp.nb) return rc;
    const uint32_t nb = sp.nb;
    const size_t entry = sp.sh.entry;
    size_t buf_size = 0;
    uint8_t *buf = scratch_take(t, entry, &buf_size);
    bool *put = pkv__calloc(&c->alloc, nb, 1);
    uint32_t saved = 0, present = 0, no_room = 0;
    if (!buf || !put) rc = PKV__SAY(c, PKV_ENOMEM, "the entry buffer (%zu bytes)", entry);
    /* deepest first: in a least-recently-used store the beginnings of prefixes stay longest.
       Each block is probed (a get with no buffer), and put where the store lacks it: block by
       block, or up to PKV__TIER_PROBES at once where the store takes probes and puts together
       (one round trip for the probes, one for the puts), in the order the store sees them one
       by one */
    const bool many = t->ext.probe_many && t->ext.put_stream;
    save_make mk = {.c = c, .id = id, .sp = &sp, .buf = buf};
    for (uint32_t hi = nb; !rc && hi > sp.first;) {
        const uint32_t lo = !many ? hi - 1 : hi - sp.first > PKV__TIER_PROBES ? hi - PKV__TIER_PROBES : sp.first;
        const uint32_t n = hi - lo; /* block hi - 1 - i at i */
        uint8_t ask[PKV__TIER_PROBES][PKV__TIER_KEY];
        int got[PKV__TIER_PROBES], res[PKV__TIER_PROBES];
        keys_down(sp.keys, hi, n, ask);
        probe_keys(t, t->ctx, n, ask, got);
        /* the batch ends before a block found past one not found (its probe, a use, came before
           the puts of those deeper: it is asked again after them, so that the beginnings stay
           the latest used), and after a failed probe (the answers past it are a lost
           connection's; its put connects again, and the next batch asks for them anew) */
        uint32_t used = n;
        mk.n = 0, mk.failed_at = PKV_NONE;
        for (uint32_t i = 0; i < n; i++) {
            if (got[i] == PKV_OK) {
                if (mk.n) {
                    used = i;
                    break;
                }
                present++;
                continue;
            }
            const bool failed = got[i] != PKV_ENOENT;
            if (failed) COUNT(t, errors, 1); /* taken as absent: the put says more */
            mk.block[mk.n] = hi - 1 - i;
            memcpy(ask[mk.n++], sp.keys[hi - 1 - i].b, PKV__TIER_KEY);
            if (failed) {
                used = i + 1;
                break;
            }
        }
        if (mk.n) put_keys(t, t->ctx, mk.n, ask, save_make_one, &mk, res);
        /* every put that took is marked for the clean-up below (where the call fails), and so
           is every put that failed (its reply may have been lost with the connection after the
           store took it); the first failure fails the call */
        for (uint32_t i = 0; i < mk.n; i++) {
            const uint32_t j = mk.block[i];
            const int r = res[i];
            if (r == PKV__TIER_UNTRIED || i == mk.failed_at) { /* (the cache refused the rows: s changed) */
                if (i == mk.failed_at && !rc) rc = r;
                continue;
            }
            if (r == PKV_OK) put[j] = true, saved++;
            else if (r == PKV_ENOSPC) no_room++;
            else {
                put[j] = true;
                if (rc) continue;
                COUNT(t, errors, 1);
                rc = PKV__SAY(c, r < 0 && r > -64 ? r : PKV_EIO, "the tier's put of block %u failed: %s", j,
                              pkv_strerror(r));
            }
        }
        hi -= used;
    }
    /* none of this call's entries stays (nor one whose put failed), where the store lets them go: a del that fails (the
       store unreachable) ends the clean-up, rather than wait on each one */
    for (uint32_t i = sp.first; rc && put && i < nb; i++)
        if (put[i] && t->ops.del(t->ctx, sp.keys[i].b) != PKV_OK) {
            COUNT(t, errors, 1);
            break;
        }
    if (!rc) {
        pthread_mutex_lock(&t->mu);
        t->st.saved += saved, t->st.save_present += present, t->st.save_no_room += no_room;
        pthread_mutex_unlock(&t->mu);
        if (n_saved) *n_saved = saved;
    }
    pkv__free(&c->alloc, put, nb);
    scratch_give(t, buf, buf_size);
    save_done(c, &sp);
    return rc;
}

/* ---- load ---- */
/* ---- staging's memory (all under t->mu) ---- */
static uint64_t held(const pkv_tier *t) { return t->sz_staged + t->sz_spare + t->sz_write + t->sz_fetch; }

/* e (out of the map, its size taken out of whichever count held it) kept as a spare */
static void spare_keep(pkv_tier *t, pkv__tent *e) {
    e->hnext = t->spare;
    t->spare = e;
    t->sz_spare += e->size;
}

/* a spare of `size` bytes, out of the spares' count (the caller counts it again); NULL: none */
static pkv__tent *spare_take(pkv_tier *t, size_t size) {
    for (pkv__tent **at = &t->spare; *at; at = &(*at)->hnext)
        if ((*at)->size == size) {
            pkv__tent *e = *at;
            *at = e->hnext;
            t->sz_spare -= size;
            return e;
        }
    return NULL;
}

/* Drops spares, then the oldest staged entries, until `bytes` more fit (or nothing is left to
 * drop); what it drops is linked onto *drop for the caller to free after the lock. */
static void make_room(pkv_tier *t, uint64_t bytes, pkv__tent **drop) {
    while (held(t) + bytes > t->staged_cap && (t->spare || t->staged.oldest)) {
        pkv__tent *o = t->spare;
        if (o) {
            t->spare = o->hnext;
            t->sz_spare -= o->size;
        } else {
            o = t->staged.oldest;
            pkv__tmap_remove(&t->staged, o);
            t->sz_staged -= o->size;
            t->st.prefetch_dropped++;
        }
        o->hnext = *drop, *drop = o;
    }
}

/* Whether key's entry was staged by the prefetch: then copied into buf (cap bytes; *len its
 * size; one larger than cap is left for the store's own answer) and out of staging, its buffer
 * a spare. The copy is made outside the lock: the entry is out of the map, this thread's. */
static bool take_staged(pkv_tier *t, const tkey *key, uint8_t *buf, size_t cap, size_t *len) {
    pthread_mutex_lock(&t->mu);
    pkv__tent *e = t->pf_on ? pkv__tmap_find(&t->staged, key->b) : NULL;
    if (e && e->len <= cap) {
        pkv__tmap_remove(&t->staged, e);
        t->st.prefetch_hits++;
    } else {
        e = NULL;
    }
    pthread_mutex_unlock(&t->mu);
    if (!e) return false;
    memcpy(buf, e->data, e->len); /* still counted as staged meanwhile */
    *len = e->len;
    pthread_mutex_lock(&t->mu);
    t->sz_staged -= e->size;
    spare_keep(t, e);
    pthread_mutex_unlock(&t->mu);
    return true;
}

/* An entry the load refuses: counted, and deleted from the store. */
static void reject(pkv_tier *t, const tkey *key) {
    COUNT(t, rejected, 1);
    (void)t->ops.del(t->ctx, key->b);
}

/* Whether staging has key's entry. */
static bool staged_has(pkv_tier *t, const tkey *key) {
    pthread_mutex_lock(&t->mu);
    const bool staged = t->pf_on && pkv__tmap_find(&t->staged, key->b);
    pthread_mutex_unlock(&t->mu);
    return staged;
}

/* A windowed load's probes, from one block down: the answers of those asked together
 * (ext.probe_many), kept for blocks [lo, hi) of the prompt. */
typedef struct probes {
    uint32_t lo, hi;
    int8_t has[PKV__TIER_PROBES]; /* block lo + i: 1, 0, or -1 where the store failed */
} probes;

/* Whether the store (or staging) has block i's entry (keys[i]): 1, 0, or -1 where the store
 * failed. Asked alone, or with up to PKV__TIER_PROBES - 1 blocks below it where the store takes
 * probes together (the blocks a windowed load probes come in descending order: P keeps the
 * answers). */
static int probe(pkv_tier *t, const tkey *keys, uint32_t i, probes *P) {
    if (i >= P->lo && i < P->hi) return P->has[i - P->lo];
    if (staged_has(t, &keys[i])) return 1;
    if (!t->ext.probe_many) {
        size_t len = 0;
        const int g = t->ops.get(t->ctx, keys[i].b, NULL, 0, &len);
        return g == PKV_OK ? 1 : g == PKV_ENOENT ? 0 : -1;
    }
    /* blocks i, i - 1, ...: the staged ones known, the others asked together */
    uint8_t ask[PKV__TIER_PROBES][PKV__TIER_KEY];
    int got[PKV__TIER_PROBES];
    uint32_t at[PKV__TIER_PROBES], n = 0;
    P->hi = i + 1;
    P->lo = i + 1 > PKV__TIER_PROBES ? i + 1 - PKV__TIER_PROBES : 0;
    for (uint32_t b = i + 1; b-- > P->lo;) {
        if (b != i && staged_has(t, &keys[b])) {
            P->has[b - P->lo] = 1;
            continue;
        }
        memcpy(ask[n], keys[b].b, PKV__TIER_KEY);
        at[n++] = b;
    }
    t->ext.probe_many(t->ctx, n, ask[0], got);
    for (uint32_t j = 0; j < n; j++)
        P->has[at[j] - P->lo] = (int8_t)(got[j] == PKV_OK ? 1 : got[j] == PKV_ENOENT ? 0 : -1);
    return P->has[i - P->lo];
}

/* Blocks [from, to) of keys asked for again (a get with no buffer: a use, to a least-recently-used
 * store), deepest first, up to PKV__TIER_PROBES in one round trip where the store takes probes
 * together (in order). Ends at a store failure (counted: each call after it would wait on an
 * unreachable store). */
static void touch_down(pkv_tier *t, const tkey *keys, uint32_t from, uint32_t to) {
    uint8_t ask[PKV__TIER_PROBES][PKV__TIER_KEY];
    int got[PKV__TIER_PROBES];
    for (uint32_t j = to; j > from;) {
        const uint32_t n = j - from < PKV__TIER_PROBES ? j - from : PKV__TIER_PROBES;
        keys_down(keys, j, n, ask);
        probe_keys(t, t->ctx, n, ask, got);
        j -= n;
        for (uint32_t i = 0; i < n; i++)
            if (got[i] != PKV_OK && got[i] != PKV_ENOENT) {
                COUNT(t, errors, 1);
                return;
            }
    }
}

/* The front (blocks) a windowed load of an empty sequence that ends with block e - 1 sets: that
 * of a match of as many positions (pkv__window_front), the last token and a media's last few
 * ids given back first, as the load gives them back. */
static uint32_t plan_front(const int32_t *tokens, uint32_t n, uint32_t e, uint32_t B, uint32_t window) {
    uint32_t r = PKV_MIN(e * B, n - 1);
    r -= pkv__media_trim(tokens, n, r);
    return pkv__window_front(r, window, B);
}

/* A load's blocks on their way into its sequence. */
typedef struct load_run {
    pkv_tier *t;
    pkv_cache *c;
    pkv_seq id;
    const int32_t *tokens;
    uint32_t n, cap, full; /* the prompt's length, its positions a load may give, its full blocks */
    const shape *sh;
    const tkey *keys, *seed; /* keys[i]: block i's; seed: block 0's parent */
    uint8_t *buf;            /* an entry */
    uint32_t pos, blocks;    /* the sequence's length; blocks loaded */
    uint32_t miss_at;        /* the block the store lacked (PKV_NONE: none) */
    bool failed;             /* a store call failed */
} load_run;

/* Appends, writes (not commits) blocks [from, end) of the prompt from L->pos on, up to a block
 * the store lacks (L->miss_at), a store failure, an entry refused (then deleted) or no room in
 * the pool: each ends the run, successfully. Fails only where the sequence changed under the
 * call. */
static int load_blocks(load_run *L, uint32_t from, uint32_t end) {
    pkv_tier *t = L->t;
    pkv_cache *c = L->c;
    const shape *sh = L->sh;
    const uint32_t B = c->B;
    for (uint32_t i = from; i < end && L->pos < L->cap; i++) {
        const tkey *key = &L->keys[i], *prev = i ? &L->keys[i - 1] : L->seed;
        const int32_t *bt = L->tokens + (size_t)i * B;
        size_t len = 0;
        int g = PKV_OK;
        if (!take_staged(t, key, L->buf, sh->entry, &len)) {
            want_ahead(t, t->ctx, key, L->tokens, i, L->full, B, L->n);
            g = t->ops.get(t->ctx, key->b, L->buf, sh->entry, &len);
        }
        if (g == PKV_ENOENT) {
            L->miss_at = i;
            return PKV_OK;
        }
        if (g != PKV_OK && g != PKV_ENOSPC) {
            COUNT(t, errors, 1);
            L->failed = true;
            return PKV_OK;
        }
        if (g == PKV_ENOSPC || !entry_ok(sh, L->buf, len, key, prev, bt)) {
            reject(t, key);
            return PKV_OK;
        }
        const uint32_t at = L->pos, to = PKV_MIN((i + 1) * B, L->cap), cnt = to - at;
        const int a = pkv_seq_append(c, L->id, L->tokens + at, cnt, NULL);
        if (a == PKV_ENOSPC || a == PKV_ELIMIT) return PKV_OK; /* no room: the load ends, successfully */
        if (a) return a;                                       /* only where s changed under the call */
        const uint8_t *p = L->buf + sizeof(tier_hdr) + (size_t)B * sizeof(int32_t);
        const size_t skip = at - (size_t)i * B;
        int w = PKV_OK;
        for (uint32_t l = 0; !w && l < c->n_layers; l++, p += sh->layer)
            w = pkv_seq_write_stored(c, L->id, l, at, cnt, p + skip * sh->k_rows,
                                     sh->v_rows ? p + (size_t)B * sh->k_rows + skip * sh->v_rows : NULL);
        if (w) { /* rows the cache refuses (crafted to pass the checksum): a refused entry */
            const int r = pkv_seq_truncate(c, L->id, at);
            reject(t, key);
            return r;
        }
        L->pos = to, L->blocks++;
    }
    return PKV_OK;
}

/* A sequence that skipped its front to front_pos (pkv__seq_skip) and loaded past it, uncommitted,
 * made empty again: the loaded positions cut, the skip undone. */
static int back_to_empty(pkv_cache *c, pkv_seq id, uint32_t front_pos, const char *api) {
    const int rc = pkv_seq_truncate(c, id, front_pos);
    return rc ? rc : pkv__seq_skip(c, id, 0, api);
}

/* pkv_tier_load (window 0) and pkv_tier_load_window. */
static int load(pkv_tier *t, pkv_cache *c, pkv_seq id, const int32_t *tokens, uint32_t n, uint32_t window,
                uint32_t *n_loaded, const char *api) {
    if (!n_loaded) return pkv__say(c, PKV_EINVAL, api, "n_loaded is NULL");
    if (n && !tokens) return pkv__say(c, PKV_EINVAL, api, "tokens is NULL, n %u", n);
    *n_loaded = 0;
    uint32_t m, n_com, front;
    uint64_t ns_lo, ns_hi;
    int rc = seq_peek(c, id, api, &m, &n_com, &ns_lo, &ns_hi, &front, NULL, NULL, 0, NULL);
    if (rc) return rc;
    if (n_com != m)
        return pkv__say(c, PKV_EINVAL, api, "positions [%u, %u) of the sequence are not committed", n_com, m);
    if (m > n) return pkv__say(c, PKV_EINVAL, api, "the sequence holds %u positions, past the prompt's %u", m, n);
    const uint32_t B = c->B, cap = n ? n - 1 : 0;
    const uint32_t full = PKV_MIN(n / B, c->max_bps), i0 = m / B;
    if (m >= cap || i0 >= full) return PKV_OK;
    shape sh;
    if (!shape_of(c, &sh)) return pkv__say(c, PKV_ENOMEM, api, "an entry's size overflows");
    /* the sequence's own positions must be the prompt's: its blocks' token ids, compared (a
       dropped block's from the index: where it no longer names them, nothing is loaded) */
    const size_t toks_bytes = ((size_t)i0 + 1) * B * sizeof(int32_t), keys_bytes = (size_t)full * sizeof(tkey);
    int32_t *toks = pkv__alloc(&c->alloc, toks_bytes, 64);
    tkey *keys = pkv__alloc(&c->alloc, keys_bytes, 64);
    size_t buf_size = 0;
    uint8_t *buf = scratch_take(t, sh.entry, &buf_size);
    bool known = false;
    if (!toks || !keys || !buf) rc = pkv__say(c, PKV_ENOMEM, api, "the entry buffer (%zu bytes)", sh.entry);
    if (!rc) {
        /* the blocks of [0, m): i0 full ones and, where m is not a multiple of B, part of one */
        const uint32_t nbk = (m + B - 1) / B;
        rc = seq_peek(c, id, api, &m, &n_com, &ns_lo, &ns_hi, &front, NULL, toks, nbk, &known);
        if (!rc && known && memcmp(toks, tokens, (size_t)m * sizeof(int32_t)))
            rc = pkv__say(c, PKV_EINVAL, api, "the sequence's positions [0, %u) are not tokens[0, %u)", m, m);
    }
    uint32_t start = i0, end = 0, keyed = 0;
    bool miss = false; /* the store lacked a block the load asked for */
    tkey seed;
    if (!rc && known) {
        key_seed(c, ns_lo, ns_hi, &seed);
        /* (a key that needs ids past the prompt, a media's: the blocks from it on do not load) */
        while (keyed < full && key_next(keyed ? &keys[keyed - 1] : &seed, tokens, keyed, B, n, &keys[keyed])) keyed++;
        end = keyed;
    }
    load_run L = {.t = t, .c = c, .id = id, .tokens = tokens, .n = n, .cap = cap, .full = full, .sh = &sh,
                  .keys = keys, .seed = &seed, .buf = buf, .pos = m, .miss_at = PKV_NONE};
    if (!rc && known) {
        /* an empty sequence under a window: first the latest window, with no question asked of
           the store (where it holds that window whole, the usual case, that is the load) */
        bool planned = !window || m || !keyed;
        if (!planned) {
            end = PKV_MIN(keyed, (cap + B - 1) / B); /* (a block past cap loads nothing) */
            start = plan_front(tokens, n, end, B, window);
        }
        for (;;) {
            if (start > i0) { /* the blocks before start are skipped: s's dropped front */
                rc = pkv__seq_skip(c, id, start * B, api);
                L.pos = start * B;
            }
            if (!rc) rc = load_blocks(&L, start, end);
            if (rc || planned || L.miss_at == PKV_NONE) break;
            planned = true;
            miss = true;
            /* the store lacks block j of that window: every end past j is ruled out (its window
               reaches back over j). Where the window ending at j starts at or past start, what
               was loaded is it; else s goes back to empty, and the latest end whose window's
               blocks the store has all is found from j down (each block probed once: a block
               missing rules out every end past it, whose windows reach back over it) */
            const uint32_t j = L.miss_at;
            if (plan_front(tokens, n, j, B, window) >= start) break;
            if ((rc = back_to_empty(c, id, start * B, api))) break;
            L.pos = 0, L.blocks = 0, L.miss_at = PKV_NONE, start = end = 0;
            probes P = {.lo = 0, .hi = 0};
            for (uint32_t e = j; e;) {
                const uint32_t lo = plan_front(tokens, n, e, B, window);
                uint32_t k = e;
                int pr = 1;
                while (k > lo && (pr = probe(t, keys, k - 1, &P)) == 1) k--;
                if (pr < 0) { /* nothing more is asked of a failing store */
                    COUNT(t, errors, 1);
                    L.failed = true;
                    break;
                }
                if (k == lo) {
                    start = lo, end = e;
                    break;
                }
                e = k - 1;
            }
            if (L.failed || !end) break;
        }
        miss |= L.miss_at != PKV_NONE;
        const uint32_t pos0 = start > i0 ? start * B : m; /* where the K/V loaded starts */
        /* committed once at the end, so that a load ending a few ids into a media whose next
           position the prompt has gives them back first, as a match does (pkv__media_trim) */
        if (!rc && L.pos > pos0) {
            const uint32_t trim = PKV_MIN(pkv__media_trim(tokens, n, L.pos), L.pos - pos0);
            if (trim) { /* the positions given back are never committed, even where this fails */
                L.pos -= trim;
                rc = pkv_seq_truncate(c, id, L.pos);
            }
        }
        if (!rc && start > i0 && start > pkv__window_front(L.pos, window, B)) {
            /* a skip the window no longer allows (the load ended early): s goes back to empty
               (the front ahead of every query it could make) */
            rc = back_to_empty(c, id, start * B, api);
            L.pos = m, L.blocks = 0;
        }
        if (L.pos > pos0) {
            const int cr = pkv_seq_commit(c, id, L.pos); /* fails only where s changed under the call */
            if (!rc) rc = cr;
        }
        if (!rc && start > i0 && L.pos > pos0) pkv__seq_link_front(c, id, tokens);
        /* touched again deepest first (the last one loaded is the latest used already), so that
           a least-recently-used store keeps the beginnings; not after a store failure */
        if (!L.failed && L.blocks > 1) touch_down(t, keys, start, start + L.blocks - 1);
        pthread_mutex_lock(&t->mu);
        t->st.loaded_blocks += L.blocks, t->st.load_misses += miss;
        t->st.loaded_tokens += L.pos > pos0 ? L.pos - pos0 : 0;
        pthread_mutex_unlock(&t->mu);
        *n_loaded = L.pos - m;
    }
    scratch_give(t, buf, buf_size);
    pkv__free(&c->alloc, keys, keys_bytes);
    pkv__free(&c->alloc, toks, toks_bytes);
    return rc;
}

PKV_API int pkv_tier_load(pkv_tier *t, pkv_cache *c, pkv_seq id, const int32_t *tokens, uint32_t n,
                          uint32_t *n_loaded) {
    if (!c) return PKV_EINVAL;
    if (!t) return PKV__SAY(c, PKV_EINVAL, "t is NULL");
    return load(t, c, id, tokens, n, 0, n_loaded, __func__);
}

PKV_API int pkv_tier_load_window(pkv_tier *t, pkv_cache *c, pkv_seq id, const int32_t *tokens, uint32_t n,
                                 uint32_t window, uint32_t *n_loaded) {
    if (!c) return PKV_EINVAL;
    if (!t) return PKV__SAY(c, PKV_EINVAL, "t is NULL");
    if (!window) return PKV__SAY(c, PKV_EINVAL, "window is 0: pkv_tier_load needs none");
    return load(t, c, id, tokens, n, window, n_loaded, __func__);
}

/* ---- prefetch ---- */
/* Whether the tier's thread runs (pkv_tier_prefetch_start). */
static bool thread_on(pkv_tier *t) {
    pthread_mutex_lock(&t->mu);
    const bool on = t->pf_on;
    pthread_mutex_unlock(&t->mu);
    return on;
}

#define PF_MAX_JOBS 64

struct pf_job {
    pf_job *next;
    tkey seed;      /* the chain's seed: namespace and shape */
    shape sh;       /* the cache's, as the entries' checks need it */
    uint32_t B, nb; /* block tokens; blocks to fetch */
    uint32_t known; /* ids in toks: the blocks' and up to PKV__MEDIA_MIN after them (key_next) */
    uint32_t n, window; /* the prompt's length; pkv_tier_prefetch_window's window (0: none) */
    int32_t toks[]; /* [nb][B], then those */
};

static size_t job_size(uint32_t nb, uint32_t B) {
    return sizeof(pf_job) + ((size_t)nb * B + PKV__MEDIA_MIN) * sizeof(int32_t);
}

/* Fetches job's entries in order into staging, until the first the store lacks (or fails). */
static void free_chain(pkv_tier *t, pkv__tent *e) { /* entries linked through hnext */
    while (e) {
        pkv__tent *next = e->hnext;
        pkv__tmap_free(&t->staged, e);
        e = next;
    }
}

/* The prefetch's buffer for one entry (counted as the fetch in flight): a spare of its size, else
 * room made (spares first, then the oldest staged entries) and a new one. NULL where the
 * allocator has none, or where the writes waiting hold the room (then nothing is dropped). */
static pkv__tent *fetch_buffer(pkv_tier *t, const tkey *key, size_t entry) {
    const size_t need = sizeof(pkv__tent) + entry; /* pkv__tmap_new's size */
    pkv__tent *drop = NULL;
    pthread_mutex_lock(&t->mu);
    pkv__tent *e = spare_take(t, need);
    const bool room = e || t->sz_write + t->sz_fetch + need <= t->staged_cap;
    if (!e && room) make_room(t, need, &drop);
    if (room) t->sz_fetch += need;
    pthread_mutex_unlock(&t->mu);
    free_chain(t, drop);
    if (!room) return NULL;
    if (e) {
        memcpy(e->key, key->b, PKV__TIER_KEY);
        e->len = entry;
        e->hnext = e->older = e->newer = NULL;
    } else if (!(e = pkv__tmap_new(&t->staged, key->b, entry, entry))) {
        pthread_mutex_lock(&t->mu);
        t->sz_fetch -= need;
        pthread_mutex_unlock(&t->mu);
    }
    return e;
}

/* Fetches job's entries in order into staging, until the first the store lacks, fails or gives
 * wrong (the header, token ids and checksum are checked here, so a staged entry is the one the
 * load would accept from the store, and a garbled one is left for the load to find there). */
static void prefetch_job(pkv_tier *t, const pf_job *j) {
    tkey key = j->seed, parent;
    /* under a window, the blocks a windowed load of the whole prompt reads (its front on) */
    const uint32_t from = j->window ? plan_front(j->toks, j->n, j->nb, j->B, j->window) : 0;
    for (uint32_t i = 0; i < j->nb; i++) {
        const int32_t *bt = j->toks + (size_t)i * j->B;
        parent = key;
        if (!key_next(&parent, j->toks, i, j->B, j->known, &key)) return;
        if (i < from) continue;
        pthread_mutex_lock(&t->mu);
        pkv__tent *have = pkv__tmap_find(&t->staged, key.b);
        if (have) pkv__tmap_touch(&t->staged, have);
        const bool stop = t->pf_stop;
        pthread_mutex_unlock(&t->mu);
        if (stop) return;
        if (have) continue;
        if (sizeof(pkv__tent) + j->sh.entry > t->staged_cap) return;
        pkv__tent *e = fetch_buffer(t, &key, j->sh.entry);
        if (!e) return;
        size_t len = 0;
        want_ahead(t, t->tctx, &key, j->toks, i, j->nb, j->B, j->known);
        const int g = t->ops.get(t->tctx, key.b, e->data, j->sh.entry, &len);
        const bool ok = g == PKV_OK && entry_ok(&j->sh, e->data, len, &key, &parent, bt);
        pthread_mutex_lock(&t->mu);
        t->sz_fetch -= e->size;
        if (ok && !pkv__tmap_find(&t->staged, key.b)) { /* only this thread stages: always absent */
            pkv__tmap_insert(&t->staged, e);
            t->sz_staged += e->size;
            t->st.prefetched++;
        } else {
            spare_keep(t, e);
        }
        if (g != PKV_OK && g != PKV_ENOENT && g != PKV_ENOSPC) t->st.errors++;
        pthread_mutex_unlock(&t->mu);
        if (!ok) return;
    }
}

/* A queued write done (under the lock): counted by the probe's status g and the put's r (where
 * g was not PKV_OK), its buffer then a spare. */
static void wrote(pkv_tier *t, pkv__tent *e, int g, int r) {
    if (g != PKV_OK && g != PKV_ENOENT) t->st.errors++; /* taken as absent: the put says more */
    if (g == PKV_OK) t->st.save_present++;
    else if (r == PKV_OK) t->st.saved++;
    else if (r == PKV_ENOSPC) t->st.save_no_room++;
    else t->st.errors++, t->wb_failed++;
    t->sz_write -= e->size;
    spare_keep(t, e);
    t->wb_done++;
}

/* The entries a write-back puts at once (pkv__tier_make_fn): e[at[i]], made already. */
typedef struct wb_make {
    pkv__tent *const *e;
    uint32_t at[PKV__TIER_PROBES];
} wb_make;

static int wb_make_one(void *arg, uint32_t i, const void **data, size_t *len) {
    const wb_make *m = arg;
    const pkv__tent *x = m->e[m->at[i]];
    *data = x->data, *len = (size_t)x->len;
    return PKV_OK;
}

/* Queued writes e[0, n) (n <= PKV__TIER_PROBES; more than 1 only where the store takes probes and
 * puts together): each put unless the store has it; wrote() counts each. Together, in rounds,
 * each its probes in one round trip, then the puts of those not found in another, as the store
 * would see them one at a time: a round ends before an entry found past one not found (that
 * probe, a use, came before the puts before it: it is asked again in the next round, after
 * them, as the save's batches do). A key twice in a round (two saves of one prompt queued
 * together) is probed and put once, the second counted as found where that put took, as one at
 * a time would count them. An entry whose put was not tried (a write failed before it: the
 * connection lost) is put alone, as the ops would (connecting again). */
static void write_back(pkv_tier *t, pkv__tent *const *e, uint32_t n) {
    for (uint32_t off = 0; off < n;) {
        pkv__tent *const *x = e + off;
        const uint32_t m = n - off; /* this round's candidates: x[0, m) */
        int got[PKV__TIER_PROBES], put[PKV__TIER_PROBES];
        uint32_t first[PKV__TIER_PROBES], end = m; /* first: x[i]'s key's first among them */
        for (uint32_t i = 0; i < m; i++) {
            got[i] = put[i] = PKV__TIER_UNTRIED;
            first[i] = i;
            for (uint32_t j = 0; j < i && first[i] == i; j++)
                if (!memcmp(x[i]->key, x[j]->key, PKV__TIER_KEY)) first[i] = j;
        }
        if (m > 1) {
            uint8_t ask[PKV__TIER_PROBES][PKV__TIER_KEY];
            int res[PKV__TIER_PROBES];
            wb_make mk = {.e = x};
            uint32_t q = 0, k = 0;
            for (uint32_t i = 0; i < m; i++)
                if (first[i] == i) memcpy(ask[q], x[i]->key, PKV__TIER_KEY), mk.at[q++] = i;
            probe_keys(t, t->tctx, q, ask, res);
            for (uint32_t j = 0; j < q; j++) got[mk.at[j]] = res[j];
            for (uint32_t i = 0; i < m; i++) { /* the round's end; its absent keys, in order */
                if (first[i] != i) continue;
                if (got[i] == PKV_OK) {
                    if (k) {
                        end = i;
                        break;
                    }
                    continue;
                }
                memcpy(ask[k], x[i]->key, PKV__TIER_KEY), mk.at[k++] = i;
                if (got[i] != PKV_ENOENT) { /* a failed probe (taken as absent): the answers past
                                               it are a lost connection's, asked anew next round */
                    end = i + 1;
                    break;
                }
            }
            if (k) put_keys(t, t->tctx, k, ask, wb_make_one, &mk, res);
            for (uint32_t j = 0; j < k; j++) put[mk.at[j]] = res[j];
        }
        /* one at a time: alone, or where a put together failed or was not tried (the connection
           lost: put alone, connecting again, as the ops would; a SET is put again harmlessly
           where only its reply was lost), until a call alone fails too */
        bool down = false;
        for (uint32_t i = 0; i < end; i++) {
            if (first[i] != i) continue;
            size_t len = 0;
            if (got[i] == PKV__TIER_UNTRIED)
                got[i] = down ? PKV_EIO : t->ops.get(t->tctx, x[i]->key, NULL, 0, &len);
            if (got[i] == PKV_OK) {
                put[i] = PKV_OK;
                continue;
            }
            if (put[i] == PKV_OK || put[i] == PKV_ENOSPC) continue;
            put[i] = down ? PKV_EIO : t->ops.put(t->tctx, x[i]->key, x[i]->data, x[i]->len);
            down = put[i] != PKV_OK && put[i] != PKV_ENOSPC;
        }
        for (uint32_t i = 0; i < end; i++)
            if (first[i] != i) {
                const uint32_t f = first[i];
                got[i] = got[f] == PKV_OK || put[f] == PKV_OK ? PKV_OK : got[f];
                put[i] = put[f];
            }
        pthread_mutex_lock(&t->mu);
        for (uint32_t i = 0; i < end; i++) wrote(t, x[i], got[i], put[i]);
        pthread_mutex_unlock(&t->mu);
        off += end;
    }
}

static void *prefetch_main(void *arg) {
    pkv_tier *t = arg;
    pthread_mutex_lock(&t->mu);
    for (;;) {
        while (!t->pf_stop && !t->pf_head && !t->wb_head) pthread_cond_wait(&t->pf_cv, &t->mu);
        if (t->wb_head) { /* writes first, and all of them before the thread stops */
            pkv__tent *e[PKV__TIER_PROBES];
            uint32_t n = 0;
            const uint32_t most = t->ext.probe_many && t->ext.put_stream ? PKV__TIER_PROBES : 1;
            for (; n < most && t->wb_head; n++) {
                e[n] = t->wb_head;
                t->wb_head = e[n]->hnext;
            }
            if (!t->wb_head) t->wb_tail = NULL;
            pthread_mutex_unlock(&t->mu);
            write_back(t, e, n);
            pthread_mutex_lock(&t->mu);
            pthread_cond_broadcast(&t->pf_idle); /* a flush waits for its count of writes done */
            continue;
        }
        if (t->pf_stop) break;
        pf_job *j = t->pf_head;
        t->pf_head = j->next;
        if (!t->pf_head) t->pf_tail = NULL;
        pthread_mutex_unlock(&t->mu);
        prefetch_job(t, j);
        pkv__free(&t->alloc, j, job_size(j->nb, j->B));
        pthread_mutex_lock(&t->mu);
        t->pf_n--;
        if (!t->pf_n) pthread_cond_broadcast(&t->pf_idle);
    }
    pthread_mutex_unlock(&t->mu);
    return NULL;
}

PKV_API int pkv_tier_prefetch_start(pkv_tier *t, uint64_t staging_bytes) {
    if (!t || !staging_bytes) return PKV_EINVAL;
    /* all under the lock: a second start waits, then finds it on (the new thread waits for the
       lock before it looks at anything) */
    pthread_mutex_lock(&t->mu);
    int rc = t->pf_on ? PKV_EINVAL : pkv__tmap_init(&t->staged, &t->alloc);
    if (!rc) {
        t->staged_cap = staging_bytes;
        t->pf_stop = false;
        /* a context of the thread's own where the store makes one (else the callers'): not
           connected until the thread's first call */
        void *own = NULL;
        t->tctx = t->ext.clone && !t->ext.clone(t->ctx, &own) ? own : t->ctx;
        pthread_cond_init(&t->pf_cv, NULL);
        pthread_cond_init(&t->pf_idle, NULL);
        if (pthread_create(&t->pf_thread, NULL, prefetch_main, t)) {
            rc = PKV_ENOMEM;
            pthread_cond_destroy(&t->pf_cv);
            pthread_cond_destroy(&t->pf_idle);
            pkv__tmap_fini(&t->staged);
            thread_ctx_drop(t);
        } else {
            t->pf_on = true;
        }
    }
    pthread_mutex_unlock(&t->mu);
    return rc;
}

static void prefetch_stop(pkv_tier *t) {
    pthread_mutex_lock(&t->mu);
    t->pf_stop = true;
    pthread_cond_broadcast(&t->pf_cv);
    pthread_mutex_unlock(&t->mu);
    pthread_join(t->pf_thread, NULL);
    for (pf_job *j = t->pf_head, *next; j; j = next) {
        next = j->next;
        pkv__free(&t->alloc, j, job_size(j->nb, j->B));
    }
    t->pf_head = t->pf_tail = NULL;
    free_chain(t, t->spare);
    t->spare = NULL;
    t->sz_staged = t->sz_spare = t->sz_write = t->sz_fetch = 0;
    pthread_cond_destroy(&t->pf_cv);
    pthread_cond_destroy(&t->pf_idle);
    pkv__tmap_fini(&t->staged);
    thread_ctx_drop(t);
    t->pf_on = false;
}

static int prefetch(pkv_tier *t, const pkv_cache *c, const void *salt, size_t salt_len, const int32_t *tokens,
                    uint32_t n, uint32_t window) {
    if (!t || !c || (!salt && salt_len) || salt_len > 256 || (!tokens && n) || !thread_on(t)) return PKV_EINVAL;
    const uint32_t B = c->B, nb = PKV_MIN(n / B, c->max_bps);
    if (!nb) return PKV_OK;
    shape sh;
    if (!shape_of(c, &sh)) return PKV_ENOMEM;
    pf_job *j = pkv__alloc(&t->alloc, job_size(nb, B), 64);
    if (!j) return PKV_ENOMEM;
    uint64_t ns_lo, ns_hi;
    pkv__salt_digest(salt, salt_len, &ns_lo, &ns_hi);
    key_seed(c, ns_lo, ns_hi, &j->seed);
    j->next = NULL, j->B = B, j->nb = nb, j->sh = sh, j->n = n, j->window = window;
    j->known = (uint32_t)PKV_MIN((uint64_t)n, (uint64_t)nb * B + PKV__MEDIA_MIN);
    memcpy(j->toks, tokens, (size_t)j->known * sizeof(int32_t));
    pthread_mutex_lock(&t->mu);
    const bool full = t->pf_n >= PF_MAX_JOBS;
    if (!full) {
        if (t->pf_tail) t->pf_tail->next = j;
        else t->pf_head = j;
        t->pf_tail = j;
        t->pf_n++;
        pthread_cond_signal(&t->pf_cv);
    }
    pthread_mutex_unlock(&t->mu);
    if (full) pkv__free(&t->alloc, j, job_size(nb, B));
    return full ? PKV_EBUSY : PKV_OK;
}

PKV_API int pkv_tier_prefetch(pkv_tier *t, const pkv_cache *c, const void *salt, size_t salt_len,
                              const int32_t *tokens, uint32_t n) {
    return prefetch(t, c, salt, salt_len, tokens, n, 0);
}

PKV_API int pkv_tier_prefetch_window(pkv_tier *t, const pkv_cache *c, const void *salt, size_t salt_len,
                                     const int32_t *tokens, uint32_t n, uint32_t window) {
    return window ? prefetch(t, c, salt, salt_len, tokens, n, window) : PKV_EINVAL;
}

PKV_API int pkv_tier_prefetch_wait(pkv_tier *t) {
    if (!t) return PKV_EINVAL;
    pthread_mutex_lock(&t->mu);
    const bool on = t->pf_on;
    while (on && t->pf_n) pthread_cond_wait(&t->pf_idle, &t->mu);
    pthread_mutex_unlock(&t->mu);
    return on ? PKV_OK : PKV_EINVAL;
}

/* ---- write-back ---- */
PKV_API int pkv_tier_save_async(pkv_tier *t, pkv_cache *c, pkv_seq id, uint32_t *n_queued) {
    if (!c) return PKV_EINVAL;
    if (!t) return PKV__SAY(c, PKV_EINVAL, "t is NULL");
    if (n_queued) *n_queued = 0;
    if (!thread_on(t)) return PKV__SAY(c, PKV_EINVAL, "the tier's thread is not started (pkv_tier_prefetch_start)");
    save_prep sp;
    int rc = save_prepare(c, id, __func__, &sp);
    if (rc || !sp.nb) return rc;
    const uint32_t nb = sp.nb - sp.first; /* entries */
    const shape sh = sp.sh;
    /* room for all of them, or none: the spares of their size, the rest made room for by
       dropping spares and staged entries; where the writes waiting (and a fetch) hold too much
       for that, nothing is dropped and the save is made now instead */
    const size_t need = sizeof(pkv__tent) + sh.entry;
    const uint64_t total = (uint64_t)nb * need;
    pkv__tent *mine = NULL, *drop = NULL;
    bool room;
    {
        pthread_mutex_lock(&t->mu);
        room = t->sz_write + t->sz_fetch + total <= t->staged_cap;
        uint32_t have = 0;
        for (pkv__tent *e; room && have < nb && (e = spare_take(t, need)); have++) e->hnext = mine, mine = e;
        if (room) {
            t->sz_write += (uint64_t)have * need; /* the spares taken, now the writes' */
            make_room(t, (uint64_t)(nb - have) * need, &drop);
            t->sz_write += (uint64_t)(nb - have) * need;
        }
        pthread_mutex_unlock(&t->mu);
        free_chain(t, drop);
        for (uint32_t k = have; room && k < nb; k++) {
            pkv__tent *e = pkv__tmap_new(&t->staged, sp.keys[0].b, sh.entry, sh.entry);
            if (!e) { /* the allocator has none: the save is made now, as for want of room */
                room = false;
                pthread_mutex_lock(&t->mu);
                t->sz_write -= (uint64_t)(nb - k) * need; /* those never allocated */
                pthread_mutex_unlock(&t->mu);
                break;
            }
            e->hnext = mine, mine = e;
        }
    }
    pkv__tent *head = NULL, *tail = NULL; /* this call's entries, deepest first */
    if (room) {
        for (uint32_t j = sp.nb; !rc && j-- > sp.first;) {
            pkv__tent *e = mine;
            mine = e->hnext;
            memcpy(e->key, sp.keys[j].b, PKV__TIER_KEY);
            e->len = sh.entry;
            e->hnext = e->older = e->newer = NULL;
            if (tail) tail->hnext = e;
            else head = e;
            tail = e;
            rc = fill_entry(c, id, &sh, sp.keys, &sp.seed, sp.toks, j, e->data);
        }
    }
    if (!rc && room) { /* queued in one step */
        pthread_mutex_lock(&t->mu);
        if (t->wb_tail) t->wb_tail->hnext = head;
        else t->wb_head = head;
        t->wb_tail = tail;
        t->wb_enq += nb;
        pthread_cond_signal(&t->pf_cv);
        pthread_mutex_unlock(&t->mu);
        if (n_queued) *n_queued = nb;
        head = NULL;
    }
    if (head || mine) { /* not queued: the buffers back as spares */
        if (tail) tail->hnext = mine;
        else head = mine;
        pthread_mutex_lock(&t->mu);
        for (pkv__tent *e = head, *next; e; e = next) {
            next = e->hnext;
            t->sz_write -= e->size;
            spare_keep(t, e);
        }
        pthread_mutex_unlock(&t->mu);
    }
    save_done(c, &sp);
    if (!rc && !room) return pkv_tier_save(t, c, id, NULL); /* no room to wait in: now */
    return rc;
}

PKV_API int pkv_tier_flush(pkv_tier *t) {
    if (!t) return PKV_EINVAL;
    pthread_mutex_lock(&t->mu);
    const bool on = t->pf_on;
    const uint64_t target = t->wb_enq; /* the writes queued before this call */
    while (on && t->wb_done < target) pthread_cond_wait(&t->pf_idle, &t->mu);
    const uint64_t failed = t->wb_failed;
    t->wb_failed = 0;
    pthread_mutex_unlock(&t->mu);
    return !on ? PKV_EINVAL : failed ? PKV_EIO : PKV_OK;
}
