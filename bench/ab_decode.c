/* ab_decode.c: decode attention of two builds of libpkv in one process, calls interleaved round
 * by round, for telling a change from the noise of a shared machine. scripts/ab-decode.sh builds
 * it: build A's global symbols renamed with the prefix a_ (objcopy), build B's as they are,
 * with tools/tool_util.c for the clock, medians and RNG.
 *
 * Each round times `calls` decode calls of A, then of B (odd rounds B first), each call on the
 * next layer so the K/V working set can exceed the caches. With EXT (optional), each call is a
 * pkv_attn_prefill of the batch's decodes plus an extend of EXT queries at the end of one more
 * sequence of CTX tokens (a chunked prefill batched beside the decodes, as servers batch).
 * Layout pc: build A reads contiguous tables and build B fragmented ones (paged), so with one
 * revision on both sides (scripts/ab-decode.sh HEAD HEAD ... pc) time B/A is paged / contiguous
 * of that build, interleaved as the other layouts are; with a small CTX x BATCH x LAYERS that
 * fits the L3 it is the ratio the kernels' arithmetic and the caches set, without the memory's
 * noise. Reports each side's median GB/s of K/V read and the median over rounds of time(B) /
 * time(A), with its quartiles. Build A's cache reads build B's pool (tool.h:
 * tool_loan_allocator). */
#include "tool.h" /* tools/tool_util.c: clock, median, RNG */

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { AB_HQ = 32, AB_HKV = 8, AB_D = 128, AB_BT = 16, AB_BT_MAX = 1024, AB_MAX_BATCH = 64, AB_SCATTER = 1024 };
enum { AB_MAX_ROUNDS = 101, AB_MAX_CALLS = 1000 };

typedef struct ab_opts {
    pkv_dtype dtype;
    uint32_t ctx, batch, layers, threads, rounds, calls, ext;
    uint32_t bt; /* block_tokens: AB_BT, or AB_BLOCK_TOKENS from the environment */
    uint32_t flags; /* pkv_attn_params.flags: AB_FLAGS_A / AB_FLAGS_B from the environment */
    const float *alibi; /* pkv_attn_params.alibi_slopes: AB_ALIBI_A / AB_ALIBI_B set to 1, else NULL */
    uint32_t chunk;     /* pkv_attn_params.attn_chunk: AB_CHUNK_A / AB_CHUNK_B, else 0 */
    int paged, shared; /* shared: paged, and sequences 1 .. batch - 1 forks of sequence 0 */
    uint32_t hq, hkv, d, vd; /* query heads, kv heads, head_dim, v_dim: AB_HQ, AB_HKV, AB_D, 0 or AB_SHAPE */
} ab_opts;

typedef struct ab_side {
    pkv_cache *c;
    pkv_seq seqs[AB_MAX_BATCH + 1]; /* + the extend's sequence */
    uint32_t next;
} ab_side;

static double ab_now(void) { return (double)tool_now_ns() * 1e-9; }

static float ab_unit(tool_rng *r) { return (float)(tool_rng_unit(r) * 2.0 - 1.0); }

/* Build A's public functions, as scripts/ab-decode.sh renames them. */
pkv_config a_pkv_config_default(void);
int a_pkv_cache_create(const pkv_config *cfg, pkv_cache **out);
void a_pkv_cache_destroy(pkv_cache *c);
int a_pkv_seq_create(pkv_cache *c, const void *salt, size_t salt_len, pkv_seq *out);
int a_pkv_seq_append(pkv_cache *c, pkv_seq s, const int32_t *tokens, uint32_t n, int32_t *slots_out);
int a_pkv_seq_release(pkv_cache *c, pkv_seq s);
int a_pkv_seq_fork(pkv_cache *c, pkv_seq parent, pkv_seq *child);
int a_pkv_seq_slots(pkv_cache *c, pkv_seq s, uint32_t start, uint32_t n, int32_t *slots);
int a_pkv_write_kv(pkv_cache *c, uint32_t layer, const int32_t *slots, uint32_t n, const void *k, const void *v,
                   pkv_dtype in_dtype);
pkv_attn_params a_pkv_attn_params_default(void);
int a_pkv_attn_prefill(pkv_cache *c, uint32_t layer, const pkv_attn_req *reqs, uint32_t n_reqs, const float *q,
                       float *out, const pkv_attn_params *p);
int a_pkv_attn_decode(pkv_cache *c, uint32_t layer, const pkv_seq *seqs, uint32_t n_seqs, const float *q, float *out,
                      const pkv_attn_params *p);

/* Build A's cache reads build B's pool (tool_loan_allocator): each side's calls read the same
 * pages, so where the OS placed two buffers is not part of the comparison. Both sides write the
 * same K/V (same seeds); a build whose pool has another size gets a buffer of its own. */
static tool_pool_loan ab_loan;

#define AB(x) a_##x
#include "ab_decode_body.h"
#undef AB
#define AB(x) x
#include "ab_decode_body.h"
#undef AB

static int usage(void) {
    fprintf(stderr, "usage: ab_decode DTYPE CTX BATCH LAYERS THREADS paged|contig|shared|pc ROUNDS CALLS [EXT]\n"
                    "  e.g. ab_decode f16 4096 16 2 2 paged 21 6  (BATCH <= %d, ROUNDS <= %d, CALLS <= %d;\n"
                    "  EXT <= CTX: each call also extends one more sequence by EXT queries;\n"
                    "  AB_BLOCK_TOKENS=N in the environment: N-token blocks, 1..%d, default %d;\n"
                    "  AB_FLAGS_A=F, AB_FLAGS_B=F: pkv_attn_params.flags of each side, default 0;\n"
                    "  AB_ALIBI_A=1, AB_ALIBI_B=1: that side's calls take ALiBi slopes 2^(-8 (h + 1) / HQ)\n"
                    "  (a build from before pkv_attn_params.alibi_slopes ignores them);\n"
                    "  AB_CHUNK_A=N, AB_CHUNK_B=N: that side's calls take chunks of N positions of local\n"
                    "  attention (pkv_attn_params.attn_chunk; a build from before it ignores them);\n"
                    "  AB_SHAPE=HQ,HKV,D[,VD]: query heads, kv heads, head_dim and v_dim (V in K), default %d,%d,%d)\n",
            AB_MAX_BATCH, AB_MAX_ROUNDS, AB_MAX_CALLS, AB_BT_MAX, AB_BT, AB_HQ, AB_HKV, AB_D);
    return 2;
}

static int parse_u32(const char *s, uint32_t lo, uint32_t hi, uint32_t *out) {
    char *end;
    const unsigned long v = strtoul(s, &end, 10);
    if (end == s || *end || v < lo || v > hi) return -1;
    *out = (uint32_t)v;
    return 0;
}

/* AB_SHAPE: "HQ,HKV,D" or "HQ,HKV,D,VD", each field as parse_u32 takes it; 0 or -1. */
static int parse_shape(const char *shape, ab_opts *o) {
    char buf[64];
    if (strlen(shape) >= sizeof buf) return -1;
    strcpy(buf, shape);
    uint32_t *const field[4] = {&o->hq, &o->hkv, &o->d, &o->vd};
    const uint32_t lo[4] = {1, 1, 1, 0}, hi[4] = {1024, 1024, 1024, 1024};
    uint32_t n = 0;
    for (char *tok = buf, *next; tok; tok = next, n++) {
        next = strchr(tok, ',');
        if (next) *next++ = '\0';
        if (n == 4 || parse_u32(tok, lo[n], hi[n], field[n])) return -1;
    }
    return n < 3 || o->hq % o->hkv || o->vd > o->d ? -1 : 0;
}

int main(int argc, char **argv) {
    ab_opts o = {0};
    int pc = 0; /* build A contiguous, build B paged */
    if (argc != 9 && argc != 10) return usage();
    int found = 0;
    for (int d = 0; d < PKV_DTYPE_COUNT; d++)
        if (!strcmp(argv[1], pkv_dtype_name((pkv_dtype)d))) o.dtype = (pkv_dtype)d, found = 1;
    if (!found || parse_u32(argv[2], 1, 1u << 20, &o.ctx) || parse_u32(argv[3], 1, AB_MAX_BATCH, &o.batch) ||
        parse_u32(argv[4], 1, 4096, &o.layers) || parse_u32(argv[5], 1, 256, &o.threads) ||
        parse_u32(argv[7], 1, AB_MAX_ROUNDS, &o.rounds) || parse_u32(argv[8], 1, AB_MAX_CALLS, &o.calls) ||
        (argc == 10 && parse_u32(argv[9], 0, o.ctx, &o.ext)))
        return usage();
    o.bt = AB_BT;
    const char *bt = getenv("AB_BLOCK_TOKENS");
    if (bt && *bt && parse_u32(bt, 1, AB_BT_MAX, &o.bt)) return usage();
    uint32_t fa = 0;
    const char *fla = getenv("AB_FLAGS_A"), *flb = getenv("AB_FLAGS_B");
    if ((fla && *fla && parse_u32(fla, 0, 255, &fa)) || (flb && *flb && parse_u32(flb, 0, 255, &o.flags)))
        return usage();
    o.hq = AB_HQ, o.hkv = AB_HKV, o.d = AB_D;
    const char *shape = getenv("AB_SHAPE");
    if (shape && *shape && parse_shape(shape, &o)) return usage();
    uint32_t ala = 0, alb = 0;
    const char *aa = getenv("AB_ALIBI_A"), *abb = getenv("AB_ALIBI_B");
    if ((aa && *aa && parse_u32(aa, 0, 1, &ala)) || (abb && *abb && parse_u32(abb, 0, 1, &alb))) return usage();
    static float slopes[1024]; /* the models' slopes for o.hq heads */
    for (uint32_t h = 0; h < o.hq; h++) slopes[h] = powf(2.0f, -8.0f * (float)(h + 1) / (float)o.hq);
    o.alibi = alb ? slopes : NULL;
    uint32_t cha = 0;
    const char *ca = getenv("AB_CHUNK_A"), *cb = getenv("AB_CHUNK_B");
    if ((ca && *ca && parse_u32(ca, 0, UINT32_MAX, &cha)) || (cb && *cb && parse_u32(cb, 0, UINT32_MAX, &o.chunk)))
        return usage();
    if (!strcmp(argv[6], "paged")) o.paged = 1;
    else if (!strcmp(argv[6], "shared")) o.paged = o.shared = 1;
    else if (!strcmp(argv[6], "pc")) o.paged = pc = 1;
    else if (strcmp(argv[6], "contig")) return usage();

    ab_opts oa = o; /* build A's: contiguous under pc */
    if (pc) oa.paged = 0;
    oa.flags = fa;
    oa.alibi = ala ? slopes : NULL;
    oa.chunk = cha;
    static ab_side a, b;
    int rc = 0;
    /* the same seed: both builds get the same pool and data (under pc, B's scattering draws
     * first, and A's contiguous writes land last in the shared pool: both read A's bytes) */
    tool_rng ra, rb;
    tool_rng_seed(&ra, 1), tool_rng_seed(&rb, 1);
    /* B first: it lends its pool to A, and is destroyed after A */
    if (ab_setup(&b, &o, &rb) < 0 || tool_pool_loan_from(b.c, &ab_loan) < 0 || a_ab_setup(&a, &oa, &ra) < 0) {
        fprintf(stderr, "ab_decode: set-up failed (out of memory, or a shape the builds refuse)\n");
        rc = 1;
    }
    const size_t nq = (size_t)(o.batch + o.ext) * o.hq * o.d;
    float *q = malloc(sizeof(float) * nq), *out = malloc(sizeof(float) * nq);
    tool_rng rq;
    tool_rng_seed(&rq, 2);
    if (!q || !out) rc = 1;
    for (size_t i = 0; i < nq && rc == 0; i++) q[i] = ab_unit(&rq);
    double ta[AB_MAX_ROUNDS], tb[AB_MAX_ROUNDS], ratio[AB_MAX_ROUNDS];
    if (rc == 0 && (a_ab_time(&a, &oa, q, out) < 0 || ab_time(&b, &o, q, out) < 0)) rc = 1; /* warm-up */
    for (uint32_t r = 0; r < o.rounds && rc == 0; r++) {
        if (r & 1) tb[r] = ab_time(&b, &o, q, out), ta[r] = a_ab_time(&a, &oa, q, out);
        else ta[r] = a_ab_time(&a, &oa, q, out), tb[r] = ab_time(&b, &o, q, out);
        if (ta[r] < 0 || tb[r] < 0) rc = 1;
        ratio[r] = tb[r] / ta[r];
    }
    if (rc == 0) {
        const double bytes = (double)o.ctx * (o.batch + (o.ext > 0)) * o.hkv *
                             (double)pkv_dtype_row_bytes(o.dtype, o.d) * (o.vd ? 1.0 : 2.0);
        const double ma = tool_median(ta, o.rounds), mb = tool_median(tb, o.rounds), mr = tool_median(ratio, o.rounds);
        char ext[48] = "";
        if (o.ext) snprintf(ext, sizeof ext, " + an extend of %u", o.ext);
        char fl[96] = "";
        if (oa.flags || o.flags) snprintf(fl, sizeof fl, " flags A %u B %u", oa.flags, o.flags);
        if (oa.alibi || o.alibi)
            snprintf(fl + strlen(fl), sizeof fl - strlen(fl), " ALiBi A %d B %d", oa.alibi != NULL, o.alibi != NULL);
        if (oa.chunk || o.chunk) snprintf(fl + strlen(fl), sizeof fl - strlen(fl), " chunk A %u B %u", oa.chunk, o.chunk);
        printf("%s ctx %u batch %u%s block %u layers %u threads %u %s%s, %u rounds x %u calls: A %.2f GB/s, "
               "B %.2f GB/s; time B/A median %.3f (quartiles %.3f %.3f)\n",
               argv[1], o.ctx, o.batch, ext, o.bt, o.layers, o.threads, argv[6], fl, o.rounds, o.calls, bytes / ma * 1e-9,
               bytes / mb * 1e-9, mr, ratio[o.rounds / 4], ratio[(3 * o.rounds) / 4]);
    } else if (a.c && b.c) {
        fprintf(stderr, "ab_decode: a decode call failed\n");
    }
    if (a.c) a_ab_free(&a);
    if (b.c) ab_free(&b);
    free(q), free(out);
    return rc;
}
