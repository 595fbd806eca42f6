/* tool.h: the pkv CLI's subcommands and shared helpers. tools/ use only the public header. */
#ifndef PKV_TOOL_H
#define PKV_TOOL_H

#include "pkv.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Exit codes of every subcommand: 0 ok, 1 usage error, 2 runtime error. */
enum { TOOL_OK = 0, TOOL_USAGE = 1, TOOL_FAIL = 2 };

int tool_bench_ops(int argc, char **argv);    /* tools/bench_ops.c */
int tool_bench_attn(int argc, char **argv);   /* tools/bench_attn.c */
int tool_bench_prefix(int argc, char **argv); /* tools/bench_prefix.c */
int tool_bench_tier(int argc, char **argv);   /* tools/bench_tier.c */
int tool_bench_tree(int argc, char **argv);   /* tools/bench_tree.c */
int tool_bench_share(int argc, char **argv);  /* tools/bench_share.c */
int tool_bench_mla(int argc, char **argv);    /* tools/bench_mla.c */
int tool_bench_shift(int argc, char **argv);  /* tools/bench_shift.c */
int tool_sim(int argc, char **argv);          /* tools/sim.c */
int tool_run(int argc, char **argv);          /* tools/run.c */
int tool_route(int argc, char **argv);        /* tools/route.c */

/* tools/tool_util.c */
uint64_t tool_now_ns(void);
double tool_median(double *v, size_t n); /* sorts v in place */
double tool_percentile(double *v, size_t n, double pct); /* sorts v in place, pct in [0,100] */
/* bytes (never freed) at a 2 MiB boundary, advised onto transparent huge pages where Linux has
 * them; NULL when out of memory. */
void *tool_map_huge(size_t bytes);
/* The sum of the 64-bit words of p[0, n), n a multiple of 64, 64-byte aligned; with pf, each line
 * read prefetches the line at the same offset of pf: where near is not NULL with the NTA hint and
 * the line at that offset of near into L1 (T0), else into L1 where l1 is set, else into L2: a plain
 * read as the decode kernels stream a run while prefetching the run they lead to (and, at two
 * levels, the next head's: src/attn/attn.h, pkv__attn_pf.near). */
uint64_t tool_sum_run(const uint8_t *p, const uint8_t *pf, const uint8_t *near, size_t n, int l1);
/* One block read as the decode kernels walk it: for each of n_heads heads, its K run (k_run
 * bytes at k + h * k_run), then its V run (likewise), each with tool_sum_run prefetching the same
 * head's run of the next block (kn, vn; NULL: none) at the level l1 chooses. l1 == 2 is the
 * library's rule on Zen 5 (src/attn/attn.c, head_io_fill and pf_ahead, copied here by hand): the
 * run about PKV_ATTN_PF_LEAD bytes of K and V runs on (whole heads, this block's or the next's;
 * at least min_ahead: the library's 1 for f32 K, else 2; at most n_heads), with the NTA hint and
 * the next head's runs into L1 where that is more than one head on, else into L1. The same macro name and
 * default as attn.c's, so one -DPKV_ATTN_PF_LEAD=N (stop 41 built the library that way) moves
 * the kernels' lead and this read's together. l1 == 3 is the library's rule on Intel
 * (PKV_CPU_LEAD_HEAD): the next head's runs of the walk (this block's or the next's first) into
 * L2. */
#ifndef PKV_ATTN_PF_LEAD
#define PKV_ATTN_PF_LEAD ((size_t)16 * 1024)
#endif
uint64_t tool_sum_block(const uint8_t *k, const uint8_t *v, const uint8_t *kn, const uint8_t *vn, uint32_t n_heads,
                        size_t k_run, size_t v_run, int l1, uint32_t min_ahead);
/* A decimal in [0, UINT32_MAX] written as digits only (no sign, blank or other character): 0 and
 * *out set, else -1 and *out untouched. The options of every subcommand parse their counts with it. */
int tool_parse_u32(const char *s, uint32_t *out);
/* The same in [0, UINT64_MAX] (seeds). */
int tool_parse_u64(const char *s, uint64_t *out);
/* "a,b,c" (digits and commas only, no empty item) -> at most cap values in [1, max] into out,
 * their count in *n: 0, else -1. The benches' list options. */
int tool_parse_u32_list(const char *s, uint32_t *out, int cap, uint32_t max, int *n);
/* "f16,q8_0" (pkv_dtype_name's names, commas only, no empty item) -> at most cap dtypes into out,
 * their count in *n: 0, else -1. */
int tool_parse_dtype_list(const char *s, pkv_dtype *out, int cap, int *n);
/* A finite number (strtod's syntax, the whole string): 0 and *out set, else -1 and *out
 * untouched. NaN and infinity are refused, since they would pass every range check after. */
int tool_parse_f64(const char *s, double *out);
/* Fails with a message naming the call when rc < 0; returns rc. */
int tool_check(int rc, const char *what);
/* Appends n positions to s (token ids tok0, tok0 + 1, ...), TOOL_FILL_CHUNK at a time, and writes
 * the same random K and V rows (f32 input) into every layer of the cache: the benches' sequences.
 * kv: TOOL_FILL_CHUNK x n_kv_heads x head_dim floats of scratch; *rng the generator's state. 0, or
 * -1 with the failing call said. */
#define TOOL_FILL_CHUNK 1024u
int tool_fill_seq(pkv_cache *c, pkv_seq s, uint32_t n, int32_t tok0, float *kv, uint64_t *rng);
/* Gives cfg a log hook that prints the library's errors and warnings to stderr after "who: "
 * (e.g. why pkv_cache_create refused a config); who must outlive the cache. */
void tool_log_errors(pkv_config *cfg, const char *who);
/* xorshift-style deterministic RNG. */
typedef struct { uint64_t s; } tool_rng;
void tool_rng_seed(tool_rng *r, uint64_t seed);
uint64_t tool_rng_u64(tool_rng *r);
double tool_rng_unit(tool_rng *r);   /* [0, 1) */
double tool_rng_normal(tool_rng *r); /* standard normal */
/* For benchmarks that compare two caches over the same memory: tool_pool_loan_from notes where
 * a cache (the lender, made with the library's own allocator) keeps its K/V pool, and a cache
 * made with tool_loan_allocator(loan) as its pkv_config.allocator gets that pool when it asks
 * for exactly as many bytes (ordinary memory for everything else). So two caches of one shape
 * read the same physical pages: a comparison of their block orders (or of two builds of the
 * library) is not also a comparison of where the OS and the hypervisor placed two buffers,
 * which moved decode speed by up to 15% between two buffers on the shared development
 * machine. Destroy the borrower before the lender; only caches that never write K/V while they
 * are compared may share (decode reads only). */
typedef struct tool_pool_loan {
    void *base;  /* the lender's pool */
    size_t size; /* its bytes (pkv_stats.kv_bytes) */
} tool_pool_loan;
int tool_pool_loan_from(pkv_cache *lender, tool_pool_loan *loan); /* 0 or a pkv status */
pkv_allocator tool_loan_allocator(tool_pool_loan *loan);

/* git commit / compiler / cpu string for benchmark headers (static storage). */
const char *tool_build_info(void);
const char *tool_cpu_name(void);

#endif
