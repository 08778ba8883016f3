"""torch's `distributed.constants` path: the default timeouts of process groups. Layer: comm (an alias)."""

from spmd.comm.world import default_pg_timeout

default_pg_nccl_timeout = default_pg_timeout   # spmd's "nccl" groups take the same default as the others

__all__ = ["default_pg_nccl_timeout", "default_pg_timeout"]
