"""torch's `distributed.collective_utils` path: run a function on one rank or every rank and share its result
or failure with the group. Layer: comm (an alias)."""

from spmd.comm.collective_utils import SyncPayload, all_gather, all_gather_object_enforce_type, broadcast

__all__ = ["SyncPayload", "all_gather", "all_gather_object_enforce_type", "broadcast"]
