#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU (make gpu-check): checks lnlib's CUDA path and
# benchmarks it, writing at most 7 files, each under 16 MiB, into ${GPU_OUT:-_build/gpu}:
#   summary.txt   every step's status (PASS, FAIL, SKIP with the reason) and time
#   tests.log     the modules compiled into CuPy's cache (in parallel, first), the GPU tests
#                 and the CuPy variants of the LayerNorm/RMSNorm/AdaLN tests
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
# what failed so far), SIGKILL 10 s later. A sanitizer that says the device is not supported is
# a SKIP, not a FAIL.
step() {
    local name=$1 limit=$2 log=$3 start=$SECONDS rc
    shift 3
    echo "=== $name: $*" >> "$OUT/$log"
    timeout --signal=INT --kill-after=10 "$limit" "$@" >> "$OUT/$log" 2>&1
    rc=$?
    local took=$((SECONDS - start))
    if [ $rc -eq 0 ]; then
        note "PASS  $name ($took s, log $log)"
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        note "FAIL  $name: timed out after $limit s (log $log)"; status=1
    elif tail -n 40 "$OUT/$log" | grep -qi "device is not supported\|not supported on this device\|unsupported device"; then
        note "SKIP  $name: the tool does not support this device ($took s, log $log)"
    else
        note "FAIL  $name: exit $rc ($took s, log $log)"; status=1
    fi
}
skip() { note "SKIP  $1: $2"; }

note "lnlib gpu-check $(date -u +%Y-%m-%dT%H:%M:%SZ), git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
note "python: $PY ($($PY -c 'import sys; print(sys.version.split()[0])' 2>&1))"
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 \
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
step "compile every module into CuPy's cache (parallel)" 35 tests.log \
    $PY tools/gpu_warm_cache.py

if has_py pytest && has_py hypothesis; then
    per_test=()
    has_py pytest_timeout && per_test=(-p pytest_timeout --timeout 90)
    gpu_tests=(tests/test_gpu.py tests/test_gpu_rows.py tests/test_gpu_add_norm.py tests/test_layer_norm.py tests/test_rms_norm.py
        tests/test_ada_norm.py
        tests/test_gpu_modulated.py)
    has_py torch && gpu_tests+=(tests/test_torch_bridge_gpu.py)
    step "GPU tests and the CuPy variants (LNLIB_REQUIRE_GPU=1, -m gpu)" 160 tests.log \
        env LNLIB_REQUIRE_GPU=1 $PY -m pytest "${gpu_tests[@]}" -m gpu -q -rs -p no:cacheprovider \
        "${per_test[@]}"
else
    skip "GPU tests" "pytest or hypothesis is missing"
fi

step "GPU benchmark" 110 bench.log $PY -m lnlib.bench_gpu --out-dir "$OUT"

NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || true)
if [ -n "$NCU" ]; then
    METRICS=dram__bytes_read.sum,dram__bytes_write.sum,l1tex__data_pipe_lsu_wavefronts.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,gpu__time_duration.sum
    step "ncu: bytes and wavefronts (d=4096, 65536 float32; d=768 float16)" 50 ncu.csv \
        "$NCU" --profile-from-start off --metrics "$METRICS" --csv --page raw \
        $PY tools/gpu_ncu_cases.py
else
    skip "ncu" "Nsight Compute (ncu) is not installed"
fi

SAN=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
if [ -n "$SAN" ]; then
    for tool in memcheck racecheck; do
        step "compute-sanitizer $tool" 50 sanitizers.log \
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
