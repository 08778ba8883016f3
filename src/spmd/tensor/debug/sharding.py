"""visualize_sharding (torch's tensor.debug.visualize_sharding): which ranks hold which block of a DTensor.

Layer: tensor. Pure metadata: the table comes from the spec's shard arithmetic for every mesh coordinate, so
nothing is communicated and any number of tensor dims is shown (torch's draws 1-D and 2-D only).
"""

from __future__ import annotations

import itertools

from spmd.tensor.api import DTensor
from spmd.tensor.placement import Partial


def sharding_table(dtensor: DTensor) -> list[tuple[str, list[int]]]:
    """(block, global ranks holding it) per distinct block, in the order of the blocks' offsets; a block reads
    "0:4, 0:6" (a half-open range per tensor dim)."""
    spec, mesh = dtensor._spec, dtensor.device_mesh
    holders: dict[tuple[tuple[int, int], ...], list[int]] = {}
    for coordinate in itertools.product(*(range(n) for n in mesh.shape)):
        shape, offset = spec.local_shape_and_offset(list(coordinate))
        block = tuple((start, start + length) for start, length in zip(offset, shape))
        holders.setdefault(block, []).append(int(mesh.mesh[coordinate].item()))
    return [(", ".join(f"{lo}:{hi}" for lo, hi in block) or "scalar", sorted(ranks))
            for block, ranks in sorted(holders.items())]


def visualize_sharding(dtensor: DTensor, header: str = "", use_rich: bool = False) -> str | None:
    """Print (and return) the table of which ranks hold which block of `dtensor`, on the mesh's first rank
    only (the others return None, as torch prints once). `use_rich` is accepted for torch's signature; the
    table is plain text."""
    mesh = dtensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None or any(coordinate) or dtensor.numel() == 0:
        return None
    rows = sharding_table(dtensor)
    width = max(len("block"), *(len(block) for block, _ in rows))
    partial = [f"mesh dim {i}" for i, p in enumerate(dtensor.placements) if isinstance(p, Partial)]
    lines = [header] if header else []
    lines.append(f"{tuple(dtensor.shape)} {list(dtensor.placements)} on mesh {list(mesh.shape)}"
                 + (f" (each block a partial sum over {', '.join(partial)})" if partial else ""))
    lines.append(f"{'block':<{width}}  ranks")
    lines.extend(f"{block:<{width}}  {', '.join(map(str, ranks))}" for block, ranks in rows)
    text = "\n".join(lines)
    print(text)
    return text
