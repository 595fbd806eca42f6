/* test_core_fault.c: fault injection through the allocator hook (SQLite faultsim style):
 * fail the k-th allocation of pkv_cache_create for every k it makes: PKV_ENOMEM, nothing
 * leaked, no bad free; then a scripted workload after creation allocates nothing at all. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include "support_util.h"

#include <string.h>

/* A workload touching every operation; returns with every sequence released. */
static void workload(pkv_cache *c) {
    pkv_seq a, b, d, e, pin;
    TU_OK(pkv_seq_create(c, "tenant", 6, &a));
    int32_t toks[40], slots[40];
    tu_tokens(toks, 40, 7);
    TU_OK(pkv_seq_append(c, a, toks, 21, slots));
    TU_WRITE_PAT(c, a, 0, 21, 1);
    TU_OK(pkv_seq_commit(c, a, 21));
    TU_OK(pkv_seq_fork(c, a, &b));
    TU_OK(pkv_seq_append(c, b, toks, 3, NULL)); /* CoW */
    TU_WRITE_PAT(c, b, 21, 3, 2);
    TU_OK(pkv_pin_create(c, a, 16, &pin));
    TU_OK(pkv_seq_create(c, "tenant", 6, &d));
    uint32_t reused = 0;
    TU_OK(pkv_seq_match_prefix(c, d, toks, 30, &reused));
    TU_OK(pkv_seq_truncate(c, b, 5));
    float k[40 * 2 * 8], v[40 * 2 * 8];
    TU_OK(pkv_seq_gather(c, a, 1, 0, 21, k, v));
    int32_t bt[4 * 16], sl[4], ip[5], idx[64], lpl[4];
    pkv_seq list[3] = {a, b, d};
    TU_OK(pkv_export_dense(c, list, 3, 16, bt, sl));
    TU_OK(pkv_export_csr(c, list, 3, ip, idx, 64, lpl, NULL));
    pkv_stats st;
    TU_OK(pkv_cache_get_stats(c, &st));
    TU_CHECK(c);
    /* attention: whatever its status (the kernels may not be built yet), it must not allocate */
    float q[2 * 8] = {0}, out[2 * 8];
    int rc = pkv_attn_decode(c, 0, &a, 1, q, out, NULL);
    assert_true(rc == PKV_OK || rc == PKV_ENOTSUP);
    pkv_attn_req r = {a, 0, 1};
    rc = pkv_attn_prefill(c, 0, &r, 1, q, out, NULL);
    assert_true(rc == PKV_OK || rc == PKV_ENOTSUP);
    TU_OK(pkv_seq_create(c, NULL, 0, &e));
    /* exhaust the pool (eviction of cached blocks included), then give it all back */
    int32_t big[256];
    tu_tokens(big, 256, 1);
    while (pkv_seq_append(c, e, big, 4, NULL) == PKV_OK) {
    }
    TU_OK(pkv_pin_release(c, pin));
    TU_OK(pkv_seq_release(c, a));
    TU_OK(pkv_seq_release(c, b));
    TU_OK(pkv_seq_release(c, d));
    TU_OK(pkv_seq_release(c, e));
    TU_OK(pkv_cache_reset(c));
    TU_CHECK(c);
}

static void run_faults(pkv_config cfg, const char *what) {
    tu_alloc_state as;
    tu_alloc_reset(&as, -1);
    cfg.allocator = tu_allocator(&as);
    pkv_cache *c = tu_create(&cfg);
    const long n_create = as.n_calls;
    assert_true(n_create >= 2);
    assert_int_equal(as.n_bad_align, 0);
    workload(c);
    if (as.n_calls != n_create)
        fail_msg("%s: the workload after create made %ld allocation(s)", what, as.n_calls - n_create);
    pkv_cache_destroy(c);
    assert_int_equal(as.n_live, 0);
    assert_int_equal(as.live_bytes, 0);
    assert_int_equal(as.n_bad_free, 0);

    for (long k = 0; k < n_create; k++) {
        tu_alloc_reset(&as, k);
        pkv_cache *x = NULL;
        int rc = pkv_cache_create(&cfg, &x);
        if (rc != PKV_ENOMEM)
            fail_msg("%s: failing allocation %ld of %ld: got %d (%s), want PKV_ENOMEM", what, k, n_create, rc,
                     pkv_strerror(rc));
        assert_null(x);
        assert_int_equal(as.n_failed, 1);
        assert_int_equal(as.n_calls, k + 1); /* it gives up at the first failure */
        if (as.n_live != 0 || as.live_bytes != 0)
            fail_msg("%s: failing allocation %ld leaked %ld block(s), %zu bytes", what, k, as.n_live, as.live_bytes);
        assert_int_equal(as.n_bad_free, 0);
    }
    /* the hook fails everything from now on: a created cache keeps working */
    tu_alloc_reset(&as, n_create);
    c = tu_create(&cfg);
    workload(c);
    assert_int_equal(as.n_failed, 0);
    pkv_cache_destroy(c);
    assert_int_equal(as.n_live, 0);
    print_message("%s: %ld allocations in create, each failed once: clean\n", what, n_create);
}

static void test_fault_prefix_on(void **state) {
    (void)state;
    pkv_config cfg = tu_config(32, 4, 2, 2, 8, PKV_DTYPE_F32);
    cfg.enable_prefix_cache = 1;
    cfg.max_seqs = 8;
    run_faults(cfg, "prefix on, f32");
}

static void test_fault_prefix_off_f16_threads(void **state) {
    (void)state;
    pkv_config cfg = tu_config(24, 8, 2, 2, 8, PKV_DTYPE_F16);
    cfg.n_threads = 2;
    cfg.max_seqs = 5;
    run_faults(cfg, "prefix off, f16, 2 threads");
}

static void test_fault_budget_sized(void **state) {
    (void)state;
    pkv_config cfg = tu_config(0, 4, 2, 2, 8, PKV_DTYPE_BF16);
    cfg.mem_budget_bytes = 40 * 2 * 2 * 2 * 4 * 8 * 2; /* 40 blocks */
    cfg.enable_prefix_cache = 1;
    run_faults(cfg, "budget-sized, bf16");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fault_prefix_on),
        cmocka_unit_test(test_fault_prefix_off_f16_threads),
        cmocka_unit_test(test_fault_budget_sized),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
