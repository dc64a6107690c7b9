"""Argument checks shared by every public function, and the array module of its arguments; the
checks and parameter fills shared by the constructors of the NumPy layers (:mod:`lnlib.layers`)
and the torch modules (:mod:`lnlib.torch_bridge`).

Each check runs before any work, names the argument at fault and says what was expected.
"""

import math
import numbers
import sys

import numpy as np

_FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def _is_cupy_array(a):
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(a, cupy.ndarray)


def get_array_module(**arrays):
    """Return ``numpy`` or ``cupy`` for the given named arguments (``None`` ones are ignored).

    CuPy is imported only when an argument already is a CuPy array, so ``import lnlib`` needs
    NumPy alone.

    Raises
    ------
    TypeError
        If some arguments are CuPy arrays and others are not: lnlib never copies between host
        and device behind the caller's back.
    """
    if "cupy" not in sys.modules:  # no argument can be a CuPy array: the common, fast case
        return np
    kinds = {name: _is_cupy_array(a) for name, a in arrays.items() if a is not None}
    if not kinds:
        return np
    if all(kinds.values()):
        import cupy

        return cupy
    if any(kinds.values()):
        on_gpu = sorted(n for n, k in kinds.items() if k)
        on_cpu = sorted(n for n, k in kinds.items() if not k)
        raise TypeError(
            f"arrays from different array libraries: {', '.join(on_gpu)} "
            f"{'is a CuPy array' if len(on_gpu) == 1 else 'are CuPy arrays'} but "
            f"{', '.join(on_cpu)} {'is not' if len(on_cpu) == 1 else 'are not'}; "
            "pass all arrays from NumPy or all from CuPy"
        )
    return np


def not_masked(a, name):
    """Refuse a masked array (numpy.ma): lnlib would ignore its mask."""
    if isinstance(a, np.ma.MaskedArray):
        raise TypeError(
            f"{name} is a masked array (numpy.ma), which lnlib does not support: "
            f"its mask would be ignored; pass {name}.filled(value) or the unmasked "
            "values instead"
        )


def float_array(a, name, xp):
    """Return ``a`` as an array of ``xp`` with a float16/32/64 dtype, or raise ``TypeError``.

    Array-likes (lists, scalars) are converted; arrays are returned as they are, never copied.
    An ndarray subclass (``numpy.matrix``, ``numpy.memmap``, ...) becomes a plain ndarray
    viewing the same memory, as ``numpy.asarray`` makes it, so that every implementation
    computes with ndarray semantics (``*`` elementwise, reshapes that drop axes) and returns
    plain ndarrays; a masked array is refused (:func:`not_masked`).
    """
    not_masked(a, name)
    if type(a) is not xp.ndarray and isinstance(a, xp.ndarray):
        a = xp.asarray(a)  # a subclass: the same memory as a plain ndarray, no copy
    elif not isinstance(a, xp.ndarray):
        try:
            a = xp.asarray(a)
        except Exception as exc:  # noqa: BLE001 - any failure means "not an array"
            raise TypeError(
                f"{name} must be a floating-point array, got {type(a).__name__}"
            ) from exc
    if a.dtype.kind == "f" and not a.dtype.isnative and a.dtype.newbyteorder("=") in _FLOATS:
        # Data in the other byte order (read from a file, say): the same values, converted.
        return a.astype(a.dtype.newbyteorder("="))
    if a.dtype not in _FLOATS:
        raise TypeError(
            f"{name} must have a floating dtype (float16, float32 or float64), got {a.dtype}"
        )
    return a


def optional_param(a, name, shape, xp):
    """Check an optional per-feature parameter (weight, bias): ``None`` or exactly ``shape``."""
    if a is None:
        return None
    a = float_array(a, name, xp)
    if a.shape != tuple(shape):
        raise ValueError(
            f"{name} must have shape {tuple(shape)} (the normalized axes of x), got {a.shape}"
        )
    return a


def eps_value(eps):
    """Return ``eps`` as a float after checking it is a finite number >= 0."""
    if type(eps) is float:  # the common case, without the slower checks of numbers.Real
        if not math.isfinite(eps) or eps < 0:
            raise ValueError(f"eps must be finite and >= 0, got {eps}")
        return eps
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps must be a real number, got {type(eps).__name__}")
    try:
        eps = float(eps)
    except OverflowError:
        raise ValueError(
            f"eps must be finite and >= 0, got an integer of {len(str(abs(eps)))} "
            "digits, too large for a float"
        ) from None
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be finite and >= 0, got {eps}")
    return eps


def weight_offset_value(offset, weight):
    """Return ``weight_offset`` as a float: finite, and 0 unless there is a ``weight``."""
    if type(offset) is float and offset == 0.0:  # the default, without numbers.Real's checks
        return 0.0
    if isinstance(offset, bool) or not isinstance(offset, numbers.Real):
        raise TypeError(f"weight_offset must be a real number, got {type(offset).__name__}")
    try:
        offset = float(offset)
    except OverflowError:
        raise ValueError(
            "weight_offset must be finite, got an integer too large for a float"
        ) from None
    if not math.isfinite(offset):
        raise ValueError(f"weight_offset must be finite, got {offset}")
    if offset and weight is None:
        raise ValueError(
            f"weight_offset={offset} needs a weight: the scale is weight_offset + "
            "weight, and weight is None (pass a weight, e.g. zeros)"
        )
    return offset


def normalized_ndim_value(x, normalized_ndim):
    """Check ``normalized_ndim`` against ``x`` and that no normalized axis is empty."""
    if type(normalized_ndim) is not int and (
        isinstance(normalized_ndim, bool) or not isinstance(normalized_ndim, numbers.Integral)
    ):
        raise TypeError(f"normalized_ndim must be an int, got {type(normalized_ndim).__name__}")
    k = int(normalized_ndim)
    if x.ndim == 0:
        raise ValueError("x must have at least one axis to normalize, got a 0-d array")
    if not 1 <= k <= x.ndim:
        raise ValueError(f"normalized_ndim must be between 1 and x.ndim = {x.ndim}, got {k}")
    normalized_axes(x.shape, k)
    return k


def normalized_axes(shape, k):
    """Shape of the last ``k`` axes; raises ``ValueError`` if one of them is empty."""
    tail = tuple(shape[len(shape) - k :])
    if 0 in tail:
        raise ValueError(
            f"x has an empty normalized axis: the last {k} axes of x have shape {tail}"
        )
    return tail


def same_shape(a, name, x, x_name="x"):
    """Check that ``a`` (a gradient such as ``dy``) has exactly the shape of ``x``."""
    if a.shape != x.shape:
        raise ValueError(f"{name} must have the shape of {x_name}, {x.shape}, got {a.shape}")


def backward_inputs(dy, x, xp, x_name="x", **stats):
    """Check the arguments every row-wise backward takes: ``dy``, ``x`` and saved statistics.

    ``x_name`` is what the errors call ``x`` (``"h"`` for the fused residual add). Returns
    ``(dy, x, stats, k)`` with ``stats`` a list in the order given and ``k`` the number of
    normalized axes.
    """
    x = float_array(x, x_name, xp)
    dy = float_array(dy, "dy", xp)
    same_shape(dy, "dy", x, x_name)
    stats = {name: float_array(s, name, xp) for name, s in stats.items()}
    return dy, x, list(stats.values()), saved_stats(x, x_name=x_name, **stats)


def saved_stats(x, x_name="x", **stats):
    """Check saved statistics (mean, rstd): all of one shape, the leading axes of ``x``.

    Returns the number of normalized axes, ``x.ndim - stat.ndim``.
    """
    shapes = {name: s.shape for name, s in stats.items()}
    first_name, first = next(iter(shapes.items()))
    for name, shape in shapes.items():
        if shape != first:
            raise ValueError(f"{name} must have the shape of {first_name}, {first}, got {shape}")
    if len(first) >= x.ndim or tuple(x.shape[: len(first)]) != first:
        raise ValueError(
            f"{first_name} must have the shape of the leading (unnormalized) axes of {x_name} "
            f"{x.shape}, i.e. {x_name}.shape[:{x_name}.ndim - normalized_ndim], got {first}"
        )
    k = x.ndim - len(first)
    normalized_axes(x.shape, k)
    return k


def normalized_shape_value(normalized_shape):
    """``normalized_shape`` (an int or a sequence of ints) as a tuple of positive ints."""
    if isinstance(normalized_shape, numbers.Integral) and not isinstance(normalized_shape, bool):
        normalized_shape = (normalized_shape,)
    shape = shape_value(normalized_shape, "normalized_shape")
    if not shape or 0 in shape:
        raise ValueError(f"normalized_shape must be non-empty and without zeros, got {shape}")
    return shape


def size_value(n, name):
    """``n`` as an int: an integer (not a bool), at least 1 (a layer's ``dim``, ``num_features``,
    ``num_channels``)."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(n).__name__} {n!r}")
    if n < 1:
        raise ValueError(f"{name} must be >= 1, got {n}")
    return int(n)


def last_axis_shape_value(normalized_shape):
    """``normalized_shape`` of a layer over the last axis only (Dynamic Tanh): one positive size,
    as a tuple."""
    shape = normalized_shape_value(normalized_shape)
    if len(shape) != 1:
        raise ValueError(
            f"normalized_shape must be one size (the last axis), got {normalized_shape}"
        )
    return shape


def num_groups_value(num_groups, channels, what):
    """``num_groups`` as an int: an integer (not a bool), at least 1, dividing ``channels``
    (``what`` names them in the error)."""
    if isinstance(num_groups, bool) or not isinstance(num_groups, numbers.Integral):
        raise TypeError(f"num_groups must be an int, got {type(num_groups).__name__}")
    g = int(num_groups)
    if g < 1:
        raise ValueError(f"num_groups must be >= 1, got {g}")
    if channels % g:
        raise ValueError(f"num_groups must divide {what} = {channels}, got {g}")
    return g


def affine_fills(held):
    """The fills of a weight (ones) and a bias (zeros), held or not (None)."""
    return {"weight": 1.0 if held else None, "bias": 0.0 if held else None}


def norm_setup(layer, normalized_shape, eps, affine, weight_offset, bias=None):
    """What a LayerNorm or RMSNorm (and their fused forms), NumPy layer or torch module, does
    first: check and set the normalized shape, ``eps`` and the offset; return the fills of the
    weight (``1 - weight_offset``) and, unless ``bias`` is None (RMSNorm has none), the bias."""
    layer.normalized_shape, layer.eps = normalized_shape_value(normalized_shape), eps
    layer.weight_offset = weight_offset_value(weight_offset, True if affine else None)
    fills = {"weight": 1 - layer.weight_offset if affine else None}
    if bias is not None:
        fills["bias"] = 0.0 if affine and bias else None
    return fills


def shape_value(shape, name):
    """Return ``shape`` as a tuple of non-negative ints, or raise naming ``name``."""
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise TypeError(
            f"{name} must be a tuple of ints (a shape), got {type(shape).__name__} {shape!r}"
        )
    shape = tuple(shape)
    for n in shape:
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
            raise ValueError(f"{name} must be a tuple of non-negative ints, got {shape!r}")
    return tuple(int(n) for n in shape)


def broadcast_modulation(a, name, x):
    """Check that a modulation array (shift, scale) broadcasts against ``x`` without growing it."""
    try:
        out = np.broadcast_shapes(a.shape, x.shape)
    except ValueError:
        out = None
    if out != x.shape:
        raise ValueError(
            f"{name} must broadcast against x of shape {x.shape} without enlarging it (for example"
            f" (B, D) for x of shape (B, D), or (B, 1, D) for (B, T, D)), got {a.shape}"
        )


def out_arrays(out, xp, specs, *, single=False):
    """Check ``out=``: None, or one array per result, each exactly of its result's shape and dtype.

    ``specs`` lists ``(label, shape, dtype)`` per result. With ``single`` the function returns
    one array and ``out`` is that array (or None); otherwise ``out`` is a tuple (or list) of
    ``len(specs)`` entries, each an array or None (then that result is allocated). Returns a
    tuple with one array or None per result; raises before anything is written. An ndarray
    subclass is accepted and written in its memory (and returned, as NumPy's ``out=`` does);
    a masked array is refused.
    """
    if out is None:
        return None
    if single:
        out = (out,)
    elif not isinstance(out, (tuple, list)) or len(out) != len(specs):
        labels = ", ".join(label for label, _, _ in specs)
        raise TypeError(
            f"out must be a tuple of {len(specs)} arrays or None ({labels}), got "
            f"{type(out).__name__}"
            + (f" of length {len(out)}" if isinstance(out, (tuple, list)) else "")
        )
    for i, (a, (label, shape, dtype)) in enumerate(zip(out, specs)):
        name = "out" if single else f"out[{i}] ({label})"
        if a is None:
            continue
        not_masked(a, name)
        if not isinstance(a, xp.ndarray):
            raise TypeError(
                f"{name} must be a {xp.__name__}.ndarray (the array library of x), "
                f"got {type(a).__name__}"
            )
        if a.shape != tuple(shape) or a.dtype != dtype:
            raise ValueError(
                f"{name} must have shape {tuple(shape)} and dtype {np.dtype(dtype)} (those of "
                f"{label}), got shape {a.shape} and dtype {a.dtype}"
            )
        if not getattr(a.flags, "writeable", True):
            raise ValueError(f"{name} is read-only")
    given = [(i, a) for i, a in enumerate(out) if a is not None]
    for j, (i, a) in enumerate(given):
        for i2, b in given[j + 1 :]:
            if xp.may_share_memory(a, b):
                raise ValueError(
                    f"out[{i}] ({specs[i][0]}) and out[{i2}] ({specs[i2][0]}) share memory; "
                    "each result needs an array of its own"
                )
    return tuple(out)
