"""Store round-trip latency: spmd's TCPStore / FileStore against torch's, with the client in another process: get,
set, add, append, and a queue_push followed by a queue_pop (torch's FileStore has no queues).

    python benchmarks/stores.py

Each figure is the median of 5 rounds of 2000 calls, in µs per call.
"""

from __future__ import annotations

import datetime
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

CALLS = 2000


def per_call_us(fn: Callable[[], object]) -> float:
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(CALLS):
            fn()
        rounds.append((time.perf_counter() - start) / CALLS * 1e6)
    return statistics.median(rounds)


def client(kind: str, port: int, path: str) -> None:
    """Connect to the store named by `kind` and time get, set and add."""
    if kind == "spmd-tcp":
        from spmd.comm.store.tcp import TCPStore
        store = TCPStore("127.0.0.1", port, timeout=30)
    elif kind == "torch-tcp":
        import torch.distributed as tdist
        store = tdist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
    elif kind == "spmd-file":
        from spmd.comm.store.file import FileStore
        store = FileStore(path)
    else:
        import torch.distributed as tdist
        store = tdist.FileStore(path, -1)
    store.set("k", b"v" * 16)
    get_us = per_call_us(lambda: store.get("k"))
    set_us = per_call_us(lambda: store.set("k", b"v" * 16))
    add_us = per_call_us(lambda: store.add("n", 1))
    store.set("log", b"")
    append_us = per_call_us(lambda: store.append("log", b"x"))
    if kind == "torch-file":      # torch's FileStore has no queues
        queue = "queue push+pop    n/a"
    else:
        pair_us = per_call_us(lambda: (store.queue_push("q", b"v" * 16), store.queue_pop("q")))
        queue = f"queue push+pop {pair_us:7.1f} µs"
    print(f"{kind:10s} get {get_us:7.1f} µs   set {set_us:7.1f} µs   add {add_us:7.1f} µs   append {append_us:7.1f} µs"
          f"   {queue}", flush=True)


def main() -> None:
    import torch.distributed as tdist

    from spmd.comm.store.tcp import TCPStore

    folder = pathlib.Path(tempfile.mkdtemp())
    for rep in range(2):
        ours = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=30)
        theirs = tdist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                timeout=datetime.timedelta(seconds=30))
        for kind, port in (("spmd-tcp", ours.port), ("torch-tcp", theirs.port)):
            subprocess.run([sys.executable, __file__, kind, str(port), "-"], check=True, timeout=300)
        for kind in ("spmd-file", "torch-file"):
            subprocess.run([sys.executable, __file__, kind, "0", str(folder / f"{kind}{rep}")], check=True,
                           timeout=300)
        ours.close()


if __name__ == "__main__":
    if len(sys.argv) > 1:
        client(sys.argv[1], int(sys.argv[2]), sys.argv[3])
    else:
        main()
