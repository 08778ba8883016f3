"""Distributed autograd at torch's path (its distributed package's `autograd`): context, backward and
get_gradients (and torch's private context helpers), defined with RPC in spmd.rpc.dist_autograd."""

from spmd.rpc.dist_autograd import _current_context as _current_context
from spmd.rpc.dist_autograd import _is_valid_context as _is_valid_context
from spmd.rpc.dist_autograd import _retrieve_context as _retrieve_context
from spmd.rpc.dist_autograd import backward, context, get_gradients

__all__ = ["backward", "context", "get_gradients", "is_available"]


def is_available() -> bool:
    return True
