/* sim.h: `pkv sim` internals shared by its files: the workload (built-in or a JSON-lines
 * trace), the continuous-batching scheduler that drives the cache per policy, and results. */
#ifndef PKV_SIM_H
#define PKV_SIM_H

#include "pkv.h"

#include <stdint.h>
#include <stdio.h>

/* ---- workload ------------------------------------------------------------------------- */

typedef struct sim_request {
    double arrival_s;     /* seconds from the start */
    uint64_t arrival_step;
    uint32_t prompt_len;  /* tokens, shared prefix included */
    uint32_t output_len;  /* tokens generated per sample (>= 1) */
    uint32_t n_samples;   /* >= 1; samples 2.. are forks after the prompt */
    int32_t group;        /* shared-prefix group (system prompt) or -1 */
    uint32_t group_len;   /* tokens of the group prefix at the start of the prompt */
    int32_t *tokens;      /* explicit prompt (trace "prompt"), or NULL: generated from the id */
    uint32_t id;
} sim_request;

typedef struct sim_workload_opts {
    uint32_t n_requests;
    double rate;          /* requests per second (Poisson) */
    double prompt_mean, prompt_sigma; /* log-normal: mean tokens and sigma of log */
    double output_mean, output_sigma;
    uint32_t max_len;     /* prompt + output cap (the model's max length) */
    uint32_t n_sys;       /* shared system prompts */
    uint32_t sys_len;     /* tokens each */
    double sys_frac;      /* fraction of requests starting with one */
    double n_frac;        /* fraction of requests with n > 1 samples */
    uint32_t n_samples;   /* n for those */
    uint64_t seed;
    double step_s;        /* simulated duration of one step (arrival seconds -> steps) */
    uint32_t turns;       /* requests a conversation (1: none follow); each later one's prompt
                             is the one before's prompt and first sample's output, then new tokens */
    double turn_gap_s;    /* seconds between a conversation's turns' arrivals */
    double turn_mean;     /* mean new tokens of a later turn (log-normal, prompt_sigma) */
} sim_workload_opts;

typedef struct sim_workload {
    sim_request *reqs;
    uint32_t n;
    int32_t *token_store; /* explicit prompts of a trace, one allocation */
} sim_workload;

/* Returns 0, -1 (out of memory) or SIM_WORKLOAD_FAR (an arrival past 2^53 steps). */
#define SIM_WORKLOAD_FAR (-2)
int sim_workload_generate(const sim_workload_opts *o, sim_workload *w);
/* Reads a JSON-lines trace; on malformed input prints "pkv sim: FILE:LINE: what" and returns -1. */
int sim_workload_read_trace(const char *path, const sim_workload_opts *o, sim_workload *w);
void sim_workload_free(sim_workload *w);
/* Token ids of positions [start, start+n) of request r's sample `sample` (prompt positions
 * are the same for every sample; output positions differ per sample). */
void sim_tokens(const sim_request *r, uint32_t sample, uint32_t start, uint32_t n, int32_t *out);

/* ---- scheduler ------------------------------------------------------------------------ */

enum { SIM_PAGED_PREFIX = 0, SIM_PAGED = 1, SIM_CONTIGUOUS = 2, SIM_N_POLICIES = 3 };
extern const char *const sim_policy_names[SIM_N_POLICIES];

typedef struct sim_model {
    uint32_t n_layers, n_kv_heads, n_q_heads, head_dim;
    pkv_dtype dtype;
} sim_model;

typedef struct sim_opts {
    sim_model model;
    uint32_t block_tokens, n_blocks;
    uint32_t max_len;
    uint32_t step_tokens;   /* token budget per step (prefill chunks + decodes) */
    uint32_t max_seqs;      /* running sequences at most */
    double watermark;       /* fraction of the pool kept free at admission */
    double headroom;        /* blocks per running sequence kept free at admission */
    uint32_t n_threads;
    uint32_t spin_us;       /* --spin-us: pkv_config.spin_us */
    int attn;               /* 0: --no-attn (no K/V writes, no kernels) */
    int compact;            /* --compact (1) / --compact-evict (2) / --compact-cached (3):
                               pkv_seq_compact on each decoding sequence every step, with
                               PKV_COMPACT_EVICT for 2, PKV_COMPACT_CACHED for 3 */
    uint32_t batch_compact; /* --batch-compact N: pkv_batch_compact of the decoding sequences every
                               N steps (0: never), with `slack` ids after each */
    uint32_t slack;         /* --slack K */
    int repack;             /* --repack: with PKV_BATCH_REPACK */
    int batch_cached;       /* --batch-cached: with PKV_BATCH_CACHED */
    int swap;               /* --preempt swap: a single-sample request's K/V goes to host memory
                               at preemption (pkv_seq_read_stored) and comes back at readmission
                               (pkv_seq_write_stored) instead of being recomputed */
    uint64_t tier_bytes;    /* --tier host:MIB / file:DIR:MIB: a storage tier of that many bytes
                               behind the pool (paged_prefix only; 0: none): at admission, after
                               the prefix match, pkv_tier_load; when a prompt is computed,
                               pkv_tier_save */
    const char *tier_dir;   /* file:DIR (NULL: host memory) */
    int plain_match;        /* --match plain: pkv_seq_match_prefix under --window too */
    uint32_t window;        /* --window W: every layer's attention sees the last W positions
                               (0: all); paged lets go of the blocks before them after each
                               step (pkv_seq_drop_front) */
    uint64_t seed;
    int progress;           /* draw a progress bar on stderr */
    int want_series;        /* keep (step, blocks, seqs) samples for --plot */
} sim_opts;

typedef struct sim_point { uint64_t step; uint32_t blocks, seqs; } sim_point;

typedef struct sim_result {
    int policy;
    uint32_t completed, rejected;
    uint32_t peak_seqs;
    double mean_seqs;       /* over steps */
    uint32_t peak_blocks;   /* ACTIVE (paged) or reserved (contiguous) */
    double kv_utilization;  /* sum over steps of live slots / sum of reserved slots */
    double waste;           /* mean fraction of the pool reserved without a live token */
    double prefix_hit_rate; /* tokens reused by match / prompt tokens queried */
    uint64_t prefix_hit_tokens, prompt_tokens;
    uint32_t preemptions;
    uint32_t swap_outs;           /* --preempt swap: preemptions that kept their K/V on the host */
    uint64_t swap_in_tokens;      /* positions written back from the host, not recomputed */
    uint64_t swap_peak_bytes;     /* host bytes held at most */
    uint64_t tier_hit_tokens;     /* --tier: prompt positions the tier gave (under --window, a
                                     windowed load's skipped front too: positions not computed) */
    uint64_t tier_saved_blocks;   /* blocks stored in it */
    uint64_t tier_evictions;      /* entries it dropped for room */
    uint64_t tier_bytes;          /* bytes it held at the end */
    uint64_t steps;
    uint64_t decode_tokens, prefill_tokens;
    uint64_t cow_copies, evictions;
    uint64_t shared_keys; /* pkv_stats.attn_shared_keys: positions decode read once a group */
    uint64_t tombstones, tomb_hits; /* pkv_stats.n_tombstones at the end, prefix_tomb_hits (--window) */
    double ttft_p50, ttft_p90, ttft_p99; /* steps */
    double pkv_s, attn_s, wall_s;
    double decode_tok_s;    /* generated tokens / seconds inside pkv calls */
    /* decode batches read in block id order: of neighbouring blocks, how many pairs and how
       many of them belong to different sequences (a block shared by several counts as its own,
       and as a switch on both sides) */
    uint64_t dec_pairs, dec_switches;
    uint64_t dec_shared; /* of the switches, pairs with a block several of the batch hold */
    uint64_t compact_moved; /* --compact: blocks moved */
    double compact_s;       /* --compact: seconds inside pkv_seq_compact (counted in pkv_s too) */
    int check_rc;           /* pkv_cache_check at the end */
    char check_msg[256];
    sim_point *series;
    uint32_t n_series;
} sim_result;

/* Replays the workload under one policy on a fresh cache. Returns 0, or a negative PKV_E*
 * status for a library failure (message printed). A failing checker is reported in
 * res->check_rc, not as a return value. */
int sim_run_policy(const sim_opts *o, const sim_workload *w, int policy, sim_result *res);

#endif
