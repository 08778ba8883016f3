"""torch's rendezvous API: `spmd.rendezvous(url, rank, world_size)` yields the (store, rank, world_size) a url
names, and `spmd.register_rendezvous_handler` adds init_method schemes, which init_process_group then takes
(torch's handler protocol: the url's query carries rank and world_size, a timedelta timeout, a generator)."""

from __future__ import annotations

import datetime
import threading
import urllib.parse
from collections.abc import Iterator

import pytest
import torch

import spmd
from spmd.comm.world import RENDEZVOUS_HANDLERS
from tests.comm.test_world import _in_rank_threads


@pytest.fixture
def scheme(request: pytest.FixtureRequest) -> Iterator[str]:
    """A scheme of the test's own, forgotten afterwards (the registry is the process's)."""
    name = f"mem{abs(hash(request.node.name)) % 10**8}"
    yield name
    RENDEZVOUS_HANDLERS.pop(name, None)


def test_a_built_in_url_yields_its_store(tmp_path) -> None:
    store, rank, world_size = next(spmd.rendezvous(f"file://{tmp_path}/store", rank=0, world_size=1, timeout=5))
    assert (rank, world_size) == (0, 1) and isinstance(store, spmd.FileStore)
    store.set("k", b"v")
    assert store.get("k") == b"v"


def test_two_ranks_initialise_through_a_registered_scheme(scheme: str) -> None:
    shared = spmd.HashStore(timeout=30)
    calls: list[tuple[dict[str, str], datetime.timedelta]] = []
    lock = threading.Lock()

    def handler(url: str, **kwargs: object) -> Iterator[tuple[spmd.Store, int, int]]:
        query = dict(urllib.parse.parse_qsl(urllib.parse.urlparse(url).query))
        with lock:
            calls.append((query, kwargs["timeout"]))
        yield spmd.PrefixStore(urllib.parse.urlparse(url).netloc, shared), int(query["rank"]), int(query["world_size"])

    spmd.register_rendezvous_handler(scheme, handler)
    results: dict[int, float] = {}

    def rank_main(rank: int) -> None:
        spmd.init_process_group("tcp", init_method=f"{scheme}://job", rank=rank, world_size=2, timeout=30,
                                torch_default_group=False)
        t = torch.full((2,), float(rank + 1))
        spmd.all_reduce(t)
        results[rank] = t[0].item()
        spmd.destroy_process_group()

    _in_rank_threads(rank_main)
    assert results == {0: 3.0, 1: 3.0}
    assert sorted(query["rank"] for query, _ in calls) == ["0", "1"]
    assert all(query["world_size"] == "2" and timeout == datetime.timedelta(seconds=30) for query, timeout in calls)


def test_a_scheme_is_registered_once_and_the_built_in_ones_are_taken(scheme: str) -> None:
    spmd.register_rendezvous_handler(scheme, lambda url, **kwargs: iter(()))
    for taken in (scheme, "tcp", "env", "file"):
        with pytest.raises(RuntimeError, match=f"Rendezvous handler for {taken}:// already registered"):
            spmd.register_rendezvous_handler(taken, lambda url, **kwargs: iter(()))


def test_a_handler_that_yields_no_spmd_store_is_named(scheme: str) -> None:
    spmd.register_rendezvous_handler(scheme, lambda url, **kwargs: iter([({"not": "a store"}, 0, 1)]))
    with pytest.raises(TypeError, match=f"the rendezvous handler of {scheme}:// must yield \\(store, rank, "
                                        f"world_size\\) with an spmd Store"):
        next(spmd.rendezvous(f"{scheme}://x", rank=0, world_size=1))


def test_an_unknown_scheme_lists_the_ones_served(scheme: str) -> None:
    spmd.register_rendezvous_handler(scheme, lambda url, **kwargs: iter(()))
    with pytest.raises(ValueError, match=f"must start with one of env://, tcp://, file://, {scheme}://"):
        next(spmd.rendezvous("nope://x", rank=0, world_size=1))
