"""Session-wide fixtures: the pool of rank processes that multi-process tests share (see tests/procpool.py), and
the reset of a torch.compile flag that rank threads can leave set."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from tests.procpool import ProcPool

# The porting tests run these scripts as programs; imported for doctest collection they would run their
# module-level code with pytest's arguments as theirs.
collect_ignore_glob = ["porting/*_tutorial.py", "porting/under_torchrun.py"]


@pytest.fixture(scope="session")
def procpool() -> Iterator[ProcPool]:
    """Up to 4 long-lived rank processes, started on first use and shut down at the end of the session."""
    pool = ProcPool(max_workers=4)
    try:
        yield pool
    finally:
        pool.shutdown()


@pytest.fixture(autouse=True)
def clear_dynamos_optimized_module_flag() -> Iterator[None]:
    """torch.compile's OptimizedModule marks "inside an optimized module" in one process-wide flag, saved and
    restored around each call, so compiled modules running on several rank threads at once can leave it set; torch's
    ModTracker (the memory trackers' oracle) then ignores every module of every later test. Cleared after each."""
    yield
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is not None:
        eval_frame._in_optimized_module = False
