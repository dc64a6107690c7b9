/* Row-wise LayerNorm and RMSNorm, forward and backward, for the CPU (declared in norms.h).
 *
 * Built into the extension module lnlib._cpu._norms when the package is built
 * (lnlib/kernels/build_norms.py); lnlib/_cpu/kernels.py calls it on chunks of rows, one
 * chunk per thread. Each kernel is written once, in norms_cpu_typed.h, and included below
 * for float and for double; the float16 kernels (norms_cpu_half.h, included last) convert
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
 *    C, so every width gives the same bits (tests/test_cpu_kernels.py compares them).
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

/* The compiler's vector extension (GCC, Clang): two sums of a block in one loop, which the
 * plain loops do not vectorize well (block_sums_dev, block_sums_g). Elsewhere, two loops. */
#if defined(__GNUC__) && (defined(__clang__) || __GNUC__ >= 9) && !defined(NORMS_NO_VECTORS)
#define NORMS_VECTORS 1
typedef double dvec16 __attribute__((vector_size(16 * sizeof(double))));
typedef double dvec8 __attribute__((vector_size(8 * sizeof(double))));
typedef double dvec4 __attribute__((vector_size(4 * sizeof(double))));
_Static_assert(LANES == 16, "lanes_total adds 16 lanes as vector halves");
#else
#define NORMS_VECTORS 0
#endif

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

void sum_blocks_pairwise(double *blocks, ptrdiff_t nblocks, ptrdiff_t n)
{
    for (ptrdiff_t step = 1; step < nblocks; step *= 2)
        for (ptrdiff_t b = 0; b + step < nblocks; b += 2 * step)
            for (ptrdiff_t j = 0; j < n; j++)
                blocks[b * n + j] += blocks[(b + step) * n + j];
}

#define T float
#define FN(name) name##_f32
#include "norms_cpu_typed.h"
#undef T
#undef FN

#define T double
#define FN(name) name##_f64
#include "norms_cpu_typed.h"
#undef T
#undef FN

/* float16: rows converted to float, the float functions above, the outputs rounded back. */
#include "norms_cpu_half.h"
