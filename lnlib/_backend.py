"""The one place that decides which array library (NumPy or CuPy) an operation runs on.

CuPy is imported only when an argument is already a CuPy array, so ``import lnlib`` needs
NumPy alone and a machine without a GPU never touches CUDA.
"""

import sys

import numpy as np


def _is_cupy_array(a):
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(a, cupy.ndarray)


def get_array_module(**arrays):
    """Return ``numpy`` or ``cupy`` for the given named arguments (``None`` ones are ignored).

    Raises
    ------
    TypeError
        If some arguments are CuPy arrays and others are not: lnlib never copies between host
        and device behind the caller's back.
    """
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


def accumulation_dtype(dtype):
    """The dtype statistics are accumulated in: float64 for float64, float32 otherwise."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)
