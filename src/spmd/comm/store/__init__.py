"""Stores: the key/value rendezvous every group is built on (Store ABC, HashStore, PrefixStore, TCPStore, FileStore).

Layer: comm. Torch-free, and imports only `_core`, so the launcher can use it without importing torch.
"""

from spmd.comm.store.base import HashStore, PrefixStore, Store
from spmd.comm.store.file import FileStore
from spmd.comm.store.tcp import TCPStore

__all__ = ["FileStore", "HashStore", "PrefixStore", "Store", "TCPStore"]
