"""A job for tests/checkpoint/test_save_process.py, run by spmdrun on 2 ranks: async saves whose writing runs in
a checkpoint process (AsyncCheckpointerType.PROCESS), as TorchTitan's "async_with_pinned_mem" mode makes them;
each rank pickles what it saw to <root>/rank<R>.pt."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
from typing import Any

import torch

import spmd
import spmd.checkpoint as dcp
from spmd.checkpoint.staging import DefaultStager, StagingOptions
from spmd.checkpoint.state_dict_saver import AsyncCheckpointerType
from spmd.device_mesh import init_device_mesh
from spmd.tensor import Shard, distribute_tensor

PROCESS = AsyncCheckpointerType.PROCESS
BREAK_DAEMON = "PROCESS_SAVE_JOB_BREAK_DAEMON"

if __name__ == "__mp_main__" and os.environ.get(BREAK_DAEMON) == "1":
    sys.exit(3)          # a checkpoint daemon re-importing this script dies starting, as a broken one would


def state(step: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (spmd.get_world_size(),))
    weight = distribute_tensor(torch.arange(24.0).reshape(6, 4) * step, mesh, [Shard(0)])
    return {"model": {"weight": weight, "bias": torch.full((3,), float(step))}, "step": step}


def loaded(path: str) -> dict[str, Any]:
    into = state(0)
    dcp.load(into, checkpoint_id=path)
    return {"weight": into["model"]["weight"].full_tensor(), "bias": into["model"]["bias"], "step": into["step"]}


def daemon_pids() -> list[int]:
    return [child.pid for child in multiprocessing.active_children() if child.name.startswith("spmd-checkpoint")]


def main(root: str) -> None:
    spmd.init_process_group()
    rank, seen = spmd.get_rank(), {}
    try:
        first = state(1)
        seen["thread"] = type(dcp.async_save(first, checkpoint_id=f"{root}/thread").result()).__name__
        seen["process"] = type(dcp.async_save(first, checkpoint_id=f"{root}/process",
                                              async_checkpointer_type=PROCESS).result()).__name__
        second = state(2)
        response = dcp.async_save(second, checkpoint_id=f"{root}/pinned", async_checkpointer_type=PROCESS,
                                  async_stager=DefaultStager(StagingOptions(True, True, True, True)))
        response.staging_completion.result()
        second["model"]["weight"]._local_tensor.fill_(-1.0)   # the optimizer step after staging
        response.upload_completion.result()
        seen.update({kind: loaded(f"{root}/{kind}") for kind in ("thread", "process", "pinned")})
        seen["daemons"] = daemon_pids()
        if rank == 1:
            for pid in seen["daemons"]:
                os.kill(pid, signal.SIGKILL)
        spmd.barrier()
        try:
            dcp.async_save(state(3), checkpoint_id=f"{root}/after_kill", async_checkpointer_type=PROCESS).result()
            seen["after_kill"] = "saved"
        except dcp.CheckpointError as error:
            seen["after_kill"] = str(error)
        dcp.async_save(state(3), checkpoint_id=f"{root}/thread_after_kill").result()
        seen["after_kill_on_a_thread"] = loaded(f"{root}/thread_after_kill")
        alone = {"w": torch.arange(5.0) + rank}               # no_dist: a daemon that joins no world
        dcp.async_save(alone, checkpoint_id=f"{root}/alone{rank}", no_dist=True,
                       async_checkpointer_type=PROCESS).result()
        alone["w"].zero_()
        dcp.load(alone, checkpoint_id=f"{root}/alone{rank}", no_dist=True)
        seen["alone"] = alone["w"]
        pair = spmd.new_group([0, 1])                         # its saves get daemons of their own
        if rank == 1:
            os.environ[BREAK_DAEMON] = "1"
        began = time.monotonic()
        try:
            dcp.async_save(state(4), checkpoint_id=f"{root}/daemon_broken", process_group=pair,
                           async_checkpointer_type=PROCESS).result()
            seen["daemon_broken"] = "saved"
        except dcp.CheckpointError as error:
            seen["daemon_broken"] = str(error)
        seen["daemon_broken_after_s"] = time.monotonic() - began
    finally:
        torch.save(seen, f"{root}/rank{rank}.pt")
        spmd.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
