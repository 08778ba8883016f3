"""benchmarks/gpu_check.py, the script a GPU machine runs once: rehearsed on the CPU (every check but the
shared-GPU ones, CPU tensors, 2 ranks over spmd's gloo) so that a lent GPU's minutes are never spent on a broken
script, and its answer on a machine without CUDA."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
import torch

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
CHECKS = 25     # the main table's rows: 12 collectives, 5 data-parallel steps, spmd's SyncBatchNorm, 4 attention
                # checks, compiled TP, a pipeline step and a checkpoint


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=240)


def test_the_rehearsal_passes_every_check_on_the_cpu() -> None:
    done = _run("--rehearse", "--timeout", "180")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line for line in done.stdout.splitlines()[2:] if line.strip()]
    assert len(rows) == CHECKS, done.stdout
    assert all(" PASS " in row for row in rows), done.stdout
    assert any(row.startswith("CP flex attention (PTRR) vs one process") for row in rows)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA answer: this machine has CUDA")
def test_without_cuda_the_check_says_so_and_succeeds() -> None:
    done = _run()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no CUDA device on this machine" in done.stdout
