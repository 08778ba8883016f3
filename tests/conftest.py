"""Session-wide fixtures: the pool of rank processes that multi-process tests share (see tests/procpool.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.procpool import ProcPool


@pytest.fixture(scope="session")
def procpool() -> Iterator[ProcPool]:
    """Up to 4 long-lived rank processes, started on first use and shut down at the end of the session."""
    pool = ProcPool(max_workers=4)
    try:
        yield pool
    finally:
        pool.shutdown()
