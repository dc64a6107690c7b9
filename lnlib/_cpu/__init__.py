"""CPU implementations of the row operations, plugged into :mod:`lnlib._backend`.

:mod:`lnlib._cpu.numpy_rows` is the blocked NumPy fast path (every float dtype, no compiler);
:mod:`lnlib._cpu.kernels` binds the compiled C kernel (float16, float32, float64). Both take
rows ``(M, D)`` with the signatures listed in :mod:`lnlib._backend`.
"""
