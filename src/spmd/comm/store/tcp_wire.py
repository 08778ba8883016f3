"""The TCPStore wire format, shared by its server (tcp_server) and its clients (tcp).

Layer: comm. Nothing is ever pickled: a frame is a header (u32 body length, u8 opcode or reply status) and a
body made of fields, each a u32 length and that many bytes; numbers travel as decimal text. The first frame of
a connection is HELLO(magic, token). A server with a token refuses a client presenting another one and drops
the connection before reading anything else; before that HELLO it accepts no frame larger than MAX_HELLO.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

HEADER = struct.Struct("!IB")
LENGTH = struct.Struct("!I")
MAGIC = b"spmd-store/1"
MAX_HELLO = 4096
RECV_CHUNK = 1 << 18

# Opcodes (client -> server).
HELLO, SET, GET, ADD, CAS, WAIT, CHECK, DELETE, NUM_KEYS, MULTI_GET, MULTI_SET, WAIT_COUNT = range(1, 13)
OP_NAMES = {SET: "set", GET: "get", ADD: "add", CAS: "compare_set", WAIT: "wait", CHECK: "check",
            DELETE: "delete_key", NUM_KEYS: "num_keys", MULTI_GET: "multi_get", MULTI_SET: "multi_set",
            WAIT_COUNT: "wait_for_workers", HELLO: "connect"}
# Reply statuses (server -> client).
OK, TIMEOUT, ERROR, BAD_VALUE, REFUSED = range(5)


def frame(code: int, fields: Sequence[bytes]) -> bytes:
    parts = [b""]
    size = 0
    for field in fields:
        parts.append(LENGTH.pack(len(field)))
        parts.append(field)
        size += 4 + len(field)
    parts[0] = HEADER.pack(size, code)
    return b"".join(parts)


def split_fields(body: bytes) -> list[bytes]:
    fields = []
    pos, end = 0, len(body)
    while pos < end:
        if pos + 4 > end:
            raise ValueError("truncated field length")
        (size,) = LENGTH.unpack_from(body, pos)
        pos += 4
        if pos + size > end:
            raise ValueError("truncated field")
        fields.append(body[pos:pos + size])
        pos += size
    return fields


def seconds_field(seconds: float) -> bytes:
    return repr(float(seconds)).encode()
