"""torch's debug server (the `debug` module of torch's distributed package): a page on rank 0 saying what every
rank of the job is doing, for a job that is slow or stuck, and optionally the same written to files every few
seconds.

Layer: debug (imports _core and comm). Every rank already runs a status service (comm.debug) that answers through
the store with its flight recorder and where its thread is; `start_debug_server` adds, on rank 0, an HTTP server
that asks all of them per request. `/` is the text spmdrun prints on SIGUSR1 (one line per rank), `/status.json`
the ranks' raw replies. Unlike torch's (every interface, no authentication), the server listens on 127.0.0.1
unless `host` says otherwise: what it shows (file names, call sites) is for the job's owner.
"""

from __future__ import annotations

import http.server
import json
import os
import threading
import time
import weakref
from typing import Any

from spmd.comm.debug import collect_statuses, describe_ranks
from spmd.comm.world import World, current_world

__all__ = ["start_debug_server", "stop_debug_server"]


class _Server:
    """Rank 0's part: the HTTP server's thread and the periodic dump's."""

    def __init__(self, world: World, host: str, port: int, dump_dir: str | None, dump_interval: float,
                 fetch_timeout: float) -> None:
        self.world, self.fetch_timeout = world, fetch_timeout
        self.stopped = threading.Event()
        self.http = http.server.ThreadingHTTPServer((host, port), self._handler())
        self.http.daemon_threads = True
        self.threads = [threading.Thread(target=self.http.serve_forever, name="spmd-debug-server", daemon=True)]
        if dump_dir is not None:
            os.makedirs(dump_dir, exist_ok=True)
            self.threads.append(threading.Thread(target=self._dump_every, args=(dump_dir, dump_interval),
                                                 name="spmd-debug-dumps", daemon=True))
        for thread in self.threads:
            thread.start()

    @property
    def port(self) -> int:
        return self.http.server_address[1]

    def statuses(self) -> dict[int, dict[str, Any] | None]:
        return collect_statuses(self.world.store, list(range(self.world.world_size)),
                                wait_s=min(self.fetch_timeout, 5.0))

    def text(self) -> str:
        return "\n".join([f"spmd: what every rank of {self.world.world_size} is doing "
                          f"({time.strftime('%Y-%m-%d %H:%M:%S')}):", *describe_ranks(self.statuses())]) + "\n"

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/":
                    body, kind = server.text().encode(), "text/plain; charset=utf-8"
                elif self.path == "/status.json":
                    body, kind = json.dumps(server.statuses()).encode(), "application/json"
                else:
                    self.send_error(404, "spmd's debug server has / and /status.json")
                    return
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                """Requests are not logged: the page is for the job's owner, not the job's output."""

        return Handler

    def _dump_every(self, dump_dir: str, interval: float) -> None:
        count = 0
        while not self.stopped.wait(interval):
            path = os.path.join(dump_dir, f"status_{count:05d}.txt")
            with open(f"{path}.tmp", "w") as file:
                file.write(self.text())
            os.replace(f"{path}.tmp", path)
            count += 1

    def stop(self) -> None:
        self.stopped.set()
        self.http.shutdown()
        self.http.server_close()
        for thread in self.threads:
            thread.join()


_started: weakref.WeakKeyDictionary[World, _Server | None] = weakref.WeakKeyDictionary()   # None: not rank 0
_lock = threading.Lock()


def start_debug_server(port: int = 25999, worker_port: int = 0, start_method: str | None = None,
                       dump_dir: str | None = None, dump_interval: float = 60.0,
                       enabled_dumps: set[str] | None = None, handlers: list[Any] | None = None,
                       fetch_timeout: float = 60.0, *, host: str = "127.0.0.1") -> None:
    """Start the debug server: call it on every rank (as torch's); rank 0 serves the page on `host`:`port`
    (port 0: a free one) and, with `dump_dir`, writes it there every `dump_interval` seconds. `worker_port` and
    `start_method` are torch's worker servers' and frontend process's, which spmd does without (each rank's
    status service answers through the store; the page is a thread of rank 0)."""
    if handlers is not None or enabled_dumps is not None:
        raise ValueError("spmd.debug.start_debug_server: torch's debug handlers (stacks, fr_trace, profiles) are "
                         "not served: spmd's page shows every rank's collectives and where its thread is; leave "
                         "handlers and enabled_dumps out")
    world = current_world()
    with _lock:
        if world in _started:
            raise RuntimeError(f"spmd.debug.start_debug_server on rank {world.rank}: already started; "
                               f"stop_debug_server() first")
        _started[world] = (_Server(world, host, port, dump_dir, dump_interval, fetch_timeout)
                           if world.rank == 0 else None)


def stop_debug_server() -> None:
    """Stop the debug server this rank started (on rank 0, the page and the dumps)."""
    world = current_world()
    with _lock:
        if world not in _started:
            raise RuntimeError(f"spmd.debug.stop_debug_server on rank {world.rank}: no debug server started")
        server = _started.pop(world)
    if server is not None:
        server.stop()


def debug_server_port() -> int | None:
    """The port rank 0's page listens on (useful after port=0); None on other ranks or when not started."""
    server = _started.get(current_world())
    return None if server is None else server.port
