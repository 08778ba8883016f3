"""async_save's writing in a process of its own (`AsyncCheckpointerType.PROCESS`, as TorchTitan's
"async_with_pinned_mem" mode asks for): the file writes, CRCs and the commit run outside the training process.

Layer: checkpoint.

Note: the checkpoint process
Each rank saving with PROCESS gets one daemon process per saving group, spawned by that group's first such save
(which so takes seconds longer: a Python with torch starting) and kept for the next ones. Each daemon reports
that it started (daemon 0 with its store's address, below), and the ranks exchange those reports before any
daemon joins a world: a daemon that dies starting (a script the spawn method re-imports without a `__main__`
guard, a broken environment) fails the save on every rank at once, naming it, where the others' daemons would
wait for it until the start timeout. The daemons of the group's ranks form a world of their own, of the group's
size, rank for rank: daemon 0 hosts its store (a TCPStore with a fresh token, on a free port of the address
spmd's tcp transport would publish for its host: SPMD_SOCKET_ADDR, ..., the route towards MASTER_ADDR, so
loopback for a one-host job launched on it), whose address, port and token the ranks' first background exchange
hands to the other ranks, each passing them to its daemon over its private pipe. A process saving alone
(no_dist) gets a daemon that joins no world. A save is planned and staged in the training process as on a thread
(api.py, Note: the save protocol, steps 1-2); then the plan, its staged boxes and the storage writer go to the
daemon over the pipe (torch's multiprocessing moves a staging buffer into shared memory the first time, and
later saves send the same pages again), and the daemon writes and commits with the other daemons (steps 3-6) and
answers with the metadata or the error. The writer must be picklable, as for torch's process checkpointer. A
daemon that dies fails its rank's save (its peers' exchanges fail naming it); the training process goes on, and
the next PROCESS save of the group fails at once, saying so.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import threading
import weakref
from multiprocessing.connection import Connection
from typing import Any

import torch.multiprocessing

from spmd._core.errors import CheckpointError
from spmd.comm.group import ProcessGroup
from spmd.comm.objects import all_gather_object

_START_TIMEOUT_S = 300.0      # a daemon's start: import torch and spmd, meet the others (as torch's init timeout)


class CheckpointProcess:
    """This rank's checkpoint daemon for one saving group (see Note: the checkpoint process), or for a process
    saving alone (`group` None: the daemon joins no world). Built on the group's background exchange thread;
    collective over `group`."""

    def __init__(self, group: ProcessGroup | None) -> None:
        self.group_rank = 0 if group is None else group.group_rank
        size = 0 if group is None else group.size()       # 0: alone
        context = torch.multiprocessing.get_context("spawn")
        self._pipe, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, self.group_rank, size),
                                        name=f"spmd-checkpoint-rank{self.group_rank}", daemon=True)
        self._process.start()
        child.close()            # the daemon's end lives in the daemon alone, so its death is an EOF here
        self._lock = threading.Lock()
        self._started = False
        weakref.finalize(self, _stop, self._pipe, self._process)
        if group is None:
            self._receive("start")
            self._started = True
            return
        address, failure = None, None
        try:
            address = self._receive("start")      # daemon 0: its store's address; the others: None
        except CheckpointError as error:          # every rank raises it, so none waits to meet this daemon
            failure = str(error)
        started = _all_gather((address, failure), group)
        failures = [failure for _, failure in started if failure is not None]
        if failures:
            raise CheckpointError("; ".join(failures))
        self._send(("join", *started[0][0]))
        self._receive("join the other ranks' checkpoint processes")
        self._started = True

    def write(self, plan: Any, writer: Any) -> Any:
        """Steps 3-6 of the save protocol for `plan` (api._SavePlan), run by the daemon; its metadata."""
        with self._lock:
            self._send(("save", dataclasses.replace(plan, group=None), writer))
            return self._receive("save")

    def _send(self, message: tuple) -> None:
        try:
            self._pipe.send(message)
        except (BrokenPipeError, ConnectionError, EOFError):
            raise self._dead() from None

    def _receive(self, what: str) -> Any:
        try:
            if not self._pipe.poll(_START_TIMEOUT_S if what != "save" else None):
                raise CheckpointError(f"rank {self.group_rank}'s checkpoint process (pid {self._process.pid}) "
                                      f"did not {what} within {_START_TIMEOUT_S:.0f}s")
            status, body = self._pipe.recv()
        except (EOFError, ConnectionError):
            raise self._dead() from None
        if status == "error":
            raise body if isinstance(body, CheckpointError) else CheckpointError(body)
        return body

    def _dead(self) -> CheckpointError:
        self._process.join(timeout=5)
        hint = ("" if self._started else "; its output above says why (a script the spawn start method re-imports "
                "must keep its code under `if __name__ == \"__main__\":`)")
        return CheckpointError(f"rank {self.group_rank}'s checkpoint process (pid {self._process.pid}) died (exit "
                               f"code {self._process.exitcode}); async_save with AsyncCheckpointerType.PROCESS "
                               f"can't write through it{hint}")


def _all_gather(value: Any, group: ProcessGroup) -> list[Any]:
    gathered: list[Any] = [None] * group.size()
    all_gather_object(gathered, value, group=group)
    return gathered


def _stop(pipe: Connection, process: Any) -> None:
    """Ask the daemon to leave its world and exit; kill it if it has not within 5 s."""
    try:
        pipe.send(("stop",))
    except (BrokenPipeError, ConnectionError, EOFError, OSError):
        pass
    process.join(timeout=5)
    if process.is_alive():
        process.kill()
        process.join()
    pipe.close()


def _serve(pipe: Connection, rank: int, size: int) -> None:
    """The daemon: host (rank 0) or reach the store, join the daemons' world (none when `size` is 0: saving
    alone), then write saves until told to stop or the training process is gone (its pipe closed)."""
    from spmd.checkpoint.api import _write_and_commit
    from spmd.comm.store.tcp import TCPStore
    from spmd.comm.transports.tcp.address import choose_address
    from spmd.comm.world import current_world, destroy_process_group, init_process_group

    group = None
    try:
        if size == 0:
            pipe.send(("ok", None))
            _write_saves(pipe, rank, None, _write_and_commit)
            return
        store = None
        if rank == 0:
            token = secrets.token_hex(16)
            reachable = choose_address(os.environ.get("MASTER_ADDR")).address
            store = TCPStore(reachable, 0, is_master=True, wait_for_workers=False, token=token,
                             timeout=_START_TIMEOUT_S)
            pipe.send(("ok", (reachable, store.port, token)))
        else:
            pipe.send(("ok", None))
        message = pipe.recv()
        if message[0] == "stop":       # another rank's daemon could not start
            return
        _, host, port, token = message
        if store is None:
            store = TCPStore(host, port, token=token, timeout=_START_TIMEOUT_S)
        init_process_group("auto", store=store, rank=rank, world_size=size, timeout=_START_TIMEOUT_S,
                                torch_default_group=False)
        group = current_world().default_group
        pipe.send(("ok", None))
    except BaseException as error:
        pipe.send(("error", f"rank {rank}'s checkpoint process could not start: {type(error).__name__}: {error}"))
        return
    try:
        _write_saves(pipe, rank, group, _write_and_commit)
    finally:
        destroy_process_group()


def _write_saves(pipe: Connection, rank: int, group: Any, write_and_commit: Any) -> None:
    """The daemon's loop: each request's steps 3-6, answered with the metadata or the error's text."""
    while True:
        try:
            message = pipe.recv()
        except EOFError:
            return           # the training process is gone
        if message[0] == "stop":
            return
        _, plan, writer = message
        try:
            pipe.send(("ok", write_and_commit(plan, writer, group)))
        except Exception as error:       # a CheckpointError as itself (its failures by rank), others as text
            pipe.send(("error", error if isinstance(error, CheckpointError)
                       else f"rank {rank}'s checkpoint process: {type(error).__name__}: {error}"))
        del plan, writer, message
