"""Rows: the contract every implementation follows, the reshaping to rows and back, the out=
protocol, and the threaded driver of the NumPy path and the compiled kernel.

The row contract. Each implementation of :data:`lnlib._backend.TABLE` defines these functions
on ``M`` rows of ``D`` values (``weight``/``bias`` flat ``(D,)`` vectors in the accumulation
dtype, :func:`accumulation_dtype`, or None for ones and zeros):

============================  ===============================================  =================
function                      arguments                                        returns
============================  ===============================================  =================
``layer_norm_forward_rows``   ``x (M, D), weight (D,), bias (D,), eps``        ``y, mean, rstd``
``layer_norm_backward_rows``  ``dy (M, D), x (M, D), mean (M,), rstd (M,)``,   ``dx, dweight,``
                              ``weight (D,)``                                  ``dbias``
``rms_norm_forward_rows``     ``x (M, D), weight (D,), eps``                   ``y, rstd``
``rms_norm_backward_rows``    ``dy (M, D), x (M, D), rstd (M,), weight (D,)``  ``dx, dweight``
============================  ===============================================  =================

``y``/``dx`` come back in the dtype of ``x``, ``mean`` and ``rstd`` in the accumulation dtype,
the parameter gradients in the accumulation dtype or wider; row ``i`` of a result depends on
row ``i`` of the inputs only. ``out``, a keyword, is None or a tuple with one entry per result:
None (the function allocates that result) or an array of exactly the result's shape and dtype,
C-contiguous and sharing memory with no input, which the function writes the result into and
returns. That is the whole out= protocol: a public function makes ``out`` with
:func:`rows_out`, and an implementation writes into :func:`out_array`; both copy what was not
written in place with :func:`written`.

The NumPy path and the compiled kernel are memory-bound (each element is read once and written
once, with a handful of flops), so :func:`run_chunks` splits the rows into one contiguous chunk
per core and runs the chunks in threads (NumPy and cffi release the GIL), and the NumPy path
works on blocks of rows small enough that its several passes over a block hit the cache. Every
row is computed by the same operations on a contiguous row, whatever block or chunk it falls
in, so a row's result is bitwise independent of the rest of the batch.
"""

import math
import numbers
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

_F32, _F64 = np.dtype(np.float32), np.dtype(np.float64)
#: Bytes of one scratch block; several of them must fit in a core's L2 cache together.
BLOCK_BYTES = 1 << 20
#: Below this many elements one thread is faster than handing work to the pool.
PARALLEL_MIN_ELEMENTS = 1 << 16

_pool = None
_pool_workers = 0
_pool_lock = threading.Lock()
#: The thread count set by set_num_threads (1 in a forked child), or None: then
#: LNLIB_NUM_THREADS, or else the cores available; and what set it.
_num_threads, _num_threads_reason = None, ""
_threads_ok = {None}  # values of LNLIB_NUM_THREADS that thread_setting accepted (None: unset)


def cpu_threads():
    """Number of cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def thread_setting():
    """``(threads, reason)``: the most threads one lnlib call runs in, and where that comes from.

    Raises
    ------
    ValueError
        ``LNLIB_NUM_THREADS`` is set to something other than a positive integer.
    """
    if _num_threads is not None:
        return _num_threads, _num_threads_reason
    raw = os.environ.get("LNLIB_NUM_THREADS", "")
    if not raw.strip():
        return cpu_threads(), "the cores this process may run on"
    value = raw.strip()
    if not value.isdigit() or int(value) < 1:
        raise ValueError(
            "LNLIB_NUM_THREADS must be a positive integer (the most threads one lnlib call "
            f"runs in), got {raw!r}"
        )
    return int(value), f"LNLIB_NUM_THREADS={raw}"


def check_thread_setting():
    """Raise ``ValueError`` for a bad ``LNLIB_NUM_THREADS``, as :func:`thread_setting` does.

    The selection point asks on every call with NumPy arrays, so that small calls, which ask
    for no threads, fail too; each value of the variable is checked once.
    """
    if _num_threads is None:
        raw = os.environ.get("LNLIB_NUM_THREADS")
        if raw not in _threads_ok:
            thread_setting()
            _threads_ok.add(raw)


def get_num_threads():
    r"""The most threads one lnlib call on the CPU runs in.

    Returns
    -------
    int
        The number given to :func:`set_num_threads` in this process; else, in a child made by
        ``os.fork`` (a ``multiprocessing`` or ``DataLoader`` worker started by fork), 1; else
        the environment variable ``LNLIB_NUM_THREADS``; else the cores this process may run
        on.

    Raises
    ------
    ValueError
        ``LNLIB_NUM_THREADS`` is not a positive integer.

    Notes
    -----
    Calls too small to gain from threads run in the calling thread whatever the setting;
    results are bitwise the same for any number of threads. The threads are lnlib's own (the
    NumPy path and the compiled kernel split the rows among them); BLAS and PyTorch have
    their own settings. :func:`lnlib.show_config` reports it. Covered in
    :ref:`sec-ch05-performance`.
    """
    return thread_setting()[0]


def set_num_threads(n):
    r"""Limit every later lnlib call in this process to ``n`` threads.

    Parameters
    ----------
    n : int
        At least 1; it replaces ``LNLIB_NUM_THREADS`` and the default (the cores available).
        More than the cores available is allowed.

    Raises
    ------
    TypeError
        ``n`` is not an integer (``bool`` included).
    ValueError
        ``n`` is less than 1.

    Notes
    -----
    Process-wide, like ``torch.set_num_threads``. A child made by ``os.fork`` starts with one
    thread whatever the parent set (as PyTorch's ``DataLoader`` workers do), until it calls
    this function itself. See :func:`get_num_threads`. Covered in
    :ref:`sec-ch05-performance`.
    """
    global _num_threads, _num_threads_reason
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"n must be an int (the most threads one call runs in), got {n!r}")
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    _num_threads, _num_threads_reason = int(n), f"lnlib.set_num_threads({int(n)})"


def _executor(workers):
    """The worker pool, with at least ``workers`` threads (made again when it has fewer)."""
    global _pool, _pool_workers
    with _pool_lock:
        if _pool is None or _pool_workers < workers:
            old, _pool_workers = _pool, max(workers, cpu_threads())
            _pool = ThreadPoolExecutor(max_workers=_pool_workers, thread_name_prefix="lnlib")
            if old is not None:
                old.shutdown(wait=False)  # its running chunks finish; it takes no new ones
        return _pool


def _forget_pool():
    """In a child made by ``os.fork()`` the parent's worker threads do not exist: drop the
    pool (without waiting for them) and its lock, so the child starts its own; and run one
    thread per call, as PyTorch's workers do (many forked workers, each with a thread per
    core, would oversubscribe the cores)."""
    global _pool, _pool_workers, _pool_lock, _num_threads, _num_threads_reason
    _pool, _pool_workers, _pool_lock = None, 0, threading.Lock()
    _num_threads, _num_threads_reason = 1, "a child made by os.fork starts with one thread"


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def _submit_all(chunk_fn, bounds, block_rows):
    """Futures for the chunks ``bounds``, or None when no thread can be started (during
    interpreter shutdown the pool refuses new work): the caller then runs them itself."""
    try:
        pool = _executor(len(bounds))
        return [pool.submit(chunk_fn, s, e, block_rows) for s, e in bounds]
    except RuntimeError:  # "cannot schedule new futures after interpreter shutdown"
        return None


def default_block_rows(n, itemsize):
    """Rows per block so that one scratch block of ``n`` columns is about BLOCK_BYTES."""
    return max(1, BLOCK_BYTES // (n * itemsize))


def run_chunks(m, n, chunk_fn, *, block_rows=None, threads=None, itemsize=4):
    """Call ``chunk_fn(start, stop, block_rows)`` on contiguous row ranges covering ``[0, m)``.

    ``threads`` defaults to :func:`get_num_threads`. The ranges are computed from ``m``,
    ``threads`` and ``block_rows`` only, and the results are returned in range order, so that
    anything combined across chunks (parameter gradients) is deterministic.
    """
    block_rows = default_block_rows(n, itemsize) if block_rows is None else int(block_rows)
    if m * n < PARALLEL_MIN_ELEMENTS:  # before asking the system for the cores (a system call)
        return [chunk_fn(0, m, block_rows)]
    threads = get_num_threads() if threads is None else int(threads)
    if threads <= 1 or m < 2 * block_rows:
        return [chunk_fn(0, m, block_rows)]
    nblocks = -(-m // block_rows)
    per = -(-nblocks // threads) * block_rows
    bounds = [(s, min(s + per, m)) for s in range(0, m, per)]
    futures = _submit_all(chunk_fn, bounds[1:], block_rows)
    results = [chunk_fn(*bounds[0], block_rows)]  # the calling thread takes the first chunk
    if futures is None:
        futures = [None] * (len(bounds) - 1)
    for f, (s, e) in zip(futures, bounds[1:]):
        # A chunk no worker has started yet (all cores busy) is run here rather than waited
        # for; the chunks are the same whoever runs them, so the results are too.
        if f is None or f.cancel():
            results.append(chunk_fn(s, e, block_rows))
        else:
            results.append(f.result())
    return results


#: Rows summed together in the accumulation dtype before a float64 total takes over.
COLUMN_GROUP_ROWS = 256


def column_group_sums(a, scale=None):
    """Sums over the rows of ``a`` (k, D), each row times ``scale[i]`` if given, per group.

    One sum (a BLAS matrix-vector product, in the dtype of ``a``) per group of
    :data:`COLUMN_GROUP_ROWS` rows; returns the list of ``(D,)`` group sums. Adding them in
    float64 with :func:`add_in_order` gives a total whose rounding error does not grow with the
    number of rows, and whose bits depend on the row count only (not on threads).
    """
    sums, ones = [], None
    for s in range(0, a.shape[0], COLUMN_GROUP_ROWS):
        e = min(s + COLUMN_GROUP_ROWS, a.shape[0])
        if scale is None:
            if ones is None:
                ones = np.ones(min(COLUMN_GROUP_ROWS, a.shape[0]), dtype=a.dtype)
            w = ones[: e - s]
        else:
            w = scale[s:e]
        sums.append(np.matmul(w, a[s:e]))
    return sums


def add_in_order(groups, n):
    """The float64 total of the ``(n,)`` arrays ``groups``, added one after the other."""
    total = np.zeros(n, dtype=np.float64)
    for g in groups:
        total += g
    return total


def as_rows(x, k):
    """View (or, if the layout requires, copy) ``x`` as a matrix: one row per normalized slice."""
    if k == 1 and x.ndim == 2:  # already rows: no reshape (a call's overhead counts on small x)
        return x
    n = math.prod(x.shape[x.ndim - k :])  # a Python int; numpy.prod takes microseconds
    return x.reshape(-1, n)


def expand_stat(stat, k):
    """Append ``k`` axes of length one so that a per-row statistic broadcasts against x."""
    return stat.reshape(stat.shape + (1,) * k)


def param_row(param, dtype, offset=0.0):
    """A per-feature parameter as a flat ``(D,)`` vector in ``dtype``, plus ``offset``.

    ``None`` stays ``None``. With a nonzero ``offset`` the result is a new array
    ``offset + param`` (the scale of a zero-centred gain); otherwise it may be a view.
    """
    if param is None:
        return None
    if param.ndim == 1 and param.dtype == dtype and not offset:  # the common case, as it is
        return param
    row = param.reshape(-1).astype(dtype, copy=False)
    return row + dtype.type(offset) if offset else row


def sum_to_shape(a, shape, dtype=None):
    """Sum the axes along which an array of ``shape`` was broadcast to ``a.shape`` away.

    Returns a new array of ``shape`` (never ``a`` itself), summed in ``dtype`` (default: the
    dtype of ``a``) without a converted copy of ``a``.
    """
    shape = tuple(shape)
    lead = a.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, n in enumerate(shape) if n == 1 and a.shape[lead + i] != 1
    )
    if not axes:
        return a.astype(a.dtype if dtype is None else dtype, copy=True)
    return a.sum(axis=axes, dtype=dtype).reshape(shape)


def contiguous_rows(a):
    """True if the 2-d array ``a`` has contiguous rows laid out forwards in memory.

    That is the layout BLAS accepts as a matrix with a leading dimension, so matrix-vector
    products (and with them the summation order) are the same as for a contiguous copy.
    """
    rows, cols = a.shape
    row_ok = a.strides[1] == a.itemsize or cols == 1
    stride = a.strides[0]
    return row_ok and (rows == 1 or (stride >= cols * a.itemsize and stride % a.itemsize == 0))


def load_block(src, scratch, dtype):
    """Return the rows ``src`` in ``dtype`` with contiguous rows, using ``scratch`` if needed."""
    if src.dtype == dtype and contiguous_rows(src):
        return src
    out = scratch[: src.shape[0]]
    np.copyto(out, src, casting="same_kind" if src.dtype.itemsize > out.dtype.itemsize else "safe")
    return out


def accumulation_dtype(dtype):
    """The dtype statistics are accumulated in: float64 for float64, float32 otherwise."""
    if not isinstance(dtype, np.dtype):
        dtype = np.dtype(dtype)
    return _F64 if dtype == _F64 else _F32


def rows_out(out, rows, inputs, xp):
    """The ``out`` of a row function, from the checked ``out`` arrays of a public function.

    ``out`` is the tuple of :func:`lnlib._validate.out_arrays`, ``rows`` the
    ``(shape, dtype)`` of each row result. An array is passed, viewed in the row shape, when
    it is C-contiguous, of the row result's dtype and shares memory with no input; the others
    are filled by :func:`written` afterwards, so a result is the same wherever it is written
    (an ``out`` that overlaps ``x`` gets the result computed from the unmodified ``x``).
    Returns None when no array is passed.
    """
    passed = [None] * len(out)
    for i, (a, (shape, dtype)) in enumerate(zip(out, rows)):
        if a is None or a.dtype != dtype or not a.flags.c_contiguous:
            continue
        if not any(b is not None and xp.may_share_memory(a, b) for b in inputs):
            # a plain ndarray view: an ndarray subclass (numpy.matrix) may not reshape to rows
            passed[i] = xp.asarray(a).reshape(shape)
    return tuple(passed) if any(p is not None for p in passed) else None


def out_array(out, i, shape, dtype, xp=np):
    """Where a row function writes result ``i``: the caller's ``out[i]``, or a new array."""
    a = None if out is None else out[i]
    return xp.empty(shape, dtype=dtype) if a is None else a


def written(out, results, passed=None):
    """``results``, each one ``out`` has an array for copied into it and replaced by it.

    A result already in its array is not copied: one that is the array (a row function that
    wrote into :func:`out_array`), or, for a public function, one whose array
    :func:`rows_out` passed down (``passed``).
    """
    if out is None:
        return results
    done = []
    for i, (a, r) in enumerate(zip(out, results)):
        if a is not None and a is not r and (passed is None or passed[i] is None):
            a[...] = r
        done.append(r if a is None else a)
    return tuple(done)


# The fused residual add (lnlib.add_norm): h = residual + x, then the norm of h.
#
# The row contract of its four ops, in every implementation (arrays (M, D) as above, dh may be
# None):
#
#   add_layer_norm_forward_rows(x, residual, weight, bias, eps, h_dtype) -> y, h, mean, rstd
#   add_layer_norm_backward_rows(dy, dh, h, mean, rstd, weight)        -> dsum, dweight, dbias
#   add_rms_norm_forward_rows(x, residual, weight, eps, h_dtype)       -> y, h, rstd
#   add_rms_norm_backward_rows(dy, dh, h, rstd, weight)                -> dsum, dweight
#
# h is residual + x added in the widest dtype of x, residual and h and rounded once to h's
# dtype; y (dtype of x) is the norm's row function on h, cast to x's dtype; dsum (dtype of h) is
# the norm's dx (dtype of h) plus dh, added in the widest dtype of the two and rounded once.

#: Bytes of h in one block of the fused add: the add writes it and the norm reads it back
#: while it is still in the core's L2 cache.
FUSED_BLOCK_BYTES = 1 << 19


def add_into(x, residual, h, xp=np):
    """``h[...] = residual + x``, added in the widest of the three dtypes, rounded once to h's.

    ``h`` may be ``residual`` itself (each element is read before it is written)."""
    wide = np.result_type(x.dtype, residual.dtype, h.dtype)
    if x.dtype == residual.dtype == h.dtype:
        return xp.add(residual, x, out=h)
    return xp.add(residual, x, out=h, dtype=wide, casting="unsafe")


def add_norm_forward_blocks(
    norm_rows, x, residual, params, eps, h_dtype, nstats, out, threads=None
):
    """The fused forward on the CPU: per block of rows the add into h, then ``norm_rows`` (an
    implementation's ``layer_norm_forward_rows`` or ``rms_norm_forward_rows``, one thread) on
    the block of h while it is in cache (``threads`` as for :func:`run_chunks`). Each row is
    computed as the unfused norm of h computes it, so y is bitwise that of the norm of h."""
    m, n = x.shape
    acc = accumulation_dtype(h_dtype)
    y, h = out_array(out, 0, (m, n), x.dtype), out_array(out, 1, (m, n), h_dtype)
    stats = [out_array(out, 2 + i, (m,), acc) for i in range(nstats)]
    same = x.dtype == h_dtype

    def chunk(start, stop, rows):
        scratch = None if same else np.empty((min(rows, stop - start), n), dtype=h_dtype)
        for i in range(start, stop, rows):
            j = min(i + rows, stop)
            hb = add_into(x[i:j], residual[i:j], h[i:j])
            yb = y[i:j] if same else scratch[: j - i]
            norm_rows(hb, *params, eps, threads=1, out=(yb, *[s[i:j] for s in stats]))
            if not same:
                np.copyto(y[i:j], yb, casting="unsafe")

    rows = max(1, FUSED_BLOCK_BYTES // (n * np.dtype(h_dtype).itemsize))
    run_chunks(m, n, chunk, block_rows=rows, threads=threads, itemsize=np.dtype(h_dtype).itemsize)
    return (y, h, *stats)


def add_norm_backward_blocks(norm_rows, dy, dh, h, stats, weight, nparams, out, threads=None):
    """The fused backward on the CPU: per block of rows the norm's backward ``norm_rows`` (one
    thread) into dsum, then dh added to the block while it is in cache. The parameter
    gradients of the blocks are added in float64 in row order (bits independent of threads).
    ``threads`` as for :func:`run_chunks`."""
    m, n = h.shape
    dsum = out_array(out, 0, (m, n), h.dtype)

    def chunk(start, stop, rows):
        parts = []
        for i in range(start, stop, rows):
            j = min(i + rows, stop)
            got = norm_rows(
                dy[i:j],
                h[i:j],
                *[s[i:j] for s in stats],
                weight,
                threads=1,
                out=(dsum[i:j],) + (None,) * nparams,
            )
            if dh is not None:
                add_into(dh[i:j], got[0], dsum[i:j])
            parts.append(got[1:])
        return parts

    rows = max(1, FUSED_BLOCK_BYTES // (n * h.itemsize))
    chunks = run_chunks(m, n, chunk, block_rows=rows, threads=threads, itemsize=h.itemsize)
    parts = [p for c in chunks for p in c]
    grads = [add_in_order([p[k] for p in parts], n) for k in range(nparams)]
    return written(out, (dsum, *grads))


def add_norm_forward_composed(norm_rows, x, residual, params, eps, h_dtype, out, xp):
    """The fused forward as two operations (the add, then ``norm_rows`` on all of h): for an
    implementation without a fused kernel."""
    h = add_into(x, residual, out_array(out, 1, x.shape, h_dtype, xp), xp)
    y, *stats = norm_rows(h, *params, eps)
    return written(out, (y.astype(x.dtype, copy=False), h, *stats))
