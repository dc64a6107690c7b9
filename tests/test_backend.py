"""The selection point (lnlib/_backend.py): first calls from many threads, and thread limits."""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

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
    done = subprocess.run(
        [sys.executable, "-c", FIRST_CALLS],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


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
