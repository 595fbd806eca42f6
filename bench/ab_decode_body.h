/* ab_decode_body.h: the half of bench/ab_decode.c that is compiled once per library build; AB(x)
 * names build A's or build B's copy of the public function x. Included twice, no include guard. */

/* Creates the cache, fragments its free queue when paged (many short sequences take blocks in
 * random interleaving and are released in random order), then appends `batch` sequences of ctx
 * tokens (one more with an extend) and writes the same random K/V rows into every layer. 0 or
 * -1. */
static int AB(ab_setup)(ab_side *s, const ab_opts *o, tool_rng *rng) {
    const uint32_t per_seq = (o->ctx + o->bt - 1) / o->bt, n_seqs = o->batch + (o->ext > 0);
    pkv_config c = AB(pkv_config_default)();
    c.n_layers = o->layers, c.n_kv_heads = o->hkv, c.head_dim = o->d, c.v_dim = o->vd, c.block_tokens = o->bt;
    c.n_blocks = per_seq * n_seqs, c.k_dtype = c.v_dtype = o->dtype, c.n_threads = o->threads;
    c.enable_prefix_cache = 0, c.max_blocks_per_seq = per_seq > 64 ? per_seq : 64, c.max_seqs = AB_SCATTER + 64;
    if (ab_loan.base) c.allocator = tool_loan_allocator(&ab_loan); /* build A reads build B's pool */
    if (AB(pkv_cache_create)(&c, &s->c) < 0) return -1;
    static const int32_t tok[AB_BT_MAX] = {0};
    if (o->paged) {
        static pkv_seq sc[AB_SCATTER];
        const uint32_t m = c.n_blocks < AB_SCATTER ? c.n_blocks : AB_SCATTER;
        for (uint32_t i = 0; i < m; i++)
            if (AB(pkv_seq_create)(s->c, NULL, 0, &sc[i]) < 0) return -1;
        for (uint32_t b = 0; b < c.n_blocks; b++)
            for (;;) {
                const int rc = AB(pkv_seq_append)(s->c, sc[tool_rng_u64(rng) % m], tok, o->bt, NULL);
                if (rc == PKV_ELIMIT) continue; /* that one is full: pick another */
                if (rc < 0) return -1;
                break;
            }
        for (uint32_t i = m; i > 1; i--) {
            const uint32_t j = (uint32_t)(tool_rng_u64(rng) % i);
            const pkv_seq t = sc[i - 1];
            sc[i - 1] = sc[j], sc[j] = t;
        }
        for (uint32_t i = 0; i < m; i++)
            if (AB(pkv_seq_release)(s->c, sc[i]) < 0) return -1;
    }
    const size_t n = (size_t)o->ctx * o->hkv * o->d;
    int32_t *ids = calloc(o->ctx, sizeof *ids), *slots = malloc(sizeof(int32_t) * o->ctx);
    float *k = malloc(sizeof(float) * n), *v = malloc(sizeof(float) * n);
    int rc = ids && slots && k && v ? 0 : -1;
    for (size_t i = 0; i < n && rc == 0; i++) k[i] = ab_unit(rng), v[i] = ab_unit(rng);
    for (uint32_t b = 0; b < n_seqs && rc == 0; b++) {
        if (o->shared && b > 0 && b < o->batch) { /* a fork of sequence 0: every block shared */
            if (AB(pkv_seq_fork)(s->c, s->seqs[0], &s->seqs[b]) < 0) rc = -1;
            continue;
        }
        if (AB(pkv_seq_create)(s->c, NULL, 0, &s->seqs[b]) < 0 ||
            AB(pkv_seq_append)(s->c, s->seqs[b], ids, o->ctx, NULL) < 0 ||
            AB(pkv_seq_slots)(s->c, s->seqs[b], 0, o->ctx, slots) < 0)
            rc = -1;
        for (uint32_t l = 0; l < o->layers && rc == 0; l++)
            if (AB(pkv_write_kv)(s->c, l, slots, o->ctx, k, o->vd ? NULL : v, PKV_DTYPE_F32) < 0) rc = -1;
    }
    free(ids), free(slots), free(k), free(v);
    return rc;
}

/* Median seconds per call over `calls` calls, each on the side's next layer: a decode of the
 * batch, or with an extend a prefill call of the batch's decodes and the extend. */
static double AB(ab_time)(ab_side *s, const ab_opts *o, const float *q, float *out) {
    pkv_attn_params p = AB(pkv_attn_params_default)();
    p.n_q_heads = o->hq;
    p.flags = o->flags;
    p.alibi_slopes = o->alibi;
    p.attn_chunk = o->chunk;
    double t[AB_MAX_CALLS];
    pkv_attn_req reqs[AB_MAX_BATCH + 1]; /* with an extend: the decodes, then the extend */
    if (o->ext) {
        for (uint32_t i = 0; i < o->batch; i++) reqs[i] = (pkv_attn_req){s->seqs[i], o->ctx - 1, 1};
        reqs[o->batch] = (pkv_attn_req){s->seqs[o->batch], o->ctx - o->ext, o->ext};
    }
    for (uint32_t i = 0; i < o->calls; i++) {
        const uint32_t layer = s->next++ % o->layers;
        const double t0 = ab_now();
        const int rc = o->ext ? AB(pkv_attn_prefill)(s->c, layer, reqs, o->batch + 1, q, out, &p)
                              : AB(pkv_attn_decode)(s->c, layer, s->seqs, o->batch, q, out, &p);
        if (rc < 0) return -1.0;
        t[i] = ab_now() - t0;
    }
    return tool_median(t, o->calls);
}

static void AB(ab_free)(ab_side *s) { AB(pkv_cache_destroy)(s->c); }
