#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU (make gpu-check): checks lnlib's CUDA path and
# benchmarks it, writing at most 7 files, each under 16 MiB, into ${GPU_OUT:-_build/gpu}:
#   summary.txt   every step's status (PASS, FAIL, SKIP with the reason) and time
#   tests.log     the modules compiled into CuPy's cache (in parallel, first), then the GPU
#                 tests in two pytest runs at once, each under its own time limit (the kernel
#                 tests; the CuPy variants of the LayerNorm/RMSNorm/AdaLN tests, AdaLN/GroupNorm
#                 on the kernels and the torch bridge), each with its 30 slowest tests
#   bench.log, gpu_<name>.json   the GPU benchmark (python -m lnlib.bench_gpu)
#   ncu.csv       Nsight Compute: DRAM bytes read and written, L1 wavefronts, per kernel
#   sanitizers.log   compute-sanitizer memcheck and racecheck on every kernel at small shapes
#   compile.log   only with GPU_CHECK_COMPILE=1 (CPU CI runs the compile test already)
# The machine it is written for has no network: nothing is installed; what is missing is named
# in the summary and the steps that need it are skipped. Every step runs under its own time limit
# (timeout), the benchmark before the sanitizers, so that a hang cannot eat the speed result; the
# limits add up to under 8 minutes. lnlib runs from the tree without its C kernel
# (LNLIB_CPU_KERNEL=0, so cffi is not needed). Exits non-zero if any step failed.
set -u
unset STEP_DIR  # set only for one step (below), never from the caller's environment
OUT=${GPU_OUT:-_build/gpu}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 LNLIB_CPU_KERNEL=0
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/lnlib-cupy-cache}
PY=${GPU_PYTHON:-python3}
status=0
note() { echo "$*" | tee -a "$SUMMARY"; }

# step NAME LIMIT_S LOG COMMAND...: run under `timeout`, append to LOG, record status and time.
# At the limit the command gets SIGINT first (pytest then stops and still prints its summary of
# what failed so far), SIGKILL 5 s later. A sanitizer that says the device is not supported is
# a SKIP, not a FAIL.
# Returns 1 if the step failed (for a step run in the background, whose status=1 is lost).
# STEP_DIR=DIR step ...: write LOG in DIR instead of $OUT (to be appended to $OUT/LOG later).
step() {
    local name=$1 limit=$2 log=$3 start=$SECONDS rc dir=${STEP_DIR:-$OUT}
    shift 3
    echo "=== $name: $*" >> "$dir/$log"
    timeout --signal=INT --kill-after=5 "$limit" "$@" >> "$dir/$log" 2>&1
    rc=$?
    local took=$((SECONDS - start))
    if [ $rc -eq 0 ]; then
        note "PASS  $name ($took s, log $log)"
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        note "FAIL  $name: timed out after $limit s (log $log)"; status=1; return 1
    elif tail -n 40 "$dir/$log" | grep -qi "device is not supported\|not supported on this device\|unsupported device"; then
        note "SKIP  $name: the tool does not support this device ($took s, log $log)"
    else
        note "FAIL  $name: exit $rc ($took s, log $log)"; status=1; return 1
    fi
    return 0
}
skip() { note "SKIP  $1: $2"; }

note "lnlib gpu-check $(date -u +%Y-%m-%dT%H:%M:%SZ), git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
note "python: $PY ($($PY -c 'import sys; print(sys.version.split()[0])' 2>&1))"
if command -v nvidia-smi >/dev/null 2>&1; then
    timeout 10 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 \
        | sed 's/^/gpu: /' | tee -a "$SUMMARY"
else
    note "missing: nvidia-smi"
fi
missing_py=$($PY - <<'PY' 2>&1
import importlib.util
names = ["numpy", "cupy", "pytest", "hypothesis", "torch", "pytest_timeout"]
print(" ".join(n for n in names if importlib.util.find_spec(n) is None))
PY
)
[ -n "$missing_py" ] && note "missing Python packages: $missing_py"
has_py() { case " $missing_py " in *" $1 "*) return 1 ;; *) return 0 ;; esac; }
if ! has_py cupy || ! has_py numpy; then
    skip "every GPU step" "CuPy or NumPy is missing"
    note "total $SECONDS s; overall FAIL"
    exit 1
fi
$PY - <<'PY' 2>&1 | tee -a "$SUMMARY"
import cupy, numpy
line = f"cupy {cupy.__version__}, numpy {numpy.__version__}"
try:
    import torch
    line += f", torch {torch.__version__} (cuda {torch.version.cuda}, gpu: {torch.cuda.is_available()})"
except ImportError:
    line += ", no torch"
print(line)
print("cupy sees a GPU" if cupy.cuda.is_available() else "cupy sees no GPU")
PY

if [ "${GPU_CHECK_COMPILE:-0}" = 1 ]; then
    step "compile test (nvcc sm_80/sm_90, NVRTC, no spills)" 120 compile.log \
        env LNLIB_CUDA_REPORT=1 $PY -m pytest tests/test_cuda_compile.py -q -s -p no:cacheprovider
else
    skip "compile test" "run by the CPU CI; GPU_CHECK_COMPILE=1 runs it here"
fi

# every module compiled at once, in parallel processes, into CuPy's cache (CUPY_CACHE_DIR): the
# steps below load them from there instead of compiling each, one at a time, on first use
step "compile every module into CuPy's cache (parallel)" 30 tests.log \
    $PY tools/gpu_warm_cache.py

# The -m gpu selection (about 680 tests) in two pytest runs: the kernel tests (many rows per
# unit, grid-stride loops, bfloat16, long rows, float16 parameter gradients against their
# bound, the fused add) and the CuPy variants of the LayerNorm/RMSNorm/AdaLN tests with AdaLN and
# GroupNorm on the kernels and the torch bridge. Each run has its own limit and a time-out of
# one loses none of the other's results. They run at once (16 cores: CuPy's own elementwise and
# reduction kernels, compiled with NVRTC on first use and not in the cache step, compile in
# both at once), each under TESTS_LIMIT; where the GPU's compute mode is not Default (a second
# process could not use it), one after the other, under 5/8 and 3/8 of TESTS_LIMIT. In the
# background too, the limit's SIGINT stops pytest with its summary: timeout starts its command
# with SIGINT's default action even where the script's background jobs ignore SIGINT (checked
# with coreutils 9.1: under `trap '' INT`, timeout's child has SIGINT not ignored). -v: each
# test named as it ends; --durations=30: the slowest, for the next run's limits.
# CUPY_NVRTC_USE_PCH=1 (the caller's value kept): NVRTC reuses the headers every CuPy kernel
# includes, parsed once a process, in the test runs (CuPy >= 14 with CUDA >= 12.8; CuPy's own CI
# runs its tests so). CuPy adds --pch after forming the cache key (cupy/cuda/compiler.py,
# v14.2.0), so the modules the cache step compiled without it are still found.
TESTS_LIMIT=160
PCH=${CUPY_NVRTC_USE_PCH:-1}
if has_py pytest && has_py hypothesis; then
    pytest_args=(-m gpu -v -rs --durations=30 -p no:cacheprovider)
    # pytest-timeout is loaded by its entry point ("timeout"); -p pytest_timeout would load it
    # a second time under its module's name, and pytest stops before collecting (exit 3)
    has_py pytest_timeout && pytest_args+=(--timeout 90)
    gpu_tests_kernels=(tests/test_gpu_rows.py tests/test_gpu.py tests/test_gpu_add_norm.py)
    gpu_tests_cupy=(tests/test_layer_norm.py tests/test_rms_norm.py tests/test_ada_norm.py
        tests/test_gpu_modulated.py)
    has_py torch && gpu_tests_cupy+=(tests/test_torch_bridge_gpu.py)
    kernels_name="GPU tests: the kernels (LNLIB_REQUIRE_GPU=1, -m gpu)"
    cupy_name="GPU tests: the CuPy variants, AdaLN/GroupNorm, the torch bridge (-m gpu)"
    mode=$(timeout 10 nvidia-smi --query-gpu=compute_mode --format=csv,noheader 2>/dev/null | head -n 1)
    if [ -z "$mode" ]; then  # no nvidia-smi: the device's properties through CuPy (0: Default)
        mode=$(timeout 30 $PY -c 'import cupy
m = cupy.cuda.runtime.getDeviceProperties(0)["computeMode"]
print("Default" if m == 0 else m)' 2>/dev/null)
    fi
    run_env=(env LNLIB_REQUIRE_GPU=1 CUPY_NVRTC_USE_PCH="$PCH")
    if [ "$mode" = Default ]; then
        cupy_dir=$(mktemp -d)
        trap 'rm -rf "$cupy_dir"' EXIT  # also when the check is interrupted
        step "$kernels_name" "$TESTS_LIMIT" tests.log "${run_env[@]}" \
            $PY -m pytest "${gpu_tests_kernels[@]}" "${pytest_args[@]}" &
        kernels_pid=$!
        STEP_DIR=$cupy_dir step "$cupy_name" "$TESTS_LIMIT" tests.log "${run_env[@]}" \
            $PY -m pytest "${gpu_tests_cupy[@]}" "${pytest_args[@]}" &
        cupy_pid=$!
        wait "$kernels_pid" || status=1
        wait "$cupy_pid" || status=1
        cat "$cupy_dir/tests.log" >> "$OUT/tests.log"
        rm -rf "$cupy_dir"
    else
        note "GPU compute mode '${mode:-unknown}': the two test runs one after the other"
        step "$kernels_name" $((TESTS_LIMIT * 5 / 8)) tests.log "${run_env[@]}" \
            $PY -m pytest "${gpu_tests_kernels[@]}" "${pytest_args[@]}"
        step "$cupy_name" $((TESTS_LIMIT * 3 / 8)) tests.log "${run_env[@]}" \
            $PY -m pytest "${gpu_tests_cupy[@]}" "${pytest_args[@]}"
    fi
else
    skip "GPU tests" "pytest or hypothesis is missing"
fi

step "GPU benchmark" 90 bench.log $PY -m lnlib.bench_gpu --out-dir "$OUT"

NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || true)
if [ -n "$NCU" ]; then
    METRICS=dram__bytes_read.sum,dram__bytes_write.sum,l1tex__data_pipe_lsu_wavefronts.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,gpu__time_duration.sum
    step "ncu: bytes and wavefronts (d=4096, 65536 float32; d=768 float16; AdaLN (16, 256, 4096) float32)" 50 ncu.csv \
        "$NCU" --profile-from-start off --metrics "$METRICS" --csv --page raw \
        $PY tools/gpu_ncu_cases.py
else
    skip "ncu" "Nsight Compute (ncu) is not installed"
fi

SAN=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
if [ -n "$SAN" ]; then
    for tool in memcheck racecheck; do
        step "compute-sanitizer $tool" 45 sanitizers.log \
            "$SAN" --tool "$tool" --error-exitcode 1 $PY tools/gpu_sanitize_cases.py
    done
else
    skip "compute-sanitizer" "not installed"
fi

for f in "$OUT"/*; do  # what comes back from the machine: files under 16 MiB
    if [ "$(stat -c %s "$f")" -gt 16000000 ]; then
        tail -c 15000000 "$f" > "$f.tail" && mv "$f.tail" "$f"
        note "cut $f to its last 15 MB"
    fi
done
ls "$OUT"/gpu_*.json 2>/dev/null | sed 's/^/benchmark JSON: /' | tee -a "$SUMMARY"
note "total $SECONDS s; overall $([ $status -eq 0 ] && echo PASS || echo FAIL)"
exit $status
