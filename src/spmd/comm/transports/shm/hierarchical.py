"""The hierarchical shm transport: a group spanning hosts, shared memory inside each host, tcp between hosts.

Layer: comm. What backend "shm" builds when the group's ranks are on more than one host (spec.hosts). The
bandwidth-heavy collectives whose hierarchical form is cheap run in three steps:

    all_reduce   1. (every host)   reduce to the host's leader through shared memory (sliced, see local)
                 2. (leaders)      all_reduce over tcp, one rank per host
                 3. (every host)   broadcast from the leader through shared memory
    broadcast    1. (root's host)  broadcast from the root through shared memory (the leader gets it)
                 2. (leaders)      broadcast from the root's host leader over tcp
                 3. (other hosts)  broadcast from the leader through shared memory
    all_gather   1. (every host)   gather to the leader through shared memory, into the host's block
                 2. (leaders)      all_gather of the host blocks over tcp, then blocks to rank order
                 3. (every host)   broadcast of the whole output from the leader through shared memory
    reduce_scatter
                 1. (every host)   reduce of the whole input to the leader through shared memory
                 2. (leaders)      reduce_scatter over tcp of the input in host order, a host block each
                 3. (every host)   scatter of the host block from the leader through shared memory
    barrier      local barrier, leaders' barrier, local barrier

so each byte crosses the network once per host instead of once per rank. The leader of a host is its
lowest group rank. A host block holds the blocks of that host's ranks in rank order, padded to the largest
host's rank count when hosts have different counts (the leaders' collectives need equal blocks).

Every other operation (reduce, gather, scatter, all_to_all) runs on a tcp transport over the whole group:
each of their blocks must cross to its host once whatever the route (and a reduce's chain over hosts'
contiguous ranks crosses each host boundary once too), so a step through the leader only adds a copy and a
wait. Measured (benchmarks/multihost.py --ops reduce,gather,scatter: 2 x 2 ranks, 16 MiB, root 0), a
leader-based version was 1.06-1.43x slower than the flat ones. Point-to-point messages go through shared
memory to a peer on the same host and over tcp to a peer elsewhere (each peer always on one route, so
messages of a (peer, tag) stay in order). Every step gets the caller's OpContext, so fingerprints are
checked inside each host and between leaders, and all steps share the op's deadline.
"""

from __future__ import annotations

from torch import Tensor

from spmd.comm.reduce_op import ReduceOp, finish_average, partial_op
from spmd.comm.store.base import PrefixStore
from spmd.comm.transports.base import OpContext, Transport, TransportSpec
from spmd.comm.transports.shm.local import LocalShmTransport
from spmd.comm.transports.tcp.transport import TcpTransport
from spmd.comm.work import Work


class HierarchicalTransport(Transport):
    """Shared memory inside each host, tcp between hosts; see the module docstring for the algorithms."""

    name = "shm+tcp"       # what get_backend says: shared memory inside hosts, tcp between them
    devices = ("cpu",)

    def __init__(self, spec: TransportSpec) -> None:
        super().__init__(spec)
        host_order = list(dict.fromkeys(spec.hosts))                    # hosts in order of their first rank
        self.host_index = host_order.index(spec.hosts[self.group_rank])
        self.host_of = [host_order.index(host) for host in spec.hosts]
        self.host_ranks = [[r for r in range(self.group_size) if self.host_of[r] == h] for h in range(len(host_order))]
        self.local_ranks = self.host_ranks[self.host_index]
        self.leaders = [ranks[0] for ranks in self.host_ranks]
        self.is_leader = self.group_rank == self.leaders[self.host_index]
        self.host_width = max(len(ranks) for ranks in self.host_ranks)   # rank blocks in a (padded) host block
        # (rank, the index of its block in the padded host blocks): the leaders' collectives' layout
        self.host_slots = [(rank, host * self.host_width + slot) for host, ranks in enumerate(self.host_ranks)
                           for slot, rank in enumerate(ranks)]
        self.blocks_in_rank_order = (self.host_width * len(host_order) == self.group_size
                                     and all(rank == slot for rank, slot in self.host_slots))
        self._transports: list[Transport] = []
        try:
            self.local = self._add(LocalShmTransport(self._subspec(
                f"local{self.host_index}", self.local_ranks, self.local_ranks.index(self.group_rank))))
            self.leader_group: Transport | None = None
            if self.is_leader:
                self.leader_group = self._add(TcpTransport(self._subspec(
                    "leaders", self.leaders, self.host_index)))
            self.flat = self._add(TcpTransport(self._subspec("flat", list(range(self.group_size)), self.group_rank)))
        except BaseException:
            self.close()
            raise

    def _subspec(self, name: str, members: list[int], my_index: int) -> TransportSpec:
        """The spec of a sub-group of `members` (group ranks), with its own prefix of the group's store."""
        spec = self.spec
        return TransportSpec(store=PrefixStore(f"hier/{name}", spec.store), group_name=f"{spec.group_name}/{name}",
                             group_rank=my_index, global_ranks=tuple(spec.global_ranks[r] for r in members),
                             hosts=tuple(spec.hosts[r] for r in members), timeout=spec.timeout, token=spec.token,
                             host_names=tuple(spec.host_names[r] for r in members) if spec.host_names else ())

    def _add(self, transport: Transport) -> Transport:
        self._transports.append(transport)
        return transport

    # -- hierarchical collectives ---------------------------------------------------------------------------

    def all_reduce(self, tensor: Tensor, op: ReduceOp, ctx: OpContext) -> None:
        partial = partial_op(op)                  # AVG: sum inside hosts and across them, divide once at the end
        self.local.reduce(tensor, 0, partial, ctx)
        if self.leader_group is not None:
            self.leader_group.all_reduce(tensor, partial, ctx)
            finish_average(tensor, op, self.group_size)
        self.local.broadcast(tensor, 0, ctx)

    def broadcast(self, tensor: Tensor, root: int, ctx: OpContext) -> None:
        root_host = self.host_of[root]
        if self.host_index == root_host:
            self.local.broadcast(tensor, self.local_ranks.index(root), ctx)
        if self.leader_group is not None:
            self.leader_group.broadcast(tensor, root_host, ctx)
        if self.host_index != root_host:
            self.local.broadcast(tensor, 0, ctx)

    def barrier(self, ctx: OpContext) -> None:
        self.local.barrier(ctx)
        if self.leader_group is not None:
            self.leader_group.barrier(ctx)
        self.local.barrier(ctx)

    def all_gather(self, output: Tensor, input: Tensor, ctx: OpContext) -> None:
        if self.leader_group is not None:
            m = input.numel()
            host_block = self.host_width * m
            hosts = output if self.blocks_in_rank_order else output.new_empty(len(self.host_ranks) * host_block)
            mine = hosts[self.host_index * host_block:(self.host_index + 1) * host_block]
            self.local.gather(mine[:len(self.local_ranks) * m], input, 0, ctx)
            self.leader_group.all_gather(hosts, mine.clone(), ctx)
            if not self.blocks_in_rank_order:
                self._host_order_to_rank_order(hosts, output, m)
        else:
            self.local.gather(None, input, 0, ctx)
        self.local.broadcast(output, 0, ctx)

    def reduce_scatter(self, output: Tensor, input: Tensor, op: ReduceOp, ctx: OpContext) -> None:
        partial = partial_op(op)                  # AVG: sum inside hosts and across them, divide once at the end
        my_host_block: Tensor | None = None
        if self.leader_group is not None:
            m = output.numel()
            host_sum = input.clone()
            self.local.reduce(host_sum, 0, partial, ctx)
            hosts = host_sum if self.blocks_in_rank_order else self._rank_order_to_host_order(host_sum, m)
            padded = output.new_empty(self.host_width * m)
            self.leader_group.reduce_scatter(padded, hosts, partial, ctx)
            finish_average(padded, op, self.group_size)
            my_host_block = padded[:len(self.local_ranks) * m]
        else:
            self.local.reduce(input, 0, partial, ctx)            # a non-root's tensor is left as it was
        self.local.scatter(output, my_host_block, 0, ctx)

    def _host_order_to_rank_order(self, hosts: Tensor, output: Tensor, m: int) -> None:
        """Copy each rank's block from its (padded) host block in `hosts` to its place in `output`."""
        for rank, slot in self.host_slots:
            output[rank * m:(rank + 1) * m].copy_(hosts[slot * m:(slot + 1) * m])

    def _rank_order_to_host_order(self, blocks: Tensor, m: int) -> Tensor:
        """`blocks` (one block per rank, in rank order) rearranged into padded host blocks, zeros as padding."""
        hosts = blocks.new_zeros(len(self.host_ranks) * self.host_width * m)
        for rank, slot in self.host_slots:
            hosts[slot * m:(slot + 1) * m].copy_(blocks[rank * m:(rank + 1) * m])
        return hosts

    # -- flat over tcp --------------------------------------------------------------------------------------

    def reduce(self, tensor: Tensor, root: int, op: ReduceOp, ctx: OpContext) -> None:
        self.flat.reduce(tensor, root, op, ctx)

    def gather(self, output: Tensor | None, input: Tensor, root: int, ctx: OpContext) -> None:
        self.flat.gather(output, input, root, ctx)

    def scatter(self, output: Tensor, input: Tensor | None, root: int, ctx: OpContext) -> None:
        self.flat.scatter(output, input, root, ctx)

    def all_to_all(self, output: Tensor, input: Tensor, output_splits: list[int], input_splits: list[int],
                   ctx: OpContext) -> None:
        self.flat.all_to_all(output, input, output_splits, input_splits, ctx)

    # -- point to point -------------------------------------------------------------------------------------

    def isend(self, tensor: Tensor, dst: int, tag: int, work: Work) -> None:
        if self.host_of[dst] == self.host_index:
            self.local.isend(tensor, self.local_ranks.index(dst), tag, work)
        else:
            self.flat.isend(tensor, dst, tag, work)

    def irecv(self, tensor: Tensor, src: int, tag: int, work: Work) -> None:
        if self.host_of[src] == self.host_index:
            self.local.irecv(tensor, self.local_ranks.index(src), tag, work)
        else:
            self.flat.irecv(tensor, src, tag, work)

    # -- lifetime -------------------------------------------------------------------------------------------

    def abort(self, error: BaseException) -> None:
        for transport in self._transports:
            transport.abort(error)

    def close(self) -> None:
        for transport in reversed(self._transports):
            transport.close()
        self._transports.clear()
