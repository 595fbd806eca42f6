/* model.c: llama2.c checkpoint loader, forward pass (RMSNorm, RoPE, GQA, SwiGLU) with pluggable
 * attention, the paged-cache attention backend, tokenizer decoding and sampling for `pkv run`. */
#include "model.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* Limits well inside what the arithmetic below and pkv accept; a header value past them is
 * "oversized" and rejected before any size is computed from it. */
#define MODEL_MAX_DIM (1 << 16)
#define MODEL_MAX_LAYERS 1024
#define MODEL_MAX_VOCAB (1 << 22)
#define MODEL_MAX_SEQ_LEN (1 << 20)

static void set_err(char *err, size_t cap, const char *fmt, ...) {
    if (!err || !cap) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, cap, fmt, ap);
    va_end(ap);
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ---- loader ------------------------------------------------------------------------------ */

static int check_header(model_config *p, char *err, size_t cap) {
    static const char *names[7] = {"dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len"};
    int32_t v[7] = {p->dim, p->hidden_dim, p->n_layers, p->n_heads, p->n_kv_heads, p->vocab_size, p->seq_len};
    for (int i = 0; i < 7; i++) {
        if (i == 5) { /* vocab_size: its sign says whether the classifier is shared */
            if (v[i] == 0 || v[i] == INT32_MIN) {
                set_err(err, cap, "invalid header: vocab_size = %d", v[i]);
                return -1;
            }
            continue;
        }
        if (v[i] <= 0) {
            set_err(err, cap, "invalid header: %s = %d (must be positive)", names[i], v[i]);
            return -1;
        }
    }
    p->shared_classifier = p->vocab_size > 0;
    if (p->vocab_size < 0) p->vocab_size = -p->vocab_size;
    if (p->dim > MODEL_MAX_DIM || p->hidden_dim > 4 * MODEL_MAX_DIM || p->n_heads > p->dim) {
        set_err(err, cap, "invalid header: dim = %d, hidden_dim = %d, n_heads = %d out of range", p->dim,
                p->hidden_dim, p->n_heads);
        return -1;
    }
    if (p->n_layers > MODEL_MAX_LAYERS) {
        set_err(err, cap, "invalid header: n_layers = %d (at most %d)", p->n_layers, MODEL_MAX_LAYERS);
        return -1;
    }
    if (p->vocab_size > MODEL_MAX_VOCAB) {
        set_err(err, cap, "invalid header: vocab_size = %d (at most %d)", p->vocab_size, MODEL_MAX_VOCAB);
        return -1;
    }
    if (p->seq_len > MODEL_MAX_SEQ_LEN) {
        set_err(err, cap, "invalid header: seq_len = %d (at most %d)", p->seq_len, MODEL_MAX_SEQ_LEN);
        return -1;
    }
    if (p->dim % p->n_heads) {
        set_err(err, cap, "invalid header: n_heads = %d does not divide dim = %d", p->n_heads, p->dim);
        return -1;
    }
    if (p->n_kv_heads > p->n_heads || p->n_heads % p->n_kv_heads) {
        set_err(err, cap, "invalid header: n_kv_heads = %d does not divide n_heads = %d", p->n_kv_heads, p->n_heads);
        return -1;
    }
    p->head_size = p->dim / p->n_heads;
    p->kv_dim = p->n_kv_heads * p->head_size;
    if (p->head_size % 2) {
        set_err(err, cap, "invalid header: head size %d (dim / n_heads) is odd; RoPE rotates pairs", p->head_size);
        return -1;
    }
    if (p->head_size > 1024) {
        set_err(err, cap, "invalid header: head size %d exceeds the cache's limit of 1024", p->head_size);
        return -1;
    }
    return 0;
}

/* Floats of the weights in file order; all factors are bounded by check_header, so uint64
 * cannot overflow (each product < 2^22 * 2^16 * 2^10). */
static uint64_t weight_floats(const model_config *p) {
    uint64_t L = (uint64_t)p->n_layers, D = (uint64_t)p->dim, H = (uint64_t)p->hidden_dim;
    uint64_t KV = (uint64_t)p->kv_dim, V = (uint64_t)p->vocab_size;
    uint64_t n = V * D;                       /* token embedding */
    n += L * D;                               /* rms_att */
    n += L * D * D;                           /* wq */
    n += 2 * L * KV * D;                      /* wk, wv */
    n += L * D * D;                           /* wo */
    n += L * D;                               /* rms_ffn */
    n += 3 * L * H * D;                       /* w1, w2, w3 */
    n += D;                                   /* rms_final */
    n += (uint64_t)p->seq_len * (uint64_t)p->head_size; /* freq_cis_real + imag (unused) */
    if (!p->shared_classifier) n += V * D;    /* wcls */
    return n;
}

void model_free(model *m) {
    if (!m) return;
    free(m->data);
    memset(m, 0, sizeof *m);
}

/* path opened for reading if it is a regular file (*bytes its size, where bytes is not NULL),
 * else NULL with err set.
 * Opened without blocking, so that a FIFO (or a device that blocks on open) is refused rather
 * than waited on; the descriptor blocks again before the reads. */
static FILE *open_regular(const char *path, const char *what, uint64_t *bytes, char *err, size_t cap) {
    const int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
        set_err(err, cap, "cannot open %s'%s': %s", what, path, strerror(errno));
        return NULL;
    }
    struct stat st;
    const int flags = fcntl(fd, F_GETFL);
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || flags < 0 || fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
        set_err(err, cap, "%s'%s' is not a regular file", what, path);
        close(fd);
        return NULL;
    }
    FILE *f = fdopen(fd, "rb");
    if (!f) {
        set_err(err, cap, "cannot open %s'%s': %s", what, path, strerror(errno));
        close(fd);
        return NULL;
    }
    if (bytes) *bytes = (uint64_t)st.st_size;
    return f;
}

int model_load(const char *path, model *m, char *err, size_t cap) {
    memset(m, 0, sizeof *m);
    uint64_t file_bytes;
    FILE *f = open_regular(path, "", &file_bytes, err, cap);
    if (!f) return -1;
    int32_t h[7];
    if (file_bytes < sizeof h || fread(h, sizeof h, 1, f) != 1) {
        set_err(err, cap, "truncated header: '%s' has %llu bytes, the header alone needs 28", path,
                (unsigned long long)file_bytes);
        fclose(f);
        return -1;
    }
    model_config p = {h[0], h[1], h[2], h[3], h[4], h[5], h[6], 0, 0, 0};
    if (check_header(&p, err, cap)) {
        fclose(f);
        return -1;
    }
    uint64_t n = weight_floats(&p);
    uint64_t want = sizeof h + n * sizeof(float);
    if (file_bytes != want) {
        set_err(err, cap, "%s: '%s' has %llu bytes but its header (dim %d, hidden %d, layers %d, heads %d, kv heads %d, "
                "vocab %d, seq_len %d) needs exactly %llu",
                file_bytes < want ? "truncated file" : "file larger than its header says", path,
                (unsigned long long)file_bytes, p.dim, p.hidden_dim, p.n_layers, p.n_heads, p.n_kv_heads,
                p.vocab_size, p.seq_len, (unsigned long long)want);
        fclose(f);
        return -1;
    }
    float *data = malloc((size_t)n * sizeof(float));
    if (!data) {
        set_err(err, cap, "out of memory for %llu bytes of weights", (unsigned long long)(n * sizeof(float)));
        fclose(f);
        return -1;
    }
    if (fread(data, sizeof(float), (size_t)n, f) != (size_t)n) {
        set_err(err, cap, "read error on '%s' (file changed while reading?)", path);
        free(data);
        fclose(f);
        return -1;
    }
    fclose(f);
    for (uint64_t i = 0; i < n; i++) {
        if (!isfinite(data[i])) {
            set_err(err, cap, "corrupt weights: non-finite value at float %llu of '%s'", (unsigned long long)i, path);
            free(data);
            return -1;
        }
    }
    m->cfg = p;
    m->data = data;
    m->n_floats = (size_t)n;
    size_t L = (size_t)p.n_layers, D = (size_t)p.dim, H = (size_t)p.hidden_dim, KV = (size_t)p.kv_dim;
    const float *ptr = data;
    m->tok_emb = ptr; ptr += (size_t)p.vocab_size * D;
    m->rms_att = ptr; ptr += L * D;
    m->wq = ptr; ptr += L * D * D;
    m->wk = ptr; ptr += L * KV * D;
    m->wv = ptr; ptr += L * KV * D;
    m->wo = ptr; ptr += L * D * D;
    m->rms_ffn = ptr; ptr += L * D;
    m->w1 = ptr; ptr += L * H * D;
    m->w2 = ptr; ptr += L * D * H;
    m->w3 = ptr; ptr += L * H * D;
    m->rms_final = ptr; ptr += D;
    ptr += (size_t)p.seq_len * (size_t)p.head_size / 2; /* freq_cis_real (llama2.c: unused) */
    ptr += (size_t)p.seq_len * (size_t)p.head_size / 2; /* freq_cis_imag */
    m->wcls = p.shared_classifier ? m->tok_emb : ptr;
    return 0;
}

/* ---- forward ----------------------------------------------------------------------------- */

int model_scratch_init(model_scratch *s, const model *m, uint32_t max_tokens) {
    memset(s, 0, sizeof *s);
    size_t T = max_tokens ? max_tokens : 1;
    size_t D = (size_t)m->cfg.dim, KV = (size_t)m->cfg.kv_dim, H = (size_t)m->cfg.hidden_dim;
    s->max_tokens = (uint32_t)T;
    s->x = malloc(T * D * sizeof(float));
    s->xb = malloc(T * D * sizeof(float));
    s->xb2 = malloc(T * D * sizeof(float));
    s->q = malloc(T * D * sizeof(float));
    s->att = malloc(T * D * sizeof(float));
    s->k = malloc(T * KV * sizeof(float));
    s->v = malloc(T * KV * sizeof(float));
    s->hb = malloc(T * H * sizeof(float));
    s->hb2 = malloc(T * H * sizeof(float));
    if (!s->x || !s->xb || !s->xb2 || !s->q || !s->att || !s->k || !s->v || !s->hb || !s->hb2) {
        model_scratch_free(s);
        return -1;
    }
    return 0;
}

void model_scratch_free(model_scratch *s) {
    free(s->x), free(s->xb), free(s->xb2), free(s->q), free(s->att);
    free(s->k), free(s->v), free(s->hb), free(s->hb2);
    memset(s, 0, sizeof *s);
}

static void rmsnorm(float *o, const float *x, const float *w, int n) {
    float ss = 0.0f;
    for (int j = 0; j < n; j++) ss += x[j] * x[j];
    ss = 1.0f / sqrtf(ss / (float)n + 1e-5f);
    for (int j = 0; j < n; j++) o[j] = w[j] * (ss * x[j]);
}

/* out[d] = W[d][n] @ x[n] */
static void matmul(float *out, const float *x, const float *w, int n, int d) {
    for (int i = 0; i < d; i++) {
        const float *row = w + (size_t)i * (size_t)n;
        float acc = 0.0f;
        for (int j = 0; j < n; j++) acc += row[j] * x[j];
        out[i] = acc;
    }
}

/* llama2.c's RoPE: pairs (2i, 2i+1) inside each head rotated by pos * 10000^(-2i/head_size). */
static void rope(float *vec, int n_heads, int hs, uint32_t pos) {
    for (int j = 0; j < hs; j += 2) {
        float freq = 1.0f / powf(10000.0f, (float)j / (float)hs);
        float val = (float)pos * freq;
        float fcr = cosf(val), fci = sinf(val);
        for (int h = 0; h < n_heads; h++) {
            float *p = vec + (size_t)h * (size_t)hs + (size_t)j;
            float v0 = p[0], v1 = p[1];
            p[0] = v0 * fcr - v1 * fci;
            p[1] = v0 * fci + v1 * fcr;
        }
    }
}

int model_forward(const model *m, model_scratch *s, uint32_t T, const int32_t *tokens, const uint32_t *pos,
                  uint32_t n_out, const uint32_t *out_rows, float *logits, model_attn_fn attn, void *ctx) {
    const model_config *p = &m->cfg;
    int D = p->dim, KV = p->kv_dim, H = p->hidden_dim, hs = p->head_size;
    if (T == 0 || T > s->max_tokens) return -1;
    for (uint32_t t = 0; t < T; t++)
        if (tokens[t] < 0 || tokens[t] >= p->vocab_size) return -1;
    for (uint32_t t = 0; t < T; t++) memcpy(s->x + (size_t)t * D, m->tok_emb + (size_t)tokens[t] * D, D * sizeof(float));

    for (int l = 0; l < p->n_layers; l++) {
        size_t lD = (size_t)l * D;
        for (uint32_t t = 0; t < T; t++) {
            float *xb = s->xb + (size_t)t * D;
            rmsnorm(xb, s->x + (size_t)t * D, m->rms_att + lD, D);
            float *q = s->q + (size_t)t * D, *k = s->k + (size_t)t * KV, *v = s->v + (size_t)t * KV;
            matmul(q, xb, m->wq + (size_t)l * D * D, D, D);
            matmul(k, xb, m->wk + (size_t)l * KV * D, D, KV);
            matmul(v, xb, m->wv + (size_t)l * KV * D, D, KV);
            rope(q, p->n_heads, hs, pos[t]);
            rope(k, p->n_kv_heads, hs, pos[t]);
        }
        int rc = attn(ctx, (uint32_t)l, s->q, s->k, s->v, s->att);
        if (rc) return rc;
        for (uint32_t t = 0; t < T; t++) {
            float *x = s->x + (size_t)t * D, *xb = s->xb + (size_t)t * D, *xb2 = s->xb2 + (size_t)t * D;
            float *hb = s->hb + (size_t)t * H, *hb2 = s->hb2 + (size_t)t * H;
            matmul(xb2, s->att + (size_t)t * D, m->wo + (size_t)l * D * D, D, D);
            for (int j = 0; j < D; j++) x[j] += xb2[j];
            rmsnorm(xb, x, m->rms_ffn + lD, D);
            matmul(hb, xb, m->w1 + (size_t)l * H * D, D, H);
            matmul(hb2, xb, m->w3 + (size_t)l * H * D, D, H);
            for (int j = 0; j < H; j++) {
                float a = hb[j];
                hb[j] = a * (1.0f / (1.0f + expf(-a))) * hb2[j]; /* SwiGLU: silu(w1 x) * (w3 x) */
            }
            matmul(xb, hb, m->w2 + (size_t)l * D * H, H, D);
            for (int j = 0; j < D; j++) x[j] += xb[j];
        }
    }
    for (uint32_t j = 0; j < n_out; j++) {
        uint32_t t = out_rows[j];
        if (t >= T) return -1;
        rmsnorm(s->xb, s->x + (size_t)t * D, m->rms_final, D);
        matmul(logits + (size_t)j * p->vocab_size, s->xb, m->wcls, D, p->vocab_size);
    }
    return 0;
}

/* ---- paged backend ------------------------------------------------------------------------- */

pkv_config model_pkv_config(const model *m, uint32_t block_tokens, uint32_t n_blocks) {
    pkv_config cfg = pkv_config_default();
    cfg.n_layers = (uint32_t)m->cfg.n_layers;
    cfg.n_kv_heads = (uint32_t)m->cfg.n_kv_heads;
    cfg.head_dim = (uint32_t)m->cfg.head_size;
    cfg.block_tokens = block_tokens;
    cfg.n_blocks = n_blocks;
    cfg.k_dtype = PKV_DTYPE_F32; /* f32 pool: paged results match a contiguous f32 forward */
    cfg.v_dtype = PKV_DTYPE_F32;
    return cfg;
}

typedef struct pkv_attn_ctx {
    const model *m;
    pkv_cache *c;
    const pkv_seq *seqs;
    uint32_t n_seqs;
    const uint32_t *n_new;
    const uint32_t *start;  /* first new position per sequence */
    const int32_t *slots;   /* [T] */
    uint32_t T;
    /* decode group (sequences with one new token) and prefill group, gathered */
    pkv_seq *dec_seqs;
    uint32_t *dec_rows;     /* token row of each decode sequence */
    uint32_t n_dec;
    pkv_attn_req *reqs;
    uint32_t *req_rows;     /* first token row of each prefill request */
    uint32_t n_req, n_req_tok;
    float *qbuf, *obuf;     /* [T][dim] gather buffers */
    model_pkv_step *timing;
} pkv_attn_ctx;

static int pkv_attn_cb(void *vctx, uint32_t layer, const float *q, const float *k, const float *v, float *out) {
    pkv_attn_ctx *a = vctx;
    size_t D = (size_t)a->m->cfg.dim;
    uint64_t t0 = now_ns();
    int rc = pkv_write_kv(a->c, layer, a->slots, a->T, k, v, PKV_DTYPE_F32);
    uint64_t t1 = now_ns();
    if (rc < 0) return rc;
    pkv_attn_params ap = pkv_attn_params_default();
    ap.n_q_heads = (uint32_t)a->m->cfg.n_heads;
    if (a->n_dec) {
        for (uint32_t i = 0; i < a->n_dec; i++) memcpy(a->qbuf + i * D, q + (size_t)a->dec_rows[i] * D, D * sizeof(float));
        rc = pkv_attn_decode(a->c, layer, a->dec_seqs, a->n_dec, a->qbuf, a->obuf, &ap);
        if (rc < 0) return rc;
        for (uint32_t i = 0; i < a->n_dec; i++) memcpy(out + (size_t)a->dec_rows[i] * D, a->obuf + i * D, D * sizeof(float));
    }
    if (a->n_req) {
        size_t off = 0;
        for (uint32_t i = 0; i < a->n_req; i++) {
            memcpy(a->qbuf + off * D, q + (size_t)a->req_rows[i] * D, a->reqs[i].n_q * D * sizeof(float));
            off += a->reqs[i].n_q;
        }
        rc = pkv_attn_prefill(a->c, layer, a->reqs, a->n_req, a->qbuf, a->obuf, &ap);
        if (rc < 0) return rc;
        off = 0;
        for (uint32_t i = 0; i < a->n_req; i++) {
            memcpy(out + (size_t)a->req_rows[i] * D, a->obuf + off * D, a->reqs[i].n_q * D * sizeof(float));
            off += a->reqs[i].n_q;
        }
    }
    uint64_t t2 = now_ns();
    if (a->timing) {
        a->timing->ns_pkv += t2 - t0;
        a->timing->ns_attn += t2 - t1;
    }
    return 0;
}

int model_pkv_forward(const model *m, model_scratch *s, pkv_cache *c, const pkv_seq *seqs, uint32_t n_seqs,
                      const uint32_t *n_new, const int32_t *tokens, float *logits, model_pkv_step *timing) {
    uint32_t T = 0;
    for (uint32_t i = 0; i < n_seqs; i++) {
        if (n_new[i] == 0) return PKV_EINVAL;
        T += n_new[i];
    }
    if (T > s->max_tokens) return PKV_EINVAL;
    /* per-call buffers; sizes are tiny next to the model's activations */
    uint32_t *start = malloc(n_seqs * sizeof *start);
    uint32_t *pos = malloc(T * sizeof *pos);
    int32_t *slots = malloc(T * sizeof *slots);
    uint32_t *out_rows = malloc(n_seqs * sizeof *out_rows);
    pkv_seq *dec_seqs = malloc(n_seqs * sizeof *dec_seqs);
    uint32_t *dec_rows = malloc(n_seqs * sizeof *dec_rows);
    pkv_attn_req *reqs = malloc(n_seqs * sizeof *reqs);
    uint32_t *req_rows = malloc(n_seqs * sizeof *req_rows);
    size_t D = (size_t)m->cfg.dim;
    float *qbuf = malloc((size_t)T * D * sizeof(float)), *obuf = malloc((size_t)T * D * sizeof(float));
    int rc = PKV_ENOMEM;
    uint32_t n_appended = 0;
    if (!start || !pos || !slots || !out_rows || !dec_seqs || !dec_rows || !reqs || !req_rows || !qbuf || !obuf)
        goto done;

    uint64_t t0 = now_ns();
    uint32_t row = 0;
    for (uint32_t i = 0; i < n_seqs; i++) {
        pkv_seq_info info;
        rc = pkv_seq_get_info(c, seqs[i], &info);
        if (rc < 0) goto undo;
        start[i] = info.n_tokens;
        rc = pkv_seq_append(c, seqs[i], tokens + row, n_new[i], slots + row);
        if (rc < 0) goto undo;
        n_appended = i + 1;
        for (uint32_t j = 0; j < n_new[i]; j++) pos[row + j] = start[i] + j;
        row += n_new[i];
        out_rows[i] = row - 1;
    }
    if (timing) timing->ns_pkv += now_ns() - t0;

    pkv_attn_ctx a = {.m = m, .c = c, .seqs = seqs, .n_seqs = n_seqs, .n_new = n_new, .start = start,
                      .slots = slots, .T = T, .dec_seqs = dec_seqs, .dec_rows = dec_rows, .reqs = reqs,
                      .req_rows = req_rows, .qbuf = qbuf, .obuf = obuf, .timing = timing};
    row = 0;
    for (uint32_t i = 0; i < n_seqs; i++) {
        if (n_new[i] == 1) {
            dec_seqs[a.n_dec] = seqs[i];
            dec_rows[a.n_dec++] = row;
        } else {
            reqs[a.n_req] = (pkv_attn_req){.seq = seqs[i], .q_start = start[i], .n_q = n_new[i]};
            req_rows[a.n_req++] = row;
            a.n_req_tok += n_new[i];
        }
        row += n_new[i];
    }
    rc = model_forward(m, s, T, tokens, pos, n_seqs, out_rows, logits, pkv_attn_cb, &a);
    if (rc == -1) rc = PKV_EINVAL;
    if (rc < 0) goto undo;
    t0 = now_ns();
    for (uint32_t i = 0; i < n_seqs; i++) {
        rc = pkv_seq_commit(c, seqs[i], start[i] + n_new[i]);
        if (rc < 0) break; /* cannot happen for positions we just appended; reported as is */
    }
    if (timing) timing->ns_pkv += now_ns() - t0;
    goto done;
undo:
    /* all-or-nothing for the caller: drop the positions this call appended */
    for (uint32_t i = 0; i < n_appended; i++) (void)!pkv_seq_truncate(c, seqs[i], start[i]);
done:
    free(start), free(pos), free(slots), free(out_rows), free(dec_seqs), free(dec_rows);
    free(reqs), free(req_rows), free(qbuf), free(obuf);
    return rc;
}

/* ---- tree forward (speculative decoding) ------------------------------------------------------ */
typedef struct tree_attn_ctx {
    pkv_cache *c;
    const int32_t *slots;
    pkv_attn_tree_req req;
    uint32_t n_q_heads;
    model_pkv_step *timing;
} tree_attn_ctx;

static int tree_attn_cb(void *vctx, uint32_t layer, const float *q, const float *k, const float *v, float *out) {
    tree_attn_ctx *a = vctx;
    uint64_t t0 = now_ns();
    int rc = pkv_write_kv(a->c, layer, a->slots, a->req.n_nodes, k, v, PKV_DTYPE_F32);
    uint64_t t1 = now_ns();
    if (rc < 0) return rc;
    pkv_attn_params ap = pkv_attn_params_default();
    ap.n_q_heads = a->n_q_heads;
    rc = pkv_attn_tree(a->c, layer, &a->req, 1, q, out, &ap);
    uint64_t t2 = now_ns();
    if (a->timing) {
        a->timing->ns_pkv += t2 - t0;
        a->timing->ns_attn += t2 - t1;
    }
    return rc < 0 ? rc : 0;
}

int model_pkv_tree_forward(const model *m, model_scratch *s, pkv_cache *c, pkv_seq seq, uint32_t n,
                           const int32_t *tokens, const int32_t *parent, float *logits, model_pkv_step *timing) {
    if (n == 0 || n > s->max_tokens || n > PKV_TREE_MAX_NODES) return PKV_EINVAL;
    for (uint32_t i = 0; i < n; i++)
        if (parent[i] < -1 || parent[i] >= (int32_t)i) return PKV_EINVAL;
    uint32_t *pos = malloc(n * sizeof *pos), *rows = malloc(n * sizeof *rows);
    int32_t *slots = malloc(n * sizeof *slots);
    pkv_seq_info info;
    int rc = PKV_ENOMEM;
    if (!pos || !rows || !slots) goto done;
    uint64_t t0 = now_ns();
    if ((rc = pkv_seq_get_info(c, seq, &info)) < 0 || (rc = pkv_seq_append(c, seq, tokens, n, slots)) < 0) goto done;
    if (timing) timing->ns_pkv += now_ns() - t0;
    for (uint32_t i = 0; i < n; i++) { /* each node at its place in the text: after its parent */
        pos[i] = parent[i] < 0 ? info.n_tokens : pos[parent[i]] + 1;
        rows[i] = i;
    }
    tree_attn_ctx a = {.c = c, .slots = slots, .req = {.seq = seq, .q_start = info.n_tokens, .n_nodes = n, .parent = parent},
                       .n_q_heads = (uint32_t)m->cfg.n_heads, .timing = timing};
    rc = model_forward(m, s, n, tokens, pos, n, rows, logits, tree_attn_cb, &a);
    if (rc == -1) rc = PKV_EINVAL;
    if (rc < 0) (void)!pkv_seq_truncate(c, seq, info.n_tokens);
done:
    free(pos), free(rows), free(slots);
    return rc;
}

/* ---- tokenizer ------------------------------------------------------------------------------ */

void model_tokenizer_free(model_tokenizer *t) {
    if (!t) return;
    if (t->pieces)
        for (int32_t i = 0; i < t->vocab_size; i++) free(t->pieces[i]);
    free(t->pieces);
    free(t->scores);
    memset(t, 0, sizeof *t);
}

int model_tokenizer_load(const char *path, int32_t vocab_size, model_tokenizer *t, char *err, size_t cap) {
    memset(t, 0, sizeof *t);
    FILE *f = open_regular(path, "tokenizer ", NULL, err, cap);
    if (!f) return -1;
    t->vocab_size = vocab_size;
    t->pieces = calloc((size_t)vocab_size, sizeof *t->pieces);
    t->scores = calloc((size_t)vocab_size, sizeof *t->scores);
    if (!t->pieces || !t->scores) {
        set_err(err, cap, "out of memory for the tokenizer");
        goto fail;
    }
    if (fread(&t->max_token_length, sizeof(int32_t), 1, f) != 1) {
        set_err(err, cap, "tokenizer '%s': truncated header", path);
        goto fail;
    }
    if (t->max_token_length <= 0 || t->max_token_length > 65536) {
        set_err(err, cap, "tokenizer '%s': invalid max_token_length %d", path, t->max_token_length);
        goto fail;
    }
    for (int32_t i = 0; i < vocab_size; i++) {
        int32_t len;
        if (fread(&t->scores[i], sizeof(float), 1, f) != 1 || fread(&len, sizeof len, 1, f) != 1) {
            set_err(err, cap, "tokenizer '%s': truncated at token %d of %d", path, i, vocab_size);
            goto fail;
        }
        if (len < 0 || len > t->max_token_length) {
            set_err(err, cap, "tokenizer '%s': token %d has length %d (max_token_length %d)", path, i, len,
                    t->max_token_length);
            goto fail;
        }
        t->pieces[i] = malloc((size_t)len + 1);
        if (!t->pieces[i]) {
            set_err(err, cap, "out of memory for the tokenizer");
            goto fail;
        }
        if (len && fread(t->pieces[i], 1, (size_t)len, f) != (size_t)len) {
            set_err(err, cap, "tokenizer '%s': truncated in token %d of %d", path, i, vocab_size);
            goto fail;
        }
        t->pieces[i][len] = 0;
    }
    fclose(f);
    return 0;
fail:
    fclose(f);
    model_tokenizer_free(t);
    return -1;
}

const char *model_tokenizer_decode(const model_tokenizer *t, int32_t prev, int32_t token, char *buf, size_t cap) {
    if (!cap) return buf;
    buf[0] = 0;
    if (token < 0 || token >= t->vocab_size) return buf;
    const char *piece = t->pieces[token];
    if (prev == 1 && piece[0] == ' ') piece++; /* BOS strips the leading space */
    unsigned byte;
    if (strlen(piece) == 6 && sscanf(piece, "<0x%02X>", &byte) == 1) {
        /* raw byte; only printable or whitespace bytes are shown, as llama2.c does */
        if ((byte >= 32 && byte < 127) || byte == '\n' || byte == '\t' || byte == '\r' || byte >= 128) {
            if (cap > 1) {
                buf[0] = (char)byte;
                buf[1] = 0;
            }
        }
        return buf;
    }
    snprintf(buf, cap, "%s", piece);
    return buf;
}

/* ---- sampling ----------------------------------------------------------------------------- */

void model_sampler_init(model_sampler *sm, float temperature, float topp, uint64_t seed) {
    sm->temperature = temperature;
    sm->topp = topp;
    sm->rng = seed ? seed : 0x2545F4914F6CDD1Dull;
}

static float rng_f32(uint64_t *st) { /* xorshift64*, top 24 bits -> [0, 1) */
    uint64_t x = *st;
    x ^= x >> 12, x ^= x << 25, x ^= x >> 27;
    *st = x;
    return (float)((x * 0x2545F4914F6CDD1Dull) >> 40) / 16777216.0f;
}

size_t model_sample_work_bytes(int32_t vocab) { return (size_t)vocab * (sizeof(float) + sizeof(int32_t)); }

typedef struct { float p; int32_t i; } prob_index;
static int cmp_prob_desc(const void *a, const void *b) {
    const prob_index *x = a, *y = b;
    if (x->p != y->p) return x->p < y->p ? 1 : -1;
    return (x->i > y->i) - (x->i < y->i);
}

int32_t model_argmax(const float *logits, int32_t vocab) {
    int32_t best = 0;
    for (int32_t i = 1; i < vocab; i++)
        if (logits[i] > logits[best]) best = i;
    return best;
}

int32_t model_sample(model_sampler *sm, float *logits, int32_t vocab, void *work) {
    if (sm->temperature <= 0.0f) return model_argmax(logits, vocab); /* greedy */
    float mx = logits[0];
    for (int32_t i = 1; i < vocab; i++) mx = logits[i] > mx ? logits[i] : mx;
    float sum = 0.0f;
    for (int32_t i = 0; i < vocab; i++) {
        logits[i] = expf((logits[i] - mx) / sm->temperature);
        sum += logits[i];
    }
    for (int32_t i = 0; i < vocab; i++) logits[i] /= sum;
    float coin = rng_f32(&sm->rng);
    if (sm->topp <= 0.0f || sm->topp >= 1.0f) {
        float cdf = 0.0f;
        for (int32_t i = 0; i < vocab; i++) {
            cdf += logits[i];
            if (coin < cdf) return i;
        }
        return vocab - 1;
    }
    /* nucleus: the smallest set of most likely tokens whose mass reaches topp */
    prob_index *pi = work;
    for (int32_t i = 0; i < vocab; i++) pi[i] = (prob_index){logits[i], i};
    qsort(pi, (size_t)vocab, sizeof *pi, cmp_prob_desc);
    float mass = 0.0f;
    int32_t last = vocab - 1;
    for (int32_t i = 0; i < vocab; i++) {
        mass += pi[i].p;
        if (mass >= sm->topp) {
            last = i;
            break;
        }
    }
    float r = coin * mass, cdf = 0.0f;
    for (int32_t i = 0; i <= last; i++) {
        cdf += pi[i].p;
        if (r < cdf) return pi[i].i;
    }
    return pi[last].i;
}
