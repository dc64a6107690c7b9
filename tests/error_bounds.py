r"""Rounding-error bounds for parameter gradients, the column sums over rows that every norm's
backward computes (``dweight = sum over rows of dy * xhat``, ``dbias = sum over rows of dy``).

A test that compares a parameter gradient with the float64 reference, or with another
implementation, uses the bound that the arithmetic of the implementations gives, not a multiple
of the values' scale: over many rows a scale-relative tolerance either fails a correct float32
sum or passes one that lost a row. Higham, *Accuracy and Stability of Numerical Algorithms*
(2002), section 4.2, gives the sum bound used here.

Works on NumPy and CuPy arrays alike (float64 inputs).
"""

#: Unit roundoff :math:`u` (half the spacing of the numbers just above 1) of each dtype.
UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24, "float64": 2.0**-53}
#: Smallest positive normal number of each dtype (a kernel built with ``-ftz=true`` flushes
#: smaller float32 results to zero; float16 and bfloat16 results below it are subnormal).
TINY = {"float16": 2.0**-14, "bfloat16": 2.0**-126, "float32": 2.0**-126, "float64": 2.0**-1022}
#: Relative error allowed to the float64 reference itself (its own roundings, about
#: ``(m + d) * 2**-53`` for the sizes the tests use, far below this).
REFERENCE = 2.0**-30


def gamma(k, u):
    r""":math:`\gamma_k = k u / (1 - k u)`: the relative error bound of ``k`` roundings in a row."""
    assert k * u < 0.5, (k, u)
    return k * u / (1 - k * u)


def summand_errors(dy, x, mean, rstd, mean_err, rstd_err, acc, extra=0.0):
    r"""Bound on the error of each computed summand :math:`t = dy\,\hat{x}` of ``dweight``.

    With :math:`\hat{x} = (x - \mu)\,r` from exact :math:`\mu, r`, an implementation that holds
    :math:`\mu' = \mu + \delta_\mu` and :math:`r' = r\,(1 + \rho)` and forms
    :math:`t' = dy\,\hat{x}'` in the accumulation dtype (unit roundoff :math:`u`), either as
    :math:`(x - \mu')\,r'` or as :math:`x r' - \mu' r'`, then times ``dy`` (at most four
    roundings), and possibly rounds :math:`\hat{x}'` and :math:`t'` to a narrower dtype
    (``extra``: the relative error of those roundings), has

    .. math::

        |t' - t| \le |dy|\,\big(c\,(|\hat{x}| + r\,(|x| + |\mu|)) + r\,|\delta_\mu|\,(1 + c)\big),
        \qquad c = (1 + u)^4 (1 + |\rho|)(1 + \mathrm{extra}) - 1 .

    Parameters
    ----------
    dy, x : ndarray (m, d), float64
        The exact values of ``dy`` and ``x`` (both implementations read the same values).
    mean, rstd : ndarray (m, 1), float64
        The exact statistics of each row (``mean`` 0 for RMSNorm).
    mean_err, rstd_err : ndarray (m, 1) or float
        Bounds on :math:`|\delta_\mu|` and :math:`|\rho|` of the statistics the implementation
        used (measured against the float64 reference, or assumed where it does not return them).
    acc : str
        The accumulation dtype, ``"float32"`` or ``"float64"``.
    extra : float, default 0
        Relative error of further roundings of each summand.

    Returns
    -------
    ndarray (m, d), float64
    """
    u = UNIT_ROUNDOFF[acc]
    c = (1 + u) ** 4 * (1 + rstd_err) * (1 + extra) - 1
    xhat = (x - mean) * rstd
    return abs(dy) * (c * (abs(xhat) + rstd * (abs(x) + abs(mean))) + rstd * mean_err * (1 + c))


def column_sum_bound(terms, errors, acc, out=None):
    r"""Bound on :math:`|s' - s|` for the column sums :math:`s = \sum_i t_i` of ``terms``.

    The implementation adds ``m`` computed summands :math:`t'_i`, each within :math:`e_i` of
    :math:`t_i`, in the accumulation dtype, in any order and grouping (a sequential loop, a
    tree, partial sums per unit then a sum over units: every summand passes through at most
    ``m - 1`` additions, so :math:`\gamma_{m-1}` bounds them all), then may round the sum once to
    the dtype ``out``:

    .. math::

        E = \sum_i e_i + \gamma_{m-1} \sum_i (|t_i| + e_i) + 4m\,\mathrm{tiny}_{acc}
            + 2^{-30} \sum_i (|t_i| + e_i), \qquad
        |s' - s| \le E + u_{out}\,(|s| + E) + u_{out}\,\mathrm{tiny}_{out},

    the :math:`4m\,\mathrm{tiny}` term for results flushed to zero, the :math:`2^{-30}` term
    for the float64 reference's own roundings (``REFERENCE``), the last term for half the
    spacing of ``out``'s subnormal numbers. With ``out`` None (the sum is returned in the
    accumulation dtype) the bound is :math:`E`.

    Parameters
    ----------
    terms : ndarray (m, d), float64
        The exact summands.
    errors : ndarray (m, d) or float
        Bounds on the error of each computed summand (0 where the summands are exact).
    acc : str
        The accumulation dtype.
    out : str, optional
        The dtype the sum is rounded to at the end, if not ``acc``.

    Returns
    -------
    ndarray (d,), float64
    """
    m = terms.shape[0]
    total = abs(terms).sum(axis=0)
    e_sum = errors.sum(axis=0) if hasattr(errors, "sum") else m * errors
    mag = total + e_sum
    err = e_sum + (gamma(max(m - 1, 0), UNIT_ROUNDOFF[acc]) + REFERENCE) * mag + 4 * m * TINY[acc]
    if out is None or out == acc:
        return err
    u_out = UNIT_ROUNDOFF[out]
    return err + u_out * (abs(terms.sum(axis=0)) + err) + u_out * TINY[out]
