/* Row-wise LayerNorm and RMSNorm on the CPU, forward and backward: the functions that
 * lnlib/_cpu/c_kernel.py calls. cffi reads the declarations below (lines starting with '#'
 * are dropped) to build the binding, and norms.c includes this file, so the compiler
 * checks that the definitions and the binding agree.
 *
 * Shapes (m rows of n elements; the suffix names the element types, below):
 *   x, dy          (m, n)  rows ldx, lddy elements apart (ldx, lddy >= n)
 *   y, dx          (m, n)  contiguous, overlapping no other argument (the kernels declare
 *                          some of their outputs restrict)
 *   mean, rstd     (m,)
 *   weight, bias   (n,)    never NULL (but RMSNorm's bias): the binding passes ones and zeros
 *                          when absent
 *   dweight_blocks, dbias_blocks  (ceil(m / NORMS_BLOCK_ROWS), n) float64, zero on entry:
 *                  row block b gets the column sums of its rows; sum_blocks_pairwise adds
 *                  the blocks, so the totals do not depend on how the rows were split
 *                  among threads (a split must fall on a multiple of NORMS_BLOCK_ROWS).
 */
#ifndef LNLIB_NORMS_H
#define LNLIB_NORMS_H
#include <stddef.h>
#include <stdint.h>

enum { NORMS_BLOCK_ROWS = 128 };

/* The forward: y = norm(x), LayerNorm for rms 0, RMSNorm for rms 1 (bias and mean unused, may
 * be NULL). With a residual (not NULL), the fused residual add: h = residual + x written, then
 * y = norm(h) on those rows while they are in cache, bitwise the plain forward's y of h
 * (lnlib/_rows.py states the rounding); residual rows ldr apart, h contiguous (m, n), possibly
 * residual itself (ldr == n). Without a residual, h is unused (may be NULL). The backward: dx
 * of x (of h for the fused add), and with dh (not NULL, rows lddh apart) dsum = dx + dh in its
 * place; dbias_blocks may be NULL for rms 1.
 *
 * Types by suffix: _f32, _f64 every array in that type; _f16 every (m, n) array float16 (IEEE
 * binary16 bits) with weight, bias, mean and rstd float; _f16f32 x, y and dy float16 with the
 * residual stream float (residual, h, dh; in the backward, x, which is h, and dx, its gradient).
 * A float16 result is exactly the _f32 kernel's on the inputs converted to float, rounded once
 * to float16 (to nearest, ties to even); a float16 h is rounded before it is normalized, a
 * float16 dx before dh is added. They return 0, or 1 when their scratch rows cannot be
 * allocated. */
int norms_forward_f32(int rms, const float *x, ptrdiff_t ldx, const float *residual,
                      ptrdiff_t ldr, const float *weight, const float *bias, float *y, float *h,
                      float *mean, float *rstd, ptrdiff_t m, ptrdiff_t n, double eps);
int norms_forward_f64(int rms, const double *x, ptrdiff_t ldx, const double *residual,
                      ptrdiff_t ldr, const double *weight, const double *bias, double *y,
                      double *h, double *mean, double *rstd, ptrdiff_t m, ptrdiff_t n,
                      double eps);
int norms_forward_f16(int rms, const uint16_t *x, ptrdiff_t ldx, const uint16_t *residual,
                      ptrdiff_t ldr, const float *weight, const float *bias, uint16_t *y,
                      uint16_t *h, float *mean, float *rstd, ptrdiff_t m, ptrdiff_t n,
                      double eps);
int norms_forward_f16f32(int rms, const uint16_t *x, ptrdiff_t ldx, const float *residual,
                         ptrdiff_t ldr, const float *weight, const float *bias, uint16_t *y,
                         float *h, float *mean, float *rstd, ptrdiff_t m, ptrdiff_t n,
                         double eps);
int norms_backward_f32(int rms, const float *dy, ptrdiff_t lddy, const float *dh,
                       ptrdiff_t lddh, const float *x, ptrdiff_t ldx, const float *mean,
                       const float *rstd, const float *weight, float *dx,
                       double *dweight_blocks, double *dbias_blocks, ptrdiff_t m, ptrdiff_t n);
int norms_backward_f64(int rms, const double *dy, ptrdiff_t lddy, const double *dh,
                       ptrdiff_t lddh, const double *x, ptrdiff_t ldx, const double *mean,
                       const double *rstd, const double *weight, double *dx,
                       double *dweight_blocks, double *dbias_blocks, ptrdiff_t m, ptrdiff_t n);
int norms_backward_f16(int rms, const uint16_t *dy, ptrdiff_t lddy, const uint16_t *dh,
                       ptrdiff_t lddh, const uint16_t *x, ptrdiff_t ldx, const float *mean,
                       const float *rstd, const float *weight, uint16_t *dx,
                       double *dweight_blocks, double *dbias_blocks, ptrdiff_t m, ptrdiff_t n);
int norms_backward_f16f32(int rms, const uint16_t *dy, ptrdiff_t lddy, const float *dh,
                          ptrdiff_t lddh, const float *x, ptrdiff_t ldx, const float *mean,
                          const float *rstd, const float *weight, float *dx,
                          double *dweight_blocks, double *dbias_blocks, ptrdiff_t m,
                          ptrdiff_t n);

/* How the float16 kernels convert: "f16c" (the x86-64 instructions, where the CPU has them)
 * or "portable" (bit operations); the same bits. norms_half_to_float and norms_float_to_half
 * convert n values with it, exactly and to nearest with ties to even: for the tests. */
const char *norms_half_conversion(void);
void norms_half_to_float(const uint16_t *h, float *f, ptrdiff_t n);
void norms_float_to_half(const float *f, uint16_t *h, ptrdiff_t n);

/* The version of the kernels the loader picked for this CPU: "avx512f", "avx2" or "default"
 * (the compiler's baseline: on a CPU without AVX2, or where multi-versioning is unavailable). */
const char *norms_kernel_version(void);

/* Streaming of large outputs (non-temporal stores, on by default) on or off for the process, for
 * the benchmark (the values are the same either way); returns the previous setting. */
int norms_set_streaming(int enabled);

/* Adds the rows of blocks (nblocks, n) pairwise, in a fixed order; the total ends in row 0. */
void sum_blocks_pairwise(double *blocks, ptrdiff_t nblocks, ptrdiff_t n);

#endif
