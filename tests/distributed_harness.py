"""Runs of the sharded LayerNorm of :mod:`lnlib.distributed` in real gloo processes, for the
tests: each rank is a process spawned by ``torch.multiprocessing``, joined with a deadline and
terminated if it passes, so none outlives the call. The workers are importable module-level
functions (spawn pickles them by name).
"""

import numpy as np

from lnlib.distributed import (
    shard_bounds,
    sharded_layer_norm,
    sharded_layer_norm_backward,
    sharded_layer_norm_forward,
)


def _init_group(rank, world_size, port, timeout_s):
    import datetime
    import os

    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _mismatch_worker(rank, world_size, port, outdir, timeout_s):
    """Each rank calls with a shard that disagrees with the others'; records the errors."""
    import json
    import os

    import torch
    import torch.distributed as dist

    _init_group(rank, world_size, port, timeout_s)
    errors = {}
    cases = {  # (rows, dtype) of this rank's x: rank 1 differs
        "rows": ((4 + rank, 3), torch.float64),
        "dtype": ((4, 3), torch.float32 if rank else torch.float64),
        "ndim": ((4, 3) if rank == 0 else (12,), torch.float64),
    }
    try:
        for name, (shape, dtype) in cases.items():
            x = torch.ones(shape, dtype=dtype)
            stats = torch.zeros(shape[0], dtype=dtype), torch.ones(shape[0], dtype=dtype)
            for which, call, args in (
                ("forward", sharded_layer_norm_forward, (x,)),
                ("backward", sharded_layer_norm_backward, (x, x, *stats)),
            ):
                try:
                    call(*args)
                    errors[f"{name}-{which}"] = None
                except ValueError as exc:
                    errors[f"{name}-{which}"] = str(exc)
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
            json.dump(errors, f)
    finally:
        dist.destroy_process_group()


def _worker(rank, world_size, port, N, D, seed, outdir, timeout_s):
    import os

    import torch
    import torch.distributed as dist

    _init_group(rank, world_size, port, timeout_s)
    try:
        x, weight, bias, dy = problem(N, D, seed)
        lo, hi = shard_bounds(D, world_size, rank)
        t = torch.from_numpy
        y, mean, rstd = sharded_layer_norm_forward(
            t(x[:, lo:hi]), t(weight[lo:hi]), t(bias[lo:hi]), eps=1e-5
        )
        dx, dweight, dbias = sharded_layer_norm_backward(
            t(dy[:, lo:hi]), t(x[:, lo:hi]), mean, rstd, t(weight[lo:hi])
        )
        # The same through autograd.
        xg, wg, bg = (
            t(a).clone().requires_grad_() for a in (x[:, lo:hi], weight[lo:hi], bias[lo:hi])
        )
        yg = sharded_layer_norm(xg, wg, bg, eps=1e-5)
        yg.backward(t(dy[:, lo:hi]))
        np.savez(
            os.path.join(outdir, f"rank{rank}.npz"),
            y=y.numpy(),
            mean=mean.numpy(),
            rstd=rstd.numpy(),
            dx=dx.numpy(),
            dweight=dweight.numpy(),
            dbias=dbias.numpy(),
            y_autograd=yg.detach().numpy(),
            dx_autograd=xg.grad.numpy(),
            dweight_autograd=wg.grad.numpy(),
            dbias_autograd=bg.grad.numpy(),
        )
    finally:
        dist.destroy_process_group()


def problem(N, D, seed):
    """The full inputs every rank builds identically (float64)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(3.0, 2.0, size=(N, D))  # (N, D), a mean far from zero on purpose
    weight = rng.normal(1.0, 0.3, size=D)  # (D,)
    bias = rng.normal(0.0, 0.3, size=D)  # (D,)
    dy = rng.normal(size=(N, D))  # (N, D)
    return x, weight, bias, dy


def free_port():
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(worker, args, world_size, timeout_s):
    """Run ``worker(rank, world_size, port, *args)`` in ``world_size`` spawned processes,
    joined with a deadline and terminated if it passes, so none outlives this call."""
    import time

    import torch.multiprocessing as mp

    port = free_port()
    ctx = mp.start_processes(
        worker, args=(world_size, port, *args), nprocs=world_size, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout_s + 30.0
    try:
        while not ctx.join(timeout=0.2):
            if time.monotonic() > deadline:
                raise TimeoutError(f"sharded LayerNorm with {world_size} ranks timed out")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
            p.join(5)
            if p.is_alive():  # pragma: no cover - a stuck process
                p.kill()
                p.join()


def run_sharded(world_size, N, D, seed, outdir, timeout_s=30.0):
    """Spawn ``world_size`` gloo processes that each run a shard; return their results.

    The processes are joined with a deadline and terminated if it passes, so no
    process outlives this call. Returns a list of dicts, one per rank.
    """
    import os

    _spawn(_worker, (N, D, seed, str(outdir), timeout_s), world_size, timeout_s)
    out = []
    for r in range(world_size):
        with np.load(os.path.join(str(outdir), f"rank{r}.npz")) as f:
            out.append({k: f[k] for k in f.files})
    return out


def run_mismatched(world_size, outdir, timeout_s=30.0):
    """Spawn ranks whose shards disagree (rows, then dtype); return each rank's errors,
    ``{case: message or None}``, as a list in rank order."""
    import json
    import os

    _spawn(_mismatch_worker, (str(outdir), timeout_s), world_size, timeout_s)
    out = []
    for r in range(world_size):
        with open(os.path.join(str(outdir), f"rank{r}.json")) as f:
            out.append(json.load(f))
    return out
