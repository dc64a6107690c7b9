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
