"""torch.distributed's public names under `spmd`: every one torch 2.13 serves, at the top level and in each
module path scripts import, is served at the same path, or listed here with why not, so a script that swaps
the import finds each name it uses (or this file says which it won't)."""

from __future__ import annotations

import datetime
import importlib
import inspect
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as torch_dist

import spmd
from spmd._core.errors import CommTimeoutError
from spmd.testing import run_ranks

NOT_SERVED = {   # torch name -> why spmd has none
    **dict.fromkeys(["BackendConfig", "get_backend_config", "ProcessGroupGloo", "Reducer", "Logger",
                     "BuiltinCommHookType"],
                    "an object of torch's C++ c10d backends; spmd's DDP takes no such objects"),
    "DistNetworkError": "network failures raise PeerLostError / PeerUnreachableError (DistBackendError) or a "
                        "StoreError (DistStoreError)",
    "record_comm": "a profiling name for torch's Work; spmd's flight recorder names every op with its call site",
    **dict.fromkeys(["GroupName", "RankType", "log", "timedelta"],
                    "not API: type aliases, torch's logger, datetime's class"),
}


def _torch_public_names() -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)        # reading reduce_op warns
        return [name for name in dir(torch_dist)
                if not name.startswith("_") and not inspect.ismodule(getattr(torch_dist, name))]


def test_every_public_torch_distributed_name_is_served_or_listed_with_why_not() -> None:
    names = _torch_public_names()
    missing = [name for name in names if name not in NOT_SERVED and not hasattr(spmd, name)]
    assert not missing, f"torch.distributed names spmd neither serves nor lists in NOT_SERVED: {missing}"
    stale = [name for name in NOT_SERVED if name not in names or hasattr(spmd, name)]
    assert not stale, f"NOT_SERVED lists names torch lacks or spmd serves: {stale}"


MODULES_NOT_SERVED: dict[str, dict[str, str]] = {   # torch module path -> {name: why spmd's has none}
    "checkpoint.filesystem": dict.fromkeys(["FileSystem", "FileSystemBase", "SerializationFormat"],
                                           "torch's storage internals: spmd's format is safetensors files and a JSON "
                                           "index, written by FileSystemWriter"),
    "checkpoint.state_dict": dict.fromkeys(["FQNS_T", "PrimitiveType", "DictValueType", "ListDictValueType"],
                                           "type aliases"),
    "checkpoint.stateful": {"StatefulT": "a type variable"},
    **{path: dict.fromkeys(["start_processes", "MultiprocessContext", "PContext", "SubprocessContext", "RunProcsResult",
                            "ProcessFailure", "LogsDest", "to_map", "get_std_cm"],
                           "torchelastic's process-starting layer under its agent: spmdrun starts and watches its "
                           "workers itself (spmd.run.spawn starts processes from Python)")
       for path in ("elastic.multiprocessing", "elastic.multiprocessing.api")},
    "elastic.multiprocessing.errors": dict.fromkeys(["ProcessFailure", "ErrorHandler", "get_error_handler"],
                                                    "torchelastic's error files: spmdrun reports a worker's "
                                                    "traceback itself"),
    "nn.functional": {"group": "not API: torch's group namespace, imported there for its defaults (spmd's "
                               "functions default to the world with group=None)"},
    "optim": {"as_functional_optim": "torch's functional optimizers are internal to its DDP/ZeRO overlap"},
    "rpc": {**dict.fromkeys(["register_backend", "backend_registered", "construct_rpc_backend_options",
                             "init_backend", "BackendValue"],
                            "torch's registry of C++ RPC agents: spmd has one agent, over its own transports"),
            **dict.fromkeys(["AllGatherStates", "method_factory", "new_method"],
                            "not API: internals of torch's RPC module")},
    "elastic.utils": dict.fromkeys(["get_env_variable_or_raise", "macros"],
                                   "torchelastic's launcher internals: spmdrun reads the environment and picks ports "
                                   "itself"),
    "rpc.api": dict.fromkeys(["AllGatherStates", "method_factory", "new_method"], "not API: internals of torch's RPC "
                                                                                  "module"),
    "_tensor": dict.fromkeys(["full_module_name", "import_module", "submodule", "submodules"],
                             "not API: torch's lazy-import helpers"),
    "distributed_c10d": {name: why for name, why in NOT_SERVED.items()},
    "_functional_collectives": {
        **{f"{op}_{part}": "torch's autograd registration of its C++ functional op; spmd's *_autograd variants are "
                           "autograd Functions" for part in ("backward", "setup_context")
           for op in ("all_gather_into_tensor", "all_gather_into_tensor_coalesced", "all_reduce",
                      "all_reduce_coalesced", "all_to_all_single", "reduce_scatter_tensor",
                      "reduce_scatter_tensor_coalesced", "wait_tensor")},
        **dict.fromkeys(["legacy_all_gather", "legacy_all_gather_base", "legacy_all_to_all_single",
                         "legacy_allgather", "legacy_allgather_single", "legacy_allreduce", "legacy_batch_p2p_ops",
                         "legacy_irecv", "legacy_isend", "legacy_reduce_scatter_base", "legacy_reducescatter",
                         "legacy_reducescatter_single", "backend_impl", "batch_p2p_ops_inplace", "irecv_inplace",
                         "isend_inplace", "allow_inflight_collective_as_graph_input_ctx"],
                        "aliases of torch's c10d collectives that dynamo remaps to its c10d_functional ops; "
                        "spmd's in-place collectives trace to its own torch.ops.spmd ops without them"),
    },
    "tensor._random": {"OffsetBasedRNGTracker": "torch's per-device Philox offset tracker: spmd's DTensor random ops "
                                                "draw the global tensor's numbers from the rank's generators "
                                                "(spmd.tensor.random)"},
    "tensor.experimental._attention": {
        "_templated_ring_attention": "the template of torch's ring attention over its kernels' calling "
                                     "conventions; spmd's ring attention is spmd.tensor.ring_attention",
    },
    "fsdp.sharded_grad_scaler": {"ProcessGroup": "not API: the type torch's module imports for its signature "
                                                 "(spmd.ProcessGroup is the top-level name)"},
    "_tools": {"MemoryTracker": "torch's older module-level tracker, superseded by MemTracker (served)",
               **dict.fromkeys(["MSPS", "SACEstimator", "SACGreedyOrderMeta", "SACStats", "SACTradeOffStats"],
                               "torch's selective-activation-checkpointing estimator: not served; spmd serves the "
                               "memory trackers and the RuntimeEstimator")},
}
TORCH_MODULES = ["tensor", "tensor.parallel", "tensor.debug", "tensor.placement_types", "tensor.experimental",
                 "tensor.experimental._attention", "tensor.experimental._context_parallel",
                 "tensor.experimental._context_parallel._attention", "device_mesh", "fsdp", "fsdp.api",
                 "fsdp.fully_sharded_data_parallel", "fsdp.wrap", "fsdp.sharded_grad_scaler", "pipelining",
                 "pipelining.schedules", "pipelining.stage", "pipelining.microbatch", "checkpoint",
                 "checkpoint.state_dict", "checkpoint.stateful", "checkpoint.format_utils", "checkpoint.staging",
                 "checkpoint.default_planner", "checkpoint.planner", "checkpoint.metadata", "checkpoint.filesystem",
                 "checkpoint.hf_storage", "checkpoint._consolidate_hf_safetensors",
                 "checkpoint.quantized_hf_storage", "checkpoint._fsspec_filesystem",
                 "checkpoint.state_dict_saver", "checkpoint.planner_helpers", "checkpoint.utils",
                 "checkpoint.resharding",
                 "checkpoint.state_dict_loader", "algorithms.ddp_comm_hooks", "algorithms.ddp_comm_hooks.default_hooks",
                 "algorithms.ddp_comm_hooks.quantization_hooks", "optim.post_localSGD_optimizer",
                 "algorithms.ddp_comm_hooks.powerSGD_hook", "algorithms.ddp_comm_hooks.post_localSGD_hook",
                 "algorithms.ddp_comm_hooks.debugging_hooks",
                 "algorithms.ddp_comm_hooks.ddp_zero_hook", "algorithms.model_averaging.averagers",
                 "algorithms.model_averaging.utils",
                 "algorithms.model_averaging.hierarchical_model_averager", "algorithms._checkpoint.checkpoint_wrapper",
                 "algorithms", "algorithms.join", "algorithms._comm_hooks", "algorithms._comm_hooks.default_hooks",
                 "optim",
                 "rpc", "rpc.api", "rpc.functions", "rpc.options", "autograd", "nn.api.remote_module",
                 "elastic.utils", "elastic.utils.data", "elastic.utils.distributed",
                 "elastic.utils.data.elastic_distributed_sampler",
                 "elastic.utils.data.cycling_iterator",
                 "nn.functional", "elastic.multiprocessing.errors", "elastic.multiprocessing",
                 "elastic.multiprocessing.api", "launcher",
                 "launcher.api", "_tensor", "_composable.fsdp", "distributed_c10d", "_functional_collectives",
                 "fsdp._fully_shard", "fsdp._fully_shard._fsdp_api", "tensor.parallel.input_reshard",
                 "tensor.parallel.ddp",
                 "optim.apply_optimizer_in_backward", "constants", "checkpoint.optimizer",
                 "_tools", "_tools.mem_tracker", "_tools.fsdp2_mem_tracker", "_tools.mod_tracker",
                 "_tools.runtime_estimator", "debug", "collective_utils", "tensor._random",
                 "_composable.fsdp.fully_shard"]


def _api_names(module: object) -> list[str]:
    """A module's public names: its __all__, else what it defines or takes from torch's distributed package
    (not what it imports from elsewhere: typing, collections, its logger, torch.amp's GradScaler)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        if getattr(module, "__all__", None):
            return list(module.__all__)
        names = [name for name in dir(module)
                 if not name.startswith("_") and not inspect.ismodule(getattr(module, name))]
    return [name for name in names
            if (getattr(getattr(module, name), "__module__", None) or "").startswith("torch.distributed")]


@pytest.mark.parametrize("path", TORCH_MODULES)
def test_every_name_of_torchs_module_is_served_at_the_same_path_or_listed(path: str) -> None:
    theirs, ours = importlib.import_module(f"torch.distributed.{path}"), importlib.import_module(f"spmd.{path}")
    names = _api_names(theirs)
    listed = MODULES_NOT_SERVED.get(path, {})
    missing = [name for name in names if name not in listed and not hasattr(ours, name)]
    assert not missing, f"torch.distributed.{path} names spmd.{path} neither serves nor lists: {missing}"
    stale = [name for name in listed if name in names and hasattr(ours, name)]
    assert not stale, f"spmd.{path} serves names still listed as not served: {stale}"


def test_the_names_torch_213_prefers_are_the_same_ops() -> None:
    assert spmd.all_gather_single is spmd.all_gather_into_tensor
    assert spmd.reduce_scatter_single is spmd.reduce_scatter_tensor
    assert spmd.init_device_mesh is spmd.device_mesh.init_device_mesh and spmd.DeviceMesh is spmd.device_mesh.DeviceMesh
    assert spmd.GradBucket is spmd.ddp.GradBucket
    assert issubclass(spmd.DistBackendError, spmd.DistError) and issubclass(spmd.DistStoreError, spmd.DistError)
    assert issubclass(spmd.DistError, RuntimeError)
    assert spmd.default_pg_timeout == datetime.timedelta(seconds=600)
    assert [spmd.supports_complex(op) for op in (spmd.ReduceOp.SUM, spmd.ReduceOp.AVG, spmd.ReduceOp.MAX)] == \
        [torch_dist.supports_complex(op) for op in (torch_dist.ReduceOp.SUM, torch_dist.ReduceOp.AVG,
                                                     torch_dist.ReduceOp.MAX)]
    assert spmd.is_backend_available("gloo") and spmd.is_backend_available("cpu:gloo,cuda:gloo")
    assert not spmd.is_backend_available("mpi") and not spmd.is_backend_available("bogus")
    assert not spmd.is_ucc_available() and not spmd.is_xccl_available()
    assert spmd.GroupMember.NON_GROUP_MEMBER == torch_dist.GroupMember.NON_GROUP_MEMBER
    with pytest.warns(FutureWarning, match="use spmd.ReduceOp"):     # older tutorials write dist.reduce_op.SUM
        assert spmd.reduce_op.SUM is spmd.ReduceOp.SUM
    with pytest.raises(AttributeError, match="reduce_op has no member 'SUMM'"):
        _ = spmd.reduce_op.SUMM
    assert spmd.group.WORLD is None and not spmd.is_initialized()


# Private names that published examples and TorchTitan import
PRIVATE_NAMES_IN_EXAMPLES = [("checkpoint.state_dict", "_init_optim_state"),   # pytorch/examples' FSDP2
                             ("distributed_c10d", "_set_pg_timeout"),              # TorchTitan
                             ("pipelining.schedules", "_PipelineScheduleRuntime"),
                             ("pipelining.schedules", "_wait_batch_p2p"),
                             ("pipelining.schedules", "_PipelineContext"),       # TorchTitan 0.2
                             ("_tensor.placement_types", "DTensorSpec"),          # torchtune
                             ("_tensor.placement_types", "TensorMeta"),
                             ("_tensor.experimental", "local_map")]               # TorchTitan 0.2's autoparallel


@pytest.mark.parametrize(("path", "name"), PRIVATE_NAMES_IN_EXAMPLES)
def test_private_names_published_examples_import_are_served(path: str, name: str) -> None:
    assert hasattr(importlib.import_module(f"torch.distributed.{path}"), name)
    assert callable(getattr(importlib.import_module(f"spmd.{path}"), name))


def test_set_pg_timeout_bounds_the_groups_next_operations() -> None:
    def body(rank: int, size: int) -> str:
        from spmd.distributed_c10d import _set_pg_timeout

        _set_pg_timeout(datetime.timedelta(seconds=1.5))
        if rank == 1:
            return ""                                        # never enters the barrier
        with pytest.raises(CommTimeoutError) as raised:
            spmd.barrier()
        return str(raised.value)

    assert "timed out after 1.5s" in run_ranks(body, 2, timeout=60)[0]


def test_node_local_rank_reads_the_launchers_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert spmd.get_node_local_rank() == 3
    monkeypatch.delenv("LOCAL_RANK")
    assert spmd.get_node_local_rank(fallback_rank=1) == 1
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK is not set.*fallback_rank="):
        spmd.get_node_local_rank()


def test_groups_coalesced_ops_and_object_messages() -> None:
    def body(rank: int, size: int) -> dict:
        assert spmd.group.WORLD is spmd.GroupMember.WORLD
        spmd.all_reduce(t := torch.ones(2), group=spmd.group.WORLD)
        count = spmd.get_pg_count()
        mine, groups = spmd.new_subgroups_by_enumeration([[0, 2], [1, 3]])
        assert [g.ranks for g in groups] == [[0, 2], [1, 3]]
        assert spmd.get_pg_count() == count + 2 and spmd.get_process_group_ranks(mine) == [rank % 2, rank % 2 + 2]
        with pytest.raises(ValueError, match=r"rank\(s\) \[2\] are in more than one"):
            spmd.new_subgroups_by_enumeration([[0, 2], [2, 3]])
        tensors = [torch.full((2, 3), float(rank)), torch.full((4,), rank * 10.0)]
        spmd.all_reduce_coalesced(tensors, group=mine)
        rows = [[torch.empty(2, 3), torch.empty(4)] for _ in range(size)]
        spmd.all_gather_coalesced(rows, [torch.full((2, 3), float(rank)), torch.full((4,), -float(rank))])
        received: list[object] = [None, None]
        if rank == 0:
            spmd.send_object_list([{"from": 0}, [1, 2]], dst=3)
        elif rank == 3:
            assert spmd.recv_object_list(received, src=0) == 0
        return {"sums": [tensors[0][0, 0].item(), tensors[1][0].item()], "ones": t.tolist(),
                "gathered": [[row[0][1, 2].item(), row[1][3].item()] for row in rows], "received": received}

    results = run_ranks(body, 4, timeout=60)
    for rank, result in enumerate(results):
        pair = [rank % 2, rank % 2 + 2]
        assert result["sums"] == [float(sum(pair)), 10.0 * sum(pair)] and result["ones"] == [4.0, 4.0]
        assert result["gathered"] == [[float(r), -float(r)] for r in range(4)]
    assert results[3]["received"] == [{"from": 0}, [1, 2]]


def test_coalesced_ops_refuse_mixed_dtypes_and_wrong_output_lists() -> None:
    def body(rank: int, size: int) -> None:
        with pytest.raises(ValueError, match=r"all_reduce_coalesced.*tensors\[1\] has dtype torch.float64"):
            spmd.all_reduce_coalesced([torch.ones(2), torch.ones(2, dtype=torch.float64)])
        with pytest.raises(ValueError, match="non-empty list"):
            spmd.all_reduce_coalesced([])
        with pytest.raises(ValueError, match=r"output_tensor_lists\[1\] must hold 2 tensors"):
            spmd.all_gather_coalesced([[torch.ones(1), torch.ones(1)], [torch.ones(1)]], [torch.ones(1)] * 2)

    run_ranks(body, 2, timeout=60)


def test_split_group_splits_the_parent_by_its_group_ranks() -> None:
    def body(rank: int, size: int) -> list[object]:
        odds = spmd.new_group([1, 3])
        if rank in (1, 3):
            single = spmd.split_group(odds, [[1]])              # group rank 1 of odds: global rank 3
            assert (single is None) == (rank == 1)
        halves = spmd.split_group(split_ranks=[[0, 1], [2, 3]])
        t = torch.full((1,), float(rank))
        spmd.all_reduce(t, group=halves)
        with pytest.raises(ValueError, match=r"appear more than once"):
            spmd.split_group(split_ranks=[[0, 1], [1, 2]])
        with pytest.raises(ValueError, match=r"split \[4\] must be a non-empty list of group ranks"):
            spmd.split_group(split_ranks=[[4]])
        return [halves.ranks, t.item(), spmd.get_backend(halves)]

    results = run_ranks(body, 4, timeout=60, backend="tcp")
    assert results == [[[0, 1], 1.0, "tcp"], [[0, 1], 1.0, "tcp"], [[2, 3], 5.0, "tcp"], [[2, 3], 5.0, "tcp"]]


def test_the_debug_level_is_torchs_and_read_from_its_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from spmd.comm import debug

    monkeypatch.setattr(debug, "_debug_level", [])
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "detail")
    assert spmd.get_debug_level() is spmd.DebugLevel.DETAIL
    assert list(spmd.DebugLevel.__members__) == list(torch_dist.DebugLevel.__members__)
    spmd.set_debug_level(spmd.DebugLevel.INFO)
    assert spmd.get_debug_level() is spmd.DebugLevel.INFO
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "LOUD")
    with pytest.raises(ValueError, match=r"TORCH_DISTRIBUTED_DEBUG='LOUD' is not a debug level; use OFF, INFO"):
        spmd.set_debug_level_from_env()
    with pytest.raises(TypeError, match=r"takes a DebugLevel"):
        spmd.set_debug_level("DETAIL")
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG")
    spmd.set_debug_level_from_env()
    assert spmd.get_debug_level() is spmd.DebugLevel.OFF


def test_the_tensor_package_holds_its_random_module_as_torchs_does() -> None:
    """TorchTitan calls `torch.distributed.tensor._random.manual_seed` having imported only the package."""
    code = "import spmd.tensor, torch.distributed.tensor as t; print(callable(spmd.tensor._random.manual_seed), " \
           "callable(t._random.manual_seed))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split() == ["True", "True"]


def test_the_private_names_torchtitans_simple_fsdp_imports_do_what_torchs_do() -> None:
    """SimpleFSDP (imported by every TorchTitan run) builds specs as torch's `DTensorSpec(mesh, placements,
    tensor_meta=...)`, reads `num_shards_map`, moves local tensors with `redistribute_local_tensor` and finds a
    mesh's root through `_mesh_resources`; torch's answers in a fake world are the oracle."""
    from torch.distributed.tensor import Shard as TorchShard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec as TorchSpec
    from torch.distributed.tensor._dtensor_spec import TensorMeta as TorchMeta

    from spmd.device_mesh import _mesh_resources, init_device_mesh
    from spmd.pipelining.stage import PipelineStage, _PipelineStageBase
    from spmd.tensor import Replicate, Shard, distribute_tensor
    from spmd.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from spmd.tensor._redistribute import redistribute_local_tensor
    from spmd.tensor.placement import _StridedShard
    from spmd.tensor.placement_types import _StridedShard as served

    assert served is _StridedShard and _PipelineStageBase is PipelineStage
    torch_dist.init_process_group("fake", rank=5, world_size=8)
    try:
        theirs = TorchSpec(torch_dist.device_mesh.init_device_mesh("cpu", (2, 4)), (TorchShard(1), TorchShard(0)),
                           tensor_meta=TorchMeta(torch.Size([18, 20, 30]), (600, 30, 1), torch.float32))
        expected = theirs.num_shards_map
    finally:
        torch_dist.destroy_process_group()

    def body(rank: int, world_size: int) -> tuple:
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        meta = TensorMeta(torch.Size([18, 20, 30]), (600, 30, 1), torch.float32)
        spec = DTensorSpec(mesh=mesh, placements=(Shard(1), Shard(0)), tensor_meta=meta)
        assert spec.tensor_meta == meta and spec == DTensorSpec(mesh, (Shard(1), Shard(0)), meta)
        full = torch.arange(8.0 * 6).reshape(8, 6)
        sharded = distribute_tensor(full, mesh["tp"], [Shard(0)])
        whole = redistribute_local_tensor(sharded.to_local(), sharded._spec,
                                          sharded._spec.with_placements((Replicate(),)))
        return spec.num_shards_map, torch.equal(whole, full), _mesh_resources.get_root_mesh(mesh["tp"]) is mesh

    assert run_ranks(body, 8, timeout=60)[5] == (expected, True, True)


def test_init_process_group_takes_every_argument_torchs_takes() -> None:
    """TorchTitan 0.2 passes torch's private `_ranks`."""
    theirs = inspect.signature(torch_dist.init_process_group).parameters
    ours = inspect.signature(spmd.init_process_group).parameters
    assert [name for name in theirs if name not in ours] == []
    assert list(ours)[:len(theirs)] == list(theirs)          # in torch's order, for positional callers


# torch callable (its spmd path) -> why spmd's lacks these parameters of torch's (a script passing one by name would
# get a TypeError); everything else torch's public functions, classes and methods take, spmd's take by name too
SIGNATURES_NOT_SERVED = {
    **dict.fromkeys(["DeviceMesh.__init__", "nn.api.remote_module.RemoteModule.init_from_module_rref"],
                    "private parameters of torch's own construction paths"),
    **dict.fromkeys(["algorithms.ddp_comm_hooks.debugging_hooks.noop_hook", "checkpoint.CheckpointException.__init__",
                     "checkpoint.DefaultLoadPlanner.finish_plan",
                     "checkpoint.format_utils.BroadcastingTorchSaveReader.prepare_global_plan",
                     "elastic.multiprocessing.errors.ChildFailedError.__init__"],
                    "named otherwise, taken positionally as torch's callers pass them"),
    **dict.fromkeys(["checkpoint.StorageWriter.finish", "checkpoint.FileSystemWriter.finish",
                     "checkpoint.HuggingFaceStorageWriter.finish"],
                    "spmd's protocol's finish takes the coordinator's storage_data; a writer of torch's protocol gets "
                    "the results positionally"),
    "checkpoint.Metadata.__init__": "spmd's checkpoint index is its own (torch's view: Metadata.state_dict_metadata)",
    **dict.fromkeys(["checkpoint.FileSystemWriter.__init__", "checkpoint.FileSystemReader.__init__"],
                    "torch's stream extensions and serialization format: TorchFormatWriter writes torch's format"),
    **dict.fromkeys(["checkpoint.save", "checkpoint.async_save"],
                    "use_collectives=False, torch's experimental uncoordinated save with per-rank metadata"),
    **dict.fromkeys(["launcher.elastic_launch.__init__", "launcher.launch_agent"],
                    "torchelastic's health-check server"),
    **dict.fromkeys(["pipelining.Pipe.__init__", "pipelining.PipelineStage.__init__",
                     "pipelining.PipelineStage.backward_one_chunk", "pipelining.PipelineStage.forward_one_chunk",
                     "pipelining.PipelineStage.backward_weight_one_chunk",
                     "pipelining.schedules.PipelineScheduleMulti.__init__",
                     "pipelining.ScheduleInterleaved1F1B.__init__", "pipelining.ScheduleLoopedBFS.__init__",
                     "pipelining.ScheduleInterleavedZeroBubble.__init__", "pipelining.ScheduleZBVZeroBubble.__init__",
                     "pipelining.ScheduleDualPipeV.__init__"],
                    "torch's stage internals for hand-written schedules (backward without autograd, deferred "
                    "receives, given gradient shapes, DTensor stage meshes); spmd's schedules lower and run "
                    "their programs themselves"),
}


def _callables(path: str) -> list[tuple[str, object, object]]:
    """(label, torch's, spmd's) for the public functions, classes (their __init__) and methods both modules serve."""
    theirs, ours = importlib.import_module(f"torch.distributed.{path}" if path else "torch.distributed"), \
        importlib.import_module(f"spmd.{path}" if path else "spmd")
    prefix = f"{path}." if path else ""
    found = []
    for name in _api_names(theirs):
        mine, torch_value = getattr(ours, name, None), getattr(theirs, name, None)
        if mine is None or torch_value is None:
            continue
        if inspect.isfunction(torch_value) and callable(mine):
            found.append((f"{prefix}{name}", torch_value, mine))
        elif inspect.isclass(torch_value) and inspect.isclass(mine):
            found.append((f"{prefix}{name}.__init__", torch_value, mine))
            for method in dir(torch_value):
                torch_method, my_method = getattr(torch_value, method, None), getattr(mine, method, None)
                if not method.startswith("_") and inspect.isfunction(torch_method) and callable(my_method):
                    found.append((f"{prefix}{name}.{method}", torch_method, my_method))
    return found


def test_torchs_callables_take_torchs_parameters_by_name_or_are_listed() -> None:
    missing: dict[str, list[str]] = {}
    lacking_listed: set[str] = set()
    seen: set[int] = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for path in ["", *TORCH_MODULES]:
            for label, theirs, ours in _callables(path):
                if id(theirs) in seen:
                    continue
                seen.add(id(theirs))
                try:
                    torch_params, our_params = inspect.signature(theirs).parameters, inspect.signature(ours).parameters
                except (TypeError, ValueError):
                    continue
                if any(p.kind is p.VAR_KEYWORD for p in our_params.values()):
                    continue
                lacking = [name for name, p in torch_params.items() if name not in our_params and name != "self"
                           and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
                if lacking and label not in SIGNATURES_NOT_SERVED:
                    missing[label] = lacking
                elif lacking:
                    lacking_listed.add(label)
    assert not missing, f"spmd's callables lack torch's parameters (serve them or list why not): {missing}"
    stale = sorted(set(SIGNATURES_NOT_SERVED) - lacking_listed)
    assert not stale, f"listed as lacking torch's parameters, but take them all: {stale}"
