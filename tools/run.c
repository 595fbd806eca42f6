/* run.c: `pkv run`: generates text with a llama2.c checkpoint, many sequences decoded together
 * in one batch per step, their K/V in the paged cache (prefix reuse, forks, paged attention). */
#include "model.h"
#include "tool.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static void usage(FILE *f) {
    fprintf(f,
            "usage: pkv run MODEL [options]\n"
            "\n"
            "Generates with a llama2.c (v0 format) checkpoint; attention and K/V go through the paged\n"
            "cache. Without -z, prints each sequence's generated token ids on one line (space separated)\n"
            "and nothing else on stdout; statistics go to stderr.\n"
            "\n"
            "options (defaults in brackets):\n"
            "  -t TEMP            temperature; 0 = greedy [1.0]\n"
            "  -p TOPP            nucleus sampling mass in (0,1); 0 or 1 = off [0.9]\n"
            "  -s SEED            random seed; sequence i samples with SEED + i [time]\n"
            "  -n STEPS           positions per sequence, prompt included, as llama2.c; 0 = model\n"
            "                     seq_len [256]\n"
            "  -z TOKENIZER       llama2.c tokenizer.bin: print text instead of token ids\n"
            "  --prompt-ids IDS   a prompt as comma-separated token ids, e.g. 1,403,407; several\n"
            "                     prompts separated by ';' (quote it) or given by repeating the flag.\n"
            "                     Ids are used as given (put BOS=1 first yourself). [one prompt: 1]\n"
            "  --batch N          sequences decoded together [number of prompts]; with N > prompts,\n"
            "                     sequence i >= prompts is forked from prompt i %% prompts after its\n"
            "                     prefill and samples with its own seed\n"
            "  --block-tokens B   cache block size in tokens, 1 to 1024 [16]\n"
            "  --blocks N         pool size in blocks [enough for every sequence at full length]\n"
            "  --threads N        attention threads, at most 256; 0 = all cpus [0]\n"
            "  --spin-us US       how long they poll for the next attention call before they\n"
            "                     sleep (pkv_config.spin_us), at most 1000000 [50]; set it past\n"
            "                     the time between two layers' calls where the cores idle then\n"
            "  --no-prefix-cache  disable prefix caching (prompts sharing a prefix recompute it)\n"
            "  --tier-dir DIR     keep prompt prefixes in a file tier in DIR (made if missing; 1 GiB):\n"
            "                     each prompt loads what the tier holds after its prefix match\n"
            "                     (pkv_tier_load) and saves its full blocks after its prefill\n"
            "                     (pkv_tier_save), so a later run with the same DIR and prompt\n"
            "                     computes only the rest\n"
            "  --spec-tree W      greedy only (-t 0): speculative decoding with draft trees, verified\n"
            "                     in one forward pass each (pkv_attn_tree) and the accepted path kept\n"
            "                     (pkv_seq_keep): the drafts are up to W continuations of earlier\n"
            "                     places in the text that end like it (prompt lookup, 2 tokens, else\n"
            "                     1), merged into a tree; 1 to 16. The token ids are those of the run\n"
            "                     without it up to float rounding (the tree's attention sums in\n"
            "                     another order: a near-tie may go the other way); stderr says how\n"
            "                     many positions each pass kept\n"
            "  --spec-depth D     draft tokens per continuation, 1 to 32 [5]\n"
            "  --ctx N            context shift (llama.cpp's; pkv_seq_shift): a sequence whose cache\n"
            "                     holds N positions, before its next token, keeps the first --keep,\n"
            "                     removes half of the rest, and moves the others down with their K\n"
            "                     turned back by RoPE; -n may then exceed the model's seq_len. N in\n"
            "                     [--keep + 2, seq_len]; not with --spec-tree. stderr says how many\n"
            "                     shifts were made\n"
            "  --keep K           positions a context shift keeps at the start (attention sinks) [4]\n"
            "  -h, --help         this help\n"
            "\n"
            "Prompts are prefilled one after the other, each first matching the prefix cache, so\n"
            "prompts sharing a prefix reuse its blocks. A sequence stops at BOS (1) or at STEPS.\n"
            "Exit status: 0 ok, 1 usage error, 2 runtime error (bad model file, cache error).\n");
}

typedef struct prompt_list {
    int32_t **ids;
    uint32_t *len;
    uint32_t n;
} prompt_list;

static int parse_prompts(prompt_list *pl, const char *arg) {
    const char *p = arg;
    for (;;) {
        size_t seg = strcspn(p, ";");
        int32_t *ids = malloc((seg / 2 + 2) * sizeof *ids);
        uint32_t n = 0;
        if (!ids) return -1;
        const char *q = p, *end = p + seg;
        while (q < end) {
            while (q < end && (*q == ' ' || *q == ',')) q++;
            if (q >= end) break;
            char *e;
            errno = 0;
            long v = strtol(q, &e, 10);
            if (e == q || errno || v < 0 || v > INT32_MAX || (e < end && *e != ',' && *e != ' ')) {
                fprintf(stderr, "pkv run: --prompt-ids: bad token id near '%.*s'\n", (int)(end - q), q);
                free(ids);
                return -1;
            }
            ids[n++] = (int32_t)v;
            q = e;
        }
        if (n == 0) {
            fprintf(stderr, "pkv run: --prompt-ids: empty prompt in '%s'\n", arg);
            free(ids);
            return -1;
        }
        pl->ids = realloc(pl->ids, (pl->n + 1) * sizeof *pl->ids);
        pl->len = realloc(pl->len, (pl->n + 1) * sizeof *pl->len);
        if (!pl->ids || !pl->len) return -1;
        pl->ids[pl->n] = ids;
        pl->len[pl->n++] = n;
        if (!p[seg]) break;
        p += seg + 1;
        if (!*p) break; /* trailing ';' */
    }
    return 0;
}

/* Speculative decoding with draft trees (--spec-tree): the tree's scratch and counters. */
typedef struct spec_ctx {
    uint32_t width, depth;
    int32_t *tok, *par; /* [1 + width * depth] a tree */
    uint32_t *path;     /* [1 + depth] the accepted nodes */
    float *logits;      /* [1 + width * depth][vocab] */
    uint64_t passes, nodes, kept;
} spec_ctx;

/* The child of node `at` carrying token t, or -1. */
static int32_t tree_child(const spec_ctx *sp, uint32_t n, int32_t at, int32_t t) {
    for (uint32_t j = (uint32_t)at + 1; j < n; j++)
        if (sp->par[j] == at && sp->tok[j] == t) return (int32_t)j;
    return -1;
}

/* The draft tree after root token t0, the last of h[0, nh): up to width continuations of at
 * most dmax tokens that follow earlier places ending in the same two tokens (then in the same
 * one), most recent first, merged by their common prefixes. Returns the node count. */
static uint32_t spec_tree(spec_ctx *sp, const int32_t *h, uint32_t nh, uint32_t dmax) {
    uint32_t n = 1, found = 0;
    sp->tok[0] = h[nh - 1], sp->par[0] = -1;
    for (int gram = 2; gram >= 1 && found < sp->width; gram--)
        for (uint32_t j = nh - 1; j-- > 0 && found < sp->width;) {
            if (h[j] != h[nh - 1] || (gram == 2 && (j == 0 || nh < 2 || h[j - 1] != h[nh - 2]))) continue;
            if (gram == 1 && j > 0 && nh >= 2 && h[j - 1] == h[nh - 2]) continue; /* taken as a 2-gram */
            int32_t at = 0;
            uint32_t added = 0;
            for (uint32_t k = 1; k <= dmax && j + k < nh; k++) {
                const int32_t t = h[j + k], ch = tree_child(sp, n, at, t);
                if (ch >= 0) {
                    at = ch;
                    continue;
                }
                sp->tok[n] = t, sp->par[n] = at;
                at = (int32_t)n++;
                added++;
            }
            found += added > 0;
        }
    return n;
}

/* Greedy decoding of one sequence with draft trees until it ends (BOS, or steps positions),
 * logits those of its last position: each pass samples the root (the token greedy decoding
 * takes next), verifies the tree in one forward pass, keeps the root and the drafts greedy
 * decoding would have taken after it, and commits them. The same tokens as without drafts, up
 * to float rounding (the tree's logits come from attention summed in another order). */
static int spec_decode(const model *m, model_scratch *s, pkv_cache *c, pkv_seq seq, const int32_t *prompt,
                       uint32_t plen, int32_t *gen, uint32_t *n_gen, uint32_t *len, uint32_t steps, float *logits,
                       int32_t *hist, spec_ctx *sp, model_pkv_step *tm) {
    const int32_t V = m->cfg.vocab_size;
    memcpy(hist, prompt, plen * sizeof *hist);
    uint32_t synced = 0; /* gen[0, synced) follows the prompt in hist */
    for (;;) {
        const int32_t t0 = model_argmax(logits, V);
        if (t0 != 1) gen[(*n_gen)++] = t0;
        if (t0 == 1 || *len + 1 > steps) return 0;
        const uint32_t nh = plen + *n_gen;
        memcpy(hist + plen + synced, gen + synced, (*n_gen - synced) * sizeof *hist);
        synced = *n_gen;
        /* drafts at depth k take position len + k: at most steps - 1 */
        const uint32_t dmax = sp->depth < steps - 1 - *len ? sp->depth : steps - 1 - *len;
        const uint32_t n = spec_tree(sp, hist, nh, dmax);
        int rc = model_pkv_tree_forward(m, s, c, seq, n, sp->tok, sp->par, sp->logits, tm);
        if (rc < 0) return rc;
        uint32_t np = 1, cur = *len + 1;
        int32_t at = 0;
        for (;;) { /* greedy decoding's next token: a child of the node it is at, or the next root */
            const int32_t t = model_argmax(sp->logits + (size_t)at * V, V);
            if (t == 1 || cur + 1 > steps) break;
            const int32_t ch = tree_child(sp, n, at, t);
            if (ch < 0) break;
            gen[(*n_gen)++] = t;
            sp->path[np++] = (uint32_t)ch;
            at = ch, cur++;
        }
        sp->path[0] = 0;
        if ((rc = pkv_seq_keep(c, seq, *len, sp->path, np)) < 0 || (rc = pkv_seq_commit(c, seq, *len + np)) < 0)
            return rc;
        *len += np;
        memcpy(logits, sp->logits + (size_t)at * V, (size_t)V * sizeof *logits);
        sp->passes++, sp->nodes += n, sp->kept += np;
    }
}

static int parse_f32(const char *s, float *out) {
    double v;
    if (tool_parse_f64(s, &v)) return -1;
    *out = (float)v;
    return 0;
}

int tool_run(int argc, char **argv) {
    const char *model_path = NULL, *tok_path = NULL;
    float temp = 1.0f, topp = 0.9f;
    uint64_t seed = 0;
    int have_seed = 0, prefix_cache = 1;
    const char *tier_dir = NULL;
    uint32_t steps = 256, batch = 0, block_tokens = 16, n_blocks = 0, n_threads = 0, ctx = 0, keep = 4, spin_us = 50;
    spec_ctx sp = {.depth = 5};
    prompt_list pl = {0};
    int status = TOOL_FAIL;

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *val = i + 1 < argc ? argv[i + 1] : NULL;
        int bad = 0;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            status = TOOL_OK;
            goto out;
        } else if (!strcmp(a, "--no-prefix-cache")) {
            prefix_cache = 0;
            continue;
        } else if (a[0] != '-') {
            if (model_path) {
                fprintf(stderr, "pkv run: unexpected argument '%s'\n", a);
                status = TOOL_USAGE;
                goto out;
            }
            model_path = a;
            continue;
        }
        /* a missing value is said after the name is known: a typo last is an unknown option */
        const int missing = !val;
        if (missing) val = "";
        i++;
        if (!strcmp(a, "-t")) bad = parse_f32(val, &temp) || temp < 0;
        else if (!strcmp(a, "-p")) bad = parse_f32(val, &topp) || topp < 0 || topp > 1;
        else if (!strcmp(a, "-s")) {
            bad = tool_parse_u64(val, &seed);
            have_seed = 1;
        } else if (!strcmp(a, "-n")) bad = tool_parse_u32(val, &steps);
        else if (!strcmp(a, "-z")) tok_path = val;
        else if (!strcmp(a, "--prompt-ids")) {
            if (!missing && parse_prompts(&pl, val)) {
                status = TOOL_USAGE;
                goto out;
            }
        } else if (!strcmp(a, "--batch")) bad = tool_parse_u32(val, &batch) || batch == 0;
        else if (!strcmp(a, "--block-tokens"))
            bad = tool_parse_u32(val, &block_tokens) || block_tokens == 0 || block_tokens > 1024; /* pkv.h */
        else if (!strcmp(a, "--blocks")) bad = tool_parse_u32(val, &n_blocks);
        else if (!strcmp(a, "--threads")) bad = tool_parse_u32(val, &n_threads) || n_threads > 256; /* pkv.h */
        else if (!strcmp(a, "--spin-us")) bad = tool_parse_u32(val, &spin_us) || spin_us > 1000000;
        else if (!strcmp(a, "--spec-tree")) bad = tool_parse_u32(val, &sp.width) || sp.width == 0 || sp.width > 16;
        else if (!strcmp(a, "--spec-depth")) bad = tool_parse_u32(val, &sp.depth) || sp.depth == 0 || sp.depth > 32;
        else if (!strcmp(a, "--ctx")) bad = tool_parse_u32(val, &ctx) || ctx == 0;
        else if (!strcmp(a, "--keep")) bad = tool_parse_u32(val, &keep);
        else if (!strcmp(a, "--tier-dir")) {
            tier_dir = val;
            bad = !*val;
        }
        else {
            fprintf(stderr, "pkv run: unknown option '%s' (see pkv run --help)\n", a);
            status = TOOL_USAGE;
            goto out;
        }
        if (missing) {
            fprintf(stderr, "pkv run: option %s needs a value (see pkv run --help)\n", a);
            status = TOOL_USAGE;
            goto out;
        }
        if (bad) {
            fprintf(stderr, "pkv run: bad value '%s' for %s\n", val, a);
            status = TOOL_USAGE;
            goto out;
        }
    }
    if (!model_path) {
        fprintf(stderr, "pkv run: no MODEL given\n\n");
        usage(stderr);
        status = TOOL_USAGE;
        goto out;
    }
    if (!have_seed) seed = (uint64_t)time(NULL);
    if (pl.n == 0) {
        static const char *bos = "1";
        if (parse_prompts(&pl, bos)) goto out;
    }
    if (sp.width && temp != 0.0f) {
        fprintf(stderr, "pkv run: --spec-tree verifies drafts against greedy decoding: it needs -t 0\n");
        status = TOOL_USAGE;
        goto out;
    }
    if (ctx && sp.width) {
        fprintf(stderr, "pkv run: --ctx (a context shift) does not go with --spec-tree\n");
        status = TOOL_USAGE;
        goto out;
    }
    if (batch == 0) batch = pl.n;
    if (batch < pl.n) {
        fprintf(stderr, "pkv run: --batch %u is smaller than the %u prompts given\n", batch, pl.n);
        status = TOOL_USAGE;
        goto out;
    }

    char err[512];
    model m;
    if (model_load(model_path, &m, err, sizeof err)) {
        fprintf(stderr, "pkv run: %s\n", err);
        goto out;
    }
    const model_config *p = &m.cfg;
    if (ctx && (ctx > (uint32_t)p->seq_len || ctx < keep + 2)) {
        fprintf(stderr, "pkv run: --ctx %u is not in [--keep + 2, the model's seq_len %d]\n", ctx, p->seq_len);
        status = TOOL_USAGE;
        model_free(&m);
        goto out;
    }
    if (steps == 0 || (!ctx && steps > (uint32_t)p->seq_len)) steps = (uint32_t)p->seq_len;
    if (ctx && steps > 1u << 24) steps = 1u << 24; /* (the generated ids are kept) */
    uint32_t max_prompt = 0;
    for (uint32_t i = 0; i < pl.n; i++) {
        for (uint32_t j = 0; j < pl.len[i]; j++)
            if (pl.ids[i][j] >= p->vocab_size) {
                fprintf(stderr, "pkv run: prompt %u: token id %d is outside the vocabulary (%d tokens)\n", i,
                        pl.ids[i][j], p->vocab_size);
                status = TOOL_USAGE;
                model_free(&m);
                goto out;
            }
        if (pl.len[i] > max_prompt) max_prompt = pl.len[i];
    }
    if (max_prompt > steps) {
        fprintf(stderr, "pkv run: a prompt has %u tokens, more than the %u steps (-n)\n", max_prompt, steps);
        status = TOOL_USAGE;
        model_free(&m);
        goto out;
    }
    model_tokenizer tok = {0};
    if (tok_path && model_tokenizer_load(tok_path, p->vocab_size, &tok, err, sizeof err)) {
        fprintf(stderr, "pkv run: %s\n", err);
        model_free(&m);
        goto out;
    }

    /* The pool: every sequence at full length, plus one block each for copy-on-write. */
    const uint32_t tree_max = sp.width ? 1 + sp.width * sp.depth : 0; /* a tree's nodes */
    uint64_t per_seq = ((ctx ? ctx : steps) + tree_max + block_tokens - 1) / block_tokens + 1;
    if (n_blocks == 0) n_blocks = (uint32_t)(per_seq * batch + 1);
    pkv_config cfg = model_pkv_config(&m, block_tokens, n_blocks);
    cfg.max_seqs = batch + 1;
    cfg.max_blocks_per_seq = (uint32_t)(per_seq < n_blocks ? per_seq : n_blocks); /* the default caps it at 4096 */
    cfg.n_threads = n_threads;
    cfg.spin_us = spin_us;
    cfg.enable_prefix_cache = prefix_cache;
    pkv_cache *c = NULL;
    pkv_tier *tier = NULL;
    model_scratch s = {0};
    pkv_seq *seqs = calloc(batch, sizeof *seqs);
    int32_t **gen = calloc(batch, sizeof *gen);
    uint32_t *n_gen = calloc(batch, sizeof *n_gen), *len = calloc(batch, sizeof *len), *n_new = calloc(batch, 4);
    int32_t *next = calloc(batch, sizeof *next), *feed = calloc(batch, sizeof *feed);
    uint32_t *live = calloc(batch, sizeof *live);
    model_sampler *smp = calloc(batch, sizeof *smp);
    float *logits = malloc((size_t)batch * (size_t)p->vocab_size * sizeof(float));
    void *work = malloc(model_sample_work_bytes(p->vocab_size));
    pkv_seq *bseqs = calloc(batch, sizeof *bseqs);
    int32_t *hist = NULL;
    if (sp.width) {
        sp.tok = malloc(tree_max * sizeof *sp.tok), sp.par = malloc(tree_max * sizeof *sp.par);
        sp.path = malloc((sp.depth + 1) * sizeof *sp.path);
        sp.logits = malloc((size_t)tree_max * (size_t)p->vocab_size * sizeof(float));
        hist = malloc(((size_t)steps + max_prompt + 1) * sizeof *hist);
    }
    int rc = 0;
    uint32_t scratch_tokens = max_prompt > batch ? max_prompt : batch;
    if (scratch_tokens < tree_max) scratch_tokens = tree_max;
    if (!seqs || !gen || !n_gen || !len || !n_new || !next || !feed || !live || !smp || !logits || !work || !bseqs ||
        (sp.width && (!sp.tok || !sp.par || !sp.path || !sp.logits || !hist)) ||
        model_scratch_init(&s, &m, scratch_tokens)) {
        fprintf(stderr, "pkv run: out of memory\n");
        goto cleanup;
    }
    for (uint32_t i = 0; i < batch; i++) {
        gen[i] = malloc(steps * sizeof **gen);
        if (!gen[i]) {
            fprintf(stderr, "pkv run: out of memory\n");
            goto cleanup;
        }
        model_sampler_init(&smp[i], temp, topp, seed + i);
    }
    tool_log_errors(&cfg, "pkv run");
    rc = pkv_cache_create(&cfg, &c);
    if (rc < 0) {
        fprintf(stderr, "pkv run: pkv_cache_create (%u blocks of %u tokens, %d layers, %d kv heads, head_dim %d): %s\n",
                n_blocks, block_tokens, p->n_layers, p->n_kv_heads, p->head_size, pkv_strerror(rc));
        goto cleanup;
    }

    if (tier_dir && (rc = pkv_tier_file_create(tier_dir, (uint64_t)1 << 30, NULL, &tier)) < 0) {
        fprintf(stderr, "pkv run: the tier in %s: %s\n", tier_dir, pkv_strerror(rc));
        goto cleanup;
    }
    model_pkv_step tm = {0};
    uint64_t t_start = tool_now_ns();
    uint64_t reused_total = 0, prompt_total = 0, loaded_total = 0, saved_total = 0;
    /* Prefill: prompt by prompt, reusing what earlier prompts committed. */
    for (uint32_t i = 0; i < pl.n; i++) {
        uint32_t reused = 0;
        const char *what = "pkv_seq_create";
        uint64_t t0 = tool_now_ns();
        rc = pkv_seq_create(c, NULL, 0, &seqs[i]);
        if (rc >= 0) {
            what = "pkv_seq_match_prefix";
            rc = pkv_seq_match_prefix(c, seqs[i], pl.ids[i], pl.len[i], &reused);
        }
        uint32_t loaded = 0, saved = 0;
        if (rc >= 0 && tier) {
            what = "pkv_tier_load";
            rc = pkv_tier_load(tier, c, seqs[i], pl.ids[i], pl.len[i], &loaded);
        }
        tm.ns_pkv += tool_now_ns() - t0;
        if (rc >= 0) {
            what = "prefill";
            uint32_t n = pl.len[i] - reused - loaded;
            rc = model_pkv_forward(&m, &s, c, &seqs[i], 1, &n, pl.ids[i] + reused + loaded,
                                   logits + (size_t)i * p->vocab_size, &tm);
        }
        if (rc >= 0 && tier) {
            what = "pkv_tier_save";
            t0 = tool_now_ns();
            rc = pkv_tier_save(tier, c, seqs[i], &saved);
            tm.ns_pkv += tool_now_ns() - t0;
        }
        loaded_total += loaded, saved_total += saved;
        if (rc < 0) {
            fprintf(stderr, "pkv run: %s of prompt %u failed: %s%s\n", what, i, pkv_strerror(rc),
                    rc == PKV_ENOTSUP ? " (this build has no attention kernels for this configuration)" : "");
            goto cleanup;
        }
        len[i] = pl.len[i];
        reused_total += reused;
        prompt_total += pl.len[i];
    }
    for (uint32_t i = pl.n; i < batch; i++) {
        uint32_t src = i % pl.n;
        rc = pkv_seq_fork(c, seqs[src], &seqs[i]);
        if (rc < 0) {
            fprintf(stderr, "pkv run: pkv_seq_fork: %s\n", pkv_strerror(rc));
            goto cleanup;
        }
        len[i] = len[src];
        memcpy(logits + (size_t)i * p->vocab_size, logits + (size_t)src * p->vocab_size, (size_t)p->vocab_size * sizeof(float));
    }
    uint64_t t_decode = tool_now_ns();
    uint64_t n_decoded = 0, n_steps = 0, n_shifts = 0, n_shifted = 0;
    uint32_t n_live = batch;
    for (uint32_t i = 0; i < batch; i++) live[i] = 1;
    for (uint32_t i = 0; sp.width && i < batch; i++) { /* one sequence after the other */
        rc = spec_decode(&m, &s, c, seqs[i], pl.ids[i % pl.n], pl.len[i % pl.n], gen[i], &n_gen[i], &len[i], steps,
                         logits + (size_t)i * p->vocab_size, hist, &sp, &tm);
        if (rc < 0) {
            fprintf(stderr, "pkv run: speculative decoding of sequence %u failed: %s\n", i, pkv_strerror(rc));
            goto cleanup;
        }
        live[i] = 0, n_live--;
    }
    n_decoded += sp.kept, n_steps += sp.passes;
    while (n_live) {
        uint32_t nb = 0;
        for (uint32_t i = 0; i < batch; i++) {
            if (!live[i]) continue;
            int32_t t = model_sample(&smp[i], logits + (size_t)i * p->vocab_size, p->vocab_size, work);
            /* llama2.c: BOS ends a sequence (and is not printed); the token that fills position
             * `steps` is printed but not fed */
            if (t != 1) gen[i][n_gen[i]++] = t;
            if (t == 1 || len[i] + 1 > steps) {
                live[i] = 0;
                n_live--;
                continue;
            }
            if (ctx) { /* full: the context shift before the token goes in */
                pkv_seq_info si;
                rc = pkv_seq_get_info(c, seqs[i], &si);
                if (rc >= 0 && si.n_tokens >= ctx) {
                    const uint32_t discard = (si.n_tokens - keep) / 2;
                    const pkv_rope rope = {.dim0 = 0, .n_rot = (uint32_t)p->head_size, .style = PKV_ROPE_GPTJ,
                                           .theta = 10000.0f, .inv_freq = NULL}; /* llama2.c's (model.c) */
                    const uint64_t t0 = tool_now_ns();
                    rc = pkv_seq_shift(c, seqs[i], keep, keep + discard, &rope);
                    tm.ns_pkv += tool_now_ns() - t0;
                    n_shifts++, n_shifted += discard;
                }
                if (rc < 0) {
                    fprintf(stderr, "pkv run: context shift of sequence %u failed: %s\n", i, pkv_strerror(rc));
                    goto cleanup;
                }
            }
            bseqs[nb] = seqs[i];
            feed[nb] = t;
            next[nb] = (int32_t)i;
            n_new[nb] = 1;
            nb++;
        }
        if (!nb) break;
        rc = model_pkv_forward(&m, &s, c, bseqs, nb, n_new, feed, logits + 0, &tm);
        if (rc < 0) {
            fprintf(stderr, "pkv run: decode step %llu (%u sequences) failed: %s%s\n", (unsigned long long)n_steps, nb,
                    pkv_strerror(rc),
                    rc == PKV_ENOSPC    ? " (pool too small: raise --blocks)"
                    : rc == PKV_ELIMIT  ? " (a sequence's block table is full: it holds at most --blocks blocks;"
                                          " raise --blocks)"
                    : rc == PKV_ENOTSUP ? " (this build has no attention kernels for this configuration)"
                                        : "");
            goto cleanup;
        }
        /* logits come back in batch order: move them to their sequences' rows (descending
         * batch index is always >= its row, so a backwards pass never overwrites unread rows) */
        for (uint32_t j = nb; j-- > 0;) {
            uint32_t i = (uint32_t)next[j];
            if (i != j) memcpy(logits + (size_t)i * p->vocab_size, logits + (size_t)j * p->vocab_size, (size_t)p->vocab_size * sizeof(float));
            len[i]++;
        }
        n_decoded += nb;
        n_steps++;
    }
    uint64_t t_end = tool_now_ns();

    pkv_stats st;
    char msg[256];
    if (pkv_cache_get_stats(c, &st) < 0 || pkv_cache_check(c, msg, sizeof msg) < 0) {
        fprintf(stderr, "pkv run: cache check failed: %s\n", msg);
        goto cleanup;
    }
    /* output */
    for (uint32_t i = 0; i < batch; i++) {
        if (!tok_path) {
            for (uint32_t j = 0; j < n_gen[i]; j++) printf(j ? " %d" : "%d", gen[i][j]);
            printf("\n");
        } else {
            static char buf[65536 + 1]; /* a piece is at most max_token_length (<= 65536) bytes */
            if (batch > 1) printf("--- sequence %u ---\n", i);
            const int32_t *pr = pl.ids[i % pl.n];
            uint32_t plen = pl.len[i % pl.n];
            int32_t prev = -1;
            for (uint32_t j = 0; j < plen; j++) {
                if (pr[j] != 1) fputs(model_tokenizer_decode(&tok, prev, pr[j], buf, sizeof buf), stdout);
                prev = pr[j];
            }
            for (uint32_t j = 0; j < n_gen[i]; j++) {
                if (gen[i][j] != 1) fputs(model_tokenizer_decode(&tok, prev, gen[i][j], buf, sizeof buf), stdout);
                prev = gen[i][j];
            }
            printf("\n");
        }
    }
    fflush(stdout);
    double s_total = (double)(t_end - t_start) * 1e-9, s_dec = (double)(t_end - t_decode) * 1e-9;
    uint64_t n_out = 0;
    for (uint32_t i = 0; i < batch; i++) n_out += n_gen[i];
    fprintf(stderr,
            "pkv run: %u sequences, %llu tokens generated in %.3f s (%.1f tok/s); decode %llu steps, %.1f tok/s\n"
            "pkv run: prefill %llu prompt tokens, %llu reused from the prefix cache; %.3f s in pkv calls "
            "(%.3f s attention, backend %s)\n"
            "pkv run: peak %u of %u blocks active, %llu copy-on-write copies, %llu positions decode read once a "
            "group of sequences sharing them, checker ok\n",
            batch, (unsigned long long)n_out, s_total, s_total > 0 ? (double)n_out / s_total : 0.0,
            (unsigned long long)n_steps, s_dec > 0 ? (double)n_decoded / s_dec : 0.0,
            (unsigned long long)prompt_total, (unsigned long long)reused_total, (double)tm.ns_pkv * 1e-9,
            (double)tm.ns_attn * 1e-9, pkv_attn_backend(c), st.peak_active, st.n_blocks,
            (unsigned long long)st.cow_copies, (unsigned long long)st.attn_shared_keys);
    if (sp.width)
        fprintf(stderr,
                "pkv run: speculative: %llu passes over %llu draft-tree nodes kept %llu positions (%.2f a pass,"
                " %.1f nodes a tree)\n",
                (unsigned long long)sp.passes, (unsigned long long)sp.nodes, (unsigned long long)sp.kept,
                sp.passes ? (double)sp.kept / (double)sp.passes : 0.0,
                sp.passes ? (double)sp.nodes / (double)sp.passes : 0.0);
    if (ctx)
        fprintf(stderr, "pkv run: context shifts: %llu (at %u positions, %llu positions removed after the first %u)\n",
                (unsigned long long)n_shifts, ctx, (unsigned long long)n_shifted, keep);
    if (tier)
        fprintf(stderr, "pkv run: tier %s: %llu prompt positions loaded from it, %llu blocks saved to it\n", tier_dir,
                (unsigned long long)loaded_total, (unsigned long long)saved_total);
    status = TOOL_OK;

cleanup:
    pkv_tier_destroy(tier);
    pkv_cache_destroy(c);
    model_scratch_free(&s);
    if (gen)
        for (uint32_t i = 0; i < batch; i++) free(gen[i]);
    free(seqs), free(gen), free(n_gen), free(len), free(n_new), free(next), free(feed), free(live), free(smp);
    free(sp.tok), free(sp.par), free(sp.path), free(sp.logits), free(hist);
    free(logits), free(work), free(bseqs);
    model_tokenizer_free(&tok);
    model_free(&m);
out:
    for (uint32_t i = 0; i < pl.n; i++) free(pl.ids[i]);
    free(pl.ids), free(pl.len);
    return status;
}
