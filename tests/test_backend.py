"""The selection point (lnlib/_backend.py): first calls from many threads, and thread limits."""

import json
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import run_json

import lnlib
from lnlib import _backend, _rows

# 8 threads wait at a barrier, then each makes its first lnlib call (the first load of the
# kernel module happens in one of them). A switch interval of 1 us makes the interpreter
# change threads often enough that one thread runs while another is half-way through an
# import: the race of issue 20, item 1, in most runs instead of a few.
FIRST_CALLS = r"""
import json, sys, threading, traceback
import numpy as np
import torch
import lnlib
import lnlib.torch_bridge as bridge
sys.setswitchinterval(1e-6)
x = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
t = torch.from_numpy(x)
calls = [lambda: lnlib.layer_norm(x), lambda: lnlib.rms_norm(x),
         lambda: bridge.layer_norm(t, (64,)), lambda: bridge.rms_norm(t, (64,))]
barrier, errors, results = threading.Barrier(8), [], {}
def work(i):
    barrier.wait()
    try:
        results[i] = np.asarray(calls[i % 4]())
    except BaseException:
        errors.append(traceback.format_exc(limit=3))
threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
for th in threads:
    th.start()
for th in threads:
    th.join()
same = all(np.array_equal(results[i], np.asarray(calls[i % 4]())) for i in results)
print(json.dumps({"errors": errors, "done": sorted(results), "same": same}))
"""


def _first_calls(env):
    return run_json(FIRST_CALLS, env=env)


def test_first_calls_from_eight_threads_at_once():
    """Issue 20, item 1: 20 fresh processes, 8 threads each making their first call at once
    (layer_norm, rms_norm and the torch bridge's two); none may raise, and each gives the
    result the same call gives afterwards."""
    pytest.importorskip("torch")
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(_first_calls, [dict(os.environ)] * 20))
    errors = [e for run in runs for e in run["errors"]]
    assert errors == [], f"{len(errors)} failed first calls, e.g.\n{errors[0]}"
    assert all(run["done"] == list(range(8)) and run["same"] for run in runs)


@pytest.fixture
def thread_state(monkeypatch):
    """Restore the process's thread setting after a test that changes it."""
    monkeypatch.delenv("LNLIB_NUM_THREADS", raising=False)
    monkeypatch.setattr(_rows, "_num_threads", None)
    monkeypatch.setattr(_rows, "_num_threads_reason", "")
    return monkeypatch


def _chunks_run(m=4096, n=256):
    """The number of chunks (one per thread) run_chunks splits a large call into."""
    return len(_rows.run_chunks(m, n, lambda s, e, r: (s, e), block_rows=16))


def test_set_num_threads_limits_every_call(thread_state):
    """Issue 20, item 8: set_num_threads(n) caps the threads of a call; get_num_threads and
    show_config report it; results are the same bits for any count."""
    x = np.random.default_rng(0).standard_normal((2048, 512)).astype(np.float32)
    lnlib.set_num_threads(3)
    assert lnlib.get_num_threads() == 3 and _chunks_run() == 3
    config = lnlib.show_config(file=False)["threads"]
    assert config == {"num_threads": 3, "reason": "lnlib.set_num_threads(3)"}
    y3 = lnlib.layer_norm(x)
    lnlib.set_num_threads(np.int64(1))
    assert lnlib.get_num_threads() == 1 and _chunks_run() == 1
    np.testing.assert_array_equal(lnlib.layer_norm(x), y3)


@pytest.mark.parametrize(
    "n,error",
    [
        (0, ValueError),
        (-2, ValueError),
        (1.5, TypeError),
        ("2", TypeError),
        (True, TypeError),
        (None, TypeError),
    ],
)
def test_set_num_threads_refuses_bad_values(thread_state, n, error):
    lnlib.set_num_threads(2)
    with pytest.raises(error, match="^n must"):
        lnlib.set_num_threads(n)
    assert lnlib.get_num_threads() == 2  # nothing changed


def test_lnlib_num_threads_environment_variable(thread_state):
    thread_state.setenv("LNLIB_NUM_THREADS", " 3 ")
    assert lnlib.get_num_threads() == 3 and _chunks_run() == 3
    assert lnlib.show_config(file=False)["threads"]["num_threads"] == 3
    lnlib.set_num_threads(2)  # the function overrides the environment
    assert lnlib.get_num_threads() == 2


@pytest.mark.parametrize("raw", ["0", "-1", "two", "1.5", "2 threads"])
def test_bad_lnlib_num_threads_is_refused_naming_it(thread_state, raw):
    """A bad value fails every call (small ones too), naming the variable; show_config
    reports it instead of raising."""
    thread_state.setenv("LNLIB_NUM_THREADS", raw)
    for call in (lnlib.get_num_threads, lambda: lnlib.layer_norm(np.ones((2, 3)))):
        with pytest.raises(ValueError, match="LNLIB_NUM_THREADS must be a positive integer"):
            call()
    config = lnlib.show_config(file=False)["threads"]
    assert config["num_threads"] is None and "LNLIB_NUM_THREADS" in config["reason"]


def _in_child():
    """In a forked child: its thread count, and whether a large call made worker threads."""
    x = np.ones((4096, 1024), np.float32)
    before = lnlib.get_num_threads()
    lnlib.layer_norm(x)
    with lnlib.use_implementation("numpy"):
        lnlib.rms_norm(x)
    pool = _rows._pool is not None
    lnlib.set_num_threads(2)
    return before, pool, lnlib.get_num_threads()


def test_a_forked_child_starts_with_one_thread(thread_state):
    """Issue 20, item 8: as PyTorch's DataLoader workers, a child made by fork (os.fork or
    multiprocessing's fork context) runs one thread per call, whatever the parent set, until
    it sets its own; the parent keeps its setting."""
    import multiprocessing

    lnlib.set_num_threads(4)
    lnlib.layer_norm(np.ones((4096, 1024), np.float32))  # the parent's pool exists
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave at once
        try:
            os.write(write, json.dumps(_in_child()).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        child = json.loads(f.read())
    os.waitpid(pid, 0)
    assert child == [1, False, 2]
    with multiprocessing.get_context("fork").Pool(1) as pool:
        assert pool.apply(_in_child) == (1, False, 2)
    assert lnlib.get_num_threads() == 4


def test_every_implementation_has_every_op_and_only_cuda_the_optional_ones():
    """select gives None for a missing row function: every OPS function must be there (a
    missing one would otherwise surface as a call of None), and the optional ops (the CUDA
    kernels' modulated LayerNorm, for AdaLN and GroupNorm) are absent on the CPU paths, which
    compose AdaLN and GroupNorm from the LayerNorm rows."""
    import importlib

    for name, row in _backend.TABLE.items():
        module = importlib.import_module(row.module)
        assert all(callable(getattr(module, op + "_rows", None)) for op in _backend.OPS), name
        has = [hasattr(module, op + "_rows") for op in _backend.OPTIONAL_OPS]
        assert has == [name == "cuda"] * len(has), name
    for name in ("numpy", "reference"):
        with lnlib.use_implementation(name):
            assert _backend.select("modulated_layer_norm_forward", np) is None
            assert _backend.select("layer_norm_forward", np) is not None
