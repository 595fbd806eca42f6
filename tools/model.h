/* model.h: a llama2.c-format transformer (checkpoint loader, tokenizer, forward pass) whose
 * attention is delegated to a callback, with the paged-cache backend over pkv.h. */
#ifndef PKV_MODEL_H
#define PKV_MODEL_H

#include "pkv.h"

#include <stddef.h>
#include <stdint.h>

/* Hyper-parameters as stored in the 7-int32 v0 header (llama2.c Config). */
typedef struct model_config {
    int32_t dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len;
    int32_t head_size;         /* dim / n_heads */
    int32_t kv_dim;            /* n_kv_heads * head_size */
    int shared_classifier;     /* vocab_size > 0 in the file: wcls is the token embedding */
} model_config;

typedef struct model {
    model_config cfg;
    float *data;      /* every weight, one buffer of n_floats (file order) */
    size_t n_floats;
    /* views into data, shapes as in llama2.c: */
    const float *tok_emb;   /* [vocab][dim] */
    const float *rms_att;   /* [L][dim] */
    const float *wq;        /* [L][dim][dim]      (out x in) */
    const float *wk;        /* [L][kv_dim][dim] */
    const float *wv;        /* [L][kv_dim][dim] */
    const float *wo;        /* [L][dim][dim] */
    const float *rms_ffn;   /* [L][dim] */
    const float *w1;        /* [L][hidden][dim] */
    const float *w2;        /* [L][dim][hidden] */
    const float *w3;        /* [L][hidden][dim] */
    const float *rms_final; /* [dim] */
    const float *wcls;      /* [vocab][dim] */
} model;

/* Loads a llama2.c v0 checkpoint. Every header value and the file size are validated before
 * anything is read into the weights; on failure returns -1 with a one-line reason in err
 * (the caller prints it and exits 2), and m is left empty. */
int model_load(const char *path, model *m, char *err, size_t err_cap);
void model_free(model *m);

/* Scratch activations for a forward pass over at most max_tokens tokens at once. */
typedef struct model_scratch {
    uint32_t max_tokens;
    float *x, *xb, *xb2;  /* [T][dim] */
    float *q, *att;       /* [T][dim] */
    float *k, *v;         /* [T][kv_dim] */
    float *hb, *hb2;      /* [T][hidden] */
} model_scratch;
int model_scratch_init(model_scratch *s, const model *m, uint32_t max_tokens); /* -1 on ENOMEM */
void model_scratch_free(model_scratch *s);

/* Attention of one layer for the T tokens of a forward pass: q [T][dim] (after RoPE),
 * k and v [T][kv_dim] (k after RoPE) of these tokens; writes out [T][dim]. The callback owns
 * the K/V storage (stores k, v, then attends causally). Returns 0 or a negative status that
 * aborts the forward pass and is returned from it. */
typedef int (*model_attn_fn)(void *ctx, uint32_t layer, const float *q, const float *k, const float *v,
                             float *out);

/* Runs T tokens (tokens[i] at position pos[i]) through the model; for each of the n_out rows
 * out_rows[j] writes the logits to logits[j][vocab]. Returns 0, -1 for a token out of range /
 * T > max_tokens, or the attention callback's status. */
int model_forward(const model *m, model_scratch *s, uint32_t T, const int32_t *tokens, const uint32_t *pos,
                  uint32_t n_out, const uint32_t *out_rows, float *logits, model_attn_fn attn, void *ctx);

/* ---- paged backend: K/V in a pkv cache, attention by pkv_attn_decode / pkv_attn_prefill ---- */

/* The pkv configuration matching the model: n_layers, n_kv_heads, head_dim, f32 K and V. */
pkv_config model_pkv_config(const model *m, uint32_t block_tokens, uint32_t n_blocks);

/* One batched step: sequence i of seqs gets n_new[i] >= 1 new tokens (tokens concatenated in
 * sequence order), appended at its current length; the K/V of every layer is written at the
 * slots pkv_seq_append returns, attention runs through the paged cache (decode for sequences
 * with one new token, one ragged prefill call for the rest), the new positions are committed,
 * and logits[i][vocab] receives the logits of sequence i's last new token. Returns 0 or a
 * negative PKV_E* status (PKV_ENOTSUP when the build has no attention kernels; -100 - k for a
 * scratch too small); on failure the appended positions are truncated away again. */
typedef struct model_pkv_step {
    uint64_t ns_pkv;      /* time spent inside pkv calls (append, write, attention, commit) */
    uint64_t ns_attn;     /* of which attention kernels */
} model_pkv_step;
int model_pkv_forward(const model *m, model_scratch *s, pkv_cache *c, const pkv_seq *seqs, uint32_t n_seqs,
                      const uint32_t *n_new, const int32_t *tokens, float *logits, model_pkv_step *timing);

/* Speculative decoding's verification step: n draft nodes (tokens[i], parent[i] in [-1, i), -1
 * for a root, which follows the sequence's last position) appended to seq, each run at its place
 * in the text (the length plus its depth), attention by pkv_attn_tree, logits[i][vocab] for
 * every node. Nothing is committed: the caller keeps the accepted path (pkv_seq_keep) and
 * commits it. Returns 0 or a negative PKV_E* status, with the nodes truncated away again. */
int model_pkv_tree_forward(const model *m, model_scratch *s, pkv_cache *c, pkv_seq seq, uint32_t n,
                           const int32_t *tokens, const int32_t *parent, float *logits, model_pkv_step *timing);

/* ---- llama2.c tokenizer.bin (decoding only) ---- */
typedef struct model_tokenizer {
    int32_t vocab_size;
    int32_t max_token_length;
    char **pieces; /* NUL-terminated */
    float *scores;
} model_tokenizer;
/* -1 with a reason in err on a missing / truncated / inconsistent file. */
int model_tokenizer_load(const char *path, int32_t vocab_size, model_tokenizer *t, char *err, size_t err_cap);
void model_tokenizer_free(model_tokenizer *t);
/* The text of `token` following `prev` (llama2.c conventions: the leading space after BOS is
 * dropped, "<0xXX>" pieces are raw bytes). buf receives at most cap-1 bytes. */
const char *model_tokenizer_decode(const model_tokenizer *t, int32_t prev, int32_t token, char *buf, size_t cap);

/* ---- sampling ---- */
typedef struct model_sampler {
    float temperature; /* 0 = greedy */
    float topp;        /* (0, 1): nucleus sampling; otherwise the full distribution */
    uint64_t rng;      /* xorshift64* state, nonzero */
} model_sampler;
void model_sampler_init(model_sampler *sm, float temperature, float topp, uint64_t seed);
/* Greedy: the index of the largest logit, the lowest one on a tie. */
int32_t model_argmax(const float *logits, int32_t vocab);
/* Samples a token from logits[vocab] (modified in place); work holds [vocab] floats + ints. */
int32_t model_sample(model_sampler *sm, float *logits, int32_t vocab, void *work);
size_t model_sample_work_bytes(int32_t vocab);

#endif
