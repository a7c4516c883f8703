"""Start-up cost of ``import omni_accel`` and of the command line's ``--help`` / ``--version``, as whole processes.

    python benchmarks/bench_startup.py                                   # this checkout
    python benchmarks/bench_startup.py --tree before=/tmp/old --tree after=.   # two checkouts side by side

Each command runs ``--warmup`` times untimed (file caches), then ``--runs`` times; wall time from a monotonic clock
around the child process and its CPU time (user + sys) from ``os.wait4``. The result file holds every run and the
median, min and max per command and tree. A tree is put first on PYTHONPATH, so the interpreter imports that
checkout's ``omni_accel``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import write_result  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMANDS = {
    "import omni_accel": ["-c", "import omni_accel"],
    "omni-accel --help": ["-m", "omni_accel", "--help"],
    "omni-accel --version": ["-m", "omni_accel", "--version"],
    "omni-accel generate --help": ["-m", "omni_accel", "generate", "--help"],
    "import torch (reference)": ["-c", "import torch"],
}


def run_once(argv: list[str], tree: str) -> tuple[float, float, int]:
    """(wall s, cpu s, exit code) of one child process."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, *argv], env=env, cwd="/", stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    return wall, usage.ru_utime + usage.ru_stime, proc.returncode


def summary(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4),
            "max": round(max(values), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", default=None, metavar="LABEL=DIR",
                    help="a checkout to time (repeatable); default: this one, labelled 'this'")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "startup_cpu.json"))
    args = ap.parse_args()
    trees = dict(t.split("=", 1) for t in (args.tree or [f"this={ROOT}"]))
    result = {"python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
              "load_average_before": os.getloadavg(), "runs": args.runs, "warmup": args.warmup,
              "trees": {label: os.path.abspath(path) for label, path in trees.items()}, "rows": []}
    for name, argv in COMMANDS.items():
        for label, tree in trees.items():
            if name.startswith("import torch") and label != next(iter(trees)):
                continue  # the reference does not depend on the tree
            for _ in range(args.warmup):
                run_once(argv, tree)
            runs = [run_once(argv, tree) for _ in range(args.runs)]
            row = {"command": name, "tree": label, "exit_codes": sorted({r[2] for r in runs}),
                   "wall_s": summary([r[0] for r in runs]), "cpu_s": summary([r[1] for r in runs]),
                   "wall_runs_s": [round(r[0], 4) for r in runs]}
            result["rows"].append(row)
            print(f"{name:32s} {label:8s} wall median {row['wall_s']['median']:.3f} s "
                  f"(min {row['wall_s']['min']:.3f}, max {row['wall_s']['max']:.3f}), cpu {row['cpu_s']['median']:.3f} s",
                  flush=True)
            write_result(args.out, result)
    result["load_average_after"] = os.getloadavg()
    write_result(args.out, result)


if __name__ == "__main__":
    main()
