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
