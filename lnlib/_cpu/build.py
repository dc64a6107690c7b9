"""Build the CPU kernels (``norms.c``) into the extension module ``lnlib._cpu._norms``.

setuptools runs this file when the package is built (``cffi_modules`` in ``setup.py``), so
``pip install .``, ``pip install git+...``, ``pip wheel .`` and the editable install compile the
kernel into the package. It uses cffi's out-of-line API mode: cffi reads the declarations of
``norms.h`` and generates a C module that includes the same header, so the compiler checks the
binding against the kernel and a call with the wrong number or types of arguments raises
``TypeError`` in Python instead of passing silently.

The extension is optional: without a C compiler the build only warns, the package installs
without it and lnlib runs its NumPy path (``lnlib._cpu.c_kernel.info()`` says why).

Run ``python lnlib/_cpu/build.py`` from the repository root to build it in place.
Either way the module's sha256 is recorded beside it (:func:`record_digest`).
"""

import hashlib
import os
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
MODULE = "lnlib._cpu._norms"
#: The file beside the built module that holds its sha256 (``lnlib._cpu.c_kernel`` reads it).
DIGEST_FILE = "_norms.sha256"
#: -ffp-contract=off: no fused multiply-add, each operation rounds as written, so results do
#: not depend on the CPU; no -march for the same reason; -fno-math-errno lets sqrt inline.
FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno"]


def declarations(header=HERE / "norms.h"):
    """The C declarations of ``header`` without its preprocessor lines (cffi reads plain C)."""
    lines = Path(header).read_text().splitlines()
    return "\n".join(line for line in lines if not line.lstrip().startswith("#"))


def record_digest(library):
    """Write the sha256 of the built module ``library`` beside it, in :data:`DIGEST_FILE`, as
    ``<hex digest>  <file name>`` (the format of ``sha256sum``).

    lnlib checks the module against it before loading it, and falls back to its NumPy path on
    a mismatch: a damaged library can kill the process inside ``dlopen``, before any Python
    check of what it loaded could run.
    """
    library = Path(library)
    digest = hashlib.sha256(library.read_bytes()).hexdigest()
    (library.parent / DIGEST_FILE).write_text(f"{digest}  {library.name}\n")


def _relative(path):
    """``path`` relative to the working directory: setuptools wants relative source paths."""
    return os.path.relpath(path)


ffibuilder = FFI()
ffibuilder.cdef(declarations())
ffibuilder.set_source(
    MODULE,
    '#include "norms.h"',
    sources=[_relative(HERE / "norms.c")],
    include_dirs=[_relative(HERE)],
    depends=[_relative(HERE / name) for name in ("norms.h", "norms_rows.h")],
    extra_compile_args=FLAGS,
    libraries=["m"] if os.name == "posix" else [],
    optional=True,
)

if __name__ == "__main__":
    record_digest(ffibuilder.compile(verbose=True))
