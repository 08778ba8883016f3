"""The layering of spmd stays true: each layer imports only those below it (see STYLE.md, rule 2)."""

from __future__ import annotations

import ast
import pathlib

ALLOWED: dict[str, set[str]] = {
    "_core": set(),
    "comm": {"_core"},
    "device_mesh": {"_core", "comm"},
    "tensor": {"_core", "comm", "device_mesh"},
    "tensor.parallel": {"_core", "comm", "device_mesh", "tensor"},
    "ddp": {"_core", "comm", "device_mesh"},
    "fsdp": {"_core", "comm", "device_mesh", "tensor"},
    "pipelining": {"_core", "comm", "device_mesh", "tensor"},
    "amp": {"_core", "comm", "device_mesh", "tensor"},
    "checkpoint": {"_core", "comm", "device_mesh", "tensor", "tensor.parallel", "ddp", "fsdp"},
    "run": {"_core", "comm"},
    "testing": {"_core", "comm", "device_mesh", "tensor", "tensor.parallel", "ddp", "fsdp", "pipelining", "amp",
                "checkpoint", "run"},
}
SRC = pathlib.Path(__file__).parents[1] / "src" / "spmd"


def component(dotted: str) -> str | None:
    """'spmd.tensor.parallel.style' -> 'tensor.parallel' (longest matching key)."""
    parts = dotted.split(".")[1:]
    if not dotted.startswith("spmd.") and dotted != "spmd":
        return None
    return next((".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in ALLOWED), None)


def imports_of(path: pathlib.Path) -> list[tuple[str, int]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: use absolute imports"
            found.append((node.module or "", node.lineno))
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
            assert target != "spmd", f"{here}:{line} imports the facade; import the defining module"
            if target.startswith("torch.distributed"):
                assert path.name == "torch_pg.py", f"{here}:{line} imports {target}"
            src, dst = component(here), component(target)
            if src and dst and src != dst:
                assert dst in ALLOWED[src], f"{here}:{line} ({src}) must not import {target} ({dst})"
    assert checked > 0


def test_no_module_imports_testing() -> None:
    for path in SRC.rglob("*.py"):
        if "testing" in path.relative_to(SRC).parts:
            continue
        for target, line in imports_of(path):
            assert not target.startswith("spmd.testing"), f"{path}:{line} imports spmd.testing"
