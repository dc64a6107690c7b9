"""Time the CPU kernel of two git revisions side by side, in one process, on cache-resident rows.

    python tools/kernel_ab.py A B [--flags "-mavx2 -DNORMS_NO_CLONES"] [--shapes 256x256,64x1024]

Builds ``lnlib/_cpu/norms.c`` as it is at revisions ``A`` and ``B`` (any git revision;
``WORKTREE`` is the working tree) with the package's flags plus ``--flags``, loads both, and
calls their kernels in turn, one thread, on the same rows: the ratio of the best times is robust
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
    """The kernel of ``rev`` compiled into ``where``; returns the shared library's path."""
    src = where / rev.replace("/", "_")
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


def calls(ffi, lib, m, n, dtype):
    """The four kernels of ``lib`` as argument-free callables on fixed (m, n) rows."""
    rng = np.random.default_rng(0)
    ctype, sfx = ("float", "f32") if dtype == np.float32 else ("double", "f64")
    x = (rng.standard_normal((m, n)) * 2 + 3).astype(dtype)
    dy, w, b = rng.standard_normal((m, n)).astype(dtype), np.ones(n, dtype), np.zeros(n, dtype)
    y, dx, mean, rstd = np.empty_like(x), np.empty_like(x), np.empty(m, dtype), np.empty(m, dtype)
    blocks = np.zeros((2, -(-m // 128), n))
    keep = [x, dy, w, b, y, dx, mean, rstd, blocks]  # alive as long as the pointers

    def p(a):
        return ffi.cast(("double" if a.dtype == np.float64 else ctype) + " *", a.ctypes.data)

    px, pdy, pw, pb, py, pdx, pm, pr = map(p, (x, dy, w, b, y, dx, mean, rstd))
    pdw, pdb = p(blocks[0]), p(blocks[1])
    f = {k: getattr(lib, f"{k}_{sfx}") for k in ("layer_norm_forward", "rms_norm_forward")}
    g = {k: getattr(lib, f"{k}_{sfx}") for k in ("layer_norm_backward", "rms_norm_backward")}
    return keep, {
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
    ffi = FFI()
    ffi.cdef(_builder().declarations(ROOT / KERNELS / "norms.h"))
    with tempfile.TemporaryDirectory() as tmp:
        libs = [ffi.dlopen(str(build(r, args.flags.split(), Path(tmp)))) for r in (args.a, args.b)]
        print(f"A = {args.a}, B = {args.b}, flags {args.flags or '(none)'}; ns per element")
        for dtype in (np.float32, np.float64):
            for shape in args.shapes.split(","):
                m, n = map(int, shape.split("x"))
                (ka, fa), (kb, fb) = (calls(ffi, lib, m, n, dtype) for lib in libs)
                cells = []
                for op in fa:
                    ta, tb = best_times(fa[op], fb[op], args.reps)
                    ns = 1e9 / (m * n)
                    cells.append(f"{op} {ta * ns:.3f} {tb * ns:.3f} ({tb / ta:.2f})")
                print(f"{np.dtype(dtype).name} {shape}: " + "  ".join(cells))


if __name__ == "__main__":
    main()
