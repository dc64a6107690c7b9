#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU (make gpu-check): checks lnlib's CUDA path and
# benchmarks it, writing logs and the benchmark JSON into ${GPU_OUT:-_build/gpu}.
#   1. environment: GPU, driver, Python packages (installs CuPy/hypothesis if missing)
#   2. the compile test (nvcc, sm_80 and sm_90, resource report)
#   3. the GPU tests with LNLIB_REQUIRE_GPU=1 (a missing GPU fails them instead of skipping)
#   4. compute-sanitizer memcheck and racecheck on every kernel at small shapes
#   5. the GPU benchmark (python -m lnlib.bench --gpu)
# Exits non-zero if any step failed; summary.txt says which. Planned to take under 8 minutes.
set -u
OUT=${GPU_OUT:-_build/gpu}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
note() { echo "$*" | tee -a "$SUMMARY"; }
step() {  # step NAME LOG COMMAND...: run, log, record the outcome and the time taken
    local name=$1 log=$2 start=$SECONDS
    shift 2
    "$@" > "$OUT/$log" 2>&1
    local rc=$?
    note "$name: $([ $rc -eq 0 ] && echo PASS || echo "FAIL (exit $rc)") in $((SECONDS - start)) s, log $log"
    [ $rc -eq 0 ] || status=1
}

PY=${GPU_PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ] && .venv/bin/python -c "import cupy" 2>/dev/null; then
        PY=.venv/bin/python
    else
        PY=python3
    fi
fi
note "lnlib gpu-check $(date -u +%Y-%m-%dT%H:%M:%SZ), git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
note "python: $PY ($($PY -c 'import sys; print(sys.version.split()[0])'))"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | sed 's/^/gpu: /' | tee -a "$SUMMARY"
if ! $PY -c "import cupy" 2>/dev/null; then
    cuda_major=$($PY -c "import torch; print((torch.version.cuda or '12').split('.')[0])" 2>/dev/null || echo 12)
    note "installing cupy-cuda${cuda_major}x"
    $PY -m pip install --quiet "cupy-cuda${cuda_major}x" >> "$SUMMARY" 2>&1 || status=1
fi
$PY -c "import hypothesis" 2>/dev/null || $PY -m pip install --quiet hypothesis >> "$SUMMARY" 2>&1
$PY - <<'PY' 2>&1 | tee -a "$SUMMARY"
import cupy, numpy, torch
print(f"cupy {cupy.__version__}, numpy {numpy.__version__}, torch {torch.__version__} "
      f"(cuda {torch.version.cuda}, gpu visible: {torch.cuda.is_available()})")
try:
    print("cupy sees", cupy.cuda.runtime.getDeviceCount(), "GPU(s)")
except Exception as exc:  # noqa: BLE001 - reported, the GPU tests then fail with the reason
    print("cupy sees no GPU:", exc)
PY

if [ "${GPU_CHECK_COMPILE:-1}" != 0 ]; then  # GPU_CHECK_COMPILE=0 skips it (CPU CI runs it too)
    step "compile test (nvcc sm_80/sm_90 and CuPy's NVRTC, no spills)" compile.log \
        env LNLIB_CUDA_REPORT=1 $PY -m pytest tests/test_cuda_compile.py -q -s -p no:cacheprovider
fi
step "GPU tests (LNLIB_REQUIRE_GPU=1)" test_gpu.log \
    env LNLIB_REQUIRE_GPU=1 $PY -m pytest tests/test_gpu.py tests/test_torch_bridge_gpu.py -q -rs -p no:cacheprovider
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
for tool in memcheck racecheck; do
    step "compute-sanitizer $tool" "$tool.log" \
        "$SAN" --tool "$tool" --error-exitcode 1 $PY tools/gpu_sanitize_cases.py
done
step "GPU benchmark" bench.log $PY -m lnlib.bench_gpu --out-dir "$OUT"
ls "$OUT"/gpu_*.json 2>/dev/null | sed 's/^/benchmark JSON: /' | tee -a "$SUMMARY"
note "total $SECONDS s; overall $([ $status -eq 0 ] && echo PASS || echo FAIL)"
exit $status
