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
int tool_sim(int argc, char **argv);          /* tools/sim.c */
int tool_run(int argc, char **argv);          /* tools/run.c */

/* tools/tool_util.c */
uint64_t tool_now_ns(void);
double tool_median(double *v, size_t n); /* sorts v in place */
double tool_percentile(double *v, size_t n, double pct); /* sorts v in place, pct in [0,100] */
/* Fails with a message naming the call when rc < 0; returns rc. */
int tool_check(int rc, const char *what);
/* xorshift-style deterministic RNG. */
typedef struct { uint64_t s; } tool_rng;
void tool_rng_seed(tool_rng *r, uint64_t seed);
uint64_t tool_rng_u64(tool_rng *r);
double tool_rng_unit(tool_rng *r);   /* [0, 1) */
double tool_rng_normal(tool_rng *r); /* standard normal */
/* An allocator hook (pkv_config.allocator) for benchmarks that compare two caches: the first
 * allocation of at least TOOL_SHARED_MIN bytes (the K/V pool) is one 2 MiB-aligned mapping,
 * advised for huge pages, and every cache made with the same tool_shared_pool gets that same
 * mapping for its pool when it asks for the same size (other sizes and smaller allocations are
 * their own). So two caches whose pools hold the same bytes read the same physical pages: a
 * comparison of their block orders (or of two builds of the library) is not also a comparison
 * of where the OS and the hypervisor placed two buffers, which moved decode speed by up to 15%
 * between two buffers on the shared development machine. Only caches that never write K/V
 * while they are compared may share (decode reads only). Single-threaded set-up only. */
enum { TOOL_SHARED_MIN = 64u << 20 };
typedef struct tool_shared_pool {
    void *base;  /* the mapping, NULL until the first pool allocation */
    size_t size; /* its size as asked */
    int refs;    /* caches holding it */
} tool_shared_pool;
pkv_allocator tool_shared_allocator(tool_shared_pool *sp);

/* git commit / compiler / cpu string for benchmark headers (static storage). */
const char *tool_build_info(void);
const char *tool_cpu_name(void);

#endif
