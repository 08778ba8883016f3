"""Checkpoints at fsspec URLs: a checkpoint_id that is a URL goes through FsspecWriter / FsspecReader (as torch's
DCP picks its fsspec storage), here on fsspec's in-memory filesystem and on file:// URLs; FSDP2 on 4 ranks loads
bit-exact into TP on 2 from memory://; a second save replaces the first's files; a save that did not finish is
reported; torch's private module path
serves the classes. Thread ranks."""

from __future__ import annotations

import os

import fsspec
import pytest
import torch

import spmd.checkpoint as dcp
from spmd._core.errors import CheckpointError
from spmd.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from tests.checkpoint.test_api import _assert_identical, _load_into, _save_trained


@pytest.fixture()
def memory_url(tmp_path) -> str:
    url = f"memory://spmd-tests/{tmp_path.name}"
    yield url
    fs = fsspec.filesystem("memory")
    if fs.exists(url):
        fs.rm(url, recursive=True)


def test_fsdp_on_4_ranks_loads_bit_exact_into_tp_on_2_through_memory(memory_url: str) -> None:
    saved = _save_trained("fsdp", memory_url)
    names = [e.rsplit("/", 1)[-1] for e in fsspec.filesystem("memory").ls(memory_url, detail=False)]
    assert "metadata.json" in names and sum(n.endswith(".safetensors") for n in names) == 4
    _assert_identical(_load_into("tp", memory_url), saved)


def test_a_file_url_is_the_same_checkpoint_as_its_directory(tmp_path) -> None:
    state = {"w": torch.arange(12.0).reshape(3, 4), "step": 3}
    dcp.save(state, checkpoint_id=f"file://{tmp_path}/ckpt")
    assert os.path.exists(tmp_path / "ckpt" / "metadata.json")
    for source in (f"file://{tmp_path}/ckpt", str(tmp_path / "ckpt")):
        loaded = {"w": torch.zeros(3, 4), "step": 0}
        dcp.load(loaded, checkpoint_id=source)
        assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 3
    assert FsspecWriter.validate_checkpoint_id("s3://bucket/x") and not FsspecReader.validate_checkpoint_id("/x")


def test_a_save_that_did_not_finish_is_reported(memory_url: str) -> None:
    dcp.save({"w": torch.zeros(4)}, checkpoint_id=memory_url)
    dcp.save({"w": torch.ones(4)}, checkpoint_id=memory_url)       # replaces the first: its data file goes
    fsspec.filesystem("memory").rm(f"{memory_url}/metadata.json")
    with pytest.raises(CheckpointError, match=r"is incomplete: it has no metadata.json, and 1 data files"):
        dcp.load({"w": torch.zeros(4)}, checkpoint_id=memory_url)
    with pytest.raises(CheckpointError, match=r"no such directory"):
        dcp.load({"w": torch.zeros(4)}, checkpoint_id=f"{memory_url}-missing")
