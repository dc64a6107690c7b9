// Building blocks of the fused normalization kernels in norms.cu: element types, the
// row layout (which thread owns which elements), the Chan merge and the fixed reduction trees.
//
// Compiled by CuPy at first use (NVRTC, lnlib/_cuda/build.py) and, without a GPU, by the
// test suite with nvcc and the same options (tests/test_cuda_compile.py).
//
// Row layout. A row of d elements is cut into chunks of V = 16 / sizeof(T) consecutive
// elements (one 16-byte vector). The R threads that work on a row own the chunks round robin:
// chunk c belongs to thread c % R, in its slot (c / R) % MAXV of tile c / (R * MAXV). A thread
// therefore always handles the same elements of a row, in the same order, whatever row it is
// and however many rows there are, and whether the chunk is read as one vector or as V scalars
// (the scalar path is taken for rows that are not 16-byte aligned): every reduction order
// below depends on d alone, which is what makes the results bitwise batch invariant.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace lnlib {

// Statistics are accumulated in float32, or in float64 for float64 data.
template <typename T> struct Acc { typedef float type; };
template <> struct Acc<double> { typedef double type; };

__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }
__device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> struct Out;
template <> struct Out<float> { static __device__ float of(float v) { return v; } };
template <> struct Out<double> { static __device__ double of(double v) { return v; } };
template <> struct Out<__half> {
    static __device__ __half of(float v) { return __float2half_rn(v); }
};
template <> struct Out<__nv_bfloat16> {
    static __device__ __nv_bfloat16 of(float v) { return __float2bfloat16_rn(v); }
};

// Elements of T in one 16-byte vector.
template <typename T> struct Vec { static const int n = 16 / sizeof(T); };

// Tiles of R * MAXV chunks of V elements that cover a row of d elements (no overflow for any
// int d; 32-bit division by constants, where 64-bit division would call a subroutine).
template <int R, int MAXV, int V>
__device__ __forceinline__ int tile_count(int d) {
    const int chunks = d / V + (d % V != 0);
    return chunks / (R * MAXV) + (chunks % (R * MAXV) != 0);
}

// The unsigned integer type of B bytes, which moves B bytes of elements as one vector.
template <int B> struct Raw;
template <> struct Raw<16> { typedef uint4 type; };
template <> struct Raw<8> { typedef uint2 type; };
template <> struct Raw<4> { typedef unsigned int type; };

// The bits of element j of a vector of T, placed in its 32-bit words w (zero to begin with).
template <typename T> struct Bits;
template <> struct Bits<float> {
    static __device__ void put(unsigned int* w, int j, float v) { w[j] = __float_as_uint(v); }
};
template <> struct Bits<double> {
    static __device__ void put(unsigned int* w, int j, double v) {
        w[2 * j] = (unsigned int)__double2loint(v);
        w[2 * j + 1] = (unsigned int)__double2hiint(v);
    }
};
template <> struct Bits<__half> {
    static __device__ void put(unsigned int* w, int j, __half v) {
        w[j / 2] |= (unsigned int)__half_as_ushort(v) << (16 * (j % 2));
    }
};
template <> struct Bits<__nv_bfloat16> {
    static __device__ void put(unsigned int* w, int j, __nv_bfloat16 v) {
        w[j / 2] |= (unsigned int)__bfloat16_as_ushort(v) << (16 * (j % 2));
    }
};

// A vector from its 32-bit words.
__device__ __forceinline__ void from_words(const unsigned int (&w)[4], uint4& r) {
    r = make_uint4(w[0], w[1], w[2], w[3]);
}
__device__ __forceinline__ void from_words(const unsigned int (&w)[2], uint2& r) {
    r = make_uint2(w[0], w[1]);
}
__device__ __forceinline__ void from_words(const unsigned int (&w)[1], unsigned int& r) {
    r = w[0];
}

// One B-byte vector from p: through the read-only cache (NC), or by a plain load, which also
// sees what this thread stored earlier in the kernel (the fused forward rereads h it wrote,
// and its residual may be h itself).
template <bool NC, typename W> __device__ __forceinline__ W load_raw(const W* p) {
    if constexpr (NC) return __ldg(p);
    else return *p;
}

// Read chunk c of a row (V elements from element c * V) into a[], in the accumulation type.
// Elements past the end of the row read as zero; returns how many were inside the row. V is
// that of the row layout's type, which for a fused op may differ from T (float16 x in rows
// laid out as float32 h: chunks of 4 halves, 8-byte vectors).
template <typename T, int V, bool NC, typename A>
__device__ __forceinline__ int load_elems(const T* row, long long c, int d, bool vec_ok, A* a) {
    typedef typename Raw<V * sizeof(T)>::type W;
    const long long i0 = c * V;
    if (vec_ok && i0 + V <= d) {
        W raw = load_raw<NC>(reinterpret_cast<const W*>(row) + c);
        const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int j = 0; j < V; ++j) a[j] = to_acc(e[j]);
        return V;
    }
    int n = 0;
#pragma unroll
    for (int j = 0; j < V; ++j) {
        const bool in = i0 + j < d;
        a[j] = in ? to_acc(row[i0 + j]) : A(0);
        n += in;
    }
    return n;
}

template <typename T, typename A>
__device__ __forceinline__ int load_chunk(const T* row, long long c, int d, bool vec_ok, A* a) {
    return load_elems<T, Vec<T>::n, true>(row, c, d, vec_ok, a);
}

// Write the first n of the V values in a[] (converted to T) to chunk c of a row.
template <typename T, int V, typename A>
__device__ __forceinline__ void store_elems(T* row, long long c, int n, bool vec_ok, const A* a) {
    typedef typename Raw<V * sizeof(T)>::type W;
    if (vec_ok && n == V) {
        W raw;
        T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
        for (int j = 0; j < V; ++j) e[j] = Out<T>::of(a[j]);
        reinterpret_cast<W*>(row)[c] = raw;
        return;
    }
#pragma unroll
    for (int j = 0; j < V; ++j)
        if (j < n) row[c * V + j] = Out<T>::of(a[j]);
}

template <typename T, typename A>
__device__ __forceinline__ void store_chunk(T* row, long long c, int n, bool vec_ok, const A* a) {
    store_elems<T, Vec<T>::n>(row, c, n, vec_ok, a);
}

// v rounded to T and read back in the accumulation type: the value a stored T holds.
template <typename T, typename A> __device__ __forceinline__ A rounded(A v) {
    return to_acc(Out<T>::of(v));
}

template <typename A, typename B> struct Same { static const bool value = false; };
template <typename A> struct Same<A, A> { static const bool value = true; };

// Count, mean and sum of squared deviations from the mean (M2) of a set of values.
template <typename A> struct Stats {
    int n;
    A mean;
    A m2;
};

// Chan, Golub and LeVeque's pairwise update: the statistics of the union of two disjoint sets
// from those of each. Not symmetric in rounding, so every caller merges in a fixed order.
template <typename A>
__device__ __forceinline__ Stats<A> chan_merge(Stats<A> a, Stats<A> b) {
    if (b.n == 0) return a;
    if (a.n == 0) return b;
    Stats<A> r;
    r.n = a.n + b.n;
    const A delta = b.mean - a.mean;
    const A fb = A(b.n) / A(r.n);
    r.mean = a.mean + delta * fb;
    r.m2 = a.m2 + b.m2 + delta * delta * A(a.n) * fb;
    return r;
}

// Statistics of one thread's slots of a tile, by two passes over registers: the mean of its few
// values first (their sum in A, divided once), then their squared deviations from it.
template <int MAXV, int V, typename A>
__device__ __forceinline__ Stats<A> thread_stats(const A (&v)[MAXV][V], const int (&cnt)[MAXV]) {
    Stats<A> s;
    s.n = 0;
    A sum = 0;
#pragma unroll
    for (int k = 0; k < MAXV; ++k) {
        s.n += cnt[k];
#pragma unroll
        for (int j = 0; j < V; ++j) sum += v[k][j];  // elements past the row are zero
    }
    s.mean = s.n ? sum / A(s.n) : A(0);
    s.m2 = 0;
#pragma unroll
    for (int k = 0; k < MAXV; ++k)
#pragma unroll
        for (int j = 0; j < V; ++j)
            if (j < cnt[k]) s.m2 += (v[k][j] - s.mean) * (v[k][j] - s.mean);
    return s;
}

template <typename A>
__device__ __forceinline__ Stats<A> shfl_down(Stats<A> s, int offset) {
    Stats<A> o;
    o.n = __shfl_down_sync(0xffffffffu, s.n, offset);
    o.mean = __shfl_down_sync(0xffffffffu, s.mean, offset);
    o.m2 = __shfl_down_sync(0xffffffffu, s.m2, offset);
    return o;
}

template <typename A>
__device__ __forceinline__ Stats<A> shfl_lane0(Stats<A> s) {
    s.n = __shfl_sync(0xffffffffu, s.n, 0);
    s.mean = __shfl_sync(0xffffffffu, s.mean, 0);
    s.m2 = __shfl_sync(0xffffffffu, s.m2, 0);
    return s;
}

// The fixed tree inside a warp: lane i takes in lane i + 16, then i + 8, 4, 2, 1; lane 0 ends
// with the merge of all 32 in an order that never changes. Every lane gets lane 0's result.
template <typename A>
__device__ __forceinline__ Stats<A> warp_merge(Stats<A> s) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) s = chan_merge(s, shfl_down(s, offset));
    return shfl_lane0(s);
}

// Merge the statistics of the R threads of a row (R = 32 .. 1024, a multiple of 32). Each warp
// merges its lanes; then every warp of the row merges the warps' results, in warp order, with
// the same tree (redundantly, so all threads end with bitwise the same result). shm holds
// (threads per block) / 32 entries. Must be reached by every thread of the block.
template <int R, typename A>
__device__ __forceinline__ Stats<A> row_merge(Stats<A> s, Stats<A>* shm) {
    s = warp_merge(s);
    if (R == 32) return s;
    const int W = R / 32, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int first = warp - warp % W;  // first warp of this row's group
    if (lane == 0) shm[warp] = s;
    __syncthreads();
    Stats<A> t;
    t.n = 0;
    t.mean = t.m2 = A(0);
    if (lane < W) t = shm[first + lane];
    t = warp_merge(t);
    __syncthreads();  // shm is free again
    return t;
}

// Sums of N values over the R threads of a row, with the same fixed trees as row_merge.
template <int N, typename A>
__device__ __forceinline__ void warp_sum(A (&v)[N]) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
#pragma unroll
        for (int i = 0; i < N; ++i) v[i] += __shfl_down_sync(0xffffffffu, v[i], offset);
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = __shfl_sync(0xffffffffu, v[i], 0);
}

template <int R, int N, typename A>
__device__ __forceinline__ void row_sum(A (&v)[N], A* shm) {
    warp_sum<N>(v);
    if (R == 32) return;
    const int W = R / 32, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int first = warp - warp % W;
    if (lane == 0)
#pragma unroll
        for (int i = 0; i < N; ++i) shm[warp * N + i] = v[i];
    __syncthreads();
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = lane < W ? shm[(first + lane) * N + i] : A(0);
    warp_sum<N>(v);
    __syncthreads();
}

}  // namespace lnlib
