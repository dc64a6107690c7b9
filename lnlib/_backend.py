"""The one place that chooses how an operation runs: :data:`TABLE` and :func:`select`.

A public function validates its arguments, asks :func:`select` for a row function and calls it
on rows (the contract: :mod:`lnlib._rows`). An implementation, a module with ``<op>_rows`` for
each of :data:`OPS` and ``available() -> (usable, reason)``, plugs in with a row of :data:`TABLE`
(and a place in :data:`AUTO` if ``"auto"`` is to take it).
"""

import contextlib
import contextvars
import importlib
from collections import namedtuple

import numpy as np

from ._rows import check_thread_setting, thread_setting

__all__ = ["use_implementation", "show_config"]

OPS = ("layer_norm_forward", "layer_norm_backward", "rms_norm_forward", "rms_norm_backward")
OPS += tuple("add_" + op for op in OPS)  # the fused residual add (lnlib.add_norm)
#: Ops only the CUDA kernels have (AdaLN, GroupNorm): select gives None elsewhere (see callers).
OPTIONAL_OPS = ("modulated_layer_norm_forward", "modulated_layer_norm_backward")
DTYPES = ("float16", "float32", "float64")  # what every implementation takes
Row = namedtuple("Row", "module arrays description")
#: Each implementation: its module and the arrays it takes ("numpy", "cupy" or "any").
TABLE = {
    "kernel": Row("lnlib._cpu.c_kernel", "numpy", "compiled C kernel (lnlib/_cpu/norms.c)"),
    "numpy": Row("lnlib._cpu.numpy_path", "numpy", "blocked, threaded NumPy fast path"),
    "reference": Row("lnlib.reference", "any", "readable formulas of lnlib.reference"),
    "cuda": Row("lnlib._cuda.cuda_kernel", "cupy", "CUDA kernels through CuPy"),
}
#: What "auto" takes, by array module: the first available (the last one always is).
AUTO = {"numpy": ("kernel", "numpy"), "cupy": ("cuda", "reference")}
NAMES = ("auto", *TABLE)  # what use_implementation accepts

_forced = contextvars.ContextVar("lnlib_implementation", default="auto")
_modules = {}  # implementation name -> its module, once fully imported


def _module(name):
    # import_module waits while another thread imports it: the module returned is complete
    module = _modules.get(name)
    if module is None:
        module = _modules[name] = importlib.import_module(TABLE[name].module)
    return module


def select(op, xp):
    """The row function of ``op`` (None for an :data:`OPTIONAL_OPS` op it lacks) for ``xp``
    arrays of :data:`DTYPES`: the forced implementation's, else the first available of
    :data:`AUTO`. Raises as :func:`use_implementation` says; ValueError: bad LNLIB_* variables."""
    arrays = "numpy" if xp is np else "cupy"
    if arrays == "numpy":
        check_thread_setting()  # every call, small ones too
    name = _forced.get()
    if name == "auto":  # the first available (the last one always is)
        for name in AUTO[arrays]:
            if (module := _module(name)).available()[0]:
                return getattr(module, op + "_rows", None)
    row, where = TABLE[name], f"lnlib.use_implementation({name!r}) is in force but"
    if row.arrays not in ("any", arrays):
        raise TypeError(
            f"{where} it runs on {row.arrays} arrays and x is a {arrays} array; use 'auto' or "
            f"one for {arrays} arrays"
        )
    if not (found := _module(name).available())[0]:
        raise RuntimeError(f"{where} it is not available here: {found[1]}")
    return getattr(_module(name), op + "_rows", None)


@contextlib.contextmanager
def use_implementation(name):
    """Run every lnlib call in this block with the implementation ``name``.

    Parameters
    ----------
    name : {"auto", "kernel", "numpy", "reference", "cuda"}
        The compiled C kernel, the blocked NumPy path, the formulas of ``lnlib.reference`` or
        the CUDA kernels (CuPy input). ``"auto"``, the default: the kernel where it is
        available, else the NumPy path; for CuPy input the CUDA kernels, else the reference.

    Yields
    ------
    str
        ``name``.

    Raises
    ------
    ValueError
        ``name`` is none of these (raised on entering the block).
    TypeError, RuntimeError
        Inside, a call with arrays the implementation does not take, or where it is not
        available (not built, ``LNLIB_CPU_KERNEL=0``, no GPU: the message says).

    Notes
    -----
    Per thread (a ``contextvars`` variable); blocks nest. The implementations compute the same
    quantities, are tested against the reference and differ in speed and in the last bits.
    Covered in :ref:`sec-ch05-performance`, which compares them.
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
        ``{"forced": name, "threads": {"num_threads", "reason"}, "implementations": {name:
        {"available", "reason", "description", "array_module", "dtypes"}}}``: the name in
        force, :func:`lnlib.get_num_threads` and why (None and the error for a bad
        ``LNLIB_NUM_THREADS``), and whether each implementation runs here, why, and what it is.

    Notes
    -----
    Nothing is compiled: it loads the kernel's module (built with the package) if no call has,
    and asks CuPy, where installed, for a GPU. Covered in :ref:`sec-ch05-performance`.
    """
    try:
        threads, why = thread_setting()
    except ValueError as exc:  # a bad LNLIB_NUM_THREADS
        threads, why = None, str(exc)
    lines = [f"lnlib implementation in force: {_forced.get()}"]
    lines.append(f"lnlib threads per call: {threads} ({why})")
    found = {}
    for name, row in TABLE.items():
        try:
            usable, reason = _module(name).available()
        except ValueError as exc:  # a bad LNLIB_CPU_KERNEL
            usable, reason = False, str(exc)
        lines.append(f"  {name:<10} {'yes' if usable else 'no '} {row.description}: {reason}")
        found[name] = {"available": usable, "reason": reason, "description": row.description}
        found[name].update(array_module=row.arrays, dtypes=list(DTYPES))
    if file is not False:
        print("\n".join(lines), file=file)
    threads = {"num_threads": threads, "reason": why}
    return {"forced": _forced.get(), "threads": threads, "implementations": found}
