/* Row-wise LayerNorm and RMSNorm on the CPU, forward and backward: the functions that
 * lnlib/_cpu/c_kernel.py calls. cffi reads the declarations below (lines starting with '#'
 * are dropped) to build the binding, and norms.c includes this file, so the compiler
 * checks that the definitions and the binding agree.
 *
 * Shapes (m rows of n elements; the suffix _f32 or _f64 is the element type T):
 *   x, dy          (m, n)  rows ldx, lddy elements apart (ldx, lddy >= n)
 *   y, dx          (m, n)  contiguous, overlapping no other argument (the kernels declare
 *                          some of their outputs restrict)
 *   mean, rstd     (m,)
 *   weight, bias   (n,)    never NULL: the binding passes ones and zeros when absent
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

void layer_norm_forward_f32(const float *x, ptrdiff_t ldx, const float *weight,
                            const float *bias, float *y, float *mean, float *rstd,
                            ptrdiff_t m, ptrdiff_t n, double eps);
void layer_norm_forward_f64(const double *x, ptrdiff_t ldx, const double *weight,
                            const double *bias, double *y, double *mean, double *rstd,
                            ptrdiff_t m, ptrdiff_t n, double eps);

void layer_norm_backward_f32(const float *dy, ptrdiff_t lddy, const float *x, ptrdiff_t ldx,
                             const float *mean, const float *rstd, const float *weight,
                             float *dx, double *dweight_blocks, double *dbias_blocks,
                             ptrdiff_t m, ptrdiff_t n);
void layer_norm_backward_f64(const double *dy, ptrdiff_t lddy, const double *x, ptrdiff_t ldx,
                             const double *mean, const double *rstd, const double *weight,
                             double *dx, double *dweight_blocks, double *dbias_blocks,
                             ptrdiff_t m, ptrdiff_t n);

void rms_norm_forward_f32(const float *x, ptrdiff_t ldx, const float *weight, float *y,
                          float *rstd, ptrdiff_t m, ptrdiff_t n, double eps);
void rms_norm_forward_f64(const double *x, ptrdiff_t ldx, const double *weight, double *y,
                          double *rstd, ptrdiff_t m, ptrdiff_t n, double eps);

void rms_norm_backward_f32(const float *dy, ptrdiff_t lddy, const float *x, ptrdiff_t ldx,
                           const float *rstd, const float *weight, float *dx,
                           double *dweight_blocks, ptrdiff_t m, ptrdiff_t n);
void rms_norm_backward_f64(const double *dy, ptrdiff_t lddy, const double *x, ptrdiff_t ldx,
                           const double *rstd, const double *weight, double *dx,
                           double *dweight_blocks, ptrdiff_t m, ptrdiff_t n);

/* float16 (the _f16 kernels): x, dy, y and dx hold IEEE binary16 bits (uint16_t); weight,
 * bias, mean and rstd are float. Each row is converted to float, goes through the float32
 * kernel's row functions, and y and dx are rounded to float16 once (to nearest, ties to
 * even): the results are exactly those of the _f32 kernel on the inputs converted to float32.
 * They return 0, or 1 when the scratch rows cannot be allocated. */
int layer_norm_forward_f16(const uint16_t *x, ptrdiff_t ldx, const float *weight,
                           const float *bias, uint16_t *y, float *mean, float *rstd,
                           ptrdiff_t m, ptrdiff_t n, double eps);
int layer_norm_backward_f16(const uint16_t *dy, ptrdiff_t lddy, const uint16_t *x,
                            ptrdiff_t ldx, const float *mean, const float *rstd,
                            const float *weight, uint16_t *dx, double *dweight_blocks,
                            double *dbias_blocks, ptrdiff_t m, ptrdiff_t n);
int rms_norm_forward_f16(const uint16_t *x, ptrdiff_t ldx, const float *weight, uint16_t *y,
                         float *rstd, ptrdiff_t m, ptrdiff_t n, double eps);
int rms_norm_backward_f16(const uint16_t *dy, ptrdiff_t lddy, const uint16_t *x, ptrdiff_t ldx,
                          const float *rstd, const float *weight, uint16_t *dx,
                          double *dweight_blocks, ptrdiff_t m, ptrdiff_t n);

/* How the float16 kernels convert: "f16c" (the x86-64 instructions, where the CPU has them)
 * or "portable" (bit operations); the same bits. norms_half_to_float and norms_float_to_half
 * convert n values with it, exactly and to nearest with ties to even: for the tests. */
const char *norms_half_conversion(void);
void norms_half_to_float(const uint16_t *h, float *f, ptrdiff_t n);
void norms_float_to_half(const float *f, uint16_t *h, ptrdiff_t n);

/* The version of the kernels the loader picked for this CPU: "avx512f", "avx2" or "default"
 * (the compiler's baseline; the only one where multi-versioning is not available). */
const char *norms_kernel_version(void);

/* Switches the streaming of large outputs (non-temporal stores, on by default) on or off for
 * the whole process; returns the previous setting. The values written are the same either
 * way: the benchmark uses it to time the two ways of storing. */
int norms_set_streaming(int enabled);

/* Adds the rows of blocks (nblocks, n) pairwise, in a fixed order; the total ends in row 0. */
void sum_blocks_pairwise(double *blocks, ptrdiff_t nblocks, ptrdiff_t n);

/* The fused residual add: h = residual + x, then the norm of h; the backward dsum = dx + dh.
 * lnlib/_rows.py states the rounding. Two rows at a time, the add into h, then the norm's row
 * code on those rows of h while they are in cache: y is bitwise the kernel's y of h, dsum its dx
 * plus dh. residual rows ldr apart; h, y, dsum contiguous (m, n); h may be residual itself
 * (ldr == n), nothing else overlaps. dh may be NULL (zero). Suffixes: _f32, _f64 and _f16 all
 * arrays in that type (float16 as uint16_t bits, weight, bias, mean, rstd in float); _f16f32:
 * x, y and dy float16, residual, h, dh, dsum float. They return 0, or 1 when their scratch
 * cannot be allocated. */
int add_layer_norm_forward_f32(const float *x, ptrdiff_t ldx, const float *residual,
                               ptrdiff_t ldr, const float *weight, const float *bias, float *y,
                               float *h, float *mean, float *rstd, ptrdiff_t m, ptrdiff_t n,
                               double eps);
int add_layer_norm_forward_f64(const double *x, ptrdiff_t ldx, const double *residual,
                               ptrdiff_t ldr, const double *weight, const double *bias,
                               double *y, double *h, double *mean, double *rstd, ptrdiff_t m,
                               ptrdiff_t n, double eps);
int add_layer_norm_forward_f16(const uint16_t *x, ptrdiff_t ldx, const uint16_t *residual,
                               ptrdiff_t ldr, const float *weight, const float *bias,
                               uint16_t *y, uint16_t *h, float *mean, float *rstd, ptrdiff_t m,
                               ptrdiff_t n, double eps);
int add_layer_norm_forward_f16f32(const uint16_t *x, ptrdiff_t ldx, const float *residual,
                                  ptrdiff_t ldr, const float *weight, const float *bias,
                                  uint16_t *y, float *h, float *mean, float *rstd, ptrdiff_t m,
                                  ptrdiff_t n, double eps);
int add_rms_norm_forward_f32(const float *x, ptrdiff_t ldx, const float *residual,
                             ptrdiff_t ldr, const float *weight, float *y, float *h,
                             float *rstd, ptrdiff_t m, ptrdiff_t n, double eps);
int add_rms_norm_forward_f64(const double *x, ptrdiff_t ldx, const double *residual,
                             ptrdiff_t ldr, const double *weight, double *y, double *h,
                             double *rstd, ptrdiff_t m, ptrdiff_t n, double eps);
int add_rms_norm_forward_f16(const uint16_t *x, ptrdiff_t ldx, const uint16_t *residual,
                             ptrdiff_t ldr, const float *weight, uint16_t *y, uint16_t *h,
                             float *rstd, ptrdiff_t m, ptrdiff_t n, double eps);
int add_rms_norm_forward_f16f32(const uint16_t *x, ptrdiff_t ldx, const float *residual,
                                ptrdiff_t ldr, const float *weight, uint16_t *y, float *h,
                                float *rstd, ptrdiff_t m, ptrdiff_t n, double eps);
int add_layer_norm_backward_f32(const float *dy, ptrdiff_t lddy, const float *dh,
                                ptrdiff_t lddh, const float *h, ptrdiff_t ldh, const float *mean,
                                const float *rstd, const float *weight, float *dsum,
                                double *dweight_blocks, double *dbias_blocks, ptrdiff_t m,
                                ptrdiff_t n);
int add_layer_norm_backward_f64(const double *dy, ptrdiff_t lddy, const double *dh,
                                ptrdiff_t lddh, const double *h, ptrdiff_t ldh,
                                const double *mean, const double *rstd, const double *weight,
                                double *dsum, double *dweight_blocks, double *dbias_blocks,
                                ptrdiff_t m, ptrdiff_t n);
int add_layer_norm_backward_f16(const uint16_t *dy, ptrdiff_t lddy, const uint16_t *dh,
                                ptrdiff_t lddh, const uint16_t *h, ptrdiff_t ldh,
                                const float *mean, const float *rstd, const float *weight,
                                uint16_t *dsum, double *dweight_blocks, double *dbias_blocks,
                                ptrdiff_t m, ptrdiff_t n);
int add_layer_norm_backward_f16f32(const uint16_t *dy, ptrdiff_t lddy, const float *dh,
                                   ptrdiff_t lddh, const float *h, ptrdiff_t ldh,
                                   const float *mean, const float *rstd, const float *weight,
                                   float *dsum, double *dweight_blocks, double *dbias_blocks,
                                   ptrdiff_t m, ptrdiff_t n);
int add_rms_norm_backward_f32(const float *dy, ptrdiff_t lddy, const float *dh, ptrdiff_t lddh,
                              const float *h, ptrdiff_t ldh, const float *rstd,
                              const float *weight, float *dsum, double *dweight_blocks,
                              ptrdiff_t m, ptrdiff_t n);
int add_rms_norm_backward_f64(const double *dy, ptrdiff_t lddy, const double *dh,
                              ptrdiff_t lddh, const double *h, ptrdiff_t ldh,
                              const double *rstd, const double *weight, double *dsum,
                              double *dweight_blocks, ptrdiff_t m, ptrdiff_t n);
int add_rms_norm_backward_f16(const uint16_t *dy, ptrdiff_t lddy, const uint16_t *dh,
                              ptrdiff_t lddh, const uint16_t *h, ptrdiff_t ldh,
                              const float *rstd, const float *weight, uint16_t *dsum,
                              double *dweight_blocks, ptrdiff_t m, ptrdiff_t n);
int add_rms_norm_backward_f16f32(const uint16_t *dy, ptrdiff_t lddy, const float *dh,
                                 ptrdiff_t lddh, const float *h, ptrdiff_t ldh,
                                 const float *rstd, const float *weight, float *dsum,
                                 double *dweight_blocks, ptrdiff_t m, ptrdiff_t n);

#endif
