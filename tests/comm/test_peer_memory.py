"""peer_memory: one-copy reads out of another process (what shm's rendezvous messages run on), and the
answers it gives where it may not read: a bad address, a process that is gone, SPMD_SHM_ONE_COPY=0."""

from __future__ import annotations

import ctypes
import errno
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from spmd.comm.transports.shm import peer_memory

_PEER = """
import ctypes, sys
buffer = ctypes.create_string_buffer(b"spmd one copy!!!", 16)
word = ctypes.c_int64(0)
word.value = ctypes.addressof(word)
print(ctypes.addressof(buffer), ctypes.addressof(word), flush=True)
sys.stdin.read()
"""


@pytest.fixture
def peer() -> Iterator[tuple[subprocess.Popen, int, int]]:
    """A process holding 16 known bytes and a word that holds its own address; ends when its stdin closes."""
    process = subprocess.Popen([sys.executable, "-c", _PEER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True)
    assert process.stdout is not None
    buffer, word = map(int, process.stdout.readline().split())
    try:
        yield process, buffer, word
    finally:
        process.communicate(timeout=10)


def _can_cross_process() -> bool:
    return peer_memory._READV is not None


@pytest.mark.timeout(30)
@pytest.mark.skipif(not _can_cross_process(), reason="process_vm_readv is Linux's")
def test_reads_another_process_and_refuses_what_it_may_not_read(peer, monkeypatch: pytest.MonkeyPatch) -> None:
    process, buffer, word = peer
    mine = ctypes.create_string_buffer(16)
    peer_memory.read(process.pid, buffer, ctypes.addressof(mine), 16)
    assert mine.raw == b"spmd one copy!!!"
    assert peer_memory.can_read(process.pid, word)
    assert not peer_memory.can_read(process.pid, buffer)           # the word must hold its own address
    with pytest.raises(OSError) as bad_address:
        peer_memory.read(process.pid, 8, ctypes.addressof(mine), 16)
    assert bad_address.value.errno == errno.EFAULT
    monkeypatch.setenv(peer_memory.ENABLED_ENV, "0")
    assert not peer_memory.can_read(process.pid, word)


@pytest.mark.timeout(30)
def test_a_process_that_is_gone_is_esrch() -> None:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait(timeout=10)
    mine = ctypes.create_string_buffer(8)
    with pytest.raises(OSError) as gone:
        peer_memory.read(process.pid, ctypes.addressof(mine), ctypes.addressof(mine), 8)
    assert gone.value.errno in (errno.ESRCH, errno.ENOSYS)
    assert not peer_memory.can_read(process.pid, ctypes.addressof(mine))


def test_a_read_of_this_process_is_a_plain_copy() -> None:
    source, target = ctypes.create_string_buffer(b"abcdefgh", 8), ctypes.create_string_buffer(8)
    peer_memory.read(os.getpid(), ctypes.addressof(source), ctypes.addressof(target), 8)
    assert target.raw == b"abcdefgh"
