"""Build step that pyproject.toml cannot express: compile the CPU kernel into the package.

``cffi_modules`` runs ``lnlib/_cpu/build.py``, which compiles ``norms.c`` into the
extension module ``lnlib._cpu._norms`` (an optional extension: without a C compiler the
install succeeds and lnlib runs its NumPy path, with a warning at first use). The
``build_ext`` below then records the module's sha256 beside it, which lnlib checks before
loading the module. All other metadata is in ``pyproject.toml``.
"""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

# lnlib/_cpu/build.py, loaded from its file: importing the package would need NumPy at build time.
_spec = importlib.util.spec_from_file_location(
    "lnlib_cpu_build", Path(__file__).resolve().parent / "lnlib" / "_cpu" / "build.py"
)
_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_build)
DIGEST_FILE, MODULE, record_digest = _build.DIGEST_FILE, _build.MODULE, _build.record_digest


class BuildExtRecordingDigest(build_ext):
    """``build_ext`` that writes the sha256 of the kernel module it built beside it, in the
    build folder (it goes into the wheel) and, for an editable install, in the source tree."""

    def _kernel_paths(self):
        for ext in self.extensions:
            if ext.name == MODULE:
                built = Path(self.build_lib) / self.get_ext_filename(ext.name)
                yield from {built, Path(self.get_ext_fullpath(ext.name))}

    def run(self):
        super().run()
        for path in self._kernel_paths():
            if path.exists():  # not there when the optional build failed
                record_digest(path)

    def get_outputs(self):
        return super().get_outputs() + [str(p.parent / DIGEST_FILE) for p in self._kernel_paths()]


setup(
    cffi_modules=["lnlib/_cpu/build.py:ffibuilder"],
    cmdclass={"build_ext": BuildExtRecordingDigest},
)
