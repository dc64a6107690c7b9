// Fused LayerNorm and RMSNorm kernels, forward and backward, on a matrix of rows (m, d).
//
// Template arguments: T the element type (float, double, __half, __nv_bfloat16), R the threads
// per row (32: a warp per row; more, up to 1024: several warps, a block of 128 holding two rows
// at R = 64, one row from 128 on) and MAXV the 16-byte vectors each thread holds per row tile. lnlib/_cuda/build.py picks (R, MAXV) from d and T alone and
// names the instantiation when it compiles the module (NVRTC name expressions).
//
// A row that fits in one tile (d <= R * MAXV * V) is read once into registers and written
// once. Longer rows are processed tile by tile: the forward (*_fwd_long, 512 threads a row, two
// blocks an SM) reads them a second time to write the result. The backward of longer rows:
// - on compute capability 9.x (H100, H200), for rows of up to 65536 elements (32768 float64;
//   LayerNorm, RMSNorm, their fused residual add and the modulated LayerNorm of AdaLN and
//   GroupNorm): norm_bwd_cluster, a cluster of 8 blocks per row, each staging its slice of x
//   and dy in shared memory, the row's two sums exchanged through distributed shared memory;
//   x and dy read once (12 bytes an element for float32); the modulated backward's clusters
//   in runs, one run per parameter row (ModRows);
// - otherwise (sm_80, longer rows): norm_bwd_long, which forms the rows' sums in one launch
//   and dx and the parameter gradients by tiles of columns in a second, reading the rows
//   twice.
// lnlib/_cuda/build.py (backward_path) picks the path from d, the dtype and the compute
// capability alone. None of these kernels has run on a GPU yet: they are checked by
// compilation (tests/test_cuda_compile.py) and by the launch checks without a GPU.
//
// Row arguments: x points at row 0, ldx is the distance between rows in elements. vec_ok says
// that every row pointer is aligned to a vector (16 bytes of the layout's type; V elements of
// any other type) and d is a multiple of V: then chunks are moved as vectors, otherwise
// element by element, with the same arithmetic either way.
//
// The fused residual add (add_layer_norm_fwd, ...) is the same code with one flag (ADD): its
// element types are those of x, residual and h (forward) or dy and h (backward), and the row
// layout, launch shapes and accumulation type are those of h, so y is bitwise the norm of h.
#include "norms.cuh"

using lnlib::Acc;
using lnlib::Stats;
using lnlib::Vec;

// Threads per block: R, but at least 128 (then a block works on 128 / R rows at once).
#define LNLIB_BLOCK(R) ((R) < 128 ? 128 : (R))

// Tile k of the fused residual add, h = residual + x (defined below, after row_statistics).
template <typename TX, typename TR, typename TH, int R, int MAXV, typename A>
__device__ __forceinline__ void add_tile(const TX* xr, const TR* rr, TH* hr, int k, int t, int d,
                                         bool vec_ok, bool active, A (&v)[MAXV][Vec<TH>::n],
                                         int (&cnt)[MAXV]);

// Load tile k of a row into v (chunks of V elements owned by thread t), counting the elements
// per slot. V is that of the row layout (Vec of h's type in a fused op), whatever T is.
template <typename T, int R, int MAXV, int V = Vec<T>::n, bool NC = true, typename A>
__device__ __forceinline__ void load_tile(const T* row, int k, int t, int d, bool vec_ok,
                                          bool active, A (&v)[MAXV][V], int (&cnt)[MAXV]) {
#pragma unroll
    for (int s = 0; s < MAXV; ++s) {
        const long long c = ((long long)k * MAXV + s) * R + t;
        if (active && c * V < d) {
            cnt[s] = lnlib::load_elems<T, V, NC>(row, c, d, vec_ok, v[s]);
        } else {
            cnt[s] = 0;
#pragma unroll
            for (int j = 0; j < V; ++j) v[s][j] = A(0);
        }
    }
}

// Mean and rstd of a row (CENTER), or rstd alone with the mean taken as zero (RMSNorm). Ends
// with v holding the row's last tile. Without ADD the row is xr (TX = TH); with ADD it is made
// as it is read, h = residual + x (add_tile). Every thread of the block must call it.
template <typename TX, typename TR, typename TH, int R, int MAXV, bool CENTER, bool ADD,
          typename A>
__device__ __forceinline__ void row_statistics(const TX* xr, const TR* rr, TH* hr, int tiles,
                                               int t, int d, bool vec_ok, bool active, A eps,
                                               A (&v)[MAXV][Vec<TH>::n], int (&cnt)[MAXV],
                                               A& mu, A& rstd) {
    const int V = Vec<TH>::n;
    __shared__ Stats<A> shm[LNLIB_BLOCK(R) / 32];
    __shared__ A shs[LNLIB_BLOCK(R) / 32];
    Stats<A> s;
    s.n = 0;
    s.mean = s.m2 = A(0);
    A sq[1] = {A(0)};
    for (int k = 0; k < tiles; ++k) {
        if constexpr (ADD)
            add_tile<TX, TR, TH, R, MAXV>(xr, rr, hr, k, t, d, vec_ok, active, v, cnt);
        else
            load_tile<TH, R, MAXV>(xr, k, t, d, vec_ok, active, v, cnt);
        if (CENTER) {
            s = lnlib::chan_merge(s, lnlib::thread_stats(v, cnt));
        } else {
#pragma unroll
            for (int k2 = 0; k2 < MAXV; ++k2)
#pragma unroll
                for (int j = 0; j < V; ++j) sq[0] += v[k2][j] * v[k2][j];
        }
    }
    if (CENTER) {
        s = lnlib::row_merge<R>(s, shm);
        mu = s.mean;
        rstd = A(1) / sqrt(s.m2 / A(d) + eps);
    } else {
        lnlib::row_sum<R, 1>(sq, shs);
        mu = A(0);
        rstd = A(1) / sqrt(sq[0] / A(d) + eps);
    }
}

// Tile k of the fused residual add: h = residual + x in the accumulation type (float32 for
// float16/float32 data: the widest of the dtypes, or, for float16 alone, the float16 sum
// correctly rounded), rounded once to TH and stored; v holds the stored values, read back,
// exactly as load_tile would read them from h. residual is read by plain loads, as h may be
// residual itself (each element is read before this thread writes the same element).
template <typename TX, typename TR, typename TH, int R, int MAXV, typename A>
__device__ __forceinline__ void add_tile(const TX* xr, const TR* rr, TH* hr, int k, int t, int d,
                                         bool vec_ok, bool active, A (&v)[MAXV][Vec<TH>::n],
                                         int (&cnt)[MAXV]) {
    const int V = Vec<TH>::n;
    A xv[MAXV][V], rv[MAXV][V];
    load_tile<TX, R, MAXV, V>(xr, k, t, d, vec_ok, active, xv, cnt);
    load_tile<TR, R, MAXV, V, false>(rr, k, t, d, vec_ok, active, rv, cnt);
#pragma unroll
    for (int s = 0; s < MAXV; ++s) {
#pragma unroll
        for (int j = 0; j < V; ++j) v[s][j] = lnlib::rounded<TH>(rv[s][j] + xv[s][j]);
        const long long c = ((long long)k * MAXV + s) * R + t;
        if (cnt[s]) lnlib::store_elems<TH, V>(hr, c, cnt[s], vec_ok, v[s]);
    }
}

// Forward: y = (h - mean) * rstd * weight + bias for every row (weight and bias optional, in
// the accumulation type); the row's mean (CENTER only) and rstd are saved for the backward.
// Without ADD, h is the input x itself (TX = TR = TH). With ADD (the fused residual add), h =
// residual + x is made tile by tile as the row is first read (add_tile) and written to h, and
// the statistics and y come from the stored h by the same code as without: y is bitwise the
// norm of h, cast to TX. Rows longer than a tile reread h, not x and residual.
// With MOD (AdaLN, GroupNorm: modulated_layer_norm_fwd), weight and bias are (mods, d) and row
// i takes their row (i / group) % mods. LONG: the long-row kernels (*_fwd_long, rows of
// several tiles, two blocks an SM), which keep no parameters in registers.
template <typename TX, typename TR, typename TH, int R, int MAXV, bool CENTER, bool ADD,
          bool MOD = false, bool LONG = false, typename A>
__device__ __forceinline__ void norm_fwd(const TX* x, long long ldx, const TR* residual,
                                         long long ldr, TH* h, long long ldh, TX* y,
                                         long long ldy, const A* weight, const A* bias,
                                         A* mean_out, A* rstd_out, long long m, int d, A eps,
                                         int vec_ok, long long group = 1, long long mods = 1) {
    const int V = Vec<TH>::n, ROWS = LNLIB_BLOCK(R) / R, t = threadIdx.x % R;
    const int tiles = lnlib::tile_count<R, MAXV, V>(d);
    A v[MAXV][V];
    int cnt[MAXV];
    // Rows of one tile: thread t has the same columns in every row, so where the registers
    // allow (KEEP: at most 16 values per thread, blocks of at most 512 threads) it loads their
    // weight and bias once, before the rows, and keeps them (otherwise, and for longer rows,
    // they are loaded per tile, below). Columns past d are never stored: neutral 1 and 0.
    // Not with MOD: the rows of a block may take different parameter rows.
    constexpr bool KEEP = !MOD && !LONG && MAXV * V <= 16 && LNLIB_BLOCK(R) <= 512;
    A wv[MAXV][V], bv[MAXV][V];
    if constexpr (KEEP) {
#pragma unroll
        for (int s = 0; s < MAXV; ++s)
#pragma unroll
            for (int j = 0; j < V; ++j) {
                const long long i = ((long long)s * R + t) * V + j;
                const bool mine = tiles == 1 && i < d;
                wv[s][j] = weight && mine ? __ldg(weight + i) : A(1);
                bv[s][j] = bias && mine ? __ldg(bias + i) : A(0);
            }
    }
    for (long long first = (long long)blockIdx.x * ROWS; first < m;
         first += (long long)gridDim.x * ROWS) {
        const long long row = first + threadIdx.x / R;
        const bool active = row < m;  // inactive threads still meet the block's barriers
        const long long r0 = active ? row : 0;
        const TX* xr = x + r0 * ldx;
        const TR* rr = ADD ? residual + r0 * ldr : residual;
        TH* hr = ADD ? h + r0 * ldh : h;
        A mu, rstd;
        row_statistics<TX, TR, TH, R, MAXV, CENTER, ADD>(xr, rr, hr, tiles, t, d, vec_ok, active,
                                                         eps, v, cnt, mu, rstd);
        if (!active) continue;
        if (t == 0) {
            if (CENTER) mean_out[row] = mu;
            rstd_out[row] = rstd;
        }
        const long long p = MOD ? (row / group) % mods * d : 0;  // this row's parameter row
        const A* wr = weight ? weight + p : weight;
        const A* br = bias ? bias + p : bias;
        for (int k = 0; k < tiles; ++k) {
            if (tiles > 1) {
                if constexpr (ADD)
                    load_tile<TH, R, MAXV, V, false>(hr, k, t, d, vec_ok, active, v, cnt);
                else
                    load_tile<TH, R, MAXV>(xr, k, t, d, vec_ok, active, v, cnt);
            }
#pragma unroll
            for (int s = 0; s < MAXV; ++s) {
                const long long c = ((long long)k * MAXV + s) * R + t;
                A out[V];
#pragma unroll
                for (int j = 0; j < V; ++j) {
                    const long long i = j < cnt[s] ? c * V + j : 0;
                    const A w = KEEP && tiles == 1 ? wv[s][j] : wr ? __ldg(wr + i) : A(1);
                    const A b = KEEP && tiles == 1 ? bv[s][j] : br ? __ldg(br + i) : A(0);
                    out[j] = (v[s][j] - mu) * rstd * w + b;
                    // the norm of h gives y in TH; a fused op then casts it to TX
                    if constexpr (!lnlib::Same<TX, TH>::value) out[j] = lnlib::rounded<TH>(out[j]);
                }
                if (cnt[s]) lnlib::store_elems<TX, V>(y + row * ldy, c, cnt[s], vec_ok, out);
            }
        }
    }
}

// Tile k of a row for the backward as loaded: each chunk of V elements of T kept in its own
// type, as one raw vector (a 16-bit type packs two elements to a register); elements past the
// row (or of an inactive thread) are zero. The backward converts an element where it uses it
// (elem), so it holds x and dy in half the registers for 16-bit types and recomputes
// xhat = (x - mu) * rstd at each use: the same value each time.
template <typename T, int R, int MAXV, int V>
__device__ __forceinline__ void load_raw_tile(const T* row, int k, int t, int d, bool vec_ok,
                                              bool active,
                                              typename lnlib::Raw<V * sizeof(T)>::type (&raw)[MAXV],
                                              int (&cnt)[MAXV]) {
    typedef typename lnlib::Raw<V * sizeof(T)>::type W;
#pragma unroll
    for (int s = 0; s < MAXV; ++s) {
        const long long c = ((long long)k * MAXV + s) * R + t, i0 = c * V;
        if (active && vec_ok && i0 + V <= d) {
            raw[s] = __ldg(reinterpret_cast<const W*>(row) + c);
            cnt[s] = V;
            continue;
        }
        // element by element, packed into 32-bit words by value (writing the elements through
        // a pointer into the vector put it on the stack for float16 dy in float32 rows)
        unsigned int w[sizeof(W) / 4] = {};
        int n = 0;
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const bool in = active && i0 + j < d;
            lnlib::Bits<T>::put(w, j, in ? row[i0 + j] : lnlib::Out<T>::of(typename Acc<T>::type(0)));
            n += in;
        }
        lnlib::from_words(w, raw[s]);
        cnt[s] = n;
    }
}

// Element j of a raw chunk of T, in the accumulation type.
template <typename T, typename W> __device__ __forceinline__ auto elem(const W& raw, int j) {
    return lnlib::to_acc(reinterpret_cast<const T*>(&raw)[j]);
}

// A tile's chunks of T as the one-tile backward holds them: a 16-bit type in 16-byte chunks
// (its own rows) as loaded (raw vectors, two elements to a register), anything else in the
// accumulation type (as many registers for 32- and 64-bit types; float16 dy in float32 rows,
// 8-byte chunks, took more registers and spilled when held raw). at(s, j): element j of slot
// s in the accumulation type.
template <typename T, int R, int MAXV, int V, typename A,
          bool RAW = sizeof(T) == 2 && V * sizeof(T) == 16>
struct Held {
    typename lnlib::Raw<V * sizeof(T)>::type raw[MAXV];
    __device__ __forceinline__ void load(const T* row, int t, int d, bool vec_ok, bool active,
                                         int (&cnt)[MAXV]) {
        load_raw_tile<T, R, MAXV, V>(row, 0, t, d, vec_ok, active, raw, cnt);
    }
    __device__ __forceinline__ A at(int s, int j) const { return elem<T>(raw[s], j); }
};

template <typename T, int R, int MAXV, int V, typename A> struct Held<T, R, MAXV, V, A, false> {
    A v[MAXV][V];
    __device__ __forceinline__ void load(const T* row, int t, int d, bool vec_ok, bool active,
                                         int (&cnt)[MAXV]) {
        load_tile<T, R, MAXV, V>(row, 0, t, d, vec_ok, active, v, cnt);
    }
    __device__ __forceinline__ A at(int s, int j) const { return v[s][j]; }
};

// Column of element j of slot s of tile k for thread t (0 for elements past the row).
template <int R, int MAXV, int V>
__device__ __forceinline__ long long column(int k, int s, int j, int t, int cnt) {
    return j < cnt ? (((long long)k * MAXV + s) * R + t) * V + j : 0;
}

// The rows the blocks of a backward take. Without MOD: every row, the grid's blocks taking
// them in turn. With MOD (AdaLN, GroupNorm: modulated_layer_norm_bwd), row i takes row
// (i / group) % mods of the parameters (mods, d), and the grid is mods runs of `blocks`
// blocks, run p taking the rows of parameter row p only, so that its units' partial sums are
// those of parameter row p. The host lays the parameters out so that either group is 1 (run
// p: rows p, p + mods, p + 2 mods, ...) or mods * group = m (run p: rows p * group to
// p * group + group - 1): either way run p's k-th row is p * group + k * stride, k = 0 ..
// count - 1 (count = m / mods), with p * group added to the row pointers once, and no
// division per row (a 64-bit division took registers enough to spill).
template <bool MOD> struct ModRows {
    long long count, blocks, block, param, first;
    long long stride;
    __device__ __forceinline__ ModRows(long long m, long long group, long long mods) {
        blocks = MOD ? gridDim.x / mods : gridDim.x;
        param = MOD ? blockIdx.x / blocks : 0;
        block = blockIdx.x - param * blocks;
        count = MOD ? m / mods : m;
        first = param * group;
        stride = MOD && group == 1 ? mods : 1;
    }
    __device__ __forceinline__ long long row(long long k) const { return MOD ? k * stride : k; }
    // Units of one parameter row (rows of the partial buffers), with ROWS units a block.
    __device__ __forceinline__ long long units(int rows_per_block) const {
        return min(count, blocks * rows_per_block);
    }
};

// Backward: with xhat = (x - mean) * rstd and g = dy * weight, for every row
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat))       (RMSNorm, CENTER false: no mean(g)).
// dweight = sum of dy * xhat and dbias = sum of dy over the rows: each row group (unit u) adds
// its rows in row order, in registers, and writes row u of the partial buffers (units, d);
// param_grad_sum then adds the units in a fixed order. No atomics.
// This kernel takes rows of one tile (d <= R * MAXV * V; lnlib/_cuda/build.py launches it for
// those only); longer rows go to norm_bwd_long, below, which sums each row in the same order.
// With ADD (the fused residual add, x being h), dx is rounded to T and dh (if not null) added,
// rounded once to T: dx is written as dsum = dh + dx. Without ADD, dh is unused and TY = T.
// With MOD (AdaLN, GroupNorm), see ModRows: a block takes the rows of one parameter row only.
template <typename TY, typename T, int R, int MAXV, bool CENTER, bool ADD, bool MOD = false,
          typename A>
__device__ __forceinline__ void norm_bwd(const TY* dy, long long lddy, const T* x, long long ldx,
                                         const T* dh, long long lddh, const A* mean,
                                         const A* rstd, const A* weight, T* dx, long long lddx,
                                         A* dw_part, A* db_part, long long m, int d, int vec_ok,
                                         long long group = 1, long long mods = 1) {
    const int V = Vec<T>::n, ROWS = LNLIB_BLOCK(R) / R, t = threadIdx.x % R;
    __shared__ A shs[2 * (LNLIB_BLOCK(R) / 32)];
    const ModRows<MOD> rows(m, group, mods);
    if (MOD) {  // the run's first row, and its parameter row
        dy += rows.first * lddy, x += rows.first * ldx, dx += rows.first * lddx;
        mean += rows.first, rstd += rows.first;
        if (weight) weight += rows.param * d;
        dw_part += rows.param * rows.units(ROWS) * d;  // the run's units' rows
        if (CENTER) db_part += rows.param * rows.units(ROWS) * d;
    }
    const long long u = rows.block * ROWS + threadIdx.x / R;  // the unit, among its run's
    Held<T, R, MAXV, V, A> xv;    // x, and xhat = (x - mu) * rstd recomputed at each use
    Held<TY, R, MAXV, V, A> dyv;  // dy
    A pw[MAXV][V], pb[MAXV][V];
    int cnt[MAXV];
    // Blocks of 512 threads (one an SM at up to 128 registers a thread, whatever the kernel
    // uses) stall at every barrier with nothing else to run. There, where x and dy are held raw
    // (16-bit types), the registers that frees hold the next row, loaded before this row's
    // barriers (row_sum), so that its loads are in flight meanwhile. Smaller blocks keep the
    // registers for more resident blocks (e.g. 72 rather than 127 for float16 LayerNorm).
    constexpr bool PREFETCH = LNLIB_BLOCK(R) >= 512 &&
                              sizeof(Held<T, R, MAXV, V, A>) < MAXV * V * sizeof(A) &&
                              sizeof(Held<TY, R, MAXV, V, A>) < MAXV * V * sizeof(A);
#pragma unroll
    for (int s = 0; s < MAXV; ++s)
#pragma unroll
        for (int j = 0; j < V; ++j) pw[s][j] = pb[s][j] = A(0);
    const long long step = rows.blocks * ROWS;
    if constexpr (PREFETCH) {
        const bool active = u < rows.count;
        const long long r0 = active ? rows.row(u) : 0;
        dyv.load(dy + r0 * lddy, t, d, vec_ok, active, cnt);
        xv.load(x + r0 * ldx, t, d, vec_ok, active, cnt);
    }
    for (long long first = rows.block * ROWS; first < rows.count; first += step) {
        const long long k = first + threadIdx.x / R, row = rows.row(k);
        const bool active = k < rows.count;  // inactive threads still meet the block's barriers
        const long long r0 = active ? row : 0;
        const A mu = CENTER ? mean[r0] : A(0), rs = rstd[r0];
        A sums[2] = {A(0), A(0)};  // sum of g, sum of g * xhat
        if constexpr (!PREFETCH) {
            dyv.load(dy + r0 * lddy, t, d, vec_ok, active, cnt);
            xv.load(x + r0 * ldx, t, d, vec_ok, active, cnt);
        }
#pragma unroll
        for (int s = 0; s < MAXV; ++s)
#pragma unroll
            for (int j = 0; j < V; ++j) {
                const long long i = column<R, MAXV, V>(0, s, j, t, cnt[s]);
                const A dy1 = dyv.at(s, j), xh = (xv.at(s, j) - mu) * rs;
                const A g = weight ? dy1 * __ldg(weight + i) : dy1;
                sums[0] += g;
                sums[1] += g * xh;
            }
        Held<T, R, MAXV, V, A> xn;  // the next row (PREFETCH only)
        Held<TY, R, MAXV, V, A> dyn;
        int cntn[MAXV];
        if constexpr (PREFETCH) {
            const bool nactive = k + step < rows.count;
            const long long n0 = nactive ? rows.row(k + step) : 0;
            dyn.load(dy + n0 * lddy, t, d, vec_ok, nactive, cntn);
            xn.load(x + n0 * ldx, t, d, vec_ok, nactive, cntn);
        }
        lnlib::row_sum<R, 2>(sums, shs);
        if (active) {
            const A c1 = CENTER ? sums[0] / A(d) : A(0), c2 = sums[1] / A(d);
#pragma unroll
            for (int s = 0; s < MAXV; ++s) {
                A out[V];
#pragma unroll
                for (int j = 0; j < V; ++j) {
                    const long long i = column<R, MAXV, V>(0, s, j, t, cnt[s]);
                    const A dy1 = dyv.at(s, j), xh = (xv.at(s, j) - mu) * rs;
                    const A g = weight ? dy1 * __ldg(weight + i) : dy1;
                    out[j] = rs * (g - c1 - xh * c2);
                    pw[s][j] += dy1 * xh;  // elements past the row add zeros
                    pb[s][j] += dy1;
                }
                const long long c = (long long)s * R + t;
                if constexpr (ADD) {
                    if (dh && cnt[s]) {
                        A dhv[V];
                        lnlib::load_elems<T, V, true>(dh + row * lddh, c, d, vec_ok, dhv);
#pragma unroll
                        for (int j = 0; j < V; ++j)
                            out[j] = lnlib::rounded<T>(out[j]) + dhv[j];
                    }
                }
                if (cnt[s]) lnlib::store_chunk(dx + row * lddx, c, cnt[s], vec_ok, out);
            }
        }
        if constexpr (PREFETCH) {
            xv = xn;
            dyv = dyn;
#pragma unroll
            for (int s = 0; s < MAXV; ++s) cnt[s] = cntn[s];
        }
    }
    if (u >= rows.count) return;  // a unit without rows (only in a block's last rows)
#pragma unroll
    for (int s = 0; s < MAXV; ++s)
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const long long i = ((long long)s * R + t) * V + j;
            if (i < d) {
                dw_part[u * d + i] = pw[s][j];
                if (CENTER) db_part[u * d + i] = pb[s][j];
            }
        }
}

// Backward of rows longer than one tile, in two launches of this kernel (phase 0, then 1), so
// that no partial sum goes to global memory row after row and nothing but the row sums' trees
// needs shared memory:
// - phase 0, a block of R threads per row (grid-stride over the rows): the row's sums of g and
//   g * xhat, in tile, slot, element order, then the fixed trees of row_sum (so the order of
//   norm_bwd), written as c[row] = mean(g) (0 for RMSNorm) and c[m + row] = mean(g * xhat);
// - phase 1, blocks (unit u, tiles k): block u of the grid's x axis takes rows u, u + units,
//   ... (units = gridDim.x <= m; with MOD the rows of one parameter row, ModRows), and for each
//   tile k of columns (k = blockIdx.y, blockIdx.y + gridDim.y, ...) reads that tile of x and dy
//   of its rows in turn, writes dx from c, and adds dy * xhat and dy to the partial sums of its
//   columns in registers, written once to row u of dw_part and db_part. No barrier.
// x and dy are read twice, dx written once; per column, a unit adds its rows in row order.
template <typename TY, typename T, int R, int MAXV, bool CENTER, bool ADD, bool MOD = false,
          typename A>
__device__ __forceinline__ void norm_bwd_long(const TY* dy, long long lddy, const T* x,
                                              long long ldx, const T* dh, long long lddh,
                                              const A* mean, const A* rstd, const A* weight,
                                              T* dx, long long lddx, A* dw_part, A* db_part,
                                              long long m, int d, int vec_ok, A* c, int phase,
                                              long long group = 1, long long mods = 1) {
    static_assert(LNLIB_BLOCK(R) == R, "a block per row");
    const int V = Vec<T>::n, t = threadIdx.x;
    const int tiles = lnlib::tile_count<R, MAXV, V>(d);
    if (phase == 0) {
        __shared__ A shs[2 * (R / 32)];
        A xv[MAXV][V], dyv[MAXV][V];
        int cnt[MAXV];
        for (long long row = blockIdx.x; row < m; row += gridDim.x) {
            const A mu = CENTER ? mean[row] : A(0), rs = rstd[row];
            const A* w = MOD && weight ? weight + (row / group) % mods * d : weight;
            A sums[2] = {A(0), A(0)};  // sum of g, sum of g * xhat
            for (int k = 0; k < tiles; ++k) {
                load_tile<TY, R, MAXV, V>(dy + row * lddy, k, t, d, vec_ok, true, dyv, cnt);
                load_tile<T, R, MAXV>(x + row * ldx, k, t, d, vec_ok, true, xv, cnt);
#pragma unroll
                for (int s = 0; s < MAXV; ++s)
#pragma unroll
                    for (int j = 0; j < V; ++j) {
                        const long long i = column<R, MAXV, V>(k, s, j, t, cnt[s]);
                        const A xh = (xv[s][j] - mu) * rs;
                        const A g = w ? dyv[s][j] * __ldg(w + i) : dyv[s][j];
                        sums[0] += g;
                        sums[1] += g * xh;
                    }
            }
            lnlib::row_sum<R, 2>(sums, shs);
            if (t == 0) {
                c[row] = CENTER ? sums[0] / A(d) : A(0);
                c[m + row] = sums[1] / A(d);
            }
        }
        return;
    }
    const ModRows<MOD> rows(m, group, mods);
    const A* c1 = c;
    const A* c2 = c + m;
    if (MOD) {  // the run's first row, and its parameter row
        dy += rows.first * lddy, x += rows.first * ldx, dx += rows.first * lddx;
        mean += rows.first, rstd += rows.first, c1 += rows.first, c2 += rows.first;
        if (weight) weight += rows.param * d;
    }
    A* wrow = dw_part + blockIdx.x * (long long)d;
    A* brow = CENTER ? db_part + blockIdx.x * (long long)d : db_part;
    for (int k = blockIdx.y; k < tiles; k += gridDim.y) {
        A pw[MAXV][V], pb[MAXV][V];
#pragma unroll
        for (int s = 0; s < MAXV; ++s)
#pragma unroll
            for (int j = 0; j < V; ++j) pw[s][j] = pb[s][j] = A(0);
        for (long long q = rows.block; q < rows.count; q += rows.blocks) {
            const long long row = rows.row(q);
            const A mu = CENTER ? mean[row] : A(0), rs = rstd[row], a1 = c1[row], a2 = c2[row];
#pragma unroll
            for (int s = 0; s < MAXV; ++s) {  // a chunk at a time: few registers held
                const long long ch = ((long long)k * MAXV + s) * R + t;
                A xc[V], dyc[V], out[V];
                lnlib::load_elems<TY, V, true>(dy + row * lddy, ch, d, vec_ok, dyc);
                const int n = lnlib::load_elems<T, V, true>(x + row * ldx, ch, d, vec_ok, xc);
#pragma unroll
                for (int j = 0; j < V; ++j) {
                    const long long i = column<R, MAXV, V>(k, s, j, t, n);
                    const A xh = (xc[j] - mu) * rs;
                    const A g = weight ? dyc[j] * __ldg(weight + i) : dyc[j];
                    out[j] = rs * (g - a1 - xh * a2);
                    pw[s][j] += dyc[j] * xh;  // elements past the row add zeros
                    if (CENTER) pb[s][j] += dyc[j];
                }
                if constexpr (ADD) {
                    if (dh && n) {
                        A dhv[V];
                        lnlib::load_elems<T, V, true>(dh + row * lddh, ch, d, vec_ok, dhv);
#pragma unroll
                        for (int j = 0; j < V; ++j) out[j] = lnlib::rounded<T>(out[j]) + dhv[j];
                    }
                }
                if (n) lnlib::store_chunk(dx + row * lddx, ch, n, vec_ok, out);
            }
        }
#pragma unroll
        for (int s = 0; s < MAXV; ++s)
#pragma unroll
            for (int j = 0; j < V; ++j) {
                const long long i = (((long long)k * MAXV + s) * R + t) * V + j;
                if (i < d) {
                    wrow[i] = pw[s][j];
                    if (CENTER) brow[i] = pb[s][j];
                }
            }
    }
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// The cluster is reached through the CUDA built-ins of sm_90 (__clusterRelativeBlockRank,
// __cluster_barrier_arrive/_wait: barrier.cluster.arrive (release) / wait (acquire), and
// __cluster_map_shared_rank: mapa), the same instructions cooperative_groups' cluster_group
// emits, without its header: NVRTC ships no cooperative_groups.h, and the one of a CUDA
// toolkit needs libcu++ headers (cuda/std/type_traits) of a matching version, so including it
// could stop every kernel of an sm_90 module from compiling where the toolkit's headers and
// CuPy's bundled ones differ.
__device__ __forceinline__ void cluster_sync() {
    __cluster_barrier_arrive();
    __cluster_barrier_wait();
}

// Blocks in a cluster of the sm_90 long-row backward (lnlib/_cuda/build.py, CLUSTER).
#define LNLIB_CLUSTER 8

// Backward of long rows on sm_90 (H100, H200), in one launch that reads x and dy once: a
// thread-block cluster of LNLIB_CLUSTER blocks (compile-time __cluster_dims__) takes a row at a
// time, block `rank` of the cluster owning the row's chunks rank * S .. rank * S + S - 1 (S =
// ceil(chunks / LNLIB_CLUSTER)), thread t of it the chunks rank * S + s * R + t (s < MAXV).
// For each of its rows (cluster u = blockIdx.x / LNLIB_CLUSTER takes rows u, u + units, ...,
// units = gridDim.x / LNLIB_CLUSTER; with MOD, the grid is mods runs of `units` clusters and
// the u-th cluster of run p takes the run's rows u, u + units, ... of ModRows) a block
// - copies its chunks of x and dy (h for the fused add) into its shared memory (dynamic: two
//   buffers of S chunks each of x and dy), by cp.async where the row is aligned, the next row's
//   copies issued before this row's work so that they are in flight during its barriers; each
//   thread reads back only the chunks it copied, so no barrier guards the buffers;
// - forms its sums of g and g * xhat (thread: slots s, then elements j, in order; then the
//   fixed trees of row_sum over the block's R threads), puts them in its shared memory, and
//   after a cluster barrier every warp of every block reads the LNLIB_CLUSTER blocks' sums
//   through distributed shared memory and adds them in rank order 0, 1, ..., so every block
//   has bitwise the same row sums;
// - writes dx from the staged chunks and adds dy * xhat and dy to the partial sums of its
//   columns, kept in registers over all the cluster's rows and written once to row u of
//   dw_part and db_part (units, d; with MOD, row p * units + u of (mods * units, d)), which
//   param_grad_sum adds as for the other kernels (run by run with MOD).
// x and dy are read once, dx written once: 12 bytes an element for float32 (plus dh for the
// fused add). The row sums are added in another order than norm_bwd's (by blocks of the
// cluster, then ranks), fixed by d alone: every row of one d takes this path on a GPU of
// compute capability 9.x where d fits (build.backward_path), whatever the number of rows.
// The partial sums of the rows' two sums go through two slots (row parity): a block writes a
// slot again two rows later, after the next row's cluster barrier, which every block reaches
// only after it has read the slot.
template <int B> __device__ __forceinline__ void copy_async(void* dst, const void* src) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(dst);
    if constexpr (B == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(src) : "memory");
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(s), "l"(src), "n"(B)
                     : "memory");
}
__device__ __forceinline__ void copy_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void copy_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Chunk c of a row (V elements of T) into *dst in shared memory: one cp.async where the row is
// aligned and the chunk whole, else element by element (zeros past the row), the same bits.
template <typename T, int V>
__device__ __forceinline__ void stage_chunk(typename lnlib::Raw<V * sizeof(T)>::type* dst,
                                            const T* row, long long c, int d, bool vec_ok) {
    typedef typename lnlib::Raw<V * sizeof(T)>::type W;
    const long long i0 = c * V;
    if (vec_ok && i0 + V <= d) {
        copy_async<sizeof(W)>(dst, reinterpret_cast<const W*>(row) + c);
        return;
    }
    unsigned int w[sizeof(W) / 4] = {};
#pragma unroll
    for (int j = 0; j < V; ++j) {
        const bool in = i0 + j < d;
        lnlib::Bits<T>::put(w, j, in ? row[i0 + j] : lnlib::Out<T>::of(typename Acc<T>::type(0)));
    }
    W raw;
    lnlib::from_words(w, raw);
    *dst = raw;
}

template <typename TY, typename T, int R, int MAXV, bool CENTER, bool ADD, bool MOD = false,
          typename A>
__device__ __forceinline__ void norm_bwd_cluster(const TY* dy, long long lddy, const T* x,
                                                 long long ldx, const T* dh, long long lddh,
                                                 const A* mean, const A* rstd, const A* weight,
                                                 T* dx, long long lddx, A* dw_part, A* db_part,
                                                 long long m, int d, int vec_ok,
                                                 long long group = 1, long long mods = 1) {
    typedef typename lnlib::Raw<Vec<T>::n * sizeof(T)>::type WX;
    typedef typename lnlib::Raw<Vec<T>::n * sizeof(TY)>::type WY;
    const int V = Vec<T>::n, C = LNLIB_CLUSTER, t = threadIdx.x, lane = threadIdx.x % 32;
    const int rank = (int)__clusterRelativeBlockRank();
    // The rows of the cluster (ModRows: with MOD, the grid is mods runs of whole clusters, run
    // p taking the rows of parameter row p only): units clusters a run, this one the u-th.
    const ModRows<MOD> rows(m, group, mods);
    const long long units = rows.blocks / C, u = rows.block / C;
    if (MOD) {  // the run's first row, its parameter row, and its units' partial-sum rows
        dy += rows.first * lddy, x += rows.first * ldx, dx += rows.first * lddx;
        mean += rows.first, rstd += rows.first;
        if (weight) weight += rows.param * d;
        dw_part += rows.param * units * d;
        if (CENTER) db_part += rows.param * units * d;
    }
    const int chunks = d / V + (d % V != 0);
    const int slice = chunks / C + (chunks % C != 0);
    const int c0 = rank * slice, own = max(0, min(slice, chunks - c0));
    extern __shared__ __align__(16) unsigned char lnlib_staged[];
    WX* xs = reinterpret_cast<WX*>(lnlib_staged);  // [2][slice]: x, two rows
    WY* dys = reinterpret_cast<WY*>(xs + 2 * slice);  // [2][slice]: dy
    __shared__ A shs[2 * (R / 32)];
    __shared__ A part[2][2];  // this block's two sums, for rows of either parity
    A pw[MAXV][V], pb[MAXV][V];
#pragma unroll
    for (int s = 0; s < MAXV; ++s)
#pragma unroll
        for (int j = 0; j < V; ++j) pw[s][j] = pb[s][j] = A(0);
    auto stage = [&](long long row, int buf) {
#pragma unroll
        for (int s = 0; s < MAXV; ++s) {
            const int q = s * R + t;
            if (q < own) {
                stage_chunk<T, V>(xs + buf * slice + q, x + row * ldx, c0 + q, d, vec_ok);
                stage_chunk<TY, V>(dys + buf * slice + q, dy + row * lddy, c0 + q, d, vec_ok);
            }
        }
        copy_commit();
    };
    if (u < rows.count) stage(rows.row(u), 0);
    int buf = 0;
    for (long long k = u; k < rows.count; k += units, buf ^= 1) {
        const long long row = rows.row(k);
        if (k + units < rows.count) stage(rows.row(k + units), buf ^ 1);
        else copy_commit();  // an empty group: the wait below is the same
        copy_wait<1>();      // this row's chunks are in
        const A mu = CENTER ? mean[row] : A(0), rs = rstd[row];
        A sums[2] = {A(0), A(0)};  // sum of g, sum of g * xhat
#pragma unroll
        for (int s = 0; s < MAXV; ++s) {
            const int q = s * R + t;
            if (q >= own) continue;
            const WX xr = xs[buf * slice + q];
            const WY yr = dys[buf * slice + q];
            const long long i0 = (long long)(c0 + q) * V;
#pragma unroll
            for (int j = 0; j < V; ++j) {
                const A dy1 = elem<TY>(yr, j), xh = (elem<T>(xr, j) - mu) * rs;
                const A g = weight ? dy1 * __ldg(weight + (i0 + j < d ? i0 + j : 0)) : dy1;
                sums[0] += g;  // elements past the row add zeros
                sums[1] += g * xh;
            }
        }
        lnlib::row_sum<R, 2>(sums, shs);
        if (t == 0) part[buf][0] = sums[0], part[buf][1] = sums[1];
        cluster_sync();
        A p[2] = {A(0), A(0)};
        if (lane < C) {
            const A* theirs = static_cast<const A*>(
                __cluster_map_shared_rank((void*)&part[buf][0], (unsigned)lane));
            p[0] = theirs[0], p[1] = theirs[1];
        }
        A total[2] = {A(0), A(0)};
#pragma unroll
        for (int r = 0; r < C; ++r)  // rank order, in every warp of every block
#pragma unroll
            for (int i = 0; i < 2; ++i) total[i] += __shfl_sync(0xffffffffu, p[i], r);
        const A c1 = CENTER ? total[0] / A(d) : A(0), c2 = total[1] / A(d);
#pragma unroll
        for (int s = 0; s < MAXV; ++s) {
            const int q = s * R + t;
            if (q >= own) continue;
            const WX xr = xs[buf * slice + q];
            const WY yr = dys[buf * slice + q];
            const long long c = c0 + q, i0 = c * V;
            const int n = d - i0 < V ? (int)(d - i0) : V;
            A out[V];
#pragma unroll
            for (int j = 0; j < V; ++j) {
                const A dy1 = elem<TY>(yr, j), xh = (elem<T>(xr, j) - mu) * rs;
                const A g = weight ? dy1 * __ldg(weight + (j < n ? i0 + j : 0)) : dy1;
                out[j] = rs * (g - c1 - xh * c2);
                pw[s][j] += dy1 * xh;  // elements past the row add zeros
                if (CENTER) pb[s][j] += dy1;
            }
            if constexpr (ADD) {
                if (dh) {
                    A dhv[V];
                    lnlib::load_elems<T, V, true>(dh + row * lddh, c, d, vec_ok, dhv);
#pragma unroll
                    for (int j = 0; j < V; ++j) out[j] = lnlib::rounded<T>(out[j]) + dhv[j];
                }
            }
            lnlib::store_chunk(dx + row * lddx, c, n, vec_ok, out);
        }
    }
    cluster_sync();  // no block leaves while another may still read its sums
    if (u >= rows.count) return;
#pragma unroll
    for (int s = 0; s < MAXV; ++s) {
        const int q = s * R + t;
        if (q >= own) continue;
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const long long i = (long long)(c0 + q) * V + j;
            if (i < d) {
                dw_part[u * d + i] = pw[s][j];
                if (CENTER) db_part[u * d + i] = pb[s][j];
            }
        }
    }
}
#endif

// Second stage of the parameter gradients: out[col] = sum over u of part[u, col], for units
// u = 0 .. units-1. Thread (tx, ty) of a block of 8 columns by 32 lanes adds the units ty,
// ty + 32, ... of column blockIdx.x * 8 + tx in order; the 32 lanes' sums are then added by a
// fixed tree over ty. (A warp reads 8 consecutive values of 4 units: whole 32-byte sectors; 8
// columns a block spread a sum of few columns over many SMs.)
#define LNLIB_SUM_COLS 8
template <typename A>
__device__ __forceinline__ void param_grad_sum_body(const A* part, long long units, int d, A* out) {
    __shared__ A shm[32][LNLIB_SUM_COLS + 1];
    const int tx = threadIdx.x % LNLIB_SUM_COLS, ty = threadIdx.x / LNLIB_SUM_COLS;
    const long long col = (long long)blockIdx.x * LNLIB_SUM_COLS + tx;
    A s = A(0);
    if (col < d)
#pragma unroll 4
        for (long long u = ty; u < units; u += 32) s += part[u * d + col];
    shm[ty][tx] = s;
    __syncthreads();
    for (int half = 16; half > 0; half >>= 1) {
        if (ty < half) shm[ty][tx] += shm[ty + half][tx];
        __syncthreads();
    }
    if (ty == 0 && col < d) out[col] = shm[0][tx];
}

// The kernels CuPy loads by name (lnlib/_cuda/build.py builds the name expressions).
template <typename T, int R, int MAXV>
__global__ void __launch_bounds__(LNLIB_BLOCK(R))
layer_norm_fwd(const T* x, long long ldx, T* y, long long ldy,
               const typename Acc<T>::type* weight, const typename Acc<T>::type* bias,
               typename Acc<T>::type* mean, typename Acc<T>::type* rstd, long long m, int d,
               typename Acc<T>::type eps, int vec_ok) {
    norm_fwd<T, T, T, R, MAXV, true, false>(x, ldx, (const T*)0, 0, (T*)0, 0, y, ldy, weight,
                                            bias, mean, rstd, m, d, eps, vec_ok);
}

template <typename T, int R, int MAXV>
__global__ void __launch_bounds__(LNLIB_BLOCK(R))
rms_norm_fwd(const T* x, long long ldx, T* y, long long ldy,
             const typename Acc<T>::type* weight, typename Acc<T>::type* rstd, long long m,
             int d, typename Acc<T>::type eps, int vec_ok) {
    typedef typename Acc<T>::type A;
    norm_fwd<T, T, T, R, MAXV, false, false>(x, ldx, (const T*)0, 0, (T*)0, 0, y, ldy, weight,
                                             (const A*)0, (A*)0, rstd, m, d, eps, vec_ok);
}

template <typename T, int R, int MAXV>
__global__ void __launch_bounds__(LNLIB_BLOCK(R))
layer_norm_bwd(const T* dy, long long lddy, const T* x, long long ldx,
               const typename Acc<T>::type* mean, const typename Acc<T>::type* rstd,
               const typename Acc<T>::type* weight, T* dx, long long lddx,
               typename Acc<T>::type* dw_part, typename Acc<T>::type* db_part, long long m,
               int d, int vec_ok) {
    norm_bwd<T, T, R, MAXV, true, false>(dy, lddy, x, ldx, (const T*)0, 0, mean, rstd, weight,
                                         dx, lddx, dw_part, db_part, m, d, vec_ok);
}

template <typename T, int R, int MAXV>
__global__ void __launch_bounds__(LNLIB_BLOCK(R))
rms_norm_bwd(const T* dy, long long lddy, const T* x, long long ldx,
             const typename Acc<T>::type* rstd, const typename Acc<T>::type* weight, T* dx,
             long long lddx, typename Acc<T>::type* dw_part, long long m, int d, int vec_ok) {
    typedef typename Acc<T>::type A;
    norm_bwd<T, T, R, MAXV, false, false>(dy, lddy, x, ldx, (const T*)0, 0, (const A*)0, rstd,
                                          weight, dx, lddx, dw_part, (A*)0, m, d, vec_ok);
}

// The fused residual add: x (TX) and residual (TR) in, h (TH) and y (TX) out; the row layout,
// the accumulation type and the launch shapes are those of TH, so y is bitwise the norm of h.
// h may be residual itself. The backward takes dy (TY), dh (TH, or null for zero) and h, and
// writes dsum = dh + dx (TH).
template <typename TX, typename TR, typename TH, int R, int MAXV>
__global__ void __launch_bounds__(LNLIB_BLOCK(R))
add_layer_norm_fwd(const TX* x, long long ldx, const TR* residual, long long ldr, TH* h,
                   long long ldh, TX* y, long long ldy, const typename Acc<TH>::type* weight,
                   const typename Acc<TH>::type* bias, typename Acc<TH>::type* mean,
                   typename Acc<TH>::type* rstd, long long m, int d,
                   typename Acc<TH>::type eps, int vec_ok) {
    norm_fwd<TX, TR, TH, R, MAXV, true, true>(x, ldx, residual, ldr, h, ldh, y, ldy, weight,
                                              bias, mean, rstd, m, d, eps, vec_ok);
}

template <typename TX, typename TR, typename TH, int R, int MAXV>
__global__ void __launch_bounds__(LNLIB_BLOCK(R))
add_rms_norm_fwd(const TX* x, long long ldx, const TR* residual, long long ldr, TH* h,
                 long long ldh, TX* y, long long ldy, const typename Acc<TH>::type* weight,
                 typename Acc<TH>::type* rstd, long long m, int d, typename Acc<TH>::type eps,
                 int vec_ok) {
    typedef typename Acc<TH>::type A;
    norm_fwd<TX, TR, TH, R, MAXV, false, true>(x, ldx, residual, ldr, h, ldh, y, ldy, weight,
                                               (const A*)0, (A*)0, rstd, m, d, eps, vec_ok);
}

template <typename TY, typename TH, int R, int MAXV>
__global__ void __launch_bounds__(LNLIB_BLOCK(R))
add_layer_norm_bwd(const TY* dy, long long lddy, const TH* dh, long long lddh, const TH* h,
                   long long ldh, const typename Acc<TH>::type* mean,
                   const typename Acc<TH>::type* rstd, const typename Acc<TH>::type* weight,
                   TH* dsum, long long ldds, typename Acc<TH>::type* dw_part,
                   typename Acc<TH>::type* db_part, long long m, int d, int vec_ok) {
    norm_bwd<TY, TH, R, MAXV, true, true>(dy, lddy, h, ldh, dh, lddh, mean, rstd, weight, dsum,
                                          ldds, dw_part, db_part, m, d, vec_ok);
}

template <typename TY, typename TH, int R, int MAXV>
__global__ void __launch_bounds__(LNLIB_BLOCK(R))
add_rms_norm_bwd(const TY* dy, long long lddy, const TH* dh, long long lddh, const TH* h,
                 long long ldh, const typename Acc<TH>::type* rstd,
                 const typename Acc<TH>::type* weight, TH* dsum, long long ldds,
                 typename Acc<TH>::type* dw_part, long long m, int d, int vec_ok) {
    typedef typename Acc<TH>::type A;
    norm_bwd<TY, TH, R, MAXV, false, true>(dy, lddy, h, ldh, dh, lddh, (const A*)0, rstd, weight,
                                           dsum, ldds, dw_part, (A*)0, m, d, vec_ok);
}

// The forward of rows longer than one tile (build.long_shape): blocks of R = 512 threads, one
// row each, two blocks an SM (at most 64 registers a thread), so that while one block waits at
// its barriers or rereads its row the other computes; the same code as the one-tile forward,
// with no parameters held in registers.
template <typename T, int R, int MAXV>
__global__ void __launch_bounds__(R, 2)
layer_norm_fwd_long(const T* x, long long ldx, T* y, long long ldy,
                    const typename Acc<T>::type* weight, const typename Acc<T>::type* bias,
                    typename Acc<T>::type* mean, typename Acc<T>::type* rstd, long long m, int d,
                    typename Acc<T>::type eps, int vec_ok) {
    norm_fwd<T, T, T, R, MAXV, true, false, false, true>(x, ldx, (const T*)0, 0, (T*)0, 0, y,
                                                         ldy, weight, bias, mean, rstd, m, d,
                                                         eps, vec_ok);
}

template <typename T, int R, int MAXV>
__global__ void __launch_bounds__(R, 2)
rms_norm_fwd_long(const T* x, long long ldx, T* y, long long ldy,
                  const typename Acc<T>::type* weight, typename Acc<T>::type* rstd, long long m,
                  int d, typename Acc<T>::type eps, int vec_ok) {
    typedef typename Acc<T>::type A;
    norm_fwd<T, T, T, R, MAXV, false, false, false, true>(x, ldx, (const T*)0, 0, (T*)0, 0, y,
                                                          ldy, weight, (const A*)0, (A*)0, rstd,
                                                          m, d, eps, vec_ok);
}

template <typename TX, typename TR, typename TH, int R, int MAXV>
__global__ void __launch_bounds__(R, 2)
add_layer_norm_fwd_long(const TX* x, long long ldx, const TR* residual, long long ldr, TH* h,
                        long long ldh, TX* y, long long ldy,
                        const typename Acc<TH>::type* weight,
                        const typename Acc<TH>::type* bias, typename Acc<TH>::type* mean,
                        typename Acc<TH>::type* rstd, long long m, int d,
                        typename Acc<TH>::type eps, int vec_ok) {
    norm_fwd<TX, TR, TH, R, MAXV, true, true, false, true>(x, ldx, residual, ldr, h, ldh, y, ldy,
                                                           weight, bias, mean, rstd, m, d, eps,
                                                           vec_ok);
}

template <typename TX, typename TR, typename TH, int R, int MAXV>
__global__ void __launch_bounds__(R, 2)
add_rms_norm_fwd_long(const TX* x, long long ldx, const TR* residual, long long ldr, TH* h,
                      long long ldh, TX* y, long long ldy, const typename Acc<TH>::type* weight,
                      typename Acc<TH>::type* rstd, long long m, int d,
                      typename Acc<TH>::type eps, int vec_ok) {
    typedef typename Acc<TH>::type A;
    norm_fwd<TX, TR, TH, R, MAXV, false, true, false, true>(x, ldx, residual, ldr, h, ldh, y,
                                                            ldy, weight, (const A*)0, (A*)0,
                                                            rstd, m, d, eps, vec_ok);
}

// The long-row backward (norm_bwd_long) of each backward above, launched twice (phase 0, 1)
// with blocks of R threads, two blocks an SM (so at most 128 registers a thread); c holds the
// rows' two means between the launches.
template <typename T, int R, int MAXV>
__global__ void __launch_bounds__(R, 2)
layer_norm_bwd_long(const T* dy, long long lddy, const T* x, long long ldx,
                    const typename Acc<T>::type* mean, const typename Acc<T>::type* rstd,
                    const typename Acc<T>::type* weight, T* dx, long long lddx,
                    typename Acc<T>::type* dw_part, typename Acc<T>::type* db_part, long long m,
                    int d, int vec_ok, typename Acc<T>::type* c, int phase) {
    norm_bwd_long<T, T, R, MAXV, true, false>(dy, lddy, x, ldx, (const T*)0, 0, mean, rstd,
                                              weight, dx, lddx, dw_part, db_part, m, d, vec_ok,
                                              c, phase);
}

template <typename T, int R, int MAXV>
__global__ void __launch_bounds__(R, 2)
rms_norm_bwd_long(const T* dy, long long lddy, const T* x, long long ldx,
                  const typename Acc<T>::type* rstd, const typename Acc<T>::type* weight, T* dx,
                  long long lddx, typename Acc<T>::type* dw_part, long long m, int d, int vec_ok,
                  typename Acc<T>::type* c, int phase) {
    typedef typename Acc<T>::type A;
    norm_bwd_long<T, T, R, MAXV, false, false>(dy, lddy, x, ldx, (const T*)0, 0, (const A*)0,
                                               rstd, weight, dx, lddx, dw_part, (A*)0, m, d,
                                               vec_ok, c, phase);
}

template <typename TY, typename TH, int R, int MAXV>
__global__ void __launch_bounds__(R, 2)
add_layer_norm_bwd_long(const TY* dy, long long lddy, const TH* dh, long long lddh, const TH* h,
                        long long ldh, const typename Acc<TH>::type* mean,
                        const typename Acc<TH>::type* rstd,
                        const typename Acc<TH>::type* weight, TH* dsum, long long ldds,
                        typename Acc<TH>::type* dw_part, typename Acc<TH>::type* db_part,
                        long long m, int d, int vec_ok, typename Acc<TH>::type* c, int phase) {
    norm_bwd_long<TY, TH, R, MAXV, true, true>(dy, lddy, h, ldh, dh, lddh, mean, rstd, weight,
                                               dsum, ldds, dw_part, db_part, m, d, vec_ok,
                                               c, phase);
}

template <typename TY, typename TH, int R, int MAXV>
__global__ void __launch_bounds__(R, 2)
add_rms_norm_bwd_long(const TY* dy, long long lddy, const TH* dh, long long lddh, const TH* h,
                      long long ldh, const typename Acc<TH>::type* rstd,
                      const typename Acc<TH>::type* weight, TH* dsum, long long ldds,
                      typename Acc<TH>::type* dw_part, long long m, int d, int vec_ok,
                      typename Acc<TH>::type* c, int phase) {
    typedef typename Acc<TH>::type A;
    norm_bwd_long<TY, TH, R, MAXV, false, true>(dy, lddy, h, ldh, dh, lddh, (const A*)0, rstd,
                                                weight, dsum, ldds, dw_part, (A*)0, m, d,
                                                vec_ok, c, phase);
}

// The long-row backward of sm_90 (norm_bwd_cluster) of each unfused and fused backward above:
// blocks of R threads, clusters of LNLIB_CLUSTER blocks, one block an SM (at most 128
// registers a thread), and the staged rows in dynamic shared memory (lnlib/_cuda/build.py,
// cluster_shared_bytes). Compiled for compute capability 9.0 and later only.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
template <typename T, int R, int MAXV>
__global__ void __launch_bounds__(R, 1) __cluster_dims__(LNLIB_CLUSTER, 1, 1)
layer_norm_bwd_cluster(const T* dy, long long lddy, const T* x, long long ldx,
                       const typename Acc<T>::type* mean, const typename Acc<T>::type* rstd,
                       const typename Acc<T>::type* weight, T* dx, long long lddx,
                       typename Acc<T>::type* dw_part, typename Acc<T>::type* db_part,
                       long long m, int d, int vec_ok) {
    norm_bwd_cluster<T, T, R, MAXV, true, false>(dy, lddy, x, ldx, (const T*)0, 0, mean, rstd,
                                                 weight, dx, lddx, dw_part, db_part, m, d,
                                                 vec_ok);
}

template <typename T, int R, int MAXV>
__global__ void __launch_bounds__(R, 1) __cluster_dims__(LNLIB_CLUSTER, 1, 1)
rms_norm_bwd_cluster(const T* dy, long long lddy, const T* x, long long ldx,
                     const typename Acc<T>::type* rstd, const typename Acc<T>::type* weight,
                     T* dx, long long lddx, typename Acc<T>::type* dw_part, long long m, int d,
                     int vec_ok) {
    typedef typename Acc<T>::type A;
    norm_bwd_cluster<T, T, R, MAXV, false, false>(dy, lddy, x, ldx, (const T*)0, 0, (const A*)0,
                                                  rstd, weight, dx, lddx, dw_part, (A*)0, m, d,
                                                  vec_ok);
}

template <typename TY, typename TH, int R, int MAXV>
__global__ void __launch_bounds__(R, 1) __cluster_dims__(LNLIB_CLUSTER, 1, 1)
add_layer_norm_bwd_cluster(const TY* dy, long long lddy, const TH* dh, long long lddh,
                           const TH* h, long long ldh, const typename Acc<TH>::type* mean,
                           const typename Acc<TH>::type* rstd,
                           const typename Acc<TH>::type* weight, TH* dsum, long long ldds,
                           typename Acc<TH>::type* dw_part, typename Acc<TH>::type* db_part,
                           long long m, int d, int vec_ok) {
    norm_bwd_cluster<TY, TH, R, MAXV, true, true>(dy, lddy, h, ldh, dh, lddh, mean, rstd,
                                                  weight, dsum, ldds, dw_part, db_part, m, d,
                                                  vec_ok);
}

template <typename TY, typename TH, int R, int MAXV>
__global__ void __launch_bounds__(R, 1) __cluster_dims__(LNLIB_CLUSTER, 1, 1)
add_rms_norm_bwd_cluster(const TY* dy, long long lddy, const TH* dh, long long lddh,
                         const TH* h, long long ldh, const typename Acc<TH>::type* rstd,
                         const typename Acc<TH>::type* weight, TH* dsum, long long ldds,
                         typename Acc<TH>::type* dw_part, long long m, int d, int vec_ok) {
    typedef typename Acc<TH>::type A;
    norm_bwd_cluster<TY, TH, R, MAXV, false, true>(dy, lddy, h, ldh, dh, lddh, (const A*)0, rstd,
                                                   weight, dsum, ldds, dw_part, (A*)0, m, d,
                                                   vec_ok);
}
#endif

// AdaLN and GroupNorm: LayerNorm whose weight and bias (mods, d) change with the row, row i
// taking their row (i / group) % mods (MOD in norm_fwd; ModRows in the backward, whose grid is
// mods runs of blocks, one per parameter row, and whose partial buffers are the runs' units).
// The backward asks for 3 resident blocks of 128 threads (at most 170 registers a thread):
// with the block size alone ptxas kept those at 128 registers and spilled the few that
// ModRows adds.
#define LNLIB_MOD_BWD_BLOCKS(R) (LNLIB_BLOCK(R) == 128 ? 3 : 1)
template <typename T, int R, int MAXV>
__global__ void __launch_bounds__(LNLIB_BLOCK(R))
modulated_layer_norm_fwd(const T* x, long long ldx, T* y, long long ldy,
                         const typename Acc<T>::type* weight, const typename Acc<T>::type* bias,
                         typename Acc<T>::type* mean, typename Acc<T>::type* rstd, long long m,
                         int d, typename Acc<T>::type eps, int vec_ok, long long group,
                         long long mods) {
    norm_fwd<T, T, T, R, MAXV, true, false, true>(x, ldx, (const T*)0, 0, (T*)0, 0, y, ldy,
                                                  weight, bias, mean, rstd, m, d, eps, vec_ok,
                                                  group, mods);
}

template <typename T, int R, int MAXV>
__global__ void __launch_bounds__(R, 2)
modulated_layer_norm_fwd_long(const T* x, long long ldx, T* y, long long ldy,
                              const typename Acc<T>::type* weight,
                              const typename Acc<T>::type* bias, typename Acc<T>::type* mean,
                              typename Acc<T>::type* rstd, long long m, int d,
                              typename Acc<T>::type eps, int vec_ok, long long group,
                              long long mods) {
    norm_fwd<T, T, T, R, MAXV, true, false, true, true>(x, ldx, (const T*)0, 0, (T*)0, 0, y, ldy,
                                                        weight, bias, mean, rstd, m, d, eps,
                                                        vec_ok, group, mods);
}

template <typename T, int R, int MAXV>
__global__ void __launch_bounds__(LNLIB_BLOCK(R), LNLIB_MOD_BWD_BLOCKS(R))
modulated_layer_norm_bwd(const T* dy, long long lddy, const T* x, long long ldx,
                         const typename Acc<T>::type* mean, const typename Acc<T>::type* rstd,
                         const typename Acc<T>::type* weight, T* dx, long long lddx,
                         typename Acc<T>::type* dw_part, typename Acc<T>::type* db_part,
                         long long m, int d, int vec_ok, long long group, long long mods) {
    norm_bwd<T, T, R, MAXV, true, false, true>(dy, lddy, x, ldx, (const T*)0, 0, mean, rstd,
                                               weight, dx, lddx, dw_part, db_part, m, d, vec_ok,
                                               group, mods);
}

template <typename T, int R, int MAXV>
__global__ void __launch_bounds__(R, 2)
modulated_layer_norm_bwd_long(const T* dy, long long lddy, const T* x, long long ldx,
                              const typename Acc<T>::type* mean,
                              const typename Acc<T>::type* rstd,
                              const typename Acc<T>::type* weight, T* dx, long long lddx,
                              typename Acc<T>::type* dw_part, typename Acc<T>::type* db_part,
                              long long m, int d, int vec_ok, long long group, long long mods,
                              typename Acc<T>::type* c, int phase) {
    norm_bwd_long<T, T, R, MAXV, true, false, true>(dy, lddy, x, ldx, (const T*)0, 0, mean,
                                                    rstd, weight, dx, lddx, dw_part, db_part, m,
                                                    d, vec_ok, c, phase, group,
                                                    mods);
}

// The sm_90 long-row backward of the modulated LayerNorm (norm_bwd_cluster with MOD): mods
// runs of whole clusters, each cluster taking rows of one parameter row, so that its units'
// partial sums, rows p * units .. p * units + units - 1 of dw_part and db_part, are those of
// parameter row p (build.cluster_run_units).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
template <typename T, int R, int MAXV>
__global__ void __launch_bounds__(R, 1) __cluster_dims__(LNLIB_CLUSTER, 1, 1)
modulated_layer_norm_bwd_cluster(const T* dy, long long lddy, const T* x, long long ldx,
                                 const typename Acc<T>::type* mean,
                                 const typename Acc<T>::type* rstd,
                                 const typename Acc<T>::type* weight, T* dx, long long lddx,
                                 typename Acc<T>::type* dw_part, typename Acc<T>::type* db_part,
                                 long long m, int d, int vec_ok, long long group,
                                 long long mods) {
    norm_bwd_cluster<T, T, R, MAXV, true, false, true>(dy, lddy, x, ldx, (const T*)0, 0, mean,
                                                       rstd, weight, dx, lddx, dw_part, db_part,
                                                       m, d, vec_ok, group, mods);
}
#endif

// The column sums of blockIdx.y separate partial buffers (units, d) one after the other
// (gridDim.y > 1: a modulated backward's runs), into rows blockIdx.y of out (gridDim.y, d).
template <typename A>
__global__ void __launch_bounds__(32 * LNLIB_SUM_COLS)
param_grad_sum(const A* part, long long units, int d, A* out) {
    param_grad_sum_body(part + blockIdx.y * units * d, units, d, out + (long long)blockIdx.y * d);
}
