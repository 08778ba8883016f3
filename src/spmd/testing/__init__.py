"""Helpers for testing distributed code: run ranks as threads of one process (no library module imports this)."""

from spmd.testing.ranks import run_ranks, seeded

__all__ = ["run_ranks", "seeded"]
