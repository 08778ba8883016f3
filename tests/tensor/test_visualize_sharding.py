"""visualize_sharding: the blocks it shows are the pieces the ranks really hold, printed once per mesh."""

from __future__ import annotations

import pytest
import torch

from spmd.tensor import Partial, Replicate, Shard, distribute_tensor
from spmd.tensor.debug import sharding_table, visualize_sharding
from tests.tensor.conftest import placement_combos, run_on_mesh


def test_every_block_shown_is_what_its_ranks_hold() -> None:
    full = torch.arange(7 * 6 * 5.0).reshape(7, 6, 5)

    def body(mesh) -> list[tuple[int, list[tuple[str, list[int]]], torch.Tensor]]:
        out = []
        for placements in placement_combos(3, mesh.ndim, partial=False):
            x = distribute_tensor(full, mesh, list(placements))
            out.append((mesh.get_rank(), sharding_table(x), x.to_local()))
        return out

    per_rank = run_on_mesh((2, 2), body)
    for layout in range(len(per_rank[0])):
        table = per_rank[0][layout][1]
        assert sorted(rank for _, ranks in table for rank in ranks) == [0, 1, 2, 3]
        for block, ranks in table:
            index = tuple(slice(*map(int, extent.split(":"))) for extent in block.split(", "))
            for rank in ranks:
                assert per_rank[rank][layout][1] == table
                assert torch.equal(per_rank[rank][layout][2], full[index]), (block, rank)


def test_printed_on_the_meshs_first_rank_only(capsys: pytest.CaptureFixture[str]) -> None:
    def body(mesh) -> str | None:
        visualize_sharding(distribute_tensor(torch.zeros(0), mesh, [Shard(0), Replicate()]))   # empty: nothing
        return visualize_sharding(distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0), Partial()]), header="w")

    texts = run_on_mesh((2, 2), body)
    assert texts[1:] == [None, None, None]
    assert texts[0] == ("w\n(8, 4) [Shard(0), Partial()] on mesh [2, 2] (each block a partial sum over mesh "
                        "dim 1)\nblock     ranks\n0:4, 0:4  0, 1\n4:8, 0:4  2, 3")
    assert capsys.readouterr().out == texts[0] + "\n"
