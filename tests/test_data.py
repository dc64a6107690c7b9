"""lnlib.data ships the benchmark results chapter 5 plots, so its notebook runs alone."""

import pytest

from lnlib.data import BENCHMARKS, load_benchmark


def test_benchmark_results_ship_with_the_package():
    bench = load_benchmark()
    assert set(bench) >= {"machine", "copy", "results", "steps", "command"}
    assert bench["command"].endswith("--out lnlib/data/cpu_layer_norm.json")
    for step_set in bench["steps"]:  # what chapter 5 reads
        names = {st["step"] for st in step_set["steps"]}
        assert "reference (readable)" in names and "row-blocked + threads" in names
    assert load_benchmark("cpu_layer_norm") == bench
    assert BENCHMARKS == ("cpu_layer_norm", "cpu_fused_add")


def test_fused_add_benchmark_ships_with_the_package():
    bench = load_benchmark("cpu_fused_add")
    assert bench["command"].endswith("--out lnlib/data/cpu_fused_add.json")
    assert "--ops add_layer_norm,add_rms_norm" in bench["command"]
    rows = {(r["op"], tuple(r["shape"])) for r in bench["fused"]}  # what chapter 5 reads
    for op in ("add_layer_norm", "add_rms_norm"):
        assert {(op, (4096, 4096)), (op, (32768, 768))} <= rows
    for r in bench["fused"]:
        for key in ("fwd_vs_unfused", "fwd_out_vs_unfused", "fwdbwd_vs_unfused", "fwd_vs_torch"):
            assert r[key] > 0
        assert r["fwd_vs_unfused"] == pytest.approx(r["unfused_fwd_s"] / r["fused_fwd_s"])


def test_unknown_benchmark_names_the_argument():
    with pytest.raises(ValueError, match="name must be one of"):
        load_benchmark("gpu_layer_norm")
