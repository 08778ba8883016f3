"""Copying out of a peer process's memory in one step: Linux cross-memory attach (process_vm_readv).

Layer: comm. The shm transport sends large point-to-point messages by rendezvous: the sender publishes where
its tensor lies and the receiver copies it straight into its own tensor, one copy instead of two through the
ring (see p2p's Note: rendezvous). The kernel allows the read only where the receiver may ptrace the sender
(same user, and neither Yama's ptrace_scope nor a container's seccomp profile forbids it), so a receiver asks
`can_read` once per peer and the pair keeps to the ring when it may not.
"""

from __future__ import annotations

import ctypes
import errno
import os

ENABLED_ENV = "SPMD_SHM_ONE_COPY"   # "0": never read peers' memory, send everything through the rings


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _process_vm_readv() -> ctypes._CFuncPtr | None:
    try:
        function = ctypes.CDLL(None, use_errno=True).process_vm_readv
    except (AttributeError, OSError):   # not Linux, or a libc without it
        return None
    function.restype = ctypes.c_ssize_t
    function.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.POINTER(_IoVec),
                         ctypes.c_ulong, ctypes.c_ulong]
    return function


_READV = _process_vm_readv()


def read(pid: int, remote: int, local: int, nbytes: int) -> None:
    """Copy `nbytes` from address `remote` in process `pid` to address `local` in this one; raises OSError
    (ESRCH: the process is gone)."""
    if pid == os.getpid():        # thread ranks of one process: a plain copy
        ctypes.memmove(local, remote, nbytes)
        return
    if _READV is None:
        raise OSError(errno.ENOSYS, "process_vm_readv is not available on this system")
    done = 0
    while done < nbytes:          # the kernel may stop short of the whole range; go on from there
        mine, theirs = _IoVec(local + done, nbytes - done), _IoVec(remote + done, nbytes - done)
        count = _READV(pid, ctypes.byref(mine), 1, ctypes.byref(theirs), 1, 0)
        if count <= 0:
            code = ctypes.get_errno() if count < 0 else errno.EIO
            raise OSError(code, f"process_vm_readv from pid {pid}: {os.strerror(code)}")
        done += count


def can_read(pid: int, address: int) -> bool:
    """Whether this process may read process `pid`'s memory: the 8-byte word at `address` there must hold
    `address` itself (the peer wrote it so)."""
    if os.environ.get(ENABLED_ENV, "1") == "0":
        return False
    word = ctypes.c_int64(0)
    try:
        read(pid, address, ctypes.addressof(word), 8)
    except OSError:
        return False
    return word.value == address
