/* The kernels over one element type, included by norms.c once for float and once for double:
 *   T       the element type
 *   FN(f)   the name f with the type's suffix (f_f32, f_f64)
 *
 * Every sum over a row runs in blocks of BLOCK elements. Within a block, element i goes to
 * lane i % LANES of an accumulator of LANES values of T (the last, short group of a block:
 * its element k to lane k); the lanes are added pairwise in float64 (lanes_total), and the
 * block totals pairwise in float64 (struct pairwise). Each pass is one function with that
 * loop written out; the compiler vectorises the lanes for each instruction set. */

/* The lanes added pairwise in float64: lane k + lane k + 8, then + 4, + 2, + 1. */
static double FN(lanes_total)(const T a[LANES])
{
    double s[LANES];
    for (int k = 0; k < LANES; k++)
        s[k] = a[k];
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int k = 0; k < w; k++)
            s[k] += s[k + w];
    return s[0];
}

/* The passes' sums over a row: sum of x; of d = x - shift and of d^2; of x^2; of
 * g = dy weight and of g (x - shift); of g x. */
static double FN(row_sum)(const T *x, ptrdiff_t n)
{
    struct pairwise s = {0};
    for (ptrdiff_t b = 0; b < n; b += BLOCK) {
        ptrdiff_t end = b + block_len(b, n), i = b;
        T a[LANES] = {0};
        for (; i + LANES <= end; i += LANES)
#pragma GCC unroll 8
            for (int k = 0; k < LANES; k++)
                a[k] += x[i + k];
        for (int k = 0; i < end; i++, k++)
            a[k] += x[i];
        pairwise_add(&s, FN(lanes_total)(a));
    }
    return pairwise_total(&s);
}

static void FN(row_sums_dev)(const T *x, ptrdiff_t n, T shift, double *sum_d, double *sum_dd)
{
    struct pairwise s = {0}, ss = {0};
    for (ptrdiff_t b = 0; b < n; b += BLOCK) {
        ptrdiff_t end = b + block_len(b, n), i = b;
        T a[LANES] = {0}, aa[LANES] = {0};
        for (; i + LANES <= end; i += LANES)
#pragma GCC unroll 8
            for (int k = 0; k < LANES; k++) {
                T d = x[i + k] - shift;
                a[k] += d;
                aa[k] += d * d;
            }
        for (int k = 0; i < end; i++, k++) {
            T d = x[i] - shift;
            a[k] += d;
            aa[k] += d * d;
        }
        pairwise_add(&s, FN(lanes_total)(a));
        pairwise_add(&ss, FN(lanes_total)(aa));
    }
    *sum_d = pairwise_total(&s);
    *sum_dd = pairwise_total(&ss);
}

static double FN(row_sum_sq)(const T *x, ptrdiff_t n)
{
    struct pairwise s = {0};
    for (ptrdiff_t b = 0; b < n; b += BLOCK) {
        ptrdiff_t end = b + block_len(b, n), i = b;
        T a[LANES] = {0};
        for (; i + LANES <= end; i += LANES)
#pragma GCC unroll 8
            for (int k = 0; k < LANES; k++)
                a[k] += x[i + k] * x[i + k];
        for (int k = 0; i < end; i++, k++)
            a[k] += x[i] * x[i];
        pairwise_add(&s, FN(lanes_total)(a));
    }
    return pairwise_total(&s);
}

static void FN(row_sums_g)(const T *dy, const T *weight, const T *x, ptrdiff_t n, T shift,
                           double *sum_g, double *sum_gxc)
{
    struct pairwise s = {0}, sx = {0};
    for (ptrdiff_t b = 0; b < n; b += BLOCK) {
        ptrdiff_t end = b + block_len(b, n), i = b;
        T a[LANES] = {0}, ax[LANES] = {0};
        for (; i + LANES <= end; i += LANES)
#pragma GCC unroll 8
            for (int k = 0; k < LANES; k++) {
                T g = dy[i + k] * weight[i + k];
                a[k] += g;
                ax[k] += g * (x[i + k] - shift);
            }
        for (int k = 0; i < end; i++, k++) {
            T g = dy[i] * weight[i];
            a[k] += g;
            ax[k] += g * (x[i] - shift);
        }
        pairwise_add(&s, FN(lanes_total)(a));
        pairwise_add(&sx, FN(lanes_total)(ax));
    }
    *sum_g = pairwise_total(&s);
    *sum_gxc = pairwise_total(&sx);
}

static double FN(row_sum_gx)(const T *dy, const T *weight, const T *x, ptrdiff_t n)
{
    struct pairwise s = {0};
    for (ptrdiff_t b = 0; b < n; b += BLOCK) {
        ptrdiff_t end = b + block_len(b, n), i = b;
        T a[LANES] = {0};
        for (; i + LANES <= end; i += LANES)
#pragma GCC unroll 8
            for (int k = 0; k < LANES; k++)
                a[k] += dy[i + k] * weight[i + k] * x[i + k];
        for (int k = 0; i < end; i++, k++)
            a[k] += dy[i] * weight[i] * x[i];
        pairwise_add(&s, FN(lanes_total)(a));
    }
    return pairwise_total(&s);
}

/* [listing: layer-norm-row] (chapter 5 shows from here to its end marker) */
/* Two-pass statistics: a first mean mu0, then the sums of d = x - mu0 and of d^2, whose mean
 * corrects mu0 and whose variance is taken about the corrected mean (Chan, Golub and
 * LeVeque, 1983), never E[x^2] - E[x]^2. Then y. */
static void FN(layer_norm_forward_row)(const T *x, const T *weight, const T *bias, T *y,
                                       T *mean, T *rstd, ptrdiff_t n, double eps)
{
    T mu0 = (T)(FN(row_sum)(x, n) / n);
    double sum_d, sum_dd;
    FN(row_sums_dev)(x, n, mu0, &sum_d, &sum_dd);
    double delta = sum_d / n, var = sum_dd / n - delta * delta;
    T mu = (T)(mu0 + delta), rs = (T)(1 / sqrt(var + eps));
    for (ptrdiff_t i = 0; i < n; i++)
        y[i] = (x[i] - mu) * rs * weight[i] + bias[i];
    *mean = mu;
    *rstd = rs;
}
/* [end listing: layer-norm-row] */

/* dx = rstd (g - mean(g) - xhat mean(g xhat)), g = dy weight; adds dy xhat and dy to the
 * row block's column sums dweight and dbias. */
static void FN(layer_norm_backward_row)(const T *dy, const T *x, T mean, T rstd,
                                        const T *weight, T *dx, double *dweight,
                                        double *dbias, ptrdiff_t n)
{
    double sum_g, sum_gxc;
    FN(row_sums_g)(dy, weight, x, n, mean, &sum_g, &sum_gxc);
    T mean_g = (T)(sum_g / n), mean_gxhat = (T)(sum_gxc * rstd / n);
    for (ptrdiff_t i = 0; i < n; i++) {
        T xhat = (x[i] - mean) * rstd;
        dx[i] = rstd * (dy[i] * weight[i] - mean_g - xhat * mean_gxhat);
        dweight[i] += dy[i] * xhat;
        dbias[i] += dy[i];
    }
}

static void FN(rms_norm_forward_row)(const T *x, const T *weight, T *y, T *rstd, ptrdiff_t n,
                                     double eps)
{
    T rs = (T)(1 / sqrt(FN(row_sum_sq)(x, n) / n + eps));
    for (ptrdiff_t i = 0; i < n; i++)
        y[i] = x[i] * rs * weight[i];
    *rstd = rs;
}

/* dx = rstd (g - xhat mean(g xhat)), xhat = x rstd; adds dy xhat to dweight. */
static void FN(rms_norm_backward_row)(const T *dy, const T *x, T rstd, const T *weight, T *dx,
                                      double *dweight, ptrdiff_t n)
{
    T mean_gxhat = (T)(FN(row_sum_gx)(dy, weight, x, n) * rstd / n);
    for (ptrdiff_t i = 0; i < n; i++) {
        T xhat = x[i] * rstd;
        dx[i] = rstd * (dy[i] * weight[i] - xhat * mean_gxhat);
        dweight[i] += dy[i] * xhat;
    }
}

/* The exported kernels (norms.h): row after row; a large output is made row by row in
 * scratch and streamed to memory (stream_scratch). */
NORMS_KERNEL void FN(layer_norm_forward)(const T *x, ptrdiff_t ldx, const T *weight,
                                         const T *bias, T *y, T *mean, T *rstd, ptrdiff_t m,
                                         ptrdiff_t n, double eps)
{
    T *s = stream_scratch(m, n, sizeof(T), 1);
    for (ptrdiff_t r = 0; r < m; r++) {
        FN(layer_norm_forward_row)(x + r * ldx, weight, bias, s ? s : y + r * n, mean + r,
                                   rstd + r, n, eps);
        if (s)
            stream_copy(y + r * n, s, n, sizeof(T));
    }
    stream_end(s);
}

NORMS_KERNEL void FN(layer_norm_backward)(const T *dy, ptrdiff_t lddy, const T *x, ptrdiff_t ldx,
                                          const T *mean, const T *rstd, const T *weight, T *dx,
                                          double *dweight_blocks, double *dbias_blocks,
                                          ptrdiff_t m, ptrdiff_t n)
{
    T *s = stream_scratch(m, n, sizeof(T), 1);
    for (ptrdiff_t r = 0; r < m; r++) {
        ptrdiff_t b = r / NORMS_BLOCK_ROWS * n;
        FN(layer_norm_backward_row)(dy + r * lddy, x + r * ldx, mean[r], rstd[r], weight,
                                    s ? s : dx + r * n, dweight_blocks + b, dbias_blocks + b, n);
        if (s)
            stream_copy(dx + r * n, s, n, sizeof(T));
    }
    stream_end(s);
}

NORMS_KERNEL void FN(rms_norm_forward)(const T *x, ptrdiff_t ldx, const T *weight, T *y,
                                       T *rstd, ptrdiff_t m, ptrdiff_t n, double eps)
{
    T *s = stream_scratch(m, n, sizeof(T), 1);
    for (ptrdiff_t r = 0; r < m; r++) {
        FN(rms_norm_forward_row)(x + r * ldx, weight, s ? s : y + r * n, rstd + r, n, eps);
        if (s)
            stream_copy(y + r * n, s, n, sizeof(T));
    }
    stream_end(s);
}

NORMS_KERNEL void FN(rms_norm_backward)(const T *dy, ptrdiff_t lddy, const T *x, ptrdiff_t ldx,
                                        const T *rstd, const T *weight, T *dx,
                                        double *dweight_blocks, ptrdiff_t m, ptrdiff_t n)
{
    T *s = stream_scratch(m, n, sizeof(T), 1);
    for (ptrdiff_t r = 0; r < m; r++) {
        FN(rms_norm_backward_row)(dy + r * lddy, x + r * ldx, rstd[r], weight,
                                  s ? s : dx + r * n, dweight_blocks + r / NORMS_BLOCK_ROWS * n,
                                  n);
        if (s)
            stream_copy(dx + r * n, s, n, sizeof(T));
    }
    stream_end(s);
}

/* The fused residual add (norms.h), row by row: h = residual + x, then the norm of that row
 * of h while it is in L1; the backward's dsum = dx + dh on the row of dx just made. rms
 * selects RMSNorm (bias and mean unused). h and y, dsum streamed as in the kernels above. */
static int FN(fused_forward)(int rms, const T *x, ptrdiff_t ldx, const T *residual,
                             ptrdiff_t ldr, const T *weight, const T *bias, T *y, T *h,
                             T *mean, T *rstd, ptrdiff_t m, ptrdiff_t n, double eps)
{
    T *s = stream_scratch(m, n, sizeof(T), 2);
    for (ptrdiff_t r = 0; r < m; r++) {
        const T *xr = x + r * ldx, *rr = residual + r * ldr;
        T *hr = s ? s : h + r * n, *yr = s ? s + n : y + r * n;
        for (ptrdiff_t i = 0; i < n; i++)
            hr[i] = rr[i] + xr[i];
        if (rms)
            FN(rms_norm_forward_row)(hr, weight, yr, rstd + r, n, eps);
        else
            FN(layer_norm_forward_row)(hr, weight, bias, yr, mean + r, rstd + r, n, eps);
        if (s) {
            stream_copy(h + r * n, hr, n, sizeof(T));
            stream_copy(y + r * n, yr, n, sizeof(T));
        }
    }
    stream_end(s);
    return 0;
}

static int FN(fused_backward)(int rms, const T *dy, ptrdiff_t lddy, const T *dh, ptrdiff_t lddh,
                              const T *h, ptrdiff_t ldh, const T *mean, const T *rstd,
                              const T *weight, T *dsum, double *dweight_blocks,
                              double *dbias_blocks, ptrdiff_t m, ptrdiff_t n)
{
    T *s = stream_scratch(m, n, sizeof(T), 1);
    for (ptrdiff_t r = 0; r < m; r++) {
        ptrdiff_t b = r / NORMS_BLOCK_ROWS * n;
        T *d = s ? s : dsum + r * n;
        if (rms)
            FN(rms_norm_backward_row)(dy + r * lddy, h + r * ldh, rstd[r], weight, d,
                                      dweight_blocks + b, n);
        else
            FN(layer_norm_backward_row)(dy + r * lddy, h + r * ldh, mean[r], rstd[r], weight, d,
                                        dweight_blocks + b, dbias_blocks + b, n);
        for (ptrdiff_t i = 0; dh && i < n; i++)
            d[i] = d[i] + dh[r * lddh + i];
        if (s)
            stream_copy(dsum + r * n, d, n, sizeof(T));
    }
    stream_end(s);
    return 0;
}
