/* The kernels over one element type T, included by norms.c once per type with
 *   T       float or double
 *   FN(f)   the name f with the type's suffix (f_f32 or f_f64)
 * Sums over a row: LANES partial sums in T within a block of BLOCK elements, then the block
 * totals in float64, added pairwise (see norms.c); norms_lanes.h holds the lanes in
 * vectors of the CPU's width. Rows up to PAIR_MAX long are taken two at a time: each pass
 * goes over the same block of both rows in one loop.
 */

/* The block sums, once per vector width (norms_lanes.h); block_sums takes the width
 * chosen for this CPU (vector_bytes in norms.c). */
#if NORMS_VECTORS
#define VBYTES 64
#define LW(name) FN(name##_v64)
#include "norms_lanes.h"
#undef LW
#undef VBYTES
#define VBYTES 32
#define LW(name) FN(name##_v32)
#include "norms_lanes.h"
#undef LW
#undef VBYTES
#define VBYTES 16
#define LW(name) FN(name##_v16)
#include "norms_lanes.h"
#undef LW
#undef VBYTES
#else
#define VBYTES 0
#define LW(name) FN(name##_v0)
#include "norms_lanes.h"
#undef LW
#undef VBYTES
#endif

static inline __attribute__((always_inline)) void
FN(block_sums)(int kind, int rows, const T *xa, const T *xb, const T *dya, const T *dyb,
               const T *w, ptrdiff_t n, T sha, T shb, double out[4])
{
#if NORMS_VECTORS
    if (vector_bytes_chosen == 64)
        FN(block_sums_v64)(kind, rows, xa, xb, dya, dyb, w, n, sha, shb, out);
    else if (vector_bytes_chosen == 32)
        FN(block_sums_v32)(kind, rows, xa, xb, dya, dyb, w, n, sha, shb, out);
    else
        FN(block_sums_v16)(kind, rows, xa, xb, dya, dyb, w, n, sha, shb, out);
#else
    FN(block_sums_v0)(kind, rows, xa, xb, dya, dyb, w, n, sha, shb, out);
#endif
}

/* The sums of a pass over one row a (rows 1) or two rows a and b (rows 2): each block's sums
 * (block_sums) added pairwise in float64 per row and per sum; sums[] as block_sums' out[]. */
static inline __attribute__((always_inline)) void
FN(row_sums)(int kind, int rows, const T *xa, const T *xb, const T *dya, const T *dyb,
             const T *w, ptrdiff_t n, T sha, T shb, double sums[4])
{
    const int two = kind == SUM_DEV || kind == SUM_G;
    struct pairwise s[4];
    for (int k = 0; k < 4; k++)
        s[k].count = 0;
    for (ptrdiff_t i = 0; i < n; i += BLOCK) {
        double b[4];
        const int g = kind == SUM_G || kind == SUM_GXC;
        FN(block_sums)(kind, rows, xa + i, rows == 2 ? xb + i : NULL, g ? dya + i : NULL,
                       g && rows == 2 ? dyb + i : NULL, g ? w + i : NULL, block_len(i, n), sha,
                       shb, b);
        for (int k = 0; k < 4; k++)
            if (k < rows || (two && k - 2 < rows))
                pairwise_add(&s[k], b[k]);
    }
    for (int k = 0; k < 4; k++)
        if (k < rows || (two && k - 2 < rows))
            sums[k] = pairwise_total(&s[k]);
}

/* The passes' sums over one row, by what they sum. */
static double FN(row_sum)(const T *x, ptrdiff_t n)
{
    double s[4];
    FN(row_sums)(SUM_X, 1, x, NULL, NULL, NULL, NULL, n, 0, 0, s);
    return s[0];
}

static double FN(row_sum_sq)(const T *x, ptrdiff_t n)
{
    double s[4];
    FN(row_sums)(SUM_XX, 1, x, NULL, NULL, NULL, NULL, n, 0, 0, s);
    return s[0];
}

/* Sums of d[i] = x[i] - shift and of d[i]^2 over a row, in one pass. */
static void FN(row_sums_dev)(const T *x, ptrdiff_t n, T shift, double *sum_d, double *sum_dd)
{
    double s[4];
    FN(row_sums)(SUM_DEV, 1, x, NULL, NULL, NULL, NULL, n, shift, 0, s);
    *sum_d = s[0];
    *sum_dd = s[2];
}

/* Sum of g[i] (x[i] - shift) over a row, g = dy weight. */
static double FN(row_sum_gxc)(const T *dy, const T *weight, const T *x, ptrdiff_t n, T shift)
{
    double s[4];
    FN(row_sums)(SUM_GXC, 1, x, NULL, dy, NULL, weight, n, shift, 0, s);
    return s[0];
}

/* Sums of g[i] = dy[i] weight[i] and of g[i] (x[i] - shift) over a row, in one pass. */
static void FN(row_sums_g)(const T *dy, const T *weight, const T *x, ptrdiff_t n, T shift,
                           double *sum_g, double *sum_gxc)
{
    double s[4];
    FN(row_sums)(SUM_G, 1, x, NULL, dy, NULL, weight, n, shift, 0, s);
    *sum_g = s[0];
    *sum_gxc = s[2];
}

/* The same sums over two rows a and b at once: sums[0], sums[1] the first sum of a and b,
 * sums[2], sums[3] the second. */
static inline __attribute__((always_inline)) void
FN(row_sums_pair)(int kind, const T *xa, const T *xb, const T *dya, const T *dyb, const T *w,
                  ptrdiff_t n, T sha, T shb, double sums[4])
{
    FN(row_sums)(kind, 2, xa, xb, dya, dyb, w, n, sha, shb, sums);
}

/* [listing: layer-norm-row] (chapter 5 shows from here to its end marker) */
/* mean and rstd from the sums of d = x - mu0 and of d^2 (corrected two-pass: Chan, Golub and
 * LeVeque): the deviations' mean corrects mu0, and the variance is taken about it. */
static void FN(layer_norm_finish)(ptrdiff_t n, T mu0, double sum_d, double sum_dd, double eps,
                                  T *mu, T *rs)
{
    double delta = sum_d / n;
    double var = sum_dd / n - delta * delta;
    *mu = (T)(mu0 + delta);
    *rs = (T)(1 / sqrt(var + eps));
}

static void FN(layer_norm_stats)(const T *x, ptrdiff_t n, T mu0, double eps, T *mu, T *rs)
{
    double sum_d, sum_dd;
    FN(row_sums_dev)(x, n, mu0, &sum_d, &sum_dd);
    FN(layer_norm_finish)(n, mu0, sum_d, sum_dd, eps, mu, rs);
}

static void FN(layer_norm_y)(const T *x, const T *weight, const T *bias, T *y, T mu, T rs,
                             ptrdiff_t n)
{
    for (ptrdiff_t i = 0; i < n; i++)
        y[i] = (x[i] - mu) * rs * weight[i] + bias[i];
}

static void FN(layer_norm_forward_row)(const T *x, const T *weight, const T *bias, T *y,
                                       T *mean, T *rstd, ptrdiff_t n, double eps)
{
    T mu0 = (T)(FN(row_sum)(x, n) / n);
    FN(layer_norm_stats)(x, n, mu0, eps, mean, rstd);
    FN(layer_norm_y)(x, weight, bias, y, *mean, *rstd, n);
}
/* [end listing: layer-norm-row] */

/* Two short rows a and b: each pass of the statistics over both rows in one loop, so that the
 * processor overlaps the two rows' chains of dependent additions; then y of a, y of b. Each
 * row gets exactly the operations of layer_norm_forward_row. */
static void FN(layer_norm_forward_pair)(const T *xa, const T *xb, const T *weight,
                                        const T *bias, T *ya, T *yb, T *mean, T *rstd,
                                        ptrdiff_t n, double eps)
{
    double sums[4];
    FN(row_sums_pair)(SUM_X, xa, xb, NULL, NULL, NULL, n, 0, 0, sums);
    T mu0a = (T)(sums[0] / n), mu0b = (T)(sums[1] / n);
    FN(row_sums_pair)(SUM_DEV, xa, xb, NULL, NULL, NULL, n, mu0a, mu0b, sums);
    FN(layer_norm_finish)(n, mu0a, sums[0], sums[2], eps, mean, rstd);
    FN(layer_norm_finish)(n, mu0b, sums[1], sums[3], eps, mean + 1, rstd + 1);
    FN(layer_norm_y)(xa, weight, bias, ya, mean[0], rstd[0], n);
    FN(layer_norm_y)(xb, weight, bias, yb, mean[1], rstd[1], n);
}

/* dx = rstd (g - mean(g) - xhat mean(g xhat)) with g = dy weight; adds dy xhat and dy to the
 * row block's column sums. One pass for the two means (layer_norm_means), one for dx
 * (layer_norm_dx). */
static void FN(layer_norm_means)(const T *dy, const T *x, T mean, T rstd, const T *weight,
                                 ptrdiff_t n, T *mean_g, T *mean_gxhat)
{
    double sum_g, sum_gxc;
    FN(row_sums_g)(dy, weight, x, n, mean, &sum_g, &sum_gxc);
    *mean_g = (T)(sum_g / n);
    *mean_gxhat = (T)(sum_gxc * rstd / n);
}

static void FN(layer_norm_dx)(const T *dy, const T *x, T mean, T rstd, const T *weight,
                              T mean_g, T mean_gxhat, T *dx, double *dweight, double *dbias,
                              ptrdiff_t n)
{
    for (ptrdiff_t i = 0; i < n; i++) {
        T xhat = (x[i] - mean) * rstd;
        dx[i] = rstd * (dy[i] * weight[i] - mean_g - xhat * mean_gxhat);
        dweight[i] += dy[i] * xhat;
        dbias[i] += dy[i];
    }
}

/* layer_norm_dx for two rows a and b in one loop: each element of the column sums receives
 * row a's term, then row b's, as with two calls, so the bits are the same; the column sums
 * are loaded and stored once for the two rows. */
static void FN(layer_norm_dx_pair)(const T *dya, const T *dyb, const T *xa, const T *xb,
                                   const T *mean, const T *rstd, const T *weight,
                                   const T *mean_g, const T *mean_gxhat, T *restrict dxa,
                                   T *restrict dxb, double *restrict dweight,
                                   double *restrict dbias, ptrdiff_t n)
{
    /* the outputs overlap no input (the binding writes into an out= array only when it
     * shares no memory with the inputs): restrict lets the loop be vectorized without a
     * run-time overlap check of every pair of pointers */
    const T ma = mean[0], mb = mean[1], ra = rstd[0], rb = rstd[1];
    const T ga = mean_g[0], gb = mean_g[1], gxa = mean_gxhat[0], gxb = mean_gxhat[1];
    for (ptrdiff_t i = 0; i < n; i++) {
        T xhat_a = (xa[i] - ma) * ra;
        T xhat_b = (xb[i] - mb) * rb;
        dxa[i] = ra * (dya[i] * weight[i] - ga - xhat_a * gxa);
        dxb[i] = rb * (dyb[i] * weight[i] - gb - xhat_b * gxb);
        double dw = dweight[i];
        dw += dya[i] * xhat_a;
        dw += dyb[i] * xhat_b;
        dweight[i] = dw;
        double db = dbias[i];
        db += dya[i];
        db += dyb[i];
        dbias[i] = db;
    }
}

/* RMSNorm: rstd of one row (one pass for the mean square), then y. */
static T FN(rms_norm_rstd)(const T *x, ptrdiff_t n, double eps)
{
    return (T)(1 / sqrt(FN(row_sum_sq)(x, n) / n + eps));
}

static void FN(rms_norm_y)(const T *x, const T *weight, T *y, T rs, ptrdiff_t n)
{
    for (ptrdiff_t i = 0; i < n; i++)
        y[i] = x[i] * rs * weight[i];
}

/* dx = rstd (g - xhat mean(g xhat)) with xhat = x rstd, g = dy weight; adds dy xhat to the
 * row block's column sums. One pass for the mean (rms_norm_mean), one for dx (rms_norm_dx). */
static T FN(rms_norm_mean)(const T *dy, const T *x, T rstd, const T *weight, ptrdiff_t n)
{
    return (T)(FN(row_sum_gxc)(dy, weight, x, n, 0) * rstd / n);
}

static void FN(rms_norm_dx)(const T *dy, const T *x, T rstd, const T *weight, T mean_gxhat,
                            T *dx, double *dweight, ptrdiff_t n)
{
    for (ptrdiff_t i = 0; i < n; i++) {
        T xhat = x[i] * rstd;
        dx[i] = rstd * (dy[i] * weight[i] - xhat * mean_gxhat);
        dweight[i] += dy[i] * xhat;
    }
}

/* layer_norm_means for two rows a and b, their sums in one pass (row_sums_pair). */
static void FN(layer_norm_means_pair)(const T *dya, const T *dyb, const T *xa, const T *xb,
                                      const T *mean, const T *rstd, const T *weight,
                                      ptrdiff_t n, T *mean_g, T *mean_gxhat)
{
    double sums[4];
    FN(row_sums_pair)(SUM_G, xa, xb, dya, dyb, weight, n, mean[0], mean[1], sums);
    for (int k = 0; k < 2; k++) {
        mean_g[k] = (T)(sums[k] / n);
        mean_gxhat[k] = (T)(sums[2 + k] * rstd[k] / n);
    }
}

/* rms_norm_rstd and rms_norm_mean for two rows a and b, each pass over both at once. */
static void FN(rms_norm_rstd_pair)(const T *xa, const T *xb, ptrdiff_t n, double eps, T *rstd)
{
    double sums[4];
    FN(row_sums_pair)(SUM_XX, xa, xb, NULL, NULL, NULL, n, 0, 0, sums);
    for (int k = 0; k < 2; k++)
        rstd[k] = (T)(1 / sqrt(sums[k] / n + eps));
}

static void FN(rms_norm_mean_pair)(const T *dya, const T *dyb, const T *xa, const T *xb,
                                   const T *rstd, const T *weight, ptrdiff_t n, T *mean_gxhat)
{
    double sums[4];
    FN(row_sums_pair)(SUM_GXC, xa, xb, dya, dyb, weight, n, 0, 0, sums);
    for (int k = 0; k < 2; k++)
        mean_gxhat[k] = (T)(sums[k] * rstd[k] / n);
}

/* One row alone (a long row, or the last of an odd count): the passes in order. */
static void FN(layer_norm_backward_row)(const T *dy, const T *x, T mean, T rstd,
                                        const T *weight, T *dx, double *dweight,
                                        double *dbias, ptrdiff_t n)
{
    T mean_g, mean_gxhat;
    FN(layer_norm_means)(dy, x, mean, rstd, weight, n, &mean_g, &mean_gxhat);
    FN(layer_norm_dx)(dy, x, mean, rstd, weight, mean_g, mean_gxhat, dx, dweight, dbias, n);
}

static void FN(rms_norm_forward_row)(const T *x, const T *weight, T *y, T *rstd, ptrdiff_t n,
                                     double eps)
{
    *rstd = FN(rms_norm_rstd)(x, n, eps);
    FN(rms_norm_y)(x, weight, y, *rstd, n);
}

static void FN(rms_norm_backward_row)(const T *dy, const T *x, T rstd, const T *weight, T *dx,
                                      double *dweight, ptrdiff_t n)
{
    T mean_gxhat = FN(rms_norm_mean)(dy, x, rstd, weight, n);
    FN(rms_norm_dx)(dy, x, rstd, weight, mean_gxhat, dx, dweight, n);
}

/* rms_norm_dx for two rows a and b in one loop (as layer_norm_dx_pair: row a's term, then
 * row b's, in each column sum). */
static void FN(rms_norm_dx_pair)(const T *dya, const T *dyb, const T *xa, const T *xb,
                                 const T *rstd, const T *weight, const T *mean_gxhat,
                                 T *restrict dxa, T *restrict dxb, double *restrict dweight,
                                 ptrdiff_t n)
{
    const T ra = rstd[0], rb = rstd[1], gxa = mean_gxhat[0], gxb = mean_gxhat[1];
    for (ptrdiff_t i = 0; i < n; i++) {
        T xhat_a = xa[i] * ra;
        T xhat_b = xb[i] * rb;
        dxa[i] = ra * (dya[i] * weight[i] - xhat_a * gxa);
        dxb[i] = rb * (dyb[i] * weight[i] - xhat_b * gxb);
        double dw = dweight[i];
        dw += dya[i] * xhat_a;
        dw += dyb[i] * xhat_b;
        dweight[i] = dw;
    }
}

/* Each kernel below takes rows up to PAIR_MAX long two at a time: a pass over row r, then the
 * same pass over row r + 1, so that the processor overlaps the two rows' chains of dependent
 * steps; each row gets exactly the operations it gets alone, and the column sums of dweight
 * and dbias still receive row r before row r + 1 (both in one block of NORMS_BLOCK_ROWS, an
 * even number, since r is even). */
_Static_assert(NORMS_BLOCK_ROWS % 2 == 0, "a pair of rows must fall in one row block");

NORMS_KERNEL void FN(layer_norm_forward)(const T *x, ptrdiff_t ldx, const T *weight,
                                         const T *bias, T *y, T *mean, T *rstd, ptrdiff_t m,
                                         ptrdiff_t n, double eps)
{
    ptrdiff_t r = 0;
    /* a large output: each pair of rows of y is made in scratch, then streamed to memory */
    T *scratch = stream_scratch(m, n, sizeof(T));
    if (n <= PAIR_MAX)
        for (; r + 1 < m; r += 2) {
            T *ya = scratch ? scratch : y + r * n;
            FN(layer_norm_forward_pair)(x + r * ldx, x + (r + 1) * ldx, weight, bias, ya,
                                        ya + n, mean + r, rstd + r, n, eps);
            if (scratch)
                stream_copy(y + r * n, scratch, 2 * n, sizeof(T));
        }
    for (; r < m; r++)
        FN(layer_norm_forward_row)(x + r * ldx, weight, bias, y + r * n, mean + r, rstd + r,
                                   n, eps);
    free(scratch);
    stream_fence();
}

NORMS_KERNEL void FN(layer_norm_backward)(const T *dy, ptrdiff_t lddy, const T *x, ptrdiff_t ldx,
                                          const T *mean, const T *rstd, const T *weight, T *dx,
                                          double *dweight_blocks, double *dbias_blocks,
                                          ptrdiff_t m, ptrdiff_t n)
{
    ptrdiff_t r = 0;
    T *scratch = stream_scratch(m, n, sizeof(T)); /* as in the forward, for dx */
    if (n <= PAIR_MAX)
        for (; r + 1 < m; r += 2) {
            const T *dya = dy + r * lddy, *dyb = dya + lddy, *xa = x + r * ldx, *xb = xa + ldx;
            double *dw = dweight_blocks + (r / NORMS_BLOCK_ROWS) * n;
            double *db = dbias_blocks + (r / NORMS_BLOCK_ROWS) * n;
            T g[2], gx[2], *dxa = scratch ? scratch : dx + r * n;
            FN(layer_norm_means_pair)(dya, dyb, xa, xb, mean + r, rstd + r, weight, n, g, gx);
            FN(layer_norm_dx_pair)(dya, dyb, xa, xb, mean + r, rstd + r, weight, g, gx, dxa,
                                   dxa + n, dw, db, n);
            if (scratch)
                stream_copy(dx + r * n, scratch, 2 * n, sizeof(T));
        }
    for (; r < m; r++) {
        ptrdiff_t b = r / NORMS_BLOCK_ROWS;
        FN(layer_norm_backward_row)(dy + r * lddy, x + r * ldx, mean[r], rstd[r], weight,
                                    dx + r * n, dweight_blocks + b * n, dbias_blocks + b * n, n);
    }
    free(scratch);
    stream_fence();
}

NORMS_KERNEL void FN(rms_norm_forward)(const T *x, ptrdiff_t ldx, const T *weight, T *y,
                                       T *rstd, ptrdiff_t m, ptrdiff_t n, double eps)
{
    ptrdiff_t r = 0;
    T *scratch = stream_scratch(m, n, sizeof(T)); /* as in layer_norm_forward */
    if (n <= PAIR_MAX)
        for (; r + 1 < m; r += 2) {
            const T *xa = x + r * ldx, *xb = xa + ldx;
            T *ya = scratch ? scratch : y + r * n;
            FN(rms_norm_rstd_pair)(xa, xb, n, eps, rstd + r);
            FN(rms_norm_y)(xa, weight, ya, rstd[r], n);
            FN(rms_norm_y)(xb, weight, ya + n, rstd[r + 1], n);
            if (scratch)
                stream_copy(y + r * n, scratch, 2 * n, sizeof(T));
        }
    for (; r < m; r++)
        FN(rms_norm_forward_row)(x + r * ldx, weight, y + r * n, rstd + r, n, eps);
    free(scratch);
    stream_fence();
}

NORMS_KERNEL void FN(rms_norm_backward)(const T *dy, ptrdiff_t lddy, const T *x, ptrdiff_t ldx,
                                        const T *rstd, const T *weight, T *dx,
                                        double *dweight_blocks, ptrdiff_t m, ptrdiff_t n)
{
    ptrdiff_t r = 0;
    T *scratch = stream_scratch(m, n, sizeof(T)); /* as in layer_norm_forward, for dx */
    if (n <= PAIR_MAX)
        for (; r + 1 < m; r += 2) {
            const T *dya = dy + r * lddy, *dyb = dya + lddy, *xa = x + r * ldx, *xb = xa + ldx;
            double *dw = dweight_blocks + (r / NORMS_BLOCK_ROWS) * n;
            T gx[2], *dxa = scratch ? scratch : dx + r * n;
            FN(rms_norm_mean_pair)(dya, dyb, xa, xb, rstd + r, weight, n, gx);
            FN(rms_norm_dx_pair)(dya, dyb, xa, xb, rstd + r, weight, gx, dxa, dxa + n, dw, n);
            if (scratch)
                stream_copy(dx + r * n, scratch, 2 * n, sizeof(T));
        }
    for (; r < m; r++)
        FN(rms_norm_backward_row)(dy + r * lddy, x + r * ldx, rstd[r], weight, dx + r * n,
                                  dweight_blocks + (r / NORMS_BLOCK_ROWS) * n, n);
    free(scratch);
    stream_fence();
}
