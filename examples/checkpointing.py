"""The trainer's checkpoints: all a run needs to continue exactly (model, optimizer, step, RNG), saved in the
background every K steps as <dir>/step-<N>, and the newest complete one found again on resume, under any layout.

Note: what a checkpoint holds
- "model" and "optimizer": the state dicts of spmd.checkpoint.state_dict, keyed by the plain model's parameter
  names whatever the layout (DDP's wrapper dropped; FSDP and TP values are DTensors, each rank saving its shard;
  a pipeline rank holds its stages' names only). The optimizer's state is in the flat form ("state.<fqn>.exp_avg",
  "param_groups.<fqn>.lr"), which names each parameter's hyperparameters by the parameter, so that a layout that
  groups the parameters differently (DTensors apart from plain tensors) loads it. Loading reads, on each rank,
  the boxes of the saved shards that its own pieces overlap: that is what lets a checkpoint saved by FSDP on 2
  ranks resume as TP on 4.
- "trainer": the number of steps done (the learning rate and the data position are functions of it: the global
  batch of step s is drawn from a generator seeded by s), the world size, layout and global batch it was saved
  under (a resume with another global batch continues, but no longer as the saved run would have).
- "rng": every rank's torch RNG state, restored when the world size is the one saved (a rank of another layout
  has no counterpart to take it from; the GPT draws no random numbers while training, so only models that add
  dropout would notice).
A save is complete when its metadata.json exists (written last, by rename, after every rank's data file):
resume skips a directory without it, such as one a killed job left half written.
"""

from __future__ import annotations

import concurrent.futures
import pathlib
import re
import shutil
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import spmd
import spmd.checkpoint as dcp
from spmd.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

STEP_DIR = re.compile(r"step-(\d+)")
METADATA = "metadata.json"
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def complete_checkpoints(directory: str | pathlib.Path) -> list[tuple[int, pathlib.Path]]:
    """(step, path) of every complete checkpoint under `directory`, oldest first."""
    root = pathlib.Path(directory)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = STEP_DIR.fullmatch(path.name)
        if match and (path / METADATA).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


class Checkpointer:
    """Saves and restores one run's state in `directory`, every `every` steps (0: at the run's end only), keeping
    the newest `keep` complete checkpoints (0: all). `model` gives the module whose state to save, with the plain
    model's parameter names (asked at each save and restore: ParallelGPT.state_module reshards FSDP's parameters
    there)."""

    def __init__(self, directory: str | pathlib.Path, every: int, model: Callable[[], nn.Module],
                 optimizer: torch.optim.Optimizer, describe_layout: str, global_batch: int, keep: int = 0) -> None:
        if every < 0:
            raise ValueError(f"--checkpoint-every must be >= 0, got {every}")
        if keep < 0:
            raise ValueError(f"--keep-checkpoints must be >= 0, got {keep}")
        self.directory, self.every, self.keep = pathlib.Path(directory), every, keep
        self.model, self.optimizer, self.layout, self.global_batch = model, optimizer, describe_layout, global_batch
        self.pending: concurrent.futures.Future[dcp.Metadata] | None = None
        self.saved_steps: list[int] = []

    def due(self, steps_done: int, last_step: int) -> bool:
        """Whether to checkpoint after `steps_done` steps: every `every` steps, and at the run's last step."""
        return steps_done == last_step or (self.every > 0 and steps_done % self.every == 0)

    def _state(self, steps_done: int, with_rng: bool) -> dict[str, Any]:
        model_state, optimizer_state = get_state_dict(self.model(), self.optimizer, options=_OPTIONS)
        state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state,
                                 "trainer": {"step": steps_done, "world_size": spmd.get_world_size(),
                                             "layout": self.layout, "global_batch": self.global_batch}}
        if with_rng:
            state["rng"] = {f"rank{spmd.get_rank()}": torch.get_rng_state()}
        return state

    def save(self, steps_done: int) -> None:
        """Start writing the state after `steps_done` steps to step-<N> (collective). Returns once this rank's
        tensors are copied to host memory; the previous save is waited for first, so that its errors surface."""
        self.wait()
        path = self.directory / f"step-{steps_done:06d}"
        self.pending = dcp.async_save(self._state(steps_done, with_rng=True), checkpoint_id=path)
        self.saved_steps.append(steps_done)

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; raises its error. Then rank 0 removes what the
        retention leaves out (see prune)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()
            if self.keep and spmd.get_rank() == 0:
                self.prune()

    def prune(self) -> None:
        """Remove every complete checkpoint but the newest `keep`, and the half-written directories older than the
        newest complete one (a killed job's); only once a newer save is committed, so a resume always finds one."""
        complete = complete_checkpoints(self.directory)
        if not complete:
            return
        newest = complete[-1][0]
        doomed = [path for _, path in complete[:-self.keep]]
        doomed += [path for path in self.directory.iterdir() if (match := STEP_DIR.fullmatch(path.name))
                   and int(match.group(1)) < newest and not (path / METADATA).is_file()]
        for path in doomed:
            shutil.rmtree(path, ignore_errors=True)   # a shared directory: another job's rank may be at it too

    def resume(self) -> dict[str, Any] | None:
        """Restore the newest complete checkpoint; its "trainer" entry (steps done, and the world size, layout
        and global batch it was saved under), or None when there is none (a fresh run). Every rank must call it;
        ranks agree on which checkpoint (rank 0's view of the directory, broadcast) so that a save completing
        meanwhile can't split them."""
        found = complete_checkpoints(self.directory)
        choice = [str(found[-1][1]) if found else None]
        spmd.broadcast_object_list(choice, src=0)
        if choice[0] is None:
            return None
        path = pathlib.Path(choice[0])
        saved = {"trainer": {"step": 0, "world_size": 0, "layout": "", "global_batch": 0}}
        dcp.load(saved, checkpoint_id=path)              # values only: reads the metadata
        trainer = saved["trainer"]
        state = self._state(trainer["step"], with_rng=trainer["world_size"] == spmd.get_world_size())
        dcp.load(state, checkpoint_id=path)
        set_state_dict(self.model(), self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=_OPTIONS)
        if "rng" in state:
            torch.set_rng_state(state["rng"][f"rank{spmd.get_rank()}"])
        return trainer
