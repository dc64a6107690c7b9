"""The compiled CPU kernels of ``lnlib/kernels/norms_cpu.c``: built once, lazily, loaded with ctypes.

On the first call of a fast path the C source is compiled with the system C compiler into a
cache folder (``$LNLIB_CACHE_DIR``, else ``$XDG_CACHE_HOME/lnlib`` or ``~/.cache/lnlib``), under
a name that hashes the source and the flags, so an edited kernel is rebuilt and an unchanged
one is reused. ``import lnlib`` compiles nothing.

Without a compiler the NumPy fast paths are used instead (``LNLIB_CPU_KERNEL=0`` is read by
the selection point, :mod:`lnlib._backend`); :func:`info` says whether the kernel loaded and why. Both give results that agree to
rounding; each is bitwise batch invariant on its own.
"""

import contextlib
import ctypes
import hashlib
import os
import platform
import shlex
import subprocess
import sysconfig
import tempfile
import threading
from pathlib import Path

import numpy as np

from ._rows import contiguous_rows

SOURCE = Path(__file__).with_name("kernels") / "norms_cpu.c"
# -ffp-contract=off: no fused multiply-adds, so each operation rounds as written.
FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC"]

_lock = threading.Lock()
_state = {"lib": None, "tried": False, "reason": "not loaded yet", "path": None, "enabled": True}

_P = ctypes.c_void_p
_N = ctypes.c_ssize_t
_SIGNATURES = {
    "layer_norm_fwd": [_P, _N, _P, _N, _P, _P, _P, _P, _N, _N, ctypes.c_double],
    "layer_norm_bwd": [_P, _N, _P, _N, _P, _P, _P, _P, _N, _P, _P, _N, _N],
    "rms_norm_fwd": [_P, _N, _P, _N, _P, _P, _N, _N, ctypes.c_double],
    "rms_norm_bwd": [_P, _N, _P, _N, _P, _P, _P, _N, _P, _N, _N],
}


def _compiler():
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return shlex.split(cc)[:1]


def _cache_dir():
    root = os.environ.get("LNLIB_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "lnlib"


def _build():
    source = SOURCE.read_bytes()
    cc = _compiler()
    key = hashlib.sha256(source + " ".join(cc + FLAGS + [platform.machine()]).encode()).hexdigest()[:16]
    for folder in (_cache_dir(), Path(tempfile.gettempdir()) / "lnlib-kernels"):
        target = folder / f"norms_cpu-{key}.so"
        if target.exists():
            return target
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
            os.close(fd)
        except OSError:
            continue  # not writable: try the next folder
        try:
            subprocess.run(cc + FLAGS + ["-o", tmp, str(SOURCE), "-lm"], check=True,
                           capture_output=True, text=True, timeout=120)
            os.replace(tmp, target)  # atomic: concurrent builders never see half a file
            return target
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    raise OSError("no writable cache folder for the compiled kernel")


def library():
    """The loaded kernel library, or None if it cannot be built here (see :func:`info`)."""
    if _state["tried"]:
        return _state["lib"]
    with _lock:
        if _state["tried"]:
            return _state["lib"]
        # LNLIB_CPU_KERNEL is read by the selection point, lnlib._backend.
        try:
            path = _build()
            lib = ctypes.CDLL(str(path))
            for name, argtypes in _SIGNATURES.items():
                for suffix in ("f32", "f64"):
                    fn = getattr(lib, f"{name}_{suffix}")
                    fn.argtypes, fn.restype = argtypes, None
            _state.update(lib=lib, path=str(path), reason="compiled kernel loaded")
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", "") or str(exc)
            _state["reason"] = f"compiled kernel unavailable ({detail.strip()[:300]}); using NumPy"
        _state["tried"] = True
        return _state["lib"]


def info():
    """Which CPU fast path runs: ``{"kernel": bool, "reason": str, "path": str or None}``."""
    library()
    return {"kernel": _state["lib"] is not None, "reason": _state["reason"], "path": _state["path"]}


@contextlib.contextmanager
def disabled():
    """Deprecated: use ``lnlib.use_implementation("numpy")``, which this now enters."""
    from ._backend import use_implementation

    before = _state["enabled"]
    _state["enabled"] = False
    try:
        with use_implementation("numpy"):
            yield
    finally:
        _state["enabled"] = before


def function(name, dtype):
    """The C function ``name`` for ``dtype`` (float32 or float64), or None."""
    if not _state["enabled"]:
        return None
    lib = library()
    if lib is None or dtype not in (np.float32, np.float64):
        return None
    return getattr(lib, f"{name}_{'f32' if dtype == np.float32 else 'f64'}")


def rows_for_kernel(a, dtype):
    """``a`` (2-d) as rows the kernel can read: contiguous, forwards, of ``dtype``."""
    if a.dtype == dtype and contiguous_rows(a):
        return a
    return np.ascontiguousarray(a, dtype=dtype)


def ptr(a, row=0):
    """Address of row ``row`` of ``a`` (or of ``a`` itself), for ctypes; None stays None."""
    if a is None:
        return None
    return a.ctypes.data + row * (a.strides[0] if a.ndim == 2 else a.itemsize)


def ld(a):
    """Leading dimension (row stride in elements) of a 2-d array."""
    return a.strides[0] // a.itemsize
