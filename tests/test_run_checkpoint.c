/* test_run_checkpoint.c: corrupted, truncated and inconsistent llama2.c checkpoints give the
 * documented one-line error (model_load) and exit status 2 from `pkv run`, never a crash. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include "../tools/model.c"
#include "test_run_spawn.h"

/* A small valid checkpoint: dim 8, hidden 12, 2 layers, 2 heads, 1 kv head, vocab 16,
 * seq_len 8; shared classifier unless vocab is negative. Returns its size in bytes. */
static size_t small_model(uint8_t **out, int32_t vocab) {
    int32_t h[7] = {8, 12, 2, 2, 1, vocab, 8};
    model_config p = {8, 12, 2, 2, 1, vocab, 8, 0, 0, 0};
    assert_int_equal(check_header(&p, NULL, 0), 0);
    size_t n = (size_t)weight_floats(&p);
    size_t bytes = 28 + n * 4;
    uint8_t *b = malloc(bytes);
    assert_non_null(b);
    memcpy(b, h, 28);
    float *w = (float *)(b + 28);
    for (size_t i = 0; i < n; i++) w[i] = (float)((int)(i % 17) - 8) * 0.03125f;
    *out = b;
    return bytes;
}

static char tmp_path[64];

static const char *write_tmp(const void *data, size_t n) {
    snprintf(tmp_path, sizeof tmp_path, "/tmp/pkv-ckpt-XXXXXX");
    int fd = mkstemp(tmp_path);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, data, n), (ssize_t)n);
    close(fd);
    return tmp_path;
}

/* model_load must fail with a message containing `want`; pkv run must exit 2 with it. */
static void expect_bad(const void *data, size_t n, const char *want) {
    const char *path = write_tmp(data, n);
    model m;
    char err[512] = "";
    if (model_load(path, &m, err, sizeof err) == 0) fail_msg("loaded a bad checkpoint (want '%s')", want);
    if (!strstr(err, want)) fail_msg("error '%s' does not say '%s'", err, want);
    assert_null(m.data);
    char *argv[] = {"pkv", "run", (char *)path, "-t", "0", "-n", "4", NULL};
    char *out = NULL, *e = NULL;
    int rc = run_cli(argv, &out, &e);
    if (rc != 2) fail_msg("pkv run exited %d (want 2) for '%s': %s", rc, want, e ? e : "");
    if (!strstr(e, want)) fail_msg("pkv run said '%s', want '%s'", e, want);
    assert_string_equal(out, "");
    free(out), free(e);
    unlink(path);
}

static void set_hdr(uint8_t *b, int field, int32_t v) { memcpy(b + 4 * field, &v, 4); }

static void test_valid_small_model_runs(void **state) {
    (void)state;
    for (int shared = 0; shared < 2; shared++) {
        uint8_t *b;
        size_t n = small_model(&b, shared ? 16 : -16);
        const char *path = write_tmp(b, n);
        model m;
        char err[256];
        assert_int_equal(model_load(path, &m, err, sizeof err), 0);
        assert_int_equal(m.cfg.vocab_size, 16);
        assert_int_equal(m.cfg.shared_classifier, shared);
        assert_int_equal(m.cfg.head_size, 4);
        assert_int_equal(m.cfg.kv_dim, 4);
        /* the classifier is the embedding when shared, else the last vocab*dim floats */
        if (shared) assert_ptr_equal(m.wcls, m.tok_emb);
        else assert_ptr_equal(m.wcls + 16 * 8, m.data + m.n_floats);
        model_free(&m);
        char *argv[] = {"pkv", "run", (char *)path, "-t", "0", "-n", "6", "--batch", "2", NULL};
        char *out, *e;
        int rc = run_cli(argv, &out, &e);
        if (rc != 0) fail_msg("pkv run on a valid small model exited %d: %s", rc, e);
        /* two lines of 6 ids in [0, 16) or fewer if BOS came */
        int lines = 0;
        for (char *p = out; *p; p++) lines += *p == '\n';
        assert_int_equal(lines, 2);
        free(out), free(e), free(b);
        unlink(path);
    }
}

static void test_truncated_files(void **state) {
    (void)state;
    uint8_t *b;
    size_t n = small_model(&b, 16);
    expect_bad(b, 0, "truncated header");
    expect_bad(b, 10, "truncated header");
    expect_bad(b, 27, "truncated header");
    expect_bad(b, 28, "truncated file");
    expect_bad(b, 28 + 4 * 100, "truncated file");
    expect_bad(b, n / 2, "truncated file");
    expect_bad(b, n - 1, "truncated file");
    expect_bad(b, n - 4, "truncated file");
    uint8_t *big = calloc(n + 8, 1);
    memcpy(big, b, n);
    expect_bad(big, n + 4, "larger than its header says");
    free(big);
    free(b);
}

static void test_bad_header_values(void **state) {
    (void)state;
    uint8_t *b;
    size_t n = small_model(&b, 16);
    struct { int field; int32_t v; const char *want; } cases[] = {
        {0, 0, "dim = 0"},
        {0, -64, "dim = -64"},
        {1, 0, "hidden_dim = 0"},
        {2, -1, "n_layers = -1"},
        {3, 0, "n_heads = 0"},
        {4, 0, "n_kv_heads = 0"},
        {5, 0, "vocab_size = 0"},
        {5, INT32_MIN, "vocab_size"},
        {6, 0, "seq_len = 0"},
        {3, 3, "n_heads = 3 does not divide dim = 8"},
        {4, 3, "n_kv_heads = 3 does not divide n_heads = 2"},
        {3, 8, "head size 1"},                 /* dim 8 / 8 heads: odd head size */
        {0, 1 << 30, "out of range"},          /* oversized: never allocated */
        {1, INT32_MAX, "out of range"},
        {2, 1 << 24, "n_layers"},
        {5, 1 << 30, "vocab_size"},
        {5, -(1 << 30), "vocab_size"},
        {6, INT32_MAX, "seq_len"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        uint8_t *c = malloc(n);
        memcpy(c, b, n);
        set_hdr(c, cases[i].field, cases[i].v);
        expect_bad(c, n, cases[i].want);
        free(c);
    }
    /* consistent-looking header whose sizes disagree with the file: seq_len changes the
     * (skipped) RoPE table size, so a file one RoPE row short is "truncated" */
    uint8_t *c = malloc(n);
    memcpy(c, b, n);
    set_hdr(c, 6, 16);
    expect_bad(c, n, "truncated file");
    set_hdr(c, 6, 4);
    expect_bad(c, n, "larger than its header says");
    /* a shared/unshared classifier flip changes the expected size too */
    set_hdr(c, 6, 8);
    set_hdr(c, 5, -16);
    expect_bad(c, n, "truncated file");
    free(c);
    free(b);
}

static void test_non_finite_weights(void **state) {
    (void)state;
    uint8_t *b;
    size_t n = small_model(&b, 16);
    float nan = NAN;
    memcpy(b + n - 4 * 7, &nan, 4);
    expect_bad(b, n, "non-finite");
    free(b);
}

static void test_missing_file(void **state) {
    (void)state;
    model m;
    char err[256];
    assert_int_equal(model_load("/nonexistent/pkv-model.bin", &m, err, sizeof err), -1);
    assert_non_null(strstr(err, "cannot open"));
    char *argv[] = {"pkv", "run", "/nonexistent/pkv-model.bin", NULL};
    char *e;
    assert_int_equal(run_cli(argv, NULL, &e), 2);
    assert_non_null(strstr(e, "cannot open"));
    free(e);
    assert_int_equal(model_load("/tmp", &m, err, sizeof err), -1); /* a directory */
    /* a FIFO is refused at once, not waited on (as a model, and as -z's tokenizer) */
    char fifo[] = "/tmp/pkv-fifo-XXXXXX";
    assert_non_null(mkdtemp(fifo));
    char path[64];
    snprintf(path, sizeof path, "%s/f", fifo);
    assert_int_equal(mkfifo(path, 0600), 0);
    assert_int_equal(model_load(path, &m, err, sizeof err), -1);
    assert_non_null(strstr(err, "not a regular file"));
    model_tokenizer t;
    assert_int_equal(model_tokenizer_load(path, 16, &t, err, sizeof err), -1);
    assert_non_null(strstr(err, "not a regular file"));
    unlink(path);
    rmdir(fifo);
}

/* A sequence longer than the library's default table capacity (4096 blocks): pkv run sizes
 * max_blocks_per_seq for its own pool (it failed at block 4097 before). seq_len 4200 at
 * 1-token blocks, a 4100-token prompt. */
static void test_long_sequence(void **state) {
    (void)state;
    enum { SEQ = 4200, PROMPT = 4100 };
    int32_t h[7] = {8, 12, 1, 2, 1, 16, SEQ};
    model_config p = {8, 12, 1, 2, 1, 16, SEQ, 0, 0, 0};
    assert_int_equal(check_header(&p, NULL, 0), 0);
    const size_t n = (size_t)weight_floats(&p), bytes = 28 + n * 4;
    uint8_t *b = malloc(bytes);
    assert_non_null(b);
    memcpy(b, h, 28);
    float *w = (float *)(b + 28);
    for (size_t i = 0; i < n; i++) w[i] = (float)((int)(i % 17) - 8) * 0.03125f;
    const char *path = write_tmp(b, bytes);
    char *ids = malloc(PROMPT * 3 + 1), *o = ids;
    for (int i = 0; i < PROMPT; i++) o += sprintf(o, "%s%d", i ? "," : "", 2 + i % 13);
    char *argv[] = {"pkv", "run", (char *)path, "-t", "0", "-n", "4110", "--block-tokens", "1", "--prompt-ids", ids, NULL};
    char *out, *e;
    const int rc = run_cli(argv, &out, &e);
    if (rc != 0) fail_msg("pkv run over %d tokens at 1-token blocks exited %d: %s", PROMPT, rc, e);
    assert_non_null(strstr(e, "prefill 4100 prompt tokens"));
    assert_non_null(strstr(e, "checker ok"));
    free(out), free(e), free(ids), free(b);
    unlink(path);
}

/* tokenizer.bin: a valid one decodes pieces (BOS strips the leading space, <0xXX> is a byte);
 * a truncated one is an error. */
static void test_tokenizer(void **state) {
    (void)state;
    const char *pieces[4] = {"<unk>", "\n<s>\n", " Once", "<0x41>"};
    uint8_t buf[256];
    size_t n = 0;
    int32_t maxlen = 8;
    memcpy(buf + n, &maxlen, 4), n += 4;
    for (int i = 0; i < 4; i++) {
        float score = (float)i;
        int32_t len = (int32_t)strlen(pieces[i]);
        memcpy(buf + n, &score, 4), n += 4;
        memcpy(buf + n, &len, 4), n += 4;
        memcpy(buf + n, pieces[i], (size_t)len), n += (size_t)len;
    }
    const char *path = write_tmp(buf, n);
    model_tokenizer t;
    char err[256], out[32];
    assert_int_equal(model_tokenizer_load(path, 4, &t, err, sizeof err), 0);
    assert_string_equal(model_tokenizer_decode(&t, 1, 2, out, sizeof out), "Once");
    assert_string_equal(model_tokenizer_decode(&t, 2, 2, out, sizeof out), " Once");
    assert_string_equal(model_tokenizer_decode(&t, 2, 3, out, sizeof out), "A");
    assert_string_equal(model_tokenizer_decode(&t, 2, 99, out, sizeof out), "");
    model_tokenizer_free(&t);
    unlink(path);
    path = write_tmp(buf, n - 3);
    assert_int_equal(model_tokenizer_load(path, 4, &t, err, sizeof err), -1);
    assert_non_null(strstr(err, "truncated"));
    unlink(path);
}

/* pkv run -z prints a piece whole, up to max_token_length (it cut them at 511 bytes): a
 * tokenizer for the small model (vocab 16) whose token 5 is 3000 bytes of 'x'. */
static void test_tokenizer_long_piece(void **state) {
    (void)state;
    enum { LONG = 3000 };
    uint8_t *b;
    size_t n = small_model(&b, 16);
    char model_path[64];
    snprintf(model_path, sizeof model_path, "%s", write_tmp(b, n));
    free(b);
    uint8_t *tb = malloc(4 + 16 * 8 + LONG + 16 * 2);
    size_t tn = 0;
    int32_t maxlen = LONG;
    memcpy(tb + tn, &maxlen, 4), tn += 4;
    for (int i = 0; i < 16; i++) {
        const float score = 0;
        const int32_t len = i == 5 ? LONG : 1;
        memcpy(tb + tn, &score, 4), tn += 4;
        memcpy(tb + tn, &len, 4), tn += 4;
        if (i == 5) memset(tb + tn, 'x', LONG);
        else tb[tn] = (uint8_t)('a' + i);
        tn += (size_t)len;
    }
    char tok_path[64];
    snprintf(tok_path, sizeof tok_path, "%s", write_tmp(tb, tn));
    free(tb);
    char *argv[] = {"pkv", "run", model_path, "-z", tok_path, "--prompt-ids", "1,5", "-n", "3", "-t", "0", NULL};
    char *out, *e;
    const int rc = run_cli(argv, &out, &e);
    if (rc != 0) fail_msg("pkv run -z exited %d: %s", rc, e);
    char *want = malloc(LONG + 1);
    memset(want, 'x', LONG), want[LONG] = 0;
    if (!strstr(out, want)) fail_msg("the 3000-byte piece was not printed whole (%zu bytes out)", strlen(out));
    free(want), free(out), free(e);
    unlink(model_path), unlink(tok_path);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_valid_small_model_runs), cmocka_unit_test(test_truncated_files),
        cmocka_unit_test(test_bad_header_values),      cmocka_unit_test(test_non_finite_weights),
        cmocka_unit_test(test_missing_file),
        cmocka_unit_test(test_long_sequence),           cmocka_unit_test(test_tokenizer),
        cmocka_unit_test(test_tokenizer_long_piece),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
