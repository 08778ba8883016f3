"""Logging: one standard-library logger per spmd module, named `spmd.<module>`.

Layer: core. spmd never configures logging; the application (or spmdrun's rank-prefixed output) does.
"""

from __future__ import annotations

import logging


def get_logger(name: str) -> logging.Logger:
    """The logger for an spmd module (`spmd.comm.store.tcp_server`, ...); silent unless the application logs."""
    return logging.getLogger(name)
