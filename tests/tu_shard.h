/* tu_shard.h: runs a cmocka group whole or one shard of it. PKV_TEST_SHARD="k/n" (0 <= k < n)
 * keeps the tests whose function has ordinal i % n == k, counting the distinct functions in
 * order (the entries of one function, one a backend, stay together); PKV_TEST_FILTER picks tests
 * by name as well and PKV_TEST_SKIP leaves tests out by name (globs, comma-separated, fnmatch(3):
 * "test_oracle_prefill*"). CMake's PKV_TEST_SHARDS
 * registers the longest tests as n ctest entries of this kind, so that ctest -j runs their
 * shards side by side: scripts/test.sh's stages do (2), and scripts/test-arm64.sh (3), where qemu
 * makes test_attn run for minutes. Include after cmocka.h. */
#ifndef PKV_TU_SHARD_H
#define PKV_TU_SHARD_H

#include <fnmatch.h>
#include <stdlib.h>
#include <string.h>

/* Whether name matches one of the comma-separated globs in list (NULL or empty: none). */
static inline int tu_matches(const char *list, const char *name) {
    char glob[256];
    for (const char *p = list; p && *p;) {
        const char *end = strchr(p, ',');
        const size_t n = end ? (size_t)(end - p) : strlen(p);
        if (n > 0 && n < sizeof glob) {
            memcpy(glob, p, n);
            glob[n] = '\0';
            if (fnmatch(glob, name, 0) == 0) return 1;
        }
        p += n + (end != NULL);
    }
    return 0;
}

static inline int tu_run_tests(const char *group, const struct CMUnitTest *tests, size_t n_tests) {
    const char *filter = getenv("PKV_TEST_FILTER"), *skip = getenv("PKV_TEST_SKIP");
    const char *shard = getenv("PKV_TEST_SHARD");
    unsigned long k = 0, n = 1;
    if (shard && *shard) {
        char *end = NULL;
        k = strtoul(shard, &end, 10);
        if (*end == '/') n = strtoul(end + 1, &end, 10);
        if (*end || *shard == '/' || n == 0 || n > 1000 || k >= n) {
            print_error("PKV_TEST_SHARD=%s: want k/n with 0 <= k < n <= 1000\n", shard);
            return 1;
        }
    }
    struct CMUnitTest *picked = malloc(sizeof *picked * (n_tests ? n_tests : 1));
    if (!picked) return 1;
    size_t n_picked = 0, ordinal = 0;
    for (size_t i = 0; i < n_tests; i++) {
        if (i > 0 && strcmp(tests[i].name, tests[i - 1].name)) ordinal++;
        if (ordinal % n == k && (!filter || !*filter || tu_matches(filter, tests[i].name)) &&
            !tu_matches(skip, tests[i].name))
            picked[n_picked++] = tests[i];
    }
    const int rc = _cmocka_run_group_tests(group, picked, n_picked, NULL, NULL);
    free(picked);
    return rc;
}

#define TU_RUN_TESTS(tests) tu_run_tests(#tests, tests, sizeof(tests) / sizeof((tests)[0]))

#endif
