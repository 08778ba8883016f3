"""CommDebugMode: count the collectives one rank issues inside a `with` block, in total and per module.

Layer: tensor (may import _core, comm, device_mesh).

The counterpart of torch's CommDebugMode, with its interface (get_comm_counts, get_total_counts,
comm_module_counts, get_parameter_info, get_sharding_info, the tracing table and the JSON dump). What differs:
- It counts at spmd's one chokepoint, ProcessGroup.run, through the rank's CollectiveObservers (see Note:
  observers in spmd.comm.group), so it counts every collective this rank issues on any of its groups,
  whichever thread issues it: DTensor's redistributions, a parallelism's own collectives, autograd's
  backward on an accelerator's thread, and the public in-place ones (spmd.all_reduce, barrier, ...).
  Point-to-point operations are not collectives and are not counted.
- It is per rank: with thread ranks each rank enters its own instance and counts only its own collectives
  and its own modules (see Note: per-rank module tracking in module_tracker.py).
- Counts are keyed by torch's functional-collective names and found by any of a collective's names (see
  counts.py): `counts["all_gather_into_tensor"]`, `counts[spmd.comm.collectives.all_gather_into_tensor]`,
  `counts[spmd.comm.functional.all_gathered]` and `counts["all_gather"]` are one count.
Operations (noise levels 1 to 3 of the reports) are recorded by a TorchDispatchMode on the entering thread,
as torch's does; the counts do not depend on it.
"""

from __future__ import annotations

import copy
import json
import re
import threading
from collections.abc import Callable
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from spmd._core.higher_order import is_higher_order
from spmd.comm.debug import Fingerprint
from spmd.comm.group import CollectiveObservers, ProcessGroup
from spmd.comm.world import current_world, is_initialized
from spmd.tensor.api import DTensor
from spmd.tensor.debug.counts import CommCounts, torch_name
from spmd.tensor.debug.module_tracker import GLOBAL, ModuleTracker, current_owner

# Operations the reports leave out below noise level 3 (torch's list).
TRIVIAL_OPS = frozenset({"aten.detach.default", "aten.t.default", "aten.view.default", "aten._to_copy.default",
                         "aten.as_strided.default", "aten.transpose.int"})
_ANSI_ESCAPE = re.compile(r"\x1B\[[0-?]*[ -/]*[@-~]")
_YELLOW, _RED, _RESET = "\033[1;33m", "\033[1;31m", "\033[0m"


def _directions() -> dict[str, CommCounts]:
    return {"forward": CommCounts(), "backward": CommCounts()}


class _OperationTracer(TorchDispatchMode):
    """Records every op run on this thread for the reports; an op on DTensors is recorded, then handed on to
    DTensor's dispatch (NotImplemented), whose local ops come back here as plain ones."""

    supports_higher_order_operators = True   # flex_attention and the like run below the tracer (as torch's)

    def __init__(self, record: Callable[[Any, tuple, bool], None]) -> None:
        super().__init__()
        self._record = record

    def __torch_dispatch__(self, func: Any, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if is_higher_order(func):
            return func(*args, **kwargs)
        on_dtensors = any(issubclass(t, DTensor) for t in types)
        self._record(func, args, on_dtensors)
        if on_dtensors:
            return NotImplemented
        return func(*args, **kwargs)


class CommDebugMode:
    """Counts the collectives this rank issues while active, in total and per module, forward and backward.

    Enter it on the rank whose collectives it should count (each thread rank enters its own); entering resets
    what an earlier use counted. Instances nest: each counts what is issued inside it. After `__exit__`, also
    when the block raised, nothing of it stays registered anywhere.

        comm_mode = CommDebugMode()
        with comm_mode:
            model(x).sum().backward()
        comm_mode.get_comm_counts()["all_reduce"]            # also [spmd.all_reduce]
        comm_mode.comm_module_counts["MLP.fc2"]["forward"]   # what fc2's forward issued
        print(comm_mode.generate_comm_debug_tracing_table(noise_level=1))
    """

    def __init__(self) -> None:
        self.comm_counts = CommCounts()
        self.comm_module_counts: dict[str, dict[str, CommCounts]] = {}
        self.comm_module_operation_counts: dict[str, dict[str, list[dict[str, Any]]]] = {}
        self.advanced_module_tracker = ModuleTracker()
        self._observer = self._count       # one bound method: the one registered is the one removed
        self._observers: CollectiveObservers | None = None
        self._tracer: _OperationTracer | None = None
        self._lock = threading.Lock()
        self._active = False

    # -- lifetime -------------------------------------------------------------------------------------------

    def __enter__(self) -> CommDebugMode:
        if self._active:
            raise RuntimeError("CommDebugMode: this instance is already active; nest a new CommDebugMode instead")
        self.comm_counts.clear()
        self.comm_module_counts.clear()
        self.comm_module_counts[GLOBAL] = _directions()
        self.comm_module_operation_counts.clear()
        self._active = True
        try:
            self.advanced_module_tracker.start(current_owner())
            self._tracer = _OperationTracer(self._record_operation)
            self._tracer.__enter__()
            if is_initialized():
                self._observers = current_world().observers
                self._observers.add(self._observer)
        except BaseException:
            self._stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop()

    def _stop(self) -> None:
        try:
            if self._observers is not None:
                self._observers.remove(self._observer)
                self._observers = None
        finally:
            try:
                if self._tracer is not None:
                    tracer, self._tracer = self._tracer, None
                    tracer.__exit__(None, None, None)
            finally:
                self.advanced_module_tracker.stop()
                self._active = False

    # -- recording ------------------------------------------------------------------------------------------

    def _count(self, group: ProcessGroup, fingerprint: Fingerprint) -> None:
        name = torch_name(fingerprint.op)
        tracker = self.advanced_module_tracker
        module, backward = tracker.current()
        direction = "backward" if backward else "forward"
        with self._lock:
            self.comm_counts[name] += 1
            for fqn in tracker.parents_of(module):
                per_module = self.comm_module_counts.get(fqn)
                if per_module is None:
                    per_module = self.comm_module_counts[fqn] = _directions()
                per_module[direction][name] += 1

    def _record_operation(self, func: Any, args: tuple, on_dtensors: bool) -> None:
        tracker = self.advanced_module_tracker
        if tracker.busy:
            return
        module, backward = tracker.current()
        entry: dict[str, Any] = {"name": func, "input_shape": [], "input_sharding": [], "device_mesh": "",
                                 "is_bw": backward, "is_activation_checkpointing": tracker.recomputing()}
        if on_dtensors:
            for arg in args:
                if isinstance(arg, DTensor):
                    entry["input_shape"].append(arg.shape)
                    entry["input_sharding"].append(arg.placements)
                    entry["device_mesh"] = str(arg.device_mesh)
        with self._lock:
            self.comm_module_operation_counts.setdefault(module, {"operations_list": []})["operations_list"].append(
                entry)

    # -- queries --------------------------------------------------------------------------------------------

    def get_total_counts(self) -> int:
        return sum(self.comm_counts.values())

    def get_comm_counts(self) -> CommCounts:
        """Collective -> how many this rank issued (keys: see counts.py; a collective never issued reads 0)."""
        return self.comm_counts

    def get_per_module_info(self) -> dict[str, dict[str, CommCounts]]:
        """comm_module_counts: module fqn ("Global" for all) -> {"forward": counts, "backward": counts}. A
        module's counts include those of the modules it called."""
        return self.comm_module_counts

    def get_parameter_info(self) -> dict[str, dict[str, Any]]:
        """Module fqn -> {parameter name: its data} for the modules that ran forward."""
        return self.advanced_module_tracker.module_parameters_dict

    def get_sharding_info(self) -> dict[str, Any]:
        """"fqn.parameter" -> placements, for the DTensor parameters of the modules that ran forward."""
        return self.advanced_module_tracker.sharding_dict

    def __repr__(self) -> str:
        return f"CommDebugMode(get_total_counts()={self.get_total_counts()})"

    # -- reports --------------------------------------------------------------------------------------------

    def generate_comm_debug_tracing_table(self, noise_level: int = 3) -> str:
        """A per-module table of collectives (forward / backward) and, by noise level, more:
        0 collective counts; 1 also module types, parameter placements and ops on DTensors but the trivial ones;
        2 also ops on plain tensors; 3 every op."""
        helper = self.advanced_module_tracker.module_helper_dict
        table = ""
        for fqn, info in helper.items():
            depth = info["depth"]
            indent = "  " * (2 * depth)
            table += f"{indent}{fqn}\n"
            if noise_level > 0:
                if "module_type" in info:
                    table += f"{indent}*module type: {info['module_type']}\n"
                if "parameters" in info:
                    table += f"{indent}*Parameter List\n"
                    for param_name, placement in info["parameters"].items():
                        table += f"{indent} *{param_name}: {placement}\n"
            indent += "  "
            collective_indent = "  " * (2 * depth + 2)
            operation_indent = "  " * (2 * depth + 3)
            counts = self.comm_module_counts.get(fqn, _directions())
            forward, backward, recomputed = self._operations(fqn, noise_level)
            for title, collectives, operations in (("FORWARD PASS", counts["forward"], forward),
                                                   ("BACKWARD PASS", counts["backward"], backward),
                                                   ("ACTIVATION CHECKPOINTING", {}, recomputed)):
                if not collectives and not operations:
                    continue
                table += f"{indent}{title}\n"
                for collective, count in collectives.items():
                    table += f"{_YELLOW}{collective_indent}*{collective}: {count}{_RESET}\n"
                for operation in operations:
                    table += f"{_YELLOW}{collective_indent}**{operation['name']}{_RESET}\n"
                    if operation["input_shape"]:
                        table += f"{_RED}{operation_indent}shape: {operation['input_shape']}{_RESET}\n"
                        table += f"{_RED}{operation_indent}sharding: {operation['input_sharding']}{_RESET}\n"
                        table += f"{_RED}{operation_indent}device mesh: {operation['device_mesh']}{_RESET}\n"
        return table

    def log_comm_debug_tracing_table_to_file(self, file_name: str = "comm_mode_log.txt",
                                             noise_level: int = 3) -> None:
        """Write the tracing table to `file_name`, without its terminal colours."""
        with open(file_name, "w") as log_file:
            log_file.write(_ANSI_ESCAPE.sub("", self.generate_comm_debug_tracing_table(noise_level)))

    def generate_json_dump(self, file_name: str = "comm_mode_log.json", noise_level: int = 3) -> None:
        """Write the module tree with its collectives and (by noise level, as the table) operations as JSON:
        {"fqn", "module_type", "parameters", "children", "collectives_forward", "collectives_backward",
        "operations_forward", "operations_backward", "operations_checkpointing"}, from "Global" down."""
        with open(file_name, "w") as json_file:
            json.dump(self._json_node(GLOBAL, noise_level), json_file, indent=4)

    def _json_node(self, fqn: str, noise_level: int) -> dict[str, Any]:
        tracker = self.advanced_module_tracker
        info = tracker.module_helper_dict.get(fqn, {})
        counts = self.comm_module_counts.get(fqn, _directions())
        forward, backward, recomputed = (
            [self._json_operation(op) for op in ops] for ops in self._operations(fqn, noise_level))
        return {
            "fqn": fqn,
            "module_type": info.get("module_type", "") if noise_level > 0 else "",
            "parameters": list(info.get("parameters", {}).items()) if noise_level > 0 else [],
            "children": [self._json_node(child, noise_level) for child in tracker.parent_dict.get(fqn, [])],
            "collectives_forward": [(str(name), count) for name, count in counts["forward"].items()],
            "collectives_backward": [(str(name), count) for name, count in counts["backward"].items()],
            "operations_forward": forward,
            "operations_backward": backward,
            "operations_checkpointing": recomputed,
        }

    @staticmethod
    def _json_operation(operation: dict[str, Any]) -> dict[str, Any]:
        out = copy.copy(operation)
        out["name"] = str(operation["name"])
        out["input_shape"] = [str(shape) for shape in operation["input_shape"]]
        out["input_sharding"] = [str(placements) for placements in operation["input_sharding"]]
        return out

    def _operations(self, fqn: str, noise_level: int) -> tuple[list[dict], list[dict], list[dict]]:
        """The operations of module `fqn` the reports show at `noise_level`: (forward, backward, recomputed)."""
        if noise_level < 1:
            return [], [], []
        operations = self.comm_module_operation_counts.get(fqn, {"operations_list": []})["operations_list"]
        shown = [op for op in operations if (noise_level > 1 or op["input_sharding"])
                 and (noise_level > 2 or str(op["name"]) not in TRIVIAL_OPS)]
        return ([op for op in shown if not op["is_bw"]],
                [op for op in shown if op["is_bw"] and not op["is_activation_checkpointing"]],
                [op for op in shown if op["is_activation_checkpointing"]])
