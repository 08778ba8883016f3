"""A stage's backward split in two without doing any of it twice: the input half (I) now, the weight half (W)
later, from what I kept.

Layer: pipelining. Autograd only; nothing here communicates or knows about stages.

Note: the split backward
The backward graph from a stage's outputs (or loss) down to its leaves has two kinds of nodes: those on a path
to a received input (the *input closure*), and the rest, which lead only to weights (and any other leaf). I runs
autograd from the outputs to the inputs alone, which executes exactly the input closure, each node computing
only its gradients towards the closure (autograd skips a node's outputs no requested input needs). The weights
hang off the closure at *entry* nodes: a closure node with an edge out of it (a linear layer's matmul node, whose
edges go to its input and to its weight). During I a pre-hook on each entry keeps the gradient flowing into it.
W then starts autograd at the entries with those gradients and runs down to the weights, each entry computing
only its weight-side outputs: together I and W do the work of one full backward.

Entries whose weight-side subgraphs touch (a weight used twice) form one *part*; W runs one autograd call per
part, so no call crosses the closure between two parts (which would redo closure nodes between them). Within a
part, an entry below another entry would receive the upper one's gradient a second time: a pre-hook pins it to
the gradient I saw (torch's pipelining does the same). A stage output that doesn't depend on any input starts a
part of its own, from its gradient.

W's calls compute gradients without accumulating them; one last backward call then accumulates all of them into
the leaves' `.grad` through their AccumulateGrad nodes, so gradient hooks (DDP's bucketing) fire once per leaf,
in one backward pass whose end-of-backward callbacks run after every weight has its gradient.

The flops of I and W add up to those of one backward, but the time a little more: each call has a fixed cost
(the graph walk, one autograd call per part: about 2.4 ms for two GPT blocks on one CPU thread), and a matmul
node's two products no longer run back to back on the same gradient. On the anchors' GPT (width 256, two
blocks and the head, a microbatch of 2 x 128 tokens, one thread) I + W took 1.4x one backward where running W
as a second backward into the weights took 1.6x (the best of 40 runs, on a loaded machine).

torch's pipelining (its _backward.py) takes the same approach (intermediate gradients saved by I); this
is written from the description above.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

Grads = tuple[Tensor | None, ...]
"""The gradients flowing into a node, one per output of its forward (None where none flows)."""


class _Part:
    """Entries whose weight-side subgraphs connect, and the leaves below them."""

    def __init__(self) -> None:
        self.entries: list[Node] = []
        self.root_edges: list[tuple[GradientEdge, Tensor]] = []    # outputs that depend on no input: their grads
        self.leaves: list[Node] = []                                # AccumulateGrad nodes


class WeightBackward:
    """The weight half of one microbatch's backward, kept by `backward_input`; `run()` once, later."""

    def __init__(self, parts: list[_Part], captured: dict[Node, Grads]) -> None:
        self._parts = parts
        self._captured = captured

    def run(self) -> None:
        """Compute the weights' gradients from what backward_input kept and accumulate them into `.grad` (see
        Note: the split backward)."""
        edges: list[GradientEdge] = []
        grads: list[Tensor] = []
        for part in self._parts:
            roots, seeds = self._roots(part)
            if not roots or not part.leaves:
                continue
            wanted = [GradientEdge(leaf, 0) for leaf in part.leaves]
            pins = [entry.register_prehook(_pinned(self._captured[entry])) for entry in part.entries
                    if len(part.entries) > 1 and entry in self._captured]
            try:
                found = torch.autograd.grad(roots, wanted, seeds, retain_graph=True, allow_unused=True)
            finally:
                for pin in pins:
                    pin.remove()
            for edge, grad in zip(wanted, found, strict=True):
                if grad is not None:
                    edges.append(edge)
                    grads.append(grad)
        self._parts, self._captured = [], {}                # the graph can go once W has run
        if edges:
            torch.autograd.backward(edges, grads)          # AccumulateGrad nodes only: .grad += grad, with hooks

    def _roots(self, part: _Part) -> tuple[list[GradientEdge], list[Tensor]]:
        roots = [edge for edge, _ in part.root_edges]
        seeds = [grad for _, grad in part.root_edges]
        for entry in part.entries:
            for index, grad in enumerate(self._captured.get(entry, ())):
                if grad is not None:
                    roots.append(GradientEdge(entry, index))
                    seeds.append(grad)
        return roots, seeds


def _pinned(grads: Grads) -> Callable[[Grads], Grads]:
    """A pre-hook that replaces the gradients flowing into its node by `grads`."""
    def hook(_incoming: Grads) -> Grads:
        return grads
    return hook


def backward_input(roots: Sequence[Tensor], root_grads: Sequence[Tensor | None],
                   inputs: Sequence[Tensor]) -> tuple[tuple[Tensor | None, ...], WeightBackward]:
    """The gradients of `roots` (seeded with `root_grads`) w.r.t. `inputs` (each requiring grad), and the weight
    half to run later (see Note: the split backward). Keeps the graph below the entries until W runs."""
    seeds = [torch.ones_like(root) if grad is None else grad for root, grad in zip(roots, root_grads, strict=True)]
    root_edges = [get_gradient_edge(root) for root in roots]
    consumers = _consumers([edge.node for edge in root_edges])
    closure = _closure([get_gradient_edge(tensor).node for tensor in inputs], consumers)
    parts, entries = _parts(root_edges, seeds, closure, consumers)
    captured: dict[Node, Grads] = {}
    hooks = [entry.register_prehook(_capture(captured, entry)) for entry in entries]
    try:
        grads = torch.autograd.grad(list(roots), list(inputs), seeds, retain_graph=True, allow_unused=True)
    finally:
        for hook in hooks:
            hook.remove()
    return tuple(grads), WeightBackward(parts, captured)


def _capture(captured: dict[Node, Grads], entry: Node) -> Callable[[Grads], None]:
    """A pre-hook that keeps the gradients flowing into `entry`."""
    def hook(incoming: Grads) -> None:
        captured[entry] = tuple(incoming)
    return hook


def _consumers(roots: list[Node]) -> dict[Node, list[Node]]:
    """Every node reachable from `roots` -> the nodes whose edges lead to it (roots map to [])."""
    consumers: dict[Node, list[Node]] = {root: [] for root in roots}
    stack = list(consumers)
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in consumers:
                consumers[child] = []
                stack.append(child)
            consumers[child].append(node)
    return consumers


def _closure(inputs: list[Node], consumers: dict[Node, list[Node]]) -> set[Node]:
    """The nodes with a path to one of `inputs` (the input closure), the inputs' own nodes included."""
    closure = {node for node in inputs if node in consumers}
    stack = list(closure)
    while stack:
        for parent in consumers[stack.pop()]:
            if parent not in closure:
                closure.add(parent)
                stack.append(parent)
    return closure


def _parts(root_edges: list[GradientEdge], root_grads: list[Tensor], closure: set[Node],
           consumers: dict[Node, list[Node]]) -> tuple[list[_Part], list[Node]]:
    """Group the weight-side subgraphs into parts (see Note: the split backward); also return the entries."""
    owner: dict[Node, Node] = {}          # union-find over nodes outside the closure and the entries

    def find(node: Node) -> Node:
        while owner[node] is not node:
            owner[node] = owner[owner[node]]
            node = owner[node]
        return node

    def join(a: Node, b: Node) -> None:
        owner.setdefault(a, a)
        owner.setdefault(b, b)
        owner[find(a)] = find(b)

    def spread(start: Node) -> None:
        """Join `start` with everything below it (all outside the closure)."""
        owner.setdefault(start, start)
        stack = [start]
        while stack:
            node = stack.pop()
            for child, _ in node.next_functions:
                if child is None:
                    continue
                fresh = child not in owner
                join(node, child)
                if fresh:
                    stack.append(child)

    entries = [node for node in consumers if node in closure
               and any(child is not None and child not in closure for child, _ in node.next_functions)]
    for entry in entries:
        owner.setdefault(entry, entry)
        for child, _ in entry.next_functions:
            if child is not None and child not in closure:
                fresh = child not in owner
                join(entry, child)
                if fresh:
                    spread(child)
    outside_roots = [(edge, grad) for edge, grad in zip(root_edges, root_grads, strict=True)
                     if edge.node not in closure]
    for edge, _ in outside_roots:
        spread(edge.node)
    parts: dict[Node, _Part] = collections.defaultdict(_Part)
    for entry in entries:
        parts[find(entry)].entries.append(entry)
    for edge, grad in outside_roots:
        parts[find(edge.node)].root_edges.append((edge, grad))
    for node in owner:
        if node not in closure and not node.next_functions and hasattr(node, "variable"):
            parts[find(node)].leaves.append(node)
    return list(parts.values()), entries

