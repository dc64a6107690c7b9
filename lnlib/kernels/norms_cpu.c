/* Row-wise LayerNorm and RMSNorm, forward and backward, for the CPU.
 *
 * Loaded by lnlib/_cpu_kernels.py (compiled once, lazily, with the system C compiler) and
 * called on contiguous rows of float32 or float64, one call per chunk of rows so that chunks
 * run in parallel threads (ctypes releases the GIL during the call).
 *
 * Each row is read from memory once: the first pass over it brings it into cache, the
 * second and third passes (centred squares, output) find it there. That is the whole point:
 * LayerNorm is memory-bound, so the time is set by the bytes moved, not by the arithmetic.
 *
 * Guarantees, matched by the tests:
 *  - two-pass statistics: the mean first, corrected by the mean of the deviations from it
 *    (the corrected two-pass algorithm of Chan, Golub and LeVeque, 1983), then the squared
 *    deviations from the corrected mean: never E[x^2] - E[x]^2;
 *  - every sum is accumulated in LANES independent partial sums, in an order that depends on
 *    the row length only (never on the row's address or its place in the batch), then the
 *    partial sums are added pairwise: results are bitwise batch invariant and deterministic;
 *  - compiled with -ffp-contract=off, so no multiply-add is fused behind our back.
 *
 * Book: chapter "Implementation", section "A compiled kernel".
 */
#include <math.h>
#include <stddef.h>

#define LANES 16

#define DEFINE_KERNELS(T, SUF)                                                               \
                                                                                             \
/* sum of (x[i] - shift) (power 1) or of (x[i] - shift) ** 2 (power 2), in LANES partial   \
 * sums */                                                                                   \
static T row_sum_##SUF(const T *x, ptrdiff_t n, T shift, int power)                         \
{                                                                                            \
    T acc[LANES] = {0};                                                                      \
    T tail = 0;                                                                              \
    ptrdiff_t i = 0;                                                                         \
    if (power == 1) {                                                                        \
        for (; i + LANES <= n; i += LANES)                                                   \
            for (int k = 0; k < LANES; k++) acc[k] += x[i + k] - shift;                      \
        for (; i < n; i++) tail += x[i] - shift;                                             \
    } else {                                                                                 \
        for (; i + LANES <= n; i += LANES)                                                   \
            for (int k = 0; k < LANES; k++) {                                                \
                T d = x[i + k] - shift;                                                      \
                acc[k] += d * d;                                                             \
            }                                                                                \
        for (; i < n; i++) { T d = x[i] - shift; tail += d * d; }                            \
    }                                                                                        \
    for (int w = LANES / 2; w > 0; w /= 2)                                                   \
        for (int k = 0; k < w; k++) acc[k] += acc[k + w];                                    \
    return acc[0] + tail;                                                                    \
}                                                                                            \
                                                                                             \
/* sum of a[i] * b[i] * (c ? c[i] : 1), in LANES partial sums */                             \
static T row_dot3_##SUF(const T *a, const T *b, const T *c, ptrdiff_t n)                    \
{                                                                                            \
    T acc[LANES] = {0};                                                                      \
    T tail = 0;                                                                              \
    ptrdiff_t i = 0;                                                                         \
    if (c) {                                                                                 \
        for (; i + LANES <= n; i += LANES)                                                   \
            for (int k = 0; k < LANES; k++) acc[k] += a[i + k] * b[i + k] * c[i + k];        \
        for (; i < n; i++) tail += a[i] * b[i] * c[i];                                       \
    } else {                                                                                 \
        for (; i + LANES <= n; i += LANES)                                                   \
            for (int k = 0; k < LANES; k++) acc[k] += a[i + k] * b[i + k];                   \
        for (; i < n; i++) tail += a[i] * b[i];                                              \
    }                                                                                        \
    for (int w = LANES / 2; w > 0; w /= 2)                                                   \
        for (int k = 0; k < w; k++) acc[k] += acc[k + w];                                    \
    return acc[0] + tail;                                                                    \
}                                                                                            \
                                                                                             \
/* With g = dy * (w ? w : 1): *sum_g = sum of g and *sum_gxc = sum of g * (x - shift), both in \
 * LANES partial sums, in one pass over the row. */                                          \
static void row_sums_g_##SUF(const T *dy, const T *w, const T *x, T shift, ptrdiff_t n,     \
                             T *sum_g, T *sum_gxc)                                           \
{                                                                                            \
    T a1[LANES] = {0}, a2[LANES] = {0};                                                      \
    T t1 = 0, t2 = 0;                                                                        \
    ptrdiff_t i = 0;                                                                         \
    if (w) {                                                                                 \
        for (; i + LANES <= n; i += LANES)                                                   \
            for (int k = 0; k < LANES; k++) {                                                \
                T g = dy[i + k] * w[i + k];                                                  \
                a1[k] += g;                                                                  \
                a2[k] += g * (x[i + k] - shift);                                             \
            }                                                                                \
        for (; i < n; i++) { T g = dy[i] * w[i]; t1 += g; t2 += g * (x[i] - shift); }        \
    } else {                                                                                 \
        for (; i + LANES <= n; i += LANES)                                                   \
            for (int k = 0; k < LANES; k++) {                                                \
                a1[k] += dy[i + k];                                                          \
                a2[k] += dy[i + k] * (x[i + k] - shift);                                     \
            }                                                                                \
        for (; i < n; i++) { t1 += dy[i]; t2 += dy[i] * (x[i] - shift); }                    \
    }                                                                                        \
    for (int h = LANES / 2; h > 0; h /= 2)                                                   \
        for (int k = 0; k < h; k++) { a1[k] += a1[k + h]; a2[k] += a2[k + h]; }              \
    *sum_g = a1[0] + t1;                                                                     \
    *sum_gxc = a2[0] + t2;                                                                   \
}                                                                                            \
                                                                                             \
/* LayerNorm forward on rows [0, m) of x (row stride ldx), y (row stride ldy).              \
 * weight and bias may be NULL. */                                                           \
void layer_norm_fwd_##SUF(const T *restrict x, ptrdiff_t ldx, T *restrict y, ptrdiff_t ldy,  \
                          T *restrict mean, T *restrict rstd, const T *restrict weight, const T *restrict bias, ptrdiff_t m, ptrdiff_t n, double eps) \
{                                                                                            \
    for (ptrdiff_t r = 0; r < m; r++) {                                                      \
        const T *xr = x + r * ldx;                                                           \
        T *yr = y + r * ldy;                                                                 \
        /* corrected two-pass: the deviations from the first mean say how far it is off; the \
         * row is in cache after the first pass, so the later passes cost little */          \
        T mu0 = row_sum_##SUF(xr, n, 0, 1) / (T)n;                                           \
        T mu = mu0 + row_sum_##SUF(xr, n, mu0, 1) / (T)n;                                    \
        T var = row_sum_##SUF(xr, n, mu, 2) / (T)n;                                          \
        T rs = (T)1 / (T)sqrt((double)(var + (T)eps));                                      \
        mean[r] = mu;                                                                        \
        rstd[r] = rs;                                                                        \
        if (weight && bias)                                                                  \
            for (ptrdiff_t i = 0; i < n; i++) yr[i] = (xr[i] - mu) * rs * weight[i] + bias[i]; \
        else if (weight)                                                                     \
            for (ptrdiff_t i = 0; i < n; i++) yr[i] = (xr[i] - mu) * rs * weight[i];         \
        else if (bias)                                                                       \
            for (ptrdiff_t i = 0; i < n; i++) yr[i] = (xr[i] - mu) * rs + bias[i];           \
        else                                                                                 \
            for (ptrdiff_t i = 0; i < n; i++) yr[i] = (xr[i] - mu) * rs;                     \
    }                                                                                        \
}                                                                                            \
                                                                                             \
/* LayerNorm backward: dx = rstd (g - mean(g) - xhat mean(g xhat)), g = dy weight;           \
 * dweight += dy xhat and dbias += dy, summed over the rows of this call in row order. */    \
void layer_norm_bwd_##SUF(const T *restrict dy, ptrdiff_t lddy, const T *restrict x, ptrdiff_t ldx, \
                          const T *restrict mean, const T *restrict rstd, const T *restrict weight, \
                          T *restrict dx, ptrdiff_t lddx, T *restrict dweight, T *restrict dbias, ptrdiff_t m, ptrdiff_t n)                    \
{                                                                                            \
    for (ptrdiff_t r = 0; r < m; r++) {                                                      \
        const T *dyr = dy + r * lddy, *xr = x + r * ldx;                                     \
        T *dxr = dx + r * lddx;                                                              \
        T mu = mean[r], rs = rstd[r];                                                        \
        T sum_g, sum_gxc;                                                                    \
        row_sums_g_##SUF(dyr, weight, xr, mu, n, &sum_g, &sum_gxc);                          \
        T sum_gxhat = sum_gxc * rs;  /* sum of g * xhat */                                   \
        T c1 = sum_g / (T)n, c2 = sum_gxhat / (T)n;                                          \
        if (weight)                                                                          \
            for (ptrdiff_t j = 0; j < n; j++) {                                              \
                T xhat = (xr[j] - mu) * rs;                                                  \
                dxr[j] = rs * (dyr[j] * weight[j] - c1 - xhat * c2);                         \
                dweight[j] += dyr[j] * xhat;                                                 \
                dbias[j] += dyr[j];                                                          \
            }                                                                                \
        else                                                                                 \
            for (ptrdiff_t j = 0; j < n; j++) {                                              \
                T xhat = (xr[j] - mu) * rs;                                                  \
                dxr[j] = rs * (dyr[j] - c1 - xhat * c2);                                     \
                dweight[j] += dyr[j] * xhat;                                                 \
                dbias[j] += dyr[j];                                                          \
            }                                                                                \
    }                                                                                        \
}                                                                                            \
                                                                                             \
void rms_norm_fwd_##SUF(const T *restrict x, ptrdiff_t ldx, T *restrict y, ptrdiff_t ldy,    \
                        T *restrict rstd, const T *restrict weight, ptrdiff_t m, ptrdiff_t n, double eps)               \
{                                                                                            \
    for (ptrdiff_t r = 0; r < m; r++) {                                                      \
        const T *xr = x + r * ldx;                                                           \
        T *yr = y + r * ldy;                                                                 \
        T ms = row_sum_##SUF(xr, n, 0, 2) / (T)n;                                            \
        T rs = (T)1 / (T)sqrt((double)(ms + (T)eps));                                        \
        rstd[r] = rs;                                                                        \
        if (weight)                                                                          \
            for (ptrdiff_t i = 0; i < n; i++) yr[i] = xr[i] * rs * weight[i];                \
        else                                                                                 \
            for (ptrdiff_t i = 0; i < n; i++) yr[i] = xr[i] * rs;                            \
    }                                                                                        \
}                                                                                            \
                                                                                             \
/* RMSNorm backward: dx = rstd (g - xhat mean(g xhat)), xhat = x rstd; dweight += dy xhat. */ \
void rms_norm_bwd_##SUF(const T *restrict dy, ptrdiff_t lddy, const T *restrict x, ptrdiff_t ldx, \
                        const T *restrict rstd, const T *restrict weight, T *restrict dx,   \
                        ptrdiff_t lddx, T *restrict dweight,    \
                        ptrdiff_t m, ptrdiff_t n)                                            \
{                                                                                            \
    for (ptrdiff_t r = 0; r < m; r++) {                                                      \
        const T *dyr = dy + r * lddy, *xr = x + r * ldx;                                     \
        T *dxr = dx + r * lddx;                                                              \
        T rs = rstd[r];                                                                      \
        T c2 = row_dot3_##SUF(dyr, xr, weight, n) * rs / (T)n;                               \
        if (weight)                                                                          \
            for (ptrdiff_t j = 0; j < n; j++) {                                              \
                T xhat = xr[j] * rs;                                                         \
                dxr[j] = rs * (dyr[j] * weight[j] - xhat * c2);                              \
                dweight[j] += dyr[j] * xhat;                                                 \
            }                                                                                \
        else                                                                                 \
            for (ptrdiff_t j = 0; j < n; j++) {                                              \
                T xhat = xr[j] * rs;                                                         \
                dxr[j] = rs * (dyr[j] - xhat * c2);                                          \
                dweight[j] += dyr[j] * xhat;                                                 \
            }                                                                                \
    }                                                                                        \
}

DEFINE_KERNELS(float, f32)
DEFINE_KERNELS(double, f64)
