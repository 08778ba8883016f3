"""FullyShardedDataParallel, FSDP1's wrapper API on fully_shard: every sharding strategy trains as one process
on the global batch; auto-wrap units, state dicts of each type (names of the plain model), optimizer state dicts,
no_sync, clip_grad_norm_, summon_full_params, mixed precision, meta-device init, sync_module_states and ignored
modules behave as torch's; bad arguments fail naming the fix. (The tutorial run against torch's own FSDP1 is in
tests/test_porting.py.)"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from spmd.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    FullStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    OptimStateKeyType,
    ShardingStrategy,
    StateDictType,
)
from spmd.fsdp import FullyShardedDataParallel as FSDP
from spmd.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy, transformer_auto_wrap_policy
from spmd.tensor import DTensor
from spmd.testing import run_ranks, seeded

STEPS = 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.tanh(self.norm(self.fc(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 6)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(6, 3)
        self.scale = 1.5          # a plain attribute, read through the wrapper

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(self.inp(x))) * self.scale


def _net() -> Net:
    with seeded(0):
        return Net()


INITIAL = _net()


def _batch(step: int, rank: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 5, generator=gen), torch.randn(4, 3, generator=gen)


def _reference(world: int, steps: int = STEPS, clip: float | None = None) -> dict[str, Tensor]:
    model = copy.deepcopy(INITIAL)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for step in range(steps):
        xs, ys = zip(*[_batch(step, rank) for rank in range(world)], strict=True)
        nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def _train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, steps: int = STEPS, first: int = 0) -> None:
    for step in range(first, first + steps):
        x, y = _batch(step, rank)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _wrap(**kwargs) -> FSDP:
    kwargs.setdefault("auto_wrap_policy", ModuleWrapPolicy({Block}))
    return FSDP(copy.deepcopy(INITIAL), **kwargs)


@pytest.mark.parametrize("strategy", list(ShardingStrategy))
def test_every_strategy_trains_as_one_process(strategy: ShardingStrategy, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")        # the hybrid strategies: 2 nodes of 2 ranks

    def body(rank: int, size: int) -> dict[str, Tensor]:
        model = _wrap(sharding_strategy=strategy)
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        _train(model, opt, rank)
        return model.state_dict()

    want = _reference(4)
    for got in run_ranks(body, 4, timeout=90):
        assert list(got) == list(want)
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_the_hybrid_strategy_shards_within_a_node_and_replicates_across(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")

    def body(rank: int, size: int) -> list:
        model = _wrap(sharding_strategy=ShardingStrategy.HYBRID_SHARD, auto_wrap_policy=None)
        weight = model.module.head.weight
        return [weight.device_mesh.mesh.tolist(), [type(p).__name__ for p in weight.placements]]

    for mesh, placements in run_ranks(body, 4, timeout=60):
        assert mesh == [[0, 1], [2, 3]] and placements == ["Replicate", "Shard"]


def test_policies_pick_the_units_and_names_stay_the_plain_models() -> None:
    def body(rank: int, size: int) -> dict:
        by_class = _wrap(auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                            transformer_layer_cls={Block}))
        by_size = _wrap(auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=40))
        return {"class": [name for name, m in by_class.named_modules() if isinstance(m, FSDP)],
                "size": sum(isinstance(m, FSDP) for m in by_size.modules()),
                "units": len(FSDP.fsdp_modules(by_class)), "roots": FSDP.fsdp_modules(by_class, root_only=True),
                "is_root": FSDP.fsdp_modules(by_class, root_only=True)[0] is by_class,
                "check_is_root": [m.check_is_root() for m in FSDP.fsdp_modules(by_class)],   # the root's first
                "params": [name for name, _ in by_class.named_parameters()],
                "buffers": dict(by_class.named_buffers()), "scale": by_class.scale,
                "item": type(by_class.blocks[0]).__name__, "repr": repr(by_class).splitlines()[0]}

    for got in run_ranks(body, 2, timeout=60):
        assert got["class"] == ["", "_fsdp_wrapped_module.blocks.0", "_fsdp_wrapped_module.blocks.1"]
        assert got["size"] == 3          # each block's fc (42 >= 40 parameters) and the root; each block's rest is 12
        assert got["units"] == 3 and len(got["roots"]) == 1 and got["is_root"]
        assert got["check_is_root"] == [True, False, False]
        assert got["params"] == [name for name, _ in INITIAL.named_parameters()]
        assert got["scale"] == 1.5 and got["item"] == "FullyShardedDataParallel"
        assert got["repr"] == "FullyShardedDataParallel("


def test_each_state_dict_type_and_its_round_trip() -> None:
    def body(rank: int, size: int) -> dict:
        model = _wrap()
        _train(model, torch.optim.SGD(model.parameters(), lr=0.1), rank)
        full = model.state_dict()
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            sharded = model.state_dict()
        with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT, LocalStateDictConfig()):
            local = model.state_dict()
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
            rank0 = model.state_dict()
        assert FSDP.get_state_dict_type(model).state_dict_type is StateDictType.FULL_STATE_DICT   # restored
        restored = {}
        for kind, state in ((StateDictType.FULL_STATE_DICT, full), (StateDictType.SHARDED_STATE_DICT, sharded),
                            (StateDictType.LOCAL_STATE_DICT, local)):
            fresh = FSDP(_net(), auto_wrap_policy=ModuleWrapPolicy({Block}))
            with FSDP.state_dict_type(fresh, kind):
                result = fresh.load_state_dict(state)
            assert not result.missing_keys and not result.unexpected_keys
            restored[kind.name] = fresh.state_dict()
        return {"full": full, "sharded": sharded, "local": local, "rank0": rank0, "restored": restored}

    results = run_ranks(body, 2, timeout=90)
    want = results[0]["full"]
    for rank, got in enumerate(results):
        assert all(not isinstance(v, DTensor) for v in got["full"].values())
        assert all(isinstance(v, DTensor) for v in got["sharded"].values())
        assert got["sharded"]["head.weight"].to_local().equal(want["head.weight"].chunk(2)[rank])
        assert got["local"]["head.weight"].equal(want["head.weight"].chunk(2)[rank])
        assert (list(got["rank0"]) == list(want)) if rank == 0 else got["rank0"] == {}
        for state in got["restored"].values():
            for key, value in want.items():
                assert state[key].equal(value), key


def test_optimizer_state_dicts_resume_training_exactly() -> None:
    def body(rank: int, size: int) -> dict:
        model = _wrap()
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        _train(model, opt, rank, steps=2)
        full = FSDP.optim_state_dict(model, opt)
        sharded = FSDP.sharded_optim_state_dict(model, opt)
        rank0 = FSDP.full_optim_state_dict(model, opt)
        by_id = FSDP.rekey_optim_state_dict(full, OptimStateKeyType.PARAM_ID, model, optim=opt)
        by_name = FSDP.rekey_optim_state_dict(by_id, OptimStateKeyType.PARAM_NAME, model, optim=opt)
        resumed = {}
        # a sharded state dict holds the optimizer's live tensors (as torch's): a copy, as a save and load makes
        sharded_copy = tree_map(lambda t: t.clone() if isinstance(t, Tensor) else t, sharded)
        for form, state in (("full", full), ("sharded", sharded_copy)):
            fresh = _wrap()
            fresh.load_state_dict(model.state_dict())
            fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.05)
            FSDP.optim_state_dict_to_load(fresh, fresh_opt, state, load_directly=True)
            _train(fresh, fresh_opt, rank, steps=1, first=2)
            resumed[form] = fresh.state_dict()
        _train(model, opt, rank, steps=1, first=2)
        return {"full": full, "rank0": rank0, "keys": (list(by_id["state"]), list(by_name["state"])),
                "sharded_type": type(sharded["state"]["head.weight"]["exp_avg"]).__name__,
                "resumed": resumed, "uninterrupted": model.state_dict()}

    for rank, got in enumerate(run_ranks(body, 2, timeout=90)):
        names = [name for name, _ in INITIAL.named_parameters()]
        assert list(got["full"]["state"]) == names and got["full"]["param_groups"][0]["params"] == names
        assert got["full"]["state"]["head.weight"]["exp_avg"].shape == (3, 6)
        assert got["sharded_type"] == "DTensor" and got["keys"] == (list(range(len(names))), names)
        assert (got["rank0"] != {}) == (rank == 0)
        for form in ("full", "sharded"):
            for key, value in got["uninterrupted"].items():
                assert got["resumed"][form][key].equal(value), (form, key)


def test_the_dcp_tutorials_sharded_optimizer_load_resumes_training_exactly(tmp_path) -> None:
    """torch's FSDP1 checkpoint recipe, line for line (its older save_state_dict / load_state_dict names): save the
    SHARDED model and optimizer state dicts; load the model's, then load_sharded_optimizer_state_dict and
    optim_state_dict_to_load."""
    import spmd.checkpoint as dist_cp
    from spmd.fsdp import StateDictType

    def body(rank: int, size: int) -> dict:
        model = _wrap()
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        _train(model, opt, rank, steps=2)
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            dist_cp.save_state_dict(state_dict={"model": model.state_dict(),
                                                "optimizer": FSDP.optim_state_dict(model, opt)},
                                    storage_writer=dist_cp.FileSystemWriter(tmp_path))
        fresh = _wrap()
        fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.05)
        with FSDP.state_dict_type(fresh, StateDictType.SHARDED_STATE_DICT):
            model_state_dict = fresh.state_dict()
            checkpoint = {"model": model_state_dict}
            dist_cp.load_state_dict(state_dict=checkpoint, storage_reader=dist_cp.FileSystemReader(tmp_path))
            fresh.load_state_dict(checkpoint["model"])
            optim_state = dist_cp.load_sharded_optimizer_state_dict(
                model_state_dict, optimizer_key="optimizer", storage_reader=dist_cp.FileSystemReader(tmp_path))
            fresh_opt.load_state_dict(FSDP.optim_state_dict_to_load(fresh, fresh_opt, optim_state["optimizer"]))
        exp_avg = optim_state["optimizer"]["state"]["head.weight"]["exp_avg"]
        _train(fresh, fresh_opt, rank, steps=1, first=2)
        _train(model, opt, rank, steps=1, first=2)
        return {"resumed": fresh.state_dict(), "uninterrupted": model.state_dict(),
                "exp_avg": (type(exp_avg).__name__, tuple(exp_avg.to_local().shape))}

    for rank, got in enumerate(run_ranks(body, 2, timeout=90)):
        assert got["exp_avg"] == ("DTensor", ((2, 6), (1, 6))[rank])    # each rank read only its shard
        for key, value in got["uninterrupted"].items():
            assert got["resumed"][key].equal(value), key


def test_the_older_checkpoint_names_warn_as_torch_s_do(tmp_path) -> None:
    """One thread: warnings.catch_warnings (which pytest.warns uses) is process-wide, so thread ranks can't each
    check their own."""
    import spmd.checkpoint as dist_cp

    state = {"x": torch.arange(3.0)}
    with pytest.warns(FutureWarning, match="save_state_dict is deprecated; use save"):
        dist_cp.save_state_dict(state, storage_writer=dist_cp.FileSystemWriter(tmp_path), no_dist=True)
    loaded = {"x": torch.zeros(3)}
    with pytest.warns(FutureWarning, match="load_state_dict is deprecated; use load"):
        dist_cp.load_state_dict(loaded, storage_reader=dist_cp.FileSystemReader(tmp_path), no_dist=True)
    assert torch.equal(loaded["x"], state["x"])


def test_no_sync_accumulates_and_the_next_backward_reduces_the_sum() -> None:
    def body(rank: int, size: int) -> dict[str, Tensor]:
        model = _wrap()
        with model.no_sync():
            for step in range(2):
                x, y = _batch(step, rank)
                nn.functional.mse_loss(model(x), y).backward()
        x, y = _batch(2, rank)
        nn.functional.mse_loss(model(x), y).backward()
        with FSDP.summon_full_params(model, with_grads=True):
            return {name: p.grad.clone() for name, p in model.named_parameters()}

    model = copy.deepcopy(INITIAL)
    for step in range(3):
        for rank in range(2):
            x, y = _batch(step, rank)
            (nn.functional.mse_loss(model(x), y) / 2).backward()
    for got in run_ranks(body, 2, timeout=60):
        for name, param in model.named_parameters():
            torch.testing.assert_close(got[name], param.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_grad_norm_clips_by_the_norm_over_all_ranks(norm_type: float) -> None:
    def body(rank: int, size: int) -> tuple[Tensor, dict[str, Tensor]]:
        model = _wrap()
        x, y = _batch(0, rank)
        nn.functional.mse_loss(model(x), y).backward()
        norm = model.clip_grad_norm_(0.05, norm_type)
        with FSDP.summon_full_params(model, with_grads=True):
            return norm, {name: p.grad.clone() for name, p in model.named_parameters()}

    model = copy.deepcopy(INITIAL)
    xs, ys = zip(*[_batch(0, rank) for rank in range(2)], strict=True)
    nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
    want = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, norm_type)
    for norm, grads in run_ranks(body, 2, timeout=60):
        torch.testing.assert_close(norm, want)
        for name, param in model.named_parameters():
            torch.testing.assert_close(grads[name], param.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_summon_full_params_writes_back_only_when_asked() -> None:
    def body(rank: int, size: int) -> dict:
        model = _wrap()
        with FSDP.summon_full_params(model), torch.no_grad():
            seen = model.module.head.weight.shape
            model.module.head.weight.fill_(2.0)
        with FSDP.summon_full_params(model, writeback=False), torch.no_grad():
            model.module.head.bias.fill_(7.0)
        with FSDP.summon_full_params(model, rank0_only=True, writeback=False):
            rank0 = type(model.module.head.weight).__name__
        model.apply(lambda m: nn.init.zeros_(m.bias) if isinstance(m, nn.LayerNorm) else None)
        with pytest.raises(ValueError, match="rank0_only=True needs writeback=False"):
            with FSDP.summon_full_params(model, rank0_only=True):
                pass
        return {"seen": seen, "rank0": rank0, "state": model.state_dict(),
                "sharded_after": isinstance(model.module.head.weight, DTensor)}

    for rank, got in enumerate(run_ranks(body, 2, timeout=60)):
        assert got["seen"] == (3, 6) and got["sharded_after"]
        assert got["rank0"] == ("Parameter" if rank == 0 else "DTensor")
        assert got["state"]["head.weight"].eq(2.0).all()
        assert got["state"]["head.bias"].equal(INITIAL.head.bias)
        assert got["state"]["blocks.0.norm.bias"].eq(0).all()


def test_over_tensor_parallelism_trains_as_one_process_with_whole_state_dicts() -> None:
    # torch's 2-D recipe (pytorch/examples fsdp_tp_example.py): parallelize_module on mesh["tp"], then the wrapper on
    # mesh["dp"]; the parameters become DTensors on the (dp, tp) mesh. sync_module_states broadcasts each tensor-
    # parallel shard over its dp group (the non-first dp ranks start from other weights here).
    def body(rank: int, size: int) -> dict:
        from spmd.device_mesh import init_device_mesh
        from spmd.tensor import Replicate
        from spmd.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        plan = {"inp": ColwiseParallel(output_layouts=Replicate()),
                "blocks.0.fc": ColwiseParallel(output_layouts=Replicate()),
                "head": RowwiseParallel(input_layouts=Replicate())}
        model = copy.deepcopy(INITIAL)
        if mesh["dp"].get_local_rank() != 0:
            with torch.no_grad():
                model.inp.weight.add_(1.0)
        parallelize_module(model, mesh["tp"], plan)
        model = FSDP(model, device_mesh=mesh["dp"], auto_wrap_policy=ModuleWrapPolicy({Block}),
                     sync_module_states=True)
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        _train(model, opt, mesh["dp"].get_local_rank())
        with FSDP.summon_full_params(model, writeback=False):
            summoned = model.module.inp.weight.detach().clone()
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            sharded = model.state_dict()
        full = model.state_dict()
        fresh = FSDP(parallelize_module(_net(), mesh["tp"], plan), device_mesh=mesh["dp"],
                     auto_wrap_policy=ModuleWrapPolicy({Block}))
        fresh.load_state_dict(full)
        return {"full": full, "summoned": summoned, "restored": fresh.state_dict(),
                "meshes": {key: value.device_mesh.mesh.tolist() for key, value in sharded.items()
                           if key in ("inp.weight", "head.weight")}}

    want = _reference(2)
    for got in run_ranks(body, 4, timeout=120):
        assert got["meshes"] == {"inp.weight": [[0, 1], [2, 3]], "head.weight": [[0, 1], [2, 3]]}
        torch.testing.assert_close(got["summoned"], want["inp.weight"], rtol=1e-5, atol=1e-6)
        for state in (got["full"], got["restored"]):
            assert list(state) == list(want)
            for key, value in want.items():
                torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)


class _Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 4)
        self.bn = nn.BatchNorm1d(4)
        self.out = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.bn(self.fc(x)))


def test_mixed_precision_computes_in_param_dtype_but_batchnorm_and_state_stay_full() -> None:
    def body(rank: int, size: int) -> dict:
        with seeded(0):
            normed = _Normed()
        model = FSDP(normed, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                     mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                    buffer_dtype=torch.bfloat16))
        seen = {}

        def record(name: str, module: nn.Module, args: tuple, out: Tensor) -> None:
            seen.setdefault(name, (args[0].dtype, out.dtype))

        for name in ("fc", "bn", "out"):
            getattr(model.module, name).register_forward_hook(functools.partial(record, name))
        x, y = _batch(0, rank)
        nn.functional.mse_loss(model(x), y).backward()
        state = model.state_dict()
        return {"seen": seen, "state_dtypes": {k: v.dtype for k, v in state.items()},
                "grad_dtype": model.module.fc.weight.grad.dtype, "buffer": model.module.fc.weight.dtype}

    for got in run_ranks(body, 2, timeout=60):
        assert got["seen"]["fc"] == (torch.bfloat16, torch.bfloat16)
        assert got["seen"]["bn"] == (torch.bfloat16, torch.bfloat16)     # ran in fp32, cast back at its edges
        assert got["seen"]["out"][1] == torch.bfloat16
        assert got["grad_dtype"] == torch.float32 and got["buffer"] == torch.float32
        assert got["state_dtypes"]["bn.running_mean"] == torch.float32
        assert all(dtype in (torch.float32, torch.int64) for dtype in got["state_dtypes"].values())


def _halves(module: nn.Module) -> None:
    """A param_init_fn: real tensors for the module's own meta parameters, all 0.5."""
    module.to_empty(device="cpu", recurse=False)
    for param in module.parameters(recurse=False):
        nn.init.constant_(param, 0.5)


def test_meta_init_sync_module_states_offload_and_ignored_modules() -> None:
    def body(rank: int, size: int) -> dict:
        with torch.device("meta"):
            meta = Net()
        by_fn = FSDP(meta, param_init_fn=_halves, auto_wrap_policy=ModuleWrapPolicy({Block}))
        with seeded(rank):                   # different on each rank: sync_module_states fixes it
            diverged = Net()
        synced = FSDP(diverged, sync_module_states=True, cpu_offload=CPUOffload(offload_params=True),
                      backward_prefetch=None, forward_prefetch=True)
        partial_model = copy.deepcopy(INITIAL)
        kept = FSDP(partial_model, ignored_modules=[partial_model.head])
        x, y = _batch(0, rank)
        nn.functional.mse_loss(kept(x), y).backward()
        return {"by_fn": by_fn.state_dict(), "synced": synced.state_dict(),
                "head_type": type(kept.module.head.weight).__name__,
                "head_grad": kept.module.head.weight.grad.clone(),
                "inp_type": type(kept.module.inp.weight).__name__}

    results = run_ranks(body, 2, timeout=60)
    with seeded(0):
        rank0_net = Net().state_dict()
    for got in results:
        assert all(v.eq(0.5).all() for v in got["by_fn"].values())
        for key, value in rank0_net.items():
            assert got["synced"][key].equal(value), key
        assert got["head_type"] == "Parameter" and got["inp_type"] == "DTensor"
    # the ignored head's gradient is not reduced: each rank keeps its own
    assert not torch.allclose(results[0]["head_grad"], results[1]["head_grad"])


def test_get_state_dict_sees_through_the_wrapper() -> None:
    from spmd.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    def body(rank: int, size: int) -> dict:
        model = _wrap()
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        _train(model, opt, rank, steps=1)
        model_state, optim_state = get_state_dict(model, opt)
        full, _ = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
        fresh = _wrap()
        fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.05)
        set_state_dict(fresh, fresh_opt, model_state_dict=model_state, optim_state_dict=optim_state)
        _train(model, opt, rank, steps=1, first=1)
        _train(fresh, fresh_opt, rank, steps=1, first=1)
        return {"keys": list(model_state), "types": {type(v).__name__ for v in model_state.values()},
                "optim_keys": list(optim_state["state"]), "full": full, "trained": model.state_dict(),
                "resumed": fresh.state_dict(), "default": FSDP.get_state_dict_type(model).state_dict_type}

    names = list(INITIAL.state_dict())
    for got in run_ranks(body, 2, timeout=60):
        assert got["keys"] == names and got["types"] == {"DTensor"}
        assert got["optim_keys"] == [name for name, _ in INITIAL.named_parameters()]
        assert list(got["full"]) == names and got["default"] is StateDictType.FULL_STATE_DICT
        for key, value in got["trained"].items():
            assert got["resumed"][key].equal(value), key


def test_bad_arguments_fail_before_sharding() -> None:
    def body(rank: int, size: int) -> None:
        from spmd.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (size,))
        with pytest.raises(ValueError, match="pass process_group or device_mesh, not both"):
            FSDP(_net(), process_group=mesh.get_group(), device_mesh=mesh)
        with pytest.raises(ValueError, match="HYBRID_SHARD takes a 2-d device_mesh"):
            FSDP(_net(), sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_mesh=mesh)
        with pytest.raises(ValueError, match="keep_low_precision_grads=True is not served"):
            FSDP(_net(), mixed_precision=MixedPrecision(keep_low_precision_grads=True))
        with pytest.raises(ValueError, match="is for HYBRID_SHARD, not FULL_SHARD"):
            FSDP(_net(), process_group=(mesh.get_group(), mesh.get_group()))
        wrapped = FSDP(_net())
        with pytest.raises(ValueError, match="already wrapped"):
            FSDP(wrapped)
        with pytest.raises(ValueError, match="FULL_STATE_DICT takes a FullStateDictConfig"):
            FSDP.set_state_dict_type(wrapped, StateDictType.FULL_STATE_DICT, LocalStateDictConfig())
        with pytest.raises(ValueError, match="holds no FullyShardedDataParallel"):
            FSDP.get_state_dict_type(_net())
        state = wrapped.state_dict()
        state["head.weight"] = torch.zeros(4, 6)
        with pytest.raises(RuntimeError, match=r"head.weight has shape \(4, 6\); the parameter's full shape is"):
            wrapped.load_state_dict(state)
        assert BackwardPrefetch.BACKWARD_POST.value == 2

    run_ranks(body, 2, timeout=60)


def test_explicit_process_groups_lay_out_no_shard_hybrid_and_full_shard() -> None:
    """NO_SHARD and FULL_SHARD over one pair of ranks (each pair its own job), HYBRID_SHARD over
    (intra-node pair, inter-node column) groups: the meshes, and gradients averaged over just those ranks."""
    import spmd

    base = nn.Linear(4, 4)

    def body(rank: int, size: int) -> tuple[list, list[float]]:
        pairs = [spmd.new_group([0, 1]), spmd.new_group([2, 3])]
        columns = [spmd.new_group([0, 2]), spmd.new_group([1, 3])]
        pair, column = pairs[rank // 2], columns[rank % 2]
        models = [FSDP(copy.deepcopy(base), process_group=pair, sharding_strategy=ShardingStrategy.NO_SHARD),
                  FSDP(copy.deepcopy(base), process_group=(pair, column),
                       sharding_strategy=ShardingStrategy.HYBRID_SHARD),
                  FSDP(copy.deepcopy(base), process_group=pair)]
        for model in models:
            model(torch.full((2, 4), float(rank))).sum().backward()     # weight gradient: 2 * rank everywhere
        grads = []
        for model in models:
            with FSDP.summon_full_params(model, with_grads=True):
                grads.append(model.module.weight.grad.unique().item())
        return [m.module.weight.device_mesh.mesh.tolist() for m in models], grads

    for rank, (meshes, grads) in enumerate(run_ranks(body, 4, timeout=60)):
        mine = [0, 1] if rank < 2 else [2, 3]
        assert meshes == [[[r] for r in mine], [[0, 1], [2, 3]], mine]
        pair_mean = sum(2.0 * r for r in mine) / 2
        assert grads == [pair_mean, 3.0, pair_mean]


@pytest.mark.parametrize("strategy, hook", [(ShardingStrategy.FULL_SHARD, "reduce_scatter_hook"),
                                            (ShardingStrategy.SHARD_GRAD_OP, "reduce_scatter_hook"),
                                            (ShardingStrategy.NO_SHARD, "allreduce_hook"),
                                            (ShardingStrategy.FULL_SHARD, "bf16_compress_hook")])
def test_a_comm_hook_reduces_in_place_of_fsdps_collectives(strategy: ShardingStrategy, hook: str) -> None:
    from spmd.algorithms._comm_hooks import default_hooks

    calls: list[tuple[int, int | None]] = []

    def counted(state, grad, output=None) -> None:       # the hook's arguments, then torch's default hook
        calls.append((grad.numel(), None if output is None else output.numel()))
        getattr(default_hooks, hook)(state, grad, *([] if output is None else [output]))

    def body(rank: int, size: int) -> dict[str, Tensor]:
        model = _wrap(sharding_strategy=strategy)
        state = (default_hooks.LowPrecisionState(None) if "compress" in hook else default_hooks.DefaultState(None))
        assert (state.gradient_predivide_factor, state.gradient_postdivide_factor) == (2.0, 2.0)   # 4 ranks
        model.register_comm_hook(state, counted)
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        _train(model, opt, rank)
        return model.state_dict()

    want = _reference(4)
    exact = "compress" not in hook
    for got in run_ranks(body, 4, timeout=90):
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=1e-5 if exact else 2e-2, atol=1e-6 if exact else 2e-2,
                                       msg=key)
    units = 3                                             # two Block units and the root
    assert len(calls) == 4 * STEPS * units
    for grad_numel, output_numel in calls:
        if strategy is ShardingStrategy.NO_SHARD:
            assert output_numel is None
        else:
            assert grad_numel == 4 * output_numel         # the flat gradient of the unit, and one rank's quarter


def test_a_second_comm_hook_and_the_hybrid_strategies_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from spmd.algorithms._comm_hooks import default_hooks

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")

    def body(rank: int, size: int) -> None:
        model = _wrap()
        model.register_comm_hook(default_hooks.DefaultState(None), default_hooks.reduce_scatter_hook)
        with pytest.raises(RuntimeError, match=r"already registered; register one, once"):
            model.register_comm_hook(default_hooks.DefaultState(None), default_hooks.reduce_scatter_hook)
        hybrid = _wrap(sharding_strategy=ShardingStrategy.HYBRID_SHARD)
        with pytest.raises(NotImplementedError, match=r"not served with HYBRID_SHARD"):
            hybrid.register_comm_hook(default_hooks.DefaultState(None), default_hooks.reduce_scatter_hook)

    run_ranks(body, 2, timeout=60)
