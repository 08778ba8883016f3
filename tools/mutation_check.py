"""Break the library on purpose and see whether the tests notice: a small mutation check.

Each mutation replaces one exact snippet of one source file (it must occur exactly once, so the list stays
true as the code moves) in a scratch copy of src/ and tests/, then runs the tests that ought to catch it.
A mutation is caught when those tests fail. Every mutation must be caught by at least one test: one that
survives means a rule, reduction or protocol could be wrong without any test saying so.

    python tools/mutation_check.py [--only NAME ...] [--list]

The last line printed is `caught N of M mutations`. Slow (a pytest run per mutation), so not part of
`make test`; run it after changing a rule, a reduction or a test helper that builds inputs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Mutation:
    """One deliberate bug: in `path`, `old` becomes `new`; `tests` are the pytest arguments that must fail."""

    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "powersgd: error feedback dropped",
        "src/spmd/ddp/powersgd.py",
        "            buffer.add_(state.error_dict[index])",
        "            pass",
        ("tests/parity/test_powersgd_oracle.py", "tests/parity/test_ddp.py", "-k", "powersgd or PowerSGD"),
    ),
    Mutation(
        "powersgd: warm start ignored",
        "src/spmd/ddp/powersgd.py",
        "if state.warm_start and memory is not None",
        "if False and memory is not None",
        ("tests/parity/test_powersgd_oracle.py", "tests/parity/test_ddp.py", "-k", "powersgd or PowerSGD"),
    ),
    Mutation(
        "monitored_barrier: the others wait no longer than the first rank",
        "src/spmd/comm/collectives.py",
        "        grace = max(1.0, 0.5 * seconds)",
        "        grace = 0.0",
        ("tests/comm/test_init_and_monitoring.py",),
    ),
)


def scratch_copy() -> pathlib.Path:
    """src/, tests/ and the pytest configuration, copied without caches."""
    folder = pathlib.Path(tempfile.mkdtemp(prefix="spmd-mutation-"))
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("src", "tests"):
        shutil.copytree(ROOT / name, folder / name, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", folder / "pyproject.toml")
    return folder


def apply(folder: pathlib.Path, mutation: Mutation) -> str:
    """Write the mutation into the copy; returns the original text of the file."""
    path = folder / mutation.path
    text = path.read_text()
    count = text.count(mutation.old)
    if count != 1:
        raise SystemExit(f"mutation {mutation.name!r}: the snippet occurs {count} times in {mutation.path}; "
                         f"update tools/mutation_check.py to the code as it is now")
    path.write_text(text.replace(mutation.old, mutation.new))
    return text


def caught(folder: pathlib.Path, mutation: Mutation, timeout: float) -> tuple[bool, str]:
    """Run the mutation's tests on the mutated copy: (whether they failed, the summary line)."""
    env = {**os.environ, "PYTHONPATH": str(folder / "src")}
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *mutation.tests]
    try:
        done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return True, f"timed out after {timeout:.0f}s (counts as caught: the suite would fail)"
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    summary = lines[-1] if lines else done.stderr.strip().splitlines()[-1:]
    if done.returncode == 5:
        raise SystemExit(f"mutation {mutation.name!r}: its tests {mutation.tests} select nothing")
    return done.returncode != 0, str(summary)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", default=None, help="run only mutations whose name contains these")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per mutation's test run")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if not args.only or any(word in m.name for word in args.only)]
    if args.list:
        for mutation in chosen:
            print(f"{mutation.name}  ({mutation.path}; {' '.join(mutation.tests)})")
        return
    folder = scratch_copy()
    survivors = []
    try:
        for mutation in chosen:
            original = apply(folder, mutation)
            start = time.monotonic()
            was_caught, summary = caught(folder, mutation, args.timeout)
            (folder / mutation.path).write_text(original)
            verdict = "caught  " if was_caught else "SURVIVED"
            print(f"{verdict} {mutation.name} ({time.monotonic() - start:.0f}s): {summary}", flush=True)
            if not was_caught:
                survivors.append(mutation.name)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if survivors:
        print(f"survived: {survivors}")
    print(f"caught {len(chosen) - len(survivors)} of {len(chosen)} mutations")
    if survivors:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
