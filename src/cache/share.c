/* share.c: shared-prefix decode. The sequences of a decode batch whose block tables begin with
 * the same blocks (forks for parallel sampling or beam search, requests whose prompts the
 * prefix cache matched) see the same keys there. Each such group's queries go through those
 * blocks together, as the rows of one item of many queries (the kernels' prefill tiles: a K/V
 * row read once for all of them), and each member's own blocks after them as a decode of its own;
 * the two parts are merged by log-sum-exp. FlashInfer and vLLM call this cascade attention. */
#include "cache_int.h"

#include <stdlib.h>
#include <string.h>

/* The blocks of item it that a group may share, counted from *base, the first block its queries
 * see: the whole blocks before its first query's position (its own part keeps at least that key,
 * and every later query sees them too) from the first key every query sees, where that is the
 * first key of each (pkv__attn_key_lo) and starts a block (chunks of local attention of whole
 * blocks, Llama 4's 8192; a window that hides no key, or one that starts on a block boundary);
 * none where a window or chunk starts inside a block or moves between the item's queries (a key
 * some query sees and the group does not read), none for an empty request. */
static uint32_t share_full(const pkv_cache *c, const pkv__attn_item *it, const pkv__attn_call *call, uint32_t *base) {
    *base = 0;
    if (!it->n_q || it->k_end) return 0; /* (k_end: non-causal queries, one request a sequence is theirs) */
    const uint32_t lo = pkv__attn_key_lo(call, it->q_pos0 + it->n_q - 1);
    if (lo % c->B || pkv__attn_key_lo(call, it->q_pos0) != lo) return 0;
    *base = lo / c->B;
    return it->q_pos0 / c->B - *base;
}

/* Item i's table from its base on: what the groups compare and read. */
static const int32_t *share_table(const pkv_cache *c, uint32_t i) {
    return c->items[i].block_table + c->share.base[i];
}

/* Whether item a's table sorts before item b's: by their shareable blocks' ids as bytes, then the
 * shorter first, then by index. Any total order over the tables puts those that share a prefix
 * side by side, which is all the grouping needs. */
static bool share_before(const pkv_cache *c, const uint32_t *full, uint32_t a, uint32_t b) {
    if (c->share.base[a] != c->share.base[b]) return c->share.base[a] < c->share.base[b]; /* never grouped */
    const uint32_t n = PKV_MIN(full[a], full[b]);
    const int r = memcmp(share_table(c, a), share_table(c, b), (size_t)n * sizeof(int32_t));
    if (r) return r < 0;
    if (full[a] != full[b]) return full[a] < full[b];
    return a < b;
}

/* What the plan's two sorts order by: the tables (share_before), or the intervals' depths. */
typedef struct share_key {
    const pkv_cache *c;
    const uint32_t *full;  /* the tables' sort */
    const uint32_t *depth; /* the intervals' sort, where not NULL */
} share_key;
static bool key_before(const share_key *k, uint32_t a, uint32_t b) {
    return k->depth ? k->depth[a] < k->depth[b] : share_before(k->c, k->full, a, b);
}

/* Sorts a[0, n) by key_before, equal keys kept in the order given (bottom-up merge sort through
 * tmp). Returns the sorted array, a or tmp. */
static uint32_t *share_sort(const share_key *k, uint32_t *a, uint32_t *tmp, uint32_t n) {
    for (uint32_t w = 1; w < n; w *= 2) {
        for (uint32_t lo = 0; lo < n; lo += 2 * w) {
            const uint32_t mid = PKV_MIN(lo + w, n), hi = PKV_MIN(lo + 2 * w, n);
            uint32_t i = lo, j = mid, o = lo;
            while (i < mid && j < hi) tmp[o++] = key_before(k, a[j], a[i]) ? a[j++] : a[i++];
            while (i < mid) tmp[o++] = a[i++];
            while (j < hi) tmp[o++] = a[j++];
        }
        uint32_t *t = a;
        a = tmp, tmp = t;
    }
    return a;
}

/* The groups of the n sorted members (lcp: neighbours' shared blocks): every lcp interval, a
 * maximal run [a, b] of members whose neighbours all share at least d blocks, with d the least
 * of them (the trie's branching points: the intervals nest), found by one pass with a stack;
 * each interval the run of members that share its first d blocks. An interval is a group where it
 * reads min_blocks or more past the nearest enclosing group (or 0) and the scratch has rows for
 * its members' queries (cap in all), taken shallowest first; a group of m members reading blocks [f, d)
 * saves (m - 1) x (d - f) block reads, and every nesting level adds to what its outer groups
 * save. Writes sh->groups, shallowest first; returns their count. */
static uint32_t share_intervals(pkv__share *sh, uint32_t n, uint32_t cap) {
    const uint32_t *lcp = sh->lcp;
    uint32_t *st_lcp = sh->st_lcp, *st_lb = sh->st_lb, *st_id = sh->st_id, top = 0, ids = 1, n_rep = 0;
    uint32_t *rep = sh->tmp; /* the intervals in the order they close (inner ones first) */
    st_lcp[0] = 0, st_lb[0] = 0, st_id[0] = 0; /* the root: depth 0, never a group */
    for (uint32_t i = 0; i < n; i++) {
        const uint32_t cur = i + 1 < n ? lcp[i] : 0; /* 0 past the end closes every interval */
        uint32_t lb = i;
        while (st_lcp[top] > cur) { /* interval [st_lb, i] of depth st_lcp closes */
            const uint32_t id = st_id[top];
            lb = st_lb[top--];
            sh->nd_a[id] = lb, sh->nd_b[id] = i, sh->nd_depth[id] = st_lcp[top + 1];
            sh->nd_up[id] = st_lcp[top] >= cur ? st_id[top] : ids; /* the next on the stack, or the one pushed below */
            rep[n_rep++] = id;
        }
        if (st_lcp[top] < cur) top++, st_lcp[top] = cur, st_lb[top] = lb, st_id[top] = ids++;
    }
    /* by depth, shallowest first (through idx, free since the tables' sort): every interval after
       the ones that hold it, and the scratch's rows to the outer levels of the whole batch first,
       whichever order the block ids gave the subtrees */
    const share_key by_depth = {.depth = sh->nd_depth};
    rep = share_sort(&by_depth, rep, sh->idx, n_rep);
    uint32_t ng = 0, left = cap;
    sh->nd_eff[0] = 0;
    for (uint32_t r = 0; r < n_rep; r++) {
        const uint32_t id = rep[r], m = sh->nd_b[id] - sh->nd_a[id] + 1, f = sh->nd_eff[sh->nd_up[id]];
        const uint64_t nq = sh->qsum[sh->nd_b[id] + 1] - sh->qsum[sh->nd_a[id]]; /* its members' queries */
        const bool take = sh->nd_depth[id] - f >= sh->min_blocks && nq <= left;
        sh->nd_eff[id] = take ? sh->nd_depth[id] : f;
        if (!take) continue;
        left -= (uint32_t)nq;
        sh->groups[ng++] = (pkv__share_group){.first = sh->nd_a[id], .n = m, .from = f, .blocks = sh->nd_depth[id]};
    }
    return ng;
}

uint32_t pkv__share_plan(pkv_cache *c, uint32_t k, const pkv__attn_call *call) {
    pkv__share *sh = &c->share;
    if (!sh->min_blocks || k < 2) return 0;
    uint32_t *full = sh->full, n = 0;
    for (uint32_t i = 0; i < k; i++) {
        full[i] = share_full(c, &c->items[i], call, &sh->base[i]);
        if (full[i] >= sh->min_blocks) sh->idx[n++] = i;
    }
    if (n < 2) return 0;
    const share_key by_table = {.c = c, .full = full};
    uint32_t *ord = share_sort(&by_table, sh->idx, sh->tmp, n);
    if (ord != sh->order) memcpy(sh->order, ord, (size_t)n * sizeof(uint32_t));
    ord = sh->order;
    for (uint32_t x = 0; x + 1 < n; x++) { /* the blocks neighbours share (none from other bases) */
        const int32_t *ta = share_table(c, ord[x]), *tb = share_table(c, ord[x + 1]);
        const uint32_t most = sh->base[ord[x]] == sh->base[ord[x + 1]] ? PKV_MIN(full[ord[x]], full[ord[x + 1]]) : 0;
        uint32_t p = 0;
        while (p < most && ta[p] == tb[p]) p++;
        sh->lcp[x] = p;
    }
    sh->n_sorted = n;
    sh->qsum[0] = 0;
    for (uint32_t x = 0; x < n; x++) sh->qsum[x + 1] = sh->qsum[x] + c->items[ord[x]].n_q; /* members [0, x)'s queries */
    const uint32_t cap = call->n_q_heads ? sh->rows / call->n_q_heads : 0; /* queries' rows the scratch holds */
    return cap < 2 ? 0 : share_intervals(sh, n, cap);
}

int pkv__share_run(pkv_cache *c, const pkv__kv_view *view, uint32_t k, const pkv__attn_call *call,
                   const char *api) {
    pkv__share *sh = &c->share;
    const uint32_t ng = pkv__share_plan(c, k, call);
    if (!ng) return pkv__cache_attn_run(c, view, k, call, api);
    /* the groups' parts first: their units, the call's largest, are handed out first */
    memmove(c->items + ng, c->items, (size_t)k * sizeof *c->items);
    pkv__attn_item *items = c->items + ng;
    const uint32_t D = c->head_dim, Dv = c->v_dim, nqh = call->n_q_heads, B = c->B;
    const size_t qrow = (size_t)nqh * D;
    for (uint32_t x = 0; x < sh->n_sorted; x++) sh->slot[x] = UINT32_MAX;
    uint32_t r0 = 0, s0 = 0; /* rows of the scratch used by the groups, by the members' own lse */
    for (uint32_t g = 0; g < ng; g++) {
        const pkv__share_group *gr = &sh->groups[g];
        const uint32_t i0 = sh->order[gr->first], bb = sh->base[i0]; /* every member's base */
        float *q = sh->q + (size_t)r0 * D;
        const uint32_t nq = (uint32_t)(sh->qsum[gr->first + gr->n] - sh->qsum[gr->first]); /* within rows */
        for (uint32_t j = 0, at = 0; j < gr->n; j++) {
            const uint32_t x = gr->first + j;
            pkv__attn_item *it = &items[sh->order[x]];
            memcpy(q + (size_t)at * qrow, it->q, it->n_q * qrow * sizeof(float));
            at += it->n_q;
            if (sh->slot[x] == UINT32_MAX) { /* its own part's lse goes to the scratch */
                sh->slot[x] = s0, s0 += it->n_q * nqh;
                sh->lse_to[x] = it->lse;
                it->lse = sh->lse_b + sh->slot[x];
            }
            it->k_start = PKV_MAX(it->k_start, (bb + gr->blocks) * B); /* its own part: past its innermost group */
        }
        /* every query of the group sees [from, blocks) of the tables from their base whatever its
           position: blocks x B - 1 the first, counted from the base (positions bb x B on; the
           part takes no window or chunk) */
        c->items[g] = (pkv__attn_item){.block_table = items[i0].block_table + bb,
                                       .q_pos0 = gr->blocks * B - 1, .n_q = nq, .k_start = gr->from * B,
                                       .k_end = gr->blocks * B, .partial = true, .q = q,
                                       .out = sh->o + (size_t)r0 * Dv,
                                       .lse = sh->lse_a + r0};
        r0 += nq * nqh;
    }
    const int rc = pkv__cache_attn_run(c, view, k + ng, call, api);
    if (rc) return rc;
    r0 = 0;
    for (uint32_t g = 0; g < ng; g++) {
        const pkv__share_group *gr = &sh->groups[g];
        const uint32_t bb = sh->base[sh->order[gr->first]];
        sh->call_keys += (uint64_t)(gr->n - 1) * (gr->blocks - gr->from) * B;
        for (uint32_t j = 0, gq = 0; j < gr->n; gq += items[sh->order[gr->first + j]].n_q, j++) {
            const pkv__attn_item *it = &items[sh->order[gr->first + j]];
            /* ALiBi: the group's query gq + qi was biased from its nominal position (bb + blocks) x B
               - 1 + gq + qi (in the text: the part counts its keys from the base too); the
               member's own is q_pos0 + qi, which moves the row's logits, so its log-sum-exp, by
               slope x (nominal - own) (the output, a softmax, is the same) */
            if (call->alibi) {
                const float d = (float)(((int64_t)bb + gr->blocks) * B - 1 + gq - it->q_pos0); /* qi cancels */
                for (uint32_t qi = 0; qi < it->n_q; qi++)
                    for (uint32_t h = 0; h < nqh; h++) sh->lse_a[r0 + qi * nqh + h] += call->alibi[h] * d;
            }
            /* the group's rows into the member's outputs and lse (its own part's: sinks there) */
            const int m = pkv_attn_merge(it->n_q * nqh, Dv, sh->o + (size_t)r0 * Dv, sh->lse_a + r0, it->out,
                                         it->lse, it->out, it->lse);
            pkv_assert(m == PKV_OK); /* finite log-sum-exps, no overlap: every part saw keys */
            r0 += it->n_q * nqh;
        }
    }
    for (uint32_t x = 0; x < sh->n_sorted; x++)
        if (sh->slot[x] != UINT32_MAX && sh->lse_to[x])
            memcpy(sh->lse_to[x], sh->lse_b + sh->slot[x], (size_t)items[sh->order[x]].n_q * nqh * sizeof(float));
    return PKV_OK;
}

/* The scratch's rows: a member's query heads each, for up to SHARE_ROWS_SEQS members of 8 query
 * heads a kv head (SHARE_MLA_HEADS where V lives in K: MLA's one kv head has 16-128; at 8, a group
 * of 128-head members never formed), within SHARE_SCRATCH_MAX bytes (a row is head_dim + 2 floats, and v_dim more
 * where V lives in K with v_dim < head_dim, whose outputs cannot take their queries' place: 1 MiB
 * at 8 kv heads of 128; a config of 4096 kv heads of 1024 would have asked for 4 GiB), a multiple
 * of 8 (the arrays after them stay 8-byte aligned). */
#define SHARE_ROWS_SEQS 32u
#define SHARE_MLA_HEADS 128u
#define SHARE_SCRATCH_MAX ((uint64_t)16 << 20)
/* Whether the groups' outputs need rows of their own: v_dim < head_dim (else they are the queries') */
static bool share_out_apart(const pkv_cache *c) { return c->v_dim < c->head_dim; }
static uint64_t share_row_floats(const pkv_cache *c) {
    return (uint64_t)c->head_dim + 2u + (share_out_apart(c) ? c->v_dim : 0u);
}
static uint32_t share_rows(const pkv_cache *c) {
    const uint64_t per_kv = c->cfg.v_dim ? SHARE_MLA_HEADS : 8u;
    const uint64_t want = (uint64_t)PKV_MIN(c->max_seqs, SHARE_ROWS_SEQS) * per_kv * c->n_kv;
    const uint64_t fit = SHARE_SCRATCH_MAX / (sizeof(float) * share_row_floats(c));
    return (uint32_t)(PKV_MIN(want, fit) & ~(uint64_t)7);
}

/* The uint32_t arrays of max_seqs + 1 each that pkv__share_carve cuts (pkv__share: full .. base). */
#define SHARE_U32_ARRAYS 15u

uint64_t pkv__share_bytes(const pkv_cache *c) {
    const uint64_t n = c->max_seqs, rows = share_rows(c);
    return sizeof(float) * rows * share_row_floats(c) + sizeof(float *) * n + sizeof(pkv__share_group) * n +
           sizeof(uint64_t) * (n + 1) + sizeof(uint32_t) * SHARE_U32_ARRAYS * (n + 1);
}

void pkv__share_carve(pkv_cache *c) {
    pkv__share *sh = &c->share;
    const uint32_t n = c->max_seqs;
    sh->rows = share_rows(c);
    sh->q = (float *)(void *)c->share_mem; /* most aligned first */
    sh->o = share_out_apart(c) ? sh->q + (size_t)sh->rows * c->head_dim : sh->q;
    sh->lse_a = sh->o + (size_t)sh->rows * c->v_dim; /* past o's rows (q's, where v_dim is head_dim) */
    sh->lse_b = sh->lse_a + sh->rows;
    sh->lse_to = (float **)(void *)(sh->lse_b + sh->rows);
    sh->groups = (pkv__share_group *)(void *)(sh->lse_to + n);
    sh->qsum = (uint64_t *)(void *)(sh->groups + n); /* groups are 16 bytes: 8-byte aligned */
    uint32_t *u = (uint32_t *)(void *)(sh->qsum + n + 1);
    uint32_t **arrays[SHARE_U32_ARRAYS] = {&sh->full,  &sh->idx,  &sh->tmp,  &sh->order,    &sh->lcp,   &sh->st_lcp, &sh->st_lb,
                             &sh->st_id, &sh->nd_a, &sh->nd_b, &sh->nd_depth, &sh->nd_up, &sh->nd_eff, &sh->slot,
                             &sh->base};
    for (uint32_t i = 0; i < SHARE_U32_ARRAYS; i++) *arrays[i] = u, u += n + 1;
}

int64_t pkv__share_env(void) {
    const char *e = getenv("PKV_ATTN_SHARE");
    if (!e || !*e || !strcmp(e, "auto")) return PKV__SHARE_MIN_KEYS;
    if (!strcmp(e, "off")) return 0;
    char *end = NULL;
    const unsigned long v = strtoul(e, &end, 10);
    if (*e < '1' || *e > '9' || *end || v > PKV__SHARE_MIN_KEYS_MAX) return -1;
    return (int64_t)v;
}

void pkv__cache_test_share(pkv_cache *c, uint32_t min_blocks, uint32_t rows) {
    pthread_mutex_lock(&c->attn_mu);
    c->share.min_blocks = min_blocks;
    c->share.rows = rows ? PKV_MIN(rows, share_rows(c)) : share_rows(c);
    pthread_mutex_unlock(&c->attn_mu);
}
