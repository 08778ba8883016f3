"""The RPC agent's handler threads: the requests peers send (and calls to itself) run here.

Layer: rpc. What concurrent.futures.ThreadPoolExecutor does for the agent (up to `size` threads, started as
calls arrive while none is idle, kept until shutdown), on daemon threads: the interpreter joins an executor's
threads at exit, so a worker whose main thread failed while a handler still waited (for an event its main thread
would have set) never exited, and its peers never learned it had failed. torch's C++ handler threads don't hold a
process either.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Any

_log = logging.getLogger(__name__)


class HandlerPool:
    """Runs each submitted call once on one of up to `size` daemon threads, in submission order."""

    def __init__(self, size: int, name: str) -> None:
        if size < 1:
            raise ValueError(f"rpc: num_worker_threads must be at least 1, got {size}")
        self._size = size
        self._name = name
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._work: collections.deque[tuple[Callable[..., Any], tuple]] = collections.deque()
        self._waiting = 0            # threads waiting for work
        self._threads: list[threading.Thread] = []
        self._stopping = False

    def submit(self, function: Callable[..., Any], *args: Any) -> None:
        """Run function(*args) on a pool thread; dropped once shutdown() began (an RRef's release after the
        agent stopped). An exception it raises is logged."""
        with self._lock:
            if self._stopping:
                return
            self._work.append((function, args))
            if len(self._work) > self._waiting and len(self._threads) < self._size:
                thread = threading.Thread(target=self._run, name=f"{self._name}_{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()
            else:
                self._arrived.notify()

    def _run(self) -> None:
        while True:
            with self._lock:
                self._waiting += 1
                while not self._work and not self._stopping:
                    self._arrived.wait()
                self._waiting -= 1
                if not self._work:
                    return
                function, args = self._work.popleft()
            try:
                function(*args)
            except BaseException:
                _log.exception("rpc: a handler failed")
            del function, args       # now, not at the next call: what they hold (an RRef's copy) is released

    def shutdown(self) -> None:
        """Run what was submitted, then stop the threads (waiting for them)."""
        with self._lock:
            self._stopping = True
            self._arrived.notify_all()
            threads = list(self._threads)
        for thread in threads:
            thread.join()
