/* The kernels over one element type T, included by norms_cpu.c once per type with
 *   T       float or double
 *   FN(f)   the name f with the type's suffix (f_f32 or f_f64)
 * Sums over a row: LANES partial sums in T within a block of BLOCK elements, then the block
 * totals in float64, added pairwise (see norms_cpu.c).
 */

#if NORMS_VECTORS
/* One LANES-wide vector of T: the compiler's vector extension, lowered to the registers the
 * target has (one AVX-512 register for 16 floats, two AVX2 ones, four SSE2 ones). Its
 * operations are elementwise, so lane k computes exactly what the scalar loops' acc[k] does. */
typedef T FN(vec) __attribute__((vector_size(LANES * sizeof(T))));

/* The LANES partial sums of a block, added pairwise in float64: s[k] += s[k + w] for
 * w = 8, 4, 2, 1, as halves of vectors, so that the sums stay in registers. */
static double FN(lanes_total)(const T *acc)
{
    FN(vec) a;
    memcpy(&a, acc, sizeof a);
    dvec16 s = __builtin_convertvector(a, dvec16);
    dvec8 s8, h8;
    memcpy(&s8, &s, sizeof s8);
    memcpy(&h8, (const char *)&s + sizeof s8, sizeof h8);
    s8 += h8;
    dvec4 s4, h4;
    memcpy(&s4, &s8, sizeof s4);
    memcpy(&h4, (const char *)&s8 + sizeof s4, sizeof h4);
    s4 += h4;
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}
#else
/* The LANES partial sums of a block, added pairwise in float64. */
static double FN(lanes_total)(const T *acc)
{
    double s[LANES];
    for (int k = 0; k < LANES; k++)
        s[k] = acc[k];
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int k = 0; k < w; k++)
            s[k] += s[k + w];
    return s[0];
}
#endif

/* Each plain block function makes one loop over at most BLOCK elements with one set of LANES
 * partial sums: that is the loop compilers vectorize well (two sets of sums in one plain loop
 * came out 3 times slower with GCC 12). Where the compiler has vector extensions
 * (NORMS_VECTORS), block_sums_dev and block_sums_g below compute two sums in one loop with
 * explicit LANES-wide vectors, lane by lane the same operations as two plain loops. */

/* Sum of x[i] - shift over one block (n <= BLOCK). */
static double FN(block_sum)(const T *x, ptrdiff_t n, T shift)
{
    T acc[LANES] = {0};
    ptrdiff_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int k = 0; k < LANES; k++)
            acc[k] += x[i + k] - shift;
    for (int k = 0; i < n; i++, k++)
        acc[k] += x[i] - shift;
    return FN(lanes_total)(acc);
}

/* Sum of (x[i] - shift)^2 over one block. */
static double FN(block_sum_sq)(const T *x, ptrdiff_t n, T shift)
{
    T acc[LANES] = {0};
    ptrdiff_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int k = 0; k < LANES; k++)
            acc[k] += (x[i + k] - shift) * (x[i + k] - shift);
    for (int k = 0; i < n; i++, k++)
        acc[k] += (x[i] - shift) * (x[i] - shift);
    return FN(lanes_total)(acc);
}

#if !NORMS_VECTORS
/* Sum of g[i] = dy[i] * weight[i] over one block. */
static double FN(block_sum_g)(const T *dy, const T *weight, ptrdiff_t n)
{
    T acc[LANES] = {0};
    ptrdiff_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int k = 0; k < LANES; k++)
            acc[k] += dy[i + k] * weight[i + k];
    for (int k = 0; i < n; i++, k++)
        acc[k] += dy[i] * weight[i];
    return FN(lanes_total)(acc);
}
#endif

/* Sum of g[i] * (x[i] - shift) over one block. */
static double FN(block_sum_gxc)(const T *dy, const T *weight, const T *x, ptrdiff_t n, T shift)
{
    T acc[LANES] = {0};
    ptrdiff_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int k = 0; k < LANES; k++)
            acc[k] += dy[i + k] * weight[i + k] * (x[i + k] - shift);
    for (int k = 0; i < n; i++, k++)
        acc[k] += dy[i] * weight[i] * (x[i] - shift);
    return FN(lanes_total)(acc);
}

static double FN(row_sum)(const T *x, ptrdiff_t n)
{
    struct pairwise s;
    s.count = 0;
    for (ptrdiff_t i = 0; i < n; i += BLOCK)
        pairwise_add(&s, FN(block_sum)(x + i, block_len(i, n), 0));
    return pairwise_total(&s);
}

static double FN(row_sum_sq)(const T *x, ptrdiff_t n)
{
    struct pairwise s;
    s.count = 0;
    for (ptrdiff_t i = 0; i < n; i += BLOCK)
        pairwise_add(&s, FN(block_sum_sq)(x + i, block_len(i, n), 0));
    return pairwise_total(&s);
}

#if NORMS_VECTORS
/* Sums of x[i] - shift and of (x[i] - shift)^2 over one block, in one loop: lane by lane the
 * same operations, in the same order, as block_sum and block_sum_sq. */
static void FN(block_sums_dev)(const T *x, ptrdiff_t n, T shift, double *sum_d, double *sum_dd)
{
    FN(vec) acc = {0}, acc2 = {0};
    ptrdiff_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        FN(vec) d;
        memcpy(&d, x + i, sizeof d);
        d = d - shift;
        acc += d;
        acc2 += d * d;
    }
    T a[LANES], a2[LANES];
    memcpy(a, &acc, sizeof a);
    memcpy(a2, &acc2, sizeof a2);
    for (int k = 0; i < n; i++, k++) {
        a[k] += x[i] - shift;
        a2[k] += (x[i] - shift) * (x[i] - shift);
    }
    *sum_d = FN(lanes_total)(a);
    *sum_dd = FN(lanes_total)(a2);
}

/* Sums of g[i] = dy[i] weight[i] and of g[i] (x[i] - shift) over one block, in one loop: the
 * same operations, lane by lane, as block_sum_g and block_sum_gxc. */
static void FN(block_sums_g)(const T *dy, const T *weight, const T *x, ptrdiff_t n, T shift,
                             double *sum_g, double *sum_gxc)
{
    FN(vec) acc = {0}, acc2 = {0};
    ptrdiff_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        FN(vec) g, w, d;
        memcpy(&g, dy + i, sizeof g);
        memcpy(&w, weight + i, sizeof w);
        memcpy(&d, x + i, sizeof d);
        g = g * w;
        acc += g;
        acc2 += g * (d - shift);
    }
    T a[LANES], a2[LANES];
    memcpy(a, &acc, sizeof a);
    memcpy(a2, &acc2, sizeof a2);
    for (int k = 0; i < n; i++, k++) {
        a[k] += dy[i] * weight[i];
        a2[k] += dy[i] * weight[i] * (x[i] - shift);
    }
    *sum_g = FN(lanes_total)(a);
    *sum_gxc = FN(lanes_total)(a2);
}
#else
static void FN(block_sums_dev)(const T *x, ptrdiff_t n, T shift, double *sum_d, double *sum_dd)
{
    *sum_d = FN(block_sum)(x, n, shift);
    *sum_dd = FN(block_sum_sq)(x, n, shift);
}

static void FN(block_sums_g)(const T *dy, const T *weight, const T *x, ptrdiff_t n, T shift,
                             double *sum_g, double *sum_gxc)
{
    *sum_g = FN(block_sum_g)(dy, weight, n);
    *sum_gxc = FN(block_sum_gxc)(dy, weight, x, n, shift);
}
#endif

/* Sums of d[i] = x[i] - shift and of d[i]^2 over a row, in one pass (one loop per block). */
static void FN(row_sums_dev)(const T *x, ptrdiff_t n, T shift, double *sum_d, double *sum_dd)
{
    struct pairwise s_d, s_dd;
    s_d.count = s_dd.count = 0;
    for (ptrdiff_t i = 0; i < n; i += BLOCK) {
        double bd, bdd;
        FN(block_sums_dev)(x + i, block_len(i, n), shift, &bd, &bdd);
        pairwise_add(&s_d, bd);
        pairwise_add(&s_dd, bdd);
    }
    *sum_d = pairwise_total(&s_d);
    *sum_dd = pairwise_total(&s_dd);
}

/* Sum of g[i] (x[i] - shift) over a row, g = dy weight. */
static double FN(row_sum_gxc)(const T *dy, const T *weight, const T *x, ptrdiff_t n, T shift)
{
    struct pairwise s;
    s.count = 0;
    for (ptrdiff_t i = 0; i < n; i += BLOCK)
        pairwise_add(&s, FN(block_sum_gxc)(dy + i, weight + i, x + i, block_len(i, n), shift));
    return pairwise_total(&s);
}

/* Sums of g[i] = dy[i] weight[i] and of g[i] (x[i] - shift) over a row, in one pass. */
static void FN(row_sums_g)(const T *dy, const T *weight, const T *x, ptrdiff_t n, T shift,
                           double *sum_g, double *sum_gxc)
{
    struct pairwise s_g, s_gxc;
    s_g.count = s_gxc.count = 0;
    for (ptrdiff_t i = 0; i < n; i += BLOCK) {
        double bg, bgxc;
        FN(block_sums_g)(dy + i, weight + i, x + i, block_len(i, n), shift, &bg, &bgxc);
        pairwise_add(&s_g, bg);
        pairwise_add(&s_gxc, bgxc);
    }
    *sum_g = pairwise_total(&s_g);
    *sum_gxc = pairwise_total(&s_gxc);
}

/* LayerNorm of one row: two passes for the statistics, one for y. Only the first pass
 * reads x from memory; the row is in cache for the others. */
static void FN(layer_norm_stats)(const T *x, ptrdiff_t n, T mu0, double eps, T *mu, T *rs)
{
    /* corrected two-pass (Chan, Golub and LeVeque): the deviations from mu0 give the
     * correction of the mean and, in the same pass, the variance */
    double sum_d, sum_dd;
    FN(row_sums_dev)(x, n, mu0, &sum_d, &sum_dd);
    double delta = sum_d / n;
    double var = sum_dd / n - delta * delta;
    *mu = (T)(mu0 + delta);
    *rs = (T)(1 / sqrt(var + eps));
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

/* Two short rows a and b: each pass of a, then the same pass of b, so that the processor
 * overlaps the two rows' chains of dependent steps (sum, mean, deviations, rstd, y). Each row
 * gets exactly the operations of layer_norm_forward_row. */
static void FN(layer_norm_forward_pair)(const T *xa, const T *xb, const T *weight,
                                        const T *bias, T *ya, T *yb, T *mean, T *rstd,
                                        ptrdiff_t n, double eps)
{
    T mu0a = (T)(FN(row_sum)(xa, n) / n);
    T mu0b = (T)(FN(row_sum)(xb, n) / n);
    FN(layer_norm_stats)(xa, n, mu0a, eps, mean, rstd);
    FN(layer_norm_stats)(xb, n, mu0b, eps, mean + 1, rstd + 1);
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
            FN(layer_norm_means)(dya, xa, mean[r], rstd[r], weight, n, g, gx);
            FN(layer_norm_means)(dyb, xb, mean[r + 1], rstd[r + 1], weight, n, g + 1, gx + 1);
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
            rstd[r] = FN(rms_norm_rstd)(xa, n, eps);
            rstd[r + 1] = FN(rms_norm_rstd)(xb, n, eps);
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
            gx[0] = FN(rms_norm_mean)(dya, xa, rstd[r], weight, n);
            gx[1] = FN(rms_norm_mean)(dyb, xb, rstd[r + 1], weight, n);
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
