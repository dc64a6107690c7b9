"""Compare the CPU kernel of two git revisions bit for bit.

    python tools/kernel_bits.py A B [--flags "-DNORMS_NO_CLONES"]

Builds ``lnlib/_cpu/norms.c`` as it is at revisions ``A`` and ``B`` (``WORKTREE`` is the
working tree) the way ``tools/kernel_ab.py`` does, calls every LayerNorm and RMSNorm kernel,
forward and backward, in float16, float32 and float64, and the fused residual add kernels
(``add_*``, also ``_f16f32``: float16 x, float stream; with and without dh) of both on the same
inputs, and compares every output (y, h, mean, rstd, dx or dsum, the summed dweight and dbias)
bitwise. The cases cover n from
1 to 5000 with odd tails, 1 to 40 rows, padded rows (ldx > n), weight and bias absent (ones and
zeros, as the binding passes them) or random, several eps, and rows holding NaN or inf.
Prints the number of comparisons and of differences; exits 1 if any differ. The backward
kernels of both get the same mean and rstd (those of A's forward), so a difference is located.
"""

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("kernel_ab", ROOT / "tools" / "kernel_ab.py")
kernel_ab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kernel_ab)

NS = [
    1,
    2,
    3,
    7,
    15,
    16,
    17,
    31,
    33,
    63,
    64,
    65,
    100,
    127,
    128,
    129,
    255,
    257,
    511,
    768,
    1000,
    1023,
    1025,
    2047,
    2049,
    4095,
    4096,
    5000,
]
MS = [1, 2, 3, 5, 17, 40]
EPS = [1e-5, 1e-12, 0.5]


def cases(rng):
    """(m, n, ld, eps, weighted, special) for every case."""
    for n in NS:
        for m in MS if n <= 1100 else (1, 3, 40):
            k = rng.integers(1 << 30)
            yield m, n, n + (k % 3 == 0) * 5, EPS[k % 3], bool(k & 4), None
    for n in (1, 17, 300, 4097):
        for special in ("nan", "inf", "-inf", "big", "const"):
            yield 4, n, n, 1e-5, True, special


def inputs(rng, m, n, ld, weighted, special):
    x = (rng.standard_normal((m, ld)) * 3 + 2).astype(np.float64)
    dy = rng.standard_normal((m, ld))
    if special == "const":
        x[1, :] = 7.25
    elif special == "big":
        x[1, :] *= 1e30
    elif special is not None:
        x[1, n // 2] = float(special)
        dy[2, n // 3] = float(special)
    w = rng.standard_normal(n) if weighted else np.ones(n)
    b = rng.standard_normal(n) if weighted else np.zeros(n)
    return x, dy, w, b


class Kernel:
    def __init__(self, ffi, lib):
        self.ffi, self.lib = ffi, lib

    def p(self, a):
        ctype = {np.float32: "float", np.float64: "double", np.uint16: "uint16_t"}
        return self.ffi.cast(ctype[a.dtype.type] + " *", a.ctypes.data)

    def run(self, dtype, m, n, ld, eps, x, dy, w, b, stats=None):
        """Every output of the four kernels of one element type, as a dict of arrays."""
        lib, p = self.lib, self.p
        sfx = {np.float16: "f16", np.float32: "f32", np.float64: "f64"}[dtype]
        pt = np.float32 if dtype == np.float16 else dtype  # weight, mean, rstd
        with np.errstate(over="ignore"):  # the "big" rows overflow float16 on purpose
            xs = np.ascontiguousarray(x.astype(dtype))
            dys = np.ascontiguousarray(dy.astype(dtype))
        if dtype == np.float16:
            xs, dys = xs.view(np.uint16), dys.view(np.uint16)
        ws, bs = w.astype(pt), b.astype(pt)
        out = {}
        y, mean, rstd = np.empty((m, n), xs.dtype), np.empty(m, pt), np.empty(m, pt)
        getattr(lib, f"layer_norm_forward_{sfx}")(
            p(xs), ld, p(ws), p(bs), p(y), p(mean), p(rstd), m, n, eps
        )
        out.update(ln_y=y, ln_mean=mean, ln_rstd=rstd)
        y2, rstd2 = np.empty((m, n), xs.dtype), np.empty(m, pt)
        getattr(lib, f"rms_norm_forward_{sfx}")(p(xs), ld, p(ws), p(y2), p(rstd2), m, n, eps)
        out.update(rms_y=y2, rms_rstd=rstd2)
        if stats is not None:  # the same statistics for both revisions' backward
            mean, rstd, rstd2 = (s.copy() for s in stats)
        nb = -(-m // 128)
        dx, dw, db = np.empty((m, n), xs.dtype), np.zeros((nb, n)), np.zeros((nb, n))
        getattr(lib, f"layer_norm_backward_{sfx}")(
            p(dys), ld, p(xs), ld, p(mean), p(rstd), p(ws), p(dx), p(dw), p(db), m, n
        )
        lib.sum_blocks_pairwise(p(dw), nb, n)
        lib.sum_blocks_pairwise(p(db), nb, n)
        out.update(ln_dx=dx, ln_dw=dw[0], ln_db=db[0])
        dx2, dw2 = np.empty((m, n), xs.dtype), np.zeros((nb, n))
        getattr(lib, f"rms_norm_backward_{sfx}")(
            p(dys), ld, p(xs), ld, p(rstd2), p(ws), p(dx2), p(dw2), m, n
        )
        lib.sum_blocks_pairwise(p(dw2), nb, n)
        out.update(rms_dx=dx2, rms_dw=dw2[0])
        stream = [dtype] + ([np.float32] if dtype == np.float16 else [])
        for hd in stream:  # the fused residual add: h in x's dtype, or float32 for float16 x
            out.update(self.fused(dtype, hd, m, n, ld, eps, x, dy, ws, bs, xs, dys, nb))
        return out, (out["ln_mean"], out["ln_rstd"], out["rms_rstd"])

    def fused(self, dtype, hd, m, n, ld, eps, x, dy, ws, bs, xs, dys, nb):
        """Every output of the add_* kernels with stream dtype ``hd``, keys prefixed."""
        lib, p = self.lib, self.p
        sfx = {np.float16: "f16", np.float32: "f32", np.float64: "f64"}[dtype]
        sfx += "f32" if hd != dtype else ""
        pt = np.float32 if dtype == np.float16 else dtype
        with np.errstate(over="ignore"):
            res = np.ascontiguousarray((x[:, ::-1] * 0.5).astype(hd))
            dh = np.ascontiguousarray((dy[::-1] * 2).astype(hd))
        if hd == np.float16:
            res, dh = res.view(np.uint16), dh.view(np.uint16)
        hview = res.dtype
        tag, out = f"add{'' if hd == dtype else '32'}_", {}
        y, h = np.empty((m, n), xs.dtype), np.empty((m, n), hview)
        mean, rstd, rstd2 = np.empty(m, pt), np.empty(m, pt), np.empty(m, pt)
        fwd = getattr(lib, f"add_layer_norm_forward_{sfx}")
        fwd(p(xs), ld, p(res), ld, p(ws), p(bs), p(y), p(h), p(mean), p(rstd), m, n, eps)
        y2, h2 = np.empty((m, n), xs.dtype), np.empty((m, n), hview)
        getattr(lib, f"add_rms_norm_forward_{sfx}")(
            p(xs), ld, p(res), ld, p(ws), p(y2), p(h2), p(rstd2), m, n, eps
        )
        out.update({tag + "ln_y": y, tag + "ln_h": h, tag + "ln_mean": mean})
        out.update({tag + "ln_rstd": rstd, tag + "rms_y": y2, tag + "rms_h": h2})
        out[tag + "rms_rstd"] = rstd2
        for with_dh in (True, False):
            t = tag + ("dh_" if with_dh else "")
            pdh = p(dh) if with_dh else self.ffi.NULL
            ds, dw, db = np.empty((m, n), hview), np.zeros((nb, n)), np.zeros((nb, n))
            getattr(lib, f"add_layer_norm_backward_{sfx}")(
                p(dys), ld, pdh, ld, p(h), n, p(mean), p(rstd), p(ws), p(ds), p(dw), p(db), m, n
            )
            lib.sum_blocks_pairwise(p(dw), nb, n)
            lib.sum_blocks_pairwise(p(db), nb, n)
            ds2, dw2 = np.empty((m, n), hview), np.zeros((nb, n))
            getattr(lib, f"add_rms_norm_backward_{sfx}")(
                p(dys), ld, pdh, ld, p(h2), n, p(rstd2), p(ws), p(ds2), p(dw2), m, n
            )
            lib.sum_blocks_pairwise(p(dw2), nb, n)
            out.update({t + "ln_dsum": ds, t + "ln_dw": dw[0], t + "ln_db": db[0]})
            out.update({t + "rms_dsum": ds2, t + "rms_dw": dw2[0]})
        return out


def compare(ka, kb, verbose=False):
    """(comparisons, differences, first differing cases) over every case and dtype."""
    rng = np.random.default_rng(22)
    total = diffs = 0
    where = []
    for m, n, ld, eps, weighted, special in cases(rng):
        x, dy, w, b = inputs(rng, m, n, ld, weighted, special)
        for dtype in (np.float16, np.float32, np.float64):
            oa, stats = ka.run(dtype, m, n, ld, eps, x, dy, w, b)
            ob, _ = kb.run(dtype, m, n, ld, eps, x, dy, w, b, stats)
            for key in oa:
                a, bb = oa[key].view(np.uint8), ob[key].view(np.uint8)
                width = oa[key].dtype.itemsize
                bad = int((a.reshape(-1, width) != bb.reshape(-1, width)).any(1).sum())
                total += oa[key].size
                diffs += bad
                if bad and len(where) < 10:
                    where.append(
                        f"{np.dtype(dtype).name} {key} m={m} n={n} ld={ld} "
                        f"eps={eps} weighted={weighted} special={special}: {bad}"
                    )
    return total, diffs, where


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--flags", default="", help="extra compiler flags for both builds")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        ka, kb = (
            Kernel(*kernel_ab.load(kernel_ab.build(r, args.flags.split(), Path(tmp))))
            for r in (args.a, args.b)
        )
        total, diffs, where = compare(ka, kb)
    print(
        f"A = {args.a}, B = {args.b}, flags {args.flags or '(none)'}: "
        f"{total} values compared, {diffs} differ"
    )
    for line in where:
        print("  " + line)
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
