"""The trainer's checkpoints (examples/checkpointing.py): a run interrupted and resumed continues exactly.

A tiny GPT trains 6 steps with a checkpoint every 3; the step-6 checkpoint is then removed, as if the job had
died between the two saves, and a run with --resume continues from step 3. On the layout it was saved under, its
losses at steps 4-6 equal the uninterrupted run's bit for bit (fp32: the same additions in the same order, given
the restored parameters, AdamW moments and step counts, learning rate and data position). Under another layout,
or another world size, they agree within the layout grid's tolerance (test_train_gpt.py): only the order of the
additions differs. A half-written checkpoint (no metadata.json) is passed over, and an empty directory starts
afresh, so a restarted job can pass --resume from its first start.
"""

from __future__ import annotations

import pathlib
import shutil

import pytest
import torch

from spmd.testing import run_ranks

from .test_train_gpt import RTOL, TIMEOUT, TINY, load_script

STEPS = ["--steps", "6", "--eval-every", "0"]


def run(world_size: int, directory: pathlib.Path, *flags: str) -> dict[str, list[float]]:
    """Rank 0's history of the tiny run with checkpoints in `directory`."""
    train_gpt = load_script()
    threads = torch.get_num_threads()
    argv = [*TINY, *STEPS, "--checkpoint-dir", str(directory), *flags]
    try:
        return run_ranks(lambda rank, size: train_gpt.main(argv), world_size, timeout=TIMEOUT)[0]
    finally:
        torch.set_num_threads(threads)


def interrupted_after_step_3(world_size: int, directory: pathlib.Path, *flags: str) -> dict[str, list[float]]:
    """The uninterrupted run's history, leaving in `directory` only the checkpoint of step 3."""
    history = run(world_size, directory, "--checkpoint-every", "3", *flags)
    assert sorted(path.name for path in directory.iterdir()) == ["step-000003", "step-000006"]
    shutil.rmtree(directory / "step-000006")
    return history


@pytest.mark.parametrize("world_size, layout", [
    (2, ()), (2, ("--dp-shard", "2")), (4, ("--dp-shard", "2", "--tp", "2")), (2, ("--pp", "2")),
    (2, ("--pp", "2", "--pp-schedule", "Interleaved1F1B", "--layers", "4")),
], ids=["ddp", "fsdp", "fsdp-tp", "pp", "pp-interleaved"])
def test_resume_on_the_same_layout_is_bit_exact(tmp_path: pathlib.Path, world_size: int,
                                                 layout: tuple[str, ...]) -> None:
    whole = interrupted_after_step_3(world_size, tmp_path, *layout)
    resumed = run(world_size, tmp_path, "--resume", *layout)
    assert resumed["step"] == [4, 5, 6]
    assert resumed["train"] == whole["train"][3:]
    assert resumed["grad_norm"] == whole["grad_norm"][3:]
    assert resumed["val"] == whole["val"]


@pytest.mark.parametrize("saved, resumed", [
    ((2, ("--dp-shard", "2")), (4, ("--pp", "2", "--tp", "2"))),
    ((4, ("--dp-shard", "2", "--tp", "2")), (2, ("--pp", "2"))),
    ((2, ("--pp", "2")), (1, ())),
], ids=["fsdp2-to-pp-tp4", "fsdp-tp4-to-pp2", "pp2-to-one-process"])
def test_resume_under_another_layout_continues_the_run(tmp_path: pathlib.Path, saved: tuple[int, tuple[str, ...]],
                                                      resumed: tuple[int, tuple[str, ...]]) -> None:
    whole = interrupted_after_step_3(saved[0], tmp_path, *saved[1])
    history = run(resumed[0], tmp_path, "--resume", *resumed[1])
    assert history["step"] == [4, 5, 6]
    torch.testing.assert_close(history["train"], whole["train"][3:], rtol=RTOL, atol=1e-5)
    torch.testing.assert_close(history["grad_norm"], whole["grad_norm"][3:], rtol=RTOL, atol=1e-5)


def test_resume_passes_over_a_half_written_checkpoint(tmp_path: pathlib.Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    whole = interrupted_after_step_3(2, tmp_path)
    unfinished = tmp_path / "step-000005"
    unfinished.mkdir()
    (unfinished / "__0_0.safetensors.partial").write_bytes(b"\0" * 64)   # a save killed before its commit
    resumed = run(2, tmp_path, "--resume")
    assert resumed["step"] == [4, 5, 6] and resumed["train"] == whole["train"][3:]
    assert "resumed from" in capsys.readouterr().out


def test_keep_checkpoints_leaves_the_newest_and_the_leftovers_go(tmp_path: pathlib.Path) -> None:
    """--keep-checkpoints 2 with a save every step: once each save is committed, all but the newest two complete
    checkpoints are removed, and so is a half-written directory older than them (a killed job's)."""
    leftover = tmp_path / "step-000000"
    leftover.mkdir()
    (leftover / "__0_0.safetensors.partial").write_bytes(b"\0" * 64)
    run(2, tmp_path, "--steps", "4", "--checkpoint-every", "1", "--keep-checkpoints", "2")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step-000003", "step-000004"]
    resumed = run(2, tmp_path, "--steps", "4", "--resume")
    assert resumed["step"] == []                       # the newest kept is the run's end: nothing left to do


def test_resume_without_a_checkpoint_starts_afresh(tmp_path: pathlib.Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    history = run(2, tmp_path / "none-yet", "--resume")
    assert history["step"] == [1, 2, 3, 4, 5, 6]
    assert "no checkpoint in" in capsys.readouterr().out


def test_checkpoint_flags_need_a_directory() -> None:
    train_gpt = load_script()
    with pytest.raises(SystemExit):
        train_gpt.parse_args(["--resume"])


@pytest.mark.parametrize("flags, message", [
    (["--log-every", "0"], "--log-every must be >= 1, got 0"),
    (["--eval-batches", "0"], "--eval-batches must be >= 1, got 0"),
    (["--eval-every", "-1"], "--eval-every must be >= 0, got -1"),
    (["--keep-checkpoints", "-2"], "--keep-checkpoints must be >= 0, got -2"),
])
def test_counts_out_of_range_are_refused_naming_the_flag(flags: list[str], message: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    train_gpt = load_script()
    with pytest.raises(SystemExit):
        train_gpt.parse_args(flags)
    assert message in capsys.readouterr().err


def test_a_run_in_pieces_equals_one_run(tmp_path: pathlib.Path) -> None:
    """--stop-after ends a run early with a checkpoint; the next piece, with --resume, finishes the schedule."""
    whole = run(2, tmp_path / "whole", "--dp-shard", "2")
    first = run(2, tmp_path / "pieces", "--dp-shard", "2", "--stop-after", "4")
    second = run(2, tmp_path / "pieces", "--dp-shard", "2", "--resume")
    assert first["step"] == [1, 2, 3, 4] and second["step"] == [5, 6]
    assert first["train"] + second["train"] == whole["train"]
