"""async_save with AsyncCheckpointerType.PROCESS (TorchTitan's "async_with_pinned_mem" mode: DefaultStager with
every option on, the writing in a daemon process), in a 2-rank job under spmdrun (process_save_job.py): it
writes what a save on a thread writes, from copies staged before the tensors change, with one daemon per rank
kept for the next saves; a daemon killed fails its rank's next PROCESS save and the other rank's, naming it,
instead of hanging, and saves on a thread, or by one process alone (no_dist) in a daemon of its own, still work;
a daemon that dies starting fails the save on both ranks within seconds, naming it (see Note: the checkpoint
process in spmd/checkpoint/save_process.py)."""

from __future__ import annotations

import pathlib

import pytest
import torch

from tests.run.helpers import spmdrun

JOB = pathlib.Path(__file__).with_name("process_save_job.py")


@pytest.mark.timeout(180)
def test_the_checkpoint_process_writes_what_a_thread_writes_and_a_dead_one_fails_its_saves(
        tmp_path: pathlib.Path) -> None:
    done = spmdrun("--standalone", "--nproc-per-node", "2", str(JOB), str(tmp_path), timeout=150)
    assert done.returncode == 0, done.stdout + done.stderr
    seen = [torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1)]
    whole = torch.arange(24.0).reshape(6, 4)
    for rank, result in enumerate(seen):
        for kind in ("thread", "process"):
            assert torch.equal(result[kind]["weight"], whole) and result[kind]["step"] == 1, (rank, kind)
            assert torch.equal(result[kind]["bias"], torch.ones(3)), (rank, kind)
        assert torch.equal(result["pinned"]["weight"], whole * 2) and result["pinned"]["step"] == 2
        assert len(result["daemons"]) == 1, result["daemons"]
        assert torch.equal(result["after_kill_on_a_thread"]["weight"], whole * 3)
        assert torch.equal(result["alone"], torch.arange(5.0) + rank)
    assert "rank 1's checkpoint process" in seen[1]["after_kill"] and "died" in seen[1]["after_kill"]
    assert seen[0]["after_kill"] != "saved" and "rank 1" in seen[0]["after_kill"], seen[0]["after_kill"]
    for rank, result in enumerate(seen):     # rank 1's daemon of a new group died starting
        assert "rank 1's checkpoint process" in result["daemon_broken"], (rank, result["daemon_broken"])
        assert "died" in result["daemon_broken"], (rank, result["daemon_broken"])
        assert result["daemon_broken_after_s"] < 60, (rank, result["daemon_broken_after_s"])
