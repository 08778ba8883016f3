"""spmd.breakpoint (torch's dist.breakpoint): stop one rank in pdb while the other ranks wait for it.

Layer: comm. The rank named opens pdb on its standard input: spmdrun gives every worker its own stdin, as
torchrun does, so the terminal spmdrun was started from reaches it (and the pdb prompt comes back through
the rank-prefixed output). The other ranks wait in a monitored_barrier of `timeout_s`, not the group's
timeout, which a debugging session outlasts; if the debugged rank never comes back it names it.

The prompt opens on the caller's frame (torch's opens inside its own function, and says to type `up`); it
inspects, and `c` ends it. It does not step on into the code after the call: the other ranks are held in the
barrier, so the first collective stepped into would wait for them.
"""

from __future__ import annotations

import os
import pdb
import sys
import threading
from types import FrameType

from spmd.comm.collectives import monitored_barrier
from spmd.comm.world import current_world

_calls: dict[tuple[int, str, int], int] = {}     # (world, file, line) -> calls so far, for `skip`
_calls_lock = threading.Lock()


def breakpoint(rank: int = 0, skip: int = 0, timeout_s: float = 3600) -> None:
    """Stop rank `rank` in pdb at the caller's line; the others wait for it to continue. Collective: every
    rank calls it. `skip`: return at once from the first `skip` calls made from this line."""
    world = current_world()
    caller = sys._getframe(1)
    if skip > 0:
        key = (id(world), caller.f_code.co_filename, caller.f_lineno)
        with _calls_lock:
            count = _calls[key] = _calls.get(key, 0) + 1
        if count <= skip:
            return
    if world.rank == rank:
        _debug(caller, rank, timeout_s)
    monitored_barrier(timeout=timeout_s)


def _debug(frame: FrameType, rank: int, timeout_s: float) -> None:
    stdin = sys.stdin
    if stdin is None or _is_devnull(stdin.fileno()):
        raise RuntimeError(f"spmd.breakpoint on rank {rank}: this process's standard input is /dev/null, so pdb "
                           f"could not read a command; run the job under spmdrun from a terminal (it gives its "
                           f"workers its stdin) or under python")
    debugger = pdb.Pdb(stdin=stdin, stdout=sys.stdout)
    debugger.message(f"spmd.breakpoint: rank {rank} stopped at the caller's line; the other ranks wait for it (up "
                     f"to {timeout_s:.0f} s). Inspect (p, pp, where, up, down); 'c' lets every rank go on.")
    debugger.reset()
    debugger.interaction(frame, None)     # a prompt on the live frame, no tracing: the ranks go on together


def _is_devnull(fd: int) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(os.devnull))
    except OSError:             # a closed descriptor: nothing to read either
        return True
