"""Launcher overheads, spmdrun against torchrun in the same run: median wall time of

  (a) a trivial job (workers print and exit) with --nproc-per-node N,
  (b) a job whose rank 0 exits 1 on the first attempt and is restarted once (--max-restarts 1),
  (c) first-failure reporting: a worker raising ValueError, no restarts (time to the non-zero exit).

Worker scripts import nothing heavy, so the figures are the launchers' own costs.

    python benchmarks/launcher.py [--reps 5]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

TRIVIAL = "import os\nprint('rank', os.environ['RANK'])\n"
FLAKY = ("import os, sys\n"
         "restarts = os.environ.get('RESTART_COUNT') or os.environ.get('TORCHELASTIC_RESTART_COUNT')\n"
         "sys.exit(1 if restarts == '0' and os.environ['RANK'] == '0' else 0)\n")
BOOM = "import os\nif os.environ['RANK'] == '1':\n    raise ValueError('boom')\n"
LAUNCHERS = {
    "spmdrun": [sys.executable, "-m", "spmd.run", "--standalone"],
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone"],
}


def timed(command: list[str]) -> tuple[float, int]:
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    return time.perf_counter() - start, done.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    folder = pathlib.Path(tempfile.mkdtemp())
    scripts = {}
    for name, body in (("trivial", TRIVIAL), ("flaky", FLAKY), ("boom", BOOM)):
        scripts[name] = folder / f"{name}.py"
        scripts[name].write_text(body)
    cases = [(f"trivial n={n}", ["--nproc-per-node", str(n), str(scripts["trivial"])], True) for n in (2, 4)]
    cases += [("restart once n=2", ["--nproc-per-node", "2", "--max-restarts", "1", str(scripts["flaky"])], True),
              ("ValueError n=2", ["--nproc-per-node", "2", str(scripts["boom"])], False)]
    print(f"{'case':20s} {'spmdrun s':>10s} {'torchrun s':>11s} {'ratio':>6s}")
    for label, case_args, should_succeed in cases:
        medians = {}
        for name, launcher in LAUNCHERS.items():
            times = []
            for _ in range(args.reps):
                seconds, returncode = timed(launcher + case_args)
                if (returncode == 0) != should_succeed:
                    raise SystemExit(f"{name} {label}: unexpected exit code {returncode}")
                times.append(seconds)
            medians[name] = statistics.median(times)
        ratio = medians["spmdrun"] / medians["torchrun"]
        print(f"{label:20s} {medians['spmdrun']:10.2f} {medians['torchrun']:11.2f} {ratio:6.2f}")


if __name__ == "__main__":
    main()
