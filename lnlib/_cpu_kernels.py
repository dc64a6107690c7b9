"""Deprecated: the compiled CPU kernel now lives in :mod:`lnlib._cpu.kernels`.

Kept only until the last importers (notebook 05, tests/exercises/test_ch05.py) switch to
``lnlib._cpu.kernels.info()`` and ``lnlib.use_implementation("numpy")``; then it goes.
"""

import contextlib
from pathlib import Path

from ._cpu import kernels as _kernels

SOURCE = Path(__file__).with_name("kernels") / "norms_cpu.c"
FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno"]


def info():
    """Whether the compiled kernel runs here; see :func:`lnlib._cpu.kernels.info`.

    Returns
    -------
    dict
        ``{"kernel": bool, "reason": str, "path": str or None, "flags": list, "source": str}``.
    """
    return _kernels.info()


@contextlib.contextmanager
def disabled():
    """Deprecated: use ``lnlib.use_implementation("numpy")``, which this enters."""
    from ._backend import use_implementation

    with use_implementation("numpy"):
        yield
