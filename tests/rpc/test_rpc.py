"""spmd.rpc on thread ranks (over the threads transport, and for calls and a parameter server also over tcp and
shm): calls by name, rank or WorkerInfo (to itself too), nested calls, remote errors raised
as themselves naming the worker, timeouts, async_execution, RRefs (to_here, local_value, proxies, forks to a third
worker, the owner dropping a value once no RRef names it, a value holding RRefs of its owner too), init_rpc
returning once every worker serves, results with autograd history sent as data outside a dist_autograd context,
graceful shutdown (and its timeout naming the workers that did not come), bad arguments; distributed autograd
(gradients on every worker equal one process's, across nested calls and async functions) and
DistributedOptimizer / RemoteModule training a parameter server bit for bit as one process trains the model."""

from __future__ import annotations

import copy
import gc
import socket
import threading
from typing import Any

import pytest
import torch
from torch import nn

import spmd
import spmd.autograd as dist_autograd
import spmd.rpc as rpc
from spmd.nn import RemoteModule
from spmd.optim import DistributedOptimizer
from spmd.rpc import api as rpc_api
from spmd.testing import run_ranks

TIMEOUT = 60.0


def _run(body: Any, world_size: int = 3, backend: str = "threads") -> list[Any]:
    def worker(rank: int, size: int) -> Any:
        rpc.init_rpc(f"w{rank}", rank=rank, world_size=size)
        try:
            return body(rank)
        finally:
            rpc.shutdown()

    return run_ranks(worker, world_size=world_size, timeout=TIMEOUT, backend=backend)


def add(a: Any, b: Any) -> Any:
    return a + b


def whoami() -> str:
    return rpc.get_worker_info().name


def relay(x: Any) -> Any:
    return rpc.rpc_sync("w2", add, (x, 1))


class Refusal(ValueError):
    pass


def refuse(reason: str) -> None:
    raise Refusal(reason)


@pytest.mark.parametrize("backend", ["threads", "tcp", "shm"])
def test_calls_reach_the_worker_named_and_return_its_result(backend: str) -> None:
    def body(rank: int) -> dict[str, Any]:
        if rank != 0:
            return {}
        w1 = rpc.get_worker_info("w1")
        return {"sync": rpc.rpc_sync("w1", add, (torch.ones(2), 2)), "who": [
                    rpc.rpc_sync(to, whoami) for to in ("w1", 2, w1, "w0")],
                "async": rpc.rpc_async("w2", add, args=(3,), kwargs={"b": 4}).wait(),
                "nested": rpc.rpc_sync("w1", relay, (10,)), "me": rpc.get_worker_info(), "w1": w1,
                "large": rpc.rpc_sync("w2", add, (torch.arange(1 << 18, dtype=torch.float32), 1)),
                "by_reference": rpc.rpc_sync("w2", add, (torch.arange(1 << 20, dtype=torch.float32), 1)),
                "reads_me": rpc_api._agent.get().channels.reads_me,
                "sockets": {sock.family for sock in rpc_api._agent.get().channels.sockets if sock is not None}}

    got = _run(body, backend=backend)[0]
    assert got["sockets"] == {socket.AF_UNIX}     # whatever the job's transport, on one host
    assert got["reads_me"] == {1, 2}                # thread ranks read each other's memory: 4 MiB by reference
    assert torch.equal(got["by_reference"], torch.arange(1 << 20, dtype=torch.float32) + 1)
    assert torch.equal(got["large"], torch.arange(1 << 18, dtype=torch.float32) + 1)      # out of band
    assert torch.equal(got["sync"], torch.full((2,), 3.0))
    assert got["who"] == ["w1", "w2", "w1", "w0"] and got["async"] == 7 and got["nested"] == 11
    assert (got["me"].name, got["me"].id, got["w1"].id) == ("w0", 0, 1)


def test_a_remote_error_is_raised_here_as_itself_naming_the_worker() -> None:
    def body(rank: int) -> str:
        if rank != 0:
            return ""
        with pytest.raises(Refusal, match="no thanks") as raised:
            rpc.rpc_sync("w1", refuse, ("no thanks",))
        return "\n".join(raised.value.__notes__)

    note = _run(body)[0]
    assert "raised by rpc_async(refuse) on worker w1 (rank 1)" in note and "Refusal: no thanks" in note


_release = threading.Event()


def wait_for_release() -> str:
    _release.wait(TIMEOUT)
    return "released"


def test_a_call_past_its_timeout_fails_and_the_worker_goes_on() -> None:
    _release.clear()

    def body(rank: int) -> Any:
        if rank != 0:
            return None
        for to in ("w1", "w0"):       # a call to this worker itself keeps its timeout too
            _release.clear()
            with pytest.raises(TimeoutError, match=rf"rpc_async\(wait_for_release\) on worker {to} \(rank "
                                                   rf"{to[1]}\) ran past"):
                rpc.rpc_sync(to, wait_for_release, timeout=0.2)
            _release.set()
        return [rpc.rpc_sync(to, wait_for_release) for to in ("w1", "w0")]

    assert _run(body, world_size=2)[0] == ["released", "released"]


@rpc.functions.async_execution
def add_later(to: str, x: int) -> torch.futures.Future:
    """Answers once another worker's call returns, holding no thread meanwhile."""
    return rpc.rpc_async(to, add, (x, 100)).then(lambda done: done.wait() * 2)


def test_async_execution_answers_when_its_future_completes() -> None:
    def body(rank: int) -> Any:
        return rpc.rpc_sync("w1", add_later, ("w2", 1)) if rank == 0 else None

    assert _run(body)[0] == 202


class Counter:
    def __init__(self, start: int) -> None:
        self.value = start

    def bump(self, by: int) -> int:
        self.value += by
        return self.value


def read_through(rref: rpc.RRef) -> Any:
    """On a third worker: an RRef it was sent, read from its owner."""
    return rref.rpc_sync().bump(0), rref.owner_name(), rref.is_owner()


def held_by_owner(rref: rpc.RRef) -> tuple[bool, int]:
    """On the owner: an RRef of its own sent back to it (counted as it is unpickled, no fork call)."""
    return rref.is_owner(), rref.local_value().value


def owner_count_settled(rref_id: tuple[int, int], expected: int) -> int:
    """On the owner: the count of `rref_id` once it is `expected`, or what it is after the timeout (a release from
    another worker is a message, which may still be on its way when a call to that worker has returned)."""
    table = rpc_api._table()
    with table.changed:
        table.changed.wait_for(lambda: table.counts.get(rref_id, 0) == expected, TIMEOUT)
        return table.counts.get(rref_id, 0)


def wait_released(rref_id: tuple[int, int]) -> bool:
    """On the owner: whether the value of `rref_id` is dropped within the timeout (its releases are messages)."""
    table = rpc_api._table()
    with table.changed:
        return table.changed.wait_for(lambda: rref_id not in table.values, TIMEOUT)


def test_rrefs_reach_their_value_and_the_owner_drops_it_with_the_last_rref() -> None:
    def body(rank: int) -> dict[str, Any]:
        if rank != 0:
            return {}
        counter = rpc.remote("w1", Counter, (5,))
        got = {"to_here": counter.to_here().value, "bumped": counter.rpc_sync().bump(2),
                "async": counter.rpc_async().bump(3).wait(), "owner": counter.owner().name,
                "mine": counter.is_owner(), "third": rpc.rpc_sync("w2", read_through, (counter,))}
        got["remote"] = counter.remote().bump(1).to_here()
        local = rpc.RRef(torch.arange(3))
        got["local"] = (local.is_owner(), local.local_value(), local.to_here())
        rref_id = counter._id
        got["counted"] = rpc.rpc_sync("w1", owner_count_settled, (rref_id, 1))
        got["at_owner"] = [rpc.rpc_sync("w1", held_by_owner, (counter,)) for _ in range(3)]
        del counter
        gc.collect()
        got["released"] = rpc.rpc_sync("w1", wait_released, (rref_id,))
        return got

    got = _run(body)[0]
    assert (got["to_here"], got["bumped"], got["async"], got["remote"]) == (5, 7, 10, 11)
    assert got["owner"] == "w1" and not got["mine"] and got["third"] == (10, "w1", False)
    assert got["local"][0] and torch.equal(got["local"][1], torch.arange(3))
    assert got["at_owner"] == [(True, 11)] * 3
    assert got["counted"] == 1 and got["released"]     # the fork to w2 and the copies sent to w1 came and went


def rrefs_of_its_own() -> list[rpc.RRef]:
    """A value holding RRefs its owner owns too (a parameter server's parameter_rrefs())."""
    return [rpc.RRef(torch.ones(1)), rpc.RRef(torch.zeros(1))]


def test_a_value_holding_its_owners_rrefs_is_dropped_and_the_owner_serves_on() -> None:
    # pytorch/examples' rpc/pipeline: dropping such a value released its RRefs through the owner's table while the
    # table's lock was held; the owner deadlocked and every later call to it hung
    def body(rank: int) -> Any:
        if rank != 0:
            return None
        held = rpc.remote("w1", rrefs_of_its_own)
        values = [rref.to_here() for rref in held.to_here()]
        rref_id = held._id
        del held
        gc.collect()
        return values, rpc.rpc_sync("w1", wait_released, (rref_id,)), rpc.rpc_sync("w1", add, (1, 2), timeout=20)

    values, released, answer = _run(body, world_size=2)[0]
    assert [v.item() for v in values] == [1.0, 0.0] and released and answer == 3


_LAYER = nn.Linear(2, 3)


def layer_forward(x: torch.Tensor) -> torch.Tensor:
    return _LAYER(x)


def test_a_result_with_autograd_history_arrives_as_data_outside_a_dist_autograd_context() -> None:
    # as torch's RPC: the history stays with the sender, the receiver gets a leaf that requires grad (an
    # evaluation loop calling a remote model's forward, pytorch/examples' rpc/parameter_server)
    def body(rank: int) -> Any:
        if rank != 0:
            return None
        with torch.no_grad():
            return rpc.rpc_sync("w1", layer_forward, (torch.ones(1, 2),))

    got = _run(body, world_size=2)[0]
    assert got.requires_grad and got.grad_fn is None
    torch.testing.assert_close(got.detach(), _LAYER(torch.ones(1, 2)).detach())


def test_init_rpc_returns_once_every_worker_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    # as torch's init_rpc ends with a barrier: a worker's first call finds its peer past init_rpc (pytorch/examples'
    # rpc/batch server sets up its state right after init_rpc, and its clients call it right after theirs)
    from spmd.rpc.agent import RpcAgent

    returned = threading.Event()
    seen: list[bool] = []
    start = RpcAgent.start

    def slow_start(agent: RpcAgent) -> None:
        if agent.rank == 1:          # while rank 1's agent is not yet serving, rank 0's init_rpc must not return
            seen.append(returned.wait(1.0))
        start(agent)

    monkeypatch.setattr(RpcAgent, "start", slow_start)

    def body(rank: int) -> None:
        if rank == 0:
            returned.set()

    _run(body, world_size=2)
    assert seen == [False]


def test_bad_arguments_are_refused_naming_them() -> None:
    def body(rank: int) -> list[str]:
        errors = []
        for call in (lambda: rpc.rpc_sync("nobody", add, (1, 2)), lambda: rpc.rpc_sync(7, add, (1, 2)),
                     lambda: rpc.rpc_sync("w1", add, (1, 2), timeout=-3),
                     lambda: rpc.RRef(1).rpc_sync().missing_method()):
            with pytest.raises((ValueError, AttributeError)) as raised:
                call()
            errors.append(str(raised.value))
        return errors

    errors = _run(body, world_size=2)[0]
    assert "no worker named 'nobody'" in errors[0] and "7 names no worker" in errors[1]
    assert "timeout must be 0 (none) or positive" in errors[2] and "missing_method" in errors[3]
    with pytest.raises(RuntimeError, match="RPC is not initialised on this worker"):
        rpc.rpc_sync("w1", add, (1, 2))
    with pytest.raises(ValueError, match=r"remote_device must be .* got 'cpu'"):   # a device names no worker
        RemoteModule("cpu", nn.Linear, args=(4, 8))
    with pytest.raises(ValueError, match="worker names must be unique; \\['twin'\\] is used by ranks \\[0, 1\\]"):
        run_ranks(lambda rank, size: rpc.init_rpc("twin", rank=rank, world_size=size), world_size=2,
                  timeout=TIMEOUT)


# -- distributed autograd --------------------------------------------------------------------------------------

torch.manual_seed(0)
_BASE = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
_X = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
_Y = torch.randn(5, 3, generator=torch.Generator().manual_seed(2))


class Server:
    def __init__(self) -> None:
        self.model = copy.deepcopy(_BASE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def parameter_rrefs(self) -> list[rpc.RRef]:
        return [rpc.RRef(p) for p in self.model.parameters()]


def served_forward(server: rpc.RRef, x: torch.Tensor) -> torch.Tensor:
    return server.local_value().forward(x)


def through(to: str, server: rpc.RRef, x: torch.Tensor) -> torch.Tensor:
    """A call that calls on: w1 squares, w2 runs the model."""
    return rpc.rpc_sync(to, served_forward, (server, x * x))


@rpc.functions.async_execution
def forward_later(server: rpc.RRef, x: torch.Tensor) -> torch.futures.Future:
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(served_forward(server, x) * 3)
    return done


def server_gradients(context_id: int) -> list[torch.Tensor]:
    server = _servers[rpc.get_worker_info().name]
    grads = dist_autograd.get_gradients(context_id)
    return [grads[p].clone() for p in server.model.parameters()]


_servers: dict[str, Server] = {}


def make_server() -> Server:
    server = _servers[rpc.get_worker_info().name] = Server()
    return server


@pytest.mark.parametrize("path", ["direct", "nested", "async"])
def test_distributed_gradients_equal_one_process_on_every_worker(path: str) -> None:
    local = torch.randn(4, 4, generator=torch.Generator().manual_seed(3))      # the caller's own parameter

    def body(rank: int) -> Any:
        if rank != 0:
            return None
        server = rpc.remote("w2", make_server)
        weight = local.clone().requires_grad_()
        with dist_autograd.context() as context_id:
            x = _X @ weight
            if path == "direct":
                out = rpc.rpc_sync("w2", served_forward, (server, x))
            elif path == "nested":
                out = rpc.rpc_sync("w1", through, ("w2", server, x))
            else:
                out = rpc.rpc_sync("w2", forward_later, (server, x))
            loss = ((out - _Y) ** 2).mean()
            dist_autograd.backward(context_id, [loss])
            mine = dist_autograd.get_gradients(context_id)[weight]
            theirs = rpc.rpc_sync("w2", server_gradients, (context_id,))
        assert weight.grad is None                   # the gradients live in the context, not in .grad
        return mine, theirs

    mine, theirs = _run(body)[0]
    model, weight = copy.deepcopy(_BASE), local.clone().requires_grad_()
    x = _X @ weight
    out = model(x * x if path == "nested" else x) * (3 if path == "async" else 1)
    ((out - _Y) ** 2).mean().backward()
    torch.testing.assert_close(mine, weight.grad, rtol=1e-6, atol=1e-7)
    for got, param in zip(theirs, model.parameters(), strict=True):
        torch.testing.assert_close(got, param.grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", ["threads", "tcp", "shm"])
def test_a_parameter_server_trains_bit_for_bit_as_one_process(backend: str) -> None:
    def body(rank: int) -> Any:
        if rank != 0:
            return None
        server = rpc.remote("w1", Server)
        optimizer = DistributedOptimizer(torch.optim.SGD, server.rpc_sync().parameter_rrefs(), lr=0.1, momentum=0.9)
        for _ in range(3):
            with dist_autograd.context() as context_id:
                loss = ((rpc.rpc_sync("w1", served_forward, (server, _X)) - _Y) ** 2).mean()
                dist_autograd.backward(context_id, [loss])
                optimizer.step(context_id)
        return [p.to_here() for p in server.rpc_sync().parameter_rrefs()]

    got = _run(body, world_size=2, backend=backend)[0]
    model = copy.deepcopy(_BASE)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        optimizer.zero_grad()
        ((model(_X) - _Y) ** 2).mean().backward()
        optimizer.step()
    for value, param in zip(got, model.parameters(), strict=True):
        assert torch.equal(value, param.detach())


def test_remote_modules_on_two_workers_train_as_one_process() -> None:
    def body(rank: int) -> Any:
        if rank != 0:
            return None
        torch.manual_seed(0)
        first = RemoteModule("w1", nn.Linear, args=(4, 8))        # torch's form: the worker's cpu
        second = RemoteModule("rank:2/cpu", nn.Linear, args=(8, 3))
        optimizer = DistributedOptimizer(torch.optim.Adam, first.remote_parameters() + second.remote_parameters(),
                                         lr=0.01)
        for _ in range(2):
            with dist_autograd.context() as context_id:
                loss = ((second(torch.tanh(first(_X))) - _Y) ** 2).mean()
                dist_autograd.backward(context_id, [loss])
                optimizer.step(context_id)
        return [p.to_here() for p in first.remote_parameters() + second.remote_parameters()]

    got = _run(body)[0]
    torch.manual_seed(0)
    first, second = nn.Linear(4, 8), nn.Linear(8, 3)
    optimizer = torch.optim.Adam([*first.parameters(), *second.parameters()], lr=0.01)
    for _ in range(2):
        optimizer.zero_grad()
        ((second(torch.tanh(first(_X))) - _Y) ** 2).mean().backward()
        optimizer.step()
    for value, param in zip(got, [*first.parameters(), *second.parameters()], strict=True):
        torch.testing.assert_close(value, param.detach(), rtol=1e-6, atol=1e-7)


def test_contexts_are_released_on_every_worker() -> None:
    def body(rank: int) -> Any:
        if rank == 0:
            server = rpc.remote("w1", Server)
            with dist_autograd.context() as context_id:
                rpc.rpc_sync("w1", served_forward, (server, _X.requires_grad_(False)))
            with pytest.raises(RuntimeError, match=f"no context {context_id} on this worker"):
                dist_autograd.get_gradients(context_id)
            return rpc.rpc_sync("w1", open_contexts)
        return None

    assert _run(body, world_size=2)[0] == []


def open_contexts() -> list[int]:
    return rpc.dist_autograd.wait_released(rpc_api._current("test"), TIMEOUT)


def test_rpc_workers_apart_from_the_spmd_world_rendezvous_by_themselves(tmp_path) -> None:
    """As the DDP + RPC tutorial's trainers do: an spmd world of their own, RPC among other ranks."""
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{tmp_path / 'rpc-store'}")

    def body(rank: int, size: int) -> Any:
        rpc_rank = size - 1 - rank                        # not this world's rank: RPC's own world
        rpc.init_rpc(f"r{rpc_rank}", rank=rpc_rank, world_size=size, rpc_backend_options=options)
        try:
            return rpc.get_worker_info().id, rpc.rpc_sync(f"r{1 - rpc_rank}", whoami)
        finally:
            rpc.shutdown()

    assert run_ranks(body, world_size=2, timeout=TIMEOUT) == [(1, "r0"), (0, "r1")]


_made = threading.Event()


def made_when_released() -> int:
    """A value the owner makes only once the test says so (its RRef is gone by then)."""
    _made.wait(TIMEOUT)
    return 1


def test_an_rref_dropped_before_its_owner_made_the_value_still_releases_it() -> None:
    _made.clear()

    def body(rank: int) -> Any:
        if rank != 0:
            return None
        rref = rpc.remote("w1", made_when_released)
        rref_id = rref._id
        del rref
        gc.collect()
        _made.set()
        return rpc.rpc_sync("w1", wait_released, (rref_id,))

    assert _run(body, world_size=2)[0] is True


_shared: dict[str, rpc.RRef] = {}
_shared_lock = threading.Lock()


def shared_embedding(initial: nn.Module) -> rpc.RRef:
    """On the server: one embedding for every trainer that asks (made by the first)."""
    with _shared_lock:
        name = rpc.get_worker_info().name
        if name not in _shared:
            _shared[name] = rpc.RRef(copy.deepcopy(initial))
        return _shared[name]


def test_ddp_trainers_over_a_remote_embedding_train_as_one_process() -> None:
    """The DDP + RPC tutorial's layout: an EmbeddingBag on a parameter server (a RemoteModule), two trainers with a
    DDP Linear over their own group, one DistributedOptimizer over both, in lockstep (barriers around the steps,
    so each trainer's step sees the same embedding); DDP averages the Linear's gradients under distributed
    autograd, the server's embedding takes both trainers' steps."""
    torch.manual_seed(0)
    emb0, fc0 = nn.EmbeddingBag(10, 4, mode="sum"), nn.Linear(4, 2)
    batches = [[(torch.randint(0, 10, (6, 3), generator=torch.Generator().manual_seed(10 * step + trainer)),
                 torch.randn(6, 2, generator=torch.Generator().manual_seed(10 * step + trainer + 5)))
                for trainer in range(2)] for step in range(3)]

    def body(rank: int, size: int) -> Any:
        trainers = spmd.new_group([0, 1])
        rpc.init_rpc(f"w{rank}", rank=rank, world_size=size)
        result = None
        if rank < 2:
            emb = RemoteModule.init_from_module_rref("w2/cpu", rpc.rpc_sync("w2", shared_embedding, (emb0,)))
            fc = spmd.DistributedDataParallel(copy.deepcopy(fc0), process_group=trainers)
            optimizer = DistributedOptimizer(torch.optim.SGD, emb.remote_parameters() +
                                              [rpc.RRef(p) for p in fc.parameters()], lr=0.1)
            for step in range(3):
                indices, target = batches[step][rank]
                with dist_autograd.context() as context_id:
                    loss = ((fc(emb(indices)) - target) ** 2).mean()
                    dist_autograd.backward(context_id, [loss])
                    spmd.barrier(group=trainers)       # both backwards saw the same embedding
                    optimizer.step(context_id)
                    spmd.barrier(group=trainers)
            result = [p.detach().clone() for p in fc.parameters()], [p.to_here() for p in emb.remote_parameters()]
        rpc.shutdown()
        return result

    _shared.clear()
    got = run_ranks(body, world_size=3, timeout=TIMEOUT)
    _shared.clear()
    emb, fc = copy.deepcopy(emb0), copy.deepcopy(fc0)
    for step in range(3):
        grads = []
        for indices, target in batches[step]:
            loss = ((fc(emb(indices)) - target) ** 2).mean()
            grads.append(torch.autograd.grad(loss, [*emb.parameters(), *fc.parameters()]))
        with torch.no_grad():
            for param, a, b in zip([*emb.parameters(), *fc.parameters()], *grads, strict=True):
                param -= 0.1 * ((a + b) if param is emb.weight else (a + b) / 2)
    for trainer in range(2):
        fc_params, emb_params = got[trainer]
        for value, param in zip(fc_params, fc.parameters(), strict=True):
            torch.testing.assert_close(value, param.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(emb_params[0], emb.weight.detach(), rtol=1e-6, atol=1e-6)


def test_a_graceful_shutdown_past_its_timeout_names_the_workers_that_did_not_come() -> None:
    def body(rank: int, size: int) -> str:
        rpc.init_rpc(f"w{rank}", rank=rank, world_size=size)
        if rank == 0:
            with pytest.raises(TimeoutError, match=r"workers \['w1'\] did not reach shutdown within 1s") as raised:
                rpc.shutdown(timeout=1)
            spmd.barrier()                 # only now does w1 go on to shut down
            return str(raised.value)
        spmd.barrier()
        rpc.shutdown(graceful=False)
        return ""

    assert "w1" in run_ranks(body, world_size=2, timeout=TIMEOUT)[0]
