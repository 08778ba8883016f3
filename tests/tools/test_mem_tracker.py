"""spmd's MemTracker and ModTracker against torch's (the oracle), one process, no process group: one training
step of the same small model under each gives the same snapshots, category by category, module by module, and
the same printed text; then the API's edges (external tensors, errors, iterations, the resize patch)."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker as TorchMemTracker
from torch.distributed._tools.mod_tracker import ModTracker as TorchModTracker
from torch.utils.checkpoint import checkpoint

from spmd._tools import MemTracker, ModTracker


class Block(nn.Module):
    """Linear -> LayerNorm -> GELU -> Linear, with a residual; optionally activation-checkpointed."""

    def __init__(self, width: int, hidden: int, recompute: bool = False) -> None:
        super().__init__()
        self.up, self.norm, self.down = nn.Linear(width, hidden), nn.LayerNorm(hidden), nn.Linear(hidden, width)
        self.recompute = recompute

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.norm(self.up(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (checkpoint(self._body, x, use_reentrant=False) if self.recompute else self._body(x))


def build() -> nn.Module:
    """Parameters, buffers (BatchNorm's running stats), nested modules and an activation-checkpointed block."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 40), nn.BatchNorm1d(40), Block(40, 72), Block(40, 56, recompute=True),
                         nn.Sequential(nn.LayerNorm(40), nn.Linear(40, 8)))


def _plain(snapshot: dict) -> dict:
    """A snapshot with its category keys as their names (each tracker has its own enum)."""
    return {str(device): {getattr(key, "value", key): nbytes for key, nbytes in snap.items()}
            for device, snap in snapshot.items()}


def _modulewise(tracker: Any) -> dict[str, dict[str, list[dict]]]:
    return {stats.mod_fqn: {state.value: [_plain(s) for s in snapshots] for state, snapshots in stats.snapshots.items()}
            for stats in tracker.memory_tracking.values()}


def _printed(show: Callable[..., None], *args: Any, **kwargs: Any) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        show(*args, **kwargs)
    return out.getvalue()


def _tracked_step(tracker_class: type) -> tuple[Any, nn.Module, dict]:
    """One Adam step of a fresh model under a fresh tracker: (tracker, model, snapshot right after backward).
    The model is returned because the tracker keeps its statistics only while the modules live."""
    model = build()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(16, 24, generator=torch.Generator().manual_seed(1))
    tracker = tracker_class()
    tracker.track_external(model, optimizer, x)
    with tracker:
        model(x).square().mean().backward()
        after_backward = tracker.get_tracker_snapshot()
        optimizer.step()
        optimizer.zero_grad()
    return tracker, model, after_backward


def test_snapshots_equal_torchs_category_by_category_and_module_by_module() -> None:
    theirs, their_model, their_after_backward = _tracked_step(TorchMemTracker)
    ours, our_model, our_after_backward = _tracked_step(MemTracker)

    peak = _plain(ours.get_tracker_snapshot("peak"))
    assert peak == _plain(theirs.get_tracker_snapshot("peak"))          # exactly: both count storage bytes
    assert _plain(our_after_backward) == _plain(their_after_backward)
    assert _plain(ours.get_tracker_snapshot()) == _plain(theirs.get_tracker_snapshot())
    cpu = peak["cpu"]
    params = sum(p.nbytes for p in our_model.parameters())
    assert cpu["Parameter"] == params and cpu["Buffer"] == sum(b.nbytes for b in our_model.buffers())
    assert cpu["Optstate"] > 2 * params                                 # Adam's two moments (and step counters)
    assert cpu["Total"] == sum(v for k, v in cpu.items() if k != "Total")

    modules = _modulewise(ours)
    assert modules == _modulewise(theirs)
    assert len(modules) == 14                                           # every module, nested ones included
    assert modules["Sequential.3.up"]["Pre-Forward-AC"]                 # recomputed in backward (checkpoint)
    assert "Pre-Forward-AC" not in modules["Sequential.2.up"]
    assert set(modules["Sequential.4.1"]) == {"Pre-Forward", "Post-Forward", "Peak-Forward", "Pre-Backward",
                                              "Post-Backward", "Peak-Backward"}
    del their_model, our_model


def test_printed_snapshots_are_torchs_text_and_tables_show_the_totals() -> None:
    theirs, their_model, _ = _tracked_step(TorchMemTracker)
    ours, our_model, _ = _tracked_step(MemTracker)
    for kind, units in (("peak", "B"), ("peak", "MiB"), ("current", "KiB")):
        assert _printed(ours.display_snapshot, kind, units=units) == \
            _printed(theirs.display_snapshot, kind, units=units)
    for depth in (1, 3):
        assert _printed(ours.display_modulewise_snapshots, depth=depth, units="KiB") == \
            _printed(theirs.display_modulewise_snapshots, depth=depth, units="KiB")

    # tabulate=True: torch's needs the tabulate package; spmd's draws the table itself
    table = _printed(ours.display_snapshot, "peak", units="B", tabulate=True).splitlines()
    header, row = table[1].split(), table[3].split()
    assert header[0] == "Device" and header[-1] == "Total" and row[0] == "cpu"
    assert int(row[-2]) == ours.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    modulewise = _printed(ours.display_modulewise_snapshots, depth=1, units="B", tabulate=True)
    assert modulewise.startswith("Module:  Sequential\n") and "Peak-Backward # 1" in modulewise
    del their_model, our_model


def test_external_tensors_are_other_and_bad_arguments_are_refused() -> None:
    tracker = MemTracker()
    kept = torch.zeros(1000)
    tracker.track_external(kept, None)
    assert tracker.get_tracker_snapshot()[torch.device("cpu")]["Other"] == 4000
    with pytest.raises(TypeError, match="cannot track a str"):
        tracker.track_external("weights")
    with pytest.raises(ValueError, match="'current' or 'peak'"):
        tracker.get_tracker_snapshot("highest")
    with pytest.raises(ValueError, match="units must be one of B, KiB, MiB, GiB"):
        tracker.display_snapshot(units="MB")


def test_a_second_iteration_needs_reset_mod_stats_and_the_resize_patch_is_undone() -> None:
    model = build()
    x = torch.randn(4, 24)
    resize = torch.UntypedStorage.resize_
    with MemTracker() as tracker:
        model(x).sum().backward()
        with pytest.raises(NotImplementedError, match="reset_mod_stats"):
            model(x)
        tracker.reset_mod_stats()
        model(x).sum().backward()
        freed = torch.ones(256)
        before = tracker.get_tracker_snapshot()[torch.device("cpu")]["Total"]
        freed.untyped_storage().resize_(0)                 # outside dispatch, as FSDP frees unsharded parameters
        assert tracker.get_tracker_snapshot()[torch.device("cpu")]["Total"] == before - 1024
    assert len(tracker.memory_tracking) == 14
    assert torch.UntypedStorage.resize_ is resize


def _module_events(tracker_class: type) -> list[tuple]:
    """What the user hooks see: (hook, module name, parents, in backward) in order, for one step of build()."""
    model = build()
    events: list[tuple] = []
    tracker = tracker_class()

    def record(kind: str) -> Callable[..., None]:
        def hook(module: nn.Module | None, *args: Any) -> None:
            name = tracker.get_known_fqn(module) if module is not None else None
            events.append((kind, name, tuple(sorted(tracker.parents)), tracker.is_bw))
        return hook

    tracker.register_user_hooks(record("pre_fw"), record("post_fw"), record("pre_bw"), record("post_bw"))
    with tracker:
        model(torch.randn(4, 24)).sum().backward()
    events.append(("after", None, tuple(sorted(tracker.parents)), tracker.is_bw))
    return events


def test_mod_tracker_sees_what_torchs_sees() -> None:
    ours = _module_events(ModTracker)
    assert ours == _module_events(TorchModTracker)
    assert ("pre_bw", "Sequential.2.down", ("Global", "Sequential", "Sequential.2", "Sequential.2.down"), True) in ours
    assert ours[-1] == ("after", None, ("Global",), False)
    tracker = ModTracker()
    tracker.register_user_hooks(print)
    with pytest.raises(RuntimeError, match="a pre_fw_hook is registered already"):
        tracker.register_user_hooks(print)
