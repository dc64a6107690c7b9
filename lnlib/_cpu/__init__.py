"""lnlib on the CPU: the C kernel's source (``norms.c``, ``norms.h``), its build script
(``build.py``, run by setuptools), its binding and row implementations (:mod:`lnlib._cpu.c_kernel`,
float16, float32, float64) and the blocked NumPy fast path (:mod:`lnlib._cpu.numpy_path`, every
float dtype, no compiler). Both take rows ``(M, D)`` with the row contract of
:mod:`lnlib._rows`.
"""
