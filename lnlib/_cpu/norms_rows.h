/* The kernels over one element type T, included by norms.c for float and for double; FN(f) is f
 * with the type's suffix (f_f32, f_f64). Each pass of sums is one function whose loop is the
 * skeleton LANE_PASS (norms.c) with the pass's terms: statements that add element e of a row to
 * lane k of sum c, a[c][k]; the compiler vectorises the lanes. */

/* The lanes added pairwise in float64: lane k + lane k + 8, then + 4, + 2, + 1. */
static double FN(lanes_total)(const T a[LANES])
{
    double t[LANES / 2];
    for (int k = 0; k < LANES / 2; k++)
        t[k] = (double)a[k] + (double)a[k + LANES / 2];
    for (int w = LANES / 4; w > 0; w /= 2)
        for (int k = 0; k < w; k++)
            t[k] += t[k + w];
    return t[0];
}

/* Adds the block's lanes of `count` sums, each to its pairwise sum. */
static void FN(pairwise_add)(struct pairwise *p, T a[][LANES], int count)
{
    for (int c = 0, k; c < count; c++) {
        double v = FN(lanes_total)(a[c]);
        k = 0;
        for (long long b = p->blocks; b & 1; b >>= 1)
            v = p->level[k++][c] + v;
        p->level[k][c] = v;
    }
    p->blocks++;
}

/* A pass of sums goes over rows a and b at once (b may be a; each row's sums are the same alone
 * or in a pair): sum[0], sum[1] for rows a and b, and a pass's second sum in sum[2], sum[3].
 * Sum of x. */
static void FN(row_sum)(const T *xa, const T *xb, ptrdiff_t n, double sum[2])
{
    LANE_PASS(2, n, sum, a[0][k] += xa[e]; a[1][k] += xb[e];);
}

/* Sums of the deviations xt = x - shift and of xt^2. */
static void FN(row_sums_dev)(const T *xa, const T *xb, ptrdiff_t n, const T shift[2],
                             double sum[4])
{
    LANE_PASS(4, n, sum, T xta = xa[e] - shift[0]; T xtb = xb[e] - shift[1]; a[0][k] += xta;
              a[1][k] += xtb; a[2][k] += xta * xta; a[3][k] += xtb * xtb;);
}

/* Sum of x^2. */
static void FN(row_sum_sq)(const T *xa, const T *xb, ptrdiff_t n, double sum[2])
{
    LANE_PASS(2, n, sum, a[0][k] += xa[e] * xa[e]; a[1][k] += xb[e] * xb[e];);
}

/* Sums of g = dy weight and of g (x - shift). */
static void FN(row_sums_g)(const T *dya, const T *dyb, const T *weight, const T *xa,
                           const T *xb, ptrdiff_t n, const T shift[2], double sum[4])
{
    LANE_PASS(4, n, sum, T ga = dya[e] * weight[e]; T gb = dyb[e] * weight[e]; a[0][k] += ga;
              a[1][k] += gb; a[2][k] += ga * (xa[e] - shift[0]);
              a[3][k] += gb * (xb[e] - shift[1]););
}

/* Sum of g x. */
static void FN(row_sum_gx)(const T *dya, const T *dyb, const T *weight, const T *xa,
                           const T *xb, ptrdiff_t n, double sum[2])
{
    LANE_PASS(2, n, sum, a[0][k] += dya[e] * weight[e] * xa[e];
              a[1][k] += dyb[e] * weight[e] * xb[e];);
}

/* The row functions take k = 1 or 2 rows (rows_at), ld elements apart: the passes of sums over
 * both at once, then the pass that writes y, row after row, or dx, of both rows in one loop. */

/* [listing: layer-norm-row] (chapter 5 shows from here to its end marker) */
/* Two-pass statistics: a first mean mu0, then the sums of the deviations xt = x - mu0 and of
 * xt^2, whose mean corrects mu0 and whose variance is taken about the corrected mean (Chan,
 * Golub and LeVeque, 1983), never mean(x^2) - mean(x)^2. Then y. */
ROWS_KERNEL
static void FN(layer_norm_forward_rows)(int k, const T *x, ptrdiff_t ldx, const T *weight,
                                        const T *bias, T *restrict y, ptrdiff_t ldy, T *mean,
                                        T *rstd, ptrdiff_t n, double eps)
{
    double s[4];
    FN(row_sum)(x, x + (k - 1) * ldx, n, s);
    T mu0[2] = {(T)(s[0] / n), (T)(s[1] / n)};
    FN(row_sums_dev)(x, x + (k - 1) * ldx, n, mu0, s);
    for (int j = 0; j < k; j++, x += ldx, y += ldy) {
        double delta = s[j] / n, var = s[2 + j] / n - delta * delta;
        T mu = (T)(mu0[j] + delta), rs = (T)(1 / sqrt(var + eps));
        for (ptrdiff_t i = 0; i < n; i++)
            y[i] = (x[i] - mu) * rs * weight[i] + bias[i];
        mean[j] = mu;
        rstd[j] = rs;
    }
}
/* [end listing: layer-norm-row] */

/* dx = rstd (g - mean(g) - xhat mean(g xhat)), g = dy weight; adds dy xhat and dy to the
 * row block's column sums dweight and dbias, row a's term before row b's (one load and store
 * of each column sum for both rows). */
ROWS_KERNEL
static void FN(layer_norm_backward_rows)(int k, const T *dy, ptrdiff_t lddy, const T *x,
                                         ptrdiff_t ldx, const T *mean, const T *rstd,
                                         const T *weight, T *restrict dx, ptrdiff_t lddx,
                                         double *restrict dweight, double *restrict dbias,
                                         ptrdiff_t n)
{
    double s[4];
    const T shift[2] = {mean[0], mean[k - 1]}, rs[2] = {rstd[0], rstd[k - 1]};
    FN(row_sums_g)(dy, dy + (k - 1) * lddy, weight, x, x + (k - 1) * ldx, n, shift, s);
    const T mean_g[2] = {(T)(s[0] / n), (T)(s[1] / n)};
    const T mean_gxhat[2] = {(T)(s[2] * rs[0] / n), (T)(s[3] * rs[1] / n)};
    if (k == 1) { /* row a alone: the pass below, for one row */
        for (ptrdiff_t i = 0; i < n; i++) {
            T xhat = (x[i] - shift[0]) * rs[0];
            dx[i] = rs[0] * (dy[i] * weight[i] - mean_g[0] - xhat * mean_gxhat[0]);
            dweight[i] += dy[i] * xhat;
            dbias[i] += dy[i];
        }
        return;
    }
    const T *dyb = dy + lddy, *xb = x + ldx;
    T *dxb = dx + lddx; /* based on dx, so covered by its restrict */
    for (ptrdiff_t i = 0; i < n; i++) {
        T xhat_a = (x[i] - shift[0]) * rs[0], xhat_b = (xb[i] - shift[1]) * rs[1];
        dx[i] = rs[0] * (dy[i] * weight[i] - mean_g[0] - xhat_a * mean_gxhat[0]);
        dxb[i] = rs[1] * (dyb[i] * weight[i] - mean_g[1] - xhat_b * mean_gxhat[1]);
        double dw = dweight[i] + dy[i] * xhat_a, db = dbias[i] + dy[i];
        dweight[i] = dw + dyb[i] * xhat_b;
        dbias[i] = db + dyb[i];
    }
}

ROWS_KERNEL
static void FN(rms_norm_forward_rows)(int k, const T *x, ptrdiff_t ldx, const T *weight,
                                      T *restrict y, ptrdiff_t ldy, T *rstd, ptrdiff_t n,
                                      double eps)
{
    double s[2];
    FN(row_sum_sq)(x, x + (k - 1) * ldx, n, s);
    for (int j = 0; j < k; j++, x += ldx, y += ldy) {
        T rs = (T)(1 / sqrt(s[j] / n + eps));
        for (ptrdiff_t i = 0; i < n; i++)
            y[i] = x[i] * rs * weight[i];
        rstd[j] = rs;
    }
}

/* dx = rstd (g - xhat mean(g xhat)), xhat = x rstd; adds dy xhat to dweight, as above. */
ROWS_KERNEL
static void FN(rms_norm_backward_rows)(int k, const T *dy, ptrdiff_t lddy, const T *x,
                                       ptrdiff_t ldx, const T *rstd, const T *weight,
                                       T *restrict dx, ptrdiff_t lddx, double *restrict dweight,
                                       ptrdiff_t n)
{
    double s[2];
    const T rs[2] = {rstd[0], rstd[k - 1]};
    FN(row_sum_gx)(dy, dy + (k - 1) * lddy, weight, x, x + (k - 1) * ldx, n, s);
    const T mean_gxhat[2] = {(T)(s[0] * rs[0] / n), (T)(s[1] * rs[1] / n)};
    if (k == 1) { /* row a alone, as in layer_norm_backward_rows */
        for (ptrdiff_t i = 0; i < n; i++) {
            T xhat = x[i] * rs[0];
            dx[i] = rs[0] * (dy[i] * weight[i] - xhat * mean_gxhat[0]);
            dweight[i] += dy[i] * xhat;
        }
        return;
    }
    const T *dyb = dy + lddy, *xb = x + ldx;
    T *dxb = dx + lddx; /* based on dx, so covered by its restrict */
    for (ptrdiff_t i = 0; i < n; i++) {
        T xhat_a = x[i] * rs[0], xhat_b = xb[i] * rs[1];
        dx[i] = rs[0] * (dy[i] * weight[i] - xhat_a * mean_gxhat[0]);
        dxb[i] = rs[1] * (dyb[i] * weight[i] - xhat_b * mean_gxhat[1]);
        double dw = dweight[i] + dy[i] * xhat_a;
        dweight[i] = dw + dyb[i] * xhat_b;
    }
}

/* Rows r to r + k - 1 of input a as rows of T, *ld apart: a's own, or its float16 rows
 * converted into the rows tmp (F16C where the CPU has it, the rest or all by bit operations). */
static const T *FN(rows_read)(struct rows a, ptrdiff_t r, int k, ptrdiff_t n, T *tmp, ptrdiff_t *ld)
{
    *ld = a.half ? n : a.ld;
    if (!a.half)
        return (const T *)a.p + r * a.ld;
    for (int j = 0; j < k; j++) {
        const uint16_t *h = (const uint16_t *)a.p + (r + j) * a.ld;
        float *f = (float *)tmp + j * n;
        for (ptrdiff_t i = have_f16c() ? f16c_in(h, f, n) : 0; i < n; i++)
            f[i] = half_to_float(h[i]);
    }
    return tmp;
}

/* Rows r to r + k - 1 of output a, made in the rows tmp: rounded to float16 (half), or
 * streamed. */
static void FN(rows_write)(void *a, int half, ptrdiff_t r, int k, ptrdiff_t n, const T *tmp)
{
    const float *f = (const float *)tmp;
    uint16_t *h = (uint16_t *)a + r * n;
    if (!half)
        stream_copy((T *)a + r * n, tmp, k * n, sizeof(T));
    else
        for (ptrdiff_t i = have_f16c() ? f16c_out(f, h, k * n) : 0; i < k * n; i++)
            h[i] = float_to_half(f[i]);
}

/* The forward of rows x or, with a residual, of h = residual + x (the fused residual add: h
 * written, then normalised while it is in cache), a pair of rows at a time (rows_at); rms selects
 * RMSNorm (bias and mean unused). y has the type of x, h that of the residual. An output of
 * float16, or a large one (streams), is made in scratch rows and then written. Float16 h is
 * rounded before it is normalised. */
static int FN(forward)(int rms, struct rows x, struct rows res, const T *weight, const T *bias,
                       void *y, void *h, T *mean, T *rstd, ptrdiff_t m, ptrdiff_t n, double eps)
{
    int stream, half = x.half || res.half;
    T *tmp = scratch(half, &stream, m, n, sizeof(T));
    if (half && !tmp)
        return 1;
    for (ptrdiff_t r = 0, k, ld, ldr; r < m; r += k) {
        k = rows_at(r, m, n);
        const T *in = FN(rows_read)(x, r, k, n, tmp, &ld);
        T *yr = x.half || stream ? tmp + 6 * n : (T *)y + r * n;
        if (res.p) {
            const T *rr = FN(rows_read)(res, r, k, n, tmp + 2 * n, &ldr);
            T *hr = res.half || stream ? tmp + 4 * n : (T *)h + r * n;
            for (ptrdiff_t j = 0; j < k; j++)
                for (ptrdiff_t i = 0; i < n; i++)
                    hr[j * n + i] = rr[j * ldr + i] + in[j * ld + i];
            if (res.half || stream)
                FN(rows_write)(h, res.half, r, k, n, hr);
            if (res.half)
                FN(rows_read)(ROWS(h, n, 1), r, k, n, hr, &ld);
            in = hr;
            ld = n;
        }
        if (rms)
            FN(rms_norm_forward_rows)(k, in, ld, weight, yr, n, rstd + r, n, eps);
        else
            FN(layer_norm_forward_rows)(k, in, ld, weight, bias, yr, n, mean + r, rstd + r, n,
                                        eps);
        if (x.half || stream)
            FN(rows_write)(y, x.half, r, k, n, yr);
    }
    stream_end(tmp, stream);
    return 0;
}

/* The backward of rows x (h of the fused add), with dsum = dx + dh when dh is given; dx has the
 * type of x. A float16 dx is rounded before dh is added. */
static int FN(backward)(int rms, struct rows dy, struct rows dh, struct rows x, const T *mean,
                        const T *rstd, const T *weight, void *dx, double *dweight_blocks,
                        double *dbias_blocks, ptrdiff_t m, ptrdiff_t n)
{
    int stream, half = dy.half || x.half;
    T *tmp = scratch(half, &stream, m, n, sizeof(T));
    if (half && !tmp)
        return 1;
    for (ptrdiff_t r = 0, k, lddy, ldx, ldh; r < m; r += k) {
        ptrdiff_t b = r / NORMS_BLOCK_ROWS * n;
        k = rows_at(r, m, n);
        const T *dyr = FN(rows_read)(dy, r, k, n, tmp, &lddy);
        const T *xr = FN(rows_read)(x, r, k, n, tmp + 2 * n, &ldx);
        T *d = x.half || stream ? tmp + 4 * n : (T *)dx + r * n;
        if (rms)
            FN(rms_norm_backward_rows)(k, dyr, lddy, xr, ldx, rstd + r, weight, d, n,
                                       dweight_blocks + b, n);
        else
            FN(layer_norm_backward_rows)(k, dyr, lddy, xr, ldx, mean + r, rstd + r, weight, d,
                                         n, dweight_blocks + b, dbias_blocks + b, n);
        if (dh.p && x.half) {
            FN(rows_write)(dx, 1, r, k, n, d);
            FN(rows_read)(ROWS(dx, n, 1), r, k, n, d, &ldh);
        }
        if (dh.p) {
            const T *dhr = FN(rows_read)(dh, r, k, n, tmp + 6 * n, &ldh);
            for (ptrdiff_t j = 0; j < k; j++)
                for (ptrdiff_t i = 0; i < n; i++)
                    d[j * n + i] = d[j * n + i] + dhr[j * ldh + i];
        }
        if (x.half || stream)
            FN(rows_write)(dx, x.half, r, k, n, d);
    }
    stream_end(tmp, stream);
    return 0;
}
