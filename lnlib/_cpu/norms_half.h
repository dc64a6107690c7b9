/* The float16 kernels (declared in norms.h), included at the end of norms.c, after the
 * float instantiation of norms_typed.h, whose static row functions they call.
 *
 * Definition: a float16 result is the float32 kernel's result on the inputs converted to
 * float (exact: every float16 is a float), with y and dx rounded once to float16, to nearest
 * with ties to even; mean, rstd and the column sums are the float32 kernel's. Each kernel
 * converts a row (two rows for n <= PAIR_MAX, as the float32 kernels pair them) into float
 * scratch rows, runs the float32 row functions on them, and converts the float y or dx into
 * the output. The scratch stays in cache, so the rows are still read from memory once. The
 * outputs are written with ordinary stores, never streamed (norms_set_streaming does not
 * apply): streaming them made no clear difference to these kernels, which convert as they go.
 *
 * The conversions: the F16C instructions where the CPU has them (x86-64; chosen at run time,
 * since the "avx2" version of NORMS_KERNEL does not imply F16C), else the compiler's
 * _Float16, else bit operations. They are all exact or correctly rounded, so all give the
 * same bits; -DNORMS_NO_F16C and -DNORMS_NO_FLOAT16 force the later ones (the tests build
 * them and compare).
 */
#include <stdint.h>
#include <stdlib.h>

#if defined(__x86_64__) && defined(__GNUC__) && defined(__has_attribute)
#if __has_attribute(target) && !defined(NORMS_NO_F16C) && !defined(NORMS_NO_FLOAT16)
#define NORMS_F16C 1
#include <immintrin.h>
#endif
#endif
#ifndef NORMS_F16C
#define NORMS_F16C 0
#endif
#if defined(__FLT16_MANT_DIG__) && NORMS_VECTORS && !defined(NORMS_NO_FLOAT16)
#define NORMS_FLOAT16 1
typedef _Float16 hvec16 __attribute__((vector_size(16 * sizeof(_Float16))));
typedef float fvec16 __attribute__((vector_size(16 * sizeof(float))));
#else
#define NORMS_FLOAT16 0
#endif

/* float16 bits to float, exactly. A NaN stays a NaN with its payload, quieted (as F16C). */
static float half_to_float(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t bits;
    float f;
    if (exp == 0x1f) /* infinity, or NaN */
        bits = sign | 0x7f800000u | (man ? 0x400000u | man << 13 : 0);
    else if (exp) /* normal: the exponent rebiased from 15 to 127 */
        bits = sign | (exp + 112) << 23 | man << 13;
    else { /* zero or subnormal: man 2^-24, a normal float (or zero), exact */
        f = (float)man * 0x1p-24f;
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    }
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* h + 1 when the dropped bits `rest` are above half of the last kept bit's weight, or equal
 * to it and h is odd: rounding to nearest, ties to even. */
static uint32_t round_even(uint32_t h, uint32_t rest, uint32_t half)
{
    return h + (rest > half || (rest == half && (h & 1)));
}

/* float to float16 bits, rounded to nearest, ties to even: 65520 and above overflow to
 * infinity, small values become subnormals or zero; a NaN keeps the top of its payload and
 * is quieted (as F16C). A carry out of the significand moves to the exponent by itself. */
static uint16_t float_to_half(float f)
{
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    uint32_t sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
    if (a > 0x7f800000u) /* NaN */
        return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) /* 65520 (halfway from 65504 to 2^16) or more */
        return (uint16_t)(sign | 0x7c00u);
    if (a >= 0x38800000u) /* 2^-14 or more: normal; 13 bits dropped, exponent rebiased */
        return (uint16_t)(sign | round_even((a >> 13) - (112u << 10), a & 0x1fffu, 0x1000u));
    if (a <= 0x33000000u) /* 2^-25 or less (2^-25 is a tie, to the even 0) */
        return (uint16_t)sign;
    /* subnormal: the significand with its leading bit, in units of 2^-24 */
    uint32_t man = (a & 0x7fffffu) | 0x800000u, shift = 126 - (a >> 23);
    return (uint16_t)(sign | round_even(man >> shift, man & ((1u << shift) - 1),
                                        1u << (shift - 1)));
}

#if NORMS_F16C
/* F16C: eight values per instruction; the rest one by one with the bit operations. */
__attribute__((target("avx,f16c"))) static void halves_to_floats_f16c(const uint16_t *h,
                                                                     float *f, ptrdiff_t n)
{
    ptrdiff_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
    for (; i < n; i++)
        f[i] = half_to_float(h[i]);
}

__attribute__((target("avx,f16c"))) static void floats_to_halves_f16c(const float *f,
                                                                     uint16_t *h, ptrdiff_t n)
{
    ptrdiff_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(h + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(f + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++)
        h[i] = float_to_half(f[i]);
}
#endif

#if NORMS_FLOAT16
/* The compiler's _Float16, sixteen values at a time (vector conversions where the target
 * has them); the rest one by one. */
static void halves_to_floats_float16(const uint16_t *h, float *f, ptrdiff_t n)
{
    ptrdiff_t i = 0;
    for (; i + 16 <= n; i += 16) {
        hvec16 a;
        memcpy(&a, h + i, sizeof a);
        fvec16 b = __builtin_convertvector(a, fvec16);
        memcpy(f + i, &b, sizeof b);
    }
    for (; i < n; i++) {
        _Float16 a;
        memcpy(&a, h + i, sizeof a);
        f[i] = (float)a;
    }
}

static void floats_to_halves_float16(const float *f, uint16_t *h, ptrdiff_t n)
{
    ptrdiff_t i = 0;
    for (; i + 16 <= n; i += 16) {
        fvec16 a;
        memcpy(&a, f + i, sizeof a);
        hvec16 b = __builtin_convertvector(a, hvec16);
        memcpy(h + i, &b, sizeof b);
    }
    for (; i < n; i++) {
        _Float16 b = (_Float16)f[i];
        memcpy(h + i, &b, sizeof b);
    }
}
#endif

/* Which conversion runs here: 2 F16C, 1 _Float16, 0 bit operations. */
static int half_conversion(void)
{
#if NORMS_F16C
    __builtin_cpu_init();
    if (__builtin_cpu_supports("f16c"))
        return 2;
#endif
    return NORMS_FLOAT16;
}

const char *norms_half_conversion(void)
{
    static const char *const names[] = {"portable", "_Float16", "f16c"};
    return names[half_conversion()];
}

/* n float16 values to float, and back, with the conversion `how` (half_conversion). */
static void halves_to_floats(const uint16_t *h, float *f, ptrdiff_t n, int how)
{
#if NORMS_F16C
    if (how == 2) {
        halves_to_floats_f16c(h, f, n);
        return;
    }
#endif
#if NORMS_FLOAT16
    if (how == 1) {
        halves_to_floats_float16(h, f, n);
        return;
    }
#endif
    (void)how;
    for (ptrdiff_t i = 0; i < n; i++)
        f[i] = half_to_float(h[i]);
}

static void floats_to_halves(const float *f, uint16_t *h, ptrdiff_t n, int how)
{
#if NORMS_F16C
    if (how == 2) {
        floats_to_halves_f16c(f, h, n);
        return;
    }
#endif
#if NORMS_FLOAT16
    if (how == 1) {
        floats_to_halves_float16(f, h, n);
        return;
    }
#endif
    (void)how;
    for (ptrdiff_t i = 0; i < n; i++)
        h[i] = float_to_half(f[i]);
}

/* The conversions of this machine, exported for the tests (norms.h). */
void norms_half_to_float(const uint16_t *h, float *f, ptrdiff_t n)
{
    halves_to_floats(h, f, n, half_conversion());
}

void norms_float_to_half(const float *f, uint16_t *h, ptrdiff_t n)
{
    floats_to_halves(f, h, n, half_conversion());
}

/* Scratch rows of a float16 call: `arrays` float arrays (the converted inputs, then the float
 * outputs) of two rows each when rows go in pairs (n <= PAIR_MAX), one otherwise. Array k,
 * row j is at buf + (k rows + j) stride: every row starts a multiple of 64 bytes after the
 * first. */
struct half_scratch {
    float *buf;
    ptrdiff_t stride, rows;
    int how; /* the conversion (half_conversion) */
};

static int half_scratch_alloc(struct half_scratch *s, int arrays, ptrdiff_t n)
{
    if (n > PTRDIFF_MAX / 64 / (2 * arrays)) /* the size would not fit in a ptrdiff_t */
        return 0;
    s->stride = (n + 15) / 16 * 16;
    s->rows = n <= PAIR_MAX ? 2 : 1;
    s->how = half_conversion();
    size_t count = (size_t)arrays * (size_t)(s->rows * s->stride);
    s->buf = malloc(count ? count * sizeof(float) : 1);
    return s->buf != NULL;
}

static float *half_row(const struct half_scratch *s, int k, int j)
{
    return s->buf + (k * s->rows + j) * s->stride;
}

/* Rows r and r + 1 (count 2) or row r (count 1) of a (ld apart) into array k of the scratch. */
static void rows_in(const struct half_scratch *s, int k, const uint16_t *a, ptrdiff_t ld,
                    ptrdiff_t r, int count, ptrdiff_t n)
{
    for (int j = 0; j < count; j++)
        halves_to_floats(a + (r + j) * ld, half_row(s, k, j), n, s->how);
}

/* Array k of the scratch out to rows r (and r + 1) of the contiguous (m, n) output a. */
static void rows_out(const struct half_scratch *s, int k, uint16_t *a, ptrdiff_t r, int count,
                     ptrdiff_t n)
{
    for (int j = 0; j < count; j++)
        floats_to_halves(half_row(s, k, j), a + (r + j) * n, n, s->how);
}

/* Scratch arrays: 0 x, 1 y (forward); 0 dy, 1 x, 2 dx (backward). Rows in pairs up to
 * PAIR_MAX long, as the float32 kernels take them, then one at a time. */

NORMS_KERNEL int layer_norm_forward_f16(const uint16_t *x, ptrdiff_t ldx, const float *weight,
                                        const float *bias, uint16_t *y, float *mean,
                                        float *rstd, ptrdiff_t m, ptrdiff_t n, double eps)
{
    struct half_scratch s;
    if (!half_scratch_alloc(&s, 2, n))
        return 1;
    float *xa = half_row(&s, 0, 0), *ya = half_row(&s, 1, 0);
    ptrdiff_t r = 0;
    if (n <= PAIR_MAX)
        for (; r + 1 < m; r += 2) {
            rows_in(&s, 0, x, ldx, r, 2, n);
            layer_norm_forward_pair_f32(xa, half_row(&s, 0, 1), weight, bias, ya,
                                        half_row(&s, 1, 1), mean + r, rstd + r, n, eps);
            rows_out(&s, 1, y, r, 2, n);
        }
    for (; r < m; r++) {
        rows_in(&s, 0, x, ldx, r, 1, n);
        layer_norm_forward_row_f32(xa, weight, bias, ya, mean + r, rstd + r, n, eps);
        rows_out(&s, 1, y, r, 1, n);
    }
    free(s.buf);
    return 0;
}

/* The two rows r, r + 1 of layer_norm_backward_f16, in the scratch, as the float32 kernel
 * takes a pair. */
static void layer_norm_backward_pair_f16(const struct half_scratch *s, const float *mean,
                                         const float *rstd, const float *weight, double *dw,
                                         double *db, ptrdiff_t n)
{
    const float *dya = half_row(s, 0, 0), *dyb = half_row(s, 0, 1);
    const float *xa = half_row(s, 1, 0), *xb = half_row(s, 1, 1);
    float g[2], gx[2];
    layer_norm_means_pair_f32(dya, dyb, xa, xb, mean, rstd, weight, n, g, gx);
    layer_norm_dx_pair_f32(dya, dyb, xa, xb, mean, rstd, weight, g, gx, half_row(s, 2, 0),
                           half_row(s, 2, 1), dw, db, n);
}

NORMS_KERNEL int layer_norm_backward_f16(const uint16_t *dy, ptrdiff_t lddy, const uint16_t *x,
                                         ptrdiff_t ldx, const float *mean, const float *rstd,
                                         const float *weight, uint16_t *dx,
                                         double *dweight_blocks, double *dbias_blocks,
                                         ptrdiff_t m, ptrdiff_t n)
{
    struct half_scratch s;
    if (!half_scratch_alloc(&s, 3, n))
        return 1;
    ptrdiff_t r = 0;
    if (n <= PAIR_MAX)
        for (; r + 1 < m; r += 2) {
            ptrdiff_t b = (r / NORMS_BLOCK_ROWS) * n;
            rows_in(&s, 0, dy, lddy, r, 2, n);
            rows_in(&s, 1, x, ldx, r, 2, n);
            layer_norm_backward_pair_f16(&s, mean + r, rstd + r, weight, dweight_blocks + b,
                                         dbias_blocks + b, n);
            rows_out(&s, 2, dx, r, 2, n);
        }
    for (; r < m; r++) {
        ptrdiff_t b = (r / NORMS_BLOCK_ROWS) * n;
        rows_in(&s, 0, dy, lddy, r, 1, n);
        rows_in(&s, 1, x, ldx, r, 1, n);
        layer_norm_backward_row_f32(half_row(&s, 0, 0), half_row(&s, 1, 0), mean[r], rstd[r],
                                    weight, half_row(&s, 2, 0), dweight_blocks + b,
                                    dbias_blocks + b, n);
        rows_out(&s, 2, dx, r, 1, n);
    }
    free(s.buf);
    return 0;
}

NORMS_KERNEL int rms_norm_forward_f16(const uint16_t *x, ptrdiff_t ldx, const float *weight,
                                      uint16_t *y, float *rstd, ptrdiff_t m, ptrdiff_t n,
                                      double eps)
{
    struct half_scratch s;
    if (!half_scratch_alloc(&s, 2, n))
        return 1;
    float *xa = half_row(&s, 0, 0), *ya = half_row(&s, 1, 0);
    ptrdiff_t r = 0;
    if (n <= PAIR_MAX)
        for (; r + 1 < m; r += 2) {
            float *xb = half_row(&s, 0, 1);
            rows_in(&s, 0, x, ldx, r, 2, n);
            rms_norm_rstd_pair_f32(xa, xb, n, eps, rstd + r);
            rms_norm_y_f32(xa, weight, ya, rstd[r], n);
            rms_norm_y_f32(xb, weight, half_row(&s, 1, 1), rstd[r + 1], n);
            rows_out(&s, 1, y, r, 2, n);
        }
    for (; r < m; r++) {
        rows_in(&s, 0, x, ldx, r, 1, n);
        rms_norm_forward_row_f32(xa, weight, ya, rstd + r, n, eps);
        rows_out(&s, 1, y, r, 1, n);
    }
    free(s.buf);
    return 0;
}

NORMS_KERNEL int rms_norm_backward_f16(const uint16_t *dy, ptrdiff_t lddy, const uint16_t *x,
                                       ptrdiff_t ldx, const float *rstd, const float *weight,
                                       uint16_t *dx, double *dweight_blocks, ptrdiff_t m,
                                       ptrdiff_t n)
{
    struct half_scratch s;
    if (!half_scratch_alloc(&s, 3, n))
        return 1;
    float *dya = half_row(&s, 0, 0), *xa = half_row(&s, 1, 0), *dxa = half_row(&s, 2, 0);
    ptrdiff_t r = 0;
    if (n <= PAIR_MAX)
        for (; r + 1 < m; r += 2) {
            float *dyb = half_row(&s, 0, 1), *xb = half_row(&s, 1, 1), gx[2];
            rows_in(&s, 0, dy, lddy, r, 2, n);
            rows_in(&s, 1, x, ldx, r, 2, n);
            rms_norm_mean_pair_f32(dya, dyb, xa, xb, rstd + r, weight, n, gx);
            rms_norm_dx_pair_f32(dya, dyb, xa, xb, rstd + r, weight, gx, dxa, half_row(&s, 2, 1),
                                 dweight_blocks + (r / NORMS_BLOCK_ROWS) * n, n);
            rows_out(&s, 2, dx, r, 2, n);
        }
    for (; r < m; r++) {
        rows_in(&s, 0, dy, lddy, r, 1, n);
        rows_in(&s, 1, x, ldx, r, 1, n);
        rms_norm_backward_row_f32(dya, xa, rstd[r], weight, dxa,
                                  dweight_blocks + (r / NORMS_BLOCK_ROWS) * n, n);
        rows_out(&s, 2, dx, r, 1, n);
    }
    free(s.buf);
    return 0;
}
