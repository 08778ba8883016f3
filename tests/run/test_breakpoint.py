"""spmd.breakpoint: one rank stops in pdb on the terminal spmdrun was given while the others wait for it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import spmd
from spmd.testing import run_ranks
from tests.run.helpers import SPMDRUN

SCRIPT = """
    import spmd
    spmd.init_process_group()
    x = 40 + spmd.get_rank()
    spmd.breakpoint(rank=1)
    print("after the breakpoint on rank", spmd.get_rank(), flush=True)
    spmd.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_the_named_rank_takes_pdb_commands_from_spmdruns_stdin_and_the_others_wait(tmp_path: Path) -> None:
    worker = tmp_path / "debugged.py"
    worker.write_text(textwrap.dedent(SCRIPT))
    result = subprocess.run([*SPMDRUN, "--standalone", "--nproc-per-node", "2", str(worker)], input="p x * 10\nc\n",
                            capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("[rank1]: ") and "rank 1 stopped at the caller's line" in line for line in lines)
    assert any(line.startswith("[rank1]: ") and "410" in line for line in lines), result.stdout   # p x * 10
    assert not any("stopped at" in line for line in lines if line.startswith("[rank0]"))
    for rank in (0, 1):          # pdb's prompt, not ended by an echoed newline, can lead the line
        assert any(line.startswith(f"[rank{rank}]: ") and line.endswith(f"after the breakpoint on rank {rank}")
                   for line in lines), result.stdout


def test_skipped_calls_return_at_once_and_a_rank_without_stdin_is_told_why(monkeypatch: pytest.MonkeyPatch) -> None:
    def body(rank: int, size: int) -> int:
        for _ in range(3):
            spmd.breakpoint(rank=0, skip=3)      # pdb would read pytest's captured stdin and fail
        return rank

    assert run_ranks(body, 2, timeout=60) == [0, 1]
    with open(os.devnull) as devnull:
        monkeypatch.setattr(sys, "stdin", devnull)
        with pytest.raises(RuntimeError, match=r"spmd.breakpoint on rank 0: this process's standard input is "
                                               r"/dev/null"):
            run_ranks(lambda rank, size: spmd.breakpoint(), 1, timeout=60)
