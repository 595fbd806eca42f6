/* sim_workload.c: `pkv sim` requests: the built-in seeded chat-like workload (Poisson arrivals,
 * log-normal lengths, shared system prompts, parallel samples) and the JSON-lines trace reader. */
#include "sim.h"
#include "tool.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define SIM_VOCAB 32000u

static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Token ids are a hash of where they are: a group prefix is the same for every request of the
 * group, everything else is private to its request (and, past the prompt, to its sample). Ids
 * are in [2, 32000): never BOS. Nothing per token is stored, so 100k requests cost no memory. */
static int32_t hash_token(uint64_t a, uint64_t b, uint64_t c) {
    uint64_t h = mix64(a * 0x9E3779B97F4A7C15ull ^ mix64(b + 0x632BE59BD9B4E019ull) ^ mix64(c * 0xD6E8FEB86659FD93ull));
    return (int32_t)(2 + h % (SIM_VOCAB - 2));
}

void sim_tokens(const sim_request *r, uint32_t sample, uint32_t start, uint32_t n, int32_t *out) {
    for (uint32_t i = 0; i < n; i++) {
        uint32_t p = start + i;
        if (p >= r->prompt_len) out[i] = hash_token(3, ((uint64_t)r->id << 20) | sample, p);
        else if (r->tokens) out[i] = r->tokens[p];
        else if (r->group >= 0 && p < r->group_len) out[i] = hash_token(1, (uint64_t)r->group, p);
        else out[i] = hash_token(2, r->id, p);
    }
}

static uint32_t lognormal(tool_rng *rng, double mean, double sigma) {
    double mu = log(mean) - 0.5 * sigma * sigma;
    double v = exp(mu + sigma * tool_rng_normal(rng));
    if (v < 1.0) v = 1.0;
    if (v > 1e9) v = 1e9;
    return (uint32_t)llround(v);
}

/* Clamps a request's lengths to max_len; SIM_WORKLOAD_FAR where its arrival is past 2^53 steps
 * (no exact step count, nor a replay that gets there). */
static int finish_request(sim_request *r, const sim_workload_opts *o) {
    const double step = r->arrival_s / o->step_s;
    if (!(step < 0x1p53)) return SIM_WORKLOAD_FAR;
    r->arrival_step = (uint64_t)step;
    if (r->prompt_len > o->max_len - 1) r->prompt_len = o->max_len - 1;
    if (r->group_len > r->prompt_len) r->group_len = r->prompt_len;
    if (r->output_len < 1) r->output_len = 1;
    if (r->output_len > o->max_len - r->prompt_len) r->output_len = o->max_len - r->prompt_len;
    if (r->n_samples < 1) r->n_samples = 1;
    return 0;
}

static int cmp_arrival(const void *a, const void *b);

/* Multi-turn conversations (--turns): each of the w->n first requests is followed, turn_gap_s
 * apart, by turns - 1 requests whose prompt is the one before's prompt and its first sample's
 * output (sim_tokens' ids, so a prefix cache holds them), then new tokens of their own; a
 * conversation ends early where that would not fit max_len. Prompts are stored (token_store);
 * ids stay unique (a later turn's output ids hash its own), and the requests are put in arrival
 * order. */
static int add_turns(const sim_workload_opts *o, sim_workload *w, tool_rng *rng) {
    const uint32_t n0 = w->n;
    if ((uint64_t)n0 * o->turns > UINT32_MAX) return -1;
    sim_request *reqs = realloc(w->reqs, (size_t)n0 * o->turns * sizeof *reqs);
    if (!reqs) return -1;
    w->reqs = reqs;
    /* lengths first (prev: the turn before, at index i + (k - 1) * n0 until the conversation ends) */
    uint32_t n = n0;
    size_t store = 0;
    uint32_t *prev_of = calloc((size_t)n0 * o->turns, sizeof *prev_of);
    if (!prev_of) return -1;
    for (uint32_t i = 0; i < n0; i++) {
        uint32_t prev = i;
        store += reqs[i].prompt_len;
        for (uint32_t k = 1; k < o->turns; k++) {
            const sim_request *p = &reqs[prev];
            const uint32_t own = lognormal(rng, o->turn_mean, o->prompt_sigma);
            const uint64_t len = (uint64_t)p->prompt_len + p->output_len + own;
            const uint32_t out = lognormal(rng, o->output_mean, o->output_sigma);
            if (p->n_samples != 1 || len > o->max_len - 1) break;
            sim_request *r = &reqs[n];
            *r = (sim_request){.arrival_s = p->arrival_s + o->turn_gap_s, .prompt_len = (uint32_t)len,
                               .output_len = out, .n_samples = 1, .group = p->group, .group_len = p->group_len,
                               .id = n};
            if (finish_request(r, o)) {
                free(prev_of);
                return SIM_WORKLOAD_FAR;
            }
            prev_of[n] = prev;
            store += r->prompt_len;
            prev = n++;
        }
    }
    w->token_store = malloc((store ? store : 1) * sizeof *w->token_store);
    if (!w->token_store) {
        free(prev_of);
        return -1;
    }
    /* then the prompts, every turn after the one before it (n0 .. n are in that order) */
    size_t at = 0;
    for (uint32_t i = 0; i < n; i++) {
        sim_request *r = &reqs[i];
        int32_t *t = w->token_store + at;
        if (i < n0) {
            sim_tokens(r, 0, 0, r->prompt_len, t);
        } else {
            const sim_request *p = &reqs[prev_of[i]];
            const uint32_t kept = p->prompt_len + p->output_len;
            sim_tokens(p, 0, 0, kept, t);
            for (uint32_t q = kept; q < r->prompt_len; q++) t[q] = hash_token(2, r->id, q);
        }
        r->tokens = t;
        at += r->prompt_len;
    }
    free(prev_of);
    w->n = n;
    qsort(reqs, n, sizeof *reqs, cmp_arrival); /* (the prompts stay where they are: ids unchanged) */
    return 0;
}

int sim_workload_generate(const sim_workload_opts *o, sim_workload *w) {
    memset(w, 0, sizeof *w);
    w->reqs = calloc(o->n_requests ? o->n_requests : 1, sizeof *w->reqs);
    if (!w->reqs) return -1;
    tool_rng rng;
    tool_rng_seed(&rng, o->seed);
    double t = 0.0;
    for (uint32_t i = 0; i < o->n_requests; i++) {
        sim_request *r = &w->reqs[i];
        t += -log(1.0 - tool_rng_unit(&rng)) / o->rate; /* Poisson process: exponential gaps */
        r->arrival_s = t;
        r->id = i;
        r->group = -1;
        uint32_t own = lognormal(&rng, o->prompt_mean, o->prompt_sigma);
        r->output_len = lognormal(&rng, o->output_mean, o->output_sigma);
        double u_sys = tool_rng_unit(&rng), u_n = tool_rng_unit(&rng);
        uint32_t g = (uint32_t)(tool_rng_u64(&rng) % (o->n_sys ? o->n_sys : 1));
        if (o->n_sys && o->sys_len && u_sys < o->sys_frac) {
            r->group = (int32_t)g;
            r->group_len = o->sys_len;
        }
        const uint64_t len = (uint64_t)r->group_len + own; /* finish_request clamps it to max_len */
        r->prompt_len = len > UINT32_MAX ? UINT32_MAX : (uint32_t)len;
        r->n_samples = (o->n_samples > 1 && u_n < o->n_frac) ? o->n_samples : 1;
        if (finish_request(r, o)) {
            free(w->reqs);
            memset(w, 0, sizeof *w);
            return SIM_WORKLOAD_FAR;
        }
    }
    w->n = o->n_requests;
    if (o->turns > 1) {
        const int rc = add_turns(o, w, &rng);
        if (rc) sim_workload_free(w);
        return rc;
    }
    return 0;
}

void sim_workload_free(sim_workload *w) {
    if (!w) return;
    free(w->reqs);
    free(w->token_store);
    memset(w, 0, sizeof *w);
}

/* ---- JSON lines ------------------------------------------------------------------------
 * One object per line:
 *   {"arrival": 0.25, "prompt": [1, 2, 3], "max_tokens": 128}
 *   {"arrival": 0.5, "prompt_len": 300, "prefix_group": 2, "prefix_len": 200, "max_tokens": 64, "n": 2}
 * arrival (seconds, >= 0) and max_tokens (>= 1) are required; then either "prompt" (token ids)
 * or "prompt_len" (>= 1) with an optional "prefix_group" (>= 0) whose first "prefix_len"
 * tokens (default --sys-len, cut to the prompt's length: a prompt shorter than --sys-len is all
 * shared prefix; a "prefix_len" over "prompt_len" is an error) are shared by every request of
 * the group. "n": samples (>= 1).
 * Other keys are ignored; blank lines are skipped. Requests are replayed in arrival order. */

typedef struct jparse {
    const char *p;
    const char *err;
} jparse;

static void ws(jparse *j) {
    while (*j->p == ' ' || *j->p == '\t' || *j->p == '\r' || *j->p == '\n') j->p++;
}

/* After a member or an element: ',' (returns 1: another follows) or close (returns 0: the object
 * or array ends); anything else sets err and returns -1. */
static int jnext(jparse *j, char close, const char *err) {
    ws(j);
    if (*j->p == ',') {
        j->p++;
        return 1;
    }
    if (*j->p == close) {
        j->p++;
        return 0;
    }
    j->err = err;
    return -1;
}

static int jstring(jparse *j, char *out, size_t cap) {
    ws(j);
    if (*j->p != '"') {
        j->err = "expected a string (an object key in double quotes)";
        return -1;
    }
    j->p++;
    size_t n = 0;
    while (*j->p && *j->p != '"') {
        char ch = *j->p++;
        if (ch == '\\') {
            if (!*j->p) break;
            ch = *j->p++;
            if (ch == 'u') { /* keep it simple: \uXXXX is skipped, never a key we know */
                for (int k = 0; k < 4 && isxdigit((unsigned char)*j->p); k++) j->p++;
                ch = '?';
            }
        }
        if (out && n + 1 < cap) out[n++] = ch;
    }
    if (*j->p != '"') {
        j->err = "unterminated string";
        return -1;
    }
    j->p++;
    if (out) out[n < cap ? n : cap - 1] = 0;
    return 0;
}

static int jnumber(jparse *j, double *out) {
    ws(j);
    char *e;
    errno = 0;
    double v = strtod(j->p, &e);
    if (e == j->p || errno || !isfinite(v) || (*j->p != '-' && !isdigit((unsigned char)*j->p))) {
        j->err = "expected a number";
        return -1;
    }
    j->p = e;
    *out = v;
    return 0;
}

static int jskip(jparse *j, int depth) {
    ws(j);
    if (depth > 64) {
        j->err = "nesting too deep";
        return -1;
    }
    char ch = *j->p;
    if (ch == '"') return jstring(j, NULL, 0);
    if (ch == '{' || ch == '[') {
        char close = ch == '{' ? '}' : ']';
        j->p++;
        ws(j);
        if (*j->p == close) {
            j->p++;
            return 0;
        }
        for (;;) {
            if (ch == '{') {
                if (jstring(j, NULL, 0)) return -1;
                ws(j);
                if (*j->p != ':') {
                    j->err = "expected ':'";
                    return -1;
                }
                j->p++;
            }
            if (jskip(j, depth + 1)) return -1;
            const int more = jnext(j, close, ch == '{' ? "expected ',' or '}'" : "expected ',' or ']'");
            if (more <= 0) return more;
        }
    }
    if (!strncmp(j->p, "true", 4) || !strncmp(j->p, "null", 4)) {
        j->p += 4;
        return 0;
    }
    if (!strncmp(j->p, "false", 5)) {
        j->p += 5;
        return 0;
    }
    double d;
    return jnumber(j, &d);
}

static int as_uint(jparse *j, double v, double lo, const char *what) {
    static char msg[128];
    if (v != floor(v) || v < lo || v > 2147483647.0) {
        snprintf(msg, sizeof msg, "%s must be an integer >= %.0f (got %g)", what, lo, v);
        j->err = msg;
        return -1;
    }
    return 0;
}

typedef struct trace_line {
    double arrival;
    int have_arrival, have_max, have_plen, have_prompt;
    uint32_t max_tokens, prompt_len, n, prefix_len;
    int have_prefix_len;
    int32_t group;
    int32_t *ids;
    uint32_t n_ids, cap_ids;
} trace_line;

static int parse_line(jparse *j, trace_line *t) {
    ws(j);
    if (*j->p != '{') {
        j->err = "expected a JSON object '{...}'";
        return -1;
    }
    j->p++;
    ws(j);
    if (*j->p == '}') {
        j->p++;
    } else {
        for (;;) {
            char key[64];
            if (jstring(j, key, sizeof key)) return -1;
            ws(j);
            if (*j->p != ':') {
                j->err = "expected ':' after a key";
                return -1;
            }
            j->p++;
            double v;
            if (!strcmp(key, "arrival")) {
                if (jnumber(j, &v)) return -1;
                if (v < 0) {
                    j->err = "arrival must be >= 0 seconds";
                    return -1;
                }
                t->arrival = v, t->have_arrival = 1;
            } else if (!strcmp(key, "max_tokens")) {
                if (jnumber(j, &v) || as_uint(j, v, 1, "max_tokens")) return -1;
                t->max_tokens = (uint32_t)v, t->have_max = 1;
            } else if (!strcmp(key, "prompt_len")) {
                if (jnumber(j, &v) || as_uint(j, v, 1, "prompt_len")) return -1;
                t->prompt_len = (uint32_t)v, t->have_plen = 1;
            } else if (!strcmp(key, "prefix_group")) {
                if (jnumber(j, &v) || as_uint(j, v, 0, "prefix_group")) return -1;
                t->group = (int32_t)v;
            } else if (!strcmp(key, "prefix_len")) {
                if (jnumber(j, &v) || as_uint(j, v, 0, "prefix_len")) return -1;
                t->prefix_len = (uint32_t)v, t->have_prefix_len = 1;
            } else if (!strcmp(key, "n")) {
                if (jnumber(j, &v) || as_uint(j, v, 1, "n")) return -1;
                t->n = (uint32_t)v;
            } else if (!strcmp(key, "prompt")) {
                ws(j);
                if (*j->p != '[') {
                    j->err = "prompt must be an array of token ids";
                    return -1;
                }
                j->p++;
                ws(j);
                t->have_prompt = 1;
                if (*j->p == ']') {
                    j->p++;
                } else {
                    for (;;) {
                        if (jnumber(j, &v) || as_uint(j, v, 0, "a token id")) return -1;
                        if (t->n_ids == t->cap_ids) {
                            t->cap_ids = t->cap_ids ? 2 * t->cap_ids : 256;
                            int32_t *nid = realloc(t->ids, t->cap_ids * sizeof *nid);
                            if (!nid) {
                                j->err = "out of memory";
                                return -1;
                            }
                            t->ids = nid;
                        }
                        t->ids[t->n_ids++] = (int32_t)v;
                        const int more = jnext(j, ']', "expected ',' or ']' in prompt");
                        if (more < 0) return -1;
                        if (!more) break;
                    }
                }
            } else if (jskip(j, 0)) {
                return -1;
            }
            const int more = jnext(j, '}', "expected ',' or '}'");
            if (more < 0) return -1;
            if (!more) break;
        }
    }
    ws(j);
    if (*j->p) {
        j->err = "trailing characters after the object";
        return -1;
    }
    if (!t->have_arrival) j->err = "missing \"arrival\"";
    else if (!t->have_max) j->err = "missing \"max_tokens\"";
    else if (!t->have_prompt && !t->have_plen) j->err = "missing \"prompt\" or \"prompt_len\"";
    else if (t->have_prompt && t->n_ids == 0) j->err = "empty \"prompt\"";
    else if (t->have_prompt && t->have_plen && t->prompt_len != t->n_ids) j->err = "\"prompt_len\" differs from the length of \"prompt\"";
    return j->err ? -1 : 0;
}

static int cmp_arrival(const void *a, const void *b) {
    const sim_request *x = a, *y = b;
    if (x->arrival_s != y->arrival_s) return x->arrival_s < y->arrival_s ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

int sim_workload_read_trace(const char *path, const sim_workload_opts *o, sim_workload *w) {
    memset(w, 0, sizeof *w);
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "pkv sim: cannot open trace '%s': %s\n", path, strerror(errno));
        return -1;
    }
    char *line = NULL;
    size_t line_cap = 0;
    ssize_t got;
    uint32_t cap = 0, lineno = 0;
    size_t store_n = 0, store_cap = 0;
    size_t *store_off = NULL; /* token_store offset per request, SIZE_MAX for none */
    trace_line t = {0};
    int rc = -1;
    while ((got = getline(&line, &line_cap, f)) != -1) {
        lineno++;
        if ((size_t)got != strlen(line)) {
            fprintf(stderr, "pkv sim: %s:%u: NUL byte in line\n", path, lineno);
            goto done;
        }
        const char *s = line;
        while (*s == ' ' || *s == '\t' || *s == '\r' || *s == '\n') s++;
        if (!*s) continue;
        int32_t *keep = t.ids;
        uint32_t keep_cap = t.cap_ids;
        memset(&t, 0, sizeof t);
        t.ids = keep, t.cap_ids = keep_cap, t.group = -1, t.n = 1;
        jparse j = {s, NULL};
        if (parse_line(&j, &t)) {
            fprintf(stderr, "pkv sim: %s:%u: %s\n", path, lineno, j.err);
            goto done;
        }
        uint32_t plen = t.have_prompt ? t.n_ids : t.prompt_len;
        if (plen >= o->max_len) {
            fprintf(stderr, "pkv sim: %s:%u: prompt of %u tokens does not fit --max-len %u\n", path, lineno, plen,
                    o->max_len);
            goto done;
        }
        if (!t.have_prompt && t.group >= 0 && t.have_prefix_len && t.prefix_len > plen) {
            fprintf(stderr, "pkv sim: %s:%u: prefix_len %u is over prompt_len %u\n", path, lineno, t.prefix_len, plen);
            goto done;
        }
        if (w->n == cap) {
            cap = cap ? 2 * cap : 1024;
            sim_request *nr = realloc(w->reqs, cap * sizeof *nr);
            size_t *no = realloc(store_off, cap * sizeof *no);
            if (nr) w->reqs = nr;
            if (no) store_off = no;
            if (!nr || !no) {
                fprintf(stderr, "pkv sim: out of memory reading the trace\n");
                goto done;
            }
        }
        sim_request *r = &w->reqs[w->n];
        memset(r, 0, sizeof *r);
        r->id = w->n;
        r->arrival_s = t.arrival;
        r->prompt_len = plen;
        r->output_len = t.max_tokens;
        r->n_samples = t.n;
        r->group = t.have_prompt ? -1 : t.group;
        r->group_len = r->group >= 0 ? (t.have_prefix_len ? t.prefix_len : o->sys_len) : 0;
        store_off[w->n] = SIZE_MAX;
        if (t.have_prompt) {
            if (store_n + t.n_ids > store_cap) {
                store_cap = (store_n + t.n_ids) * 2;
                int32_t *ns = realloc(w->token_store, store_cap * sizeof *ns);
                if (!ns) {
                    fprintf(stderr, "pkv sim: out of memory reading the trace\n");
                    goto done;
                }
                w->token_store = ns;
            }
            memcpy(w->token_store + store_n, t.ids, t.n_ids * sizeof *t.ids);
            store_off[w->n] = store_n;
            store_n += t.n_ids;
        }
        if (finish_request(r, o)) {
            fprintf(stderr, "pkv sim: %s:%u: arrival %g s is past 2^53 steps of %g s\n", path, lineno, t.arrival,
                    o->step_s);
            goto done;
        }
        w->n++;
    }
    if (ferror(f)) {
        fprintf(stderr, "pkv sim: read error on '%s'\n", path);
        goto done;
    }
    if (w->n == 0) {
        fprintf(stderr, "pkv sim: %s: no requests in the trace\n", path);
        goto done;
    }
    for (uint32_t i = 0; i < w->n; i++)
        if (store_off[i] != SIZE_MAX) w->reqs[i].tokens = w->token_store + store_off[i];
    qsort(w->reqs, w->n, sizeof *w->reqs, cmp_arrival);
    for (uint32_t i = 0; i < w->n; i++) w->reqs[i].id = i; /* ids in replay order */
    rc = 0;
done:
    free(t.ids);
    free(line);
    free(store_off);
    fclose(f);
    if (rc) sim_workload_free(w);
    return rc;
}
