"""`make gpu-check` (tools/gpu_check.sh) on a machine that lacks what it needs: it installs
nothing, names what is missing, and still writes its summary; its time limits fit in 8 minutes."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_check.sh"


def test_the_check_installs_nothing():
    text = SCRIPT.read_text()
    assert not re.search(r"pip\s+install|apt-get|conda\s+install", text)


def test_the_step_limits_fit_in_eight_minutes():
    text = SCRIPT.read_text()
    limits = [int(n) for n in re.findall(r'^\s*step "[^"]+" (\d+) ', text, re.M)]
    compile_limit = int(re.search(r'step "compile test[^"]*" (\d+)', text).group(1))
    # the two sanitizer steps run in one loop, so their limit counts twice; compile is off here
    sanitizer = int(re.search(r'step "compute-sanitizer \$tool" (\d+)', text).group(1))
    # the two GPU test runs: at once, each under TESTS_LIMIT, or one after the other, under
    # fractions of it that add up to at most 1
    tests_limit = int(re.search(r"^TESTS_LIMIT=(\d+)$", text, re.M).group(1))
    assert len(re.findall(r'step "\$\w+_name" "\$TESTS_LIMIT" tests\.log [^&]*&\n', text)) == 2
    fractions = re.findall(r'step "\$\w+_name" \$\(\(TESTS_LIMIT \* (\d+) / (\d+)\)\)', text)
    assert len(fractions) == 2 and sum(int(a) / int(b) for a, b in fractions) <= 1, fractions
    total = sum(limits) - compile_limit + sanitizer + tests_limit
    # a step at its limit may take --kill-after more: at most 7 steps in turn (the cache, the
    # two test runs one after the other, the benchmark, ncu, two sanitizers)
    kill_after = int(re.search(r"--kill-after=(\d+) ", text).group(1))
    total += 7 * kill_after
    assert len(limits) >= 5 and total + 20 < 8 * 60, (limits, total)  # 20 s: the rest


@pytest.mark.skipif(
    importlib.util.find_spec("cupy") is not None, reason="CuPy is installed in this Python"
)
def test_without_cupy_it_says_so_and_stops_with_a_summary(tmp_path):
    env = dict(os.environ, GPU_OUT=str(tmp_path), GPU_PYTHON=sys.executable)
    result = subprocess.run(
        ["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1
    summary = (tmp_path / "summary.txt").read_text()
    assert "missing Python packages:" in summary and "cupy" in summary
    assert "SKIP  every GPU step" in summary and "overall FAIL" in summary
    assert len(list(tmp_path.iterdir())) <= 7


@pytest.mark.skipif(
    importlib.util.find_spec("cupy") is not None, reason="CuPy is installed in this Python"
)
@pytest.mark.parametrize("mode", ["Default", "Exclusive_Process"])
def test_the_two_test_runs_each_report_into_one_log(tmp_path, mode):
    """With a CuPy that sees no GPU (a stand-in module) and an nvidia-smi that gives the compute
    mode: both GPU test runs (at once where the mode is Default, else one after the other) get
    their summary line, both pytest sessions end up in tests.log, and the check fails (every GPU
    test fails under LNLIB_REQUIRE_GPU=1; -x via PYTEST_ADDOPTS stops each at the first)."""
    fake = tmp_path / "fake"
    (fake / "cupy").mkdir(parents=True)
    (fake / "cupy" / "__init__.py").write_text(
        '__version__ = "0+stand-in"\n\n\nclass cuda:\n    is_available = staticmethod(bool)\n'
    )
    # a stand-in pytest-timeout, registered as the real one is (entry point "timeout", module
    # pytest_timeout): the check must load it once (-p pytest_timeout made pytest stop, exit 3)
    (fake / "pytest_timeout.py").write_text(
        "def pytest_addoption(parser):\n    parser.addoption('--timeout', help='stand-in')\n"
    )
    dist = fake / "pytest_timeout_standin-0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: pytest-timeout-standin\nVersion: 0\n"
    )
    (dist / "entry_points.txt").write_text("[pytest11]\ntimeout = pytest_timeout\n")
    smi = fake / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text(
        f'#!/bin/sh\ncase "$*" in *compute_mode*) echo {mode};; *) echo stand-in;; esac\n'
    )
    smi.chmod(0o755)
    out = tmp_path / "out"
    env = dict(
        os.environ,
        GPU_OUT=str(out),
        GPU_PYTHON=sys.executable,
        PYTHONPATH=str(fake),
        PATH=f"{smi.parent}:{os.environ['PATH']}",
        PYTEST_ADDOPTS="-x",
        CUPY_CACHE_DIR=str(tmp_path / "cache"),
        TMPDIR=str(tmp_path),
    )
    result = subprocess.run(
        ["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=280
    )
    summary = (out / "summary.txt").read_text()
    assert result.returncode == 1, summary
    runs = [line for line in summary.splitlines() if line.startswith("FAIL  GPU tests: ")]
    assert len(runs) == 2 and all(re.search(r"exit \d+ \(\d+ s, log tests\.log\)", r) for r in runs)
    assert ("one after the other" in summary) == (mode != "Default"), summary
    log = (out / "tests.log").read_text()
    assert log.count("=== GPU tests: ") == 2 and log.count("test session starts") == 2
    assert log.count("--timeout 90") == 2 and "Plugin already registered" not in log
    assert log.count("CUPY_NVRTC_USE_PCH=1 ") == 2  # NVRTC's precompiled headers, in both
    assert log.count("slowest 30 durations") == 2 and "LNLIB_REQUIRE_GPU=1 but" in log
    assert len(list(out.iterdir())) <= 7
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("tmp")]  # mktemp -d's, gone


def test_it_runs_every_test_file_with_gpu_tests():
    """Every test file with a test the ``gpu`` marker selects (the GPU tests and the CuPy
    variants of the ``xp`` fixture) is in the check's list: a file left out never runs on a GPU."""
    text = SCRIPT.read_text()
    listed = set(re.findall(r"tests/test_\w+\.py", " ".join(re.findall(r"gpu_tests.*", text))))
    listed |= set(re.findall(r"^\s+(tests/test_\w+\.py)", text, re.M))  # continuation lines
    found = subprocess.run(
        [sys.executable, "-m", "pytest", "tests", "--ignore=tests/book", "--ignore=tests/pdf"]
        + ["--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert found.returncode == 0, found.stdout[-2000:] + found.stderr[-2000:]
    with_gpu = {line.split("::")[0] for line in found.stdout.splitlines() if "::" in line}
    assert {"tests/test_gpu.py", "tests/test_gpu_rows.py", "tests/test_layer_norm.py"} <= with_gpu
    assert with_gpu <= listed, f"GPU tests the check does not run: {sorted(with_gpu - listed)}"


@pytest.mark.skipif(
    importlib.util.find_spec("cupy") is not None, reason="CuPy is installed in this Python"
)
def test_the_cache_warm_up_reports_each_module():
    """tools/gpu_warm_cache.py compiles every module in spawned workers and reports each: here,
    without a GPU (or CuPy), every module fails, by name, and it exits 1."""
    result = subprocess.run(
        [sys.executable, "tools/gpu_warm_cache.py", "--workers", "2"],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT), CUPY_CACHE_DIR="/nonexistent-cupy-cache"),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    sys.path.insert(0, str(ROOT))
    from lnlib._cuda import build

    keys = build.modules()
    lines = result.stdout.splitlines()
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert len(lines) == len(keys) + 1 and all("FAILED" in line for line in lines[:-1])
    assert lines[-1].startswith(f"{len(keys)} modules, {len(keys)} failed")


def test_a_step_in_the_background_reports_its_failure():
    """The two GPU test runs are steps in the background: their status=1 is lost with the
    subshell, so the script waits on each with `|| status=1`, which needs step to return 1 on a
    failure and a time-out (and 0 on success), besides its summary line."""
    text = SCRIPT.read_text()
    step = re.search(r"^step\(\) \{\n.*?^\}\n", text, re.M | re.S).group(0)
    assert 'wait "$kernels_pid" || status=1' in text and 'wait "$cupy_pid" || status=1' in text
    script = (
        'set -u\nOUT=$(mktemp -d); SUMMARY=$OUT/summary.txt; status=0\n'
        'note() { echo "$*" >> "$SUMMARY"; }\n' + step +
        'step ok 5 a.log true & p1=$!\n'
        'step bad 5 a.log false & p2=$!\n'
        'step slow 1 a.log sleep 30 & p3=$!\n'
        'wait $p1 && echo ok-0; wait $p2 || echo bad-1; wait $p3 || echo slow-1\n'
        'echo status=$status; cat "$SUMMARY"; rm -rf "$OUT"\n'
    )  # fmt: skip
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    out = done.stdout
    assert {"ok-0", "bad-1", "slow-1", "status=0"} <= set(out.split()), out
    assert "PASS  ok" in out and "FAIL  bad: exit 1" in out and "FAIL  slow: timed out" in out
