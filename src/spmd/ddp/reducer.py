"""The Reducer: turns gradient-ready events during backward into bucketed, overlapped all-reduces.

Layer: ddp. One Reducer per DistributedDataParallel module; it owns the buckets, the per-parameter
post-accumulate-grad hooks, and the end-of-backward callback that waits for communication. The hooks hold the
reducer weakly and are removed when it is collected: a discarded wrapper (say, one replaced by wrapping the module
again) frees its buckets and stops reducing, as torch's DDP does.

Note: one iteration of the reducer
  1. (forward)  `arm()`: reset readiness; parameters known to be unused (static_graph) are marked ready now.
  2. (backward) the first gradient reaching any forward output queues `_finalize` as a final callback of that
     backward (the outermost one, even when reentrant checkpointing runs nested backwards; a parameter hook
     queues it instead if the outputs held no tensor). Each parameter's post-accumulate-grad hook copies its
     gradient into its bucket slot (or finds it already there, with gradient_as_bucket_view) and marks it ready.
  3. (backward) a bucket whose last slot became ready is launched, but only in bucket order: every rank
     launches bucket k before bucket k+1, so collectives line up across ranks whatever order hooks fire in.
     Launching runs the comm hook, or by default an async all_reduce (SUM) of slots already divided by the
     group size as they were filled, which spares a pass over the bucket.
  4. (end of backward) `_finalize`: parameters whose hook never fired are unused. Without
     find_unused_parameters that is an error naming them (raised here, not as a hang or at the next forward);
     with it their slots are zero-filled and the remaining buckets launched, and one all_reduce of the
     "used" map tells which parameters no rank used (their .grad is left untouched, as torch does).
  5. (end of backward) wait for every bucket in order, write results back into .grad, disarm.
Every rank runs the same collectives in the same order: the buckets, then the used map when there is one.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable

import torch
from torch import Tensor, nn

from spmd._autograd import (
    DDP_STEPS_IN_BACKWARD,
    at_backward_end,
    on_backward_reaching,
    on_grad_accumulated,
    step_in_backward,
)
from spmd._core.errors import SpmdError
from spmd.comm.collectives import all_reduce
from spmd.comm.group import ProcessGroup
from spmd.comm.reduce_op import ReduceOp
from spmd.comm.work import Work
from spmd.ddp.bucket import Bucket, GradBucket, assign_buckets
from spmd.ddp.dtensor_params import local_grad, local_of, set_grad

CommHook = Callable[[object, GradBucket], torch.futures.Future]


class ReducerState(enum.Enum):
    IDLE = enum.auto()       # no reduction expected: hooks leave gradients alone (no_sync, no_grad, before forward)
    ARMED = enum.auto()      # a forward with gradient sync ran; the next backward's gradients are reduced
    REDUCING = enum.auto()   # backward is producing gradients; buckets launch as they fill; finalize is queued


class Reducer:
    """Buckets, hooks and the per-iteration protocol (see Note: one iteration of the reducer)."""

    def __init__(self, params: list[nn.Parameter], names: list[str], group: ProcessGroup, bucket_bytes: int,
                 first_bucket_bytes: int, find_unused_parameters: bool, static_graph: bool,
                 gradient_as_bucket_view: bool) -> None:
        self.params = params
        self.names = names
        self.group = group
        self.find_unused = find_unused_parameters
        self.static_graph = static_graph
        self.as_view = gradient_as_bucket_view
        self.div_factor = group.size()
        self.device = params[0].device   # of the used map and join's counts: the first parameter's, as in torch
        self.buckets = [Bucket(index, members, params)
                        for index, members in enumerate(assign_buckets(params, bucket_bytes, first_bucket_bytes))]
        self.locate: list[tuple[int, int]] = [(0, 0)] * len(params)   # param index -> (bucket, slot)
        for bucket in self.buckets:
            for slot, index in enumerate(bucket.param_indices):
                self.locate[index] = (bucket.index, slot)
        self.comm_hook: CommHook | None = None
        self.comm_hook_state: object = None
        self.state = ReducerState.IDLE
        self.iterations = 0
        # static_graph: what iteration 1 learned (hook firings per parameter; parameters no rank used)
        self.expected_fires: list[int] | None = None
        self.unused_everywhere: set[int] = set()
        self._ready = [False] * len(params)
        self._fires = [0] * len(params)
        self._next_bucket = 0
        self._in_flight: list[tuple[Tensor | None, Callable[[], Tensor]]] = []   # (bucket buffer, wait)
        self._hooks = on_grad_accumulated(params, _weakly(self._on_grad_ready))
        weakref.finalize(self, self._hooks.remove)

    # -- per-iteration protocol -----------------------------------------------------------------------------

    def arm(self) -> None:
        """Step 1: expect the next backward to produce gradients to reduce."""
        if self.state is ReducerState.REDUCING:
            raise RuntimeError(
                f"DistributedDataParallel on rank {self.group.global_rank}: the previous backward never finished "
                f"reducing its gradients (it raised part-way), so this rank's collectives may no longer line up "
                f"with its peers'. Restart training from a checkpoint.")
        self._reset()
        if self._learning_static_graph():
            return
        if self.expected_fires is not None:
            for index, fires in enumerate(self.expected_fires):
                if fires == 0:
                    self._mark_unused(index)

    def _reset(self) -> None:
        self._ready = [False] * len(self.params)
        self._fires = [0] * len(self.params)
        self._next_bucket = 0
        self._in_flight = []
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
        self.state = ReducerState.ARMED

    def watch_outputs(self, output: object) -> None:
        """Queue `_finalize` on the backward that reaches `output` first (step 2)."""
        on_backward_reaching(_tensors_in(output), self._on_backward_start)

    def _on_backward_start(self) -> None:
        if self.state is ReducerState.ARMED:
            self.state = ReducerState.REDUCING
            at_backward_end(self._finalize)

    def disarm(self) -> None:
        """Gradients of the next backward stay local (a forward inside no_sync)."""
        if self.state is ReducerState.ARMED:
            self.state = ReducerState.IDLE

    def set_divisor(self, ranks: int) -> None:
        """Divide the summed gradients by `ranks` from the next backward on (the group size unless join() sets the
        number of ranks still training)."""
        self.div_factor = ranks

    def _learning_static_graph(self) -> bool:
        return self.static_graph and self.expected_fires is None

    def _on_grad_ready(self, index: int) -> None:
        """Step 2 (autograd engine thread): parameter `index` has its gradient for this backward."""
        if self.state is ReducerState.IDLE:
            return
        self._on_backward_start()
        self._fires[index] += 1
        if self._learning_static_graph():
            return   # iteration 1 of a static graph: learn the firing counts, reduce everything at the end
        if self.expected_fires is not None:
            if self._fires[index] < self.expected_fires[index]:
                return
        elif self._ready[index]:
            self._fail(RuntimeError(
                f"DistributedDataParallel on rank {self.group.global_rank}: parameter '{self.names[index]}' got "
                f"its gradient twice in one backward (reentrant activation checkpointing, or a second backward "
                f"through the same graph). Pass static_graph=True if the graph is the same every iteration, or "
                f"use non-reentrant checkpointing."))
        self._take_grad(index)
        self._mark_ready(index)

    def _take_grad(self, index: int) -> None:
        param = self.params[index]
        bucket_index, slot = self.locate[index]
        view = self.buckets[bucket_index].views[slot]
        grad = local_grad(param)
        divide = self.comm_hook is None   # the default reduction averages here, in the copy; hooks divide themselves
        if grad is None:
            view.zero_()
        elif _aliases(grad, view):
            if divide:
                view.div_(self.div_factor)
        else:
            if divide:
                torch.div(grad, self.div_factor, out=view)
            else:
                view.copy_(grad)
            if self.as_view:
                set_grad(param, view)

    def _mark_unused(self, index: int) -> None:
        """Zero this parameter's slot (keeping any stale .grad it aliases) and count it ready."""
        param = self.params[index]
        bucket_index, slot = self.locate[index]
        view = self.buckets[bucket_index].views[slot]
        if param.grad is not None and _aliases(local_of(param.grad), view):
            set_grad(param, view.clone())
        view.zero_()
        self._mark_ready(index)

    def _mark_ready(self, index: int) -> None:
        self._ready[index] = True
        bucket = self.buckets[self.locate[index][0]]
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        """Step 3: launch every bucket that is full, strictly in bucket order."""
        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].pending == 0:
            bucket = self.buckets[self._next_bucket]
            self._next_bucket += 1
            self._in_flight.append((bucket.buffer, self.launch(bucket)))

    def launch(self, bucket: Bucket) -> Callable[[], Tensor]:
        """Start reducing `bucket`; returns a function that waits and gives the averaged gradient."""
        if self.comm_hook is None:   # the slots were divided by div_factor as they filled (see _take_grad)
            work = all_reduce(bucket.buffer, ReduceOp.SUM, group=self.group, async_op=True)
            return _waiter(work, bucket.buffer)
        view = GradBucket(bucket, bucket.index == len(self.buckets) - 1, self.div_factor, self.group)
        future = self.comm_hook(self.comm_hook_state, view)
        if not isinstance(future, torch._C.Future):   # what Future.then returns too
            raise TypeError(f"DistributedDataParallel: the comm hook must return a torch.futures.Future of the "
                            f"reduced bucket, got {type(future).__name__}")
        return future.wait

    def _finalize(self) -> None:
        """Steps 4 and 5, run by the autograd engine once backward has finished."""
        try:
            used_map = self._reduce_the_rest()
            for buffer, wait in self._in_flight:
                result = wait()
                if buffer is not None and result is not buffer:
                    buffer.copy_(result)
            unused = self._unused_everywhere(used_map)
            self._write_back(unused)
            self.iterations += 1
        finally:
            self.state = ReducerState.IDLE

    def _reduce_the_rest(self) -> Tensor | None:
        """Step 4: deal with parameters whose hook never fired; returns the used map being all-reduced."""
        learning = self._learning_static_graph()
        if learning:
            for index, fires in enumerate(self._fires):
                if fires:
                    self._take_grad(index)
                    self._mark_ready(index)
        missing = [index for index, ready in enumerate(self._ready) if not ready]
        if missing and not (self.find_unused or learning):
            names = ", ".join(f"'{self.names[i]}'" for i in missing)
            self._fail(SpmdError(
                f"DistributedDataParallel on rank {self.group.global_rank} of {self.group.description}: "
                f"{len(missing)} parameter(s) got no gradient in this backward: {names}. Their buckets can't be "
                f"reduced, so the group was aborted rather than left to hang. Pass find_unused_parameters=True if "
                f"the forward skips these parameters (or an output using them is left out of the loss), or set "
                f"requires_grad=False on parameters that should not train."))
        for index in missing:
            self._mark_unused(index)
        if not (self.find_unused or learning) or self.expected_fires is not None:
            return None
        return self._reduce_used_map(torch.tensor([fires > 0 for fires in self._fires], dtype=torch.int32,
                                                  device=self.device))

    def _reduce_used_map(self, used_map: Tensor) -> Tensor:
        """Count, per parameter, the ranks that used it (async; waited with the buckets)."""
        work = all_reduce(used_map, ReduceOp.SUM, group=self.group, async_op=True)
        self._in_flight.append((None, _waiter(work, used_map)))
        return used_map

    def _unused_everywhere(self, used_map: Tensor | None) -> set[int]:
        if self._learning_static_graph():
            assert used_map is not None
            self.expected_fires = list(self._fires)
            self.unused_everywhere = {i for i, used in enumerate(used_map.tolist()) if used == 0}
        if used_map is None:
            return self.unused_everywhere
        return {i for i, used in enumerate(used_map.tolist()) if used == 0}

    def _write_back(self, unused: set[int]) -> None:
        """Step 5: the averaged buckets become .grad (aliased with gradient_as_bucket_view, else copied); a
        parameter with optimizers to step in backward (_apply_optimizer_in_backward) is stepped now, and its
        gradient freed."""
        for bucket in self.buckets:
            for param, index, view in zip(bucket.params, bucket.param_indices, bucket.views):
                if index in unused:
                    continue
                if self.as_view:
                    set_grad(param, view)
                elif param.grad is None:
                    set_grad(param, view.clone())
                elif not _aliases(local_of(param.grad), view):
                    local_of(param.grad).copy_(view)
                if getattr(param, DDP_STEPS_IN_BACKWARD, False):
                    step_in_backward(param)

    def shadow_iteration(self) -> None:
        """Run the collectives of one iteration on zero gradients (a joined rank keeping pace; see join.py).

        Afterwards the joined rank's .grad holds the averaged gradients the training ranks got (those of
        parameters no rank used untouched), so a sharded optimizer's step on it updates its part as theirs do.
        """
        self._reset()
        for bucket in self.buckets:
            bucket.buffer.zero_()
            bucket.pending = 0
        self._launch_ready_buckets()
        used_map = None
        if self._learning_static_graph() or (self.find_unused and self.expected_fires is None):
            used_map = self._reduce_used_map(torch.zeros(len(self.params), dtype=torch.int32, device=self.device))
        try:
            for buffer, wait in self._in_flight:
                result = wait()
                if buffer is not None and result is not buffer:
                    buffer.copy_(result)
            self._in_flight = []
            unused = self.unused_everywhere if used_map is None else {
                i for i, used in enumerate(used_map.tolist()) if used == 0}
            self._write_back(unused)
        finally:
            self.state = ReducerState.IDLE

    def _fail(self, error: BaseException) -> None:
        """Raise `error`, aborting the group first so peers waiting on our buckets fail fast instead of hanging."""
        self.state = ReducerState.IDLE
        self.group.abort(error)
        raise error


def _weakly(method: Callable[[int], None]) -> Callable[[int], None]:
    """`method` called through a weak reference to its object (a no-op once the object is gone)."""
    ref = weakref.WeakMethod(method)

    def call(index: int) -> None:
        bound = ref()
        if bound is not None:
            bound(index)
    return call


def _waiter(work: Work, result: Tensor) -> Callable[[], Tensor]:
    def wait() -> Tensor:
        work.wait()
        return result
    return wait


def _tensors_in(tree: object) -> list[Tensor]:
    if isinstance(tree, Tensor):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [t for item in tree for t in _tensors_in(item)]
    if isinstance(tree, dict):
        return [t for item in tree.values() for t in _tensors_in(item)]
    return []


def _aliases(grad: Tensor, view: Tensor) -> bool:
    return grad.data_ptr() == view.data_ptr() and grad.shape == view.shape and grad.dtype == view.dtype
