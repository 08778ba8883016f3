"""The main job runs end to end, under every parallel layout: examples/train_gpt.py on 2 and 4 thread ranks.

A smoke test of the script's whole path (corpus, model, DDP, schedule, validation, sampling); the real run is
`make demo` under spmdrun. Then the layout grid: FSDP, HSDP, TP (+ sequence, + loss parallel), PP (two
schedules, and the multi-stage ones), FSDP x TP, HSDP x TP, PP x FSDP, PP x DDP, PP x TP, each training a
tiny GPT for 2 steps on the same global batch (drawn per step, whatever the layout) as plain data parallelism
over the same ranks, from the same initial weights: the training losses (means over the global batch), the
gradient norms before clipping and the validation loss after the second step (the first to use AdamW's state)
must agree. fp32 on CPU, where only the order of additions differs (sums over shards, microbatches or ranks
instead of one batch): rtol 1e-4. The norms agreeing checks the clipping, which AdamW's per-element
normalisation would otherwise hide from the losses.
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib
import warnings

import pytest
import torch

from spmd.testing import run_ranks

SCRIPT = pathlib.Path(__file__).parents[2] / "examples" / "train_gpt.py"
TIMEOUT = 120.0
TINY = ["--steps", "2", "--layers", "2", "--width", "32", "--heads", "2", "--context", "16", "--global-batch", "8",
        "--lr", "1e-2", "--warmup", "1", "--log-every", "1", "--eval-every", "2", "--eval-batches", "1",
        "--corpus-mb", "0.2", "--sample-tokens", "0", "--threads", "1"]
RTOL, ATOL = 1e-4, 1e-5


@functools.cache
def load_script():
    spec = importlib.util.spec_from_file_location("train_gpt", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train(world_size: int, *flags: str) -> list[dict[str, list[float]]]:
    """Every rank's history of the tiny run under `flags`."""
    train_gpt = load_script()
    threads = torch.get_num_threads()
    try:
        return run_ranks(lambda rank, size: train_gpt.main([*TINY, *flags]), world_size, timeout=TIMEOUT)
    finally:
        torch.set_num_threads(threads)   # --threads is process-wide; leave the other tests theirs


@functools.cache
def data_parallel(world_size: int, *flags: str) -> dict[str, list[float]]:
    histories = train(world_size, *flags)
    assert all(h == histories[0] for h in histories)     # every value is reduced over the ranks
    return histories[0]


def assert_matches_data_parallel(histories: list[dict[str, list[float]]], world_size: int, *flags: str,
                                 rtol: float = RTOL, atol: float = ATOL) -> None:
    want = data_parallel(world_size, *flags)
    for rank, got in enumerate(histories):
        for key in ("train", "grad_norm", "val"):
            torch.testing.assert_close(got[key], want[key], rtol=rtol, atol=atol, msg=f"rank {rank}: {key}")


def test_train_gpt_loss_goes_down_on_two_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    train_gpt = load_script()
    argv = ["--steps", "16", "--layers", "1", "--width", "32", "--heads", "2", "--context", "32",
            "--batch-size", "4", "--grad-accum", "2", "--lr", "1e-2", "--warmup", "2", "--log-every", "4",
            "--eval-every", "8", "--eval-batches", "2", "--corpus-mb", "0.5", "--sample-tokens", "20",
            "--threads", "1"]
    threads = torch.get_num_threads()
    try:
        histories = run_ranks(lambda rank, size: train_gpt.main(argv), 2, timeout=TIMEOUT)
    finally:
        torch.set_num_threads(threads)
    assert histories[0]["val"] == histories[1]["val"]          # validation is all-reduced: ranks agree
    assert histories[0]["val"][-1] < histories[0]["val"][0] < 5.6   # ln(256) = 5.55 at random init
    out = capsys.readouterr().out
    assert "2 rank(s)" in out and "DDP 2" in out and "tok/s" in out and "--- sample ---" in out
    assert out.count("validation loss") == 2                    # printed by rank 0 only


LAYOUTS_2 = {
    "FSDP": ["--dp-shard", "2"],
    "FSDP grad-accum": ["--dp-shard", "2", "--grad-accum", "2"],
    "TP": ["--tp", "2"],
    "TP+SP": ["--tp", "2", "--sequence-parallel"],
    "TP+loss-parallel": ["--tp", "2", "--loss-parallel"],
    "PP GPipe": ["--pp", "2", "--pp-schedule", "GPipe"],
    "PP 1F1B": ["--pp", "2", "--pp-schedule", "1F1B", "--microbatches", "2"],
}


@pytest.mark.parametrize("flags", LAYOUTS_2.values(), ids=LAYOUTS_2.keys())
def test_two_rank_layouts_train_like_data_parallel(flags: list[str]) -> None:
    assert_matches_data_parallel(train(2, *flags), 2)


LAYOUTS_4 = {
    "DP": [],
    "HSDP 2x2": ["--dp-replicate", "2", "--dp-shard", "2"],
    "FSDP x TP+SP+loss-parallel": ["--dp-shard", "2", "--tp", "2", "--sequence-parallel", "--loss-parallel"],
    "DDP-replicas x TP": ["--dp-replicate", "2", "--tp", "2"],
    "PP x FSDP": ["--pp", "2", "--dp-shard", "2"],
    "PP x DDP": ["--pp", "2", "--dp-replicate", "2", "--pp-schedule", "GPipe"],
    "PP x TP+SP": ["--pp", "2", "--tp", "2", "--sequence-parallel"],
}


@pytest.mark.parametrize("flags", LAYOUTS_4.values(), ids=LAYOUTS_4.keys())
def test_four_rank_layouts_train_like_data_parallel(flags: list[str]) -> None:
    assert_matches_data_parallel(train(4, *flags), 2)


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "ZBVZeroBubble"])
def test_multi_stage_schedules_train_like_data_parallel(schedule: str) -> None:
    """Two stages per pipeline rank (looped, and V-shaped: rank 0 holds the first and the last stage)."""
    assert_matches_data_parallel(train(2, "--layers", "4", "--pp", "2", "--pp-schedule", schedule), 2,
                                 "--layers", "4")


def test_hsdp_x_tp_and_pp_x_fsdp_x_tp_on_eight_ranks_train_like_data_parallel() -> None:
    for flags in (["--dp-replicate", "2", "--dp-shard", "2", "--tp", "2"],
                  ["--pp", "2", "--dp-shard", "2", "--tp", "2"]):
        assert_matches_data_parallel(train(8, *flags), 2)


def test_bf16_and_activation_checkpointing_train_close_to_fp32(capsys: pytest.CaptureFixture[str]) -> None:
    """FSDP x TP with FSDP's bf16 policy, PP with autocast: bf16 rounding only, so bf16-sized tolerances; the
    activation checkpointing recomputes the same values. The sample is generated from the gathered stages."""
    for flags in (["--dp-shard", "2", "--tp", "2"], ["--pp", "2", "--tp", "2", "--sample-tokens", "8"]):
        histories = train(4, *flags, "--mixed-precision", "bf16", "--activation-checkpointing")
        assert_matches_data_parallel(histories, 2, rtol=2e-2, atol=2e-2)
    out = capsys.readouterr().out
    assert "PP 2 (1F1B, 4 microbatches) x TP 2" in out and out.count("--- sample ---") == 1


def test_layouts_that_do_not_fit_are_refused_before_training() -> None:
    train_gpt = load_script()
    cases = [(["--dp-shard", "3"], "doesn't divide the world size 2"),
             (["--dp-replicate", "1", "--tp", "1"], r"= 1 ranks, but the world has 2"),
             (["--sequence-parallel"], "need tensor parallelism"),
             (["--pp", "2", "--layers", "1"], "needs at least 2 layers"),
             (["--pp", "2", "--microbatches", "3"], "must divide the 8 sequences"),
             (["--global-batch", "7"], "must be a multiple of dp")]
    for flags, message in cases:
        with pytest.raises(ValueError, match=message):
            run_ranks(lambda rank, size, flags=flags: train_gpt.main([*TINY, *flags]), 2, timeout=TIMEOUT)


def test_parallel_flag_is_a_deprecated_alias_and_unknown_values_are_refused() -> None:
    train_gpt = load_script()
    with pytest.warns(FutureWarning, match="deprecated"):
        assert train_gpt.parse_args(["--parallel", "ddp"]).parallel == "ddp"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train_gpt.parse_args([])
    with pytest.raises(SystemExit):
        train_gpt.parse_args(["--parallel", "fsdp"])


@pytest.mark.parametrize("world_size, flags", [
    (2, ()), (2, ("--dp-shard", "2")), (2, ("--tp", "2", "--sequence-parallel")), (2, ("--pp", "2")),
    (2, ("--dp-shard", "2", "--activation-checkpointing")),
], ids=["ddp", "fsdp", "tp-sp", "pp", "fsdp-ac"])
def test_predicted_memory_is_within_a_fifth_of_the_measured_peak(world_size: int, flags: tuple[str, ...],
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Each rank's predicted bytes (parameters, gradients, optimizer state, FSDP's gathered groups, activations,
    the corpus) against the peak live tensor bytes of its second step, on a model big enough for activations to
    count (context 64, width 128, batch 8)."""
    histories = train(world_size, "--steps", "2", "--width", "128", "--heads", "4", "--context", "64",
                      "--corpus-mb", "1", *flags)
    for rank, history in enumerate(histories):
        predicted, measured = history["memory"]
        assert 0.8 < measured / predicted < 1.25, f"rank {rank}: predicted {predicted}, measured {measured}"
    out = capsys.readouterr().out
    assert "predicted memory (rank 0)" in out and "memory, measured" in out and "exposed communication" in out
    assert "of peak" in out and "MFLOP per token" in out


def test_simulate_plays_one_rank_of_a_large_job_and_measures_its_memory(capsys: pytest.CaptureFixture[str]) -> None:
    train_gpt = load_script()
    flags = [*TINY, "--width", "64", "--layers", "4", "--heads", "2", "--global-batch", "64"]
    threads = torch.get_num_threads()
    try:
        memory = {world: train_gpt.main([*flags, "--simulate", str(world), "--simulate-rank", "1",
                                          "--dp-shard", str(world)])["memory"] for world in (2, 32)}
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "FSDP 32 over fake" in out and "simulated: this process is rank 1" in out
    for predicted, measured in memory.values():
        assert 0.7 < measured / predicted < 1.4, (predicted, measured)
    assert memory[32][1] < memory[2][1] / 2         # state sharded 32 ways, a 16th of the batch per rank
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("flags, message", [
    (["--simulate", "4", "--simulate-rank", "4"], "must be one of the N >= 1 simulated ones"),
    (["--simulate", "4", "--pp", "2"], "can't run --pp"),
    (["--simulate", "4", "--checkpoint-dir", "x"], "writes no checkpoints"),
])
def test_simulate_refuses_what_it_cannot_do(flags: list[str], message: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        load_script().parse_args(flags)
    assert message in capsys.readouterr().err
