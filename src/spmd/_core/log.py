"""Rank-prefixed logging.

Layer: core. Loggers are named `spmd.<module>`; a message gets a "[rank N]" prefix when the rank is known.
"""

from __future__ import annotations

import logging


def get_logger(name: str) -> logging.Logger:
    """The logger for an spmd module (`spmd.comm.store.tcp_server`, ...); silent unless the application logs."""
    return logging.getLogger(name)


def rank_prefix(rank: int | None) -> str:
    return "" if rank is None else f"[rank {rank}] "
