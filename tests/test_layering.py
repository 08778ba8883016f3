"""The layering of spmd stays true: each layer imports only those below it (see STYLE.md, rule 2).

Between components (comm, device_mesh, tensor, ...) the ALLOWED table rules. Inside the comm layer, the public
edge (world, group, collectives, p2p, objects, functional) sits on top of the transports, and the transports
sit on the reduction kernels, work/debug, the stores and `_core`; the stores sit on `_core` alone (INSIDE_COMM).
Inside the checkpoint layer only `checkpoint.state_dict` may know the layer-4 parallelisms (EXCEPTIONS).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ALLOWED: dict[str, set[str]] = {
    "_core": set(),
    "_autograd": set(),   # autograd plumbing (imports torch only) shared by ddp and fsdp
    "comm": {"_core"},
    "device_mesh": {"_core", "comm"},
    "tensor": {"_core", "comm", "device_mesh"},
    "tensor.parallel": {"_core", "comm", "device_mesh", "tensor"},
    "ddp": {"_core", "_autograd", "comm", "device_mesh", "tensor"},
    "fsdp": {"_core", "_autograd", "comm", "device_mesh", "tensor"},
    "pipelining": {"_core", "comm", "device_mesh", "tensor"},
    "amp": {"_core", "comm", "device_mesh", "tensor"},
    "rpc": {"_core", "comm"},
    "autograd": {"_core", "comm", "rpc"},
    "optim": {"_core", "_autograd", "comm", "device_mesh", "tensor", "rpc"},
    "nn": {"_core", "comm", "rpc"},
    "checkpoint": {"_core", "comm", "device_mesh", "tensor"},
    "accumulation": {"_core", "_autograd", "comm", "device_mesh", "tensor", "ddp", "fsdp"},
    "_tools": {"_core", "comm", "tensor", "fsdp"},   # memory trackers: FSDPMemTracker hooks fsdp's state changes
    "run": {"_core", "comm"},
    "testing": {"_core", "_autograd", "comm", "device_mesh", "tensor", "tensor.parallel", "ddp", "fsdp",
                "pipelining", "amp", "optim", "checkpoint", "run", "rpc"},
    # aliases at torch's module paths: each sits in the layer of what it re-exports
    "distributed_c10d": {"_core", "comm"},
    "constants": {"_core", "comm"},
    "collective_utils": {"_core", "comm"},
    "utils": {"_core", "comm"},
    "_functional_collectives": {"_core", "comm", "device_mesh", "nn"},
    "_tensor": {"_core", "comm", "device_mesh", "tensor"},
    "_state_dict_utils": {"_core", "comm", "device_mesh", "tensor"},
    "tensor.experimental._attention": {"_core", "comm", "device_mesh", "tensor", "tensor.parallel"},
    "tensor.experimental._context_parallel": {"_core", "comm", "device_mesh", "tensor", "tensor.parallel"},
    "_composable": {"_core", "_autograd", "comm", "device_mesh", "tensor", "ddp", "fsdp"},
    "algorithms": {"_core", "_autograd", "comm", "device_mesh", "ddp", "fsdp", "optim"},
    "elastic": {"_core", "comm", "run"},
    "launch": {"_core", "comm", "run"},
    "launcher": {"_core", "comm", "run"},
    "debug": {"_core", "comm"},   # torch.distributed.debug's path: rank 0's status page
}
LAYER_4 = {"tensor.parallel", "ddp", "fsdp", "pipelining", "amp", "optim"}
EXCEPTIONS: dict[str, set[str]] = {"spmd.checkpoint.state_dict": ALLOWED["checkpoint"] | LAYER_4}

# Inside comm: module prefix -> the comm modules (prefixes) it may import besides its own part and `_core`.
_BELOW_TRANSPORTS = {"spmd.comm.reduce_op", "spmd.comm.work", "spmd.comm.debug", "spmd.comm.store"}
INSIDE_COMM: dict[str, set[str]] = {
    "spmd.comm.store": set(),
    "spmd.comm.reduce_op": set(),
    "spmd.comm.debug": {"spmd.comm.store", "spmd.comm.work"},
    "spmd.comm.work": {"spmd.comm.debug"},
    "spmd.comm.transports": _BELOW_TRANSPORTS,
}
TORCH_DISTRIBUTED_MODULES = ("torch_pg.py", "torch_backend.py")
SRC = pathlib.Path(__file__).parents[1] / "src" / "spmd"


def component(dotted: str) -> str | None:
    """'spmd.tensor.parallel.style' -> 'tensor.parallel' (longest matching key)."""
    parts = dotted.split(".")[1:]
    if not dotted.startswith("spmd.") and dotted != "spmd":
        return None
    return next((".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in ALLOWED), None)


def _part_of(dotted: str, prefix: str) -> bool:
    return dotted == prefix or dotted.startswith(prefix + ".")


def violation(here: str, target: str, filename: str) -> str | None:
    """Why module `here` (in file `filename`) must not import `target`, or None when it may."""
    if target == "spmd":
        return "imports the facade; import the defining module"
    if target.startswith(("torch.distributed", "torch.nn.parallel")) and filename not in TORCH_DISTRIBUTED_MODULES:
        return f"imports {target}; only {TORCH_DISTRIBUTED_MODULES} may"
    src, dst = component(here), component(target)
    if src and dst and src != dst:
        allowed = EXCEPTIONS.get(here, ALLOWED[src])
        if dst not in allowed:
            return f"({src}) must not import {target} ({dst})"
    if src == dst == "comm":
        rule = next((prefix for prefix in INSIDE_COMM if _part_of(here, prefix)), None)
        if rule is not None and not _part_of(target, rule) and target != "spmd.comm":
            if not any(_part_of(target, below) for below in INSIDE_COMM[rule]):
                return f"({rule}) must not import {target}; it may import {sorted(INSIDE_COMM[rule])} and _core"
    return None


def imports_of(path: pathlib.Path) -> list[tuple[str, int]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: use absolute imports"
            found.append((node.module or "", node.lineno))
            if node.module == "spmd.comm":   # `from spmd.comm import x`: x is a module of comm
                found.extend((f"spmd.comm.{alias.name}", node.lineno) for alias in node.names)
        elif isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno) for alias in node.names)
    return found


def test_layers_point_down() -> None:
    checked = 0
    for path in SRC.rglob("*.py"):
        here = ".".join(("spmd", *path.relative_to(SRC).with_suffix("").parts)).removesuffix(".__init__")
        if here == "spmd":
            continue   # the facade re-exports; nothing imports it
        for target, line in imports_of(path):
            checked += 1
            why = violation(here, target, path.name)
            assert why is None, f"{here}:{line} {why}"
    assert checked > 0


@pytest.mark.parametrize(("here", "target", "filename"), [
    ("spmd.comm.group", "spmd.tensor.api", "group.py"),                            # upward across layers
    ("spmd.run.agent", "spmd.tensor.api", "agent.py"),                             # the launcher never knows DTensor
    ("spmd.tensor.api", "spmd.tensor.parallel.style", "api.py"),                   # tensor below tensor.parallel
    ("spmd.ddp.api", "spmd.fsdp.api", "api.py"),                                   # siblings in layer 4
    ("spmd.checkpoint.api", "spmd.fsdp.api", "api.py"),                            # only state_dict knows layer 4
    ("spmd.comm.transports.tcp.transport", "spmd.comm.group", "transport.py"),     # transports below the edge
    ("spmd.comm.transports.threads", "spmd.comm.world", "threads.py"),
    ("spmd.comm.store.tcp", "spmd.comm.transports.base", "tcp.py"),                # stores know only _core
    ("spmd.comm.store.file", "spmd.comm.debug", "file.py"),
    ("spmd.comm.debug", "spmd.comm.group", "debug.py"),
    ("spmd.comm.group", "torch.distributed", "group.py"),                          # torch.distributed: 2 modules
    ("spmd.tensor.api", "spmd", "api.py"),                                         # never the facade
    ("spmd._tensor", "spmd.tensor.parallel.style", "__init__.py"),                 # aliases keep their layer
    ("spmd.distributed_c10d", "spmd.ddp.api", "distributed_c10d.py"),
])
def test_violations_are_caught(here: str, target: str, filename: str) -> None:
    assert violation(here, target, filename) is not None


@pytest.mark.parametrize(("here", "target", "filename"), [
    ("spmd.checkpoint.state_dict", "spmd.fsdp.api", "state_dict.py"),
    ("spmd.comm.transports.shm.hierarchical", "spmd.comm.transports.tcp.transport", "hierarchical.py"),
    ("spmd.comm.transports.threads", "spmd.comm.reduce_op", "threads.py"),
    ("spmd.comm.transports.base", "spmd.comm.store.base", "base.py"),
    ("spmd.comm.group", "spmd.comm.transports.base", "group.py"),
    ("spmd.comm.store.tcp", "spmd.comm.store.tcp_wire", "tcp.py"),
    ("spmd.comm.transports.torch_pg", "torch.distributed", "torch_pg.py"),
    ("spmd.comm.torch_backend", "torch.distributed", "torch_backend.py"),
])
def test_allowed_imports_pass(here: str, target: str, filename: str) -> None:
    assert violation(here, target, filename) is None


def test_no_module_imports_testing() -> None:
    for path in SRC.rglob("*.py"):
        if "testing" in path.relative_to(SRC).parts:
            continue
        for target, line in imports_of(path):
            assert not target.startswith("spmd.testing"), f"{path}:{line} imports spmd.testing"
