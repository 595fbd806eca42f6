/* attn.h: the interface between the cache and the paged attention kernels. The kernels see a
 * read-only view of one layer of the pool plus, per work item, a block table; they never see
 * cache internals. Depends on core and quant only. */
#ifndef PKV_ATTN_H
#define PKV_ATTN_H

#include "../core/core.h"

/* One layer of the pool (ARCHITECTURE section 3). Row of (block b, kv head h, offset t):
 * k + b * k_block_bytes + (h * block_tokens + t) * k_row_bytes. */
typedef struct pkv__kv_view {
    const uint8_t *k, *v;
    pkv_dtype k_dtype, v_dtype;
    size_t k_row_bytes, v_row_bytes;
    size_t k_block_bytes, v_block_bytes;
    uint32_t n_kv_heads, head_dim, block_tokens, n_blocks;
} pkv__kv_view;

/* One sequence's share of an attention call: n_q consecutive queries at positions
 * q_pos0 .. q_pos0 + n_q - 1; the query at position p attends to positions
 * [max(0, p - window + 1), p] (window 0 = [0, p]). block_table covers at least
 * ceil((q_pos0 + n_q) / block_tokens) entries, all valid block ids. */
typedef struct pkv__attn_item {
    const int32_t *block_table;
    uint32_t q_pos0;
    uint32_t n_q;
    const float *q; /* [n_q][n_q_heads][head_dim] */
    float *out;     /* [n_q][n_q_heads][head_dim] */
    float *lse;     /* [n_q][n_q_heads] or NULL */
} pkv__attn_item;

typedef struct pkv__attn_call {
    uint32_t n_q_heads; /* multiple of n_kv_heads, already validated */
    float scale;        /* resolved (never 0) */
    float softcap;      /* 0 = off */
    uint32_t window;    /* 0 = off */
} pkv__attn_call;

/* Sizes the attention context may rely on (scratch is allocated once, at create). */
typedef struct pkv__attn_limits {
    uint32_t max_items;          /* items per pkv__attn_run call */
    uint32_t max_blocks_per_seq;
    uint32_t n_kv_heads, head_dim, block_tokens;
} pkv__attn_limits;

typedef struct pkv__attn pkv__attn; /* thread pool, scratch, chosen backend */

/* n_threads: workers including the caller (0 = all cpus). Allocates through a. */
int pkv__attn_create(const pkv_allocator *a, uint32_t n_threads, const pkv__attn_limits *lim, pkv__attn **out);
void pkv__attn_destroy(pkv__attn *at);
const char *pkv__attn_backend_name(const pkv__attn *at);
uint32_t pkv__attn_n_threads(const pkv__attn *at);

/* Runs attention for n_items items (n_items <= max_items). Not reentrant on one context: the
 * cache serializes calls. Allocates nothing. Returns 0 or a PKV_E* status. */
int pkv__attn_run(pkv__attn *at, const pkv__kv_view *kv, const pkv__attn_item *items, uint32_t n_items,
                  const pkv__attn_call *call);

#endif
