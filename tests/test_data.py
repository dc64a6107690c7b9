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
    assert BENCHMARKS == ("cpu_layer_norm",)


def test_unknown_benchmark_names_the_argument():
    with pytest.raises(ValueError, match="name must be one of"):
        load_benchmark("gpu_layer_norm")
