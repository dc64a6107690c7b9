r"""LayerNorm with the hidden dimension sharded across processes.

In Megatron-style tensor parallelism the input of a LayerNorm is replicated on
every rank (or, with sequence parallelism, split along the sequence), so each
rank holds whole rows: the forward and ``dx`` need no communication (with
sequence parallelism the ``weight`` and ``bias`` gradients, each rank's sum
over its part of the sequence, are still all-reduced over the tensor-parallel
group). The hidden axis of a row is
split only where activations stay sharded by features between layers (rows too
long for one device, say): rank ``k`` then holds ``x[:, cols_k]`` and the
matching slices of ``weight`` and ``bias``, and no process sees a whole row.
LayerNorm needs two row statistics, so the ranks exchange *summaries* of their
pieces instead of the pieces themselves.

Forward. Each rank computes, per row, the count ``n_k`` of its columns, the
mean ``m_k`` of its piece and the sum of squared deviations from that mean,
``M2_k`` (two passes over its piece). The summaries are combined with the
parallel merge of Chan, Golub and LeVeque (1983), exact in real arithmetic,

.. math::

    n = n_a + n_b,\qquad \delta = m_b - m_a,\qquad
    m = m_a + \delta\,\frac{n_b}{n},\qquad
    M_2 = M_{2,a} + M_{2,b} + \delta^2\,\frac{n_a n_b}{n},

applied in rank order, so the row variance is ``M2 / D``. Nothing like
``mean(x^2) - mean(x)^2`` is formed, so there is no catastrophic cancellation; but
in floating point the merge is less accurate than a two-pass variance over the
whole row when the mean is large against the spread: the difference of two
rounded means, ``delta``, carries an error of the order of the rounding of the
means, which enters ``M2`` to first order (float32 rows of mean 1000 in 8
shards: about 1e-6 relative, against about 1e-7 for two passes; chapter 5's
notebook prints both). Float64 inputs are merged in float64.

We gather every rank's ``(m_k, M2_k)`` with one ``all_gather`` and let every
rank merge them in the same fixed order, rather than ``all_reduce`` the sums:
the merge is then the same arithmetic on the same numbers on every rank, so all
ranks hold bit-identical ``mean`` and ``rstd``, independent of how the backend
orders a reduction, and one communication round suffices (the alternative,
``all_reduce`` of the row sum and then of the centred squares, needs two
rounds, one after the other). The counts are the shard widths, the same for
every row, so they are gathered once per call, not per row.

Bytes per row. Each rank contributes two numbers per row (8 bytes each in
float64, 4 in float32) however wide the row is; gathering whole rows
instead would move ``D / P`` values per rank and row. The backward needs two
more row sums per rank, ``sum(g)`` and ``sum(g * xhat)`` with
``g = dy * weight``.

Backward. With ``xhat = (x - mean) * rstd`` and ``g = dy * weight``,

.. math::

    dx = \mathrm{rstd}\,\bigl(g - \overline{g} - \hat{x}\,\overline{g\hat{x}}\bigr),

where the bars are means over the *whole* row: each rank sums its piece, the
partial sums are gathered and added in rank order. ``dweight`` and ``dbias``
for the local slice need no communication.

:func:`sharded_layer_norm` wraps the two in a ``torch.autograd.Function`` for use in a model.

Covered in :ref:`sec-ch05-sharded`.
"""

from __future__ import annotations

import functools

import numpy as np

from ._rows import accumulation_dtype
from .formulas import layer_norm_dx

__all__ = [
    "partial_moments",
    "merge_moments",
    "sharded_layer_norm",
    "sharded_layer_norm_forward",
    "sharded_layer_norm_backward",
    "shard_bounds",
]


def partial_moments(x):
    r"""Per-row count, mean and sum of squared deviations of a shard.

    Parameters
    ----------
    x : ndarray, shape (N, D_k), floating
        One shard of the rows (``D_k`` of the ``D`` columns).

    Returns
    -------
    count : int
        ``D_k``.
    mean : ndarray, shape (B,)
        Row means of the shard, in float64 for float64 input, else float32.
    m2 : ndarray, shape (B,)
        :math:`\sum_j (x_j - \text{mean})^2` per row (two passes).

    Notes
    -----
    Covered in :ref:`sec-ch05-sharded`.
    """
    acc = accumulation_dtype(x.dtype)
    xa = np.asarray(x, dtype=acc)  # (N, D_k)
    mean = xa.mean(axis=-1)  # (B,)
    xc = xa - mean[:, None]  # (N, D_k)
    m2 = np.einsum("ij,ij->i", xc, xc)  # (B,)
    return x.shape[-1], mean, m2


def merge_moments(counts, means, m2s):
    r"""Combine per-shard moments with Chan's parallel merge (exact in real arithmetic).

    .. math::

        n = n_a + n_b,\quad \delta = m_b - m_a,\quad
        m = m_a + \delta n_b / n,\quad
        M_2 = M_{2,a} + M_{2,b} + \delta^2 n_a n_b / n

    The shards are merged left to right in the order given, so the result is
    deterministic: the same inputs in the same order give the same bits.

    Parameters
    ----------
    counts : sequence of int, length P
        Number of elements in each shard (positive).
    means : sequence of arrays, each of shape (B,)
        Mean of each shard, per row.
    m2s : sequence of arrays, each of shape (B,)
        Sum of squared deviations from the shard mean, per row.

    Returns
    -------
    count : int
        Total number of elements, the sum of ``counts``.
    mean : ndarray, shape (B,)
        Mean of the merged rows.
    m2 : ndarray, shape (B,)
        Sum of squared deviations of the merged rows; the variance (biased) is
        ``m2 / count``.

    Raises
    ------
    ValueError
        Empty input, lengths that differ, or a count that is not positive.

    Notes
    -----
    T. F. Chan, G. H. Golub and R. J. LeVeque, "Algorithms for computing the sample
    variance: analysis and recommendations", The American Statistician 37(3), 1983.
    Covered in :ref:`sec-ch05-numerics` and :ref:`sec-ch05-sharded`.
    """
    counts = [int(c) for c in counts]
    if not counts:
        raise ValueError("counts: expected at least one shard, got none")
    if len(means) != len(counts) or len(m2s) != len(counts):
        raise ValueError(
            f"means, m2s: expected {len(counts)} entries each (one per count), "
            f"got {len(means)} and {len(m2s)}"
        )
    if min(counts) <= 0:
        raise ValueError(f"counts: expected positive shard sizes, got {counts}")
    n = counts[0]
    mean = np.array(means[0], copy=True)
    m2 = np.array(m2s[0], copy=True)
    for nb, mb, m2b in zip(counts[1:], means[1:], m2s[1:]):
        total = n + nb
        delta = mb - mean
        mean = mean + delta * (nb / total)
        m2 = m2 + m2b + delta * delta * (n * nb / total)
        n = total
    return n, mean, m2


def shard_bounds(D, world_size, rank):
    """Columns ``[start, stop)`` of one rank when a row's columns are split across ranks.

    The split is as even as possible (the first ``D % world_size`` ranks get one extra
    column), like ``np.array_split``.

    Parameters
    ----------
    D : int
        D, the number of columns (features) of a whole row.
    world_size : int
        Number of ranks P.
    rank : int
        This rank, ``0 <= rank < world_size``.

    Returns
    -------
    start, stop : int
        This rank's columns are ``x[:, start:stop]``.

    Notes
    -----
    Covered in :ref:`sec-ch05-sharded`.
    """
    base, extra = divmod(D, world_size)
    start = rank * base + min(rank, extra)
    stop = start + base + (1 if rank < extra else 0)
    return start, stop


#: dtype codes exchanged between ranks before any data (float16, float32, float64, other).
_DTYPE_CODES = {"float16": 16, "float32": 32, "float64": 64}


def _agree(x, group, what, dy=None):
    """Exchange (ndim, rows, width, dtype) of every rank's shard before any collective on data.

    Every rank receives the same table, so when the ranks disagree on the number of rows or
    on the dtype, or one of them has a bad shape, all of them raise the same ``ValueError``,
    naming the mismatch, instead of letting a collective on mismatched buffers abort one
    process, mix up rows, or wait forever for a rank that failed alone.

    Returns the list of shard widths, in rank order.
    """
    import torch

    rows, width = (x.shape[0], x.shape[1]) if x.ndim == 2 else (-1, -1)
    dy_ok = dy is None or tuple(dy.shape) == tuple(x.shape)
    code = _DTYPE_CODES.get(str(x.dtype).removeprefix("torch."), 0)
    local = torch.tensor([[x.ndim, rows, width, code, int(dy_ok)]], dtype=torch.int64)
    table = [[int(v) for v in t[0]] for t in _gather_rows(local, group)]

    def ranks(col, name=lambda v: v):
        return ", ".join(f"rank {r}: {name(t[col])}" for r, t in enumerate(table))

    names = {16: "float16", 32: "float32", 64: "float64", 0: "another dtype"}
    if any(t[0] != 2 for t in table):
        raise ValueError(
            f"{what}: every rank must pass a 2-D (N, D_k) tensor; dimensions ({ranks(0)})"
        )
    if not all(t[4] for t in table):
        raise ValueError(
            f"dy: must have the shape of x on every rank; it differs on rank(s) "
            f"{[r for r, t in enumerate(table) if not t[4]]}"
        )
    if len({t[1] for t in table}) > 1:
        raise ValueError(
            f"{what}: the ranks hold different numbers of rows ({ranks(1)}); "
            "every rank must hold the same rows, split by columns"
        )
    if len({t[3] for t in table}) > 1:
        raise ValueError(
            f"{what}: the ranks hold different dtypes ({ranks(3, names.get)}); "
            "every rank must use one dtype"
        )
    return [t[2] for t in table]


def _gather_rows(local, group):
    """all_gather a (N, k) float tensor; return the list of P tensors in rank order."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    out = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(out, local.contiguous(), group=group)
    return out


def sharded_layer_norm_forward(x, weight=None, bias=None, *, eps=1e-5, group=None):
    r"""Forward of LayerNorm over a last axis sharded across the ranks of ``group``.

    Parameters
    ----------
    x : torch.Tensor, shape (N, D_k), float32 or float64, CPU
        This rank's columns of the rows.
    weight, bias : torch.Tensor of shape (D_k,) or None
        This rank's slices of the affine parameters.
    eps : float, default 1e-5
        Added to the variance inside the square root.
    group : torch.distributed process group or None
        The ranks that share the rows (None: the default group).

    Returns
    -------
    y : torch.Tensor, shape (N, D_k)
        This rank's columns of the output.
    mean, rstd : torch.Tensor, shape (B,)
        Statistics of the whole rows, bit-identical on every rank.

    Notes
    -----
    Communication: one ``all_gather`` of ``(mean_r, M2_r)``, 2 numbers per row
    per rank, plus one of the shard widths. Covered in :ref:`sec-ch05-sharded`.
    """
    import torch

    counts = _agree(x, group, "x")
    xn = x.detach().cpu().numpy()
    _, mean_r, m2_r = partial_moments(xn)
    local = torch.from_numpy(np.stack([mean_r, m2_r], axis=1))  # (N, 2)
    parts = [p.numpy() for p in _gather_rows(local, group)]
    D, mean, m2 = merge_moments(counts, [p[:, 0] for p in parts], [p[:, 1] for p in parts])
    rstd = 1.0 / np.sqrt(m2 / D + eps)  # (B,)
    acc = mean.dtype
    y = (xn.astype(acc, copy=False) - mean[:, None]) * rstd[:, None]  # (N, D_k)
    if weight is not None:
        y = y * weight.detach().cpu().numpy().astype(acc, copy=False)
    if bias is not None:
        y = y + bias.detach().cpu().numpy().astype(acc, copy=False)
    return (
        torch.from_numpy(y.astype(xn.dtype, copy=False)),
        torch.from_numpy(mean),
        torch.from_numpy(rstd),
    )


def sharded_layer_norm_backward(dy, x, mean, rstd, weight=None, *, group=None):
    r"""Backward of :func:`sharded_layer_norm_forward`.

    Parameters
    ----------
    dy, x : torch.Tensor, shape (N, D_k)
        This rank's columns of the output gradient and of the input.
    mean, rstd : torch.Tensor, shape (B,)
        As returned by the forward.
    weight : torch.Tensor of shape (D_k,) or None
        This rank's slice of the forward gain (None: ones).
    group : torch.distributed process group or None
        The ranks that share the rows (None: the default group).

    Returns
    -------
    dx : torch.Tensor, shape (N, D_k)
        Gradient with respect to this rank's columns of ``x``.
    dweight, dbias : torch.Tensor, shape (D_k,)
        Gradients of this rank's slices (of a weight of ones and a bias of
        zeros when none was used).

    Notes
    -----
    Communication: one ``all_gather`` of ``(sum g, sum g*xhat)``, 2 numbers
    per row per rank, added in rank order on every rank. Covered in :ref:`sec-ch05-sharded`.
    """
    import torch

    D = sum(_agree(x, group, "x", dy=dy))
    xn = x.detach().cpu().numpy()
    acc = accumulation_dtype(xn.dtype)
    dyn = dy.detach().cpu().numpy().astype(acc, copy=False)  # (N, D_k)
    meann = mean.detach().cpu().numpy().astype(acc, copy=False)  # (B,)
    rstdn = rstd.detach().cpu().numpy().astype(acc, copy=False)  # (B,)
    xhat = (xn.astype(acc, copy=False) - meann[:, None]) * rstdn[:, None]  # (N, D_k)
    g = dyn if weight is None else dyn * weight.detach().cpu().numpy().astype(acc)  # (N, D_k)
    local = torch.from_numpy(np.stack([g.sum(axis=1), np.einsum("ij,ij->i", g, xhat)], axis=1))
    parts = _gather_rows(local, group)
    total = parts[0].numpy().copy()  # (N, 2)
    for p in parts[1:]:
        total += p.numpy()
    means = (total[:, 0:1] / D, total[:, 1:2] / D)  # (N, 1) each, over the whole rows
    dx = layer_norm_dx(g, xhat, rstdn[:, None], means=means)  # (N, D_k)
    dweight = np.einsum("ij,ij->j", dyn, xhat)  # (D_k,)
    dbias = dyn.sum(axis=0)  # (D_k,)
    dt = xn.dtype
    return (
        torch.from_numpy(dx.astype(dt, copy=False)),
        torch.from_numpy(dweight.astype(dt, copy=False)),
        torch.from_numpy(dbias.astype(dt, copy=False)),
    )


def sharded_layer_norm(x, weight=None, bias=None, *, eps=1e-5, group=None):
    r"""Differentiable LayerNorm of rows whose last axis is sharded across ranks.

    :func:`sharded_layer_norm_forward` in the forward, :func:`sharded_layer_norm_backward` in
    the backward (a ``torch.autograd.Function``).

    Parameters
    ----------
    x : torch.Tensor, shape (N, D_k), float32 or float64, CPU
        This rank's columns of the rows.
    weight, bias : torch.Tensor of shape (D_k,) or None
        This rank's slices of the affine parameters.
    eps : float, default 1e-5
        Added to the variance inside the square root.
    group : torch.distributed process group or None
        The ranks that share the rows (None: the default group).

    Returns
    -------
    y : torch.Tensor, shape (N, D_k)
        This rank's columns of the output; gradients flow to ``x`` and to this rank's
        slices of ``weight`` and ``bias``.

    Raises
    ------
    ValueError
        On every rank, when a rank's shard is not 2-d, or the ranks disagree on the number
        of rows or the dtype (checked before any data is exchanged).

    Notes
    -----
    Covered in :ref:`sec-ch05-sharded`.
    """
    return _sharded_function().apply(x, weight, bias, float(eps), group)


@functools.cache
def _sharded_function():
    # Built on first use so that importing this module does not import torch.
    import torch

    class ShardedLayerNormFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, bias, eps, group):
            y, mean, rstd = sharded_layer_norm_forward(x, weight, bias, eps=eps, group=group)
            ctx.save_for_backward(x, weight, mean, rstd)
            ctx.group, ctx.has_bias = group, bias is not None
            return y

        @staticmethod
        def backward(ctx, dy):
            x, weight, mean, rstd = ctx.saved_tensors
            dx, dweight, dbias = sharded_layer_norm_backward(
                dy, x, mean, rstd, weight, group=ctx.group
            )
            return (
                dx,
                dweight if weight is not None else None,
                dbias if ctx.has_bias else None,
                None,
                None,
            )

    return ShardedLayerNormFunction
