/* sim_sched.c: `pkv sim`'s continuous-batching scheduler: admits, prefills in chunks, decodes,
 * forks samples, preempts by recompute (or with --preempt swap by swapping K/V to host memory), all
 * on a real pkv cache, and measures each policy. */
#include "sim.h"
#include "tool.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

const char *const sim_policy_names[SIM_N_POLICIES] = {"paged_prefix", "paged", "contiguous"};

enum { RQ_PENDING = 0, RQ_WAITING, RQ_RUNNING, RQ_DONE, RQ_REJECTED };

typedef struct req_state {
    uint8_t state;
    uint32_t computed;      /* positions of the prefill target with K/V (reused ones included) */
    uint32_t target;        /* prefill target: the prompt, plus the kept tokens after a preemption */
    uint32_t kept;          /* tokens generated before a preemption (n == 1 only) */
    uint32_t n_finished;    /* samples that produced all their tokens */
    uint32_t reserved;      /* contiguous: blocks reserved at admission */
    uint64_t admit_no;      /* admission order; the largest running one is the newest */
    int64_t ttft;           /* steps from arrival to the first token, -1 before it */
    uint8_t *swap;          /* --preempt swap: positions [0, swap_len) of every layer, as stored */
    uint32_t swap_len;
} req_state;

typedef struct entry {      /* one running sequence */
    uint32_t req, sample;
    pkv_seq s;
    uint32_t len;           /* positions in the cache */
    uint32_t gen;           /* tokens generated so far */
    uint8_t alive, prefill;
} entry;

typedef struct item {       /* work for one sequence in this step */
    uint32_t e;
    uint32_t n;             /* new positions */
    uint32_t off;           /* into the step's token / slot buffers */
} item;

typedef struct sim {
    const sim_opts *o;
    const sim_workload *w;
    int policy;
    pkv_cache *c;
    pkv_tier *tier;         /* --tier (paged_prefix), else NULL */
    req_state *rs;
    entry *ent;
    uint32_t n_ent, cap_ent;
    uint32_t *run_reqs;     /* running requests in admission order (lazily compacted) */
    uint32_t n_run_reqs;
    uint32_t *wq;           /* waiting queue: ring buffer of request indices */
    uint32_t wq_head, wq_n, wq_cap;
    uint32_t running_seqs;
    uint32_t seats;          /* sum of n_samples over running requests: forks to come included */
    uint64_t reserved_total; /* contiguous */
    uint64_t admit_counter;
    uint64_t now;
    uint64_t ns_pkv, ns_attn, ns_compact;
    size_t swap_k, swap_v;   /* --preempt swap: stored bytes of one position's K, V, one layer */
    uint64_t swap_bytes;     /* held on the host now */
    sim_result *res;
    /* step buffers */
    item *items;
    int32_t *tok, *slots;
    pkv_seq *dec_seqs;
    int32_t *owner, *tab;   /* [n_blocks]: a decode batch's block owners; [max_blocks_per_seq] */
    uint32_t max_bps;
    pkv_attn_req *preq;
    float *kbuf, *vbuf, *qbuf, *obuf;
    uint32_t kv_row, q_row;  /* floats per token */
    int fatal;
} sim;

#define KV_POOL_ROWS 4096u /* random K/V rows the writes cycle through */

static int wq_push_back(sim *S, uint32_t r) {
    if (S->wq_n == S->wq_cap) return -1;
    S->wq[(S->wq_head + S->wq_n++) % S->wq_cap] = r;
    return 0;
}
static int wq_push_front(sim *S, uint32_t r) {
    if (S->wq_n == S->wq_cap) return -1;
    S->wq_head = (S->wq_head + S->wq_cap - 1) % S->wq_cap;
    S->wq[S->wq_head] = r;
    S->wq_n++;
    return 0;
}

static uint32_t ceil_div(uint64_t a, uint32_t b) { return (uint32_t)((a + b - 1) / b); }

static int fail(sim *S, int rc, const char *what) {
    fprintf(stderr, "pkv sim: %s (%s, step %llu): %s\n", what, sim_policy_names[S->policy],
            (unsigned long long)S->now, pkv_strerror(rc));
    if (rc == PKV_ENOTSUP)
        fprintf(stderr, "pkv sim: this build's attention kernels do not support this configuration; "
                        "--no-attn replays memory only\n");
    S->fatal = 1;
    return rc;
}

static entry *add_entry(sim *S, uint32_t req, uint32_t sample, pkv_seq s, uint32_t len, uint32_t gen, int prefill) {
    if (S->n_ent == S->cap_ent) {
        uint32_t cap = S->cap_ent ? 2 * S->cap_ent : 256;
        entry *ne = realloc(S->ent, cap * sizeof *ne);
        if (!ne) return NULL;
        S->ent = ne, S->cap_ent = cap;
    }
    entry *e = &S->ent[S->n_ent++];
    *e = (entry){.req = req, .sample = sample, .s = s, .len = len, .gen = gen, .alive = 1, .prefill = (uint8_t)prefill};
    S->running_seqs++;
    return e;
}

static int release_entry(sim *S, entry *e) {
    uint64_t t0 = tool_now_ns();
    int rc = pkv_seq_release(S->c, e->s);
    S->ns_pkv += tool_now_ns() - t0;
    e->alive = 0;
    S->running_seqs--;
    return rc < 0 ? fail(S, rc, "pkv_seq_release") : 0;
}

/* --preempt swap: positions [0, e->len) of e (written and committed in earlier steps; this
 * step's appends are not written yet), every layer, to host memory as the pool stores them: per
 * layer its K rows, then its V rows. */
static int swap_out(sim *S, entry *e) {
    req_state *q = &S->rs[e->req];
    const uint32_t nl = S->o->model.n_layers, len = e->len;
    const size_t layer = (size_t)len * (S->swap_k + S->swap_v);
    q->swap = malloc(layer * nl);
    if (!q->swap) return fail(S, PKV_ENOMEM, "swap out");
    uint64_t t0 = tool_now_ns();
    int rc = 0;
    for (uint32_t l = 0; l < nl && !rc; l++) {
        uint8_t *k = q->swap + l * layer;
        rc = pkv_seq_read_stored(S->c, e->s, l, 0, len, k, k + (size_t)len * S->swap_k);
    }
    S->ns_pkv += tool_now_ns() - t0;
    if (rc < 0) return fail(S, rc, "pkv_seq_read_stored");
    q->swap_len = len;
    S->swap_bytes += layer * nl;
    if (S->swap_bytes > S->res->swap_peak_bytes) S->res->swap_peak_bytes = S->swap_bytes;
    S->res->swap_outs++;
    return 0;
}

/* --preempt swap: q's image freed (written back, no longer needed, or given up). */
static void swap_drop(sim *S, req_state *q) {
    free(q->swap);
    q->swap = NULL;
    S->swap_bytes -= (uint64_t)q->swap_len * (S->swap_k + S->swap_v) * S->o->model.n_layers;
}

/* --preempt swap, at readmission: positions [from, q->swap_len) of the image (those the prefix
 * match did not attach) appended to s and written back, then committed; each layer read back and
 * compared with the image (the sim's own check that nothing was lost). The image is freed. 1:
 * the append found no room (PKV_ENOSPC, nothing changed), so the positions are recomputed. */
static int swap_in(sim *S, req_state *q, pkv_seq s, const int32_t *tokens, uint32_t from) {
    const uint32_t nl = S->o->model.n_layers, len = q->swap_len, n = len - from;
    const size_t layer = (size_t)len * (S->swap_k + S->swap_v);
    uint8_t *back = malloc((size_t)n * (S->swap_k + S->swap_v) + 1);
    if (!back) return fail(S, PKV_ENOMEM, "swap in");
    uint64_t t0 = tool_now_ns();
    int rc = pkv_seq_append(S->c, s, tokens + from, n, NULL);
    const bool room = rc != PKV_ENOSPC; /* else nothing appended: it is recomputed instead */
    for (uint32_t l = 0; l < nl && room && !rc; l++) {
        const uint8_t *k = q->swap + l * layer, *v = k + (size_t)len * S->swap_k;
        rc = pkv_seq_write_stored(S->c, s, l, from, n, k + (size_t)from * S->swap_k, v + (size_t)from * S->swap_v);
        if (!rc) rc = pkv_seq_read_stored(S->c, s, l, from, n, back, back + (size_t)n * S->swap_k);
        if (!rc && (memcmp(back, k + (size_t)from * S->swap_k, (size_t)n * S->swap_k) ||
                    memcmp(back + (size_t)n * S->swap_k, v + (size_t)from * S->swap_v, (size_t)n * S->swap_v)))
            rc = PKV_ECORRUPT;
    }
    if (room && !rc) rc = pkv_seq_commit(S->c, s, len);
    S->ns_pkv += tool_now_ns() - t0;
    free(back);
    swap_drop(S, q);
    if (!room) return 1;
    if (rc < 0) return fail(S, rc, "swap in (append, pkv_seq_write_stored, read back, commit)");
    S->res->swap_in_tokens += n;
    return 0;
}

/* Recompute preemption (vLLM's): drop every sequence of request r and put it back at the head
 * of the queue. A single-sample request keeps its generated tokens: on readmission it prefills
 * prompt + those tokens (prefix matching finds what is still cached) and goes on decoding. A
 * request with forked samples starts over from its prompt. With --preempt swap a single-sample
 * request's computed positions go to host memory first (swap_out) and come back at readmission
 * (swap_in) rather than being prefilled again. */
static int preempt(sim *S, uint32_t r) {
    req_state *q = &S->rs[r];
    q->kept = 0;
    S->seats -= S->w->reqs[r].n_samples;
    for (uint32_t i = 0; i < S->n_ent; i++) {
        entry *e = &S->ent[i];
        if (!e->alive || e->req != r) continue;
        if (S->w->reqs[r].n_samples == 1 && !e->prefill) q->kept = e->gen;
        else if (S->w->reqs[r].n_samples == 1) q->kept = q->target - S->w->reqs[r].prompt_len;
        if (S->o->swap && S->o->attn && S->w->reqs[r].n_samples == 1 && e->len && swap_out(S, e)) return -1;
        if (release_entry(S, e)) return -1;
    }
    q->state = RQ_WAITING;
    q->computed = 0;
    q->n_finished = 0;
    S->reserved_total -= q->reserved;
    q->reserved = 0;
    S->res->preemptions++;
    /* the victim is always the newest running request: drop it from the admission stack */
    if (S->n_run_reqs && S->run_reqs[S->n_run_reqs - 1] == r) S->n_run_reqs--;
    return wq_push_front(S, r);
}

static int64_t newest_running(sim *S) {
    while (S->n_run_reqs && S->rs[S->run_reqs[S->n_run_reqs - 1]].state != RQ_RUNNING) S->n_run_reqs--;
    return S->n_run_reqs ? (int64_t)S->run_reqs[S->n_run_reqs - 1] : -1;
}

static int finish_entry(sim *S, entry *e) {
    if (release_entry(S, e)) return -1;
    req_state *q = &S->rs[e->req];
    if (++q->n_finished == S->w->reqs[e->req].n_samples) {
        q->state = RQ_DONE;
        S->seats -= S->w->reqs[e->req].n_samples;
        S->reserved_total -= q->reserved;
        q->reserved = 0;
        S->res->completed++;
    }
    return 0;
}

/* Whether this run lets go of what --window has passed (pkv_seq_drop_front): the paged policies
 * (a tier's save then keys the blocks past the front by the ids the index keeps of it). */
static bool drops_front(const sim *S, const sim_opts *o) { return o->window && S->policy != SIM_CONTIGUOUS; }

/* Admits waiting requests while the budget, max_seqs and blocks allow (FIFO: the head blocks
 * the queue, as in vLLM). Appends the admitted items to items[*n_items]. */
static int admit(sim *S, uint32_t *budget, uint32_t *n_items, uint32_t *off) {
    const sim_opts *o = S->o;
    uint32_t B = o->block_tokens;
    uint32_t wm = (uint32_t)ceil(o->watermark * o->n_blocks);
    while (S->wq_n && *budget > 0) {
        uint32_t r = S->wq[S->wq_head];
        const sim_request *rq = &S->w->reqs[r];
        if (S->seats + rq->n_samples > o->max_seqs) break;
        uint32_t reserve = 0;
        if (S->policy == SIM_CONTIGUOUS) {
            /* an engine without paging reserves max-length slots for every sample up front */
            reserve = rq->n_samples * ceil_div(o->max_len, B);
            if (S->reserved_total + reserve > o->n_blocks) break;
        } else {
            pkv_stats st;
            uint64_t t0 = tool_now_ns();
            int rc = pkv_cache_get_stats(S->c, &st);
            S->ns_pkv += tool_now_ns() - t0;
            if (rc < 0) return fail(S, rc, "pkv_cache_get_stats");
            /* the whole prompt (+1 for a copy-on-write of a matched tail) must fit above the
             * watermark plus `headroom` blocks per running sequence (their growth over the next
             * B steps: without it a new admission is preempted again at once); cached blocks
             * count as available since they can be evicted */
            uint64_t span = rq->prompt_len + S->rs[r].kept; /* the prompt's positions held at once */
            if (drops_front(S, o) && span > (uint64_t)o->window + o->step_tokens)
                span = (uint64_t)o->window + o->step_tokens; /* a chunk, and the window before it */
            uint64_t need = ceil_div(span, B) + 1u + wm + (uint64_t)(o->headroom * S->running_seqs + 0.5);
            if ((uint64_t)st.n_free + st.n_cached < need) break;
        }
        S->wq_head = (S->wq_head + 1) % S->wq_cap;
        S->wq_n--;
        pkv_seq s;
        uint32_t reused = 0;
        int32_t *prompt = S->tok + *off; /* scratch: the prompt, then this step's tokens */
        uint64_t t0 = tool_now_ns();
        int rc = pkv_seq_create(S->c, NULL, 0, &s);
        if (rc < 0) return fail(S, rc, "pkv_seq_create");
        req_state *q = &S->rs[r];
        q->target = rq->prompt_len + q->kept;
        if (S->policy != SIM_CONTIGUOUS) {
            sim_tokens(rq, 0, 0, q->target, prompt);
            /* under --window a match needs only what the window sees (tombstones before it) */
            const bool windowed = drops_front(S, o) && !o->plain_match;
            rc = windowed ? pkv_seq_match_prefix_window(S->c, s, prompt, q->target, o->window, &reused)
                          : pkv_seq_match_prefix(S->c, s, prompt, q->target, &reused);
            if (rc < 0) return fail(S, rc, windowed ? "pkv_seq_match_prefix_window" : "pkv_seq_match_prefix");
        }
        uint32_t loaded = 0;
        if (S->tier) { /* what the pool no longer holds, from the tier */
            const bool windowed = drops_front(S, o) && !o->plain_match; /* (only what the window reads) */
            rc = windowed ? pkv_tier_load_window(S->tier, S->c, s, prompt, q->target, o->window, &loaded)
                          : pkv_tier_load(S->tier, S->c, s, prompt, q->target, &loaded);
            if (rc < 0) return fail(S, rc, windowed ? "pkv_tier_load_window" : "pkv_tier_load");
            S->res->tier_hit_tokens += loaded;
        }
        S->ns_pkv += tool_now_ns() - t0;
        S->res->prefix_hit_tokens += reused;
        reused += loaded;
        S->res->prompt_tokens += q->target;
        if (q->swap) { /* the rest of what it had computed comes back from the host */
            if (q->swap_len > reused) {
                const uint32_t len = q->swap_len;
                const int in = swap_in(S, q, s, prompt, reused);
                if (in < 0) return -1;
                if (in == 0) reused = len;
            } else {
                swap_drop(S, q); /* the prefix index still held all of it */
            }
        }
        q->state = RQ_RUNNING;
        q->computed = reused;
        q->reserved = reserve;
        q->admit_no = S->admit_counter++;
        S->reserved_total += reserve;
        S->seats += rq->n_samples;
        S->run_reqs[S->n_run_reqs++] = r;
        if (!add_entry(S, r, 0, s, reused, 0, 1)) return fail(S, PKV_ENOMEM, "admission");
        uint32_t n = q->target - reused;
        if (n > *budget) n = *budget;
        S->items[(*n_items)++] = (item){.e = S->n_ent - 1, .n = n, .off = *off};
        *off += n;
        *budget -= n;
    }
    return 0;
}

/* Appends items [from, to) to their sequences; when the pool is out of blocks (PKV_ENOSPC),
 * preempts the newest running request and retries (possibly the item's own request). */
static int append_items(sim *S, uint32_t from, uint32_t to) {
    uint64_t t0 = tool_now_ns();
    int rc = 0;
    for (uint32_t i = from; i < to; i++) {
        item *it = &S->items[i];
        entry *e = &S->ent[it->e];
        if (!e->alive) continue;
        sim_tokens(&S->w->reqs[e->req], e->sample, e->len, it->n, S->tok + it->off);
        for (;;) {
            rc = pkv_seq_append(S->c, e->s, S->tok + it->off, it->n, S->slots + it->off);
            if (rc != PKV_ENOSPC || S->policy == SIM_CONTIGUOUS) break;
            int64_t v = newest_running(S);
            if (v < 0) break;
            uint32_t own = e->req;
            if (preempt(S, (uint32_t)v)) return -1;
            if ((uint32_t)v == own) break; /* the item's own request went back to the queue */
        }
        if (!e->alive) continue;
        if (rc < 0) {
            S->ns_pkv += tool_now_ns() - t0;
            return fail(S, rc, "pkv_seq_append");
        }
    }
    S->ns_pkv += tool_now_ns() - t0;
    return 0;
}

static void sample_series(sim *S, uint32_t blocks) {
    sim_result *res = S->res;
    static const uint32_t cap = 8192;
    static uint64_t stride_of_run = 1;
    if (!S->o->want_series) return;
    if (!res->series) {
        res->series = malloc(cap * sizeof *res->series);
        if (!res->series) return;
        stride_of_run = 1;
    }
    if (S->now % stride_of_run) return;
    if (res->n_series == cap) { /* decimate: keep every other point, sample half as often */
        for (uint32_t i = 0; i < cap / 2; i++) res->series[i] = res->series[2 * i];
        res->n_series = cap / 2;
        stride_of_run *= 2;
        if (S->now % stride_of_run) return;
    }
    res->series[res->n_series++] = (sim_point){S->now, blocks, S->running_seqs};
}

static void progress(sim *S, uint64_t t_start, int final) {
    static uint64_t last;
    if (!S->o->progress) return;
    uint64_t now = tool_now_ns();
    if (!final && (now - t_start < 1000000000ull || now - last < 100000000ull)) return;
    last = now;
    uint32_t done = S->res->completed + S->res->rejected, n = S->w->n;
    int width = 30, fill = n ? (int)((uint64_t)done * width / n) : width;
    fprintf(stderr, "\r%-12s [%.*s%*s] %3u%% %u/%u requests, step %llu, %u running  ", sim_policy_names[S->policy],
            fill, "##############################", width - fill, "", n ? (unsigned)((uint64_t)done * 100 / n) : 100u,
            done, n, (unsigned long long)S->now, S->running_seqs);
    if (final) fprintf(stderr, "\r\033[K");
    fflush(stderr);
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The decode batch's blocks in id order, as pool-order decode reads them: how many neighbours
 * belong to different sequences (res->dec_pairs, dec_switches), and how many of those pairs
 * hold a block several of the batch share, which no layout makes one sequence's
 * (dec_shared). 0, or -1 on a library failure. */
static int decode_order(sim *S, uint32_t n_dec) {
    const uint32_t nb = S->o->n_blocks;
    memset(S->owner, 0, (size_t)nb * sizeof *S->owner);
    for (uint32_t d = 0; d < n_dec; d++) {
        uint32_t n = 0;
        int rc = pkv_seq_block_table(S->c, S->dec_seqs[d], S->tab, S->max_bps, &n);
        if (rc < 0) return fail(S, rc, "pkv_seq_block_table");
        for (uint32_t j = 0; j < n; j++) {
            if (S->tab[j] < 0) continue; /* a dropped front (--window) */
            int32_t *o = &S->owner[S->tab[j]];
            *o = *o == 0 ? (int32_t)d + 1 : -1; /* -1: shared */
        }
    }
    int32_t prev = 0;
    for (uint32_t b = 0; b < nb; b++) {
        const int32_t o = S->owner[b];
        if (!o) continue;
        if (prev) {
            S->res->dec_pairs++;
            S->res->dec_switches += o != prev || o < 0;
            S->res->dec_shared += o < 0 || prev < 0;
        }
        prev = o;
    }
    return 0;
}

int sim_run_policy(const sim_opts *o, const sim_workload *w, int policy, sim_result *res) {
    memset(res, 0, sizeof *res);
    res->policy = policy;
    sim S = {.o = o, .w = w, .policy = policy, .res = res};
    uint64_t t_start = tool_now_ns();
    uint32_t B = o->block_tokens;
    const sim_model *md = &o->model;
    pkv_config cfg = pkv_config_default();
    if (o->attn) {
        cfg.n_layers = md->n_layers, cfg.n_kv_heads = md->n_kv_heads, cfg.head_dim = md->head_dim;
        cfg.k_dtype = cfg.v_dtype = md->dtype;
    } else { /* memory-only: the smallest shape; block accounting does not depend on it */
        cfg.n_layers = 1, cfg.n_kv_heads = 1, cfg.head_dim = 8;
        cfg.k_dtype = cfg.v_dtype = PKV_DTYPE_F16;
    }
    cfg.block_tokens = B;
    cfg.n_blocks = o->n_blocks;
    cfg.max_seqs = o->max_seqs + 1;
    cfg.max_blocks_per_seq = ceil_div(o->max_len, B) + 2;
    S.max_bps = cfg.max_blocks_per_seq;
    cfg.n_threads = o->n_threads;
    cfg.spin_us = o->spin_us;
    cfg.enable_prefix_cache = policy == SIM_PAGED_PREFIX;
    tool_log_errors(&cfg, "pkv sim");
    int rc = pkv_cache_create(&cfg, &S.c);
    if (rc < 0) {
        fprintf(stderr, "pkv sim: pkv_cache_create (%u blocks of %u tokens): %s\n", o->n_blocks, B, pkv_strerror(rc));
        return rc;
    }
    if (o->tier_bytes && policy == SIM_PAGED_PREFIX) {
        rc = o->tier_dir ? pkv_tier_file_create(o->tier_dir, o->tier_bytes, NULL, &S.tier)
                         : pkv_tier_host_create(o->tier_bytes, NULL, &S.tier);
        if (rc < 0) {
            fprintf(stderr, "pkv sim: the tier (%s): %s\n", o->tier_dir ? o->tier_dir : "host memory", pkv_strerror(rc));
            pkv_cache_destroy(S.c);
            return rc;
        }
    }
    S.kv_row = md->n_kv_heads * md->head_dim;
    S.swap_k = (size_t)cfg.n_kv_heads * pkv_dtype_row_bytes(cfg.k_dtype, cfg.head_dim);
    S.swap_v = (size_t)cfg.n_kv_heads * pkv_dtype_row_bytes(cfg.v_dtype, cfg.head_dim);
    S.q_row = md->n_q_heads * md->head_dim;
    uint32_t n = w->n;
    uint32_t max_tok = o->step_tokens > o->max_len ? o->step_tokens : o->max_len;
    S.rs = calloc(n ? n : 1, sizeof *S.rs);
    S.run_reqs = malloc((n ? n : 1) * sizeof *S.run_reqs);
    S.wq_cap = n ? n : 1;
    S.wq = malloc(S.wq_cap * sizeof *S.wq);
    S.items = malloc((o->max_seqs + 1) * sizeof *S.items);
    S.tok = malloc(((size_t)o->step_tokens + o->max_len) * sizeof *S.tok);
    S.slots = malloc((size_t)o->step_tokens * sizeof *S.slots);
    S.dec_seqs = malloc((o->max_seqs + 1) * sizeof *S.dec_seqs);
    S.preq = malloc((o->max_seqs + 1) * sizeof *S.preq);
    S.owner = malloc((size_t)o->n_blocks * sizeof *S.owner);
    S.tab = malloc((size_t)S.max_bps * sizeof *S.tab);
    double *ttft = malloc((n ? n : 1) * sizeof *ttft);
    int ok = S.rs && S.run_reqs && S.wq && S.items && S.tok && S.slots && S.dec_seqs && S.preq && S.owner && S.tab && ttft;
    if (o->attn && ok) {
        tool_rng rng;
        tool_rng_seed(&rng, o->seed ^ 0x5EEDull);
        size_t nkv = ((size_t)KV_POOL_ROWS + o->step_tokens) * S.kv_row;
        size_t nq = (size_t)max_tok * S.q_row;
        S.kbuf = malloc(nkv * sizeof(float));
        S.vbuf = malloc(nkv * sizeof(float));
        S.qbuf = malloc(nq * sizeof(float));
        S.obuf = malloc(nq * sizeof(float));
        ok = S.kbuf && S.vbuf && S.qbuf && S.obuf;
        for (size_t i = 0; ok && i < nkv; i++) {
            S.kbuf[i] = (float)tool_rng_normal(&rng);
            S.vbuf[i] = (float)tool_rng_normal(&rng);
        }
        for (size_t i = 0; ok && i < nq; i++) S.qbuf[i] = (float)tool_rng_normal(&rng);
    }
    if (!ok) {
        fprintf(stderr, "pkv sim: out of memory\n");
        rc = PKV_ENOMEM;
        goto done;
    }
    pkv_attn_params ap = pkv_attn_params_default();
    ap.n_q_heads = md->n_q_heads;
    ap.window = o->window;

    uint32_t wm = (uint32_t)ceil(o->watermark * o->n_blocks);
    uint32_t next = 0, n_ttft = 0;
    uint64_t idle_steps = 0;
    double sum_live = 0, sum_res = 0, sum_waste = 0, sum_seqs = 0;
    uint64_t n_steps = 0;
    while (res->completed + res->rejected < n) {
        if (S.running_seqs == 0 && S.wq_n == 0 && next < n && w->reqs[next].arrival_step > S.now)
            S.now = w->reqs[next].arrival_step; /* idle: jump to the next arrival */
        for (; next < n && w->reqs[next].arrival_step <= S.now; next++) {
            const sim_request *rq = &w->reqs[next];
            /* a request that could never run under the strictest policy (max-length
             * reservation) is rejected by every policy, so all complete the same set */
            uint64_t worst = (uint64_t)rq->n_samples * (ceil_div(o->max_len, B) + 1) + wm;
            if (worst > o->n_blocks || rq->n_samples > o->max_seqs) {
                S.rs[next].state = RQ_REJECTED;
                res->rejected++;
                continue;
            }
            S.rs[next].state = RQ_WAITING;
            S.rs[next].ttft = -1;
            wq_push_back(&S, next);
        }

        /* schedule: running sequences first (decode 1 token, or the next prefill chunk), oldest
         * first, within the token budget; then admissions */
        uint32_t budget = o->step_tokens, n_items = 0, off = 0;
        for (uint32_t i = 0; i < S.n_ent && budget > 0; i++) {
            entry *e = &S.ent[i];
            if (!e->alive) continue;
            uint32_t k = 1;
            if (e->prefill) {
                k = S.rs[e->req].target - S.rs[e->req].computed;
                if (k > budget) k = budget;
            }
            S.items[n_items++] = (item){.e = i, .n = k, .off = off};
            off += k;
            budget -= k;
        }
        /* --compact: each decoding sequence compacted before its slots are taken (a move makes
         * slots taken before stale); --batch-compact: then the decoding sequences repacked,
         * oldest first */
        const int repack_now = o->batch_compact && S.now % o->batch_compact == 0;
        if (o->compact || repack_now) {
            uint64_t t0 = tool_now_ns();
            uint32_t nb = 0, m = 0;
            for (uint32_t i = 0; i < n_items; i++) {
                entry *e = &S.ent[S.items[i].e];
                if (e->prefill) continue;
                S.dec_seqs[nb++] = e->s;
                if (!o->compact) continue;
                static const uint32_t flags[] = {0, 0, PKV_COMPACT_EVICT, PKV_COMPACT_CACHED}; /* by mode */
                if ((rc = pkv_seq_compact(S.c, e->s, flags[o->compact], &m)) < 0) {
                    fail(&S, rc, "pkv_seq_compact");
                    goto done;
                }
                res->compact_moved += m;
            }
            if (repack_now) {
                if ((rc = pkv_batch_compact(S.c, S.dec_seqs, nb, o->slack, (o->repack ? PKV_BATCH_REPACK : 0u) | (o->batch_cached ? PKV_BATCH_CACHED : 0u), &m)) < 0) {
                    fail(&S, rc, "pkv_batch_compact");
                    goto done;
                }
                res->compact_moved += m;
            }
            uint64_t dt = tool_now_ns() - t0;
            S.ns_pkv += dt;
            S.ns_compact += dt;
        }
        /* the running sequences get their slots first; only a step that preempted nobody admits
         * (vLLM's rule: admitting right after a preemption would only thrash) */
        uint32_t preempted_before = res->preemptions;
        if (append_items(&S, 0, n_items)) goto done;
        if (res->preemptions == preempted_before) {
            uint32_t first_new = n_items;
            if (admit(&S, &budget, &n_items, &off) || append_items(&S, first_new, n_items)) goto done;
        }

        /* gather the surviving work: slots for the writes, decode and prefill lists */
        uint32_t T = 0, n_dec = 0, n_pre = 0;
        for (uint32_t i = 0; i < n_items; i++) {
            item *it = &S.items[i];
            entry *e = &S.ent[it->e];
            if (!e->alive) continue;
            if (T != it->off) memmove(S.slots + T, S.slots + it->off, it->n * sizeof *S.slots);
            T += it->n;
            if (it->n == 1) S.dec_seqs[n_dec++] = e->s;
            else S.preq[n_pre++] = (pkv_attn_req){.seq = e->s, .q_start = e->len, .n_q = it->n};
        }
        if (n_dec > 1 && decode_order(&S, n_dec) < 0) goto done;
        if (o->attn && T) {
            uint64_t ta = tool_now_ns();
            for (uint32_t l = 0; l < md->n_layers; l++) {
                size_t row = (size_t)((S.now * 131 + l * 977) % KV_POOL_ROWS) * S.kv_row;
                rc = pkv_write_kv(S.c, l, S.slots, T, S.kbuf + row, S.vbuf + row, PKV_DTYPE_F32);
                if (rc < 0) {
                    fail(&S, rc, "pkv_write_kv");
                    goto done;
                }
                uint64_t tk = tool_now_ns();
                if (n_dec) {
                    rc = pkv_attn_decode(S.c, l, S.dec_seqs, n_dec, S.qbuf, S.obuf, &ap);
                    if (rc < 0) {
                        fail(&S, rc, "pkv_attn_decode");
                        goto done;
                    }
                }
                if (n_pre) {
                    rc = pkv_attn_prefill(S.c, l, S.preq, n_pre, S.qbuf + (size_t)n_dec * S.q_row, S.obuf, &ap);
                    if (rc < 0) {
                        fail(&S, rc, "pkv_attn_prefill");
                        goto done;
                    }
                }
                S.ns_attn += tool_now_ns() - tk;
            }
            S.ns_pkv += tool_now_ns() - ta;
        }

        /* commit (one timed loop: a clock read per call would cost as much as the call) */
        uint64_t tc = tool_now_ns();
        for (uint32_t i = 0; i < n_items; i++) {
            entry *e = &S.ent[S.items[i].e];
            if (e->alive && (rc = pkv_seq_commit(S.c, e->s, e->len + S.items[i].n)) < 0) {
                fail(&S, rc, "pkv_seq_commit");
                goto done;
            }
        }
        S.ns_pkv += tool_now_ns() - tc;
        /* advance: prompt done -> first token and forks; decode -> next token */
        for (uint32_t i = 0; i < n_items; i++) {
            item *it = &S.items[i];
            uint32_t ei = it->e;
            if (!S.ent[ei].alive) continue;
            S.ent[ei].len += it->n;
            uint32_t r = S.ent[ei].req;
            const sim_request *rq = &w->reqs[r];
            req_state *q = &S.rs[r];
            if (S.ent[ei].prefill) {
                q->computed += it->n;
                res->prefill_tokens += it->n;
                if (q->computed < q->target) continue;
                S.ent[ei].prefill = 0;
                if (S.tier) { /* the computed prompt's full blocks, for requests to come */
                    uint32_t saved = 0;
                    uint64_t t0 = tool_now_ns();
                    rc = pkv_tier_save(S.tier, S.c, S.ent[ei].s, &saved);
                    S.ns_pkv += tool_now_ns() - t0;
                    if (rc < 0) {
                        fail(&S, rc, "pkv_tier_save");
                        goto done;
                    }
                }
                S.ent[ei].gen = q->kept + 1;
                q->kept = 0;
                if (q->ttft < 0) {
                    q->ttft = (int64_t)(S.now + 1 - rq->arrival_step);
                    ttft[n_ttft++] = (double)q->ttft;
                }
                for (uint32_t k = 1; k < rq->n_samples; k++) {
                    pkv_seq child;
                    uint64_t t0 = tool_now_ns();
                    rc = pkv_seq_fork(S.c, S.ent[ei].s, &child);
                    S.ns_pkv += tool_now_ns() - t0;
                    if (rc < 0) {
                        fail(&S, rc, "pkv_seq_fork");
                        goto done;
                    }
                    entry *ce = add_entry(&S, r, k, child, S.ent[ei].len, 1, 0);
                    if (!ce) {
                        fail(&S, PKV_ENOMEM, "fork");
                        goto done;
                    }
                    if (ce->gen >= rq->output_len && finish_entry(&S, ce)) goto done;
                }
            } else {
                S.ent[ei].gen++;
                res->decode_tokens++;
            }
            if (S.ent[ei].gen >= rq->output_len && finish_entry(&S, &S.ent[ei])) goto done;
        }

        /* --window: the paged policies let go of the blocks before each sequence's next first key
           (its next position, len, sees from len + 1 - W); paged_prefix's stay in its index */
        if (drops_front(&S, o)) {
            uint64_t t0 = tool_now_ns();
            for (uint32_t i = 0; i < S.n_ent; i++) {
                const entry *e = &S.ent[i];
                if (e->alive && e->len + 1 > o->window && (rc = pkv_seq_drop_front(S.c, e->s, e->len + 1 - o->window)) < 0) {
                    fail(&S, rc, "pkv_seq_drop_front");
                    goto done;
                }
            }
            S.ns_pkv += tool_now_ns() - t0;
        }

        /* measure the step */
        pkv_stats st;
        rc = pkv_cache_get_stats(S.c, &st);
        if (rc < 0) {
            fail(&S, rc, "pkv_cache_get_stats");
            goto done;
        }
        uint64_t reserved = policy == SIM_CONTIGUOUS ? S.reserved_total : st.n_active;
        if (policy == SIM_CONTIGUOUS && reserved > res->peak_blocks) res->peak_blocks = (uint32_t)reserved;
        if (reserved) {
            sum_live += (double)st.n_slots_used;
            sum_res += (double)reserved * B;
        }
        sum_waste += (double)(reserved * B - st.n_slots_used) / ((double)o->n_blocks * B);
        sum_seqs += S.running_seqs;
        if (S.running_seqs > res->peak_seqs) res->peak_seqs = S.running_seqs;
        sample_series(&S, (uint32_t)reserved);
        n_steps++;

        /* compact the entry list (keeps order) */
        uint32_t k = 0;
        for (uint32_t i = 0; i < S.n_ent; i++)
            if (S.ent[i].alive) S.ent[k++] = S.ent[i];
        S.n_ent = k;
        if (n_items == 0 && S.running_seqs == 0 && S.wq_n > 0) {
            if (++idle_steps > 2) {
                fprintf(stderr, "pkv sim: %s: the waiting request %u cannot be admitted into an empty pool\n",
                        sim_policy_names[policy], S.wq[S.wq_head]);
                rc = PKV_ENOSPC;
                goto done;
            }
        } else {
            idle_steps = 0;
        }
        S.now++;
        progress(&S, t_start, 0);
    }
    progress(&S, t_start, 1);
    res->wall_s = (double)(tool_now_ns() - t_start) * 1e-9;
    res->steps = n_steps;
    res->mean_seqs = n_steps ? sum_seqs / (double)n_steps : 0;
    res->kv_utilization = sum_res > 0 ? sum_live / sum_res : 0;
    res->waste = n_steps ? sum_waste / (double)n_steps : 0;
    res->prefix_hit_rate = res->prompt_tokens ? (double)res->prefix_hit_tokens / (double)res->prompt_tokens : 0;
    res->pkv_s = (double)S.ns_pkv * 1e-9;
    res->attn_s = (double)S.ns_attn * 1e-9;
    res->compact_s = (double)S.ns_compact * 1e-9;
    res->decode_tok_s = res->pkv_s > 0 ? (double)res->decode_tokens / res->pkv_s : 0;
    qsort(ttft, n_ttft, sizeof *ttft, cmp_d);
    res->ttft_p50 = tool_percentile(ttft, n_ttft, 50);
    res->ttft_p90 = tool_percentile(ttft, n_ttft, 90);
    res->ttft_p99 = tool_percentile(ttft, n_ttft, 99);
    {
        pkv_stats st;
        if (pkv_cache_get_stats(S.c, &st) == 0) {
            if (policy != SIM_CONTIGUOUS) res->peak_blocks = st.peak_active;
            res->cow_copies = st.cow_copies;
            res->evictions = st.evictions;
            res->shared_keys = st.attn_shared_keys;
            res->tombstones = st.n_tombstones;
            res->tomb_hits = st.prefix_tomb_hits;
        }
    }
    if (S.tier) {
        pkv_tier_stats ts;
        if (pkv_tier_get_stats(S.tier, &ts) == 0) {
            res->tier_saved_blocks = ts.saved;
            res->tier_evictions = ts.evictions;
            res->tier_bytes = ts.bytes;
        }
    }
    res->check_rc = pkv_cache_check(S.c, res->check_msg, sizeof res->check_msg);
    rc = 0;
done:
    if (S.fatal && rc >= 0) rc = PKV_EINVAL;
    if (rc < 0) progress(&S, t_start, 1);
    pkv_cache_destroy(S.c);
    pkv_tier_destroy(S.tier);
    for (uint32_t i = 0; S.rs && i < w->n; i++) free(S.rs[i].swap); /* left by a run that failed */
    free(S.rs), free(S.ent), free(S.run_reqs), free(S.wq), free(S.items), free(S.tok), free(S.slots);
    free(S.dec_seqs), free(S.preq), free(S.owner), free(S.tab), free(S.kbuf), free(S.vbuf), free(S.qbuf), free(S.obuf), free(ttft);
    return rc;
}
