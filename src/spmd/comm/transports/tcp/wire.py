"""The tcp transport's wire format: frames, the connection handshake, and socket I/O on tensor memory.

Layer: comm. Nothing here is pickled: a frame is a fixed binary header, a short metadata string and raw
tensor bytes, which are sent from and received into the tensor's own memory (`byte_view`).

Note: frame layout
Every frame starts with HEADER (24 bytes, little endian):
    kind u8 | flags u8 | key_len u16 | site_len u16 | pad u16 | seq i64 | payload_len u64
followed by `key_len` bytes of key, `site_len` bytes of site and `payload_len` bytes of payload.
  COLL   a piece of a collective. seq = the collective's sequence number, key = the JSON of its
         Fingerprint.key() (compared byte for byte with the receiver's own), site = the sender's whole
         Fingerprint encoded (its shape and call site, for a mismatch's message).
  P2P    a point-to-point message. seq = the tag, key = the dtype name; payload = the tensor's bytes.
  ABORT  the group failed. seq = the rank where it failed first, key = the error class name, payload = the
         UTF-8 reason. A rank passes the first ABORT it gets on to its other peers.
  BYE    the sender is closing the group normally; EOF follows.

Note: handshake (challenge-response in both directions; the token never crosses the wire)
    connecting rank -> HELLO = magic | group_rank u32 | name_len u16 | its nonce (16 bytes), then the group name
    accepting rank  -> CHALLENGE = magic | its nonce | HMAC-SHA256(token, b"accept" | HELLO | its nonce)
    connecting rank -> PROOF = HMAC-SHA256(token, b"connect" | HELLO | the accepting rank's nonce)
The accepting rank checks magic, lengths, name and rank before it answers, and keeps the connection only once
the PROOF checks out; the connecting rank sends its PROOF (and anything else) only once the CHALLENGE proved
that the other end knows the token. So whatever listens on a published port, or dials one, learns nothing of
the token, and each proof is bound to both nonces and to its direction: none can be replayed or reflected.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import socket
import struct
import time

import torch
from torch import Tensor

HEADER = struct.Struct("<BBHHxxqQ")
MAGIC = b"SPMDTCP2"
NONCE_BYTES = 16
_HELLO = struct.Struct(f"<8sIH{NONCE_BYTES}s")
_MAX_NAME = 1024
PROOF_LEN = hashlib.sha256().digest_size
CHALLENGE_LEN = len(MAGIC) + NONCE_BYTES + PROOF_LEN
MAX_ABORT_REASON = 1 << 16


class Kind(enum.IntEnum):
    """What a frame carries (see Note: frame layout)."""

    COLL = 1
    P2P = 2
    ABORT = 3
    BYE = 4


class PeerClosed(ConnectionError):
    """The peer closed its end of the connection (EOF) while a frame was expected."""


def byte_view(tensor: Tensor) -> memoryview:
    """A writable one-dimensional byte memoryview of a contiguous tensor's memory, whatever its shape and dtype
    (bool and bf16 too)."""
    if tensor.numel() == 0:
        return memoryview(bytearray())
    if tensor.requires_grad:
        tensor = tensor.detach()
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def pack_header(kind: Kind, seq: int, payload_len: int, key: bytes = b"", site: bytes = b"") -> bytes:
    return HEADER.pack(kind, 0, len(key), len(site), seq, payload_len) + key + site


def send_frame(sock: socket.socket, header: bytes, payload: memoryview | None, deadline: float | None,
               is_failed: object) -> None:
    """Send header + payload completely, as one sendmsg where possible.

    The socket has a send timeout (SO_SNDTIMEO), so a peer that stops draining makes this return to check
    `deadline` (monotonic seconds) and `is_failed()` instead of blocking forever. Raises TimeoutError at the
    deadline and OSError when the connection breaks.
    """
    parts = [memoryview(header)] if payload is None or len(payload) == 0 else [memoryview(header), payload]
    while parts:
        try:
            sent = sock.sendmsg(parts, [], socket.MSG_NOSIGNAL)
        except (BlockingIOError, InterruptedError):
            sent = 0
        while sent and parts:
            if sent >= len(parts[0]):
                sent -= len(parts[0])
                parts.pop(0)
            else:
                parts[0] = parts[0][sent:]
                sent = 0
        if parts:
            if is_failed():   # type: ignore[operator]
                raise ConnectionAbortedError("the group failed while sending")
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError("the peer stopped receiving")


def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from the socket (blocking); PeerClosed on EOF."""
    got = 0
    total = len(view)
    while got < total:
        n = sock.recv_into(view[got:], total - got, socket.MSG_WAITALL)
        if n == 0:
            raise PeerClosed("connection closed by the peer")
        got += n


def recv_bytes(sock: socket.socket, length: int) -> bytes:
    buf = bytearray(length)
    if length:
        recv_into(sock, memoryview(buf))
    return bytes(buf)


def discard(sock: socket.socket, length: int) -> None:
    """Read and drop `length` bytes (the payload of a frame nobody can use)."""
    sink = memoryview(bytearray(min(length, 1 << 20)))
    while length:
        step = min(length, len(sink))
        recv_into(sock, sink[:step])
        length -= step


# -- handshake ---------------------------------------------------------------------------------------------


def hello_frame(group_rank: int, group_name: str, nonce: bytes) -> bytes:
    name = group_name.encode()
    return _HELLO.pack(MAGIC, group_rank, len(name), nonce) + name


def read_hello(sock: socket.socket, group_name: str) -> tuple[int, bytes] | None:
    """Read a connecting peer's hello; (its group rank, the raw hello) or None for a stranger.

    Nothing the stranger sent is interpreted beyond the fixed-size fields and the group name; whether it
    holds the token is what its PROOF shows, after the CHALLENGE.
    """
    head = recv_bytes(sock, _HELLO.size)
    magic, group_rank, name_len, _ = _HELLO.unpack(head)
    if magic != MAGIC or name_len > _MAX_NAME:
        return None
    name = recv_bytes(sock, name_len)
    if name != group_name.encode():
        return None
    return group_rank, head + name


def _mac(token: bytes, direction: bytes, hello: bytes, nonce: bytes) -> bytes:
    return hmac.new(token, direction + hello + nonce, hashlib.sha256).digest()


def challenge_frame(token: bytes, hello: bytes, nonce: bytes) -> bytes:
    """The accepting rank's answer: its nonce and its proof of the token, bound to the hello it got."""
    return MAGIC + nonce + _mac(token, b"accept", hello, nonce)


def check_challenge(challenge: bytes, token: bytes, hello: bytes) -> bytes | None:
    """The accepting rank's nonce if its CHALLENGE proves it knows the token, else None."""
    if len(challenge) != CHALLENGE_LEN or challenge[:len(MAGIC)] != MAGIC:
        return None
    nonce = challenge[len(MAGIC):len(MAGIC) + NONCE_BYTES]
    return nonce if hmac.compare_digest(challenge, challenge_frame(token, hello, nonce)) else None


def proof_frame(token: bytes, hello: bytes, nonce: bytes) -> bytes:
    """The connecting rank's proof of the token, bound to its hello and the accepting rank's nonce."""
    return _mac(token, b"connect", hello, nonce)


def check_proof(proof: bytes, token: bytes, hello: bytes, nonce: bytes) -> bool:
    return hmac.compare_digest(proof, proof_frame(token, hello, nonce))
