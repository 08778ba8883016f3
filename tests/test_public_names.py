"""The names users import keep working: the facade's whole __all__, and every spmd name the README's porting
table shows (the table is read from README.md, so a renamed module or a stale row fails here)."""

from __future__ import annotations

import importlib
import pathlib
import re

import pytest

import spmd

README = pathlib.Path(__file__).parents[1] / "README.md"


@pytest.mark.parametrize("name", spmd.__all__)
def test_every_facade_name_resolves(name: str) -> None:
    assert getattr(spmd, name) is not None


def _porting_rows() -> list[str]:
    text = README.read_text()
    table = text.split("## Porting from torch.distributed", 1)[1].split("\n## ", 1)[0]
    return [line.split("|")[2] for line in table.splitlines() if line.startswith("| `")]


def test_every_spmd_name_in_the_porting_table_imports() -> None:
    checked = 0
    for cell in _porting_rows():
        for dotted in re.findall(r"`(spmd(?:\.\w+)+)`", cell):
            module, _, attribute = dotted.rpartition(".")
            try:
                importlib.import_module(dotted)
            except ModuleNotFoundError:
                assert hasattr(importlib.import_module(module), attribute), f"README names {dotted}"
            checked += 1
    assert checked >= 6


def test_stores_live_in_comm_store_and_the_facade() -> None:
    from spmd.comm import store

    for name in ("Store", "HashStore", "PrefixStore", "TCPStore", "FileStore"):
        assert getattr(store, name) is getattr(spmd, name)


# torch module path (under torch.distributed) -> names scripts import from it; spmd serves each at the same
# path under `spmd`, as the same objects as spmd's own modules.
TORCH_PATHS: dict[str, tuple[str, ...]] = {
    "": ("init_process_group", "all_reduce", "Backend", "get_default_backend_for_device", "is_nccl_available",
         "is_gloo_available", "is_mpi_available", "is_torchelastic_launched", "is_available"),
    "distributed_c10d": ("init_process_group", "all_reduce", "new_group", "get_backend", "Backend", "ReduceOp",
                         "_get_default_group"),
    "device_mesh": ("DeviceMesh", "init_device_mesh"),
    "tensor": ("DTensor", "Shard", "Replicate", "Partial", "distribute_tensor", "distribute_module",
               "init_device_mesh", "DeviceMesh", "zeros", "ones", "empty", "full", "rand", "randn"),
    "tensor.device_mesh": ("DeviceMesh", "init_device_mesh"),
    "tensor.placement_types": ("Shard", "Replicate", "Partial", "Placement"),
    "tensor.parallel": ("parallelize_module", "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
                        "PrepareModuleInput", "loss_parallel"),
    "tensor.debug": ("CommDebugMode",),
    "tensor._utils": ("compute_local_shape_and_global_offset", "normalize_to_torch_size"),
    "utils": ("_apply_to_tensors", "_cast_forward_inputs", "_pack_kwargs", "_unpack_kwargs", "_to_kwargs",
              "_alloc_storage", "_free_storage", "_sync_module_states", "_sync_params_and_buffers",
              "_verify_param_shape_across_processes", "_replace_by_prefix", "_p_assert"),
    "_state_dict_utils": ("_gather_state_dict", "_offload_state_dict_to_cpu", "_copy_state_dict",
                          "_create_cpu_state_dict", "_check_state_dict_similarity", "_distribute_tensors",
                          "_distribute_state_dict"),
    "_tensor": ("DTensor", "Shard", "Replicate", "Partial", "distribute_tensor", "DeviceMesh", "init_device_mesh"),
    "_tensor.api": ("DTensor", "distribute_tensor", "distribute_module"),
    "_tensor.device_mesh": ("DeviceMesh", "init_device_mesh"),
    "_tensor.placement_types": ("Shard", "Replicate", "Partial", "Placement"),
    "fsdp": ("fully_shard", "MixedPrecisionPolicy", "CPUOffloadPolicy", "FSDPModule"),
    "_composable.fsdp": ("fully_shard", "MixedPrecisionPolicy", "CPUOffloadPolicy", "FSDPModule"),
    "_composable": ("replicate", "checkpoint", "contract", "_get_registry"),
    "_composable.replicate": ("replicate",),
    "_composable.replicate_with_fsdp": ("replicate", "ReplicateModule", "is_composable_with_replicate"),
    "_composable.checkpoint_activation": ("checkpoint",),
    "_composable.contract": ("contract", "_get_registry"),
    "algorithms.ddp_comm_hooks.default_hooks": ("allreduce_hook", "fp16_compress_hook", "bf16_compress_hook"),
    "algorithms.ddp_comm_hooks.powerSGD_hook": ("PowerSGDState", "powerSGD_hook"),
    "elastic.multiprocessing.errors": ("record", "ChildFailedError"),
    "run": ("main", "run", "get_args_parser", "parse_args"),
    "elastic.multiprocessing": ("Std", "DefaultLogsSpecs", "LogsSpecs"),
    "elastic.timer": ("expires", "configure", "FileTimerClient", "FileTimerServer", "LocalTimerClient",
                      "LocalTimerServer", "TimerClient", "TimerRequest"),
    "elastic.timer.file_based_local_timer": ("FileTimerClient", "FileTimerServer", "FileTimerRequest"),
    "elastic.timer.local_timer": ("LocalTimerClient", "LocalTimerServer"),
    "elastic.timer.api": ("expires", "configure", "TimerClient", "TimerServer", "RequestQueue"),
    "checkpoint": ("save", "load", "async_save", "FileSystemWriter", "FileSystemReader", "CheckpointException"),
    "checkpoint.api": ("CheckpointException",),
    "checkpoint.format_utils": ("dcp_to_torch_save", "torch_save_to_dcp", "BroadcastingTorchSaveReader",
                                "DynamicMetaLoadPlanner"),
    "checkpoint.state_dict": ("get_state_dict", "set_state_dict", "get_model_state_dict", "StateDictOptions"),
    "checkpoint.stateful": ("Stateful",),
    "pipelining": ("PipelineStage", "ScheduleGPipe", "Schedule1F1B"),
    "_tools": ("MemTracker", "FSDPMemTracker", "ModTracker"),
    "_tools.mem_tracker": ("MemTracker",),
    "_tools.fsdp2_mem_tracker": ("FSDPMemTracker",),
    "_tools.mod_tracker": ("ModTracker",),
}
SAME_AS = {  # alias module -> the spmd module whose objects it serves
    "distributed_c10d": "spmd", "tensor.device_mesh": "spmd.device_mesh", "_tensor": "spmd.tensor",
    "_tensor.api": "spmd.tensor", "_tensor.device_mesh": "spmd.device_mesh", "_tensor.placement_types": "spmd.tensor",
    "tensor.placement_types": "spmd.tensor", "_composable.fsdp": "spmd.fsdp",
    "_composable.replicate_with_fsdp": "spmd.fsdp.replicate",
    "algorithms.ddp_comm_hooks.default_hooks": "spmd.ddp", "algorithms.ddp_comm_hooks.powerSGD_hook": "spmd.ddp",
    "checkpoint.stateful": "spmd.checkpoint",
}


@pytest.mark.parametrize("path", sorted(TORCH_PATHS))
def test_torch_module_paths_exist_under_spmd(path: str) -> None:
    torch_module = importlib.import_module("torch.distributed" + (f".{path}" if path else ""))
    spmd_module = importlib.import_module("spmd" + (f".{path}" if path else ""))
    for name in TORCH_PATHS[path]:
        assert hasattr(torch_module, name), f"torch has no {path}.{name}: the table is stale"
        assert hasattr(spmd_module, name), f"spmd.{path} lacks {name}"
    target = SAME_AS.get(path)
    if target is not None:
        for name in TORCH_PATHS[path]:
            if not name.startswith("_"):
                assert getattr(spmd_module, name) is getattr(importlib.import_module(target), name), name


def test_record_returns_the_entry_point_unchanged() -> None:
    from spmd.elastic.multiprocessing.errors import record

    def main() -> int:
        return 7

    assert record(main) is main and main() == 7
