"""The one place that chooses how an operation runs: array module, then implementation.

Every public function validates its arguments, asks :func:`select` for an implementation of
its operation for the array module and dtype of its input, reshapes to rows and calls it.
Implementations share one row-matrix signature per operation (``M`` rows of ``D`` values;
``weight``/``bias`` flat vectors of length ``D`` in the accumulation dtype, or None):

==========================  ==============================================  ===================
operation                   arguments                                       returns
==========================  ==============================================  ===================
``layer_norm_forward``      ``x (M, D), weight (D,), bias (D,), eps``       ``y, mean, rstd``
``layer_norm_backward``     ``dy (M, D), x (M, D), mean (M,), rstd (M,),``  ``dx, dweight,
                            ``weight (D,)``                                 dbias``
``rms_norm_forward``        ``x (M, D), weight (D,), eps``                  ``y, rstd``
``rms_norm_backward``       ``dy (M, D), x (M, D), rstd (M,), weight (D,)``  ``dx, dweight``
==========================  ==============================================  ===================

``y``/``dx`` come back in the dtype of ``x``; ``mean``, ``rstd`` and the parameter gradients
in the accumulation dtype (:func:`accumulation_dtype`). Row ``i`` of a result depends on row
``i`` of the inputs only.

Implementations are registered by name; a device adds one with one :func:`register` line:

* ``"kernel"``: the compiled C kernel (:mod:`lnlib._cpu.c_kernel`), float16, float32 and
  float64;
* ``"numpy"``: the blocked NumPy fast path (:mod:`lnlib._cpu.numpy_path`), every dtype;
* ``"reference"``: the readable formulas of :mod:`lnlib.reference`, NumPy or CuPy;
* ``"cuda"``: CUDA kernels through CuPy (:mod:`lnlib._cuda.cuda_kernel`), where a GPU is present.

``"auto"`` (the default) takes the kernel where it can and the NumPy path otherwise on the
CPU, and ``"cuda"`` (else the reference) for CuPy arrays. :func:`use_implementation` forces
one. CuPy is imported only when an argument is already a CuPy array, so ``import lnlib`` needs
NumPy alone.
"""

import contextlib
import contextvars
import importlib
import os
import sys
from dataclasses import dataclass

import numpy as np

from ._rows import thread_setting

__all__ = ["use_implementation", "show_config"]

OPS = ("layer_norm_forward", "layer_norm_backward", "rms_norm_forward", "rms_norm_backward")
_F16, _F32, _F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)

#: Values of ``LNLIB_CPU_KERNEL`` that switch the compiled kernel off, and those that keep it.
_OFF = ("0", "false", "no", "off")
_ON = ("", "1", "true", "yes", "on")


@dataclass(frozen=True)
class _Implementation:
    """A registered implementation: where its row functions live and what it accepts."""

    name: str
    module: str  # imported on first use; defines one function per op in OPS
    attr: str  # the function's name in the module, from the op: "{op}_rows" or "{op}"
    array_module: str  # "numpy", "cupy" or "any"
    dtypes: tuple
    description: str


_REGISTRY = {}
_forced = contextvars.ContextVar("lnlib_implementation", default="auto")


def register(name, module, *, array_module, dtypes, description, attr="{op}_rows"):
    """Add an implementation under ``name`` (one line per device or variant)."""
    _REGISTRY[name] = _Implementation(
        name, module, attr, array_module, tuple(np.dtype(d) for d in dtypes), description
    )


register(
    "kernel",
    "lnlib._cpu.c_kernel",
    array_module="numpy",
    dtypes=(_F16, _F32, _F64),
    description="compiled C kernel (lnlib/_cpu/norms.c)",
)
register(
    "numpy",
    "lnlib._cpu.numpy_path",
    array_module="numpy",
    dtypes=(_F16, _F32, _F64),
    description="blocked, threaded NumPy fast path",
)
register(
    "reference",
    "lnlib.reference",
    array_module="any",
    dtypes=(_F16, _F32, _F64),
    description="readable formulas of lnlib.reference",
    attr="{op}",
)
# The CUDA kernels: a module with available() -> (bool, reason) and the <op>_rows functions.
register(
    "cuda",
    "lnlib._cuda.cuda_kernel",
    array_module="cupy",
    dtypes=(_F16, _F32, _F64),
    description="CUDA kernels through CuPy",
)
#: Names :func:`use_implementation` accepts.
NAMES = ("auto", *_REGISTRY)


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


def accumulation_dtype(dtype):
    """The dtype statistics are accumulated in: float64 for float64, float32 otherwise."""
    if not isinstance(dtype, np.dtype):
        dtype = np.dtype(dtype)
    return _F64 if dtype == _F64 else _F32


def kernel_setting():
    """``(enabled, reason)`` from the environment variable ``LNLIB_CPU_KERNEL``.

    Raises
    ------
    ValueError
        For a value that is neither on (1, true, yes, on) nor off (0, false, no, off).
    """
    raw = os.environ.get("LNLIB_CPU_KERNEL", "")
    value = raw.strip().lower()
    if value in _OFF:
        return False, f"disabled by LNLIB_CPU_KERNEL={raw}"
    if value in _ON:
        return True, "enabled"
    raise ValueError(
        f"LNLIB_CPU_KERNEL must be one of {', '.join(_ON[1:])} (use the kernel) or "
        f"{', '.join(_OFF)} (do not), got {raw!r}"
    )


def _kernel_usable():
    """``(usable, reason)`` for the compiled CPU kernel: the environment, then the build."""
    enabled, reason = kernel_setting()
    if not enabled:
        return False, reason
    info = _kernels_module().info()
    return bool(info["kernel"]), info["reason"]


#: lnlib._cpu.c_kernel once it is fully imported (None before): set only by _kernels_module.
_kernels = None


def _kernels_module():
    """The kernel binding module, imported once. ``importlib.import_module`` waits while
    another thread is still importing it, so the module returned is complete: a module found
    in ``sys.modules`` may still be half-way through its import in another thread."""
    global _kernels
    if _kernels is None:
        _kernels = importlib.import_module("lnlib._cpu.c_kernel")
    return _kernels


def _usable(impl):
    """``(usable, reason)`` for a registered implementation on this machine."""
    if impl.name == "kernel":
        return _kernel_usable()
    if impl.array_module == "cupy":
        try:
            module = importlib.import_module(impl.module)
        except ImportError as exc:
            return False, f"cannot import {impl.module} ({exc})"
        return module.available()
    return True, "always available"


def _function(impl, op):
    """The row function of ``op`` in ``impl``, or None if the implementation lacks it."""
    module = importlib.import_module(impl.module)
    return getattr(module, impl.attr.format(op=op), None)


def _auto(op, xp_name, dtype):
    if xp_name == "cupy":
        cuda = _REGISTRY["cuda"]
        if dtype in cuda.dtypes and _usable(cuda)[0] and _function(cuda, op) is not None:
            return _function(cuda, op)
        return _function(_REGISTRY["reference"], op)
    if dtype in _REGISTRY["kernel"].dtypes and _kernel_usable()[0]:
        return _function(_REGISTRY["kernel"], op)
    return _function(_REGISTRY["numpy"], op)


def _forced_function(name, op, xp_name, dtype):
    impl = _REGISTRY[name]
    where = f"lnlib.use_implementation({name!r}) is in force but"
    if impl.array_module not in ("any", xp_name):
        raise TypeError(
            f"{where} it runs on {impl.array_module} arrays and x is a "
            f"{xp_name} array; use 'auto' or one for {xp_name} arrays"
        )
    if dtype not in impl.dtypes:
        raise TypeError(
            f"{where} it takes {', '.join(d.name for d in impl.dtypes)} and x is "
            f"{dtype.name}; use 'auto' or 'numpy'"
        )
    usable, reason = _usable(impl)
    if not usable:
        raise RuntimeError(f"{where} it is not available here: {reason}")
    fn = _function(impl, op)
    if fn is None:
        raise RuntimeError(f"{where} it has no {op}; use 'auto'")
    return fn


def select(op, xp, dtype):
    """The row function of operation ``op`` for arrays of module ``xp`` and ``dtype``.

    Parameters
    ----------
    op : str
        One of :data:`OPS`.
    xp : module
        ``numpy`` or ``cupy``, from :func:`get_array_module`.
    dtype : numpy.dtype
        The dtype of ``x``.

    Returns
    -------
    callable
        With the row signature of ``op`` (module docstring); ``eps`` is passed by keyword.

    Raises
    ------
    TypeError, RuntimeError
        If the implementation forced with :func:`use_implementation` cannot handle ``xp`` or
        ``dtype``, or is not available on this machine (the message says which).
    ValueError
        ``LNLIB_CPU_KERNEL`` has a value that is neither on nor off, or ``LNLIB_NUM_THREADS``
        is not a positive integer.
    """
    dtype = dtype if isinstance(dtype, np.dtype) else np.dtype(dtype)
    name = _forced.get()
    if xp is not np:
        return _uncached(op, "cupy", dtype, name)
    env = os.environ.get("LNLIB_CPU_KERNEL"), os.environ.get("LNLIB_NUM_THREADS")
    key = (op, dtype, name, *env, _kernel_state())
    fn = _SELECTED.get(key)
    if fn is None:
        thread_setting()  # a bad LNLIB_NUM_THREADS fails every call, not only large ones
        fn = _uncached(op, "numpy", dtype, name)
        if key[-1] is not _UNLOADED:  # the choice may depend on the kernel's first load
            if len(_SELECTED) > 256:
                _SELECTED.clear()
            _SELECTED[key] = fn
    return fn


def _uncached(op, xp_name, dtype, name):
    if name == "auto":
        return _auto(op, xp_name, dtype)
    return _forced_function(name, op, xp_name, dtype)


#: Row functions chosen for NumPy arrays, by (op, dtype, implementation in force,
#: LNLIB_CPU_KERNEL, LNLIB_NUM_THREADS (checked once per value), the loaded kernel module):
#: everything the choice depends on, so that a cached choice is the one :func:`select` would
#: make again. Failures are never cached.
_SELECTED = {}
_UNLOADED = object()


def _kernel_state():
    """The loaded kernel extension (None where it failed), or _UNLOADED before the first try."""
    if _kernels is None:  # not imported yet, so not loaded either
        return _UNLOADED
    tried, module = _kernels.load_result()
    return module if tried else _UNLOADED


@contextlib.contextmanager
def use_implementation(name):
    r"""Run every lnlib call in this block with the implementation ``name``.

    Parameters
    ----------
    name : {"auto", "kernel", "numpy", "reference", "cuda"}
        ``"auto"`` (the default outside any block): the compiled C kernel for NumPy input
        (float16, float32, float64) where it is available, the NumPy fast path otherwise, the CUDA
        kernels (or the reference) for CuPy input. ``"kernel"``: the compiled C kernel.
        ``"numpy"``: the blocked NumPy fast path. ``"reference"``: the readable formulas of
        ``lnlib.reference`` (NumPy or CuPy). ``"cuda"``: the CUDA kernels (CuPy input).

    Yields
    ------
    str
        ``name``.

    Raises
    ------
    ValueError
        ``name`` is not one of the names above (raised when the block is entered).
    TypeError
        Inside the block, a call whose input the forced implementation cannot take: a
        NumPy implementation with CuPy arrays, or the reverse.
    RuntimeError
        Inside the block, a call when the forced implementation is not available here (for
        example no C compiler, or ``LNLIB_CPU_KERNEL=0``); the message gives the reason.

    Notes
    -----
    The setting is per thread (a ``contextvars`` variable) and nests. Every
    implementation computes the same quantities and is tested against the reference; they
    differ in speed and in the last bits. Covered in :ref:`sec-ch05-performance`, which
    compares them.

    Examples
    --------
    >>> import numpy as np, lnlib
    >>> x = np.arange(6.0).reshape(2, 3)
    >>> with lnlib.use_implementation("reference"):
    ...     y = lnlib.layer_norm(x)
    """
    if not isinstance(name, str) or name not in NAMES:
        raise ValueError(f"name must be one of {', '.join(map(repr, NAMES))}, got {name!r}")
    token = _forced.set(name)
    try:
        yield name
    finally:
        _forced.reset(token)


def show_config(*, file=None):
    """Print and return which implementations lnlib can use here, and why.

    Parameters
    ----------
    file : file-like, optional
        Where to print (default ``sys.stdout``); ``False`` prints nothing.

    Returns
    -------
    dict
        ``{"forced": name in force, "threads": {"num_threads": int, "reason": str},
        "implementations": {name: {"available": bool, "reason": str, "description": str,
        "dtypes": [...], "array_module": str}}}``: ``num_threads`` is
        :func:`lnlib.get_num_threads` and ``reason`` where it comes from (``num_threads``
        None, and the error in ``reason``, for a bad ``LNLIB_NUM_THREADS``).

    Notes
    -----
    Asking about the kernel may compile it (once). See :func:`use_implementation`.
    Covered in :ref:`sec-ch05-performance`.
    """
    config = {"forced": _forced.get(), "threads": {}, "implementations": {}}
    try:
        threads, why = thread_setting()
    except ValueError as exc:  # a bad LNLIB_NUM_THREADS
        threads, why = None, str(exc)
    config["threads"] = {"num_threads": threads, "reason": why}
    for impl in _REGISTRY.values():
        try:
            usable, reason = _usable(impl)
        except ValueError as exc:  # a bad LNLIB_CPU_KERNEL
            usable, reason = False, str(exc)
        config["implementations"][impl.name] = {
            "available": bool(usable),
            "reason": reason,
            "description": impl.description,
            "dtypes": [d.name for d in impl.dtypes],
            "array_module": impl.array_module,
        }
    if file is not False:
        lines = [
            f"lnlib implementation in force: {config['forced']}",
            f"lnlib threads per call: {threads} ({why})",
        ]
        for name, row in config["implementations"].items():
            mark = "yes" if row["available"] else "no "
            lines.append(f"  {name:<10} {mark} {row['description']}: {row['reason']}")
        print("\n".join(lines), file=file)
    return config
