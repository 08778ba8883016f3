"""torch's debug server under spmd (`spmd.debug`): every rank starts it, rank 0 serves what every rank is doing
(its collectives and where its thread is), as text and JSON, and writes it to files when asked; torch's handler
options are refused with a reason; a second start and a stop without a start are errors."""

from __future__ import annotations

import json
import pathlib
import threading
import time
import urllib.error
import urllib.request

import pytest

import spmd
from spmd.debug import debug_server_port, start_debug_server, stop_debug_server
from spmd.testing import run_ranks


def _get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as response:
        return response.read().decode()


def test_rank_0_serves_what_every_rank_is_doing(tmp_path: pathlib.Path) -> None:
    release, served = threading.Event(), {}

    def body(rank: int, size: int) -> None:
        start_debug_server(port=0, dump_dir=str(tmp_path) if rank == 0 else None, dump_interval=0.1)
        with pytest.raises(RuntimeError, match="already started"):
            start_debug_server(port=0)
        spmd.barrier()
        if rank == 1:
            release.wait(timeout=30)           # "stuck" outside any collective while rank 0 looks
        else:
            port = debug_server_port()
            assert port is not None
            served["text"], served["json"] = _get(port, "/"), json.loads(_get(port, "/status.json"))
            with pytest.raises(urllib.error.HTTPError, match="404"):
                _get(port, "/nothing")
            deadline = time.monotonic() + 30
            while not list(tmp_path.glob("status_*.txt")) and time.monotonic() < deadline:
                release.wait(0.05)
            served["dump"] = sorted(tmp_path.glob("status_*.txt"))[0].read_text()
            release.set()
        spmd.barrier()
        stop_debug_server()
        with pytest.raises(RuntimeError, match="no debug server started"):
            stop_debug_server()

    run_ranks(body, 2, timeout=60)
    assert "rank 0 on group 'default' last completed barrier #1" in served["text"]
    assert "rank 1 on group 'default' last completed barrier #1" in served["text"]
    assert "now at threading.py:" in served["text"] and "in body" in served["text"]
    assert set(served["json"]) == {"0", "1"} and served["json"]["1"]["groups"]["default"][-1]["op"] == "barrier"
    assert "what every rank of 2 is doing" in served["dump"]


def test_torchs_handler_options_are_refused_naming_why() -> None:
    def body(rank: int, size: int) -> None:
        with pytest.raises(ValueError, match=r"torch's debug handlers .* are not served"):
            start_debug_server(port=0, enabled_dumps={"stacks"})

    run_ranks(body, 1, timeout=30)
