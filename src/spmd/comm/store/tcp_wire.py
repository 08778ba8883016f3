"""The TCPStore wire format, shared by its server (tcp_server) and its clients (tcp).

Layer: comm. Nothing is ever pickled: a frame is a header (u32 body length, u8 opcode or reply status) and a
body made of fields, each a u32 length and that many bytes; numbers travel as decimal text.

Note: replies come in request order, one per request, except for the UNANSWERED requests (set, multi_set,
append, queue_push):
those are answered only when they fail, with status QUIET_FAILED, so a client sends them and moves on (as
torch's set does) and reads such a failure ahead of the reply to a later request. The server applies each
connection's requests in order, so that connection's later requests see the write; another connection sees
it once the server has read it.

Note: handshake (challenge-response in both directions; the token never crosses the wire)
    client -> HELLO(MAGIC, client_nonce, b"1" if it has a token else b"0")
    server -> OK(server_nonce), or REFUSED(reason) when exactly one side has a token
    client -> AUTH(proof(token, CLIENT_SIDE, server_nonce, client_nonce))
    server -> OK(proof(token, SERVER_SIDE, server_nonce, client_nonce)), or REFUSED(b"wrong token")
The client sends no request before it has checked the server's proof, so whatever listens on the port without
knowing the token learns neither the token nor any key or value. Without a token on either side the same
exchange runs keyed by b"" (it then proves nothing, but keeps one code path).

Note: with a token, a client on the server's machine (one that connects to a loopback address) talks to it
over a Unix socket in the abstract namespace (Linux) named by `local_name`: the same frames and handshake,
less kernel work per request than loopback TCP. The name is keyed by the token, so no process without it
can take the name before the server does (a tokenless store keeps to TCP: its name would be predictable).
TCP serves every other client, and any client where the name cannot be used.

Note: limits (a stranger or a careless caller cannot make the server spin or buffer without bound)
    MAX_HELLO            4 KiB   the largest frame accepted before the handshake completes
    MAX_FRAME           64 MiB   the largest request or reply body; clients refuse to send a bigger one
    MAX_UNAUTHENTICATED    256   connections that have not completed the handshake, per listening socket; a
                                 new one over the cap drops the oldest of them (a flood cannot lock legitimate
                                 clients out)
    MAX_BUFFERED_REPLY  64 MiB   reply bytes a connection may leave unread before the server stops reading
                                 its requests (back-pressure; the connection is kept)
    HELLO_TIMEOUT_S        5 s   how long a connection may take to complete the handshake
Timeout fields are non-negative seconds or "inf" (wait forever); NaN or a negative one is a malformed request.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import struct
from collections.abc import Sequence

HEADER = struct.Struct("!IB")
LENGTH = struct.Struct("!I")
MAGIC = b"spmd-store/4"
NONCE_BYTES = 16
MAX_HELLO = 4096
MAX_FRAME = 64 << 20
MAX_UNAUTHENTICATED = 256
MAX_BUFFERED_REPLY = 64 << 20
HELLO_TIMEOUT_S = 5.0
RECV_CHUNK = 1 << 18
CLIENT_SIDE, SERVER_SIDE = b"client", b"server"

# Opcodes (client -> server).
(HELLO, SET, GET, ADD, CAS, WAIT, CHECK, DELETE, NUM_KEYS, MULTI_GET, MULTI_SET, WAIT_COUNT,
 AUTH, APPEND, LIST_KEYS, QUEUE_PUSH, QUEUE_POP, QUEUE_LEN) = range(1, 19)
OP_NAMES = {SET: "set", GET: "get", ADD: "add", CAS: "compare_set", WAIT: "wait", CHECK: "check",
            DELETE: "delete_key", NUM_KEYS: "num_keys", MULTI_GET: "multi_get", MULTI_SET: "multi_set",
            WAIT_COUNT: "wait_for_workers", HELLO: "connect", AUTH: "connect", APPEND: "append",
            LIST_KEYS: "list_keys", QUEUE_PUSH: "queue_push", QUEUE_POP: "queue_pop", QUEUE_LEN: "queue_len"}
UNANSWERED = frozenset({SET, MULTI_SET, APPEND, QUEUE_PUSH})   # answered only when they fail (QUIET_FAILED)
# Reply statuses (server -> client). EMPTY: a non-blocking queue_pop found its queue empty.
OK, TIMEOUT, ERROR, BAD_VALUE, REFUSED, QUIET_FAILED, EMPTY = range(7)


class FrameTooLarge(ValueError):
    """A frame whose body would be over MAX_FRAME; `frame` raises it before building anything."""

    def __init__(self, size: int) -> None:
        super().__init__(f"a {size}-byte frame body is over the store's limit of {MAX_FRAME} bytes")
        self.size = size


def frame(code: int, fields: Sequence[bytes]) -> bytes:
    """The frame of `fields` under opcode or status `code`; FrameTooLarge if its body would be over MAX_FRAME."""
    parts = [b""]
    size = 0
    pack = LENGTH.pack
    for field in fields:
        length = len(field)
        parts.append(pack(length))
        parts.append(field)
        size += 4 + length
    if size > MAX_FRAME:
        raise FrameTooLarge(size)
    parts[0] = HEADER.pack(size, code)
    return b"".join(parts)


def split_fields(body: bytes) -> list[bytes]:
    fields = []
    unpack = LENGTH.unpack_from
    pos, end = 0, len(body)
    while pos < end:
        if pos + 4 > end:
            raise ValueError("truncated field length")
        (size,) = unpack(body, pos)
        pos += 4
        if pos + size > end:
            raise ValueError("truncated field")
        fields.append(body[pos:pos + size])
        pos += size
    return fields


def local_name(port: int, token: bytes) -> str:
    """The abstract Unix socket name of the store server on TCP port `port` with `token` (see the note above)."""
    return f"\0spmd-store/{port}/" + hmac.new(token, b"local-name/%d" % port, hashlib.sha256).hexdigest()[:32]


def proof(token: bytes, side: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """HMAC-SHA256 over both nonces and the proving side: shows knowledge of `token` without revealing it."""
    return hmac.new(token, side + server_nonce + client_nonce, hashlib.sha256).digest()


def seconds_field(seconds: float) -> bytes:
    return repr(float(seconds)).encode()


def parse_seconds(field: bytes) -> float:
    """A timeout field: non-negative seconds or inf; ValueError for NaN, a negative number or garbage."""
    seconds = float(field)
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(f"timeout {field[:32]!r} is not a non-negative number of seconds")
    return seconds
