"""The main job runs end to end: examples/train_gpt.py trains a tiny GPT under DDP on 2 thread ranks.

A smoke test of the script's whole path (corpus, model, DDP, schedule, validation, sampling); the real run
is `make demo` under spmdrun. Parity of the training itself is tests/parity/test_ddp.py's job.
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

from spmd.testing import run_ranks

SCRIPT = pathlib.Path(__file__).parents[2] / "examples" / "train_gpt.py"


def load_script():
    spec = importlib.util.spec_from_file_location("train_gpt", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_gpt_loss_goes_down_on_two_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    train_gpt = load_script()
    argv = ["--steps", "16", "--layers", "1", "--width", "32", "--heads", "2", "--context", "32",
            "--batch-size", "4", "--grad-accum", "2", "--lr", "1e-2", "--warmup", "2", "--log-every", "4",
            "--eval-every", "8", "--eval-batches", "2", "--corpus-mb", "0.5", "--sample-tokens", "20",
            "--threads", "1"]
    threads = torch.get_num_threads()
    try:
        histories = run_ranks(lambda rank, size: train_gpt.main(argv), 2, timeout=90)
    finally:
        torch.set_num_threads(threads)   # --threads is process-wide; leave the other tests theirs
    assert histories[0]["val"] == histories[1]["val"]          # validation is all-reduced: ranks agree
    assert histories[0]["val"][-1] < histories[0]["val"][0] < 5.6   # ln(256) = 5.55 at random init
    out = capsys.readouterr().out
    assert "2 rank(s)" in out and "tok/s" in out and "--- sample ---" in out
    assert out.count("validation loss") == 2                    # printed by rank 0 only


def test_unknown_parallel_flag_is_refused() -> None:
    train_gpt = load_script()
    with pytest.raises(SystemExit):
        train_gpt.parse_args(["--parallel", "fsdp"])
