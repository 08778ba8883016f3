"""The per-rank world: init/destroy_process_group, the default group, new_group and rank queries.

Layer: comm. World state is found through a context variable (set by init_process_group on the calling
thread), so the threads transport can host several ranks in one process; a process with one real rank also
finds its world from threads it starts later. Inside the library groups are passed explicitly; only the
public API resolves the default group here.
"""

from __future__ import annotations

import collections
import contextvars
import datetime
import json
import os
import secrets
import socket
import threading
import urllib.parse
from collections.abc import Callable, Iterator

import torch

from spmd._core import env
from spmd._core.deadline import as_seconds
from spmd._core.errors import GroupAbortedError
from spmd.comm.backend import torch_style_name, transport_for
from spmd.comm.debug import FlightRecorder, StatusService
from spmd.comm.group import CollectiveObservers, NonMemberGroup, ProcessGroup
from spmd.comm.host import host_identity
from spmd.comm.store.base import HashStore, PrefixStore, Store
from spmd.comm.transports.base import TransportSpec, create_transport

DEFAULT_TIMEOUT = 600.0
SIMULATED = "fake"       # the transport of a world whose other ranks are simulated (transports/fake.py)

AnyGroup = ProcessGroup | NonMemberGroup


class World:
    """One rank's view of the job: its rank, the store, the default group and every group it created.

    `backend` is the name the user asked for ("gloo", "auto", "cpu:gloo,cuda:nccl"); `device` the device
    init_process_group's device_id bound this rank to, if any.
    """

    def __init__(self, rank: int, world_size: int, store: Store, backend: str, timeout: float,
                 owns_store: bool, device: torch.device | None = None, prefix: str | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.store = store
        self.backend = backend
        self.device = device
        self.torch_backend_names: dict[str, str] = {}   # group name -> what torch's get_backend prints for it
        self.requested_backends: dict[str, str] = {}    # group name -> the backend name it was created with
        self.timeout = timeout
        self.owns_store = owns_store
        self.recorder = FlightRecorder()
        self.groups: list[AnyGroup] = []
        self.groups_made = 0    # new_group calls so far: names the next group (never reused after a destroy)
        self.local_groups_made: collections.Counter[tuple[int, ...]] = collections.Counter()   # per member set
        self.observers = CollectiveObservers()      # told of every collective on this rank's groups
        # Every init over one long-lived store gets fresh keys: ranks re-initialize in lockstep, so the
        # count of this rank's inits names the same generation on every rank (a shrunk world is given its own).
        self.prefix = prefix if prefix is not None else f"spmd/{store.add(f'spmd/inits/rank{rank}', 1)}"
        self.simulated = transport_for(backend) == SIMULATED    # the other ranks exist only in this process
        self.hosts, self.host_names = self._simulated_hosts() if self.simulated else self._exchange_hosts()
        self.token = self._agree_token()
        status_store = store.clone()
        self.status_service = StatusService(status_store, rank, self.recorder, owns_store=status_store is not store)
        self.default_group = self.create_group(list(range(world_size)), timeout, backend, name="default")
        if isinstance(self.default_group, ProcessGroup):
            self.default_group.group_desc = "default_pg"     # torch's name for it

    def _exchange_hosts(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(host identity, hostname) of every rank: identities group ranks by host, names are for messages."""
        host = host_identity()
        self.store.set(f"{self.prefix}/host/{self.rank}", json.dumps([host, socket.gethostname()]))
        pairs = [json.loads(value) for value in self.store.multi_get(
            [f"{self.prefix}/host/{rank}" for rank in range(self.world_size)])]
        return tuple(key for key, _ in pairs), tuple(name for _, name in pairs)

    def _simulated_hosts(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """A simulated world's ranks all live on this host."""
        return (host_identity(),) * self.world_size, (socket.gethostname(),) * self.world_size

    def _agree_token(self) -> bytes:
        return self.store.compare_set(f"{self.prefix}/transport_token", "", secrets.token_hex(16))

    def create_group(self, ranks: list[int], timeout: float, backend: str, name: str) -> AnyGroup:
        """Set up a group: its members together, through the store; a non-member gets a NonMemberGroup. `name`
        is the same on every member and never used twice in the world (see new_group).

        `backend` is a name as users write it (see spmd.comm.backend), translated here to a transport."""
        transport_name = transport_for(backend)
        if self.simulated and transport_name != SIMULATED:
            raise ValueError(f"spmd: this world was initialised with backend 'fake', so its other ranks exist only "
                             f"in this process and can't connect over {backend!r}; make its groups with "
                             f"backend='fake' (or none: they inherit it)")
        if self.rank not in ranks:
            group: AnyGroup = NonMemberGroup(name, ranks, self.rank)
        else:
            spec = self.transport_spec(ranks, name, timeout)
            transport = create_transport(transport_name, spec)
            group = ProcessGroup(name, ranks, ranks.index(self.rank), transport, spec.store, self.store, timeout,
                                 self.recorder, transport.name, self.observers)
            group.bound_device_id = self.device
        self.requested_backends[name] = backend
        torch_name = torch_style_name(backend)
        if torch_name is not None:
            self.torch_backend_names[name] = torch_name
        self.groups.append(group)
        return group

    def transport_spec(self, ranks: list[int], name: str, timeout: float) -> TransportSpec:
        """What a transport of the group `name` of `ranks` (this rank among them) needs: its private store
        prefix, the members' hosts and the world's token."""
        return TransportSpec(store=PrefixStore(f"{self.prefix}/group/{name}", self.store), group_name=name,
                             group_rank=ranks.index(self.rank), global_ranks=tuple(ranks),
                             hosts=tuple(self.hosts[r] for r in ranks), timeout=timeout, token=self.token,
                             host_names=tuple(self.host_names[r] for r in ranks))

    def next_group_name(self) -> str:
        """The name of the next group made on every rank (new_group's): the same on each, never reused."""
        self.groups_made += 1
        return str(self.groups_made)

    def destroy(self) -> None:
        self.retire()
        if self.owns_store:
            self.store.close()

    def retire(self) -> None:
        """Close every group of this world and its status service, keeping the store (for a world after it)."""
        self.status_service.stop()
        for group in reversed(self.groups):
            if isinstance(group, ProcessGroup):
                group.close()
        self.groups.clear()


_world: contextvars.ContextVar[World | None] = contextvars.ContextVar("spmd_world", default=None)
# Threads the user starts later find the world through this fallback, but only while the process holds
# exactly one world (a normal one-rank-per-process job); with several thread ranks it stays empty.
_process_worlds: list[World] = []
_process_world_lock = threading.Lock()


def _visible_world() -> World | None:
    world = _world.get()
    if world is None and len(_process_worlds) == 1:
        world = _process_worlds[0]
    return world


def current_world() -> World:
    """This rank's World, or RuntimeError if init_process_group has not run."""
    world = _visible_world()
    if world is None:
        raise RuntimeError("spmd: this rank has no process group; call spmd.init_process_group() first")
    return world


def is_initialized() -> bool:
    return _visible_world() is not None


def init_process_group(backend: str | None = None, init_method: str | None = None,
                       timeout: float | datetime.timedelta | None = None, world_size: int | None = -1,
                       rank: int | None = -1,
                       store: Store | None = None, group_name: str = "", pg_options: object = None,
                       device_id: torch.device | int | None = None, _ranks: list[int] | None = None, *,
                       torch_default_group: bool = True) -> None:
    """Join the job: rendezvous, connect the default group's transport, and make this rank's world current.

    Collective: every rank of the job calls it. With no arguments it reads RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT (as set by `spmdrun`). `backend` is "auto" (the default: shared memory inside a host, tcp
    across hosts), "tcp", "shm" or "threads" (ranks are threads of one process; pass the shared `store`), or
    a torch name: "gloo" (= "auto"), "nccl" (CUDA over torch's NCCL), a device map "cpu:gloo,cuda:nccl",
    "fake" (this process is rank `rank` of a `world_size` job whose other ranks are simulated: no store, no
    launcher, nothing sent; transports/fake.py); any case. `device_id` binds this rank to one device (a CUDA
    one becomes the current device). `group_name`, `pg_options` and torch's private `_ranks` (which only names
    torch's default group; TorchTitan passes it) are accepted for torch's signature and not used (the default group
    is always "default").
    `torch_default_group`: also initialise torch's default group over this world (the "spmd" backend) when this
    rank rendezvoused by itself (no `store` given), so torch's own utilities see its rank and world size
    (torch_backend.py, Note: torch's default group over spmd); pass False where the process must initialise
    torch's default group itself.
    """
    if _world.get() is not None:
        raise RuntimeError("spmd: init_process_group was already called on this rank; call "
                           "destroy_process_group() first to re-initialize")
    backend = backend if backend is not None else "auto"
    transport = transport_for(backend)     # an unavailable or unknown backend fails before any rendezvous
    device = _bind_device(device_id)
    rank = -1 if rank is None else rank
    world_size = -1 if world_size is None else world_size
    _check_rank_arguments(rank, world_size, "the rank= and world_size= arguments")
    seconds = as_seconds(timeout, DEFAULT_TIMEOUT)
    owns_store = store is None
    if store is not None:
        if init_method is not None:
            raise ValueError("spmd: pass either store or init_method to init_process_group, not both")
        if rank < 0 or world_size <= 0:
            raise ValueError(f"spmd.init_process_group: with an explicit store, rank and world_size are required "
                             f"(got rank={rank}, world_size={world_size}); pass both")
    elif transport == SIMULATED:
        if init_method is not None or rank < 0 or world_size <= 0:
            given = f"rank={rank}, world_size={world_size}" + (f", init_method={init_method!r}" if init_method else "")
            raise ValueError(f"spmd.init_process_group: backend 'fake' simulates the other ranks in this process, "
                             f"so there is nothing to rendezvous with: pass rank= and world_size= and no "
                             f"init_method (got {given})")
        store = HashStore(timeout=seconds)
    else:
        if transport == "threads":
            raise ValueError("spmd: the threads backend needs the store its threads share; use "
                             "spmd.testing.run_ranks, or pass one HashStore as store= to every thread")
        store, rank, world_size = rendezvous(init_method or "env://", rank, world_size, seconds)
    world = World(rank, world_size, store, backend, seconds, owns_store, device)
    _world.set(world)
    with _process_world_lock:
        _process_worlds.append(world)
    if torch_default_group and owns_store:     # a rank that rendezvoused itself: one world in its process
        from spmd.comm import torch_backend

        torch_backend.init_torch_default_group(rank, world_size, seconds)


def _bind_device(device_id: torch.device | int | None) -> torch.device | None:
    """The device init_process_group's `device_id` names, validated; a CUDA one becomes the current device.

    As in torch, an int is an index of the accelerator (CUDA here)."""
    if device_id is None:
        return None
    if isinstance(device_id, int) and not isinstance(device_id, bool):
        device = torch.device("cuda", device_id)
    elif isinstance(device_id, torch.device):
        device = device_id
    else:
        raise TypeError(f"spmd: init_process_group device_id must be a torch.device or an int, got "
                        f"{type(device_id).__name__}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"spmd: init_process_group device_id={device_id!r} names a CUDA device, but "
                             f"torch.cuda.is_available() is False; pass device_id=None (or torch.device('cpu'))")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if not 0 <= index < torch.cuda.device_count():
            raise ValueError(f"spmd: init_process_group device_id={device_id!r}: this process sees "
                             f"{torch.cuda.device_count()} CUDA devices")
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        raise ValueError(f"spmd: init_process_group device_id={device_id!r}: spmd binds ranks to cpu or cuda "
                         f"devices, not {device.type}")
    return device


def _check_rank_arguments(rank: int, world_size: int, source: str) -> None:
    """Reject a rank / world_size that can't be right before any rendezvous waits on them; `source` says where
    they came from, for the fix. -1 means "not given yet" (read from the environment or the init_method)."""
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"spmd.init_process_group: {name} must be an int, got {type(value).__name__} "
                            f"{value!r}; check {source}")
    if world_size == 0 or world_size < -1:
        raise ValueError(f"spmd.init_process_group: world_size {world_size} is not a number of ranks (it must be "
                         f"at least 1, or -1 to read WORLD_SIZE); check {source}")
    if rank < -1:
        raise ValueError(f"spmd.init_process_group: rank {rank} is negative (ranks count from 0; -1 reads RANK); "
                         f"check {source}")
    if world_size > 0 and rank >= world_size:
        raise ValueError(f"spmd.init_process_group: rank {rank} is out of range for world_size {world_size} "
                         f"(ranks are 0..{world_size - 1}); check {source}")


BUILT_IN_SCHEMES = ("env", "tcp", "file")
RendezvousHandler = Callable[..., Iterator[tuple[Store, int, int]]]
RENDEZVOUS_HANDLERS: dict[str, RendezvousHandler] = {}     # init_method schemes registered by the user


def _registered_rendezvous(init_method: str, rank: int, world_size: int, timeout: float) -> tuple[Store, int, int]:
    """A registered scheme's (store, rank, world_size): its handler called as torch calls it, with the url's
    query carrying rank and world_size and `timeout` as a timedelta; the first triplet it yields."""
    url = urllib.parse.urlparse(init_method)
    query = dict(urllib.parse.parse_qsl(url.query))
    if rank >= 0:
        query.setdefault("rank", str(rank))
    if world_size > 0:
        query.setdefault("world_size", str(world_size))
    full = urllib.parse.urlunparse(url._replace(query=urllib.parse.urlencode(query)))
    yielded = next(iter(RENDEZVOUS_HANDLERS[url.scheme](full, timeout=datetime.timedelta(seconds=timeout))), None)
    if (not isinstance(yielded, tuple) or len(yielded) != 3 or not isinstance(yielded[0], Store)
            or not all(isinstance(value, int) for value in yielded[1:])):
        raise TypeError(f"spmd: the rendezvous handler of {url.scheme}:// must yield (store, rank, world_size) with "
                        f"an spmd Store (spmd.TCPStore, FileStore, HashStore, ...); it yielded {yielded!r}")
    store, got_rank, got_world_size = yielded
    _check_rank_arguments(got_rank, got_world_size, f"what the {url.scheme}:// rendezvous handler yielded")
    if got_rank < 0 or got_world_size <= 0:
        raise ValueError(f"spmd: the rendezvous handler of {url.scheme}:// yielded rank {got_rank} of "
                         f"{got_world_size}; it must give this process's rank and the world size")
    return store, got_rank, got_world_size


def rendezvous(init_method: str, rank: int, world_size: int, timeout: float) -> tuple[Store, int, int]:
    """Build the store named by `init_method` ("env://", "tcp://host:port", "file:///path")."""
    from spmd.comm.store.file import FileStore
    from spmd.comm.store.tcp import TCPStore

    url = urllib.parse.urlparse(init_method)
    query = urllib.parse.parse_qs(url.query)
    source = "the rank= and world_size= arguments"
    if "rank" in query or "world_size" in query:
        source = f"the rank and world_size in init_method {init_method!r}"
        rank = _query_int(query, "rank", rank, init_method)
        world_size = _query_int(query, "world_size", world_size, init_method)
    if url.scheme == "env" and (rank < 0 or world_size < 0):
        source = "RANK / WORLD_SIZE"
        rank = rank if rank >= 0 else env.required_int("RANK")
        world_size = world_size if world_size >= 0 else env.required_int("WORLD_SIZE")
    _check_rank_arguments(rank, world_size, source)
    missing = (f"spmd.init_process_group: init_method {init_method!r} needs rank and world_size; pass rank= and "
               f"world_size=, or add ?rank=R&world_size=N to it")
    if url.scheme == "env":
        host, port = env.required_str("MASTER_ADDR"), env.required_int("MASTER_PORT")
    elif url.scheme == "tcp":
        host, port = url.hostname or "", url.port or 0
        if not host or not port:
            raise ValueError(f"spmd: init_method {init_method!r} needs tcp://host:port")
    elif url.scheme == "file":
        if rank < 0 or world_size <= 0:
            raise ValueError(missing)
        return FileStore(url.path, world_size, timeout=timeout), rank, world_size
    elif url.scheme in RENDEZVOUS_HANDLERS:
        return _registered_rendezvous(init_method, rank, world_size, timeout)
    else:
        schemes = ", ".join(f"{scheme}://" for scheme in (*BUILT_IN_SCHEMES, *RENDEZVOUS_HANDLERS))
        raise ValueError(f"spmd: init_method {init_method!r} must start with one of {schemes} (register a scheme "
                         f"of your own with spmd.register_rendezvous_handler)")
    if rank < 0 or world_size <= 0:
        raise ValueError(missing)
    attempt = env.torchrun_agent_store_attempt() if url.scheme == "env" else None
    if attempt is not None:
        # torchrun's agent serves the job's store on MASTER_PORT for its workers (torch's own workers connect to
        # it, rank 0 too): spmd's world rendezvouses there, through torch's store client
        from spmd.comm import torch_backend

        return torch_backend.torchrun_agent_store(host, port, timeout, attempt), rank, world_size
    token = env.store_token()
    if rank != 0 or port == 0:
        store: Store = TCPStore(host, port, world_size=world_size, is_master=rank == 0, timeout=timeout, token=token)
    else:
        store = _kept_master(host, port, world_size, timeout, token)
    return store, rank, world_size


# Note: rank 0 keeps its store server
# With env:// or tcp://, rank 0 hosts the job's TCPStore. destroy_process_group() then init_process_group() in one
# job (a notebook, tutorials run in turn) must not close that server: another rank may already be re-joining
# through it (it reached the old server before rank 0 destroyed), and would lose its connection mid-rendezvous.
# So rank 0 keeps the server for the life of its process, keyed by address, port and token, and each world gets a
# client of it; a re-init finds it there. Every init counts itself per rank in the store (World.prefix), so the
# worlds over one server never read each other's keys.
_kept_masters: dict[tuple[int, str, int, str | None], Store] = {}
_kept_masters_lock = threading.Lock()


def _kept_master(host: str, port: int, world_size: int, timeout: float, token: str | None) -> Store:
    """A client of the TCPStore server rank 0 hosts at host:port, started by the first init that needs it (Note:
    rank 0 keeps its store server)."""
    from spmd.comm.store.tcp import TCPStore

    key = (os.getpid(), host, port, token)
    with _kept_masters_lock:
        master = _kept_masters.get(key)
        if master is None:
            master = TCPStore(host, port, world_size=world_size, is_master=True, timeout=timeout, token=token)
            _kept_masters[key] = master
    client = master.clone()
    client.set_timeout(timeout)
    return client


def _query_int(query: dict[str, list[str]], name: str, default: int, init_method: str) -> int:
    if name not in query:
        return default
    try:
        return int(query[name][0])
    except ValueError:
        raise ValueError(f"spmd.init_process_group: {name}={query[name][0]!r} in init_method {init_method!r} is "
                         f"not an integer") from None


def destroy_process_group(group: AnyGroup | None = None) -> None:
    """Close `group`, or with None every group and this rank's world (after which init may run again)."""
    world = current_world()
    if group is not None:
        if isinstance(group, ProcessGroup):
            group.close()
        if group in world.groups:
            world.groups.remove(group)
        return
    from spmd.comm import torch_backend

    if world.owns_store:
        torch_backend.destroy_torch_default_group()
    else:
        torch_backend.release_torch_default_group()
    world.destroy()
    _world.set(None)
    with _process_world_lock:
        if world in _process_worlds:
            _process_worlds.remove(world)


def default_group() -> ProcessGroup:
    group = current_world().default_group
    assert isinstance(group, ProcessGroup)
    return group


def new_group(ranks: list[int] | None = None, timeout: float | datetime.timedelta | None = None,
              backend: str | None = None, pg_options: object = None, use_local_synchronization: bool = False,
              group_desc: str | None = None, device_id: object = None, sort_ranks: bool = True) -> AnyGroup:
    """Create a group of `ranks` (all ranks if None). Collective: every rank of the world calls it, in the
    same order, including ranks not in `ranks`, which get a NonMemberGroup they can't communicate on.

    With `use_local_synchronization=True` (as torch's), only the members call it, in the same order among
    themselves; a non-member that calls it gets a NonMemberGroup and nothing else happens. Group ranks follow
    the global ranks' order (`sort_ranks=False` with ranks out of order, torch's group ranks in the given order,
    is refused). `group_desc` is kept as the group's `group_desc`; `pg_options` and `device_id` are accepted for
    torch's signature and not used (a group's device is the one init_process_group's device_id bound)."""
    world = current_world()
    given = list(range(world.world_size)) if ranks is None else _check_members(ranks, world)
    members = sorted(given)
    if not sort_ranks and given != members:
        raise ValueError(f"spmd.new_group on rank {world.rank}: sort_ranks=False with ranks {given} out of order; "
                         f"spmd's group ranks follow the global ranks' order ({members}): pass them sorted")
    if use_local_synchronization:
        if world.rank not in members:
            return NonMemberGroup(f"local:{members}", members, world.rank)
        key = tuple(members)
        world.local_groups_made[key] += 1   # names it the same on every member, never on anyone else
        name = f"local/{'-'.join(map(str, key))}/{world.local_groups_made[key]}"
    else:
        name = world.next_group_name()
    group = world.create_group(members, as_seconds(timeout, world.timeout), backend or world.backend, name)
    if group_desc is not None and isinstance(group, ProcessGroup):
        group.group_desc = group_desc
    return group


def _check_members(ranks: object, world: World) -> list[int]:
    """`ranks` as a list, or an error naming the calling rank and what is wrong, before any group is made."""
    where = f"spmd.new_group on rank {world.rank}"
    if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
        raise TypeError(f"{where}: ranks must be a list of ints (or None for all ranks), got "
                        f"{type(ranks).__name__}")
    members = list(ranks)
    for rank in members:
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"{where}: ranks {members} hold {rank!r} ({type(rank).__name__}); list global ranks "
                            f"as ints")
        if not 0 <= rank < world.world_size:
            raise ValueError(f"{where}: rank {rank} in ranks {members} is out of range for world_size "
                             f"{world.world_size} (ranks are 0..{world.world_size - 1})")
    repeated = sorted(rank for rank, count in collections.Counter(members).items() if count > 1)
    if repeated:
        raise ValueError(f"{where}: ranks {members} list rank(s) {repeated} more than once; list each rank once")
    if not members:
        raise ValueError(f"{where}: ranks is empty; a group needs at least one rank (None means all ranks)")
    return members


def new_subgroups(group_size: int | None = None, group: AnyGroup | None = None,
                  timeout: float | datetime.timedelta | None = None, backend: str | None = None,
                  pg_options: object = None, group_desc: str | None = None) -> tuple[AnyGroup | None, list[AnyGroup]]:
    """Split `group` (default: the world) into contiguous groups of `group_size` of its ranks; returns (this rank's
    group, or None outside `group`, and all of them). Without `group_size`, one group per host: torch's default
    is one per machine's GPUs, and spmd's ranks per host are what it knows of the machine. Collective: every rank
    of the world calls it. `group_desc` becomes each group's `group_desc`; `pg_options` is accepted for torch's
    signature and not used."""
    world = current_world()
    ranks = list(range(world.world_size)) if group is None else list(group.ranks)   # a non-member knows them too
    where = f"spmd.new_subgroups on rank {world.rank}"
    if group_size is None:
        per_host = collections.Counter(world.hosts[rank] for rank in ranks)
        if len(set(per_host.values())) != 1:
            raise ValueError(f"{where}: the hosts hold different numbers of the group's ranks "
                             f"({sorted(per_host.values())}); pass group_size")
        group_size = next(iter(per_host.values()))
    if group_size <= 0 or len(ranks) % group_size:
        raise ValueError(f"{where}: group_size {group_size} must divide the group's size {len(ranks)}")
    groups = [new_group(ranks[start:start + group_size], timeout=timeout, backend=backend, group_desc=group_desc)
              for start in range(0, len(ranks), group_size)]
    mine = [g for g in groups if world.rank in g.ranks]
    return (mine[0] if mine else None), groups


def new_subgroups_by_enumeration(ranks_per_subgroup_list: list[list[int]], timeout: float | datetime.timedelta |
                                 None = None, backend: str | None = None, pg_options: object = None,
                                 group_desc: str | None = None) -> tuple[AnyGroup | None, list[AnyGroup]]:
    """A group per list of ranks (the lists disjoint); returns (this rank's group or None, all of them).
    Collective: every rank calls it with the same lists. `group_desc` becomes each group's `group_desc`;
    `pg_options` is accepted for torch's signature and not used."""
    world = current_world()
    seen: set[int] = set()
    for ranks in ranks_per_subgroup_list:
        members = _check_members(ranks, world)
        if seen & set(members):
            raise ValueError(f"spmd.new_subgroups_by_enumeration on rank {world.rank}: rank(s) "
                             f"{sorted(seen & set(members))} are in more than one of {ranks_per_subgroup_list}")
        seen |= set(members)
    groups = [new_group(ranks, timeout=timeout, backend=backend, group_desc=group_desc)
              for ranks in ranks_per_subgroup_list]
    mine = [g for g in groups if world.rank in g.ranks]
    return (mine[0] if mine else None), groups


def split_group(parent_pg: AnyGroup | None = None, split_ranks: list[list[int]] | None = None,
                timeout: float | datetime.timedelta | None = None, pg_options: object = None,
                group_desc: str | None = None, backend: str | None = None) -> ProcessGroup | None:
    """Split `parent_pg` (default: the world) into disjoint groups of its group ranks, `split_ranks`; returns
    this rank's group, or None if no split holds it. Collective over the parent only: every member calls it
    with the same splits. The groups keep the parent's backend unless `backend` is given; `group_desc` becomes
    the group's `group_desc`; `pg_options` is accepted for torch's signature and not used."""
    world = current_world()
    parent = resolve_group(parent_pg, "split_group")
    where = f"spmd.split_group on rank {world.rank}"
    if not isinstance(split_ranks, (list, tuple)) or not split_ranks:
        raise ValueError(f"{where}: split_ranks must be a non-empty list of lists of the parent's group ranks, "
                         f"got {split_ranks!r}")
    seen: set[int] = set()
    mine: list[int] | None = None
    for split in split_ranks:
        if not isinstance(split, (list, tuple)) or not split or any(
                isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < parent.size() for r in split):
            raise ValueError(f"{where}: split {split!r} must be a non-empty list of group ranks of the parent "
                             f"(0..{parent.size() - 1})")
        if seen & set(split) or len(set(split)) != len(split):
            raise ValueError(f"{where}: group rank(s) {sorted(seen & set(split)) or split} appear more than once "
                             f"in {split_ranks}; the splits must be disjoint")
        seen |= set(split)
        if parent.group_rank in split:
            mine = sorted(split)
    if mine is None:
        return None
    chosen = backend or world.requested_backends.get(parent.name, world.backend)
    group = new_group([parent.ranks[r] for r in mine], timeout=timeout if timeout is not None else parent.timeout,
                      backend=chosen, use_local_synchronization=True, group_desc=group_desc)
    assert isinstance(group, ProcessGroup)
    return group


SHRINK_DEFAULT, SHRINK_ABORT = 0, 1     # torch's shrink_flags: close the group after its queued ops, or abort them


def shrink_group(ranks_to_exclude: list[int], group: AnyGroup | None = None, shrink_flags: int = SHRINK_DEFAULT,
                 pg_options: object = None) -> ProcessGroup:
    """A group of `group`'s ranks but `ranks_to_exclude` (its group ranks; `group` defaults to the world), made
    by the remaining ranks alone, so it works when the excluded ones are dead; `group` is destroyed. Shrinking
    the world replaces it: the ranks are renumbered in order (get_rank and get_world_size change), every other
    group is destroyed, and the returned group is the new default group. SHRINK_ABORT fails the old group's
    queued operations instead of running them. `pg_options` is accepted for torch's signature and not used."""
    world = current_world()
    target = resolve_group(group, "shrink_group")
    excluded = _check_shrink(ranks_to_exclude, target, shrink_flags, world.rank)
    remaining = [rank for at, rank in enumerate(target.ranks) if at not in excluded]
    if shrink_flags == SHRINK_ABORT:
        target.abort(GroupAbortedError(f"spmd: rank {world.rank} shrank group {target.name!r} with SHRINK_ABORT, "
                                       f"excluding its group rank(s) {sorted(excluded)}"))
    if target is not world.default_group:
        shrunk = new_group(remaining, timeout=target.timeout, use_local_synchronization=True,
                           backend=world.requested_backends.get(target.name, world.backend))
        destroy_process_group(target)
        assert isinstance(shrunk, ProcessGroup)
        return shrunk
    return _shrink_world(world, remaining)


def _check_shrink(ranks_to_exclude: object, target: ProcessGroup, shrink_flags: object, rank: int) -> set[int]:
    """The group ranks to exclude, or an error naming the calling rank, before anything changes."""
    where = f"spmd.shrink_group on rank {rank}"
    if shrink_flags not in (SHRINK_DEFAULT, SHRINK_ABORT) or isinstance(shrink_flags, bool):
        raise ValueError(f"{where}: shrink_flags must be SHRINK_DEFAULT ({SHRINK_DEFAULT}) or SHRINK_ABORT "
                         f"({SHRINK_ABORT}), got {shrink_flags!r}")
    if not isinstance(ranks_to_exclude, list) or not ranks_to_exclude:
        raise ValueError(f"{where}: ranks_to_exclude must be a non-empty list of group ranks of {target.name!r} "
                         f"(0..{target.size() - 1}), got {ranks_to_exclude!r}")
    bad = [r for r in ranks_to_exclude if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < target.size()]
    if bad:
        raise ValueError(f"{where}: ranks_to_exclude {ranks_to_exclude} hold {bad}, not group ranks of "
                         f"{target.name!r} (0..{target.size() - 1})")
    excluded = set(ranks_to_exclude)
    if len(excluded) != len(ranks_to_exclude):
        raise ValueError(f"{where}: ranks_to_exclude {ranks_to_exclude} list a rank more than once")
    if len(excluded) == target.size():
        raise ValueError(f"{where}: ranks_to_exclude {ranks_to_exclude} exclude every rank of {target.name!r}; "
                         f"at least one must remain")
    if target.group_rank in excluded:
        raise RuntimeError(f"{where}: this rank (group rank {target.group_rank} of {target.name!r}) is in "
                           f"ranks_to_exclude {ranks_to_exclude}; only the remaining ranks call shrink_group")
    return excluded


def _shrink_world(world: World, remaining: list[int]) -> ProcessGroup:
    """Replace `world` by one of its `remaining` ranks, renumbered, over the same store: the remaining ranks
    name its keys alike (the old world's prefix and who remains), and no excluded rank is waited for."""
    from spmd.comm import torch_backend

    torch_owned = world.owns_store and torch_backend.destroy_torch_default_group()
    world.retire()
    rank = remaining.index(world.rank)
    shrunk = World(rank, len(remaining), world.store, world.backend, world.timeout, world.owns_store, world.device,
                   prefix=f"{world.prefix}/shrunk/{'-'.join(map(str, remaining))}")
    _world.set(shrunk)
    with _process_world_lock:
        _process_worlds[:] = [shrunk if w is world else w for w in _process_worlds]
    if torch_owned:
        torch_backend.init_torch_default_group(rank, len(remaining), world.timeout)
    return default_group()


def get_pg_count() -> int:
    """How many groups this rank's world holds now (the default group included), as torch counts them."""
    return len(current_world().groups)


def get_node_local_rank(fallback_rank: int | None = None) -> int:
    """This process's rank on its node, from LOCAL_RANK (spmdrun and torchrun set it), else `fallback_rank`."""
    local = env.optional_str("LOCAL_RANK")
    if local is not None:
        return int(local)
    if fallback_rank is not None:
        return int(fallback_rank)
    raise RuntimeError("spmd.get_node_local_rank: LOCAL_RANK is not set (spmdrun sets it); pass fallback_rank= "
                       "for a process started without a launcher")


class _WorldGroupMeta(type):
    @property
    def WORLD(cls) -> ProcessGroup | None:
        """This rank's default group, None before init_process_group."""
        world = _visible_world()
        return None if world is None else world.default_group


class group(metaclass=_WorldGroupMeta):
    """torch's `group.WORLD`: this rank's default group (None before init_process_group), for `group=` args."""


class GroupMember(metaclass=_WorldGroupMeta):
    """torch's GroupMember: `WORLD` as in `group`, and `NON_GROUP_MEMBER`, torch's rank of a non-member."""

    NON_GROUP_MEMBER = -100


default_pg_timeout = datetime.timedelta(seconds=DEFAULT_TIMEOUT)   # spmd's default (torch's is 30 minutes)


def set_group_timeout(timeout: float | datetime.timedelta, group: AnyGroup | None = None) -> None:
    """torch's `_set_pg_timeout`: the timeout of `group`'s operations from now on (default group by default), as
    TorchTitan shortens it after the first step. This rank's view of the group: every member should set it."""
    resolved = resolve_group(group, "_set_pg_timeout")
    seconds = as_seconds(timeout, resolved.timeout, "_set_pg_timeout: timeout")
    if seconds <= 0:
        raise ValueError(f"_set_pg_timeout on rank {resolved.global_rank}: timeout must be positive, got {timeout}")
    resolved.timeout = seconds


def resolve_group(group: AnyGroup | None, op: str) -> ProcessGroup:
    """The group an operation runs on: `group`, or the default group; ValueError for a non-member."""
    if group is None:
        return default_group()
    if isinstance(group, NonMemberGroup):
        raise group.not_member_error(op)
    if not isinstance(group, ProcessGroup):
        standing_for = getattr(group, "spmd_group", None)     # torch's view of an spmd group (torch_backend)
        if isinstance(standing_for, ProcessGroup):
            return standing_for
        raise TypeError(f"{op}: group must be a spmd ProcessGroup, got {type(group).__name__}")
    return group


def group_named(name: str, op: str) -> ProcessGroup:
    """This rank's group called `name` (torch's functional collectives and custom ops name groups so)."""
    world = current_world()
    for candidate in world.groups:
        if isinstance(candidate, ProcessGroup) and candidate.name == name:
            return candidate
    raise ValueError(f"{op} on rank {world.rank}: no group named {name!r}")


def get_rank(group: AnyGroup | None = None) -> int:
    """This rank's global rank, or its rank inside `group` (-1 if not a member)."""
    if group is None:
        return current_world().rank
    return group.group_rank if isinstance(group, ProcessGroup) else -1


def get_world_size(group: AnyGroup | None = None) -> int:
    if group is None:
        return current_world().world_size
    return len(group.ranks)


def get_process_group_ranks(group: AnyGroup) -> list[int]:
    return list(group.ranks)


def get_group_rank(group: AnyGroup, global_rank: int) -> int:
    if global_rank not in group.ranks:
        raise ValueError(f"spmd: rank {global_rank} is not in group '{group.name}' (ranks {group.ranks})")
    return group.ranks.index(global_rank)


def get_global_rank(group: AnyGroup, group_rank: int) -> int:
    if not 0 <= group_rank < len(group.ranks):
        raise ValueError(f"spmd: group rank {group_rank} is out of range for group '{group.name}' "
                         f"of size {len(group.ranks)}")
    return group.ranks[group_rank]


def get_backend(group: AnyGroup | None = None) -> str:
    """The group's backend as torch prints it ("gloo", "cpu:gloo,cuda:nccl") when it was asked for by a torch
    name, else the transport spmd resolved: "shm" (one host), "shm+tcp" (shared memory inside hosts, tcp between
    them), "tcp", "threads"."""
    resolved = resolve_group(group, "get_backend")
    return current_world().torch_backend_names.get(resolved.name, resolved.backend)
