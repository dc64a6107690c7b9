/* The sums over one block of a row (at most BLOCK elements), for one element type T and one
 * vector width, included by norms_typed.h once per width with
 *   TBYTES  sizeof(T), for the preprocessor
 *   VBYTES  the bytes of one vector: 64 (AVX-512), 32 (AVX2), 16 (SSE2, NEON), or 0 for
 *           plain C without the compiler's vector extension (one T per "vector")
 *   LW(f)   the name f with the type's and the width's suffix (f_f32_v64, ...)
 *
 * The LANES partial sums of a block are held in NV vectors of VN lanes each (NV * VN = LANES):
 * lane k is element k % VN of vector k / VN. Element i of the block goes to lane i % LANES,
 * and the lanes are then added pairwise in float64 (lane k + lane k + 8, then + 4, + 2, + 1).
 * That order is the same for every width, so every width gives the same bits; the width only
 * decides how many registers hold the lanes. Each width is written in vectors the target
 * has: GCC keeps a vector wider than the target's registers in memory. With the 16 lanes in
 * one 64-byte vector, the AVX2 build ran the float32 LayerNorm forward about 1.5 times slower
 * than the SSE2 one; written this way, 2.5 times faster than before (in cache, one thread,
 * tools/kernel_ab.py on the machine of chapter 5).
 */

#if VBYTES
typedef T LW(vec) __attribute__((vector_size(VBYTES)));
#define VN (VBYTES / (int)sizeof(T))
#else
typedef T LW(vec);
#define VN 1
#endif
#define NV (LANES / VN)

/* One vector from p (any alignment); an expression, not a function returning a vector, which
 * GCC would warn about for the widths the target lacks. */
#if VBYTES
#define LOAD(p) __extension__({                                                                \
    LW(vec) v_;                                                                                \
    memcpy(&v_, (p), sizeof v_);                                                               \
    v_;                                                                                        \
})
#else
#define LOAD(p) (*(p))
#endif

/* The LANES partial sums acc (NV vectors) added pairwise in float64. */
static inline __attribute__((always_inline)) double LW(total)(const LW(vec) *acc)
{
#if VBYTES == 64 && TBYTES == 4
    /* 16 floats in one register: widened at once, then halved through memory; this measured
     * 4 to 6 % faster on short rows than the halves taken in registers below */
    typedef double d16 __attribute__((vector_size(128)));
    typedef double d8 __attribute__((vector_size(64)));
    typedef double d4 __attribute__((vector_size(32)));
    d16 s16 = __builtin_convertvector(acc[0], d16);
    d8 s8, h8;
    memcpy(&s8, &s16, sizeof s8);
    memcpy(&h8, (const char *)&s16 + sizeof s8, sizeof h8);
    s8 += h8;
    d4 s4, h4;
    memcpy(&s4, &s8, sizeof s4);
    memcpy(&h4, (const char *)&s8 + sizeof s4, sizeof h4);
    s4 += h4;
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
#elif VBYTES
    /* float64 vectors of VBYTES bytes, DN lanes each: ND of them hold the LANES lanes */
    typedef double dvec __attribute__((vector_size(VBYTES)));
    enum { DN = VBYTES / 8, ND = LANES / DN };
    dvec d[ND];
#if TBYTES == 8
    memcpy(d, acc, sizeof d);
#else
    /* each vector of floats is two halves of DN lanes, widened exactly */
    typedef T hvec __attribute__((vector_size(VBYTES / 2)));
    for (int j = 0; j < NV; j++) {
        hvec lo, hi;
        memcpy(&lo, &acc[j], sizeof lo);
        memcpy(&hi, (const char *)&acc[j] + sizeof lo, sizeof hi);
        d[2 * j] = __builtin_convertvector(lo, dvec);
        d[2 * j + 1] = __builtin_convertvector(hi, dvec);
    }
#endif
    /* lane k += lane k + w DN for w = ND / 2, ..., 1: across the vectors */
    for (int w = ND / 2; w > 0; w /= 2)
        for (int j = 0; j < w; j++)
            d[j] += d[j + w];
    /* then within d[0]: lane k += lane k + DN / 2, ..., + 1 */
#if VBYTES >= 64
    typedef double dvec4 __attribute__((vector_size(32)));
    dvec4 h4, l4;
    memcpy(&l4, &d[0], sizeof l4);
    memcpy(&h4, (const char *)&d[0] + sizeof l4, sizeof h4);
    l4 += h4;
#else
    dvec l4 = d[0];
#endif
#if VBYTES >= 32
    typedef double dvec2 __attribute__((vector_size(16)));
    dvec2 h2, l2;
    memcpy(&l2, &l4, sizeof l2);
    memcpy(&h2, (const char *)&l4 + sizeof l2, sizeof h2);
    l2 += h2;
#else
    dvec l2 = l4;
#endif
    return l2[0] + l2[1];
#else
    double s[LANES];
    for (int k = 0; k < LANES; k++)
        s[k] = acc[k];
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int k = 0; k < w; k++)
            s[k] += s[k + w];
    return s[0];
#endif
}

/* The sums of a pass (kind: SUM_X, ... in norms.c) over one block of n <= BLOCK elements
 * of one row a (rows 1) or of two rows a and b (rows 2, the same block of each, in one loop,
 * so that the processor works on the rows' independent chains of additions side by side).
 * out[0], out[1]: the first sum of a and of b; out[2], out[3]: the second (SUM_DEV, SUM_G).
 * A row's sums do not depend on whether it came alone or in a pair. kind and rows are
 * constants at every call, so that the compiler keeps only their branches. */
static inline __attribute__((always_inline)) void
LW(block_sums)(int kind, int rows, const T *xa, const T *xb, const T *dya, const T *dyb,
               const T *w, ptrdiff_t n, T sha, T shb, double out[4])
{
    const int two = kind == SUM_DEV || kind == SUM_G, g = kind == SUM_G || kind == SUM_GXC;
    LW(vec) a1[NV] = {0}, a2[NV] = {0}, b1[NV] = {0}, b2[NV] = {0};
    ptrdiff_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < NV; j++) {
            const ptrdiff_t o = i + j * VN;
            LW(vec) va = LOAD(xa + o), ga = va, wv = va, t1, t2 = {0};
            if (g) {
                ga = LOAD(dya + o);
                wv = LOAD(w + o);
            }
            NORMS_TERMS(kind, va, ga, wv, sha, t1, t2);
            a1[j] += t1;
            if (two)
                a2[j] += t2;
            if (rows == 2) {
                LW(vec) vb = LOAD(xb + o), gb = g ? LOAD(dyb + o) : vb;
                NORMS_TERMS(kind, vb, gb, wv, shb, t1, t2);
                b1[j] += t1;
                if (two)
                    b2[j] += t2;
            }
        }
    if (i < n) {
        /* the tail: its terms go to lanes 0, 1, ... and +0 to the others, which leaves them
         * as they are (a sum that starts at +0 is never -0) */
        T t[4][LANES] = {{0}};
        for (int k = 0; i < n; i++, k++) {
            NORMS_TERMS(kind, xa[i], g ? dya[i] : 0, g ? w[i] : 0, sha, t[0][k], t[2][k]);
            if (rows == 2)
                NORMS_TERMS(kind, xb[i], g ? dyb[i] : 0, g ? w[i] : 0, shb, t[1][k], t[3][k]);
        }
        for (int j = 0; j < NV; j++) {
            a1[j] += LOAD(t[0] + j * VN);
            b1[j] += LOAD(t[1] + j * VN);
            a2[j] += LOAD(t[2] + j * VN);
            b2[j] += LOAD(t[3] + j * VN);
        }
    }
    out[0] = LW(total)(a1);
    if (rows == 2)
        out[1] = LW(total)(b1);
    if (two) {
        out[2] = LW(total)(a2);
        if (rows == 2)
            out[3] = LW(total)(b2);
    }
}

#undef LOAD
#undef VN
#undef NV
