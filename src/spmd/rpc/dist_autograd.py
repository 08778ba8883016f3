"""Distributed autograd (torch's distributed `autograd`): inside `with context() as context_id:`, RPC calls
record where gradients flow back, and backward(context_id, [loss]) computes the gradients of every tensor that
took part, on every worker, into the context (get_gradients), not into `.grad`.

Layer: rpc.

Note: edges across workers
A call made inside a context sends its tensors detached, with the positions of those that required grad; the
callee makes them leaves that require grad, runs the function in the same context (its own calls nest), and,
when its result has tensors that require grad, keeps (those leaves, those outputs) as an edge and returns the
result detached with the edge's id. The caller joins the result to its graph through _RpcEdge, a function of
the arguments that required grad and of the context's anchor (a leaf every edge takes, so that a backward asked
for the anchor's gradient runs every edge, even one whose arguments needed none: a forward on a parameter server
with plain inputs). _RpcEdge's backward calls the callee with the output gradients; the callee runs
torch.autograd.grad from the edge's outputs to its leaves and the anchor (nested edges call on in turn), adds
the gradients of its own leaves (parameters) into its context, and returns those of the received leaves, which
_RpcEdge returns to the caller's engine. Every gradient is the sum over the paths, by the chain rule, as one
process computes it; a callee's graph is kept (retain_graph) until the context is released.
"""

from __future__ import annotations

import contextvars
import itertools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from spmd.rpc.agent import RpcAgent, WorkerInfo
from spmd.rpc.functions import async_execution, is_async_execution


class _Context:
    """One worker's part of a distributed autograd context."""

    def __init__(self, context_id: int) -> None:
        self.id = context_id
        self.anchor = torch.zeros((), requires_grad=True)
        self.lock = threading.Lock()
        self.grads: dict[Tensor, Tensor] = {}
        self.edges: dict[int, tuple[list[Tensor], list[Tensor]]] = {}
        self.edge_ids = itertools.count(1)

    def accumulate(self, leaves: list[Tensor], grads: tuple[Tensor | None, ...]) -> None:
        with self.lock:
            for leaf, grad in zip(leaves, grads, strict=True):
                if grad is not None:
                    held = self.grads.get(leaf)
                    self.grads[leaf] = grad.detach() if held is None else held + grad


_current: contextvars.ContextVar[_Context | None] = contextvars.ContextVar("spmd_dist_autograd", default=None)
_contexts: weakref.WeakKeyDictionary[RpcAgent, dict[int, _Context]] = weakref.WeakKeyDictionary()
_contexts_lock = threading.Lock()
_released = threading.Condition(_contexts_lock)     # notified when a context is released (its release is a message)
_context_ids = itertools.count(1)


def _agent() -> RpcAgent:
    from spmd.rpc.api import _current as current_agent

    return current_agent("dist_autograd")


def _table(agent: RpcAgent) -> dict[int, _Context]:
    with _contexts_lock:
        return _contexts.setdefault(agent, {})


def _joined(agent: RpcAgent, context_id: int) -> _Context:
    table = _table(agent)
    with _contexts_lock:
        found = table.get(context_id)
        if found is None:
            found = table[context_id] = _Context(context_id)
        return found


def _retrieve_context(context_id: int) -> _Context:
    found = _table(_agent()).get(context_id)
    if found is None:
        raise RuntimeError(f"dist_autograd: no context {context_id} on this worker (released, or never joined)")
    return found


class context:
    """`with context() as context_id:` a distributed autograd context, released on every worker at exit."""

    def __enter__(self) -> int:
        agent = _agent()
        context_id = (agent.rank << 40) | next(_context_ids)
        self._token = _current.set(_joined(agent, context_id))
        self._agent = agent
        return context_id

    def __exit__(self, *exc: object) -> None:
        found = _current.get()
        _current.reset(self._token)
        assert found is not None
        _release(found.id)
        for worker in self._agent.workers:
            if worker.id != self._agent.rank:
                self._agent.notify(worker, _release, (found.id,))


def _release(context_id: int) -> None:
    table = _table(_agent())
    with _contexts_lock:
        table.pop(context_id, None)
        _released.notify_all()


def _current_context() -> _Context:
    found = _current.get()
    if found is None:
        raise RuntimeError("dist_autograd: not inside a distributed autograd context")
    return found


def _is_valid_context(context_id: int) -> bool:
    return context_id in _table(_agent())


def get_gradients(context_id: int) -> dict[Tensor, Tensor]:
    """This worker's gradients of the context: tensor -> its gradient."""
    found = _retrieve_context(context_id)
    with found.lock:
        return dict(found.grads)


def backward(context_id: int, roots: list[Tensor], retain_graph: bool = False) -> None:
    """Gradients of the scalar `roots` for every tensor of the context's graph, on every worker it reaches,
    added into the context (Note: edges across workers). On this worker they pass through `.grad` (and back to
    what `.grad` held), so gradient hooks run: a DDP module's gradients are reduced over its group, as torch's
    DDP does under distributed autograd."""
    found = _retrieve_context(context_id)
    for root in roots:
        if not isinstance(root, Tensor) or root.numel() != 1 or not root.requires_grad:
            raise RuntimeError("dist_autograd.backward: roots must be scalar tensors that require grad")
    leaves = _leaves(roots, found.anchor)
    held = [leaf.grad for leaf in leaves]
    anchor_held = found.anchor.grad
    for leaf in leaves:
        leaf.grad = None
    try:
        # into .grad, so that gradient hooks run (DDP reduces a module's gradients there), then into the context
        torch.autograd.backward(roots, inputs=[*leaves, found.anchor], retain_graph=retain_graph)
        found.accumulate(leaves, tuple(leaf.grad for leaf in leaves))
    finally:
        for leaf, grad in zip(leaves, held, strict=True):
            leaf.grad = grad
        found.anchor.grad = anchor_held


def _leaves(tensors: list[Tensor], anchor: Tensor) -> list[Tensor]:
    """The leaves requiring grad that `tensors`' graph reaches (the anchor left out)."""
    found: dict[int, Tensor] = {}
    seen: set[Any] = set()
    stack = []
    for tensor in tensors:
        if tensor.grad_fn is None:
            if tensor.requires_grad and tensor is not anchor:
                found[id(tensor)] = tensor
        else:
            stack.append(tensor.grad_fn)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, Tensor):
            if variable is not anchor:
                found[id(variable)] = variable
            continue
        stack.extend(child for child, _ in node.next_functions if child is not None)
    return list(found.values())


# -- calls inside a context --------------------------------------------------------------------------------------

class _EdgeInfo:
    def __init__(self, agent: RpcAgent, worker: WorkerInfo, context_id: int, edge_id: int,
                 outputs: list[Tensor]) -> None:
        self.agent, self.worker, self.context_id, self.edge_id = agent, worker, context_id, edge_id
        self.outputs: list[Tensor] | None = outputs


class _RpcEdge(torch.autograd.Function):
    """The result of a call, as a function of the arguments that required grad (Note: edges across workers)."""

    @staticmethod
    def forward(ctx: Any, info: _EdgeInfo, anchor: Tensor, *grad_inputs: Tensor) -> tuple[Tensor, ...]:
        ctx.info = info
        outputs, info.outputs = info.outputs, None
        assert outputs is not None
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Tensor) -> tuple[Tensor | None, ...]:
        info: _EdgeInfo = ctx.info
        grads = info.agent.call(info.worker, _edge_backward, (info.context_id, info.edge_id, list(grad_outputs)),
                                {}, 0, "dist_autograd.backward").wait()
        return (None, None, *grads)


def call(agent: RpcAgent, worker: WorkerInfo, func: Callable[..., Any], args: tuple, kwargs: dict, timeout: float,
         what: str) -> torch.futures.Future:
    """A call, joined to the current distributed autograd context if there is one."""
    found = _current.get()
    if found is None:
        return agent.call(worker, func, args, kwargs, timeout, what)
    flat, spec = tree_flatten((args, kwargs))
    positions = [i for i, x in enumerate(flat) if isinstance(x, Tensor) and x.requires_grad]
    grad_inputs = [flat[i] for i in positions]
    sent_args, sent_kwargs = tree_unflatten([x.detach() if isinstance(x, Tensor) else x for x in flat], spec)
    future = agent.call(worker, _serve, (found.id, func, sent_args, sent_kwargs, positions), {}, timeout, what)

    def attach(done: torch.futures.Future) -> Any:
        result, out_positions, edge_id = done.wait()
        if edge_id is None:
            return result
        out_flat, out_spec = tree_flatten(result)
        info = _EdgeInfo(agent, worker, found.id, edge_id, [out_flat[i] for i in out_positions])
        joined = _RpcEdge.apply(info, found.anchor, *grad_inputs)
        for position, tensor in zip(out_positions, joined, strict=True):
            out_flat[position] = tensor
        return tree_unflatten(out_flat, out_spec)

    return future.then(attach)


@async_execution
def _serve(context_id: int, func: Callable[..., Any], args: tuple, kwargs: dict,
           positions: list[int]) -> torch.futures.Future:
    """(callee) Run a call inside its context (Note: edges across workers)."""
    found = _joined(_agent(), context_id)
    flat, spec = tree_flatten((args, kwargs))
    received = [flat[i].requires_grad_() for i in positions]
    args, kwargs = tree_unflatten(flat, spec)
    token = _current.set(found)
    try:
        result = func(*args, **kwargs)
    finally:
        _current.reset(token)
    if is_async_execution(func) and isinstance(result, torch._C.Future):
        return result.then(lambda done: _pack(found, done.wait(), received))
    packed: torch.futures.Future = torch.futures.Future()
    packed.set_result(_pack(found, result, received))
    return packed


def _pack(found: _Context, result: Any, received: list[Tensor]) -> tuple[Any, list[int], int | None]:
    flat, spec = tree_flatten(result)
    positions = [i for i, x in enumerate(flat) if isinstance(x, Tensor) and x.requires_grad]
    sent = tree_unflatten([x.detach() if isinstance(x, Tensor) else x for x in flat], spec)
    if not positions:
        return sent, [], None
    edge_id = next(found.edge_ids)
    with found.lock:
        found.edges[edge_id] = (received, [flat[i] for i in positions])
    return sent, positions, edge_id


def _edge_backward(context_id: int, edge_id: int, grad_outputs: list[Tensor]) -> list[Tensor | None]:
    """(callee) Gradients from an edge's outputs back to its leaves (Note: edges across workers)."""
    found = _retrieve_context(context_id)
    with found.lock:
        received, outputs = found.edges[edge_id]
    taken = {id(t) for t in received}
    leaves = [leaf for leaf in _leaves(outputs, found.anchor) if id(leaf) not in taken]
    grads = torch.autograd.grad(outputs, [*received, *leaves, found.anchor], grad_outputs, allow_unused=True,
                                retain_graph=True)
    found.accumulate(leaves, grads[len(received):len(received) + len(leaves)])
    return [None if g is None else g.detach() for g in grads[:len(received)]]


def wait_released(agent: RpcAgent, timeout: float) -> list[int]:
    """The contexts this worker still holds once none is left or `timeout` passed (for tests and leak checks)."""
    table = _table(agent)
    with _released:
        _released.wait_for(lambda: not table, timeout)
        return list(table)
