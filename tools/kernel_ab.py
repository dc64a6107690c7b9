"""Time the CPU kernel of two git revisions side by side, in one process, on cache-resident rows.

    python tools/kernel_ab.py A B [--flags "-mavx2 -DNORMS_NO_CLONES"] [--shapes 256x256,64x1024]

Builds ``lnlib/_cpu/norms.c`` as it is at revisions ``A`` and ``B`` (any git revision;
``WORKTREE`` is the working tree) with the package's flags plus ``--flags``, loads both, and
calls their kernels in turn, one thread, on the same arrays: the ratio of the best times is robust
to the machine's drift, which moves both alike. ``--flags "-mavx2 -DNORMS_NO_CLONES"`` builds
the AVX2 version alone, as a CPU without AVX-512 runs it. Prints nanoseconds per element and
B/A for the four float32 and float64 kernels. For changes to the kernel's speed; the
benchmark of the package against torch is ``python -m lnlib.bench``.
"""

import argparse
import importlib.util
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
from cffi import FFI

ROOT = Path(__file__).resolve().parents[1]
KERNELS = "lnlib/_cpu"
#: Where revisions before the layout by backend kept the kernel (main file norms_cpu.c).
OLD_KERNELS = "lnlib/kernels"


def _builder():
    spec = importlib.util.spec_from_file_location("lnlib_cpu_build", ROOT / KERNELS / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _has(rev, path):
    """Whether git revision ``rev`` has the file ``path``."""
    cmd = ["git", "-C", str(ROOT), "cat-file", "-e", f"{rev}:{path}"]
    return subprocess.run(cmd, capture_output=True).returncode == 0


def build(rev, flags, where):
    """The kernel of ``rev`` compiled into a new folder in ``where``; returns the shared
    library's path."""
    src = where / f"{len(list(where.iterdir()))}_{rev.replace('/', '_')}"
    src.mkdir()
    if rev == "WORKTREE":
        files = {p.name: p.read_bytes() for p in (ROOT / KERNELS).glob("norms*.[ch]")}
    else:
        folder = KERNELS if _has(rev, f"{KERNELS}/norms.c") else OLD_KERNELS
        names = subprocess.run(
            ["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{rev}:{folder}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()
        files = {
            n: subprocess.run(
                ["git", "-C", str(ROOT), "show", f"{rev}:{folder}/{n}"],
                check=True,
                capture_output=True,
            ).stdout
            for n in names
            if n.startswith("norms") and n.endswith((".c", ".h"))
        }
    for name, data in files.items():
        (src / name).write_bytes(data)
    out = src / "norms.so"
    cmd = ["cc", *_builder().FLAGS, *flags, "-shared", "-fPIC", "-o", str(out)]
    main = src / ("norms.c" if "norms.c" in files else "norms_cpu.c")
    subprocess.run([*cmd, str(main), "-lm"], check=True)
    return out


class PerOp:
    """The per-op functions of the kernels before the two-function interface
    (``layer_norm_forward_f32``, ``add_rms_norm_backward_f16f32``, ...) over a kernel that exports
    ``norms_forward_*`` and ``norms_backward_*`` (a flag ``rms``; a residual, dh, bias or mean
    that may be NULL), so that revisions on both sides of the change are called alike."""

    def __init__(self, ffi, lib):
        self._lib, z = lib, ffi.NULL
        for s in ("f16", "f32", "f64", "f16f32"):
            f, g = getattr(lib, f"norms_forward_{s}"), getattr(lib, f"norms_backward_{s}")
            ops = {
                "add_layer_norm_forward": lambda *a, f=f: f(0, *a),
                "add_rms_norm_forward": lambda x, lx, r, lr, w, y, h, rs, m, n, e, f=f: f(
                    1, x, lx, r, lr, w, z, y, h, z, rs, m, n, e
                ),
                "add_layer_norm_backward": lambda *a, g=g: g(0, *a),
                "add_rms_norm_backward": lambda dy, ly, dh, lh, h, ld, rs, w, d, dw, m, n, g=g: g(
                    1, dy, ly, dh, lh, h, ld, z, rs, w, d, dw, z, m, n
                ),
                "layer_norm_forward": lambda x, lx, w, b, y, mu, rs, m, n, e, f=f: f(
                    0, x, lx, z, 0, w, b, y, z, mu, rs, m, n, e
                ),
                "rms_norm_forward": lambda x, lx, w, y, rs, m, n, e, f=f: f(
                    1, x, lx, z, 0, w, z, y, z, z, rs, m, n, e
                ),
                "layer_norm_backward": lambda dy, ly, x, lx, mu, rs, w, d, dw, db, m, n, g=g: g(
                    0, dy, ly, z, 0, x, lx, mu, rs, w, d, dw, db, m, n
                ),
                "rms_norm_backward": lambda dy, ly, x, lx, rs, w, d, dw, m, n, g=g: g(
                    1, dy, ly, z, 0, x, lx, z, rs, w, d, dw, z, m, n
                ),
            }
            for op, fn in ops.items():
                setattr(self, f"{op}_{s}", fn)

    def __getattr__(self, name):
        return getattr(self._lib, name)


def load(path):
    """The kernel built at ``path`` (by :func:`build`), declared from its own ``norms.h``:
    ``(ffi, lib)``, with ``lib`` a :class:`PerOp` over a kernel of the two-function interface."""
    ffi = FFI()
    header = path.parent / "norms.h"
    ffi.cdef(_builder().declarations(header))
    lib = ffi.dlopen(str(path))
    return ffi, PerOp(ffi, lib) if "norms_forward_f32" in header.read_text() else lib


def rows(m, n, dtype):
    """The arrays the kernels read and write at (m, n): the same ones for both revisions, so
    that neither gains from where its rows happen to lie in memory."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((m, n)) * 2 + 3).astype(dtype)
    dy, w, b = rng.standard_normal((m, n)).astype(dtype), np.ones(n, dtype), np.zeros(n, dtype)
    y, dx, mean, rstd = np.empty_like(x), np.empty_like(x), np.empty(m, dtype), np.empty(m, dtype)
    return x, dy, w, b, y, dx, mean, rstd, np.zeros((2, -(-m // 128), n))


def calls(ffi, lib, arrays):
    """The four kernels of ``lib`` as argument-free callables on ``arrays`` (:func:`rows`)."""
    x, dy, w, b, y, dx, mean, rstd, blocks = arrays
    m, n = x.shape
    ctype, sfx = ("float", "f32") if x.dtype == np.float32 else ("double", "f64")

    def p(a):
        return ffi.cast(("double" if a.dtype == np.float64 else ctype) + " *", a.ctypes.data)

    px, pdy, pw, pb, py, pdx, pm, pr = map(p, (x, dy, w, b, y, dx, mean, rstd))
    pdw, pdb = p(blocks[0]), p(blocks[1])
    if isinstance(lib, PerOp):  # the two-function interface, called directly (no extra call)
        z = ffi.NULL
        f, g = getattr(lib, f"norms_forward_{sfx}"), getattr(lib, f"norms_backward_{sfx}")
        return {
            "ln_fwd": lambda: f(0, px, n, z, 0, pw, pb, py, z, pm, pr, m, n, 1e-5),
            "rms_fwd": lambda: f(1, px, n, z, 0, pw, z, py, z, z, pr, m, n, 1e-5),
            "ln_bwd": lambda: g(0, pdy, n, z, 0, px, n, pm, pr, pw, pdx, pdw, pdb, m, n),
            "rms_bwd": lambda: g(1, pdy, n, z, 0, px, n, z, pr, pw, pdx, pdw, z, m, n),
        }
    f = {k: getattr(lib, f"{k}_{sfx}") for k in ("layer_norm_forward", "rms_norm_forward")}
    g = {k: getattr(lib, f"{k}_{sfx}") for k in ("layer_norm_backward", "rms_norm_backward")}
    return {
        "ln_fwd": lambda: f["layer_norm_forward"](px, n, pw, pb, py, pm, pr, m, n, 1e-5),
        "rms_fwd": lambda: f["rms_norm_forward"](px, n, pw, py, pr, m, n, 1e-5),
        "ln_bwd": lambda: g["layer_norm_backward"](pdy, n, px, n, pm, pr, pw, pdx, pdw, pdb, m, n),
        "rms_bwd": lambda: g["rms_norm_backward"](pdy, n, px, n, pr, pw, pdx, pdw, m, n),
    }


def best_times(fa, fb, reps):
    """Best seconds of ``fa`` and ``fb``, called in turn ``reps`` times each."""
    best = [float("inf"), float("inf")]
    for _ in range(reps):
        for k, fn in enumerate((fa, fb)):
            t = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t)
    return best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--flags", default="", help="extra compiler flags for both builds")
    parser.add_argument("--shapes", default="256x256,64x1024,32x768,8x4096")
    parser.add_argument("--reps", type=int, default=2000)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        libs = [load(build(r, args.flags.split(), Path(tmp))) for r in (args.a, args.b)]
        print(f"A = {args.a}, B = {args.b}, flags {args.flags or '(none)'}; ns per element")
        for dtype in (np.float32, np.float64):
            for shape in args.shapes.split(","):
                m, n = map(int, shape.split("x"))
                arrays = rows(m, n, dtype)
                fa, fb = (calls(ffi, lib, arrays) for ffi, lib in libs)
                cells = []
                for op in fa:
                    ta, tb = best_times(fa[op], fb[op], args.reps)
                    ns = 1e9 / (m * n)
                    cells.append(f"{op} {ta * ns:.3f} {tb * ns:.3f} ({tb / ta:.2f})")
                print(f"{np.dtype(dtype).name} {shape}: " + "  ".join(cells))


if __name__ == "__main__":
    main()
