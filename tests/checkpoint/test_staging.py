"""async_save's stagers (torch's checkpoint.staging): DefaultStager stages in the background and async_save returns
an AsyncSaveResponse at once; blocking staging returns a Future; a stager of the user's stages the state dict
itself; each writes the values of the moment of staging; errors reach both futures; a process checkpointer is
refused."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import pytest
import torch

import spmd.checkpoint as dcp
from spmd.checkpoint.metadata import METADATA_FILE
from spmd.checkpoint.staging import AsyncStager, BlockingAsyncStager, DefaultStager, StagingOptions
from spmd.checkpoint.state_dict_saver import AsyncSaveResponse
from spmd.device_mesh import init_device_mesh
from spmd.tensor import Shard, distribute_tensor
from spmd.testing import run_ranks

TIMEOUT = 60


def _loaded(path: str, mesh: Any) -> tuple[list[float], int]:
    target = distribute_tensor(torch.zeros(6), mesh, [Shard(0)])
    state = {"w": target, "step": -1}
    dcp.load(state, checkpoint_id=path)
    return target.full_tensor().tolist(), state["step"]


def test_default_stager_returns_at_once_and_writes_what_was_there_at_staging(tmp_path) -> None:
    def body(rank: int, size: int) -> list:
        mesh = init_device_mesh("cpu", (size,))
        weight = distribute_tensor(torch.arange(6.0), mesh, [Shard(0)])
        stager = DefaultStager()
        first = dcp.async_save({"w": weight, "step": 1}, checkpoint_id=str(tmp_path / "a"), async_stager=stager)
        assert isinstance(first, AsyncSaveResponse)
        first.staging_completion.result(timeout=TIMEOUT)
        weight.to_local().add_(10)                               # the optimizer step, once staging is done
        second = dcp.async_save({"w": weight, "step": 2}, checkpoint_id=str(tmp_path / "b"), async_stager=stager)
        second.staging_completion.result(timeout=TIMEOUT)        # waited for the first to finish writing
        weight.to_local().add_(10)
        metadata = [first.upload_completion.result(timeout=TIMEOUT), second.upload_completion.result(TIMEOUT)]
        stager.close()
        assert [m.values for m in metadata] == [{"step": 1}, {"step": 2}]
        return [_loaded(str(tmp_path / "a"), mesh), _loaded(str(tmp_path / "b"), mesh)]

    for first, second in run_ranks(body, 2, timeout=TIMEOUT):
        assert first == ([0.0, 1.0, 2.0, 3.0, 4.0, 5.0], 1)
        assert second == ([10.0, 11.0, 12.0, 13.0, 14.0, 15.0], 2)


@pytest.mark.parametrize("stager", [DefaultStager(StagingOptions(use_async_staging=False)), BlockingAsyncStager()],
                         ids=["default-blocking", "blocking"])
def test_blocking_stagers_return_a_future_once_the_copy_is_made(tmp_path, stager: AsyncStager) -> None:
    def body(rank: int, size: int) -> tuple:
        mesh = init_device_mesh("cpu", (size,))
        weight = distribute_tensor(torch.arange(6.0), mesh, [Shard(0)])
        future = dcp.async_save({"w": weight, "step": 5}, checkpoint_id=str(tmp_path / "c"), async_stager=stager)
        assert isinstance(future, concurrent.futures.Future)
        weight.to_local().add_(10)                               # at once: the copy is already made
        future.result(timeout=TIMEOUT)
        return _loaded(str(tmp_path / "c"), mesh)

    for got in run_ranks(body, 2, timeout=TIMEOUT):
        assert got == ([0.0, 1.0, 2.0, 3.0, 4.0, 5.0], 5)


class _Recording(AsyncStager):
    """A user's stager: doubles every tensor it stages (so the checkpoint shows it was used), in the background
    when asked."""

    def __init__(self, background: bool) -> None:
        self.background = background
        self._synchronize_after_execute = not background
        self.synchronized = 0

    def stage(self, state_dict: dict[str, Any]) -> Any:
        staged = {key: value * 2 if isinstance(value, torch.Tensor) else value for key, value in state_dict.items()}
        if not self.background:
            return staged
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(staged)
        return future

    def synchronize_staging(self) -> None:
        self.synchronized += 1


@pytest.mark.parametrize("background", [False, True])
def test_a_users_stager_stages_the_state_dict_itself(tmp_path, background: bool) -> None:
    def body(rank: int, size: int) -> tuple:
        mesh = init_device_mesh("cpu", (size,))
        stager = _Recording(background)
        weight = distribute_tensor(torch.arange(6.0), mesh, [Shard(0)])
        result = dcp.async_save({"w": weight, "step": 7}, checkpoint_id=str(tmp_path / "d"), async_stager=stager)
        upload = result.upload_completion if background else result
        assert isinstance(result, AsyncSaveResponse) == background
        upload.result(timeout=TIMEOUT)
        return _loaded(str(tmp_path / "d"), mesh), stager.synchronized

    for got, synchronized in run_ranks(body, 2, timeout=TIMEOUT):
        assert got == ([0.0, 2.0, 4.0, 6.0, 8.0, 10.0], 7) and synchronized == (0 if background else 1)


def test_errors_reach_both_futures(tmp_path) -> None:
    response = dcp.async_save({"bad": object()}, checkpoint_id=str(tmp_path / "e"), async_stager=DefaultStager(),
                              no_dist=True)
    for future in (response.staging_completion, response.upload_completion):
        with pytest.raises(Exception, match="bad"):
            future.result(timeout=TIMEOUT)
    assert not (tmp_path / "e" / METADATA_FILE).exists()


def test_a_stager_alone_makes_a_copy() -> None:
    state = {"w": torch.arange(3.0), "n": 4}
    for stager in (DefaultStager(), DefaultStager(StagingOptions(use_async_staging=False)), BlockingAsyncStager()):
        staged = stager.stage(state)
        staged = staged.result(timeout=TIMEOUT) if isinstance(staged, concurrent.futures.Future) else staged
        state["w"].add_(1)
        assert staged["w"].tolist() == [float(i) for i in range(3)] and staged["n"] == 4
        state["w"].sub_(1)
        stager.close()
