"""spmd.checkpoint.state_dict: FQN-keyed model and optimizer state dicts for plain, DDP, FSDP2, tensor-parallel,
FSDP x TP and pipeline-stage modules, on thread ranks.

The oracle is one process: a plain model trained on the same global batch (each data-parallel rank's chunk in
turn, the chunk losses averaged, which is the gradient DDP and FSDP average) with the same AdamW. The model is an
input projection, two Megatron blocks (colwise `up` 8 -> 10, rowwise `down` 10 -> 8: FSDP over 4 ranks holds
3/3/3/1 rows of `up`, FSDP x TP the 3/2 dp pieces of each tp rank's 5 rows, as _StridedShard; tensor parallelism
itself needs even pieces, its plain activations are rewrapped by DTensor.from_local), a LayerNorm, a head and a
persistent buffer. Round trips on one layout are bit-identical; parity with one process is to rtol 1e-5 /
atol 1e-6 (fp32 on CPU, only the order of additions differs).
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spmd.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from spmd.ddp import DistributedDataParallel
from spmd.device_mesh import init_device_mesh
from spmd.fsdp import fully_shard
from spmd.tensor import DTensor, Replicate
from spmd.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from spmd.tensor.placement import _StridedShard
from spmd.testing import run_ranks, seeded

TIMEOUT = 60.0
RTOL, ATOL = 1e-5, 1e-6
FULL = StateDictOptions(full_state_dict=True)
WORLD = {"plain": 1, "ddp": 2, "fsdp": 4, "hsdp": 4, "tp": 2, "fsdp_tp": 4}
DP = {"plain": 1, "ddp": 2, "fsdp": 4, "hsdp": 4, "tp": 1, "fsdp_tp": 2}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 10)
        self.down = nn.Linear(10, 8)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(F.gelu(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 3))

    def forward(self, x: Tensor) -> Tensor:
        x = torch.tanh(self.inp(x))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)) * self.scale




def build(seed: int = 0) -> Net:
    with seeded(seed):
        return Net()


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def batch(step: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 5, generator=gen), torch.randn(8, 3, generator=gen)


def parallelize(layout: str, model: Net) -> tuple[nn.Module, int, int]:
    """`model` laid out as `layout` on this rank; returns it, this rank's data-parallel index and the dp size."""
    if layout == "plain":
        return model, 0, 1
    world = WORLD[layout]
    if layout == "ddp":
        ddp = DistributedDataParallel(model)
        return ddp, ddp.process_group.rank(), world
    if layout in ("fsdp", "hsdp"):       # HSDP: replicated over mesh dim 0, sharded over dim 1
        mesh = init_device_mesh("cpu", (world,) if layout == "fsdp" else (2, 2))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, mesh.get_rank(), world
    mesh = init_device_mesh("cpu", (2, 2) if layout == "fsdp_tp" else (world,),
                           mesh_dim_names=("dp", "tp") if layout == "fsdp_tp" else ("tp",))
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if layout == "tp":
        return model, 0, 1
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, mesh.get_local_rank("dp"), 2


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range, dp_rank: int, dp: int) -> None:
    for step in steps:
        x, y = batch(step)
        optimizer.zero_grad()
        F.mse_loss(model(x.chunk(dp)[dp_rank]), y.chunk(dp)[dp_rank]).backward()
        optimizer.step()


def train_one_process(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range, dp: int) -> None:
    for step in steps:
        x, y = batch(step)
        optimizer.zero_grad()
        for xs, ys in zip(x.chunk(dp), y.chunk(dp), strict=True):
            (F.mse_loss(model(xs), ys) / dp).backward()
        optimizer.step()


@functools.cache
def reference(dp: int) -> dict[str, Any]:
    """One process: the state dicts after 2 steps (copied), and the model's state dict after a 3rd."""
    model = build()
    optimizer = adamw(model)
    train_one_process(model, optimizer, range(2), dp)
    model_sd, optim_sd = copy.deepcopy(get_state_dict(model, optimizer))
    train_one_process(model, optimizer, range(2, 3), dp)
    return {"model": model_sd, "optim": optim_sd, "final": copy.deepcopy(model.state_dict())}


def local(value: Any) -> Any:
    return value.to_local() if isinstance(value, DTensor) else value


def assert_equal_trees(got: Any, want: Any, exact: bool = True) -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), (list(got), list(want))
        for key in want:
            assert_equal_trees(got[key], want[key], exact)
    elif isinstance(want, list | tuple):
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert_equal_trees(a, b, exact)
    elif isinstance(want, Tensor):
        assert type(got) is type(want)
        if isinstance(want, DTensor):
            assert got.placements == want.placements and got.shape == want.shape
        if exact:
            assert torch.equal(local(got), local(want))
        else:
            torch.testing.assert_close(local(got), local(want), rtol=RTOL, atol=ATOL)
    else:
        assert got == want


# -- keys ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["plain", "ddp", "fsdp", "fsdp_tp"])
def test_keys_are_the_plain_models_fqns(layout: str) -> None:
    plain = build()
    names = [name for name, _ in plain.named_parameters()]

    def body(rank: int, world_size: int) -> None:
        model, dp_rank, dp = parallelize(layout, copy.deepcopy(plain))
        optimizer = adamw(model)
        train(model, optimizer, range(1), dp_rank, dp)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        assert list(model_sd) == list(plain.state_dict())
        assert list(optim_sd["state"]) == names
        assert [group["params"] for group in optim_sd["param_groups"]] == [names]
        assert set(optim_sd["state"]["head.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
        sharded = layout in ("fsdp", "fsdp_tp")
        assert isinstance(model_sd["head.weight"], DTensor) == sharded
        assert isinstance(optim_sd["state"]["head.weight"]["exp_avg"], DTensor) == sharded
        if layout == "fsdp_tp":      # FSDP over a colwise weight: the dp shard of the tp shard
            assert isinstance(model_sd["blocks.0.up.weight"].placements[0], _StridedShard)

    run_ranks(body, world_size=WORLD[layout], timeout=TIMEOUT)


def test_a_pipeline_stage_has_its_part_of_the_fqns_and_loads_its_part_of_a_full_state_dict() -> None:
    """Two stages (input projection and block 0; block 1, norm and head) keep the whole model's names."""
    class Stage(nn.Module):
        def __init__(self, model: Net, first: bool) -> None:
            super().__init__()
            self.inp = model.inp if first else None
            self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in ([0] if first else [1])})
            self.norm, self.head = (None, None) if first else (model.norm, model.head)

    ref = reference(1)

    def body(rank: int, world_size: int) -> None:
        stage = Stage(build(seed=1), first=rank == 0)
        optimizer = adamw(stage)
        mine = [key for key in ref["model"] if key.startswith(("inp.", "blocks.0.") if rank == 0 else
                                                               ("blocks.1.", "norm.", "head."))]
        result = set_model_state_dict(stage, ref["model"], options=StateDictOptions(strict=False))
        assert result.missing_keys == [] and sorted(result.unexpected_keys) == sorted(set(ref["model"]) - set(mine))
        set_optimizer_state_dict(stage, optimizer, ref["optim"], options=StateDictOptions(strict=False))
        model_sd, optim_sd = get_state_dict(stage, optimizer)
        assert list(model_sd) == mine
        assert_equal_trees(model_sd, {key: ref["model"][key] for key in mine})
        params = [key for key in mine if key in ref["optim"]["state"]]
        assert_equal_trees(optim_sd["state"], {key: ref["optim"]["state"][key] for key in params})

    run_ranks(body, world_size=2, timeout=TIMEOUT)


# -- round trips on one layout ------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["plain", "ddp", "fsdp", "tp", "fsdp_tp"])
def test_a_round_trip_into_a_fresh_model_and_optimizer_is_bit_identical(layout: str) -> None:
    trained, fresh = build(), build(seed=1)

    def body(rank: int, world_size: int) -> None:
        model, dp_rank, dp = parallelize(layout, copy.deepcopy(trained))
        optimizer = adamw(model)
        train(model, optimizer, range(2), dp_rank, dp)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        other, _, _ = parallelize(layout, copy.deepcopy(fresh))
        other_optimizer = adamw(other)
        set_state_dict(other, other_optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
        assert_equal_trees(get_state_dict(other, other_optimizer), (model_sd, optim_sd))
        loaded = get_optimizer_state_dict(other, other_optimizer)["state"]["inp.weight"]
        for name in ("exp_avg", "step"):      # copied into the optimizer's own tensors, not shared
            assert local(loaded[name]).data_ptr() != local(optim_sd["state"]["inp.weight"][name]).data_ptr()
        train(model, optimizer, range(2, 3), dp_rank, dp)
        train(other, other_optimizer, range(2, 3), dp_rank, dp)
        assert_equal_trees(get_state_dict(other, other_optimizer), get_state_dict(model, optimizer))

    run_ranks(body, world_size=WORLD[layout], timeout=TIMEOUT)


@pytest.mark.parametrize("flatten", [False, True])
def test_a_plain_models_state_dicts_are_torchs(flatten: bool) -> None:
    """torch's DCP state_dict module is the oracle on one process (it needs no process group there)."""
    from torch.distributed.checkpoint import state_dict as torch_state_dict

    model = build()
    optimizer = adamw(model)
    train_one_process(model, optimizer, range(2), 1)
    ours = get_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=flatten))
    theirs = torch_state_dict.get_state_dict(
        model, optimizer, options=torch_state_dict.StateDictOptions(flatten_optimizer_state_dict=flatten))
    assert_equal_trees(ours, theirs)
    other = build(seed=1)
    other_optimizer = adamw(other)
    torch_state_dict.set_state_dict(other, other_optimizer, model_state_dict=ours[0], optim_state_dict=ours[1])
    assert_equal_trees(get_state_dict(other, other_optimizer), get_state_dict(model, optimizer))


def test_flattened_optimizer_state_round_trips() -> None:
    model = build()
    optimizer = adamw(model)
    train_one_process(model, optimizer, range(2), 1)
    flat = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
    assert "state.blocks.0.up.weight.exp_avg" in flat and flat["param_groups.head.bias.lr"] == 1e-2
    other = build(seed=1)
    other_optimizer = adamw(other)
    set_optimizer_state_dict(other, other_optimizer, flat)
    assert_equal_trees(get_optimizer_state_dict(other, other_optimizer), get_optimizer_state_dict(model, optimizer))


OPTIMIZERS = {
    "adamw": adamw,
    "adam-l2": lambda model: torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.1),
    "sgd-momentum": lambda model: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1),
}


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_a_fresh_optimizer_gets_the_state_its_first_step_builds_and_then_trains_identically(kind: str) -> None:
    model, untouched = build(), build()
    optimizer, untouched_optimizer = OPTIMIZERS[kind](model), OPTIMIZERS[kind](untouched)
    state = get_optimizer_state_dict(model, optimizer)["state"]
    assert set(state) == {name for name, _ in model.named_parameters()}
    for entry in state.values():
        assert entry.get("step", torch.zeros(())).item() == 0
        assert not any(value.any() for name, value in entry.items() if name != "step")
    assert_equal_trees(model.state_dict(), untouched.state_dict())
    assert all(p.grad is None for p in model.parameters())
    train_one_process(model, optimizer, range(2), 1)
    train_one_process(untouched, untouched_optimizer, range(2), 1)
    assert_equal_trees(get_state_dict(model, optimizer), get_state_dict(untouched, untouched_optimizer))


# -- full state dicts: parity with one process --------------------------------------------------------------

def test_full_state_dict_of_fsdp_equals_the_one_process_state_dict() -> None:
    ref = reference(4)
    initial = build()

    def body(rank: int, world_size: int) -> tuple[Any, Any]:
        model, dp_rank, dp = parallelize("fsdp", copy.deepcopy(initial))
        optimizer = adamw(model)
        train(model, optimizer, range(2), dp_rank, dp)
        full = get_state_dict(model, optimizer, options=FULL)
        offloaded = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return full, offloaded

    results = run_ranks(body, world_size=4, timeout=TIMEOUT)
    for rank, (full, offloaded) in enumerate(results):
        assert_equal_trees(full, (ref["model"], ref["optim"]), exact=False)
        if rank == 0:
            assert_equal_trees(offloaded, full)
        else:
            assert offloaded == ({}, {})


@pytest.mark.parametrize("layout", ["ddp", "fsdp", "hsdp", "tp", "fsdp_tp"])
def test_a_full_state_dict_set_into_a_parallel_model_then_trains_like_one_process(layout: str) -> None:
    fresh = build(seed=1)

    def body(rank: int, world_size: int) -> dict[str, Tensor]:
        model, dp_rank, dp = parallelize(layout, copy.deepcopy(fresh))
        optimizer = adamw(model)
        ref = reference(dp)
        set_state_dict(model, optimizer, model_state_dict=ref["model"], optim_state_dict=ref["optim"])
        assert_equal_trees(get_state_dict(model, optimizer, options=FULL), (ref["model"], ref["optim"]))
        train(model, optimizer, range(2, 3), dp_rank, dp)
        return get_model_state_dict(model, options=FULL)

    for dp in {1, 2, 4}:
        reference(dp)        # in the main thread, once
    for got in run_ranks(body, world_size=WORLD[layout], timeout=TIMEOUT):
        assert_equal_trees(got, reference(DP[layout])["final"], exact=False)


@pytest.mark.parametrize("layout", ["fsdp", "fsdp_tp"])
def test_broadcast_from_rank0_loads_rank_0s_full_state_dict_everywhere(layout: str) -> None:
    fresh = build(seed=1)
    ref = reference(DP[layout])
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)

    def body(rank: int, world_size: int) -> None:
        model, _, _ = parallelize(layout, copy.deepcopy(fresh))
        optimizer = adamw(model)
        set_state_dict(model, optimizer, model_state_dict=ref["model"] if rank == 0 else {},
                       optim_state_dict=ref["optim"] if rank == 0 else {}, options=options)
        assert_equal_trees(get_state_dict(model, optimizer, options=FULL), (ref["model"], ref["optim"]))

    run_ranks(body, world_size=WORLD[layout], timeout=TIMEOUT)


def test_dtensors_of_another_layout_are_redistributed_and_become_full_tensors_in_a_plain_model() -> None:
    trained, fresh = build(), build(seed=1)

    def body(rank: int, world_size: int) -> None:
        model, dp_rank, dp = parallelize("fsdp", copy.deepcopy(trained))
        optimizer = adamw(model)
        train(model, optimizer, range(2), dp_rank, dp)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        full = get_state_dict(model, optimizer, options=FULL)
        replicated = [{k: v.redistribute(placements=[Replicate()]) if isinstance(v, DTensor) else v
                       for k, v in tree.items()} for tree in (model_sd, optim_sd["state"]["head.weight"])]
        other, _, _ = parallelize("fsdp", copy.deepcopy(fresh))
        set_model_state_dict(other, replicated[0])
        assert_equal_trees(get_model_state_dict(other), model_sd)
        other_optimizer = adamw(other)
        set_optimizer_state_dict(other, other_optimizer, {**optim_sd, "state": {**optim_sd["state"],
                                                                               "head.weight": replicated[1]}})
        assert_equal_trees(get_optimizer_state_dict(other, other_optimizer), optim_sd)
        plain = build(seed=1)
        plain_optimizer = adamw(plain)
        set_state_dict(plain, plain_optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
        assert_equal_trees(get_state_dict(plain, plain_optimizer), full)

    run_ranks(body, world_size=4, timeout=TIMEOUT)


def test_a_model_sharded_on_the_meta_device_takes_rank_0s_values() -> None:
    """Rank 0 alone holds the values; the model is built on meta and sharded, and the loaded shards are
    assigned (then the optimizer is made)."""
    ref = reference(4)

    def body(rank: int, world_size: int) -> None:
        with torch.device("meta"):
            model = Net()
        model, _, _ = parallelize("fsdp", model)
        set_model_state_dict(model, ref["model"] if rank == 0 else {},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        assert not any(param.is_meta for param in model.parameters())
        assert_equal_trees(get_model_state_dict(model, options=FULL), ref["model"])
        optimizer = adamw(model)
        set_optimizer_state_dict(model, optimizer, ref["optim"], options=FULL)
        assert_equal_trees(get_optimizer_state_dict(model, optimizer, options=FULL), ref["optim"])

    run_ranks(body, world_size=4, timeout=TIMEOUT)


# -- errors -------------------------------------------------------------------------------------------------

def test_strict_names_missing_and_unexpected_keys_and_non_strict_returns_them() -> None:
    model = build()
    sd = get_model_state_dict(model)
    partial = {key: value for key, value in sd.items() if key != "head.bias"} | {"head.extra": torch.zeros(1)}
    with pytest.raises(RuntimeError, match=r"missing keys \['head.bias'\] and unexpected keys \['head.extra'\]"):
        set_model_state_dict(build(seed=1), partial)
    result = set_model_state_dict(build(seed=1), partial, options=StateDictOptions(strict=False))
    assert (result.missing_keys, result.unexpected_keys) == (["head.bias"], ["head.extra"])


def test_shape_and_dtype_mismatches_name_the_key() -> None:
    sd = get_model_state_dict(build())
    with pytest.raises(RuntimeError, match=r"head.weight has shape \(3, 7\) in the state dict but \(3, 8\)"):
        set_model_state_dict(build(), {**sd, "head.weight": torch.zeros(3, 7)})
    with pytest.raises(RuntimeError, match=r"norm.bias has dtype torch.float64 in the state dict but torch.float32"):
        set_model_state_dict(build(), {**sd, "norm.bias": sd["norm.bias"].double()})
    model = build()
    set_model_state_dict(model, {**sd, "norm.bias": sd["norm.bias"].double() + 1},
                         options=StateDictOptions(strict=False))
    assert torch.equal(model.norm.bias, sd["norm.bias"] + 1)


def test_optimizer_strict_names_parameters_without_state_and_unknown_ones() -> None:
    model = build()
    optimizer = adamw(model)
    optim_sd = get_optimizer_state_dict(model, optimizer)
    state = dict(optim_sd["state"])
    del state["head.bias"]
    state["inp.weight"] = {k: v for k, v in state["inp.weight"].items() if k != "exp_avg_sq"}
    state["gone.weight"] = state["inp.bias"]
    broken = {**optim_sd, "state": state}
    with pytest.raises(RuntimeError, match=r"missing keys \['inp.weight \(exp_avg_sq\)', 'head.bias'\] and "
                                           r"unexpected keys \['state.gone.weight'\]"):
        set_optimizer_state_dict(model, optimizer, broken)


def test_broadcast_from_rank0_needs_full_state_dict() -> None:
    with pytest.raises(ValueError, match="broadcast_from_rank0=True needs full_state_dict=True"):
        set_model_state_dict(build(), {}, options=StateDictOptions(broadcast_from_rank0=True))


# -- options ------------------------------------------------------------------------------------------------

def test_submodules_select_entries_with_or_without_their_prefixes() -> None:
    model = build()
    sd = model.state_dict()
    block = get_model_state_dict(model, submodules={model.blocks[1]})
    assert list(block) == [key for key in sd if key.startswith("blocks.1.")]
    bare = get_model_state_dict(model, submodules={model.blocks[1]},
                                options=StateDictOptions(keep_submodule_prefixes=False))
    assert_equal_trees(bare, model.blocks[1].state_dict())


def test_ignore_frozen_params_leaves_them_out_of_get_and_does_not_miss_them_on_set() -> None:
    model = build()
    model.inp.requires_grad_(False)
    options = StateDictOptions(ignore_frozen_params=True)
    sd = get_model_state_dict(model, options=options)
    assert list(sd) == [key for key in model.state_dict() if not key.startswith("inp.")]
    other = build(seed=1)
    other.inp.requires_grad_(False)
    assert set_model_state_dict(other, sd, options=options).missing_keys == []
    with pytest.raises(RuntimeError, match=r"missing keys \['inp.weight', 'inp.bias'\]"):
        set_model_state_dict(other, sd)


def test_an_optimizers_own_state_dict_loads_as_torch_takes_it() -> None:
    """torchtune resumes with set_state_dict(model, optimizer, optim_state_dict=optimizer.state_dict()): state keyed
    by parameter position, as torch's set_optimizer_state_dict accepts it."""
    def body(rank: int, world_size: int) -> None:
        mesh = init_device_mesh("cpu", (world_size,))

        def sharded() -> tuple[nn.Module, torch.optim.Optimizer]:
            model = build()
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            return model, adamw(model)

        model, optimizer = sharded()
        for step in range(2):
            x, y = batch(step)
            F.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        saved = copy.deepcopy(optimizer.state_dict())
        assert all(isinstance(position, int) for position in saved["state"])
        fresh_model, fresh = sharded()
        set_state_dict(fresh_model, fresh, model_state_dict=model.state_dict(), optim_state_dict=saved)
        for want, got in zip(optimizer.state_dict()["state"].values(), fresh.state_dict()["state"].values(),
                             strict=True):
            assert torch.equal(got["exp_avg"].to_local(), want["exp_avg"].to_local())
            assert float(got["step"]) == float(want["step"]) == 2.0
        with pytest.raises(ValueError, match=r"names parameter positions \[99\]"):
            set_optimizer_state_dict(fresh_model, fresh, {"state": {99: {}}, "param_groups": []})

    run_ranks(body, 2, timeout=60)


class Router(nn.Module):
    """A module whose state dict calls its child's weight by its own name (`gate.weight` saved as `weight`, as a
    MoE router keeps a checkpoint's names), saying so with `_fqn_modifiers` (torch's convention)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 4, bias=False)
        self.scale = nn.Parameter(torch.ones(4))
        self.register_state_dict_post_hook(lambda module, state, prefix, local: state.__setitem__(
            prefix + "weight", state.pop(prefix + "gate.weight")))
        self.register_load_state_dict_pre_hook(lambda module, state, prefix, *rest: state.__setitem__(
            prefix + "gate.weight", state.pop(prefix + "weight")))

    def _fqn_modifiers(self) -> dict[str, str]:
        return {"weight": "gate"}

    def forward(self, x: Tensor) -> Tensor:
        return self.gate(x) * self.scale


def routed() -> nn.Module:
    with seeded(0):
        return nn.Sequential(nn.Linear(8, 8), Router())


def test_a_module_hiding_a_childs_name_is_keyed_as_torch_keys_it_and_round_trips() -> None:
    """torch's keys: the model's as its state_dict() names them (`1.weight`), the optimizer's as named_parameters()
    does (`1.gate.weight`); torch needs `_fqn_modifiers` to walk the renamed key, spmd does not."""
    from torch.distributed.checkpoint import state_dict as torch_state_dict

    model = routed()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    ours = get_state_dict(model, optimizer)
    assert list(ours[0]) == ["0.weight", "0.bias", "1.scale", "1.weight"]
    assert list(ours[1]["state"]) == ["0.weight", "0.bias", "1.scale", "1.gate.weight"]
    assert_equal_trees(ours, torch_state_dict.get_state_dict(model, optimizer))
    for options in (None, StateDictOptions(dsd_fqn_modifiers="_no_such_method")):
        other = nn.Sequential(nn.Linear(8, 8), Router())
        other_optimizer = torch.optim.AdamW(other.parameters(), lr=1e-2)
        set_state_dict(other, other_optimizer, model_state_dict=ours[0], optim_state_dict=ours[1], options=options)
        assert_equal_trees(get_state_dict(other, other_optimizer, options=options), ours)


def test_a_sharded_module_hiding_a_childs_name_round_trips_under_fsdp() -> None:
    def body(rank: int, world_size: int) -> dict[str, Any]:
        mesh = init_device_mesh("cpu", (world_size,))
        model = routed()
        fully_shard(model[1], mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(torch.randn(3, 8)).sum().backward()
        optimizer.step()
        full = StateDictOptions(full_state_dict=True)
        model_state, optim_state = get_state_dict(model, optimizer)
        other = routed()
        fully_shard(other[1], mesh=mesh)
        fully_shard(other, mesh=mesh)
        other_optimizer = torch.optim.AdamW(other.parameters(), lr=1e-2)
        set_state_dict(other, other_optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
        theirs = get_state_dict(other, other_optimizer, options=full)
        ours = get_state_dict(model, optimizer, options=full)
        return {"keys": sorted(ours[0]),
                "same": all(theirs[0][key].equal(ours[0][key]) for key in ours[0])
                and theirs[1]["state"]["1.gate.weight"]["exp_avg"].equal(ours[1]["state"]["1.gate.weight"]["exp_avg"])}

    for out in run_ranks(body, world_size=2, timeout=60):
        assert out == {"keys": ["0.bias", "0.weight", "1.scale", "1.weight"], "same": True}
