/* Row-wise LayerNorm and RMSNorm, forward and backward, for the CPU (declared in norms.h), built
 * into lnlib._cpu._norms by build.py; c_kernel.py calls it on chunks of rows, one per thread. The
 * row functions are written once, in norms_rows.h, included below for float and for double; the
 * float16 kernels convert rows to float and run the float ones.
 *
 * A row that fits in cache is read from memory once: the later passes find it there. The order of
 * every sum depends on the row length (and, for the column sums, on the fixed row blocks) only, so
 * results are bitwise batch and thread invariant. Compiled with -ffp-contract=off (no multiply-add
 * fused behind our back); on x86-64 each exported kernel and row function is also compiled for AVX2
 * and AVX-512 (target_clones), with the same bits, since the lanes and their order are written out.
 * Build switches, for the tests: -DNORMS_NO_CLONES (the baseline version alone), -DNORMS_NO_F16C
 * (the portable float16 conversion alone). Book: chapter "Implementation", "A compiled kernel". */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "norms.h"

enum { LANES = 16, BLOCK = 256 };

#if defined(__has_attribute) && defined(__x86_64__) && defined(__GLIBC__)
#if __has_attribute(target_clones) && !defined(NORMS_NO_CLONES)
#define NORMS_CLONES 1
#endif
#endif
#ifdef NORMS_CLONES
/* flatten: what a version calls is inlined, so compiled for its instruction set too; the row
 * functions (ROWS_KERNEL) are versions of their own, called directly by each version: inlined,
 * the two-row backward's loop ran out of registers. */
#define NORMS_KERNEL __attribute__((target_clones("avx512f", "avx2", "default"), flatten))
#define ROWS_KERNEL NORMS_KERNEL __attribute__((noinline))
#else
#define NORMS_KERNEL
#define ROWS_KERNEL
#endif

const char *norms_kernel_version(void)
{
#ifdef NORMS_CLONES
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f"))
        return "avx512f";
    if (__builtin_cpu_supports("avx2"))
        return "avx2";
#endif
    return "default";
}

/* Rows up to PAIR_MAX long go two at a time (the row functions' k): two rows of x and dy in
 * float64 (256 KiB) still fit in a core's L2 cache. How many rows start at row r: */
enum { PAIR_MAX = 8192 };
_Static_assert(NORMS_BLOCK_ROWS % 2 == 0, "a pair of rows must fall in one row block");

static int rows_at(ptrdiff_t r, ptrdiff_t m, ptrdiff_t n)
{
    return r + 1 < m && n <= PAIR_MAX ? 2 : 1;
}

/* `count` pairwise sums of streams of values (binary counters): level[k][c] holds the sum of
 * the last 2^k values of sum c not yet merged, so each value goes through at most log2(blocks)
 * additions; sums of one pass get their values together. */
struct pairwise {
    double level[64][4];
    long long blocks;
};

/* The totals: the levels still held, from the lowest. */
static void pairwise_totals(const struct pairwise *p, int count, double *total)
{
    for (int c = 0; c < count; c++) {
        total[c] = 0;
        for (int k = 0; (p->blocks >> k) != 0; k++)
            if ((p->blocks >> k) & 1)
                total[c] = p->level[k][c] + total[c];
    }
}

void sum_blocks_pairwise(double *blocks, ptrdiff_t nblocks, ptrdiff_t n)
{
    for (ptrdiff_t step = 1; step < nblocks; step *= 2)
        for (ptrdiff_t b = 0; b + step < nblocks; b += 2 * step)
            for (ptrdiff_t j = 0; j < n; j++)
                blocks[b * n + j] += blocks[(b + step) * n + j];
}

/* Non-temporal ("streaming") stores (SSE2: every x86-64): an output row made in a scratch row
 * is written without the read for ownership of an ordinary store, so a forward moves two arrays'
 * worth of bytes, not three. Only for outputs of STREAM_BYTES or more (a smaller one may still be
 * in cache when next read) in rows of at most STREAM_ROW_MAX (the scratch stays in L1 or L2). */
#ifdef __SSE2__
#include <emmintrin.h>
#endif
enum { STREAM_BYTES = 8 << 20, STREAM_ROW_MAX = 8192 };
static int stream_enabled = 1;

int norms_set_streaming(int enabled)
{
    int before = stream_enabled;
    stream_enabled = enabled != 0;
    return before;
}

/* n values of `size` bytes from src to dst: ordinary stores up to dst's first 16-byte boundary,
 * streamed ones from there, the tail ordinary (all ordinary when that head is not whole values
 * or is longer than the copy). */
static void stream_copy(void *dst, const void *src, ptrdiff_t n, size_t size)
{
    char *d = dst;
    const char *s = src;
    size_t bytes = (size_t)n * size, i = 0;
#ifdef __SSE2__
    size_t head = (16 - (uintptr_t)d % 16) % 16;
    if (head % size == 0 && head <= bytes) {
        memcpy(d, s, head);
        for (i = head; i + 16 <= bytes; i += 16)
            _mm_stream_si128((__m128i *)(d + i), _mm_loadu_si128((const __m128i *)(s + i)));
    }
#endif
    memcpy(d + i, s + i, bytes - i);
}

/* Eight scratch rows of n values of `size` bytes (and one value more: never malloc(0)) where
 * float16 rows (half) or streaming need them, else NULL; *stream: whether the call streams its
 * (m, n) output (not if malloc failed). */
static void *scratch(int half, int *stream, ptrdiff_t m, ptrdiff_t n, size_t size)
{
#ifdef __SSE2__
    *stream = stream_enabled && n <= STREAM_ROW_MAX && (size_t)m * (size_t)n * size >= STREAM_BYTES;
#else
    *stream = 0;
#endif
    void *tmp = (half || *stream) && n < PTRDIFF_MAX / 64 ? malloc((8 * (size_t)n + 1) * size) : 0;
    *stream = *stream && tmp;
    return tmp;
}

/* Frees the scratch and, after streamed stores, orders them before what this thread does next
 * (the caller then hands the output to other threads). */
static void stream_end(void *scratch, int stream)
{
#ifdef __SSE2__
    if (stream)
        _mm_sfence();
#endif
    (void)stream;
    free(scratch);
}

/* float16 conversions: the F16C instructions where the CPU has them (chosen at run time: the
 * "avx2" version does not imply F16C), else bit operations; the same bits either way. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(NORMS_NO_F16C)
#define NORMS_F16C 1
#include <immintrin.h>
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

/* float to float16 bits, to nearest, ties to even: 65520 and above overflow to infinity,
 * small values become subnormals or zero; a NaN keeps the top of its payload and is quieted
 * (as F16C). A carry out of the significand moves to the exponent by itself. */
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

static int have_f16c(void)
{
#ifdef NORMS_F16C
    __builtin_cpu_init();
    return __builtin_cpu_supports("f16c");
#endif
    return 0;
}

const char *norms_half_conversion(void)
{
    return have_f16c() ? "f16c" : "portable";
}

#ifdef NORMS_F16C
/* The first n - n % 8 values of a row, eight per instruction; returns how many. */
__attribute__((target("avx,f16c"))) static ptrdiff_t f16c_in(const uint16_t *a, float *f,
                                                             ptrdiff_t n)
{
    ptrdiff_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a + i))));
    return i;
}

__attribute__((target("avx,f16c"))) static ptrdiff_t f16c_out(const float *f, uint16_t *a,
                                                              ptrdiff_t n)
{
    ptrdiff_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(a + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(f + i), _MM_FROUND_TO_NEAREST_INT));
    return i;
}
#else
#define f16c_in(a, f, n) 0
#define f16c_out(f, a, n) 0
#endif

/* An input of the kernels: rows ld elements apart, of the type T of the kernel that reads them,
 * or (half) float16 bits, which only float kernels read. */
struct rows {
    const void *p;
    ptrdiff_t ld;
    int half;
};
#define ROWS(p, ld, half) ((struct rows){(p), (ld), (half)})
#define NONE ROWS(NULL, 0, 0)

/* The skeleton of a pass over the rows (norms_rows.h): per block, the lanes a[c] of `count`
 * sums, to which the statements `...` add element e to lane k (element i of the block to lane
 * i % LANES); then each block's lanes are added, in float64, to the sum's pairwise total, and
 * the totals go to sum[]. A full block's steps (i from the block's start) are a loop of fixed
 * count unrolled 4 times, with no exit test between steps (with one after each, GCC kept the
 * lanes in memory; unrolled fully, it spilled float64's lanes), and the lane loop 8 times for
 * the vectoriser (fully, GCC makes the block loop in-order reductions); a row's last, short
 * block takes plain loops. The lanes are zeroed by stores: GCC makes an initializer
 * ({{0}}) a per-block memset (rep stos, slow to start). */
#define LANE_STEP(...)                                                                         \
    _Pragma("GCC unroll 8") for (int k = 0; k < LANES; k++)                                    \
    {                                                                                          \
        const ptrdiff_t e = start + i + k;                                                     \
        __VA_ARGS__                                                                            \
    }
#define LANE_PASS(count, n, sum, ...)                                                          \
    do {                                                                                       \
        struct pairwise s_;                                                                    \
        s_.blocks = 0;                                                                         \
        for (ptrdiff_t start = 0; start < (n); start += BLOCK) {                               \
            ptrdiff_t len = (n) - start < BLOCK ? (n) - start : BLOCK, i = 0;                  \
            T a[count][LANES];                                                                 \
            for (int c = 0; c < (count); c++)                                                  \
                _Pragma("GCC unroll 16") for (int k = 0; k < LANES; k++) a[c][k] = 0;          \
            if (len == BLOCK)                                                                  \
                _Pragma("GCC unroll 4") for (; i < BLOCK; i += LANES)                          \
                    LANE_STEP(__VA_ARGS__)                                                     \
            else {                                                                             \
                for (; i + LANES <= len; i += LANES)                                           \
                    LANE_STEP(__VA_ARGS__)                                                     \
                for (int k = 0; i < len; i++, k++) {                                           \
                    const ptrdiff_t e = start + i;                                             \
                    __VA_ARGS__                                                                \
                }                                                                              \
            }                                                                                  \
            FN(pairwise_add)(&s_, a, count);                                                   \
        }                                                                                      \
        pairwise_totals(&s_, count, sum);                                                      \
    } while (0)

#define T float
#define FN(name) name##_f32
#include "norms_rows.h"
#undef T
#undef FN

#define T double
#define FN(name) name##_f64
#include "norms_rows.h"
#undef T
#undef FN

/* n float16 values to float, and back, as the float16 kernels convert (for the tests). */
void norms_half_to_float(const uint16_t *h, float *f, ptrdiff_t n)
{
    ptrdiff_t ld;
    rows_read_f32(ROWS(h, n, 1), 0, 1, n, f, &ld);
}

void norms_float_to_half(const float *f, uint16_t *h, ptrdiff_t n)
{
    rows_write_f32(h, 1, 0, 1, n, f);
}

/* The exported functions (norms.h): norms_forward_S and norms_backward_S for S = f32, f64,
 * f16 and f16f32, computed by the F (f32 or f64) functions on rows stored as TX (float16 when
 * HX), the residual stream as TR (float16 when HR), and weight, bias, mean and rstd as TP. Each
 * case of rms, and of a residual (dh) or none, is a call of its own: inlined (flatten), compiled
 * for its constants. */
#define FORWARD(F, RMS, RES) forward_##F(RMS, xr, RES, weight, bias, y, h, mean, rstd, m, n, eps)
#define BACKWARD(F, RMS, DH)                                                                   \
    backward_##F(RMS, dyr, DH, xr, mean, rstd, weight, dx, dweight_blocks, dbias_blocks, m, n)
#define NORMS_EXPORTS(S, F, TX, TR, TP, HX, HR)                                                \
    NORMS_KERNEL int norms_forward_##S(int rms, const TX *x, ptrdiff_t ldx, const TR *residual, \
                                       ptrdiff_t ldr, const TP *weight, const TP *bias, TX *y,  \
                                       TR *h, TP *mean, TP *rstd, ptrdiff_t m, ptrdiff_t n,     \
                                       double eps)                                             \
    {                                                                                          \
        struct rows xr = ROWS(x, ldx, HX), rr = ROWS(residual, ldr, HR);                       \
        if (residual)                                                                          \
            return rms ? FORWARD(F, 1, rr) : FORWARD(F, 0, rr);                                \
        return rms ? FORWARD(F, 1, NONE) : FORWARD(F, 0, NONE);                                \
    }                                                                                          \
    NORMS_KERNEL int norms_backward_##S(int rms, const TX *dy, ptrdiff_t lddy, const TR *dh,    \
                                        ptrdiff_t lddh, const TR *x, ptrdiff_t ldx,             \
                                        const TP *mean, const TP *rstd, const TP *weight,       \
                                        TR *dx, double *dweight_blocks, double *dbias_blocks,   \
                                        ptrdiff_t m, ptrdiff_t n)                               \
    {                                                                                          \
        struct rows dyr = ROWS(dy, lddy, HX), dhr = ROWS(dh, lddh, HR), xr = ROWS(x, ldx, HR); \
        if (dh)                                                                                \
            return rms ? BACKWARD(F, 1, dhr) : BACKWARD(F, 0, dhr);                            \
        return rms ? BACKWARD(F, 1, NONE) : BACKWARD(F, 0, NONE);                              \
    }

NORMS_EXPORTS(f32, f32, float, float, float, 0, 0)
NORMS_EXPORTS(f64, f64, double, double, double, 0, 0)
NORMS_EXPORTS(f16, f32, uint16_t, uint16_t, float, 1, 1)
NORMS_EXPORTS(f16f32, f32, uint16_t, float, float, 1, 0)
