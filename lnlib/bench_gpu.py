"""GPU benchmark: lnlib's CUDA kernels against torch on the same device, and the copy bound.

``python -m lnlib.bench --gpu`` (or ``python -m lnlib.bench_gpu``) times, at about 2^27
elements per call, float32 and float16:

* LayerNorm and RMSNorm forward, and forward + backward (parameter gradients included), for
  row lengths D of 768 to 65536, through lnlib's public functions on CuPy arrays (the CUDA
  kernels), and through ``torch.nn.functional.layer_norm`` / ``rms_norm`` (autograd for the
  backward);
* AdaLN (DiT's modulated LayerNorm) forward, and forward + backward, for D of 768, 1152 and
  4096: x of shape (B, T, D) with T = 256 tokens and one shift and scale (B, 1, D) per example,
  through ``lnlib.ada_layer_norm_forward`` / ``ada_layer_norm_backward`` (the modulated CUDA
  kernels) and through torch as DiT writes it,
  ``layer_norm(x, (D,), eps=1e-6) * (1 + scale) + shift`` (autograd for the backward);
* a device-to-device copy of 2^28 bytes, the bound a memory-bound kernel can approach.

Bandwidth counts the bytes each pass must move, the same for both contenders (torch's
unfused AdaLN moves more, so its GB/s are what its time gives for lnlib's traffic): the
forward reads x and the parameters (weight, bias; AdaLN's shift and scale) and writes y and the
per-row statistics (mean and rstd; rstd only for RMSNorm); the backward reads dy, x, the
statistics and the weight (AdaLN: scale) and writes dx and the parameter gradients
(:func:`pass_bytes`). Each timing is a CUDA-event interval around ``--calls`` calls; the
contenders alternate within every repeat and the median over repeats is reported. Every
contender is checked against the other before it is timed. The JSON result is named after the
GPU (``gpu_nvidia_h200.json``), in ``lnlib/data`` when run from the repository root (committed
results), else in the current folder, or in ``--out-dir``.

Derived in the book, chapter "Implementation", section "GPU kernels".
"""

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

import numpy as np

import lnlib

WIDTHS = (768, 1024, 2048, 4096, 8192, 16384, 65536)
#: AdaLN's row lengths: DiT-B's 768, DiT-XL's 1152, and 4096.
ADA_WIDTHS = (768, 1152, 4096)
#: AdaLN's tokens per example, T (DiT-XL/2 at 256 x 256: 16 x 16 patches).
ADA_TOKENS = 256
ADA_EPS = 1e-6  # DiT's
OPS = ("layer_norm", "rms_norm", "ada_layer_norm")
ELEMENTS = 1 << 27
COPY_BYTES = 1 << 28
#: Where the committed results live in the repository (``lnlib.data``); elsewhere: here.
DEFAULT_DIR = Path("lnlib") / "data" if (Path("lnlib") / "data").is_dir() else Path()


def _events(cp, fn, calls):
    """Milliseconds per call of ``fn``, by CUDA events around ``calls`` calls."""
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(calls):
        fn()
    stop.record()
    stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop) / calls


def copy_bandwidth(cp, repeats, calls, nbytes=COPY_BYTES):
    """GB/s (bytes read + written) of a device-to-device copy of ``nbytes``."""
    src = cp.ones(nbytes // 4, dtype=cp.float32)
    dst = cp.empty_like(src)

    def fn():
        dst.data.copy_from_device_async(src.data, nbytes)

    fn()
    ms = statistics.median(_events(cp, fn, calls) for _ in range(repeats))
    return 2 * nbytes / ms / 1e6


def ada_shape(d, elements=None):
    """AdaLN's ``(B, T)`` for rows of ``d``: T = :data:`ADA_TOKENS` and B the examples that
    fit in ``elements`` (default :data:`ELEMENTS`), at least one; so B * T rows are the
    other ops' ``elements // d`` rounded down to a multiple of T (0.1 % fewer at d = 768)."""
    elements = ELEMENTS if elements is None else elements
    return max(1, elements // d // ADA_TOKENS), ADA_TOKENS


def pass_bytes(op, m, d, dtype, mods=1):
    """``(forward, backward)``: the bytes one forward and one backward of ``op`` on ``m`` rows
    of ``d`` elements of ``dtype`` must move, each array read or written once:

    * forward: x read, y written (m * d each); the parameters read (LayerNorm's weight and bias,
      RMSNorm's weight: d each; AdaLN's shift and scale: ``mods`` * d each, one row per
      example); mean and rstd written (rstd only for RMSNorm), m each in the accumulation dtype;
    * backward: dy and x read, dx written (m * d each); the weight read (AdaLN: scale) and the
      parameter gradients written (dweight, dbias; dweight; dshift, dscale); the statistics read.

    Parameters and their gradients are counted in the dtype of x, as torch holds them."""
    item = np.dtype(dtype).itemsize
    acc = 8 if item == 8 else 4  # the statistics: float32, float64 for float64 x
    params = 1 if op == "rms_norm" else 2  # arrays of parameters in the forward
    p = mods * d if op == "ada_layer_norm" else d  # elements of each
    stats = (1 if op == "rms_norm" else 2) * m * acc
    fwd = 2 * m * d * item + params * p * item + stats
    bwd = 3 * m * d * item + (params + 1) * p * item + stats
    return fwd, bwd


def _contenders(cp, torch, op, x, w, b, dy):
    """``{(who, pass): (callable, bytes)}`` for one shape: x and dy (M, D), w and b (D,); for
    AdaLN x and dy (B, T, D) and w, b the scale and shift (B, 1, D)."""
    F = torch.nn.functional
    d = x.shape[-1]
    m = x.size // d
    xt, wt, bt, dyt = (torch.from_dlpack(a) for a in (x, w, b, dy))
    xr = xt.detach().clone().requires_grad_(True)
    wr = wt.detach().clone().requires_grad_(True)
    br = bt.detach().clone().requires_grad_(True)
    fwd_bytes, bwd_bytes = pass_bytes(op, m, d, x.dtype, w.size // d)
    if op == "ada_layer_norm":  # w: scale, b: shift, as DiT's modulate(x, shift, scale)

        def ln_fwd():
            return lnlib.ada_layer_norm_forward(x, b, w, eps=ADA_EPS)

        def ln_fb():
            _y, mean, rstd = lnlib.ada_layer_norm_forward(x, b, w, eps=ADA_EPS)
            return lnlib.ada_layer_norm_backward(dy, x, mean, rstd, w)  # dx, dshift, dscale

        def t_fwd():
            return F.layer_norm(xt, (d,), eps=ADA_EPS) * (1 + wt) + bt

        def t_fb():
            y = F.layer_norm(xr, (d,), eps=ADA_EPS) * (1 + wr) + br
            return torch.autograd.grad(y, (xr, br, wr), dyt)
    elif op == "layer_norm":

        def ln_fwd():
            return lnlib.layer_norm_forward(x, w, b)

        def ln_fb():
            _y, mean, rstd = lnlib.layer_norm_forward(x, w, b)
            return lnlib.layer_norm_backward(dy, x, mean, rstd, w)

        def t_fwd():
            return F.layer_norm(xt, (d,), wt, bt, 1e-5)

        def t_fb():
            y = F.layer_norm(xr, (d,), wr, br, 1e-5)
            return torch.autograd.grad(y, (xr, wr, br), dyt)
    else:

        def ln_fwd():
            return lnlib.rms_norm_forward(x, w)

        def ln_fb():
            _y, rstd = lnlib.rms_norm_forward(x, w)
            return lnlib.rms_norm_backward(dy, x, rstd, w)

        def t_fwd():
            return F.rms_norm(xt, (d,), wt, 1e-6)

        def t_fb():
            y = F.rms_norm(xr, (d,), wr, 1e-6)
            return torch.autograd.grad(y, (xr, wr), dyt)

    return {
        ("lnlib", "forward"): (ln_fwd, fwd_bytes),
        ("torch", "forward"): (t_fwd, fwd_bytes),
        ("lnlib", "forward+backward"): (ln_fb, fwd_bytes + bwd_bytes),
        ("torch", "forward+backward"): (t_fb, fwd_bytes + bwd_bytes),
    }


def _check(cp, torch, runs, dtype):
    """lnlib and torch agree on the outputs before anything is timed: y, and every gradient
    torch returns (dx and the parameter gradients, in the same order as lnlib's)."""
    tol = 5e-2 if dtype == np.float16 else 2e-3
    for kind in ("forward", "forward+backward"):
        ours = runs[("lnlib", kind)][0]()
        theirs = runs[("torch", kind)][0]()
        theirs = (theirs,) if kind == "forward" else tuple(theirs)
        ours = ours[: len(theirs)]
        for i, (a, t) in enumerate(zip(ours, theirs)):
            got = torch.from_dlpack(a).double()
            want = t.detach().double()
            if got.shape != want.shape:
                raise AssertionError(
                    f"lnlib and torch differ ({kind}, output {i}): shapes "
                    f"{tuple(got.shape)} and {tuple(want.shape)}"
                )
            scale = max(1.0, float(want.abs().max()))
            err = float((got - want).abs().max())
            if not err <= tol * scale * (1 if kind == "forward" else 50):
                raise AssertionError(f"lnlib and torch differ ({kind}, output {i}): {err:.3g}")


def bench_shape(cp, torch, op, d, dtype, repeats, calls, copy_gbps, rng):
    """One row of results: lnlib and torch bandwidth, fraction of copy, ratio to torch."""
    if op == "ada_layer_norm":  # (B, T, D), one scale (w) and shift (b) an example
        batch, tokens = ada_shape(d)
        shape, pshape, m = (batch, tokens, d), (batch, 1, d), batch * tokens
    else:
        m = max(1, ELEMENTS // d)
        shape, pshape = (m, d), (d,)
    x = rng.standard_normal(shape, dtype=cp.float32).astype(dtype)
    dy = rng.standard_normal(shape, dtype=cp.float32).astype(dtype)
    w = rng.standard_normal(pshape, dtype=cp.float32).astype(dtype)
    b = rng.standard_normal(pshape, dtype=cp.float32).astype(dtype)
    runs = _contenders(cp, torch, op, x, w, b, dy)
    _check(cp, torch, runs, dtype)
    times = {key: [] for key in runs}
    for _ in range(repeats):
        for key, (fn, _) in runs.items():  # interleaved: every contender in every repeat
            times[key].append(_events(cp, fn, calls))
    rows = []
    for kind in ("forward", "forward+backward"):
        ms = {who: statistics.median(times[(who, kind)]) for who in ("lnlib", "torch")}
        gbps = {who: runs[(who, kind)][1] / ms[who] / 1e6 for who in ms}
        rows.append(
            {
                "op": op,
                "pass": kind,
                "dtype": np.dtype(dtype).name,
                "M": m,
                "D": d,
                "lnlib_ms": ms["lnlib"],
                "torch_ms": ms["torch"],
                "lnlib_GBps": gbps["lnlib"],
                "torch_GBps": gbps["torch"],
                "copy_fraction": gbps["lnlib"] / copy_gbps,
                "speedup_vs_torch": ms["torch"] / ms["lnlib"],
            }
        )
    return rows


def gpu_name(cp):
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = props["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def run(
    widths=WIDTHS,
    dtypes=("float32", "float16"),
    ops=OPS,
    repeats=15,
    calls=5,
    ada_widths=ADA_WIDTHS,
):
    """Run the whole benchmark; returns the JSON-ready result. ``widths``: the D of LayerNorm
    and RMSNorm; ``ada_widths``: AdaLN's (x of shape (B, T, D), :func:`ada_shape`)."""
    import cupy as cp
    import torch

    rng = cp.random.default_rng(0)
    copy_gbps = copy_bandwidth(cp, repeats, calls)
    results, failures = [], []
    for dtype in dtypes:
        for op in ops:
            for d in ada_widths if op == "ada_layer_norm" else widths:
                try:
                    rows = bench_shape(
                        cp, torch, op, d, np.dtype(dtype), repeats, calls, copy_gbps, rng
                    )
                except Exception as exc:  # a wrong result or a CUDA error: record it, go on
                    failures.append({"op": op, "dtype": dtype, "D": d, "error": repr(exc)})
                    print(f"FAILED {op} {dtype} D={d}: {exc!r}", flush=True)
                    continue
                print(format_rows(rows, header=not results), flush=True)
                results += rows
    return {
        "gpu": gpu_name(cp),
        "cupy": cp.__version__,
        "torch": torch.__version__,
        "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
        "copy_GBps": copy_gbps,
        "copy_bytes": COPY_BYTES,
        "elements_per_call": ELEMENTS,
        "ada_tokens": ADA_TOKENS,  # AdaLN rows: M = B * T, x (B, T, D), shift and scale (B, 1, D)
        "repeats": repeats,
        "calls_per_timing": calls,
        "results": results,
        "failures": failures,  # shapes whose check or run raised: not in results
    }


def format_rows(rows, header=True):
    lines = (
        [
            (
                f"{'op':<15}{'pass':<17}{'dtype':<8}{'D':>6}{'lnlib GB/s':>12}{'torch GB/s':>12}"
                f"{'of copy':>9}{'vs torch':>9}"
            )
        ]
        if header
        else []
    )
    for r in rows:
        lines.append(
            f"{r['op']:<15}{r['pass']:<17}{r['dtype']:<8}{r['D']:>6}"
            f"{r['lnlib_GBps']:>12.0f}{r['torch_GBps']:>12.0f}"
            f"{100 * r['copy_fraction']:>8.0f}%{r['speedup_vs_torch']:>8.2f}x"
        )
    return "\n".join(lines)


def result_path(folder, gpu):
    """``folder/gpu_<name>.json``, the GPU's name in lower case with non-alphanumerics as _."""
    return Path(folder) / f"gpu_{re.sub(r'[^0-9a-z]+', '_', gpu.lower()).strip('_')}.json"


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m lnlib.bench --gpu", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--widths",
        default=",".join(map(str, WIDTHS)),
        help="comma-separated D (LayerNorm, RMSNorm)",
    )
    p.add_argument(
        "--ada-widths",
        default=",".join(map(str, ADA_WIDTHS)),
        help=f"comma-separated D of AdaLN, x (B, {ADA_TOKENS}, D)",
    )
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, of {', '.join(OPS)}")
    p.add_argument("--dtypes", default="float32,float16", help="comma-separated")
    p.add_argument("--repeats", type=int, default=15, help="interleaved repeats (median)")
    p.add_argument("--calls", type=int, default=5, help="calls per CUDA-event timing")
    p.add_argument(
        "--out-dir",
        default=str(DEFAULT_DIR),
        help="folder of the JSON result, named after the GPU "
        "(default: lnlib/data in the repository, else the current folder)",
    )
    args = p.parse_args(argv)
    if args.repeats < 1 or args.calls < 1:
        p.error("--repeats and --calls: expected positive numbers")
    widths = _widths(p, "--widths", args.widths)
    ada_widths = _widths(p, "--ada-widths", args.ada_widths)
    ops = [o.strip() for o in args.ops.split(",")]
    if not ops or any(o not in OPS for o in ops):
        p.error(f"--ops: expected comma-separated names of {', '.join(OPS)}, got {args.ops!r}")
    dtypes = [d.strip() for d in args.dtypes.split(",")]
    if any(d not in ("float16", "float32", "float64") for d in dtypes):
        p.error(f"--dtypes: expected float16, float32 or float64, got {args.dtypes!r}")
    result = run(widths, dtypes, ops, repeats=args.repeats, calls=args.calls, ada_widths=ada_widths)
    result["command"] = "python -m lnlib.bench --gpu " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    print(f"copy: {result['copy_GBps']:.0f} GB/s on {result['gpu']}")
    path = result_path(args.out_dir, result["gpu"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    if result["failures"]:
        print(f"{len(result['failures'])} shapes failed (listed above and in the JSON)")
    return result


def _widths(p, name, text):
    """Comma-separated positive integers, or the parser's error naming ``name``."""
    try:
        widths = [int(w) for w in text.split(",")]
    except ValueError:
        widths = []
    if not widths or min(widths) < 1:
        p.error(f"{name}: expected comma-separated positive integers, got {text!r}")
    return widths


if __name__ == "__main__":
    sys.exit(1 if main()["failures"] else 0)
