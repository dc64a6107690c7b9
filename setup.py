"""Build step that pyproject.toml cannot express: compile the CPU kernel into the package.

``cffi_modules`` runs ``lnlib/kernels/build_norms.py``, which compiles ``norms_cpu.c`` into the
extension module ``lnlib._cpu._norms`` (an optional extension: without a C compiler the
install succeeds and lnlib runs its NumPy path, with a warning at first use). All other
metadata is in ``pyproject.toml``.
"""

from setuptools import setup

setup(cffi_modules=["lnlib/kernels/build_norms.py:ffibuilder"])
