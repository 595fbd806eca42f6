/* pool.c: block states, refcounts and the intrusive queues (FIFO free; the cached blocks' LRU and
 * inner queues). O(1). */
#include "pool.h"

#include <string.h>

void pkv__pool_init(pkv__pool *p, pkv__blk *blk, uint32_t n_blocks) {
    memset(p, 0, sizeof *p);
    p->blk = blk;
    p->n_blocks = n_blocks;
    p->free_head = p->free_tail = PKV_NONE;
    p->lru_head = p->lru_tail = p->inner_head = p->inner_tail = PKV_NONE;
    for (uint32_t b = 0; b < n_blocks; b++) {
        memset(&blk[b], 0, sizeof blk[b]);
        blk[b].parent = blk[b].hnext = blk[b].child = PKV_NONE;
        blk[b].sib_prev = blk[b].sib_next = PKV_NONE;
        blk[b].qprev = b ? b - 1 : PKV_NONE;
        blk[b].qnext = b + 1 < n_blocks ? b + 1 : PKV_NONE;
    }
    if (n_blocks) {
        p->free_head = 0;
        p->free_tail = n_blocks - 1;
    }
    p->n_free = n_blocks;
}

void pkv__pool_free_push(pkv__pool *p, uint32_t b) {
    pkv__blk *k = &p->blk[b];
    pkv_assert(k->ref == 0 && !(k->flags & PKV_BLKF_INDEXED));
    k->state = PKV_BLK_FREE;
    k->flags = k->moved = 0;
    k->n_fill = k->n_commit = 0;
    k->parent = k->hnext = k->child = k->sib_prev = k->sib_next = PKV_NONE;
    k->n_children = k->n_hot = 0;
    k->qnext = PKV_NONE;
    k->qprev = p->free_tail;
    if (p->free_tail != PKV_NONE) p->blk[p->free_tail].qnext = b;
    else p->free_head = b;
    p->free_tail = b;
    p->n_free++;
}

uint32_t pkv__pool_free_pop(pkv__pool *p) {
    uint32_t b = p->free_head;
    if (b != PKV_NONE) pkv__pool_free_remove(p, b);
    return b;
}

void pkv__pool_free_remove(pkv__pool *p, uint32_t b) {
    pkv__blk *k = &p->blk[b];
    pkv_assert(k->state == PKV_BLK_FREE);
    if (k->qprev != PKV_NONE) p->blk[k->qprev].qnext = k->qnext;
    else p->free_head = k->qnext;
    if (k->qnext != PKV_NONE) p->blk[k->qnext].qprev = k->qprev;
    else p->free_tail = k->qprev;
    k->qprev = k->qnext = PKV_NONE;
    p->n_free--;
}

/* A cached block's queue: its head and tail. */
static uint32_t *q_head(pkv__pool *p, const pkv__blk *k) { return k->inner ? &p->inner_head : &p->lru_head; }
static uint32_t *q_tail(pkv__pool *p, const pkv__blk *k) { return k->inner ? &p->inner_tail : &p->lru_tail; }

void pkv__pool_lru_push(pkv__pool *p, uint32_t b, bool inner) {
    pkv__blk *k = &p->blk[b];
    pkv_assert(k->ref == 0 && (k->flags & PKV_BLKF_INDEXED));
    k->state = PKV_BLK_CACHED;
    k->inner = inner;
    uint32_t *tail = q_tail(p, k);
    k->qnext = PKV_NONE;
    k->qprev = *tail;
    if (*tail != PKV_NONE) p->blk[*tail].qnext = b;
    else *q_head(p, k) = b;
    *tail = b;
    p->n_cached++;
}

void pkv__pool_lru_remove(pkv__pool *p, uint32_t b) {
    pkv__blk *k = &p->blk[b];
    pkv_assert(k->state == PKV_BLK_CACHED);
    if (k->qprev != PKV_NONE) p->blk[k->qprev].qnext = k->qnext;
    else *q_head(p, k) = k->qnext;
    if (k->qnext != PKV_NONE) p->blk[k->qnext].qprev = k->qprev;
    else *q_tail(p, k) = k->qprev;
    k->qprev = k->qnext = PKV_NONE;
    k->inner = 0;
    p->n_cached--;
}

void pkv__pool_lru_demote(pkv__pool *p, uint32_t b) {
    pkv_assert(p->blk[b].state == PKV_BLK_CACHED && p->blk[b].inner);
    pkv__pool_lru_remove(p, b);
    pkv__pool_lru_push(p, b, false);
}

static void became_active(pkv__pool *p, pkv__blk *k) {
    k->state = PKV_BLK_ACTIVE;
    p->n_active++;
    if (p->n_active > p->peak_active) p->peak_active = p->n_active;
    p->slots_used += k->n_fill;
}

void pkv__pool_activate(pkv__pool *p, uint32_t b) {
    pkv__blk *k = &p->blk[b];
    pkv_assert(k->state == PKV_BLK_FREE && k->ref == 0);
    k->flags = k->moved = 0;
    k->n_fill = k->n_commit = 0;
    k->ref = 1;
    became_active(p, k);
}

void pkv__pool_ref(pkv__pool *p, uint32_t b) {
    pkv__blk *k = &p->blk[b];
    if (k->ref == 0) {
        pkv_assert(k->state == PKV_BLK_CACHED);
        pkv__pool_lru_remove(p, b);
        became_active(p, k);
    }
    pkv_assert(k->state == PKV_BLK_ACTIVE);
    k->ref++;
}

uint32_t pkv__pool_unref(pkv__pool *p, uint32_t b) {
    pkv__blk *k = &p->blk[b];
    pkv_assert(k->state == PKV_BLK_ACTIVE && k->ref > 0);
    if (--k->ref == 0) {
        p->n_active--;
        p->slots_used -= k->n_fill;
    }
    return k->ref;
}

void pkv__pool_set_fill(pkv__pool *p, uint32_t b, uint32_t n_fill) {
    pkv__blk *k = &p->blk[b];
    pkv_assert(k->state == PKV_BLK_ACTIVE);
    p->slots_used = p->slots_used - k->n_fill + n_fill;
    k->n_fill = (uint16_t)n_fill;
}
