/* share.c: shared-prefix decode. The sequences of a decode batch whose block tables begin with
 * the same blocks (forks for parallel sampling or beam search, requests whose prompts the
 * prefix cache matched) see the same keys there. Each such group's queries go through those
 * blocks together, as the rows of one item of many queries (the kernels' prefill tiles: a K/V
 * row read once for all of them), and each member's own blocks after them as a decode of its own;
 * the two parts are merged by log-sum-exp. FlashInfer and vLLM call this cascade attention. */
#include "cache_int.h"

#include <stdlib.h>
#include <string.h>

/* The blocks of item i that a group may share: the whole blocks before its query's position (its
 * own part keeps at least that key), none where a window hides some key of them. */
static uint32_t share_full(const pkv_cache *c, const pkv__attn_item *it, uint32_t window) {
    if (window && it->q_pos0 + 1 > window) return 0;
    return it->q_pos0 / c->B;
}

/* Whether item a's table sorts before item b's: by their shareable blocks' ids as bytes, then the
 * shorter first, then by index. Any total order over the tables puts those that share a prefix
 * side by side, which is all the grouping needs. */
static bool share_before(const pkv_cache *c, const uint32_t *full, uint32_t a, uint32_t b) {
    const uint32_t n = PKV_MIN(full[a], full[b]);
    const int r = memcmp(c->items[a].block_table, c->items[b].block_table, (size_t)n * sizeof(int32_t));
    if (r) return r < 0;
    if (full[a] != full[b]) return full[a] < full[b];
    return a < b;
}

/* Sorts idx[0, n) by share_before (bottom-up merge sort through tmp). Returns the sorted array. */
static uint32_t *share_sort(const pkv_cache *c, const uint32_t *full, uint32_t *idx, uint32_t *tmp, uint32_t n) {
    for (uint32_t w = 1; w < n; w *= 2) {
        for (uint32_t lo = 0; lo < n; lo += 2 * w) {
            const uint32_t mid = PKV_MIN(lo + w, n), hi = PKV_MIN(lo + 2 * w, n);
            uint32_t i = lo, j = mid, o = lo;
            while (i < mid && j < hi) tmp[o++] = share_before(c, full, idx[j], idx[i]) ? idx[j++] : idx[i++];
            while (i < mid) tmp[o++] = idx[i++];
            while (j < hi) tmp[o++] = idx[j++];
        }
        uint32_t *t = idx;
        idx = tmp, tmp = t;
    }
    return idx;
}

/* Groups the n sorted members as saves the most block reads: a group of m members sharing p
 * blocks saves (m - 1) x p. A group's members may be taken contiguous in the sorted order (a
 * member between two that share p blocks shares them too), so a partition of the order into runs
 * decides it: best[i], the most members [0, i) save, is best[i - 1] (member i - 1 alone) or, for a
 * run [j, i) of at most span members whose neighbours all share at least min_blocks, best[j] +
 * (i - 1 - j) x their least share; from[i - 1] keeps the j taken (i - 1: alone). On a tie the
 * larger group (fewer items). O(n x span). Writes the groups to sh->groups in order; returns
 * their count. */
static uint32_t share_partition(pkv__share *sh, uint32_t n, uint32_t span) {
    const uint32_t *lcp = sh->lcp;
    uint64_t *best = sh->best;
    uint32_t *from = sh->tmp; /* the sort is done with it */
    best[0] = 0;
    for (uint32_t i = 1; i <= n; i++) {
        best[i] = best[i - 1], from[i - 1] = i - 1;
        uint32_t p = UINT32_MAX;
        for (uint32_t j = i - 1; j-- > 0 && i - j <= span;) {
            p = PKV_MIN(p, lcp[j]);
            if (p < sh->min_blocks) break;
            const uint64_t v = best[j] + (uint64_t)(i - 1 - j) * p;
            if (v >= best[i]) best[i] = v, from[i - 1] = j;
        }
    }
    uint32_t ng = 0;
    for (uint32_t i = n; i > 0;) { /* back from the end: the groups in descending order */
        const uint32_t j = from[i - 1];
        if (j == i - 1) {
            i--;
            continue;
        }
        uint32_t p = UINT32_MAX;
        for (uint32_t x = j; x + 1 < i; x++) p = PKV_MIN(p, lcp[x]);
        sh->groups[ng++] = (pkv__share_group){.first = j, .n = i - j, .blocks = p};
        i = j;
    }
    for (uint32_t a = 0, b = ng; a + 1 < b; a++, b--) { /* ascending */
        const pkv__share_group t = sh->groups[a];
        sh->groups[a] = sh->groups[b - 1], sh->groups[b - 1] = t;
    }
    return ng;
}

uint32_t pkv__share_plan(pkv_cache *c, uint32_t k, uint32_t window, uint32_t n_q_heads) {
    pkv__share *sh = &c->share;
    if (!sh->min_blocks || k < 2) return 0;
    uint32_t *full = sh->full, n = 0;
    for (uint32_t i = 0; i < k; i++) {
        full[i] = share_full(c, &c->items[i], window);
        if (full[i] >= sh->min_blocks) sh->idx[n++] = i;
    }
    if (n < 2) return 0;
    uint32_t *ord = share_sort(c, full, sh->idx, sh->tmp, n);
    if (ord != sh->order) memcpy(sh->order, ord, (size_t)n * sizeof(uint32_t));
    ord = sh->order;
    for (uint32_t x = 0; x + 1 < n; x++) { /* the blocks neighbours share */
        const int32_t *ta = c->items[ord[x]].block_table, *tb = c->items[ord[x + 1]].block_table;
        const uint32_t most = PKV_MIN(full[ord[x]], full[ord[x + 1]]);
        uint32_t p = 0;
        while (p < most && ta[p] == tb[p]) p++;
        sh->lcp[x] = p;
    }
    /* groups of at most as many members as the scratch holds rows for, then, in order, as many
       of them as it holds (the last cut, in a group of two or more) */
    const uint32_t cap = n_q_heads ? sh->rows / n_q_heads : 0;
    if (cap < 2) return 0;
    const uint32_t found = share_partition(sh, n, cap);
    uint32_t left = cap, ng = 0;
    for (uint32_t g = 0; g < found && left >= 2; g++) {
        pkv__share_group gr = sh->groups[g];
        gr.n = PKV_MIN(gr.n, left);
        left -= gr.n;
        sh->groups[ng++] = gr;
    }
    return ng;
}

int pkv__share_decode(pkv_cache *c, const pkv__kv_view *view, uint32_t k, const pkv__attn_call *call,
                      const char *api) {
    pkv__share *sh = &c->share;
    const uint32_t ng = pkv__share_plan(c, k, call->window, call->n_q_heads);
    if (!ng) return pkv__cache_attn_run(c, view, k, call, api);
    /* the groups' shared parts first: their units, the call's largest, are handed out first */
    memmove(c->items + ng, c->items, (size_t)k * sizeof *c->items);
    pkv__attn_item *items = c->items + ng;
    const uint32_t D = c->head_dim, nqh = call->n_q_heads;
    const size_t qrow = (size_t)nqh * D;
    uint32_t r0 = 0; /* rows of the scratch used */
    for (uint32_t g = 0; g < ng; g++) {
        const pkv__share_group *gr = &sh->groups[g];
        const uint32_t P = gr->blocks * c->B;
        float *q = sh->q + (size_t)r0 * D;
        for (uint32_t j = 0; j < gr->n; j++) {
            pkv__attn_item *it = &items[sh->order[gr->first + j]];
            memcpy(q + j * qrow, it->q, qrow * sizeof(float));
            sh->lse_to[gr->first + j] = it->lse;
            it->lse = sh->lse_b + (size_t)r0 + (size_t)j * nqh;
            it->k_start = P;
        }
        /* every query of the group sees [0, P) whatever its position: P - 1 is the first */
        c->items[g] = (pkv__attn_item){.block_table = items[sh->order[gr->first]].block_table,
                                           .q_pos0 = P - 1, .n_q = gr->n, .k_end = P, .partial = true,
                                           .q = q, .out = q, .lse = sh->lse_a + r0};
        r0 += gr->n * nqh;
    }
    const int rc = pkv__cache_attn_run(c, view, k + ng, call, api);
    if (rc) return rc;
    for (uint32_t g = 0; g < ng; g++)
        sh->call_keys += (uint64_t)(sh->groups[g].n - 1) * sh->groups[g].blocks * c->B;
    r0 = 0;
    for (uint32_t g = 0; g < ng; g++) {
        const pkv__share_group *gr = &sh->groups[g];
        for (uint32_t j = 0; j < gr->n; j++, r0 += nqh) {
            const pkv__attn_item *it = &items[sh->order[gr->first + j]];
            /* the shared part's rows and the member's own (sinks there) into the member's output */
            const int m = pkv_attn_merge(nqh, D, sh->q + (size_t)r0 * D, sh->lse_a + r0, it->out, it->lse, it->out,
                                         sh->lse_to[gr->first + j]);
            pkv_assert(m == PKV_OK); /* finite log-sum-exps, no overlap: both parts saw keys */
        }
    }
    return PKV_OK;
}

/* The scratch's rows: a member's query heads each, for up to SHARE_ROWS_SEQS members of 8 query
 * heads a kv head. */
#define SHARE_ROWS_SEQS 32u
static uint32_t share_rows(const pkv_cache *c) {
    return PKV_MIN(c->max_seqs, SHARE_ROWS_SEQS) * 8u * c->n_kv;
}

uint64_t pkv__share_bytes(const pkv_cache *c) {
    const uint64_t n = c->max_seqs, rows = share_rows(c);
    return sizeof(float) * rows * ((uint64_t)c->head_dim + 2u) + sizeof(uint64_t) * (n + 1) + sizeof(float *) * n +
           sizeof(pkv__share_group) * (n / 2 + 1) + sizeof(uint32_t) * 5u * n;
}

void pkv__share_carve(pkv_cache *c) {
    pkv__share *sh = &c->share;
    const uint32_t n = c->max_seqs;
    sh->rows = share_rows(c);
    sh->q = (float *)(void *)c->share_mem; /* most aligned first */
    sh->lse_a = sh->q + (size_t)sh->rows * c->head_dim;
    sh->lse_b = sh->lse_a + sh->rows;
    sh->best = (uint64_t *)(void *)(sh->lse_b + sh->rows);
    sh->lse_to = (float **)(void *)(sh->best + n + 1);
    sh->groups = (pkv__share_group *)(void *)(sh->lse_to + n);
    sh->full = (uint32_t *)(void *)(sh->groups + n / 2 + 1);
    sh->idx = sh->full + n;
    sh->tmp = sh->idx + n;
    sh->order = sh->tmp + n;
    sh->lcp = sh->order + n;
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
