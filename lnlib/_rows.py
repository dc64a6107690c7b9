"""Row-blocked, multi-threaded driver for the NumPy fast paths of the row-wise norms.

LayerNorm and RMSNorm are memory-bound: each element is read once and written once, and the
arithmetic is a handful of flops. The fast paths therefore

* work on blocks of rows small enough that the several passes NumPy makes over a block (sum,
  centre, square, scale, ...) hit the CPU cache instead of main memory;
* reuse preallocated scratch blocks and ``out=`` arguments, so no temporary is allocated per
  block;
* split the rows into one contiguous chunk per core and run the chunks in threads: NumPy
  releases the GIL inside its loops, so the chunks really run in parallel.

Every row is computed by the same sequence of NumPy calls on a contiguous row, whatever block or
chunk it falls in, so a row's result is bitwise independent of the rest of the batch.
"""

import math
import numbers
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

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


def direct_out(rows_fn, out, row_shapes, inputs, xp):
    """The ``out=`` keyword for a row function: the out arrays it can write in place.

    ``out`` is the checked tuple of :func:`lnlib._validate.out_arrays` (or None); a row function
    that writes results into given arrays lists their positions in its attribute
    ``writes_out``. An array is written in place
    when it is C-contiguous and shares no memory with an input; the others are filled by
    :func:`fill_out` afterwards, so a result is the same wherever it is written (an ``out``
    that overlaps ``x`` gets the result computed from the unmodified ``x``).
    Returns ``(kwargs, direct)``: the keyword arguments for the call, and per result whether it
    was written in place.
    """
    if out is None:
        return {}, None
    writes = getattr(rows_fn, "writes_out", ())
    direct = tuple(
        a is not None
        and i in writes
        and a.flags.c_contiguous
        and not any(b is not None and xp.may_share_memory(a, b) for b in inputs)
        for i, a in enumerate(out)
    )
    if not any(direct):
        return {}, direct
    # plain ndarray views: an ndarray subclass (numpy.matrix) may not reshape to rows
    views = tuple(
        xp.asarray(a).reshape(s) if d else None for a, s, d in zip(out, row_shapes, direct)
    )
    return {"out": views}, direct


def fill_out(out, direct, results):
    """The results to return: each given ``out`` array, holding its result, or the result."""
    if out is None:
        return results
    filled = []
    for a, d, r in zip(out, direct, results):
        if a is not None and not d:
            a[...] = r
        filled.append(r if a is None else a)
    return tuple(filled)
