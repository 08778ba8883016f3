"""Rendezvous: how the agents of a job agree, round after round, on the node set and each node's ranks.

Layer: run. Everything goes through a Store (a TCPStore hosted by one agent, or a HashStore for a one-node job),
with one decision maker: the Coordinator, a thread of the agent that hosts the store. Other agents only write
facts (joined, alive, failed, done, left) and follow the rounds the coordinator publishes, so two agents can
never decide differently. There are no cross-node clock comparisons: liveness is "the heartbeat counter moved
recently" by the coordinator's own clock.

Protocol (keys are under `spmd/rdzv/<run id>/`):
  1. (every agent)  `add("join_seq", 1)` -> its node id; `add("hb/<id>", 1)`; `set("node/<id>", NodeInfo)`.
  2. (every agent)  a heartbeat thread runs `add("hb/<id>", 1)` every heartbeat_interval.
  3. (coordinator)  once MIN nodes are alive and MAX joined or last_call_timeout passed, publishes
                    `set("round/<r>", Round)` and then `set("round", r)`. A Round lists its nodes in
                    group-rank order; a round with no nodes means "stop and wait" (too few nodes left).
  4. (every agent)  polls `round`; on a newer round it stops its workers; if it is in the round, the node
                    with group rank 0 publishes the workers' store `set("round/<r>/master", "addr:port:token")`
                    and every member starts its workers with it.
  5. (an agent)     its workers failed: `set("round/<r>/failure/<id>", [WorkerFailure, ...])`, then it stops
                    the rest. All its workers succeeded: `set("round/<r>/done/<id>", "1")`.
  6. (coordinator)  every member done -> close "succeeded";
                    a member dead (heartbeat stale or `left/<id>`) -> a new round with the live nodes (no restart
                    used; see Note: failure reports and dying nodes); with fewer than MIN left, close "failed"
                    naming the lost nodes when no restarts remain, else use one and wait (an empty round saying
                    for what and until when, at most join_timeout);
                    failure -> once settled, the earliest failure of all reports is the root cause; a new round
                    (restart_count + 1) while restarts remain, else close "failed" with every report;
                    a waiting node and room below MAX (and no member done) -> a new round with it;
                    too few nodes for join_timeout -> close "timeout".
  7. (anyone)       `compare_set("closed", "", Outcome)` ends the job (first writer wins); every agent stops
                    its workers, sets `ack/<id>` and exits; the store's host waits for those acks first.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from typing import Any

from spmd._core.log import get_logger
from spmd.comm.store.base import PrefixStore, Store
from spmd.run.config import RendezvousTimeouts

log = get_logger("spmd.run.rendezvous")


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    """One agent as the others see it."""

    node_id: int  # join order; unique within the job
    addr: str  # where other nodes reach it (for the workers' store when it has group rank 0)
    hostname: str
    nproc: int  # workers it runs
    node_rank: int | None  # the rank it asked for with --node-rank, if any
    pid: int

    def describe(self) -> str:
        return f"{self.hostname} (node {self.node_id}, pid {self.pid})"


@dataclasses.dataclass(frozen=True)
class Round:
    """One agreed membership: nodes in group-rank order, with the job's failure-restart count so far."""

    number: int
    nodes: tuple[NodeInfo, ...]
    restart_count: int
    note: str = ""  # for a round with no nodes: why the job waits, for what and until when

    @property
    def world_size(self) -> int:
        return sum(node.nproc for node in self.nodes)

    def group_rank(self, node_id: int) -> int | None:
        return next((i for i, node in enumerate(self.nodes) if node.node_id == node_id), None)

    def rank_offset(self, node_id: int) -> int:
        """The global rank of this node's local rank 0: the workers of the nodes before it come first."""
        group_rank = self.group_rank(node_id)
        if group_rank is None:
            raise ValueError(f"node {node_id} is not in round {self.number}")
        return sum(node.nproc for node in self.nodes[:group_rank])

    def to_json(self) -> str:
        return json.dumps({"number": self.number, "restart_count": self.restart_count, "note": self.note,
                           "nodes": [dataclasses.asdict(node) for node in self.nodes]})

    @staticmethod
    def from_json(text: bytes | str) -> Round:
        data = json.loads(text)
        return Round(data["number"], tuple(NodeInfo(**node) for node in data["nodes"]), data["restart_count"],
                     data.get("note", ""))

    def describe_node(self, node: NodeInfo) -> str:
        """'hostB (node 2, ranks 2-3)': a member as the summaries name it."""
        offset = self.rank_offset(node.node_id)
        ranks = f"rank {offset}" if node.nproc == 1 else f"ranks {offset}-{offset + node.nproc - 1}"
        return f"{node.hostname} (node {node.node_id}, {ranks})"


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How the job ended: status 'succeeded', 'failed' (a worker), 'timeout' or 'error' (rendezvous), or
    'interrupted' (a signal to an agent)."""

    status: str
    message: str
    failures: tuple[dict[str, Any], ...] = ()  # the WorkerFailures (as JSON) reported, when status is 'failed'
    lost: str | None = None  # the nodes whose loss ended the job (then the root cause), if that is what did

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @staticmethod
    def from_json(text: bytes | str) -> Outcome:
        data = json.loads(text)
        return Outcome(data["status"], data["message"], tuple(data["failures"]), data.get("lost"))


class RendezvousClient:
    """An agent's side of the protocol (steps 1, 4, 5, 7). Not thread-safe: the agent's main thread owns it."""

    def __init__(self, store: Store, run_id: str) -> None:
        self.store = PrefixStore(f"spmd/rdzv/{run_id}", store)
        self._latest: Round | None = None  # polled every monitor interval: fetch a round's body once

    def join(self, addr: str, hostname: str, nproc: int, node_rank: int | None, pid: int) -> NodeInfo:
        """Step 1: take a node id and announce this node."""
        node_id = self.store.add("join_seq", 1)
        self.store.add(f"hb/{node_id}", 1)
        info = NodeInfo(node_id, addr, hostname, nproc, node_rank, pid)
        self.store.set(f"node/{node_id}", json.dumps(dataclasses.asdict(info)))
        return info

    def latest_round(self) -> Round | None:
        if not self.store.check(["round"]):
            return None
        number = int(self.store.get("round"))
        if self._latest is None or self._latest.number != number:
            self._latest = Round.from_json(self.store.get(f"round/{number}"))
        return self._latest

    def outcome(self) -> Outcome | None:
        return Outcome.from_json(self.store.get("closed")) if self.store.check(["closed"]) else None

    def close(self, outcome: Outcome) -> Outcome:
        """End the job unless someone already did; returns the outcome that stands."""
        return Outcome.from_json(self.store.compare_set("closed", "", outcome.to_json()))

    def publish_master(self, round_number: int, addr: str, port: int, token: str) -> None:
        self.store.set(f"round/{round_number}/master", f"{addr}\n{port}\n{token}")

    def master(self, round_number: int) -> tuple[str, int, str] | None:
        """The workers' store of a round (addr, port, token), or None while its node has not published it."""
        key = f"round/{round_number}/master"
        if not self.store.check([key]):
            return None
        addr, port, token = self.store.get(key).decode().split("\n")
        return addr, int(port), token

    def report_failures(self, round_number: int, node_id: int, failures: list[dict[str, Any]]) -> None:
        self.store.set(f"round/{round_number}/failure/{node_id}", json.dumps(failures))

    def report_done(self, round_number: int, node_id: int) -> None:
        self.store.set(f"round/{round_number}/done/{node_id}", "1")

    def leave(self, node_id: int) -> None:
        self.store.set(f"left/{node_id}", "1")

    def ack(self, node_id: int) -> None:
        self.store.set(f"ack/{node_id}", "1")


class Heartbeat(threading.Thread):
    """Step 2: bumps this node's heartbeat counter; `error` holds why it stopped if the store went away."""

    def __init__(self, store: Store, run_id: str, node_id: int, interval: float) -> None:
        super().__init__(name=f"spmdrun-heartbeat-{node_id}", daemon=True)
        self.store = PrefixStore(f"spmd/rdzv/{run_id}", store)
        self.key, self.interval = f"hb/{node_id}", interval
        self.error: BaseException | None = None
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.interval):
            try:
                self.store.add(self.key, 1)
            except Exception as error:  # reported by the agent's main loop
                self.error = error
                return

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5.0)


@dataclasses.dataclass
class _Tracked:
    info: NodeInfo
    beats: int
    changed_at: float
    left: bool = False


class Coordinator:
    """Steps 3 and 6: the one place where rounds are decided. `step(now)` observes the store and acts once;
    `start()` runs it on a thread every `tick` seconds. Tests drive `step` with their own clock."""

    def __init__(self, store: Store, run_id: str, min_nodes: int, max_nodes: int, max_restarts: int,
                 timeouts: RendezvousTimeouts, now: float, tick: float = 0.05, failure_settle: float = 0.5) -> None:
        self.store = PrefixStore(f"spmd/rdzv/{run_id}", store)
        self.min_nodes, self.max_nodes, self.max_restarts = min_nodes, max_nodes, max_restarts
        self.timeouts, self.tick, self.failure_settle = timeouts, tick, failure_settle
        self.nodes: dict[int, _Tracked] = {}
        self.current: Round | None = None
        self.next_number = 0
        self.restart_count = 0
        self.wait_started = now  # when the job last had no running round (for join_timeout)
        self.settle_started: float | None = None  # when MIN nodes were first alive while waiting
        self.failure_seen_at: float | None = None  # when the running round's first failure report was seen
        self.closed: Outcome | None = None
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    # ---- observation -------------------------------------------------------------------------------------
    def _observe(self, now: float) -> None:
        joined = int(self.store.get("join_seq")) if self.store.check(["join_seq"]) else 0
        for node_id in range(1, joined + 1):
            if node_id not in self.nodes and self.store.check([f"node/{node_id}"]):
                info = NodeInfo(**json.loads(self.store.get(f"node/{node_id}")))
                self.nodes[node_id] = _Tracked(info, beats=-1, changed_at=now)
        for node_id, tracked in self.nodes.items():
            if tracked.left:
                continue
            if self.store.check([f"left/{node_id}"]):
                tracked.left = True
                continue
            beats = int(self.store.get(f"hb/{node_id}"))
            if beats != tracked.beats:
                tracked.beats, tracked.changed_at = beats, now
        if self.closed is None and self.store.check(["closed"]):
            self.closed = Outcome.from_json(self.store.get("closed"))

    def alive(self, now: float) -> list[NodeInfo]:
        """Nodes that have not left and whose heartbeat moved within heartbeat_timeout, in join order."""
        return [tracked.info for node_id, tracked in sorted(self.nodes.items())
                if not tracked.left and now - tracked.changed_at <= self.timeouts.heartbeat_timeout]

    # ---- decision ----------------------------------------------------------------------------------------
    def step(self, now: float) -> None:
        """Observe the store, then take at most one decision (publish a round or close the job)."""
        self._observe(now)
        if self.closed is not None:
            return
        alive = self.alive(now)
        if self.current is None:
            self._while_waiting(alive, now)
        else:
            self._while_running(self.current, alive, now)

    def _while_waiting(self, alive: list[NodeInfo], now: float) -> None:
        if len(alive) >= self.min_nodes:
            self.settle_started = now if self.settle_started is None else self.settle_started
            if len(alive) >= self.max_nodes or now - self.settle_started >= self.timeouts.last_call_timeout:
                self._publish(alive)
            return
        self.settle_started = None
        if now - self.wait_started > self.timeouts.join_timeout:
            missing = self.min_nodes - len(alive)
            joined = ", ".join(node.describe() for node in alive) or "none"
            self._close(Outcome("timeout", (
                f"spmdrun: rendezvous timed out after {self.timeouts.join_timeout:g}s: {len(alive)} of the "
                f"{self.min_nodes} nodes needed are here, {missing} node(s) missing (joined: {joined}). Start the "
                f"missing node(s) with the same --rdzv-endpoint and --rdzv-id, or lower --nnodes.")))

    def _while_running(self, current: Round, alive: list[NodeInfo], now: float) -> None:
        done = [self.store.check([f"round/{current.number}/done/{node.node_id}"]) for node in current.nodes]
        if all(done):
            self._close(Outcome("succeeded", "every worker exited 0"))
            return
        alive_ids = {node.node_id for node in alive}
        reported = {node.node_id: json.loads(self.store.get(key)) for node in current.nodes
                    if self.store.check([key := f"round/{current.number}/failure/{node.node_id}"])}
        failures = tuple(sorted((failure for report in reported.values() for failure in report),
                                key=lambda failure: (failure["timestamp"], failure["rank"])))
        lost = [node for node in current.nodes if node.node_id not in alive_ids]
        if lost:
            self._lose_nodes(current, lost, alive, failures, now)
            return
        if reported:
            if self._failures_settled(current, set(reported), now):
                self._fail_round(failures, alive, now)
        elif not any(done) and len(current.nodes) < self.max_nodes and len(alive) > len(current.nodes):
            self._publish(alive)  # a node joined late and there is room: scale up

    def _failures_settled(self, current: Round, reported: set[int], now: float) -> bool:
        """Whether to act on the failure reports of the running round now.

        Note: failure reports and dying nodes
        A worker failure often causes others (peers lose their connection and fail too), so the earliest report
        is the root cause; waiting failure_settle lets a root cause reported late still come first. When a
        member dies, the survivors' workers fail at once but its heartbeat goes stale only later. So a member
        that has not reported must show a heartbeat newer than the first report before the failure counts: a
        live one does within a heartbeat interval; a dead one never does, and once its heartbeat times out the
        round regroups as a membership change, which uses no restart.
        """
        if len(reported) == len(current.nodes):
            return True  # every member is alive enough to report
        self.failure_seen_at = now if self.failure_seen_at is None else self.failure_seen_at
        if now - self.failure_seen_at < self.failure_settle:
            return False
        return all(self.nodes[node.node_id].changed_at > self.failure_seen_at
                   for node in current.nodes if node.node_id not in reported)

    def _fail_round(self, failures: tuple[dict[str, Any], ...], alive: list[NodeInfo], now: float) -> None:
        """Restart after a worker failure while restarts remain, else end the job with the failures."""
        if self.restart_count >= self.max_restarts:
            self._close(Outcome("failed", f"worker failure with {self.restart_count} of {self.max_restarts} "
                                "restarts used", failures))
            return
        self.restart_count += 1
        log.info("round failed (first: rank %s); restart %d of %d", failures[0].get("rank"), self.restart_count,
                 self.max_restarts)
        self._regroup(alive, now)

    def _lose_nodes(self, current: Round, lost: list[NodeInfo], alive: list[NodeInfo],
                    failures: tuple[dict[str, Any], ...], now: float) -> None:
        """Members died or left. With MIN nodes left the job goes on without them (a membership change, no restart
        used). With fewer it needs a node to (re-)join. A fixed-size job with no restarts left ends now, naming
        the lost nodes (the root cause of the worker failures reported); with restarts left it uses one and waits.
        An elastic job waits for nodes as when it started. Waits last at most join_timeout and say for what and
        until when."""
        if len(alive) >= self.min_nodes:
            self._publish(alive)
            return
        gone = ", ".join(current.describe_node(node) for node in lost)
        agents = "its agent" if len(lost) == 1 else "their agents"
        what = (f"lost {gone}: {agents} sent no heartbeat for {self.timeouts.heartbeat_timeout:g}s (died, or the "
                f"host is unreachable)")
        restart = ""
        if self.min_nodes == self.max_nodes:
            if self.restart_count >= self.max_restarts:
                message = (f"a node was lost; {len(alive)} of the {self.min_nodes} nodes needed are left and no "
                           f"restarts are left ({self.restart_count} of {self.max_restarts} used) to wait for a "
                           "re-join")
                self._close(Outcome("failed", message, failures, lost=what))
                return
            self.restart_count += 1
            restart = f", restart {self.restart_count} of {self.max_restarts}"
        note = f"{what}; waiting {self._until()} for {self.min_nodes - len(alive)} node(s) to join{restart}"
        log.info("%s", note)
        self._wait_for_nodes(now, note)

    def _regroup(self, alive: list[NodeInfo], now: float) -> None:
        """Start a new round with the live nodes, or, with too few, publish an empty round and wait for more."""
        if len(alive) >= self.min_nodes:
            self._publish(alive)
            return
        self._wait_for_nodes(now, f"too few nodes left (need {self.min_nodes}); waiting {self._until()} for more")

    def _until(self) -> str:
        """'until 15:32:10 (join_timeout 600s)': the end of a wait for nodes starting now, by the wall clock."""
        until = time.strftime("%H:%M:%S", time.localtime(time.time() + self.timeouts.join_timeout))
        return f"until {until} (join_timeout {self.timeouts.join_timeout:g}s)"

    def _wait_for_nodes(self, now: float, note: str) -> None:
        """Publish an empty round (every agent stops its workers and waits) that says why, and wait for nodes."""
        self._write_round(Round(self.next_number, (), self.restart_count, note))
        self.current, self.wait_started, self.settle_started, self.failure_seen_at = None, now, None, None

    def _publish(self, alive: list[NodeInfo]) -> None:
        members = {node.node_id for node in self.current.nodes} if self.current else set()
        chosen = sorted(alive, key=lambda node: (node.node_id not in members, node.node_id))[:self.max_nodes]
        ranked = tuple(sorted(chosen, key=lambda node: (node.node_rank is None, node.node_rank or 0, node.node_id)))
        claimed = [node.node_rank for node in ranked if node.node_rank is not None]
        if len(set(claimed)) != len(claimed):
            dup = next(rank for rank in claimed if claimed.count(rank) > 1)
            hosts = ", ".join(node.describe() for node in ranked if node.node_rank == dup)
            self._close(Outcome("error", f"spmdrun: two agents claim --node-rank {dup}: {hosts}. Give each "
                                "node its own --node-rank."))
            return
        self.current = Round(self.next_number, ranked, self.restart_count)
        self._write_round(self.current)
        self.settle_started = self.failure_seen_at = None

    def _write_round(self, new: Round) -> None:
        self.store.set(f"round/{new.number}", new.to_json())
        self.store.set("round", str(new.number))
        self.next_number = new.number + 1

    def _close(self, outcome: Outcome) -> None:
        self.closed = Outcome.from_json(self.store.compare_set("closed", "", outcome.to_json()))

    # ---- thread ------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="spmdrun-coordinator", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._halt.wait(self.tick):
            try:
                self.step(time.monotonic())
            except Exception as error:  # the agent's main loop reports it
                self.error = error
                return

    def wait_for_acks(self, timeout: float) -> None:
        """After the job closed and `stop()`, wait until every live node acknowledged (or left), so the store
        outlives their last reads. A node that dies meanwhile drops out when its heartbeat goes stale."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            now = time.monotonic()
            self._observe(now)
            alive = self.alive(now)
            if all(self.store.check([f"ack/{node.node_id}"]) for node in alive):
                return
            time.sleep(self.tick)

    def stop(self) -> None:
        self._halt.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
