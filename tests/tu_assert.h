/* tu_assert.h: a float assert that NaN and infinities cannot pass. cmocka's assert_float_equal
 * (1.1.x) passes a NaN or an infinite value (both of its comparisons are false for them), and
 * with epsilon 0 still takes a relative difference of FLT_EPSILON. Include after cmocka.h. */
#ifndef PKV_TU_ASSERT_H
#define PKV_TU_ASSERT_H

#include <math.h>
#include <stdio.h>

static inline int tu_near_failed(double a, double b, double eps, const char *expr, const char *file, int line) {
    if (fabs(a - b) <= eps) return 0; /* false for NaN, and for an infinite a or b */
    print_error("%s:%d: %s = %.9g, want %.9g within %.3g\n", file, line, expr, a, b, eps);
    return 1;
}
/* |a - b| <= eps, as doubles; eps 0 is exact equality */
#define TU_NEAR(a, b, eps)                                                                                      \
    do {                                                                                                        \
        if (tu_near_failed((double)(a), (double)(b), (double)(eps), #a, __FILE__, __LINE__)) fail();            \
    } while (0)

#endif
