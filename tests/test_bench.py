"""Smoke test of ``python -m lnlib.bench`` on tiny shapes (seconds, not a measurement)."""

import json
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("torch")

from lnlib import bench  # noqa: E402

FIELDS = [
    "shape",
    "dtype",
    "repeats",
    "bytes_fwd",
    "bytes_fwdbwd",
    "lnlib_fwd_s",
    "torch_fwd_s",
    "lnlib_fwdbwd_s",
    "torch_fwdbwd_s",
    "fwd_speedup",
    "fwdbwd_speedup",
    "lnlib_fwd_GBps",
    "torch_fwd_GBps",
    "lnlib_fwdbwd_GBps",
    "torch_fwdbwd_GBps",
    "lnlib_fwd_copy_fraction",
    "lnlib_fwdbwd_copy_fraction",
    "max_abs_diff_fwd",
    "max_abs_diff_dx",
    "lnlib_fwd_out_s",
    "lnlib_fwdbwd_out_s",
    "lnlib_fwd_out_bound_fraction",
    "lnlib_fwdbwd_out_bound_fraction",
    "lnlib_fwd_fresh_bound_fraction",
    "lnlib_fwdbwd_fresh_bound_fraction",
]


def test_parse_shapes():
    assert bench.parse_shapes("4096x4096, 32768x768") == [(4096, 4096), (32768, 768)]
    for bad in ("4096", "4096x", "0x5", "ax4"):
        with pytest.raises(ValueError, match="--shapes"):
            bench.parse_shapes(bad)


def test_quick_run_writes_the_table_fields(tmp_path, capsys):
    out = tmp_path / "r.json"
    result = bench.main(
        [
            "--quick",
            "--shapes",
            "16x64,40x24",
            "--dtypes",
            "float32,float64",
            "--repeats",
            "2",
            "--steps",
            "--out",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert "speedup" in printed and "of copy" in printed and "fwd+bwd" in printed
    data = json.loads(out.read_text())
    copy = data["copy"]
    assert copy["copy_GBps"] > 0 and copy["bytes"] > 0 and copy["fresh_GBps"] > 0
    assert copy["best_GBps"] == max(
        copy["copy_GBps"], copy["copy_threads_GBps"], copy["torch_copy_GBps"]
    )
    assert "CPU: " in printed and data["machine"]["cpu_model"] in printed
    assert data["machine"]["torch_threads"] >= 1
    assert len(data["results"]) == 4
    for row in data["results"]:
        for field in FIELDS:
            assert field in row, field
        assert len(row["lnlib_fwd_all_s"]) == 2
        m, h = row["shape"]
        item = 4 if row["dtype"] == "float32" else 8
        assert row["bytes_fwd"] >= 2 * m * h * item
        assert row["fwd_speedup"] == pytest.approx(row["torch_fwd_s"] / row["lnlib_fwd_s"])
        assert row["lnlib_fwd_copy_fraction"] == pytest.approx(
            row["lnlib_fwd_GBps"] / data["copy"]["best_GBps"]
        )
        for kind in ("fwd", "fwdbwd"):
            nbytes = row[f"bytes_{kind}"]
            streams = {"fwd": 2, "fwdbwd": 5}[kind]
            assert row[f"lnlib_{kind}_out_bound_fraction"] == pytest.approx(
                streams / 2 * row["copy_x_best_s"] / row[f"lnlib_{kind}_out_s"]
            )
            assert row["copy_x_best_s"] == min(
                row[f"{k}_s"] for k in ("copy_x", "copy_x_threads", "torch_copy_x")
            )
            assert row[f"lnlib_{kind}_fresh_bound_fraction"] == pytest.approx(
                nbytes / row[f"lnlib_{kind}_s"] / 1e9 / copy["fresh_GBps"]
            )
    assert len(data["steps"]) == 2  # float32 only, one per shape
    assert {s["dtype"] for s in data["steps"]} == {"float32"}
    names = [s["step"] for s in data["steps"][0]["steps"]]
    assert names[0].startswith("reference") and names[-1].startswith("torch")
    for s in data["steps"][0]["steps"][:-1]:
        assert s["max_abs_err_vs_reference"] < 1e-5
    assert result["results"] == data["results"]


def test_command_line_rejects_bad_dtype():
    proc = subprocess.run(
        [sys.executable, "-m", "lnlib.bench", "--quick", "--dtypes", "int32"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "--dtypes" in proc.stderr


def test_thread_crossover_times_both_ways():
    from lnlib._cpu import c_kernel

    if not c_kernel.available()[0]:
        pytest.skip("compiled kernel not available")
    rows = bench.thread_crossover(sizes=(4096,), repeats=1, width=64)
    assert [r["dtype"] for r in rows] == ["float16", "float32", "float64"]
    for r in rows:
        c = r["cores"]
        assert r["bytes"] == 4096 * np.dtype(r["dtype"]).itemsize
        assert all(r[k] > 0 for k in ("fwd_1", "bwd_1", f"fwd_{c}", f"bwd_{c}"))
    assert "one thread against all cores" in bench.format_crossover(rows)


def test_each_timed_call_starts_after_the_pause_which_is_not_timed():
    starts = []

    def task():
        starts.append(bench.time.perf_counter())

    times = bench._median_times({"a": task, "b": task}, repeats=3, warmup=0, pause=0.01)
    assert len(starts) == 6 and all(len(v) == 3 for v in times.values())
    assert min(b - a for a, b in zip(starts, starts[1:])) >= 0.01  # a pause before each call
    assert max(max(v) for v in times.values()) < 0.005  # and not inside the timing


def test_pause_option_is_recorded_and_checked(tmp_path, capsys):
    out = tmp_path / "r.json"
    args = ["--quick", "--shapes", "8x32", "--repeats", "1", "--out", str(out)]
    bench.main([*args, "--pause-ms", "5"])
    assert json.loads(out.read_text())["pause_s"] == pytest.approx(0.005)
    assert bench.PAUSE_S == 0.0  # the run's setting does not outlive it
    with pytest.raises(SystemExit):
        bench.main([*args, "--pause-ms", "-1"])
    assert "--pause-ms" in capsys.readouterr().err


def test_fused_ops_are_checked_timed_and_reported(tmp_path, capsys):
    out = tmp_path / "f.json"
    args = ["--quick", "--shapes", "16x64,40x24", "--dtypes", "float32,float16", "--repeats", "3"]
    result = bench.main(args + ["--ops", "add_layer_norm,add_rms_norm", "--out", str(out)])
    rows = json.loads(out.read_text())["fused"]
    assert result["results"] == [] and len(rows) == 8
    for r in rows:
        for who in ("fused", "unfused", "torch", "fused_out", "unfused_out"):
            for kind in ("fwd", "fwdbwd"):
                name = who.replace("_out", f"_{kind}_out") if "out" in who else f"{who}_{kind}"
                assert len(r[f"{name}_all_s"]) == 3 and r[f"{name}_s"] > 0
        for kind in ("fwd", "fwdbwd"):
            assert r[f"{kind}_vs_unfused"] == r[f"unfused_{kind}_s"] / r[f"fused_{kind}_s"]
            want = r[f"unfused_{kind}_out_s"] / r[f"fused_{kind}_out_s"]
            assert r[f"{kind}_out_vs_unfused"] == want
        m, d = r["shape"]
        size = m * d * np.dtype(r["dtype"]).itemsize
        assert (r["fused_fwd_bytes"], r["fused_fwdbwd_bytes"]) == (4 * size, 8 * size)
        assert (r["unfused_fwd_bytes"], r["unfused_fwdbwd_bytes"]) == (5 * size, 11 * size)
    assert "vs unf." in capsys.readouterr().out


def test_rotated_orders_vary_each_tasks_predecessor():
    seen = []
    tasks = {k: (lambda k=k: seen.append(k)) for k in "abcdefghij"}
    times = bench._median_times(tasks, 11, warmup=0, rotate=True)
    assert all(len(v) == 11 for v in times.values())
    repeats = ["".join(seen[i : i + 10]) for i in range(0, len(seen), 10)]
    assert all(sorted(r) == list("abcdefghij") for r in repeats)  # each task once per repeat
    for task in "abcdefghij":  # a task is not always timed after the same one
        before = {r[r.index(task) - 1] for r in repeats if r.index(task)}
        assert len(before) >= 3, (task, before)
    assert bench._orders(10, 11, True) == bench._orders(10, 11, True)  # the same every run
    assert bench._orders(3, 2, False) == [[0, 1, 2], [0, 1, 2]]


def test_check_fused_catches_a_wrong_out_result():
    tasks = bench.fused_contenders((8, 16), np.float32)
    bench.check_fused(tasks, (8, 16), np.float32)
    good = tasks["unfused_fwd_out"]
    tasks["unfused_fwd_out"] = lambda: (good()[0] + 1, None)
    with pytest.raises(AssertionError, match="unfused_fwd_out"):
        bench.check_fused(tasks, (8, 16), np.float32)
