"""torch's elastic `utils` path: the data helpers elastic training scripts import (data/), and a socket holding a
free port (distributed.py)."""

from spmd.elastic.utils.distributed import get_socket_with_port

__all__ = ["get_socket_with_port"]
