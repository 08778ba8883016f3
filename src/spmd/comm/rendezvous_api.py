"""torch's rendezvous API at spmd's top level: `rendezvous(url, rank, world_size)` gives the (store, rank,
world_size) a url names, and `register_rendezvous_handler(scheme, handler)` adds init_method schemes of your own,
which init_process_group then accepts.

Layer: comm (the public edge, over spmd.comm.world's rendezvous). A handler keeps torch's protocol: it is called
as `handler(url, timeout=timedelta)`, the url's query carrying `rank` and `world_size` where they are known, and
yields (store, rank, world_size); the store must be one of spmd's (TCPStore, FileStore, HashStore, PrefixStore).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from spmd._core.deadline import as_seconds
from spmd.comm.store.base import Store
from spmd.comm.world import (
    BUILT_IN_SCHEMES,
    RENDEZVOUS_HANDLERS,
    RendezvousHandler,
    default_pg_timeout,
)
from spmd.comm.world import rendezvous as _rendezvous

__all__ = ["register_rendezvous_handler", "rendezvous"]


def register_rendezvous_handler(scheme: str, handler: RendezvousHandler) -> None:
    """Serve init_method urls of `scheme` with `handler` (a generator function yielding (store, rank,
    world_size)); RuntimeError for a scheme already served, the built-in env, tcp and file ones included."""
    if scheme in BUILT_IN_SCHEMES or scheme in RENDEZVOUS_HANDLERS:
        raise RuntimeError(f"Rendezvous handler for {scheme}:// already registered")
    RENDEZVOUS_HANDLERS[scheme] = handler


def rendezvous(url: str, rank: int = -1, world_size: int = -1,
               **kwargs: Any) -> Iterator[tuple[Store, int, int]]:
    """The (store, rank, world_size) that `url` names, as a one-item iterator (torch's protocol): env://, tcp://
    and file:// build spmd's stores, a registered scheme asks its handler. `timeout=` (seconds or a timedelta)
    bounds the waits; default `default_pg_timeout`."""
    if not isinstance(url, str):
        raise RuntimeError(f"`url` must be a string. {type(url)}: {url}")
    timeout = kwargs.pop("timeout", None)
    if kwargs:
        raise TypeError(f"rendezvous() got unexpected keyword arguments {sorted(kwargs)}")
    seconds = as_seconds(timeout, default_pg_timeout.total_seconds(), "rendezvous: timeout")
    yield _rendezvous(url, rank, world_size, seconds)
