"""CommDebugMode on thread ranks: exact counts for each redistribution, a colwise -> rowwise MLP's per-module
forward and backward counts, the reports, per-rank isolation, nesting and re-entry, and nothing left
registered after the block (also when it raises)."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from torch import nn
from torch.nn.modules import module as nn_module
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils.checkpoint import checkpoint

import spmd
import spmd.comm.collectives as collectives
import spmd.comm.functional as functional
from spmd.comm.world import current_world
from spmd.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor, init_device_mesh
from spmd.tensor.debug import CommCounts, CommDebugMode
from spmd.testing import run_ranks, seeded
from spmd.testing.dtensor import make_dtensor

TIMEOUT = 60
FULL = torch.randn(8, 12, generator=torch.Generator().manual_seed(0))


def _counts(per_direction: CommCounts) -> dict[str, int]:
    return dict(per_direction)


def _module_counts(mode: CommDebugMode) -> dict[str, dict[str, dict[str, int]]]:
    return {fqn: {direction: _counts(counts) for direction, counts in per.items()}
            for fqn, per in mode.comm_module_counts.items()}


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize(("src", "dst", "collective"), [
    (Shard(0), Replicate(), "all_gather_into_tensor"), (Partial(), Replicate(), "all_reduce"),
    (Partial(), Shard(0), "reduce_scatter_tensor"), (Shard(0), Shard(1), "all_to_all_single"),
    (Replicate(), Shard(1), None), (Replicate(), Partial(), None)])
def test_each_redistribution_counts_its_one_collective(world_size: int, src, dst, collective: str | None) -> None:
    def body(rank: int, world_size: int) -> tuple[dict[str, int], int]:
        mesh = init_device_mesh("cpu", (world_size,))
        x = make_dtensor(FULL, mesh, [src])
        with CommDebugMode() as mode:
            y = x.redistribute(mesh, [dst])
        torch.testing.assert_close(y.full_tensor(), FULL)
        return dict(mode.get_comm_counts()), mode.get_total_counts()

    expected = ({collective: 1}, 1) if collective else ({}, 0)
    assert run_ranks(body, world_size, timeout=TIMEOUT) == [expected] * world_size


def test_counts_are_found_by_every_name_of_a_collective() -> None:
    counts = CommCounts({"all_gather": 2, "all_reduce": 1, "all_to_all": 3})
    assert dict(counts) == {"all_gather_into_tensor": 2, "all_reduce": 1, "all_to_all_single": 3}
    for key in ("all_gather_into_tensor", "all_gather", collectives.all_gather_into_tensor, collectives.all_gather,
                functional.all_gathered, spmd.all_gather_into_tensor):
        assert counts[key] == 2, key
    for key in (collectives.all_reduce, spmd.all_reduce, functional.all_reduced, torch.ops._c10d_functional.all_reduce,
                torch.ops._c10d_functional.all_reduce.default):
        assert counts[key] == 1, key
        assert key in counts
    assert counts["all_to_all"] == counts[collectives.all_to_all_single] == counts[functional.all_to_all_dims] == 3
    assert counts[collectives.reduce_scatter_tensor] == 0 and "reduce_scatter" not in counts
    assert counts.get(functional.reduce_scattered, 7) == 7
    assert counts == {collectives.all_gather: 2, "all_reduce": 1, functional.all_to_all_dims: 3}
    assert counts != {"all_reduce": 1}
    counts[spmd.reduce_scatter] += 1
    assert counts["reduce_scatter_tensor"] == 1


def test_public_collectives_count_and_point_to_point_does_not() -> None:
    def body(rank: int, world_size: int) -> dict[str, int]:
        t = torch.ones(3)
        with CommDebugMode() as mode:
            spmd.all_reduce(t)
            spmd.broadcast(t, src=0)
            spmd.all_gather([torch.empty(3) for _ in range(world_size)], t)
            spmd.reduce_scatter_tensor(torch.empty(3), torch.ones(3 * world_size))
            spmd.barrier()
            if rank == 0:
                spmd.send(t, dst=1)
            else:
                spmd.recv(t, src=0)
        counts = mode.get_comm_counts()
        assert counts[spmd.all_gather_into_tensor] == counts["all_gather"] == 1
        assert mode.get_total_counts() == 5
        return dict(counts)

    expected = {"all_reduce": 1, "broadcast": 1, "all_gather_into_tensor": 1, "reduce_scatter_tensor": 1,
                "barrier": 1}
    assert run_ranks(body, 2, timeout=TIMEOUT) == [expected] * 2


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 16)
        self.fc2 = nn.Linear(16, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _tp_mlp(mesh) -> MLP:
    """fc1 column-wise (weight and bias Shard(0), replicated input made from the local one), fc2 row-wise
    (weight Shard(1), output all-reduced to Replicate), as torch's ColwiseParallel and RowwiseParallel."""
    with seeded(0):
        model = MLP()

    def colwise(name: str, module: nn.Module, mesh) -> None:
        for param_name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(param_name, nn.Parameter(distribute_tensor(param.data, mesh, [Shard(0)])))

    def rowwise(name: str, module: nn.Module, mesh) -> None:
        module.weight = nn.Parameter(distribute_tensor(module.weight.data, mesh, [Shard(1)]))

    distribute_module(model.fc1, mesh, colwise,
                      input_fn=lambda module, inputs, mesh: tuple(DTensor.from_local(x, mesh, [Replicate()])
                                                                  for x in inputs))
    distribute_module(model.fc2, mesh, rowwise,
                      output_fn=lambda module, output, mesh: output.redistribute(mesh, [Replicate()]))
    distribute_module(model, mesh)
    return model


def _mlp_step(model: MLP) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(4, 12, generator=torch.Generator().manual_seed(1), requires_grad=True)
    out = model(x)
    out.to_local().pow(2).sum().backward()
    return out.to_local().detach(), x.grad


@pytest.mark.parametrize("world_size", [2, 4])
def test_mlp_counts_per_module_forward_and_backward(world_size: int) -> None:
    def body(rank: int, world_size: int) -> dict:
        mesh = init_device_mesh("cpu", (world_size,))
        model = _tp_mlp(mesh)
        plain_out, plain_grad = _mlp_step(model)
        model.zero_grad()
        mode = CommDebugMode()
        with mode:
            out, grad = _mlp_step(model)
        torch.testing.assert_close(out, plain_out)          # watching changes nothing
        torch.testing.assert_close(grad, plain_grad)
        assert mode.get_comm_counts() == {"all_reduce": 2}
        assert mode.get_per_module_info() is mode.comm_module_counts
        assert mode.get_sharding_info() == {"MLP.fc1.weight": (Shard(0),), "MLP.fc1.bias": (Shard(0),),
                                            "MLP.fc2.weight": (Shard(1),), "MLP.fc2.bias": (Replicate(),)}
        params = mode.get_parameter_info()
        assert {fqn: sorted(p) for fqn, p in params.items()} == {"MLP.fc1": ["bias", "weight"],
                                                                  "MLP.fc2": ["bias", "weight"]}
        assert params["MLP.fc2"]["weight"].placements == (Shard(1),)
        tracker = mode.advanced_module_tracker
        assert tracker.parent_dict == {"Global": ["MLP"], "MLP": ["MLP.fc1", "MLP.fc2"]}
        assert {fqn: info["depth"] for fqn, info in tracker.module_helper_dict.items()} == {
            "Global": 0, "MLP": 1, "MLP.fc1": 2, "MLP.fc2": 2}
        return _module_counts(mode)

    one = {"all_reduce": 1}
    expected = {"Global": {"forward": one, "backward": one}, "MLP": {"forward": one, "backward": one},
                "MLP.fc1": {"forward": {}, "backward": one}, "MLP.fc2": {"forward": one, "backward": {}}}
    assert run_ranks(body, world_size, timeout=TIMEOUT) == [expected] * world_size


def test_tracing_table_log_file_and_json_dump(tmp_path) -> None:
    def body(rank: int, world_size: int) -> None:
        mesh = init_device_mesh("cpu", (world_size,))
        model = _tp_mlp(mesh)
        with CommDebugMode() as mode:
            _mlp_step(model)
        quiet = mode.generate_comm_debug_tracing_table(noise_level=0)
        assert quiet.startswith("Global\n  FORWARD PASS\n\x1b[1;33m    *all_reduce: 1\x1b[0m\n")
        assert "\n        MLP.fc2\n" in quiet and "**" not in quiet and "Parameter List" not in quiet
        detailed = mode.generate_comm_debug_tracing_table(noise_level=1)
        assert "*module type: class 'torch.nn.modules.linear.Linear'" in detailed
        assert "*weight: (Shard(1),)" in detailed and "**aten.addmm.default" in detailed
        assert "**aten.t.default" not in detailed and "aten.t.default" in mode.generate_comm_debug_tracing_table(3)

        log = tmp_path / f"rank{rank}.txt"
        mode.log_comm_debug_tracing_table_to_file(str(log), noise_level=1)
        text = log.read_text()
        assert "\x1b" not in text and "*all_reduce: 1" in text and "BACKWARD PASS" in text

        dump = tmp_path / f"rank{rank}.json"
        mode.generate_json_dump(str(dump), noise_level=1)
        root = json.loads(dump.read_text())
        assert root["fqn"] == "Global" and [child["fqn"] for child in root["children"]] == ["MLP"]
        fc1, fc2 = root["children"][0]["children"]
        assert (fc1["fqn"], fc2["fqn"]) == ("MLP.fc1", "MLP.fc2")
        assert fc2["collectives_forward"] == [["all_reduce", 1]] and fc2["collectives_backward"] == []
        assert fc1["collectives_backward"] == [["all_reduce", 1]]
        assert ["weight", "(Shard(1),)"] in fc2["parameters"]
        assert any(op["name"] == "aten.addmm.default" for op in fc2["operations_forward"])
        assert fc2["operations_backward"] and all(op["input_sharding"] for op in fc2["operations_backward"])

    run_ranks(body, 2, timeout=TIMEOUT)


class Left(nn.Module):
    def forward(self, x: torch.Tensor, group) -> torch.Tensor:
        return functional.all_reduce_fwd_identity_bwd(x, group)


class Right(nn.Module):
    def forward(self, x: torch.Tensor, group) -> torch.Tensor:
        return functional.all_reduce_fwd_identity_bwd(functional.all_reduce_fwd_identity_bwd(x, group), group)


def test_each_rank_counts_only_its_own_collectives_and_modules() -> None:
    def body(rank: int, world_size: int) -> tuple[int, dict]:
        t = torch.ones(2)
        mode = CommDebugMode()
        mode.__enter__()
        for step in range(world_size):     # rank r watches its first r + 1 all-reduces only
            if step == rank + 1:
                mode.__exit__(None, None, None)
            spmd.all_reduce(t)
        if rank == world_size - 1:
            mode.__exit__(None, None, None)
        first = mode.get_total_counts()

        left, right = spmd.new_group([0, 1]), spmd.new_group([2, 3])
        module, group = (Left(), left) if rank < 2 else (Right(), right)
        with mode:                          # every rank's forward and backward run at once
            module(torch.ones(2, requires_grad=True), group).sum().backward()
        assert set(mode.advanced_module_tracker.module_helper_dict) == {"Global", type(module).__name__}
        return first, _module_counts(mode)

    def counted(n: int, name: str) -> dict:
        per = {"forward": {"all_reduce": n}, "backward": {}}
        return {"Global": per, name: per}

    assert run_ranks(body, 4, timeout=TIMEOUT) == [
        (1, counted(1, "Left")), (2, counted(1, "Left")), (3, counted(2, "Right")), (4, counted(2, "Right"))]


def test_collectives_issued_from_another_thread_count_for_the_rank() -> None:
    def body(rank: int, world_size: int) -> int:
        group = current_world().default_group
        with CommDebugMode() as mode:
            # an accelerator's autograd thread has no spmd world of its own: the group's observers count it
            helper = threading.Thread(target=lambda: spmd.all_reduce(torch.ones(2), group=group))
            helper.start()
            helper.join(TIMEOUT)
        return mode.get_comm_counts()[spmd.all_reduce]

    assert run_ranks(body, 2, timeout=TIMEOUT) == [1, 1]


def test_nesting_reentry_and_reset() -> None:
    def body(rank: int, world_size: int) -> None:
        t = torch.ones(2)
        outer, inner = CommDebugMode(), CommDebugMode()
        with outer:
            spmd.all_reduce(t)
            with inner:
                spmd.broadcast(t, src=0)
                with pytest.raises(RuntimeError, match="already active"):
                    inner.__enter__()
            spmd.all_reduce(t)
        assert outer.get_comm_counts() == {"all_reduce": 2, "broadcast": 1}
        assert inner.get_comm_counts() == {"broadcast": 1}
        with outer:                         # entering again starts from zero
            assert outer.get_total_counts() == 0 and list(outer.comm_module_counts) == ["Global"]
            spmd.barrier()
        assert outer.get_comm_counts() == {"barrier": 1}
        spmd.all_reduce(t)                  # after the block nothing counts
        assert outer.get_total_counts() == 1 and repr(outer) == "CommDebugMode(get_total_counts()=1)"

    run_ranks(body, 2, timeout=TIMEOUT)


def test_nothing_stays_registered_after_the_block_even_when_it_raises() -> None:
    def body(rank: int, world_size: int) -> None:
        mesh = init_device_mesh("cpu", (world_size,))
        model = _tp_mlp(mesh)
        world = current_world()
        global_hooks = (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks))
        module_hooks = {name: len(m._forward_hooks) for name, m in model.named_modules()}

        def left_behind() -> list[str]:
            found = []
            if world.observers.callbacks:
                found.append("observer")
            if any(group.observers is not world.observers for group in world.groups if hasattr(group, "observers")):
                found.append("a group with observers of its own")
            if {name: len(m._forward_hooks) for name, m in model.named_modules()} != module_hooks:
                found.append("module forward hooks")
            if _get_current_dispatch_mode() is not None:
                found.append("dispatch mode")
            return found

        with CommDebugMode():
            _mlp_step(model)
            assert world.observers.callbacks and _get_current_dispatch_mode() is not None
        assert left_behind() == []
        with pytest.raises(ValueError, match="boom"), CommDebugMode() as mode:
            out = model(torch.randn(4, 12, requires_grad=True))
            raise ValueError("boom")
        assert left_behind() == [] and mode.get_total_counts() == 1
        out.to_local().sum().backward()     # hooks on tensors made inside the block do nothing now
        assert mode.get_total_counts() == 1
        # every rank's instances are gone from torch's global hooks (checked once all ranks are out)
        spmd.barrier()
        assert (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks)) <= global_hooks

    run_ranks(body, 2, timeout=TIMEOUT)
    assert not nn_module._global_forward_pre_hooks


def test_activation_checkpointing_recompute_counts_as_backward() -> None:
    class Block(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = functional.all_reduce_fwd_identity_bwd(x, current_world().default_group)
            return y * y                    # y is saved for backward: recomputing it all-reduces again

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = Block()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.block, x, use_reentrant=False)

    def body(rank: int, world_size: int) -> dict:
        with CommDebugMode() as mode:
            Net()(torch.ones(3, requires_grad=True)).sum().backward()
        return _module_counts(mode)

    per = {"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}}
    assert run_ranks(body, 2, timeout=TIMEOUT) == [{"Global": per, "Net": per, "Net.block": per}] * 2


def test_without_a_process_group_modules_are_tracked_and_nothing_counts() -> None:
    model = MLP()
    with CommDebugMode() as mode:
        model(torch.randn(2, 12, requires_grad=True)).sum().backward()
    assert mode.get_total_counts() == 0
    assert list(mode.advanced_module_tracker.module_helper_dict) == ["Global", "MLP", "MLP.fc1", "MLP.fc2"]
    assert mode.get_sharding_info() == {}
    assert sorted(mode.get_parameter_info()["MLP.fc1"]) == ["bias", "weight"]


def test_autograd_grad_to_a_leaf_input_is_tracked() -> None:
    """A pipeline stage's I action: autograd.grad from the outputs to the stage's received input, a leaf. Autograd
    can't say inside autograd.grad whether it will reach a leaf, so the tracker must not ask (it used to raise)."""
    def body(rank: int, size: int) -> dict:
        mesh = init_device_mesh("cpu", (size,))
        def colwise(name: str, module: nn.Module, m) -> None:
            for param_name, param in list(module.named_parameters()):
                module.register_parameter(param_name, nn.Parameter(distribute_tensor(param.data, m, [Shard(0)])))
        layer = distribute_module(nn.Linear(4, 4), mesh, colwise,
                                  input_fn=lambda mod, inputs, m: (DTensor.from_local(inputs[0], m, [Replicate()]),),
                                  output_fn=lambda mod, out, m: out.redistribute(placements=[Replicate()]).to_local())
        x = torch.randn(3, 4, requires_grad=True)
        with CommDebugMode() as mode:
            out = layer(x)                     # the module's input is the leaf itself
            (grad,) = torch.autograd.grad(out.sum(), [x], retain_graph=True)
        assert grad.shape == x.shape
        return {name: dict(info["forward"]) for name, info in mode.get_per_module_info().items()}
    for per_module in run_ranks(body, 2, timeout=60):
        assert per_module["Linear"] == {"all_gather_into_tensor": 1}
