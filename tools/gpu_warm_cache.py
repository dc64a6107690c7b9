"""Compile every CUDA module of lnlib for this machine's GPU into CuPy's kernel cache, in parallel.

    python tools/gpu_warm_cache.py [--workers N]

lnlib compiles a module (one op, one dtype: ``lnlib._cuda.build.modules()``) with NVRTC on its
first use, one at a time, and CuPy keeps the result on disk (``CUPY_CACHE_DIR``). The steps of
``tools/gpu_check.sh`` after this one (the tests, the benchmark, ncu, the sanitizers) then load
the modules from the cache instead of compiling them inside their own time limits. Each worker
is a fresh process (spawned: CUDA does not survive a fork) that compiles its share. Prints each
module's compile time and the total; exits 1 if any module fails to compile.
"""

import argparse
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def compile_module(key):
    """Compile the module ``key`` = (op, dtype); return (key, seconds, error or None)."""
    from lnlib._cuda import build

    start = time.perf_counter()
    try:
        build.module(*key).compile()
    except Exception as error:  # reported by the parent, which exits 1
        return key, time.perf_counter() - start, f"{type(error).__name__}: {error}"
    return key, time.perf_counter() - start, None


def main(argv=None):
    from lnlib._cuda import build

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    args = parser.parse_args(argv)
    keys = build.modules()
    start, failed = time.perf_counter(), 0
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(args.workers, mp_context=context) as pool:
        for key, took, error in pool.map(compile_module, keys):
            failed += error is not None
            print(f"{took:6.1f} s  {key[0]} {key[1]}" + (f"  FAILED {error}" if error else ""))
    took = time.perf_counter() - start
    print(f"{len(keys)} modules, {failed} failed, {took:.1f} s with {args.workers} workers")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
