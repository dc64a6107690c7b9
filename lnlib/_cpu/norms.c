/* Row-wise LayerNorm and RMSNorm, forward and backward, for the CPU (declared in norms.h).
 *
 * Built into the extension module lnlib._cpu._norms when the package is built
 * (lnlib/_cpu/build.py); lnlib/_cpu/c_kernel.py calls it on chunks of rows, one
 * chunk per thread. Each kernel is written once, in norms_typed.h, and included below
 * for float and for double; the float16 kernels (norms_half.h, included last) convert
 * rows to float and call the float ones' row functions.
 *
 * A row is read from memory once: the first pass brings it into cache, the later passes
 * find it there. LayerNorm is memory-bound, so the time is set by the bytes moved.
 *
 * Guarantees, matched by the tests:
 *  - two-pass statistics: a first mean mu0, then in a second pass the sums of the deviations
 *    d = x - mu0 and of d^2, which give the correction of the mean (Chan, Golub and LeVeque,
 *    1983) and the variance about it, never E[x^2] - E[x]^2;
 *  - every sum over a row runs in blocks of BLOCK elements, each summed in LANES partial
 *    sums in T; the block totals are added pairwise in float64, so the rounding error does
 *    not grow with the row length. The order depends on the row length only (never on the
 *    row's address, its place in the batch or the thread): results are bitwise batch and
 *    thread invariant;
 *  - the column sums of dweight and dbias are accumulated in float64 per block of
 *    NORMS_BLOCK_ROWS rows, and the blocks added pairwise (sum_blocks_pairwise);
 *  - compiled with -ffp-contract=off, so no multiply-add is fused behind our back. On
 *    x86-64 each exported kernel is also compiled for AVX2 and AVX-512 (NORMS_KERNEL) and the
 *    loader picks the widest the CPU has; the lanes and their order are written out in the
 *    C, held in vectors of the width the CPU has (norms_lanes.h), so every width gives
 *    the same bits (tests/test_cpu_kernels.py compares the builds and the widths).
 *
 * Book: chapter "Implementation", section "A compiled kernel".
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "norms.h"

enum { LANES = 16, BLOCK = 256 };
/* Rows up to this length are processed two at a time (the passes of two rows interleaved);
 * two rows of x and dy in float64 (256 KiB) still fit in a core's L2 cache. */
enum { PAIR_MAX = 8192 };

/* Non-temporal ("streaming") stores, where the target has them (SSE2: every x86-64): a large
 * output is written to memory without first being read into the cache (the read for
 * ownership of an ordinary store), so a forward moves two arrays' worth of bytes, not three.
 * Used when one call writes at least STREAM_BYTES, more than the caches hold, so the output
 * would not stay in cache anyway; smaller outputs stay in cache for whatever reads them next.
 * The values are the same either way: only how they reach memory differs. Chapter 5 times
 * both ways (`python -m lnlib.bench --steps`; on its 2-core machine streaming saved 3 to 9 %
 * of a 4096 x 4096 float32 forward into a reused output). -DNORMS_NO_STREAM builds without
 * them. */
#if defined(__SSE2__) && !defined(NORMS_NO_STREAM)
#include <emmintrin.h>
#define NORMS_STREAM 1
#else
#define NORMS_STREAM 0
#endif
enum { STREAM_BYTES = 8 << 20 };

/* Function multi-versioning where the compiler has it and the C library can pick a version
 * at load time (ifunc: glibc on x86-64); flatten inlines the helpers so that they are compiled
 * for each width too. -DNORMS_NO_CLONES builds one version only. */
#if defined(__has_attribute) && defined(__x86_64__) && defined(__GLIBC__)
#if __has_attribute(target_clones) && !defined(NORMS_NO_CLONES)
#define NORMS_CLONES 1
#endif
#endif
#ifndef NORMS_CLONES
#define NORMS_CLONES 0
#endif
#if NORMS_CLONES
#define NORMS_KERNEL __attribute__((target_clones("avx512f", "avx2", "default"), flatten))
#else
#define NORMS_KERNEL
#endif

/* The compiler's vector extension (GCC, Clang): the sums' lanes in vectors of the width the
 * CPU has (norms_lanes.h). Elsewhere, plain C loops over the same lanes. */
#if defined(__GNUC__) && (defined(__clang__) || __GNUC__ >= 9) && !defined(NORMS_NO_VECTORS)
#define NORMS_VECTORS 1
#else
#define NORMS_VECTORS 0
#endif
_Static_assert(LANES == 16, "the lanes' pairwise total halves 16 lanes (norms_lanes.h)");

#define NORMS_PASTE_(a, b) a##b
#define NORMS_PASTE(a, b) NORMS_PASTE_(a, b)

/* The widest vectors, in bytes, that the CPU runs and this build was compiled for (with
 * multi-versioning, the loader picks the AVX-512 or AVX2 version where the CPU has it); the
 * block sums use vectors of this width. 0 until chosen. */
static int vector_bytes_chosen;

static int vector_bytes_best(void)
{
#if NORMS_VECTORS && (defined(__x86_64__) || defined(__i386__))
#if NORMS_CLONES || defined(__AVX512F__)
    const int built = 64;
#elif defined(__AVX2__)
    const int built = 32;
#else
    const int built = 16;
#endif
    __builtin_cpu_init();
    int cpu = __builtin_cpu_supports("avx512f") ? 64 : __builtin_cpu_supports("avx2") ? 32 : 16;
    return cpu < built ? cpu : built;
#elif NORMS_VECTORS
    return 16;
#else
    return 0;
#endif
}

#if defined(__GNUC__)
__attribute__((constructor))
#endif
static void vector_bytes_init(void)
{
    if (!vector_bytes_chosen)
        vector_bytes_chosen = vector_bytes_best();
}

int norms_vector_bytes(void)
{
    vector_bytes_init();
    return vector_bytes_chosen;
}

int norms_set_vector_bytes(int bytes)
{
    vector_bytes_init();
    int before = vector_bytes_chosen, best = vector_bytes_best();
    if (bytes == 0)
        bytes = best;
    if (!NORMS_VECTORS || (bytes != 16 && bytes != 32 && bytes != 64) || bytes > best)
        return -1;
    vector_bytes_chosen = bytes;
    return before;
}

const char *norms_kernel_version(void)
{
#if NORMS_CLONES
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f"))
        return "avx512f";
    if (__builtin_cpu_supports("avx2"))
        return "avx2";
#endif
    return "default";
}

static ptrdiff_t block_len(ptrdiff_t start, ptrdiff_t n)
{
    return n - start < BLOCK ? n - start : BLOCK;
}

/* Pairwise sum of a stream of values (a binary counter): level[k] holds the sum of the last
 * 2^k values not yet merged, so each value goes through at most log2(count) additions. */
struct pairwise {
    double level[64];
    long long count;
};

static void pairwise_add(struct pairwise *s, double v)
{
    int k = 0;
    for (long long c = s->count++; c & 1; c >>= 1)
        v = s->level[k++] + v;
    s->level[k] = v;
}

static double pairwise_total(const struct pairwise *s)
{
    double total = 0;
    for (int k = 0; (s->count >> k) != 0; k++)
        if ((s->count >> k) & 1)
            total = s->level[k] + total;
    return total;
}

/* Copies n values of `size` bytes (4 or 8) from src to dst, with non-temporal stores for
 * the 16-byte-aligned part of dst. */
static void stream_copy(void *dst, const void *src, ptrdiff_t n, size_t size)
{
    char *d = dst;
    const char *s = src;
    size_t bytes = (size_t)n * size, i = 0;
#if NORMS_STREAM
    size_t head = (16 - (uintptr_t)d % 16) % 16;
    if (head % size == 0 && head <= bytes) {
        memcpy(d, s, head);
        for (i = head; i + 16 <= bytes; i += 16)
            _mm_stream_si128((__m128i *)(d + i), _mm_loadu_si128((const __m128i *)(s + i)));
    }
#endif
    memcpy(d + i, s + i, bytes - i);
}

/* Orders this thread's non-temporal stores before what it does next (the caller then hands
 * the output to other threads). */
static void stream_fence(void)
{
#if NORMS_STREAM
    _mm_sfence();
#endif
}

static int stream_enabled = 1;

int norms_set_streaming(int enabled)
{
    int before = stream_enabled;
    stream_enabled = enabled != 0;
    return before;
}

/* Scratch for two rows of output when a call writes enough to stream it, else NULL (also
 * when malloc fails: the rows are then written in place, with the same values). */
static void *stream_scratch(ptrdiff_t m, ptrdiff_t n, size_t size)
{
    if (!NORMS_STREAM || !stream_enabled || n > PAIR_MAX
        || (size_t)m * (size_t)n * size < STREAM_BYTES)
        return NULL;
    return malloc(2 * (size_t)n * size);
}

/* What a pass sums (block_sums in norms_lanes.h), with g = dy weight: x - shift;
 * (x - shift)^2; both; g and g (x - shift); g (x - shift). */
enum { SUM_X, SUM_XX, SUM_DEV, SUM_G, SUM_GXC };

/* The terms t1 (and t2, for SUM_DEV and SUM_G) of one element, or one vector of elements, for
 * a pass of that kind: the same operations in the same order for every width. */
#define NORMS_TERMS(kind, x, dy, w, shift, t1, t2)                                             \
    do {                                                                                       \
        if ((kind) == SUM_X) {                                                                 \
            t1 = (x) - (shift);                                                                \
        } else if ((kind) == SUM_XX) {                                                         \
            t1 = ((x) - (shift)) * ((x) - (shift));                                            \
        } else if ((kind) == SUM_DEV) {                                                        \
            t1 = (x) - (shift);                                                                \
            t2 = t1 * t1;                                                                      \
        } else if ((kind) == SUM_G) {                                                          \
            t1 = (dy) * (w);                                                                   \
            t2 = t1 * ((x) - (shift));                                                         \
        } else {                                                                               \
            t1 = (dy) * (w) * ((x) - (shift));                                                 \
        }                                                                                      \
    } while (0)

void sum_blocks_pairwise(double *blocks, ptrdiff_t nblocks, ptrdiff_t n)
{
    for (ptrdiff_t step = 1; step < nblocks; step *= 2)
        for (ptrdiff_t b = 0; b + step < nblocks; b += 2 * step)
            for (ptrdiff_t j = 0; j < n; j++)
                blocks[b * n + j] += blocks[(b + step) * n + j];
}

#define T float
#define TBYTES 4
#define FN(name) name##_f32
#include "norms_typed.h"
#undef T
#undef TBYTES
#undef FN

#define T double
#define TBYTES 8
#define FN(name) name##_f64
#include "norms_typed.h"
#undef T
#undef TBYTES
#undef FN

/* float16: rows converted to float, the float functions above, the outputs rounded back. */
#include "norms_half.h"

/* ---------------------------------------------------------------------------------------
 * fused residual add (declared at the end of norms.h; the rounding is lnlib/_rows.py's)
 *
 * h = residual + x, then the norm of h: per block of `rows` rows (fused_rows: h's block is at
 * most NORMS_FUSED_BLOCK_BYTES, so it is still in the core's L2 cache when the norm reads it
 * back), the add writes the block of h (a plain loop the compiler vectorises), then the
 * kernel above runs on that block: y, mean and rstd are bitwise those of the norm of h. The
 * backward runs the norm's backward on a block (dx into the block of dsum), then adds dh to
 * the block while it is in cache. So a forward reads x and residual and writes h and y, a
 * backward reads dy, dh and h and writes dsum: each array crosses memory once.
 *
 * When a call writes at least STREAM_BYTES (as in the kernels above), the blocks of h, y and
 * dsum are made in scratch blocks and streamed to memory (stream_copy), so the outputs cost
 * no read for ownership; below that they are written in place. The values are the same.
 *
 * The blocks are a power of two of rows, at most NORMS_BLOCK_ROWS, and the caller starts a
 * chunk of a backward on a multiple of NORMS_BLOCK_ROWS: a block never straddles two row
 * blocks of the column sums, and each row block receives its rows in order, as in one call of
 * the backward kernel, so dweight and dbias are bitwise those of the unfused backward.
 *
 * h may be residual itself (written over it in place): each block of residual is read before
 * the same block of h is written, and no other block is touched. The norm's own functions are
 * called as they are (the exported kernels, with their multi-versioning), so the row code is
 * the one the unfused norm runs. */

static ptrdiff_t fused_rows(ptrdiff_t n, size_t hsize)
{
    ptrdiff_t rows = NORMS_BLOCK_ROWS;
    while (rows > 1 && (size_t)rows * (size_t)n * hsize > NORMS_FUSED_BLOCK_BYTES)
        rows /= 2;
    return rows;
}

/* Scratch of `count` elements of `size` bytes when the call streams its outputs, else NULL
 * (also when malloc fails: the outputs are then written in place, with the same values). */
static void *fused_stream_scratch(ptrdiff_t m, ptrdiff_t n, size_t size, size_t count)
{
    if (!NORMS_STREAM || !stream_enabled || (size_t)m * (size_t)n * size < STREAM_BYTES)
        return NULL;
    return malloc(count * size);
}

/* h = r + x for k rows (x, r ld apart, h contiguous; h may be r): float, double. */
static void fused_add_f32(const float *x, ptrdiff_t ldx, const float *r, ptrdiff_t ldr,
                          float *h, ptrdiff_t ldh, ptrdiff_t k, ptrdiff_t n)
{
    for (ptrdiff_t i = 0; i < k; i++) {
        const float *xi = x + i * ldx, *ri = r + i * ldr;
        float *hi = h + i * ldh;
        for (ptrdiff_t j = 0; j < n; j++)
            hi[j] = ri[j] + xi[j];
    }
}

static void fused_add_f64(const double *x, ptrdiff_t ldx, const double *r, ptrdiff_t ldr,
                          double *h, ptrdiff_t ldh, ptrdiff_t k, ptrdiff_t n)
{
    for (ptrdiff_t i = 0; i < k; i++) {
        const double *xi = x + i * ldx, *ri = r + i * ldr;
        double *hi = h + i * ldh;
        for (ptrdiff_t j = 0; j < n; j++)
            hi[j] = ri[j] + xi[j];
    }
}

/* float16: h = r + x added in float and rounded once to float16 (the float sum of two
 * float16 values rounds to the float16 nearest their exact sum: float has more than twice
 * float16's precision plus two bits), as NumPy adds float16. cv: 2 n floats. */
static void fused_add_f16(const uint16_t *x, ptrdiff_t ldx, const uint16_t *r, ptrdiff_t ldr,
                          uint16_t *h, ptrdiff_t ldh, ptrdiff_t k, ptrdiff_t n, float *cv,
                          int how)
{
    for (ptrdiff_t i = 0; i < k; i++) {
        halves_to_floats(x + i * ldx, cv, n, how);
        halves_to_floats(r + i * ldr, cv + n, n, how);
        for (ptrdiff_t j = 0; j < n; j++)
            cv[j] = cv[n + j] + cv[j];
        floats_to_halves(cv, h + i * ldh, n, how);
    }
}

/* float16 x, float residual and h: x converted exactly, the sum in float. cv: n floats. */
static void fused_add_f16f32(const uint16_t *x, ptrdiff_t ldx, const float *r, ptrdiff_t ldr,
                             float *h, ptrdiff_t ldh, ptrdiff_t k, ptrdiff_t n, float *cv,
                             int how)
{
    for (ptrdiff_t i = 0; i < k; i++) {
        halves_to_floats(x + i * ldx, cv, n, how);
        fused_add_f32(cv, n, r + i * ldr, ldr, h + i * ldh, ldh, 1, n);
    }
}

/* The forward and backward over one element type; rms selects RMSNorm (bias and mean unused). */
#define NORMS_FUSED_TYPED(T, S)                                                                \
    static int fused_forward_##S(int rms, const T *x, ptrdiff_t ldx, const T *residual,        \
                                 ptrdiff_t ldr, const T *weight, const T *bias, T *y, T *h,    \
                                 T *mean, T *rstd, ptrdiff_t m, ptrdiff_t n, double eps)       \
    {                                                                                          \
        ptrdiff_t rows = fused_rows(n, sizeof(T));                                             \
        T *hs = fused_stream_scratch(m, n, sizeof(T), 2 * (size_t)rows * (size_t)n);           \
        for (ptrdiff_t r = 0; r < m; r += rows) {                                              \
            ptrdiff_t k = m - r < rows ? m - r : rows;                                         \
            T *hb = hs ? hs : h + r * n, *yb = hs ? hs + rows * n : y + r * n;                 \
            fused_add_##S(x + r * ldx, ldx, residual + r * ldr, ldr, hb, n, k, n);             \
            if (rms)                                                                           \
                rms_norm_forward_##S(hb, n, weight, yb, rstd + r, k, n, eps);                  \
            else                                                                               \
                layer_norm_forward_##S(hb, n, weight, bias, yb, mean + r, rstd + r, k, n,      \
                                       eps);                                                   \
            if (hs) {                                                                          \
                stream_copy(h + r * n, hb, k * n, sizeof(T));                                  \
                stream_copy(y + r * n, yb, k * n, sizeof(T));                                  \
            }                                                                                  \
        }                                                                                      \
        free(hs);                                                                              \
        stream_fence();                                                                        \
        return 0;                                                                              \
    }                                                                                          \
                                                                                               \
    static int fused_backward_##S(int rms, const T *dy, ptrdiff_t lddy, const T *dh,           \
                                  ptrdiff_t lddh, const T *h, ptrdiff_t ldh, const T *mean,    \
                                  const T *rstd, const T *weight, T *dsum, double *dwb,        \
                                  double *dbb, ptrdiff_t m, ptrdiff_t n)                       \
    {                                                                                          \
        ptrdiff_t rows = fused_rows(n, sizeof(T));                                             \
        T *ds = fused_stream_scratch(m, n, sizeof(T), (size_t)rows * (size_t)n);               \
        for (ptrdiff_t r = 0; r < m; r += rows) {                                              \
            ptrdiff_t k = m - r < rows ? m - r : rows, b = (r / NORMS_BLOCK_ROWS) * n;         \
            T *db = ds ? ds : dsum + r * n;                                                    \
            if (rms)                                                                           \
                rms_norm_backward_##S(dy + r * lddy, lddy, h + r * ldh, ldh, rstd + r, weight, \
                                      db, dwb + b, k, n);                                      \
            else                                                                               \
                layer_norm_backward_##S(dy + r * lddy, lddy, h + r * ldh, ldh, mean + r,       \
                                        rstd + r, weight, db, dwb + b, dbb + b, k, n);         \
            if (dh) /* dsum = dx + dh */                                                       \
                fused_add_##S(dh + r * lddh, lddh, db, n, db, n, k, n);                        \
            if (ds)                                                                            \
                stream_copy(dsum + r * n, ds, k * n, sizeof(T));                               \
        }                                                                                      \
        free(ds);                                                                              \
        stream_fence();                                                                        \
        return 0;                                                                              \
    }

NORMS_FUSED_TYPED(float, f32)
NORMS_FUSED_TYPED(double, f64)

/* float16 x (and residual, h): the add as fused_add_f16, then the float16 kernels on the
 * block of h (each row through the float32 row code, y rounded once). Written in place. */
static int fused_forward_f16(int rms, const uint16_t *x, ptrdiff_t ldx, const uint16_t *residual,
                             ptrdiff_t ldr, const float *weight, const float *bias, uint16_t *y,
                             uint16_t *h, float *mean, float *rstd, ptrdiff_t m, ptrdiff_t n,
                             double eps)
{
    ptrdiff_t rows = fused_rows(n, sizeof(uint16_t));
    float *cv = malloc(2 * (size_t)n * sizeof(float) + 1);
    int how = half_conversion(), status = cv == NULL;
    for (ptrdiff_t r = 0; r < m && !status; r += rows) {
        ptrdiff_t k = m - r < rows ? m - r : rows;
        fused_add_f16(x + r * ldx, ldx, residual + r * ldr, ldr, h + r * n, n, k, n, cv, how);
        status = rms ? rms_norm_forward_f16(h + r * n, n, weight, y + r * n, rstd + r, k, n, eps)
                     : layer_norm_forward_f16(h + r * n, n, weight, bias, y + r * n, mean + r,
                                              rstd + r, k, n, eps);
    }
    free(cv);
    return status;
}

static int fused_backward_f16(int rms, const uint16_t *dy, ptrdiff_t lddy, const uint16_t *dh,
                              ptrdiff_t lddh, const uint16_t *h, ptrdiff_t ldh, const float *mean,
                              const float *rstd, const float *weight, uint16_t *dsum,
                              double *dwb, double *dbb, ptrdiff_t m, ptrdiff_t n)
{
    ptrdiff_t rows = fused_rows(n, sizeof(uint16_t));
    float *cv = malloc(2 * (size_t)n * sizeof(float) + 1);
    int how = half_conversion(), status = cv == NULL;
    for (ptrdiff_t r = 0; r < m && !status; r += rows) {
        ptrdiff_t k = m - r < rows ? m - r : rows, b = (r / NORMS_BLOCK_ROWS) * n;
        uint16_t *db = dsum + r * n;
        status = rms ? rms_norm_backward_f16(dy + r * lddy, lddy, h + r * ldh, ldh, rstd + r,
                                             weight, db, dwb + b, k, n)
                     : layer_norm_backward_f16(dy + r * lddy, lddy, h + r * ldh, ldh, mean + r,
                                               rstd + r, weight, db, dwb + b, dbb + b, k, n);
        if (!status && dh)
            fused_add_f16(dh + r * lddh, lddh, db, n, db, n, k, n, cv, how);
    }
    free(cv);
    return status;
}

/* float16 x, y and dy with float residual, h, dh and dsum (the stream kept in float32): x
 * and dy converted exactly to float, then the float32 kernels on the block; y rounded once
 * to float16 from the float32 kernel's y. h and dsum streamed as in the typed versions. */
static int fused_forward_f16f32(int rms, const uint16_t *x, ptrdiff_t ldx, const float *residual,
                                ptrdiff_t ldr, const float *weight, const float *bias,
                                uint16_t *y, float *h, float *mean, float *rstd, ptrdiff_t m,
                                ptrdiff_t n, double eps)
{
    ptrdiff_t rows = fused_rows(n, sizeof(float));
    size_t block = (size_t)rows * (size_t)n;
    float *buf = malloc((block + (size_t)n) * sizeof(float));
    float *hs = fused_stream_scratch(m, n, sizeof(float), block);
    if (!buf) {
        free(hs);
        return 1;
    }
    float *yf = buf, *cv = buf + block;
    int how = half_conversion();
    for (ptrdiff_t r = 0; r < m; r += rows) {
        ptrdiff_t k = m - r < rows ? m - r : rows;
        float *hb = hs ? hs : h + r * n;
        fused_add_f16f32(x + r * ldx, ldx, residual + r * ldr, ldr, hb, n, k, n, cv, how);
        if (rms)
            rms_norm_forward_f32(hb, n, weight, yf, rstd + r, k, n, eps);
        else
            layer_norm_forward_f32(hb, n, weight, bias, yf, mean + r, rstd + r, k, n, eps);
        floats_to_halves(yf, y + r * n, k * n, how);
        if (hs)
            stream_copy(h + r * n, hb, k * n, sizeof(float));
    }
    free(buf);
    free(hs);
    stream_fence();
    return 0;
}

static int fused_backward_f16f32(int rms, const uint16_t *dy, ptrdiff_t lddy, const float *dh,
                                 ptrdiff_t lddh, const float *h, ptrdiff_t ldh, const float *mean,
                                 const float *rstd, const float *weight, float *dsum, double *dwb,
                                 double *dbb, ptrdiff_t m, ptrdiff_t n)
{
    ptrdiff_t rows = fused_rows(n, sizeof(float));
    size_t block = (size_t)rows * (size_t)n;
    float *dyf = malloc(block * sizeof(float));
    float *ds = fused_stream_scratch(m, n, sizeof(float), block);
    if (!dyf) {
        free(ds);
        return 1;
    }
    int how = half_conversion();
    for (ptrdiff_t r = 0; r < m; r += rows) {
        ptrdiff_t k = m - r < rows ? m - r : rows, b = (r / NORMS_BLOCK_ROWS) * n;
        float *db = ds ? ds : dsum + r * n;
        for (ptrdiff_t i = 0; i < k; i++)
            halves_to_floats(dy + (r + i) * lddy, dyf + i * n, n, how);
        if (rms)
            rms_norm_backward_f32(dyf, n, h + r * ldh, ldh, rstd + r, weight, db, dwb + b, k, n);
        else
            layer_norm_backward_f32(dyf, n, h + r * ldh, ldh, mean + r, rstd + r, weight, db,
                                    dwb + b, dbb + b, k, n);
        if (dh)
            fused_add_f32(dh + r * lddh, lddh, db, n, db, n, k, n);
        if (ds)
            stream_copy(dsum + r * n, ds, k * n, sizeof(float));
    }
    free(dyf);
    free(ds);
    stream_fence();
    return 0;
}

/* The exported functions (norms.h): LayerNorm (rms 0) and RMSNorm (rms 1) of each variant. */
#define NORMS_FUSED_EXPORTS(S, TX, TR, TP)                                                     \
    int add_layer_norm_forward_##S(const TX *x, ptrdiff_t ldx, const TR *residual,             \
                                   ptrdiff_t ldr, const TP *weight, const TP *bias, TX *y,     \
                                   TR *h, TP *mean, TP *rstd, ptrdiff_t m, ptrdiff_t n,        \
                                   double eps)                                                 \
    {                                                                                          \
        return fused_forward_##S(0, x, ldx, residual, ldr, weight, bias, y, h, mean, rstd, m,  \
                                 n, eps);                                                      \
    }                                                                                          \
    int add_rms_norm_forward_##S(const TX *x, ptrdiff_t ldx, const TR *residual, ptrdiff_t ldr, \
                                 const TP *weight, TX *y, TR *h, TP *rstd, ptrdiff_t m,        \
                                 ptrdiff_t n, double eps)                                      \
    {                                                                                          \
        return fused_forward_##S(1, x, ldx, residual, ldr, weight, NULL, y, h, NULL, rstd, m,  \
                                 n, eps);                                                      \
    }                                                                                          \
    int add_layer_norm_backward_##S(const TX *dy, ptrdiff_t lddy, const TR *dh, ptrdiff_t lddh, \
                                    const TR *h, ptrdiff_t ldh, const TP *mean, const TP *rstd, \
                                    const TP *weight, TR *dsum, double *dweight_blocks,        \
                                    double *dbias_blocks, ptrdiff_t m, ptrdiff_t n)            \
    {                                                                                          \
        return fused_backward_##S(0, dy, lddy, dh, lddh, h, ldh, mean, rstd, weight, dsum,     \
                                  dweight_blocks, dbias_blocks, m, n);                         \
    }                                                                                          \
    int add_rms_norm_backward_##S(const TX *dy, ptrdiff_t lddy, const TR *dh, ptrdiff_t lddh,   \
                                  const TR *h, ptrdiff_t ldh, const TP *rstd, const TP *weight, \
                                  TR *dsum, double *dweight_blocks, ptrdiff_t m, ptrdiff_t n)  \
    {                                                                                          \
        return fused_backward_##S(1, dy, lddy, dh, lddh, h, ldh, NULL, rstd, weight, dsum,     \
                                  dweight_blocks, NULL, m, n);                                 \
    }

NORMS_FUSED_EXPORTS(f32, float, float, float)
NORMS_FUSED_EXPORTS(f64, double, double, double)
NORMS_FUSED_EXPORTS(f16, uint16_t, uint16_t, float)
NORMS_FUSED_EXPORTS(f16f32, uint16_t, float, float)
