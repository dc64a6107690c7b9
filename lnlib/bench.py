r"""Benchmark of lnlib's CPU LayerNorm and RMSNorm against PyTorch, and of the steps that made
them fast.

Run ``python -m lnlib.bench`` (``--help`` for the options). For each op, shape and dtype it
times, in one process and interleaved (each repeat runs every contender once, in turn, so that
a slow moment of the machine hits all of them alike; ``--pause-ms`` sleeps before each timed
call, so that the threads of the call before have gone idle):

* ``lnlib_fwd``: :func:`lnlib.layer_norm_forward` (or :func:`lnlib.rms_norm_forward`),
  returning new arrays as torch does;
* ``torch_fwd``: ``torch.nn.functional.layer_norm`` (``rms_norm``) on the same memory (CPU,
  torch's default number of threads, no autograd);
* ``lnlib_fwdbwd``: the forward then the backward; ``lnlib_bwd``: the backward alone, from
  saved statistics;
* ``torch_fwdbwd``: the torch forward then ``backward`` through autograd, with ``x`` and the
  parameters requiring gradients;
* ``lnlib_fwd_out``, ``lnlib_fwdbwd_out``: the same lnlib calls writing into arrays reused
  from one call to the next (``out=``), so without allocating and first touching new pages;

and reports medians, the ratio torch time / lnlib time (above 1: lnlib is faster), the
effective bandwidth and its fraction of the bound. The bound is the best copy the machine
does, measured in the same run on arrays much larger than the caches: ``np.copyto`` in one
thread, split over the cores, or torch's ``Tensor.copy_``, into an existing array; the calls
with ``out=`` are held to it. Calls that return new arrays are held to the copy into a new
array (``x.copy()``), which pays for the same allocation and page faults. The table's first
line names the CPU model, the cores and the kernel's vector width.

Bytes counted are the compulsory traffic only: the forward reads ``x`` and writes ``y``
(2 x M x D elements) plus the small ``mean``/``rstd``/parameters; the forward+backward adds
reading ``dy`` and ``x`` and writing ``dx`` (5 x M x D in all). A copy reads and writes its
array once (2 x size), so the fraction of the bound says how close a call comes to doing
nothing but moving its data.

``--ops add_layer_norm,add_rms_norm`` times the residual add fused with the norm
(:mod:`lnlib.add_norm`) against lnlib's add then norm and torch's ``residual + x`` then the
norm, forward and forward+backward, each against the bytes it must move; lnlib's fused and
unfused calls also with ``out=`` (into reused arrays), which leaves out the cost of new pages.

``--steps`` times the successive optimisations of the forward (the chapter's plot): the
readable reference; the fused version with preallocated scratch and ``out=`` arguments over
the whole array in one thread; the same, row-blocked so a block stays in cache across the
passes; blocked with one thread per core; then the compiled C kernel
(``lnlib/_cpu/norms.c``, the path the public functions take when a C compiler is
available), in one thread and in one thread per core. Every variant is checked
against the reference before it is timed.

Book: Chapter 5, "Performance".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import lnlib
from lnlib import reference

DEFAULT_SHAPES = "4096x4096,32768x768"
QUICK_SHAPES = "256x1024,1024x256"


def parse_shapes(text):
    """``"4096x4096,32768x768"`` -> ``[(4096, 4096), (32768, 768)]``."""
    shapes = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"--shapes: expected items like 4096x4096, got {item!r}")
        shapes.append((int(parts[0]), int(parts[1])))
    return shapes


#: Seconds of sleep before each timed call (``--pause-ms``; default none: the calls run back to
#: back). PyTorch's OpenMP workers spin for a few milliseconds after each call, so the call
#: timed next may find one core busy; a pause of 20 ms lets them go idle, but on a shared
#: virtual machine it also times each call from a cold start. On the 2-core machine of chapter
#: 5 (``--ops layer_norm,rms_norm --shapes 4096x4096,256x1024,1024x256``, with and without
#: ``--pause-ms 20``): the 4096 x 4096 float32 LayerNorm forward returning new arrays took
#: 17.6 ms back to back and 12.2 ms after the pause (torch 30.7 and 28.5 ms), while the calls
#: on 1 MiB took 3 to 80 times longer for both sides after the pause.
PAUSE_S = 0.0


def _median_times(tasks, repeats, warmup=1, pause=None, rotate=False):
    """Run each task once per repeat, in turn, after ``pause`` seconds idle (default
    :data:`PAUSE_S`); return {name: [seconds, ...]}. With ``rotate`` the order changes from
    repeat to repeat (:func:`_orders`), so that no task is always timed right after the same
    other one (after torch's calls, whose spinning workers still hold a core)."""
    pause = PAUSE_S if pause is None else pause
    for _ in range(warmup):
        for fn in tasks.values():
            fn()
    times = {name: [] for name in tasks}
    items = list(tasks.items())
    for order in _orders(len(items), repeats, rotate):
        for name, fn in (items[j] for j in order):
            if pause > 0:
                time.sleep(pause)
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def _orders(n, repeats, rotate):
    """The order of the ``n`` tasks in each repeat: always ``0, 1, ..., n - 1``, or with
    ``rotate`` a different permutation in each repeat, drawn from a generator seeded with the
    repeat's index (the same orders in every run). A rotation of one order would keep each
    task's predecessor; random orders give each task varying predecessors."""
    if not rotate:
        return [list(range(n)) for _ in range(repeats)]
    return [[int(j) for j in np.random.default_rng(i).permutation(n)] for i in range(repeats)]


def copy_bandwidth(n_bytes, repeats, threads=None):
    """Memory-copy bandwidth in GB/s (bytes read + written / median time), several ways.

    Returns a dict with the figures of the copies into an existing array: ``np.copyto`` in
    one thread (``copy_*``), split into one contiguous chunk per thread (``copy_threads_*``,
    ``threads`` defaults to the cores available) and torch's ``Tensor.copy_`` (its own
    threads, ``torch_copy_*``); and of a copy into a new array, ``src.copy()``
    (``fresh_copy_*``), which also pays for allocating the destination and for the first
    touch of each of its pages. ``best_GBps`` is the fastest copy into an existing array,
    the bound of the benchmark; ``fresh_GBps`` the bound for a function that returns new
    arrays.
    """
    n = max(1, n_bytes // 4)
    src = np.ones(n, dtype=np.float32)
    threads = threads or lnlib_cpu_threads()
    # copy_x -> copy, copy_x_threads -> copy_threads, torch_copy_x -> torch_copy
    tasks = {name.replace("_x", ""): fn for name, fn in copies_of(src, threads).items()}
    tasks["fresh_copy"] = src.copy
    times = _median_times(tasks, repeats)
    moved = 2 * src.nbytes
    out = {"bytes": moved, "copy_threads": threads}
    for name, ts in times.items():
        out[f"{name}_s"] = statistics.median(ts)
        out[f"{name}_GBps"] = moved / out[f"{name}_s"] / 1e9
    out["best_GBps"] = max(out[f"{k}_GBps"] for k in ("copy", "copy_threads", "torch_copy"))
    out["fresh_GBps"] = out["fresh_copy_GBps"]
    return out


def lnlib_cpu_threads():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _inputs(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    m, h = shape
    x = rng.standard_normal((m, h), dtype=np.float32).astype(dtype, copy=False)  # (M, H)
    weight = (1.0 + 0.1 * rng.standard_normal(h)).astype(dtype)  # (H,)
    bias = (0.1 * rng.standard_normal(h)).astype(dtype)  # (H,)
    dy = rng.standard_normal((m, h), dtype=np.float32).astype(dtype, copy=False)  # (M, H)
    return x, weight, bias, dy


def copies_of(x, threads=None):
    """The copies of ``x`` into an existing array that bound a call on ``x``, as timed tasks.

    ``copy_x``: ``np.copyto`` in one thread; ``copy_x_threads``: split into one chunk of rows
    per thread (``threads``, default the cores available); ``torch_copy_x``: torch's
    ``Tensor.copy_`` (its own threads). The fastest is the time a forward on ``x`` cannot beat
    (it reads ``x`` and writes an array of its size).
    """
    import torch

    dst = np.empty_like(x)
    src_t, dst_t = torch.from_numpy(x), torch.from_numpy(dst)
    cores = threads or lnlib_cpu_threads()
    bounds = np.linspace(0, x.shape[0], cores + 1).astype(int)

    def threaded():
        list(
            _pool(cores).map(
                lambda i: np.copyto(dst[bounds[i] : bounds[i + 1]], x[bounds[i] : bounds[i + 1]]),
                range(cores),
            )
        )

    return {
        "copy_x": lambda: np.copyto(dst, x),
        "copy_x_threads": threaded,
        "torch_copy_x": lambda: dst_t.copy_(src_t),
    }


_POOLS = {}


def _pool(workers):
    """A thread pool of ``workers`` threads, made once per process."""
    if workers not in _POOLS:
        _POOLS[workers] = ThreadPoolExecutor(max_workers=workers)
    return _POOLS[workers]


def contenders(shape, dtype, eps=1e-5, op="layer_norm"):
    """The timed callables for one shape: lnlib and torch, forward and forward+backward.

    ``op`` is ``"layer_norm"`` or ``"rms_norm"``.
    """
    if op == "rms_norm":
        return _rms_norm_contenders(shape, dtype, eps)
    import torch
    import torch.nn.functional as F

    h = shape[1]
    x, weight, bias, dy = _inputs(shape, dtype)  # (M, H), (H,), (H,), (M, H)
    xt, wt, bt, dyt = (torch.from_numpy(a) for a in (x, weight, bias, dy))
    wg, bg = wt.clone().requires_grad_(), bt.clone().requires_grad_()
    first = lnlib.layer_norm_forward(x, weight, bias, eps=eps)
    saved = first[1:]  # mean, rstd (M,)
    fwd_out = tuple(np.empty_like(a) for a in first)  # reused: y (M, H), mean, rstd (M,)
    bwd_out = (np.empty_like(x), np.empty_like(weight), np.empty_like(bias))

    def lnlib_fwdbwd():
        _, mean, rstd = lnlib.layer_norm_forward(x, weight, bias, eps=eps)
        return lnlib.layer_norm_backward(dy, x, mean, rstd, weight)

    def lnlib_fwd_out():
        return lnlib.layer_norm_forward(x, weight, bias, eps=eps, out=fwd_out)

    def lnlib_fwdbwd_out():
        _, mean, rstd = lnlib_fwd_out()
        return lnlib.layer_norm_backward(dy, x, mean, rstd, weight, out=bwd_out)

    def torch_fwd():
        with torch.no_grad():
            return F.layer_norm(xt, (h,), wt, bt, eps)

    def torch_fwdbwd():
        wg.grad = bg.grad = None
        xg = xt.detach().requires_grad_()
        F.layer_norm(xg, (h,), wg, bg, eps).backward(dyt)
        return xg.grad, wg.grad, bg.grad

    return {
        "lnlib_fwd": lambda: lnlib.layer_norm_forward(x, weight, bias, eps=eps),
        "torch_fwd": torch_fwd,
        "lnlib_fwdbwd": lnlib_fwdbwd,
        "torch_fwdbwd": torch_fwdbwd,
        "lnlib_bwd": lambda: lnlib.layer_norm_backward(dy, x, *saved, weight),
        "lnlib_fwd_out": lnlib_fwd_out,
        "lnlib_fwdbwd_out": lnlib_fwdbwd_out,
        **copies_of(x),
    }


def _rms_norm_contenders(shape, dtype, eps):
    import torch
    import torch.nn.functional as F

    h = shape[1]
    x, weight, _, dy = _inputs(shape, dtype)  # (M, H), (H,), (M, H)
    xt, wt, dyt = (torch.from_numpy(a) for a in (x, weight, dy))
    wg = wt.clone().requires_grad_()
    first = lnlib.rms_norm_forward(x, weight, eps=eps)
    rstd = first[1]  # (M,)
    fwd_out = tuple(np.empty_like(a) for a in first)  # reused: y (M, H), rstd (M,)
    bwd_out = (np.empty_like(x), np.empty_like(weight))

    def lnlib_fwdbwd():
        return lnlib.rms_norm_backward(dy, x, lnlib.rms_norm_forward(x, weight, eps=eps)[1], weight)

    def lnlib_fwd_out():
        return lnlib.rms_norm_forward(x, weight, eps=eps, out=fwd_out)

    def lnlib_fwdbwd_out():
        return lnlib.rms_norm_backward(dy, x, lnlib_fwd_out()[1], weight, out=bwd_out)

    def torch_fwd():
        with torch.no_grad():
            return F.rms_norm(xt, (h,), wt, eps)

    def torch_fwdbwd():
        wg.grad = None
        xg = xt.detach().requires_grad_()
        F.rms_norm(xg, (h,), wg, eps).backward(dyt)
        return xg.grad, wg.grad

    return {
        "lnlib_fwd": lambda: lnlib.rms_norm_forward(x, weight, eps=eps),
        "torch_fwd": torch_fwd,
        "lnlib_fwdbwd": lnlib_fwdbwd,
        "torch_fwdbwd": torch_fwdbwd,
        "lnlib_bwd": lambda: lnlib.rms_norm_backward(dy, x, rstd, weight),
        "lnlib_fwd_out": lnlib_fwd_out,
        "lnlib_fwdbwd_out": lnlib_fwdbwd_out,
        **copies_of(x),
    }


def check(tasks, shape, dtype):
    """Run lnlib and torch once and compare y and dx: time only what has been checked.

    Returns ``(max |y - y_torch|, max |dx - dx_torch|)``; raises AssertionError if either is
    beyond the dtype's tolerance.
    """
    y_l, dx_l = tasks["lnlib_fwd"]()[0], tasks["lnlib_fwdbwd"]()[0]
    for name, want in (("lnlib_fwd_out", y_l), ("lnlib_fwdbwd_out", dx_l)):
        if not np.array_equal(tasks[name]()[0], want):
            raise AssertionError(f"{name} differs from the same call without out=")
    y_t, dx_t = tasks["torch_fwd"]().numpy(), tasks["torch_fwdbwd"]()[0].numpy()
    tol = 1e-2 if np.dtype(dtype).itemsize <= 2 else 1e-3
    err_fwd = float(np.max(np.abs(y_l.astype(np.float64) - y_t)))
    err_bwd = float(np.max(np.abs(dx_l.astype(np.float64) - dx_t)))
    if not (err_fwd < tol and err_bwd < tol):
        raise AssertionError(
            f"lnlib and torch disagree on {shape} {np.dtype(dtype).name}: "
            f"forward {err_fwd:.3g}, backward {err_bwd:.3g}"
        )
    return err_fwd, err_bwd


def report(shape, dtype, times, errors, copy, op="layer_norm"):
    """The result row of one shape: medians, ratios to torch, GB/s and fractions of the bound.

    ``copy`` is the dict of :func:`copy_bandwidth`. ``lnlib_<pass>`` (new output arrays, as
    torch returns) is compared with torch and with the copy into a new array
    (``fresh_bound_fraction``); ``lnlib_<pass>_out`` (outputs written into reused arrays with
    ``out=``) with the bound (``out_bound_fraction``): the time of the best copy of ``x``,
    timed beside it, for the forward (2 streams: read ``x``, write ``y``), 2.5 times that for
    the forward and backward (5 streams). ``copy_fraction`` is the allocating call against the
    best copy of :func:`copy_bandwidth`.
    """
    m, h = shape
    med = {k: statistics.median(v) for k, v in times.items()}
    item = np.dtype(dtype).itemsize
    stats = 2 * m * 4 + 2 * h * item  # mean, rstd (float32) and weight, bias
    bytes_fwd = 2 * m * h * item + stats
    bytes_fwdbwd = 5 * m * h * item + 2 * stats
    row = {
        "op": op,
        "shape": [m, h],
        "dtype": np.dtype(dtype).name,
        "repeats": len(next(iter(times.values()))),
        "max_abs_diff_fwd": errors[0],
        "max_abs_diff_dx": errors[1],
        "bytes_fwd": bytes_fwd,
        "bytes_fwdbwd": bytes_fwdbwd,
    }
    for k, v in med.items():
        row[f"{k}_s"] = v
        row[f"{k}_all_s"] = times[k]
    # the bound of a call on x: the best copy of x, timed beside it (2 streams: read, write)
    copy_x = row["copy_x_best_s"] = min(
        med[k] for k in ("copy_x", "copy_x_threads", "torch_copy_x")
    )
    streams = {"fwd": 2, "fwdbwd": 5}
    for kind, nbytes in (("fwd", bytes_fwd), ("fwdbwd", bytes_fwdbwd)):
        for who in ("lnlib", "torch", "lnlib_out"):
            name = f"{who}_{kind}" if who != "lnlib_out" else f"lnlib_{kind}_out"
            row[f"{name}_GBps"] = gbps = nbytes / med[name] / 1e9
            if who != "lnlib_out":
                row[f"{name}_copy_fraction"] = gbps / copy["best_GBps"]
        row[f"lnlib_{kind}_fresh_bound_fraction"] = row[f"lnlib_{kind}_GBps"] / copy["fresh_GBps"]
        row[f"lnlib_{kind}_out_bound_fraction"] = (
            streams[kind] / 2 * copy_x / med[f"lnlib_{kind}_out"]
        )
        row[f"{kind}_speedup"] = med[f"torch_{kind}"] / med[f"lnlib_{kind}"]
    return row


def bench_shape(shape, dtype, repeats, copy, eps=1e-5, op="layer_norm"):
    """Check, time and report lnlib against torch on one shape; returns the result row.

    ``copy`` is the dict of :func:`copy_bandwidth` (the bounds).
    """
    tasks = contenders(shape, dtype, eps, op)
    errors = check(tasks, shape, dtype)
    return report(shape, dtype, _median_times(tasks, repeats), errors, copy, op)


#: The fused residual add (:mod:`lnlib.add_norm`): the ops ``--ops`` takes for it, and the
#: full-size arrays each contender must move: fused forward reads x and residual and writes h
#: and y (4); unfused, the add moves 3 and the norm 2 (5). The backward reads dy, dh and h and
#: writes dsum (4) fused; unfused, the norm's backward moves 3 and the add of dh 3 (6).
FUSED_OPS = ("add_layer_norm", "add_rms_norm")
FUSED_STREAMS = {"fused_fwd": 4, "unfused_fwd": 5, "fused_fwdbwd": 8, "unfused_fwdbwd": 11}


def fused_contenders(shape, dtype, eps=1e-5, op="add_layer_norm"):
    """The timed callables of the fused residual add on one shape: lnlib fused, lnlib's add
    then norm (NumPy's ``residual + x``, then the lnlib norm; ``dx + dh`` in the backward), and
    torch's ``residual + x`` then ``F.layer_norm`` (``F.rms_norm``), forward and
    forward+backward (torch through autograd, both outputs receiving a gradient)."""
    import torch
    import torch.nn.functional as F

    rms = op == "add_rms_norm"
    d = shape[1]
    x, weight, bias, dy = _inputs(shape, dtype)  # (M, D), (D,), (D,), (M, D)
    residual, _, _, dh = _inputs(shape, dtype, seed=1)  # (M, D), (M, D)
    params = (weight,) if rms else (weight, bias)
    fwd = lnlib.add_rms_norm_forward if rms else lnlib.add_layer_norm_forward
    bwd = lnlib.add_rms_norm_backward if rms else lnlib.add_layer_norm_backward
    norm_fwd = lnlib.rms_norm_forward if rms else lnlib.layer_norm_forward
    norm_bwd = lnlib.rms_norm_backward if rms else lnlib.layer_norm_backward
    tx, tr, tdy, tdh = (torch.from_numpy(a) for a in (x, residual, dy, dh))
    tparams = [torch.from_numpy(p).clone().requires_grad_() for p in params]

    def torch_norm(h):
        if rms:
            return F.rms_norm(h, (d,), tparams[0], eps)
        return F.layer_norm(h, (d,), *tparams, eps)

    def fused_fwdbwd():
        _, h, *stats = fwd(x, residual, *params, eps=eps)
        return bwd(dy, dh, h, *stats, weight)

    def unfused_fwd():
        h = residual + x
        return (norm_fwd(h, *params, eps=eps)[0], h)

    def unfused_fwdbwd():
        h = residual + x
        _, *stats = norm_fwd(h, *params, eps=eps)
        dx, *grads = norm_bwd(dy, h, *stats, weight)
        return (dx + dh, *grads)

    def torch_fwd():
        with torch.no_grad():
            h = tr + tx
            return (torch_norm(h), h)

    def torch_fwdbwd():
        for p in tparams:
            p.grad = None
        xg, rg = tx.detach().requires_grad_(), tr.detach().requires_grad_()
        h = rg + xg
        torch.autograd.backward([torch_norm(h), h], [tdy, tdh])
        return (xg.grad, *(p.grad for p in tparams))

    return {
        "fused_fwd": lambda: fwd(x, residual, *params, eps=eps)[:2],
        "unfused_fwd": unfused_fwd,
        "torch_fwd": torch_fwd,
        "fused_fwdbwd": fused_fwdbwd,
        "unfused_fwdbwd": unfused_fwdbwd,
        "torch_fwdbwd": torch_fwdbwd,
        **_fused_out_contenders(x, residual, params, dy, dh, eps, rms),
        **copies_of(x),
    }


def _fused_out_contenders(x, residual, params, dy, dh, eps, rms):
    """The fused and unfused contenders of :func:`fused_contenders` with ``out=``: every output
    written into arrays reused from one call to the next, so that the ratio compares the
    memory passes alone, without allocating and first touching new pages."""
    fwd = lnlib.add_rms_norm_forward if rms else lnlib.add_layer_norm_forward
    bwd = lnlib.add_rms_norm_backward if rms else lnlib.add_layer_norm_backward
    norm_fwd = lnlib.rms_norm_forward if rms else lnlib.layer_norm_forward
    norm_bwd = lnlib.rms_norm_backward if rms else lnlib.layer_norm_backward
    weight = params[0]

    first = fwd(x, residual, *params, eps=eps)
    fwd_out = tuple(np.empty_like(a) for a in first)  # y, h (M, D), mean and rstd (M,)
    stats_out = fwd_out[2:]
    norm_out = (fwd_out[0], *stats_out)
    bwd_out = tuple(np.empty_like(a) for a in bwd(dy, dh, first[1], *first[2:], weight))

    def fused_fwd_out():
        return fwd(x, residual, *params, eps=eps, out=fwd_out)[:2]

    def fused_fwdbwd_out():
        _, h, *stats = fused_fwd_out() + fwd_out[2:]
        return bwd(dy, dh, h, *stats, weight, out=bwd_out)

    def unfused_fwd_out():
        h = np.add(residual, x, out=fwd_out[1])
        return (norm_fwd(h, *params, eps=eps, out=norm_out)[0], h)

    def unfused_fwdbwd_out():
        h = unfused_fwd_out()[1]
        dx, *grads = norm_bwd(dy, h, *stats_out, weight, out=bwd_out)
        return (np.add(dx, dh, out=dx), *grads)

    return {
        "fused_fwd_out": fused_fwd_out,
        "unfused_fwd_out": unfused_fwd_out,
        "fused_fwdbwd_out": fused_fwdbwd_out,
        "unfused_fwdbwd_out": unfused_fwdbwd_out,
    }


def check_fused(tasks, shape, dtype):
    """Compare the contenders once before timing: fused and unfused bitwise in y, h and dsum;
    torch within the dtype's tolerance. Returns the largest differences from torch."""
    (y, h), (yu, hu) = tasks["fused_fwd"](), tasks["unfused_fwd"]()
    ds, ds_u = tasks["fused_fwdbwd"]()[0], tasks["unfused_fwdbwd"]()[0]
    if not (np.array_equal(y, yu) and np.array_equal(h, hu) and np.array_equal(ds, ds_u)):
        raise AssertionError(f"fused and unfused lnlib differ on {shape} {np.dtype(dtype).name}")
    for kind, want in (("fwd", y), ("fwdbwd", ds)):
        for who in ("fused", "unfused"):
            if not np.array_equal(tasks[f"{who}_{kind}_out"]()[0], want):
                raise AssertionError(f"{who}_{kind}_out differs from the same call without out=")
    y_t, ds_t = tasks["torch_fwd"]()[0].numpy(), tasks["torch_fwdbwd"]()[0].numpy()
    tol = 1e-2 if np.dtype(dtype).itemsize <= 2 else 1e-3
    err_fwd = float(np.max(np.abs(y.astype(np.float64) - y_t)))
    err_bwd = float(np.max(np.abs(ds.astype(np.float64) - ds_t)))
    if not (err_fwd < tol and err_bwd < tol):
        raise AssertionError(f"lnlib and torch disagree: {err_fwd:.3g}, {err_bwd:.3g}")
    return err_fwd, err_bwd


def bench_fused_shape(shape, dtype, repeats, eps=1e-5, op="add_layer_norm"):
    """Check, time and report the fused residual add on one shape (the contenders' order
    rotating from repeat to repeat): medians, the ratios
    unfused / fused and torch / fused, and each contender's time against its bound (the best
    copy of x, timed beside it, times half its streams)."""
    tasks = fused_contenders(shape, dtype, eps, op)
    errors = check_fused(tasks, shape, dtype)
    times = _median_times(tasks, repeats, rotate=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    copy_x = min(med[k] for k in ("copy_x", "copy_x_threads", "torch_copy_x"))
    row = {"op": op, "shape": list(shape), "dtype": np.dtype(dtype).name, "repeats": repeats}
    row.update(max_abs_diff_fwd=errors[0], max_abs_diff_dsum=errors[1], copy_x_best_s=copy_x)
    for k, v in med.items():
        row[f"{k}_s"], row[f"{k}_all_s"] = v, times[k]
    itemsize = np.dtype(dtype).itemsize
    for kind in ("fwd", "fwdbwd"):
        for who in ("fused", "unfused"):
            streams = FUSED_STREAMS[f"{who}_{kind}"]
            row[f"{who}_{kind}_bytes"] = streams * shape[0] * shape[1] * itemsize
            row[f"{who}_{kind}_bound_fraction"] = streams / 2 * copy_x / med[f"{who}_{kind}"]
            row[f"{who}_{kind}_out_bound_fraction"] = (
                streams / 2 * copy_x / med[f"{who}_{kind}_out"]
            )
        row[f"{kind}_vs_unfused"] = med[f"unfused_{kind}"] / med[f"fused_{kind}"]
        row[f"{kind}_out_vs_unfused"] = med[f"unfused_{kind}_out"] / med[f"fused_{kind}_out"]
        row[f"{kind}_vs_torch"] = med[f"torch_{kind}"] / med[f"fused_{kind}"]
    return row


def format_fused(rows):
    """The fused residual add's results as a plain-text table."""
    head = (
        f"{'op':>14} {'shape':>10} {'dtype':>7} | {'pass':>7} {'fused ms':>8} {'unfused':>8} "
        f"{'torch ms':>8} | {'vs unf.':>7} {'vs torch':>8} | {'of bound':>8} | "
        f"{'out= ms':>8} {'unfused':>8} {'vs unf.':>7} {'of bound':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        tag = f"{r['op']:>14} " + "x".join(map(str, r["shape"])).rjust(10)
        for kind, label in (("fwd", "fwd"), ("fwdbwd", "fwd+bwd")):
            lines.append(
                f"{tag} {r['dtype']:>7} | {label:>7} {r[f'fused_{kind}_s'] * 1e3:8.2f} "
                f"{r[f'unfused_{kind}_s'] * 1e3:8.2f} {r[f'torch_{kind}_s'] * 1e3:8.2f} | "
                f"{r[f'{kind}_vs_unfused']:6.2f}x {r[f'{kind}_vs_torch']:7.2f}x | "
                f"{r[f'fused_{kind}_bound_fraction']:8.0%} | "
                f"{r[f'fused_{kind}_out_s'] * 1e3:8.2f} {r[f'unfused_{kind}_out_s'] * 1e3:8.2f} "
                f"{r[f'{kind}_out_vs_unfused']:6.2f}x {r[f'fused_{kind}_out_bound_fraction']:8.0%}"
            )
    lines.append(
        "vs unf. = lnlib's add then norm / fused; vs torch = torch's residual + x then the norm "
        "/ fused (all return new arrays); of bound = the best copy of x, timed beside it, times "
        "half the arrays moved (4 fwd, 8 fwd+bwd), / the fused time; out= columns: the same "
        "calls writing into arrays reused from call to call"
    )
    return "\n".join(lines)


def step_variants(x, weight, bias, eps):
    """The successive forward implementations of the chapter, as (name, callable) pairs.

    The NumPy steps, then the compiled kernel (one pass from memory per row) in one thread and
    in one thread per core, when it is available on this machine.
    """
    from lnlib._cpu import c_kernel, numpy_path

    _forward_numpy = numpy_path.layer_norm_forward_rows
    _forward_kernel = c_kernel.layer_norm_forward_rows
    m = x.shape[0]
    steps = [
        ("reference (readable)", lambda: reference.layer_norm_forward(x, weight, bias, eps=eps)),
        (
            "fused, out= (1 thread)",
            lambda: _forward_numpy(x, weight, bias, eps, block_rows=m, threads=1),
        ),
        ("row-blocked (1 thread)", lambda: _forward_numpy(x, weight, bias, eps, threads=1)),
        ("row-blocked + threads", lambda: _forward_numpy(x, weight, bias, eps)),
    ]
    if c_kernel.available()[0] and x.dtype in (np.float32, np.float64):
        out = (np.empty_like(x), np.empty(m, x.dtype), np.empty(m, x.dtype))  # reused
        cores = lnlib_cpu_threads()

        def ordinary_stores():
            with c_kernel.ordinary_stores():
                return _forward_kernel(x, weight, bias, eps, threads=cores, out=out)

        steps += [
            ("C kernel (1 thread)", lambda: _forward_kernel(x, weight, bias, eps, threads=1)),
            ("C kernel + threads", lambda: _forward_kernel(x, weight, bias, eps, threads=cores)),
            ("C kernel + threads, out=, ordinary stores", ordinary_stores),
            (
                "C kernel + threads, out=",
                lambda: _forward_kernel(x, weight, bias, eps, threads=cores, out=out),
            ),
        ]
    return steps


def bench_steps(shape, dtype, repeats, copy_GBps, eps=1e-5):
    """Time each optimisation step of the forward on one shape (checked first)."""
    import torch
    import torch.nn.functional as F

    m, h = shape
    x, weight, bias, _ = _inputs(shape, dtype)
    xt, wt, bt = (torch.from_numpy(a) for a in (x, weight, bias))
    y_ref = reference.layer_norm_forward(x, weight, bias, eps=eps)[0].astype(np.float64)
    tasks = {}
    errors = {}
    for name, fn in step_variants(x, weight, bias, eps):
        errors[name] = float(np.max(np.abs(fn()[0].astype(np.float64) - y_ref)))
        if errors[name] > 1e-3:
            raise AssertionError(f"step {name!r} differs from the reference by {errors[name]}")
        tasks[name] = fn

    def torch_fwd():
        with torch.no_grad():
            return F.layer_norm(xt, (h,), wt, bt, eps)

    tasks["torch F.layer_norm"] = torch_fwd
    times = _median_times(tasks, repeats)
    nbytes = 2 * m * h * np.dtype(dtype).itemsize
    base = statistics.median(times["reference (readable)"])
    steps = []
    for name, ts in times.items():
        med = statistics.median(ts)
        steps.append(
            {
                "step": name,
                "time_s": med,
                "GBps": nbytes / med / 1e9,
                "copy_fraction": nbytes / med / 1e9 / copy_GBps,
                "speedup_vs_reference": base / med,
                "max_abs_err_vs_reference": errors.get(name),
            }
        )
    return {"shape": [m, h], "dtype": np.dtype(dtype).name, "repeats": repeats, "steps": steps}


def _implementations():
    """The CPU implementations to compare: the compiled kernel where available, NumPy."""
    from lnlib._cpu import c_kernel

    return (["kernel"] if c_kernel.available()[0] else []) + ["numpy"]


def long_row_rstd_errors(log2_n, seed=0, eps=1e-5):
    """Relative error of float32 rstd on one row of 2**log2_n values from N(3, 1), vs float64.

    Returns ``{implementation: error}`` for lnlib's CPU implementations and ``torch``, and
    ``"float32 nearest"``: the error of the exact rstd rounded to float32 (the best possible).
    """
    import torch

    x = (3 + np.random.default_rng(seed).standard_normal((1, 1 << log2_n))).astype(np.float32)
    x64 = x.astype(np.float64)
    exact = 1 / np.sqrt(np.mean((x64 - x64.mean()) ** 2) + eps)
    got = {"float32 nearest": np.float32(exact)}
    for name in _implementations():
        with lnlib.use_implementation(name):
            got[name] = lnlib.layer_norm_forward(x, eps=eps)[2][0]
    got["torch"] = torch.native_layer_norm(torch.from_numpy(x), (x.shape[1],), None, None, eps)[
        2
    ].item()
    return {k: abs(float(v) - exact) / exact for k, v in got.items()}


def long_column_dbias_errors(log2_m, dy_value=1.3, n=4, seed=0):
    """Largest relative error of float32 dbias over 2**log2_m rows of ``dy = dy_value``."""
    import torch

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1 << log2_m, n)).astype(np.float32)  # (M, D)
    dy = np.full(x.shape, dy_value, dtype=np.float32)  # (M, D)
    exact = dy.astype(np.float64).sum(0)  # (D,)
    got = {}
    for name in _implementations():
        with lnlib.use_implementation(name):
            _, mean, rstd = lnlib.layer_norm_forward(x)
            got[name] = lnlib.layer_norm_backward(dy, x, mean, rstd)[2]
    bias = torch.zeros(n, requires_grad=True)
    torch.nn.functional.layer_norm(torch.from_numpy(x), (n,), None, bias).backward(
        torch.from_numpy(dy)
    )
    got["torch"] = bias.grad.numpy()
    return {k: float(np.max(np.abs(v - exact) / np.abs(exact))) for k, v in got.items()}


def accuracy(log2_lengths=(22, 24), log2_rows=20):
    """The accuracy figures of issue 8: long-row rstd and long-column dbias, float32."""
    rows = [
        {"case": f"rstd, one row of 2^{k} values N(3, 1)", **long_row_rstd_errors(k)}
        for k in log2_lengths
    ]
    rows.append(
        {"case": f"dbias, 2^{log2_rows} rows of dy = 1.3", **long_column_dbias_errors(log2_rows)}
    )
    return rows


def format_accuracy(rows):
    """The accuracy figures as a plain-text table of relative errors."""
    names = [k for k in rows[0] if k != "case"]
    lines = [f"{'float32 relative error vs float64':<40}" + "".join(f"{n:>17}" for n in names)]
    for row in rows:
        lines.append(
            f"{row['case']:<40}" + "".join(f"{row.get(n, float('nan')):17.2e}" for n in names)
        )
    return "\n".join(lines)


def thread_crossover(sizes=(1 << 19, 1 << 20, 1 << 21), repeats=41, width=1024):
    """The compiled LayerNorm in one thread and in every core, interleaved, per size and dtype.

    The measurement behind ``lnlib._cpu.c_kernel.PARALLEL_MIN_BYTES`` (below it a call runs in
    the calling thread). Returns rows of ``dtype``, ``elements``, ``bytes`` of ``x`` and the
    median seconds of the forward and the backward with ``threads=1`` and with all cores.
    """
    from lnlib._cpu import c_kernel

    if not c_kernel.available()[0]:
        return []
    cores, rows = lnlib_cpu_threads(), []
    for dtype in (np.float16, np.float32, np.float64):
        acc = np.float64 if dtype == np.float64 else np.float32
        for size in sizes:
            x, _, _, dy = _inputs((size // width, width), dtype)
            w, b = np.ones(width, acc), np.zeros(width, acc)
            mean, rstd = c_kernel.layer_norm_forward_rows(x, w, b, 1e-5)[1:]
            tasks = _crossover_tasks(c_kernel, (x, dy, w, b, mean, rstd), cores)
            med = {k: statistics.median(v) for k, v in _median_times(tasks, repeats).items()}
            rows.append(
                {
                    "dtype": np.dtype(dtype).name,
                    "elements": size,
                    "bytes": x.nbytes,
                    "cores": cores,
                    **med,
                }
            )
    return rows


def _crossover_tasks(kernel, arrays, cores):
    """The forward and backward in one thread and in ``cores`` threads, as timed tasks."""
    x, dy, w, b, mean, rstd = arrays
    tasks = {}
    for t in (1, cores):
        tasks[f"fwd_{t}"] = lambda t=t: kernel.layer_norm_forward_rows(x, w, b, 1e-5, threads=t)
        tasks[f"bwd_{t}"] = lambda t=t: kernel.layer_norm_backward_rows(
            dy, x, mean, rstd, w, threads=t
        )
    return tasks


def format_crossover(rows):
    """The thread crossover as a plain-text table (microseconds)."""
    lines = ["LayerNorm kernel, one thread against all cores (us, medians, interleaved)"]
    for r in rows:
        c = r["cores"]
        lines.append(
            f"{r['dtype']:>8} {r['elements'] // 1024:6d} K elements "
            f"{r['bytes'] / 2**20:5.1f} MiB | "
            f"fwd {r['fwd_1'] * 1e6:8.0f} / {r[f'fwd_{c}'] * 1e6:8.0f} | "
            f"bwd {r['bwd_1'] * 1e6:8.0f} / {r[f'bwd_{c}'] * 1e6:8.0f}"
        )
    return "\n".join(lines)


def machine_info():
    import torch

    return {
        "platform": platform.platform(),
        "processor": platform.processor(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_threads": lnlib_cpu_threads(),
        "cpu_model": _cpu_model(),
        "lnlib_cpu_path": _cpu_path(),
    }


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_path():
    from lnlib._cpu import c_kernel

    info = c_kernel.info()
    if not info["kernel"]:
        return f"NumPy ({info['reason']})"
    return f"compiled C kernel ({info['version']} version, {info['vector_bytes']}-byte vectors)"


def format_table(results, copy, machine=None):
    """The comparison as a plain-text table (with the machine's CPU and the bounds)."""
    head = (
        f"{'op':>10} {'shape':>10} {'dtype':>7} | {'pass':>7} {'lnlib ms':>8} {'torch ms':>8} "
        f"{'speedup':>7} {'of fresh':>8} | {'out= ms':>7} {'GB/s':>6} {'of bound':>8}"
    )
    lines = []
    if machine:
        lines.append(
            f"CPU: {machine['cpu_model']}, {machine['cpu_threads']} cores; lnlib: "
            f"{machine['lnlib_cpu_path']}; torch {machine['torch']}, "
            f"{machine['torch_threads']} threads"
        )
    lines += [
        f"copy into an existing array: np.copyto {copy['copy_GBps']:.2f} GB/s, "
        f"{copy['copy_threads']} threads {copy['copy_threads_GBps']:.2f} GB/s, torch copy_ "
        f"{copy['torch_copy_GBps']:.2f} GB/s; bound = best: {copy['best_GBps']:.2f} GB/s",
        f"copy into a new array (x.copy(): allocation and page faults included): "
        f"{copy['fresh_GBps']:.2f} GB/s = fresh bound",
        head,
        "-" * len(head),
    ]
    for r in results:
        tag = f"{r.get('op', 'layer_norm'):>10} " + "x".join(map(str, r["shape"])).rjust(10)
        for kind, label in (("fwd", "fwd"), ("fwdbwd", "fwd+bwd")):
            lines.append(
                f"{tag} {r['dtype']:>7} | {label:>7} {r[f'lnlib_{kind}_s'] * 1e3:8.2f} "
                f"{r[f'torch_{kind}_s'] * 1e3:8.2f} {r[f'{kind}_speedup']:6.2f}x "
                f"{r[f'lnlib_{kind}_fresh_bound_fraction']:8.0%} | "
                f"{r[f'lnlib_{kind}_out_s'] * 1e3:7.2f} {r[f'lnlib_{kind}_out_GBps']:6.2f} "
                f"{r[f'lnlib_{kind}_out_bound_fraction']:8.0%}"
            )
    lines.append(
        "speedup = torch ms / lnlib ms (both return new arrays); of fresh = lnlib's bandwidth / "
        "the copy into a new array; out= = lnlib writing into reused arrays; of bound = the "
        "best copy of x, timed beside it, / that time (x 2.5 for fwd+bwd: 5 arrays moved, not 2)"
    )
    return "\n".join(lines)


def format_steps(steps_results):
    lines = []
    for s in steps_results:
        lines.append(f"steps on {'x'.join(map(str, s['shape']))} {s['dtype']}:")
        for st in s["steps"]:
            lines.append(
                f"  {st['step']:<26} {st['time_s'] * 1e3:9.2f} ms "
                f"{st['GBps']:7.2f} GB/s {st['copy_fraction']:6.0%} of copy "
                f"{st['speedup_vs_reference']:6.2f}x"
            )
    return "\n".join(lines)


def run(
    shapes,
    dtypes,
    repeats,
    *,
    steps=False,
    copy_bytes=1 << 28,
    copy_repeats=None,
    ops=("layer_norm",),
    pause_s=None,
):
    """Run the benchmark and return the results as a JSON-ready dict (``pause_s``: the idle
    seconds before each timed call, default :data:`PAUSE_S`)."""
    global PAUSE_S
    before, PAUSE_S = PAUSE_S, PAUSE_S if pause_s is None else pause_s
    try:
        copy = copy_bandwidth(copy_bytes, copy_repeats or repeats)
        out = {"machine": machine_info(), "copy": copy, "results": [], "steps": [], "fused": []}
        out["pause_s"] = PAUSE_S
        for dtype in dtypes:
            for shape in shapes:
                for op in ops:
                    if op in FUSED_OPS:
                        out["fused"].append(bench_fused_shape(shape, dtype, repeats, op=op))
                    else:
                        out["results"].append(bench_shape(shape, dtype, repeats, copy, op=op))
                if steps and dtype == np.float32:  # the chapter's figure: float32
                    out["steps"].append(bench_steps(shape, dtype, repeats, copy["best_GBps"]))
    finally:
        PAUSE_S = before
    return out


def _parser():
    """The command line of ``python -m lnlib.bench`` (``--gpu`` is handled before it)."""
    p = argparse.ArgumentParser(prog="python -m lnlib.bench", description=__doc__.split("\n")[0])
    p.add_argument(
        "--shapes",
        default=None,
        help=f"comma-separated MxH (default {DEFAULT_SHAPES}; --quick: {QUICK_SHAPES})",
    )
    p.add_argument("--dtypes", default="float32", help="comma-separated (default float32)")
    p.add_argument(
        "--ops",
        default="layer_norm",
        help="comma-separated, of layer_norm, rms_norm and the fused residual add "
        "add_layer_norm, add_rms_norm (default layer_norm)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="interleaved repeats per contender (default 21; --quick: 3)",
    )
    p.add_argument(
        "--steps",
        action="store_true",
        help="also time the successive optimisation steps of the float32 forward",
    )
    p.add_argument("--out", default=None, help="write the results as JSON to this file")
    p.add_argument(
        "--pause-ms",
        type=float,
        default=PAUSE_S * 1e3,
        help=f"idle milliseconds before each timed call (default {PAUSE_S * 1e3:g}: none), so "
        "that the threads of the call before (torch's spinning OpenMP workers) are idle",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="small shapes, few repeats, a small copy: a smoke run of seconds",
    )
    p.add_argument(
        "--threads",
        action="store_true",
        help="only time the kernel in one thread against all cores at sizes around the "
        "threshold below which a call stays in one thread",
    )
    p.add_argument(
        "--accuracy",
        action="store_true",
        help="only print the float32 accuracy on long rows and columns (issue 8)",
    )
    return p


def main(argv=None):
    args = sys.argv[1:] if argv is None else list(argv)
    if "--gpu" in args:  # the GPU benchmark has its own options: lnlib/bench_gpu.py
        from . import bench_gpu

        return bench_gpu.main([a for a in args if a != "--gpu"])
    p = _parser()
    args = p.parse_args(argv)
    if args.threads:
        rows = thread_crossover()
        print(format_crossover(rows))
        return {"threads": rows}
    if args.accuracy:
        rows = accuracy()
        print(format_accuracy(rows))
        return {"accuracy": rows}

    shapes = parse_shapes(args.shapes or (QUICK_SHAPES if args.quick else DEFAULT_SHAPES))
    dtypes = [np.dtype(d.strip()) for d in args.dtypes.split(",")]
    for d in dtypes:
        if d.kind != "f":
            p.error(f"--dtypes: expected floating dtypes, got {d}")
    ops = [o.strip() for o in args.ops.split(",")]
    if not set(ops) <= {"layer_norm", "rms_norm", *FUSED_OPS}:
        p.error(f"--ops: expected layer_norm, rms_norm, {', '.join(FUSED_OPS)}, got {args.ops!r}")
    repeats = args.repeats or (3 if args.quick else 21)
    if repeats < 1:
        p.error("--repeats: expected a positive number")
    copy_bytes = (1 << 26) if args.quick else (1 << 28)
    if args.pause_ms < 0:
        p.error("--pause-ms: expected a number >= 0")
    result = run(
        shapes,
        dtypes,
        repeats,
        steps=args.steps,
        copy_bytes=copy_bytes,
        ops=ops,
        pause_s=args.pause_ms / 1e3,
    )
    result["command"] = "python -m lnlib.bench " + " ".join(sys.argv[1:] if argv is None else argv)
    if result["results"]:
        print(format_table(result["results"], result["copy"], result["machine"]))
    if result["fused"]:
        print(format_fused(result["fused"]))
    if result["steps"]:
        print(format_steps(result["steps"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
