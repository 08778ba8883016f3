"""Launcher overheads, spmdrun against torchrun in the same run, repetitions interleaved (A, B, B, A, ...):

  (a) trivial n=N: wall time of a whole job whose workers print and exit (--nproc-per-node N), from the
      launcher's start to its exit (Python start-up of launcher and workers included, for both alike);
  (b) first all_reduce n=2: wall time of a whole job whose 2 workers import torch, initialise a gloo world
      (`import torch.distributed as dist` under torchrun, its port `import spmd as dist` under spmdrun),
      all-reduce one tensor and destroy the world: what a user waits for before the first step;
  (c) restart latency: rank 0 exits 1 on the first attempt (--max-restarts 1); the time from the moment the
      failing worker exits to the moment the restarted rank 0 runs its script's first line again, each taken
      by the workers themselves (time.time() written to a file), so neither launcher's start-up counts;
  (d) failure to exit: a worker raises ValueError (no restarts); the time from the raise to the launcher's
      exit with the failure reported.

Apart from (b), worker scripts import nothing heavy, so the figures are the launchers' own costs. Printed: median
and range over the repetitions, and the ratio spmdrun / torchrun of the medians (below 1: spmdrun faster).

    python benchmarks/launcher.py [--reps 7]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

TRIVIAL = "import os\nprint('rank', os.environ['RANK'])\n"
FLAKY = ("import os, sys, time\n"
         "restarts = os.environ.get('RESTART_COUNT') or os.environ.get('TORCHELASTIC_RESTART_COUNT')\n"
         "if os.environ['RANK'] == '0':\n"
         "    if restarts == '0':\n"
         "        open(os.environ['BENCH_FAILED_AT'], 'w').write(repr(time.time()))\n"
         "        sys.exit(1)\n"
         "    open(os.environ['BENCH_RESTARTED_AT'], 'w').write(repr(time.time()))\n")
BOOM = ("import os, time\n"
        "if os.environ['RANK'] == '1':\n"
        "    open(os.environ['BENCH_FAILED_AT'], 'w').write(repr(time.time()))\n"
        "    raise ValueError('boom')\n")
FIRST_ALL_REDUCE = ("import torch\n"
                    "import {package} as dist\n"
                    "dist.init_process_group('gloo')\n"
                    "t = torch.ones(4)\n"
                    "dist.all_reduce(t)\n"
                    "assert t.eq(dist.get_world_size()).all()\n"
                    "dist.destroy_process_group()\n")
LAUNCHERS = {
    "spmdrun": [sys.executable, "-m", "spmd.run", "--standalone"],
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone"],
}


def _stamp(path: pathlib.Path) -> float:
    return float(path.read_text())


def run_case(case: str, launcher: list[str], scripts: dict[str, pathlib.Path], folder: pathlib.Path) -> float:
    """Seconds that `case` measures for one launch of `launcher` (see the module docstring)."""
    failed_at, restarted_at = folder / "failed_at", folder / "restarted_at"
    for path in (failed_at, restarted_at):
        path.unlink(missing_ok=True)
    env = {**os.environ, "BENCH_FAILED_AT": str(failed_at), "BENCH_RESTARTED_AT": str(restarted_at)}
    nproc = case.rsplit("=", 1)[1] if case.startswith("trivial") else "2"
    args = {"restart": ["--max-restarts", "1", str(scripts["flaky"])], "failure": [str(scripts["boom"])],
            "first": [str(scripts[f"first {launcher[2]}"])]}
    command = [*launcher, "--nproc-per-node", nproc, *args.get(case.split()[0], [str(scripts["trivial"])])]
    start = time.time()
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    end = time.time()
    if (done.returncode == 0) != (not case.startswith("failure")):
        raise SystemExit(f"{launcher[2]} {case}: unexpected exit code {done.returncode}\n{done.stderr[-2000:]}")
    if case.startswith("restart"):
        return _stamp(restarted_at) - _stamp(failed_at)
    if case.startswith("failure"):
        return end - _stamp(failed_at)
    return end - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    folder = pathlib.Path(tempfile.mkdtemp())
    scripts = {}
    bodies = {"trivial": TRIVIAL, "flaky": FLAKY, "boom": BOOM,
              "first spmd.run": FIRST_ALL_REDUCE.format(package="spmd"),
              "first torch.distributed.run": FIRST_ALL_REDUCE.format(package="torch.distributed")}
    for name, body in bodies.items():
        scripts[name] = folder / f"{name.replace(' ', '_')}.py"
        scripts[name].write_text(body)
    print(f"load average {os.getloadavg()[0]:.1f}, {args.reps} interleaved repetitions")
    print(f"{'case':20s} {'spmdrun s (range)':>24s} {'torchrun s (range)':>24s} {'spmd/torch':>10s}")
    for case in ("trivial n=2", "trivial n=4", "first all_reduce n=2", "restart latency", "failure to exit"):
        times: dict[str, list[float]] = {name: [] for name in LAUNCHERS}
        for rep in range(args.reps):
            order = list(LAUNCHERS) if rep % 2 == 0 else list(reversed(LAUNCHERS))
            for name in order:
                times[name].append(run_case(case, LAUNCHERS[name], scripts, folder))
        cells = {name: f"{statistics.median(t):.3f} ({min(t):.2f}-{max(t):.2f})" for name, t in times.items()}
        ratio = statistics.median(times["spmdrun"]) / statistics.median(times["torchrun"])
        print(f"{case:20s} {cells['spmdrun']:>24s} {cells['torchrun']:>24s} {ratio:10.2f}")


if __name__ == "__main__":
    main()
