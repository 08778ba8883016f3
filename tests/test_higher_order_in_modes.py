"""Higher-order operators under spmd's TorchDispatchModes: flex_attention's HOP reaches CommDebugMode, the
memory tracker of spmd.testing and spmd._tools.MemTracker, which run it (the trackers counting its inner ops, the
score matrix included) instead of raising torch's "no rule registered for HigherOrderOperator". Eager
flex_attention hands the HOP to the modes when it is not compiled (_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG); its
default path compiles, which dynamo refuses under any such mode, torch's own included."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.attention.flex_attention as flex

from spmd._tools import MemTracker
from spmd.tensor.debug import CommDebugMode
from spmd.testing.memory import TensorMemoryTracker

B, H, L, E = 1, 2, 256, 16
SCORES = B * H * L * L * 4          # flex's eager path materializes the float32 score matrix


@pytest.fixture
def uncompiled_flex(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flex, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _attend() -> torch.Tensor:
    q = torch.randn(B, H, L, E, generator=torch.Generator().manual_seed(0))
    return flex.flex_attention(q, q, q)


def test_comm_debug_mode_runs_flex_attention_and_counts_no_collective(uncompiled_flex: None) -> None:
    mode = CommDebugMode()
    with mode:
        out = _attend()
    assert torch.equal(out, _attend()) and mode.get_total_counts() == 0


@pytest.mark.parametrize("make", [TensorMemoryTracker, MemTracker], ids=["TensorMemoryTracker", "MemTracker"])
def test_memory_trackers_count_flex_attentions_score_matrix(uncompiled_flex: None, make: type) -> None:
    tracker = make()
    with tracker:
        out = _attend()
    assert torch.equal(out, _attend())
    peak = (tracker.peak_bytes if isinstance(tracker, TensorMemoryTracker)
            else tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])
    assert peak >= SCORES, (peak, SCORES)
