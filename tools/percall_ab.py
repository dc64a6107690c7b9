"""Time lnlib's per-call cost at small shapes for two trees, in two processes taking turns.

    python tools/percall_ab.py A B [--rounds 101] [--burst-ms 10]

``A`` and ``B`` are each a folder holding an lnlib tree with its kernel built, ``WORKTREE``
(this checkout) or a git revision (exported to a temporary folder, its kernel built there with
``lnlib/_cpu/build.py``). One process imports each tree's lnlib; for every case the two take
turns, ``--rounds`` times, each turn a burst of calls lasting about ``--burst-ms``, so that a
change in the machine's state moves both alike. A burst is timed in CPU time of the process
(``time.process_time``), which other processes on a shared machine do not add to; at these
shapes every call runs in the calling thread. The table gives, per case, the median over the
bursts in microseconds per call, the fastest burst, and B/A of each. At these shapes a call costs
microseconds of Python around the kernel (validation, selection, reshaping), so this measures
that overhead; for the kernels' own speed use ``tools/kernel_ab.py``.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Runs with the tree first on sys.path. Prints the case names, then answers each line
#: "case calls" from stdin with the seconds those calls took.
CHILD = r"""
import functools, sys, time
import numpy as np
import lnlib
tree = sys.argv[1]
assert lnlib.__file__.startswith(tree), (lnlib.__file__, tree)
kernel = lnlib.show_config(file=False)["implementations"]["kernel"]
assert kernel["available"] and tree in kernel["reason"], kernel
cases = {}
for m, n in ((4, 64), (256, 1024)):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((m, n)) * 2 + 1).astype(np.float32)
    dy = rng.standard_normal((m, n)).astype(np.float32)
    w, b = (1 + 0.1 * rng.standard_normal(n)).astype(np.float32), np.zeros(n, np.float32)
    y, mean, rstd = lnlib.layer_norm_forward(x, w, b)
    r = lnlib.rms_norm_forward(x, w)[1]
    out = (np.empty_like(y), np.empty_like(mean), np.empty_like(rstd))
    calls = {
        "layer_norm_forward": (lnlib.layer_norm_forward, (x, w, b), {}),
        "layer_norm_forward out=": (lnlib.layer_norm_forward, (x, w, b), {"out": out}),
        "layer_norm_backward": (lnlib.layer_norm_backward, (dy, x, mean, rstd, w), {}),
        "rms_norm_forward": (lnlib.rms_norm_forward, (x, w), {}),
        "rms_norm_backward": (lnlib.rms_norm_backward, (dy, x, r, w), {}),
    }
    for name, (fn, args, kwargs) in calls.items():
        cases[f"{name} {m}x{n}"] = functools.partial(fn, *args, **kwargs)
print("|".join(cases), flush=True)
for line in sys.stdin:
    case, number = line.rsplit(" ", 1)
    fn, number = cases[case], int(number)
    start = time.process_time()
    for _ in range(number):
        fn()
    print(time.process_time() - start, flush=True)
"""


def tree(spec, where):
    """The folder of the lnlib tree ``spec`` names (building a revision's kernel if needed)."""
    if spec == "WORKTREE":
        return ROOT
    if Path(spec).is_dir():
        return Path(spec).resolve()
    dest = where / spec.replace("/", "_")
    dest.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", spec], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    env = dict(os.environ, PYTHONPATH=str(dest))
    build = [sys.executable, "lnlib/_cpu/build.py"]
    subprocess.run(build, cwd=dest, env=env, check=True, capture_output=True)
    return dest


class Child:
    """A process running :data:`CHILD` with ``folder``'s lnlib."""

    def __init__(self, folder):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(folder)],
            cwd=folder,
            env=dict(os.environ, PYTHONPATH=str(folder)),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the process for {folder} failed (its error is above)")
        self.cases = line.strip().split("|")

    def time(self, case, number):
        """Seconds per call of ``case`` over ``number`` calls."""
        self.proc.stdin.write(f"{case} {number}\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline()) / number

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", help="folder, WORKTREE or git revision (the baseline)")
    parser.add_argument("b", help="folder, WORKTREE or git revision")
    parser.add_argument("--rounds", type=int, default=101, help="bursts per tree and case")
    parser.add_argument("--burst-ms", type=float, default=10.0, help="length of one burst")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="percall_ab-") as tmp:
        children = [Child(tree(spec, Path(tmp))) for spec in (args.a, args.b)]
        try:
            report(children, args)
        finally:
            for child in children:
                child.close()


def report(children, args):
    """Time every case, the two children taking turns, and print a line per case."""
    print(f"A = {args.a}, B = {args.b}; {args.rounds} bursts each, taking turns")
    print("CPU us per call: the median burst and the fastest one")
    print(f"{'case':<34} {'A':>8} {'B':>8} {'B/A':>6} {'A best':>8} {'B best':>8} {'B/A':>6}")
    for case in children[0].cases:
        per_call = min(children[i].time(case, 20) for i in (0, 1) for _ in range(5))
        number = max(1, round(args.burst_ms * 1e-3 / per_call))
        times = [[], []]
        for r in range(args.rounds):
            for i in (0, 1) if r % 2 == 0 else (1, 0):
                times[i].append(children[i].time(case, number))
        med = [statistics.median(t) * 1e6 for t in times]
        best = [min(t) * 1e6 for t in times]
        print(
            f"{case:<34} {med[0]:8.2f} {med[1]:8.2f} {med[1] / med[0]:6.3f} "
            f"{best[0]:8.2f} {best[1]:8.2f} {best[1] / best[0]:6.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
