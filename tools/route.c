/* route.c: `pkv route`: KV-aware routing across engine replicas, replayed on real caches. Each
 * replica is a pkv cache with prefix-index events on; the router keeps, per replica, the set
 * of block hashes its events name (nothing else: no call into the replica's cache) and sends a
 * request where the most leading blocks of its prompt (pkv_prefix_hashes) are held, as
 * llm-d's and Dynamo's KV-aware routers do with vLLM's events. Compared with round robin on
 * the same multi-turn chat workload: how much of each prompt the chosen replica reuses. */
#include "tool.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { RT_RR = 0, RT_PREFIX, RT_BOUNDED, RT_N_POLICIES };
static const char *const rt_names[RT_N_POLICIES] = {"round_robin", "prefix", "prefix_bounded"};

typedef struct rt_opts {
    uint32_t replicas, block_tokens, n_blocks, event_capacity;
    uint32_t convs, active, turns, n_sys, sys_len, user_mean, reply_mean;
    uint32_t drain_every; /* the router takes events every this many requests */
    double balance;       /* prefix_bounded: a replica takes at most (1 + balance) x the mean load */
    uint64_t seed;
    int json, policies[RT_N_POLICIES], n_policies;
} rt_opts;

typedef struct rt_result {
    uint64_t requests, prompt_tokens, reused_tokens, computed_tokens, evictions, events, overflows;
    uint64_t predicted, exact;      /* routed requests whose prediction for the chosen replica was exact */
    uint64_t predicted_blocks;      /* held blocks the router expected at the chosen replicas */
    uint32_t req_min, req_max;      /* requests per replica */
    double route_ns;                /* median ns per routing decision (hashes + lookups) */
} rt_result;

/* ---- a replica's mirror: a set of uint64 hashes, open addressing with backward-shift deletion --- */
typedef struct rt_set {
    uint64_t *slot; /* 0: empty (a hash of 0 is stored as 1: one in 2^64 collides with that) */
    uint32_t mask, n;
} rt_set;

static uint64_t key_of(uint64_t h) { return h ? h : 1; }
static uint32_t home(const rt_set *s, uint64_t k) { return (uint32_t)((k * 0x9E3779B97F4A7C15ull) >> 32) & s->mask; }

static int set_has(const rt_set *s, uint64_t h) {
    const uint64_t k = key_of(h);
    for (uint32_t i = home(s, k);; i = (i + 1) & s->mask) {
        if (s->slot[i] == k) return 1;
        if (!s->slot[i]) return 0;
    }
}

static void set_add(rt_set *s, uint64_t h) {
    const uint64_t k = key_of(h);
    uint32_t i = home(s, k);
    while (s->slot[i] && s->slot[i] != k) i = (i + 1) & s->mask;
    if (!s->slot[i]) s->slot[i] = k, s->n++;
}

static void set_del(rt_set *s, uint64_t h) {
    const uint64_t k = key_of(h);
    uint32_t i = home(s, k);
    while (s->slot[i] != k) {
        if (!s->slot[i]) return;
        i = (i + 1) & s->mask;
    }
    s->n--;
    /* shift back the entries after i that would no longer be found past the hole */
    for (uint32_t j = (i + 1) & s->mask; s->slot[j]; j = (j + 1) & s->mask) {
        const uint32_t hj = home(s, s->slot[j]);
        if (((j - hj) & s->mask) >= ((j - i) & s->mask)) {
            s->slot[i] = s->slot[j];
            i = j;
        }
    }
    s->slot[i] = 0;
}

static void set_clear(rt_set *s) {
    memset(s->slot, 0, ((size_t)s->mask + 1) * sizeof *s->slot);
    s->n = 0;
}

/* ---- the workload: multi-turn chats over shared system prompts ----------------------------- */
typedef struct rt_conv {
    uint32_t sys, turn;
    uint32_t len;     /* tokens of its history so far (system prompt included) */
    int32_t *tok;     /* [cap] */
    uint32_t cap;
    uint64_t id;
} rt_conv;

static int32_t tok_of(uint64_t a, uint64_t b) {
    uint64_t x = a * 0x9E3779B97F4A7C15ull ^ (b + 0x632BE59BD9B4E019ull);
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 29;
    return (int32_t)(x % 32000u);
}

static uint32_t around(tool_rng *r, uint32_t mean) { /* uniform in [mean / 2, 3 mean / 2] */
    return mean / 2 + (uint32_t)(tool_rng_u64(r) % (mean + 1));
}

static void conv_start(rt_conv *c, const rt_opts *o, uint64_t id, tool_rng *r) {
    c->id = id;
    c->sys = (uint32_t)(tool_rng_u64(r) % o->n_sys);
    c->turn = 0;
    c->len = o->sys_len;
    for (uint32_t i = 0; i < o->sys_len; i++) c->tok[i] = tok_of(1000 + c->sys, i);
}

/* Appends n tokens of its own to c (a user message or a reply). */
static void conv_grow(rt_conv *c, uint32_t n) {
    for (uint32_t i = 0; i < n; i++, c->len++) c->tok[c->len] = tok_of(c->id + 77, c->len);
}

/* ---- one replay ----------------------------------------------------------------------------- */
typedef struct rt_world {
    const rt_opts *o;
    pkv_cache **c;
    rt_set *set;
    uint32_t *load;
    pkv_event *ev;
    uint64_t *hashes;
    double *route_ns;
    rt_result *res;
} rt_world;

/* Everything replica i's events say since the last drain, into its mirror. */
static int drain(rt_world *W, uint32_t i) {
    for (;;) {
        size_t n = 0;
        int rc = pkv_cache_take_events(W->c[i], W->ev, 256, NULL, &n);
        if (rc) return tool_check(rc, "pkv_cache_take_events");
        if (!n) return 0;
        W->res->events += n;
        for (size_t k = 0; k < n; k++) {
            const pkv_event *e = &W->ev[k];
            if (e->kind == PKV_EVENT_STORED) set_add(&W->set[i], e->hash);
            else if (e->kind == PKV_EVENT_REMOVED) set_del(&W->set[i], e->hash);
            else if (e->kind == PKV_EVENT_CLEARED) set_clear(&W->set[i]);
            else if (e->kind == PKV_EVENT_OVERFLOW) { /* resync from the whole index */
                W->res->overflows++;
                size_t m = 0;
                rc = pkv_prefix_snapshot(W->c[i], W->ev + 256, W->o->n_blocks, NULL, &m);
                if (rc) return tool_check(rc, "pkv_prefix_snapshot");
                set_clear(&W->set[i]);
                for (size_t j = 0; j < m; j++) set_add(&W->set[i], W->ev[256 + j].hash);
                break; /* the snapshot holds what the rest of this batch said */
            }
        }
    }
}

/* Leading blocks of hashes[0 .. n) replica i's mirror holds. */
static uint32_t held(const rt_world *W, uint32_t i, uint32_t n) {
    uint32_t k = 0;
    while (k < n && set_has(&W->set[i], W->hashes[k])) k++;
    return k;
}

static int run_policy(const rt_opts *o, int policy, rt_result *res) {
    memset(res, 0, sizeof *res);
    const uint32_t R = o->replicas, B = o->block_tokens;
    const uint32_t max_len = o->sys_len + o->turns * (o->user_mean * 3 / 2 + 1 + o->reply_mean * 3 / 2 + 1);
    uint32_t set_slots = 16;
    while (set_slots < 2 * o->n_blocks) set_slots *= 2;
    rt_world W = {.o = o, .res = res};
    W.c = calloc(R, sizeof *W.c);
    W.set = calloc(R, sizeof *W.set);
    W.load = calloc(R, sizeof *W.load);
    W.ev = malloc((256 + (size_t)o->n_blocks) * sizeof *W.ev);
    W.hashes = malloc(((size_t)max_len / B + 1) * sizeof *W.hashes);
    const uint64_t n_req = (uint64_t)o->convs * o->turns;
    W.route_ns = malloc(n_req * sizeof *W.route_ns);
    rt_conv *cv = calloc(o->active, sizeof *cv);
    int rc = W.c && W.set && W.load && W.ev && W.hashes && W.route_ns && cv ? 0 : PKV_ENOMEM;
    for (uint32_t i = 0; !rc && i < R; i++) {
        W.set[i].mask = set_slots - 1;
        W.set[i].slot = calloc(set_slots, sizeof *W.set[i].slot);
        if (!W.set[i].slot) rc = PKV_ENOMEM;
    }
    for (uint32_t i = 0; !rc && i < o->active; i++) {
        cv[i].cap = max_len;
        cv[i].tok = malloc((size_t)max_len * sizeof *cv[i].tok);
        if (!cv[i].tok) rc = PKV_ENOMEM;
    }
    if (rc) {
        fprintf(stderr, "pkv route: out of memory\n");
        goto done;
    }
    pkv_config cfg = pkv_config_default();
    cfg.n_layers = 1, cfg.n_kv_heads = 1, cfg.head_dim = 8; /* memory only: routing needs no K/V */
    cfg.block_tokens = B;
    cfg.n_blocks = o->n_blocks;
    cfg.max_seqs = 4;
    cfg.n_threads = 1;
    cfg.huge_pages = 0;
    cfg.event_capacity = o->event_capacity;
    tool_log_errors(&cfg, "pkv route");
    for (uint32_t i = 0; i < R; i++)
        if ((rc = tool_check(pkv_cache_create(&cfg, &W.c[i]), "pkv_cache_create")) < 0) goto done;

    tool_rng rng;
    tool_rng_seed(&rng, o->seed);
    uint64_t started = 0, rr = 0;
    for (uint32_t i = 0; i < o->active && started < o->convs; i++) conv_start(&cv[i], o, started++, &rng);
    uint32_t n_active = o->active < o->convs ? o->active : o->convs;
    while (n_active) {
        const uint32_t ci = (uint32_t)(tool_rng_u64(&rng) % n_active);
        rt_conv *c = &cv[ci];
        conv_grow(c, around(&rng, o->user_mean)); /* the user's message: the prompt is the history */
        const uint32_t n = c->len;
        /* route */
        const uint64_t t0 = tool_now_ns();
        size_t nh = 0;
        if ((rc = tool_check(pkv_prefix_hashes(NULL, 0, B, c->tok, n, W.hashes, (size_t)max_len / B + 1, &nh),
                             "pkv_prefix_hashes")) < 0)
            goto done;
        uint32_t pick = (uint32_t)(rr++ % R), best = held(&W, pick, (uint32_t)nh);
        if (policy != RT_RR) {
            /* the most leading blocks held; ties to the least loaded; prefix_bounded skips a
               replica over (1 + balance) x the mean load (consistent hashing with bounded loads) */
            const double cap = (1.0 + o->balance) * (double)(res->requests + 1) / R;
            const uint64_t cap_whole = (uint64_t)cap + (cap > (double)(uint64_t)cap); /* rounded up */
            int found = 0;
            for (uint32_t i = 0; i < R; i++) {
                if (policy == RT_BOUNDED && W.load[i] + 1 > cap_whole) continue;
                const uint32_t h = held(&W, i, (uint32_t)nh);
                if (!found || h > best || (h == best && W.load[i] < W.load[pick])) pick = i, best = h, found = 1;
            }
        }
        W.route_ns[res->requests] = (double)(tool_now_ns() - t0);
        /* the replica serves it: match, compute the rest, then the reply, all committed */
        pkv_cache *cc = W.c[pick];
        pkv_seq s;
        uint32_t reused = 0;
        if ((rc = tool_check(pkv_seq_create(cc, NULL, 0, &s), "pkv_seq_create")) < 0) goto done;
        if ((rc = tool_check(pkv_seq_match_prefix(cc, s, c->tok, n, &reused), "pkv_seq_match_prefix")) < 0) goto done;
        const uint32_t expect = best < (n - 1) / B ? best : (n - 1) / B;
        res->predicted_blocks += expect;
        res->exact += reused / B == expect;
        res->predicted++;
        const uint32_t reply = around(&rng, o->reply_mean);
        conv_grow(c, reply);
        rc = pkv_seq_append(cc, s, c->tok + reused, c->len - reused, NULL);
        if (rc == 0) rc = pkv_seq_commit(cc, s, c->len);
        if ((rc = tool_check(rc, "pkv_seq_append / pkv_seq_commit (is --blocks enough for one chat?)")) < 0) goto done;
        if ((rc = tool_check(pkv_seq_release(cc, s), "pkv_seq_release")) < 0) goto done;
        res->requests++;
        res->prompt_tokens += n;
        res->reused_tokens += reused;
        res->computed_tokens += c->len - reused;
        W.load[pick]++;
        if (res->requests % o->drain_every == 0)
            for (uint32_t i = 0; i < R; i++)
                if ((rc = drain(&W, i)) < 0) goto done;
        if (++c->turn == o->turns) { /* done: the next chat takes its place */
            if (started < o->convs) {
                conv_start(c, o, started++, &rng);
            } else {
                rt_conv t = *c;
                *c = cv[--n_active];
                cv[n_active] = t;
            }
        }
    }
    res->req_min = UINT32_MAX;
    for (uint32_t i = 0; i < R; i++) {
        pkv_stats st;
        if ((rc = tool_check(pkv_cache_get_stats(W.c[i], &st), "pkv_cache_get_stats")) < 0) goto done;
        res->evictions += st.evictions;
        if (W.load[i] < res->req_min) res->req_min = W.load[i];
        if (W.load[i] > res->req_max) res->req_max = W.load[i];
        char msg[256];
        if ((rc = pkv_cache_check(W.c[i], msg, sizeof msg)) < 0) {
            fprintf(stderr, "pkv route: replica %u: pkv_cache_check: %s\n", i, msg);
            goto done;
        }
    }
    res->route_ns = tool_median(W.route_ns, res->requests);
    rc = 0;
done:
    for (uint32_t i = 0; W.c && i < R; i++) pkv_cache_destroy(W.c[i]);
    for (uint32_t i = 0; W.set && i < R; i++) free(W.set[i].slot);
    for (uint32_t i = 0; cv && i < o->active; i++) free(cv[i].tok);
    free(W.c), free(W.set), free(W.load), free(W.ev), free(W.hashes), free(W.route_ns), free(cv);
    return rc;
}

/* ---- the command ------------------------------------------------------------------------------ */
static void defaults(rt_opts *o) {
    *o = (rt_opts){.replicas = 8, .block_tokens = 16, .n_blocks = 256, .event_capacity = 1024, .convs = 128,
                   .active = 32, .turns = 6, .n_sys = 4, .sys_len = 512, .user_mean = 80, .reply_mean = 200,
                   .drain_every = 1, .balance = 0.25, .seed = 1, .n_policies = RT_N_POLICIES};
    for (int i = 0; i < RT_N_POLICIES; i++) o->policies[i] = i;
}

static void usage(FILE *f) {
    rt_opts d;
    defaults(&d);
    fprintf(f,
            "usage: pkv route [options]\n"
            "\n"
            "KV-aware routing across engine replicas, replayed on real caches (memory only: block\n"
            "allocation, prefix matching, eviction; no K/V data). Each replica is a pkv cache with\n"
            "prefix-index events on (config event_capacity); the router keeps, per replica, the block\n"
            "hashes its events name (pkv_cache_take_events) and nothing else, and hashes each prompt\n"
            "itself (pkv_prefix_hashes). Policies, on the same requests:\n"
            "  round_robin     replica after replica\n"
            "  prefix          where the most leading blocks of the prompt are held; ties to the least\n"
            "                  loaded (the fewest requests so far)\n"
            "  prefix_bounded  the same among replicas under (1 + balance) x the mean load\n"
            "Workload: multi-turn chats, each opening with one of the shared system prompts; a request\n"
            "is a chat's whole history plus a new user message, and its reply is appended and\n"
            "committed; `active` chats at once, a random one speaks next. One request at a time per\n"
            "replica: between requests a pool holds only cached prefixes.\n"
            "\n"
            "  --replicas N      engine replicas [%u]\n"
            "  --blocks N        pool blocks per replica [%u]\n"
            "  --block-tokens B  tokens per block [%u]\n"
            "  --events N        event_capacity of each replica [%u]\n"
            "  --drain K         the router takes the events every K requests [%u]\n"
            "  --balance F       prefix_bounded's slack over the mean load [%g]\n"
            "  --chats N         chats in all [%u]\n"
            "  --active N        chats at once [%u]\n"
            "  --turns N         turns per chat [%u]\n"
            "  --sys-prompts N   shared system prompts [%u]   --sys-len N  tokens each [%u]\n"
            "  --user-mean N     mean tokens of a user message [%u]\n"
            "  --reply-mean N    mean tokens of a reply [%u]\n"
            "  --policies LIST   comma-separated subset of round_robin,prefix,prefix_bounded [all]\n"
            "  --seed N          [%llu]\n"
            "  --json            one JSON object per policy per line\n"
            "\n"
            "Reported: the share of prompt tokens the chosen replica reused (hit rate), tokens computed,\n"
            "requests per replica (min-max), evictions, events taken, and how often the router's\n"
            "prediction (the leading blocks its mirror held there) was exactly what the replica's own\n"
            "prefix match reused. Exit status: 0 ok, 1 usage error, 2 runtime error.\n",
            d.replicas, d.n_blocks, d.block_tokens, d.event_capacity, d.drain_every, d.balance, d.convs, d.active,
            d.turns, d.n_sys, d.sys_len, d.user_mean, d.reply_mean, (unsigned long long)d.seed);
}

static int parse_policies(rt_opts *o, const char *s) {
    o->n_policies = 0;
    int seen[RT_N_POLICIES] = {0};
    while (*s) {
        size_t len = strcspn(s, ",");
        int p = RT_N_POLICIES;
        for (int i = 0; i < RT_N_POLICIES; i++)
            if (strlen(rt_names[i]) == len && !strncmp(s, rt_names[i], len)) p = i;
        if (p == RT_N_POLICIES || seen[p]) return -1;
        seen[p] = 1;
        o->policies[o->n_policies++] = p;
        s += len;
        if (*s == ',' && !*++s) return -1;
    }
    return o->n_policies ? 0 : -1;
}

static int parse_args(rt_opts *o, int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 1;
        }
        if (!strcmp(a, "--json")) {
            o->json = 1;
            continue;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "pkv route: %s needs a value, or is unknown (see pkv route --help)\n", a);
            return -1;
        }
        const char *v = argv[++i];
        int bad;
        if (!strcmp(a, "--replicas")) bad = tool_parse_u32(v, &o->replicas) || !o->replicas || o->replicas > 1024;
        else if (!strcmp(a, "--blocks")) bad = tool_parse_u32(v, &o->n_blocks) || o->n_blocks < 1 || o->n_blocks > (1u << 24);
        else if (!strcmp(a, "--block-tokens")) bad = tool_parse_u32(v, &o->block_tokens) || !o->block_tokens || o->block_tokens > 1024;
        else if (!strcmp(a, "--events")) bad = tool_parse_u32(v, &o->event_capacity) || !o->event_capacity || o->event_capacity > (1u << 24);
        else if (!strcmp(a, "--drain")) bad = tool_parse_u32(v, &o->drain_every) || !o->drain_every;
        else if (!strcmp(a, "--balance")) bad = tool_parse_f64(v, &o->balance) || o->balance < 0 || o->balance > 1e6;
        else if (!strcmp(a, "--chats")) bad = tool_parse_u32(v, &o->convs) || !o->convs || o->convs > (1u << 20);
        else if (!strcmp(a, "--active")) bad = tool_parse_u32(v, &o->active) || !o->active || o->active > (1u << 16);
        else if (!strcmp(a, "--turns")) bad = tool_parse_u32(v, &o->turns) || !o->turns || o->turns > 256;
        else if (!strcmp(a, "--sys-prompts")) bad = tool_parse_u32(v, &o->n_sys) || !o->n_sys || o->n_sys > (1u << 20);
        else if (!strcmp(a, "--sys-len")) bad = tool_parse_u32(v, &o->sys_len) || o->sys_len > (1u << 16);
        else if (!strcmp(a, "--user-mean")) bad = tool_parse_u32(v, &o->user_mean) || !o->user_mean || o->user_mean > (1u << 16);
        else if (!strcmp(a, "--reply-mean")) bad = tool_parse_u32(v, &o->reply_mean) || !o->reply_mean || o->reply_mean > (1u << 16);
        else if (!strcmp(a, "--policies")) bad = parse_policies(o, v);
        else if (!strcmp(a, "--seed")) bad = tool_parse_u64(v, &o->seed);
        else {
            fprintf(stderr, "pkv route: unknown option '%s' (see pkv route --help)\n", a);
            return -1;
        }
        if (bad) {
            fprintf(stderr, "pkv route: bad value '%s' for %s\n", v, a);
            return -1;
        }
    }
    return 0;
}

int tool_route(int argc, char **argv) {
    rt_opts o;
    defaults(&o);
    int p = parse_args(&o, argc, argv);
    if (p) return p > 0 ? TOOL_OK : TOOL_USAGE;
    if (!o.json)
        printf("pkv route: %u replicas x %u blocks of %u tokens, events every %u request(s); %u chats x %u turns, "
               "%u at once, %u system prompts of %u tokens, messages ~%u, replies ~%u tokens\n\n"
               "%-15s %9s %12s %12s %15s %10s %9s %14s %9s\n",
               o.replicas, o.n_blocks, o.block_tokens, o.drain_every, o.convs, o.turns, o.active, o.n_sys, o.sys_len,
               o.user_mean, o.reply_mean, "policy", "hit rate", "reused tok", "computed", "req/replica", "evictions",
               "events", "prediction", "route_us");
    for (int k = 0; k < o.n_policies; k++) {
        const int policy = o.policies[k];
        rt_result r;
        if (run_policy(&o, policy, &r) < 0) return TOOL_FAIL;
        const double hit = r.prompt_tokens ? (double)r.reused_tokens / (double)r.prompt_tokens : 0;
        if (o.json) {
            printf("{\"policy\":\"%s\",\"replicas\":%u,\"blocks\":%u,\"block_tokens\":%u,\"drain\":%u,\"requests\":%llu,"
                   "\"prompt_tokens\":%llu,\"reused_tokens\":%llu,\"hit_rate\":%.4f,\"computed_tokens\":%llu,"
                   "\"req_min\":%u,\"req_max\":%u,\"evictions\":%llu,\"events\":%llu,\"overflows\":%llu,"
                   "\"predicted\":%llu,\"predicted_exact\":%llu,\"predicted_blocks\":%llu,\"route_us\":%.3f}\n",
                   rt_names[policy], o.replicas, o.n_blocks, o.block_tokens, o.drain_every,
                   (unsigned long long)r.requests, (unsigned long long)r.prompt_tokens,
                   (unsigned long long)r.reused_tokens, hit, (unsigned long long)r.computed_tokens, r.req_min,
                   r.req_max, (unsigned long long)r.evictions, (unsigned long long)r.events,
                   (unsigned long long)r.overflows, (unsigned long long)r.predicted, (unsigned long long)r.exact,
                   (unsigned long long)r.predicted_blocks, r.route_ns * 1e-3);
        } else {
            char lr[32], pr[32];
            snprintf(lr, sizeof lr, "%u-%u", r.req_min, r.req_max);
            snprintf(pr, sizeof pr, "%llu/%llu", (unsigned long long)r.exact, (unsigned long long)r.predicted);
            printf("%-15s %8.1f%% %12llu %12llu %15s %10llu %9llu %14s %9.2f\n", rt_names[policy], 100 * hit,
                   (unsigned long long)r.reused_tokens, (unsigned long long)r.computed_tokens, lr,
                   (unsigned long long)r.evictions, (unsigned long long)r.events, pr, r.route_ns * 1e-3);
        }
        fflush(stdout);
    }
    if (!o.json)
        printf("\nprediction: requests where the router's count of leading blocks held at the chosen replica\n"
               "equalled the full blocks its prefix match reused (route_us: median time to hash the prompt\n"
               "and look it up in every replica's mirror)\n");
    return TOOL_OK;
}
