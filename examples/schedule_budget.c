/* schedule_budget.c: a serving loop that budgets each step before appending, as vLLM's
 * scheduler does with can_append_slots. Every step the running sequences each want one decode
 * token; pkv_seq_append_blocks says how many blocks each append would take, and while their sum
 * is over what the pool can give (n_free + n_cached) the newest running sequence is preempted:
 * released, and queued again to be recomputed from its prompt and the tokens it made. Then every
 * append of the step succeeds, as the count promised. Waiting requests are admitted after the
 * decodes, each with a prefix match first and then its count. The pool is too small for all
 * requests at once, so preemption happens; the checker runs after every step, and the example
 * fails if an append it budgeted is refused or a request ends with the wrong length. */
#include <pkv.h>
#include <stdio.h>
#include <string.h>

enum { N_REQ = 8, SYS = 24, OUT = 40, BT = 16, BLOCKS = 24, H = 2, D = 32, HQ = 4, MAX_LEN = 160 };

typedef struct {
    pkv_seq seq;      /* 0 while waiting */
    uint32_t prompt;  /* prompt length (the first SYS tokens shared by every request) */
    uint32_t made;    /* tokens generated so far (kept across a preemption) */
    uint32_t out_at;  /* the step it was last preempted: not admitted again in that step */
    int32_t tok[MAX_LEN];
} request;

/* Token ids: the shared system prompt, then the request's own; generated tokens from the step. */
static int32_t token_at(uint32_t r, uint32_t pos) { return pos < SYS ? (int32_t)(7 + pos) : (int32_t)(100 * r + pos); }

/* Writes K/V for positions [from, from + n) of s (values from the token id) and commits them. */
static int compute(pkv_cache *c, pkv_seq s, const int32_t *tok, uint32_t from, uint32_t n) {
    static float k[MAX_LEN][H][D], v[MAX_LEN][H][D];
    int32_t slots[MAX_LEN];
    int rc = pkv_seq_append(c, s, tok + from, n, slots);
    if (rc) return rc;
    for (uint32_t i = 0; i < n; i++)
        for (int h = 0; h < H; h++)
            for (int d = 0; d < D; d++)
                k[i][h][d] = v[i][h][d] = (float)((tok[from + i] * 31 + h * 7 + d) % 17) / 17.0f;
    rc = pkv_write_kv(c, 0, slots, n, k, v, PKV_DTYPE_F32);
    return rc ? rc : pkv_seq_commit(c, s, from + n);
}

static uint32_t can_have(pkv_cache *c) {
    pkv_stats st;
    return pkv_cache_get_stats(c, &st) ? 0 : st.n_free + st.n_cached;
}

int main(void) {
    pkv_config cfg = pkv_config_default(); /* prefix cache on */
    cfg.n_layers = 1, cfg.n_kv_heads = H, cfg.head_dim = D, cfg.block_tokens = BT, cfg.n_blocks = BLOCKS;
    cfg.n_threads = 1;
    pkv_cache *c = NULL;
    if (pkv_cache_create(&cfg, &c)) return 1;
    static request req[N_REQ];
    for (uint32_t r = 0; r < N_REQ; r++) {
        req[r].prompt = SYS + 8 + 11 * r; /* 32 .. 109 tokens */
        for (uint32_t p = 0; p < req[r].prompt; p++) req[r].tok[p] = token_at(r, p);
    }
    static float q[N_REQ][HQ][D], out[N_REQ][HQ][D];
    for (int i = 0; i < N_REQ; i++)
        for (int h = 0; h < HQ; h++)
            for (int d = 0; d < D; d++) q[i][h][d] = (float)((i + h + d) % 5) / 5.0f;
    pkv_attn_params p = pkv_attn_params_default();
    p.n_q_heads = HQ;
    uint32_t done = 0, steps = 0, preempted = 0, reused = 0, order[N_REQ], n_run = 0; /* running, oldest first */
    int rc = 0;
    while (!rc && done < N_REQ && steps < 10000) {
        steps++;
        /* 1. the decodes: preempt the newest until every append of the step fits */
        uint32_t need[N_REQ], sum;
        for (;;) {
            sum = 0;
            for (uint32_t i = 0; i < n_run && !rc; i++) rc = pkv_seq_append_blocks(c, req[order[i]].seq, 1, &need[i]);
            for (uint32_t i = 0; i < n_run; i++) sum += need[i];
            if (rc || sum <= can_have(c) || n_run == 0) break;
            request *victim = &req[order[--n_run]];
            rc = pkv_seq_release(c, victim->seq);
            victim->seq = 0; /* waits again; its made tokens are recomputed with the prompt */
            victim->out_at = steps;
            preempted++;
        }
        pkv_seq batch[N_REQ];
        for (uint32_t i = 0; i < n_run && !rc; i++) {
            request *rq = &req[order[i]];
            const uint32_t len = rq->prompt + rq->made;
            rq->tok[len] = (int32_t)(500 + (len * 13 + steps) % 97); /* the token this step "sampled" */
            rc = compute(c, rq->seq, rq->tok, len, 1);
            if (rc == PKV_ENOSPC) fprintf(stderr, "schedule_budget: a budgeted append was refused\n");
            rq->made++;
            batch[i] = rq->seq;
        }
        if (!rc && n_run) rc = pkv_attn_decode(c, 0, batch, n_run, &q[0][0][0], &out[0][0][0], &p);
        /* finished requests leave; their full blocks stay CACHED for the prefix index */
        for (uint32_t i = 0; i < n_run && !rc;) {
            request *rq = &req[order[i]];
            if (rq->made < OUT) {
                i++;
                continue;
            }
            pkv_seq_info in;
            rc = pkv_seq_get_info(c, rq->seq, &in);
            if (!rc && in.n_tokens != rq->prompt + OUT) rc = PKV_ECORRUPT;
            if (!rc) rc = pkv_seq_release(c, rq->seq);
            rq->seq = 0, rq->made = OUT + 1; /* done */
            done++;
            memmove(order + i, order + i + 1, (--n_run - i) * sizeof *order);
        }
        /* 2. admissions, oldest request first, while its prompt (and made tokens) fit */
        for (uint32_t r = 0; r < N_REQ && !rc; r++) {
            request *rq = &req[r];
            if (rq->seq || rq->made > OUT || rq->out_at == steps) continue;
            const uint32_t len = rq->prompt + rq->made;
            uint32_t hit = 0, need_r = 0;
            rc = pkv_seq_create(c, NULL, 0, &rq->seq);
            if (!rc) rc = pkv_seq_match_prefix(c, rq->seq, rq->tok, len, &hit);
            if (!rc) rc = pkv_seq_append_blocks(c, rq->seq, len - hit, &need_r);
            if (rc) break;
            if (need_r > can_have(c)) { /* not this step: give back what the match attached */
                rc = pkv_seq_release(c, rq->seq);
                rq->seq = 0;
                break;
            }
            rc = compute(c, rq->seq, rq->tok, hit, len - hit);
            if (rc == PKV_ENOSPC) fprintf(stderr, "schedule_budget: a budgeted prompt was refused\n");
            reused += hit;
            order[n_run++] = r;
        }
        char msg[256];
        if (!rc && pkv_cache_check(c, msg, sizeof msg)) {
            fprintf(stderr, "schedule_budget: checker: %s\n", msg);
            rc = PKV_ECORRUPT;
        }
    }
    if (!rc && done != N_REQ) rc = PKV_ECORRUPT;
    if (!rc && preempted == 0) rc = PKV_ECORRUPT; /* the pool is meant to be too small for all */
    printf("schedule_budget: %u requests in %u steps, %u preemptions, %u prompt tokens reused\n", done, steps,
           preempted, reused);
    if (rc) fprintf(stderr, "schedule_budget: %s\n", pkv_strerror(rc));
    pkv_cache_destroy(c);
    return rc ? 1 : 0;
}
