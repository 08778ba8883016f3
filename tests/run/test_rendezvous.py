"""The rendezvous coordinator's decisions, driven step by step with a fake clock over a HashStore.

Agents are played by RendezvousClient calls and heartbeat bumps; no threads, no processes, no sleeping.
"""

from __future__ import annotations

from spmd.comm.store.base import HashStore, PrefixStore
from spmd.run.config import RendezvousTimeouts
from spmd.run.rendezvous import Coordinator, NodeInfo, Outcome, RendezvousClient, Round

TIMEOUTS = RendezvousTimeouts(join_timeout=30.0, last_call_timeout=2.0, heartbeat_interval=1.0,
                              heartbeat_timeout=5.0)


class Job:
    """One store, one coordinator, and helpers to act as the agents."""

    def __init__(self, min_nodes: int, max_nodes: int, max_restarts: int = 0) -> None:
        self.store = HashStore(timeout=1.0)
        self.coordinator = Coordinator(self.store, "job", min_nodes, max_nodes, max_restarts, TIMEOUTS, now=0.0)
        self.client = RendezvousClient(self.store, "job")
        self.raw = PrefixStore("spmd/rdzv/job", self.store)

    def join(self, host: str, nproc: int = 2, node_rank: int | None = None) -> NodeInfo:
        return self.client.join(f"10.0.0.{host[-1]}", host, nproc, node_rank, pid=100)

    def beat(self, *nodes: NodeInfo) -> None:
        for node in nodes:
            self.raw.add(f"hb/{node.node_id}", 1)

    def step(self, now: float) -> Round | None:
        self.coordinator.step(now)
        return self.client.latest_round()


def test_fixed_size_job_starts_when_all_nodes_joined_with_ranks_by_node_rank() -> None:
    job = Job(2, 2)
    b = job.join("host1", nproc=3, node_rank=1)
    assert job.step(0.1) is None  # one of two
    a = job.join("host0", nproc=2, node_rank=0)
    first = job.step(0.2)
    assert first is not None and first.number == 0
    assert [node.node_id for node in first.nodes] == [a.node_id, b.node_id]  # by --node-rank, not join order
    assert (first.world_size, first.rank_offset(a.node_id), first.rank_offset(b.node_id)) == (5, 0, 2)
    assert first.group_rank(b.node_id) == 1 and first.group_rank(99) is None


def test_elastic_job_waits_last_call_for_more_nodes() -> None:
    job = Job(1, 3)
    a = job.join("host0")
    assert job.step(0.0) is None  # min reached: settle for last_call_timeout
    b = job.join("host1")
    job.beat(a, b)
    assert job.step(1.0) is None
    started = job.step(2.1)
    assert started is not None and [node.node_id for node in started.nodes] == [a.node_id, b.node_id]


def test_late_joiner_triggers_a_new_round_and_a_full_job_keeps_extra_nodes_waiting() -> None:
    job = Job(1, 2)
    a = job.join("host0")
    job.step(0.0)
    assert job.step(2.5).number == 0
    b = job.join("host1")
    job.beat(a)
    second = job.step(3.0)
    assert second.number == 1 and second.world_size == 4 and second.restart_count == 0
    c = job.join("host2")
    job.beat(a, b)
    assert job.step(3.5).number == 1  # full (max 2): host2 waits
    assert c.node_id not in {node.node_id for node in second.nodes}


def failure(rank: int, timestamp: float) -> dict[str, float]:
    return {"rank": rank, "timestamp": timestamp}


def test_failure_restarts_until_the_budget_is_spent_then_closes_with_the_failures() -> None:
    job = Job(1, 1, max_restarts=1)
    a = job.join("host0")
    first = job.step(0.0)
    job.client.report_failures(first.number, a.node_id, [failure(1, 5.0)])
    job.beat(a)
    second = job.step(0.1)  # every member reported: no need to wait for more reports
    assert (second.number, second.restart_count) == (1, 1)
    job.client.report_failures(second.number, a.node_id, [failure(1, 7.0), failure(0, 6.0)])
    job.step(0.2)
    outcome = job.client.outcome()
    assert outcome is not None and outcome.status == "failed"
    assert outcome.failures == (failure(0, 6.0), failure(1, 7.0))  # earliest first
    assert "1 of 1 restarts used" in outcome.message


def test_the_earliest_failure_wins_even_when_reported_second() -> None:
    job = Job(2, 2)
    a, b = job.join("host0"), job.join("host1")
    first = job.step(0.0)
    job.client.report_failures(first.number, b.node_id, [failure(3, 10.5)])  # a consequence, reported first
    job.beat(a, b)
    job.step(0.2)
    assert job.client.outcome() is None  # waiting failure_settle for the other member's report
    job.client.report_failures(first.number, a.node_id, [failure(0, 10.0)])
    job.step(0.3)
    outcome = job.client.outcome()
    assert outcome is not None and [f["rank"] for f in outcome.failures] == [0, 3]


def test_a_lone_failure_report_is_acted_on_after_the_settle_time() -> None:
    job = Job(2, 2)
    a, b = job.join("host0"), job.join("host1")
    first = job.step(0.0)
    job.client.report_failures(first.number, b.node_id, [failure(2, 1.0)])
    job.beat(a, b)
    job.step(0.1)
    assert job.client.outcome() is None
    job.step(0.7)
    assert job.client.outcome() is None  # host0 has not beaten since the report: it may be dying
    job.beat(a)
    job.step(0.8)
    assert job.client.outcome().failures == (failure(2, 1.0),)


def test_failures_caused_by_a_dying_node_use_no_restart() -> None:
    job = Job(1, 2, max_restarts=0)
    a, b = job.join("host0"), job.join("host1")
    job.beat(a, b)
    first = job.step(2.1)  # host1's last heartbeat is seen now
    assert first.world_size == 4
    job.client.report_failures(first.number, a.node_id, [failure(0, 3.0)])  # host1 died: its peers fail
    for now in (3.0, 4.0, 5.0, 6.0):  # host1 is silent; its heartbeat verdict is awaited, not the restart budget
        job.beat(a)
        job.step(now)
        assert job.client.outcome() is None
    job.beat(a)
    second = job.step(7.2)  # host1's heartbeat is now 5.2s old: dead
    assert (second.number, second.restart_count, second.world_size) == (1, 0, 2)
    assert job.client.outcome() is None


def test_all_done_closes_succeeded() -> None:
    job = Job(2, 2)
    a, b = job.join("host0"), job.join("host1")
    first = job.step(0.0)
    job.client.report_done(first.number, a.node_id)
    job.step(0.1)
    assert job.client.outcome() is None
    job.client.report_done(first.number, b.node_id)
    job.step(0.2)
    assert job.client.outcome() == Outcome("succeeded", "every worker exited 0")
    assert job.step(0.3).number == 0  # closed: nothing more is decided


def test_dead_node_regroups_and_too_few_nodes_pause_then_time_out() -> None:
    job = Job(2, 3)
    a, b, _ = job.join("host0"), job.join("host1"), job.join("host2")
    assert job.step(0.0).world_size == 6
    for now in (2.0, 4.0, 6.0):  # host2 stops beating
        job.beat(a, b)
        latest = job.step(now)
    assert latest.number == 1 and [node.node_id for node in latest.nodes] == [a.node_id, b.node_id]
    job.client.leave(b.node_id)
    job.beat(a)
    paused = job.step(6.5)
    assert paused.number == 2 and paused.nodes == ()  # too few: everyone stops and waits
    for now in (10.0, 20.0, 30.0, 37.0):
        job.beat(a)
        job.step(now)
    outcome = job.client.outcome()
    assert outcome is not None and outcome.status == "timeout"
    assert "1 of the 2 nodes needed are here, 1 node(s) missing" in outcome.message
    assert "host0" in outcome.message


def test_rendezvous_timeout_names_the_missing_count() -> None:
    job = Job(3, 3)
    a = job.join("host0")
    for now in (4.0, 8.0, 12.0, 16.0, 20.0, 24.0, 28.0):
        job.beat(a)
        job.step(now)
    assert job.client.outcome() is None
    job.beat(a)
    job.step(31.0)
    outcome = job.client.outcome()
    assert outcome is not None and "2 node(s) missing" in outcome.message and "after 30s" in outcome.message


def test_duplicate_node_ranks_are_an_error_naming_both_nodes() -> None:
    job = Job(2, 2)
    job.join("host0", node_rank=1)
    job.join("host1", node_rank=1)
    job.step(0.0)
    outcome = job.client.outcome()
    assert outcome is not None and outcome.status == "error"
    assert "--node-rank 1" in outcome.message and "host0" in outcome.message and "host1" in outcome.message


def test_master_address_roundtrip_and_first_close_wins() -> None:
    job = Job(1, 1)
    assert job.client.master(0) is None
    job.client.publish_master(0, "10.0.0.1", 29500, "tok")
    assert job.client.master(0) == ("10.0.0.1", 29500, "tok")
    first = job.client.close(Outcome("interrupted", "SIGINT"))
    second = job.client.close(Outcome("succeeded", "late"))
    assert first == second == Outcome("interrupted", "SIGINT")


def test_a_node_lost_from_a_fixed_size_job_without_restarts_ends_it_naming_the_host_and_its_ranks() -> None:
    job = Job(2, 2)
    a, b = job.join("host0", node_rank=0), job.join("host1", node_rank=1)
    first = job.step(0.0)
    assert first is not None and first.world_size == 4
    job.client.report_failures(first.number, a.node_id, [failure(0, 1.0)])  # its workers lost their peers
    for now in (1.0, 3.0, 5.0):                  # host1's agent was killed at 0: no heartbeat from it
        job.beat(a)
        job.step(now)
    assert job.client.outcome() is None          # within the heartbeat timeout (5s), b may still report
    job.beat(a)
    job.step(5.5)
    outcome = job.client.outcome()
    assert outcome is not None and outcome.status == "failed"
    assert outcome.lost == f"lost host1 (node {b.node_id}, ranks 2-3): its agent sent no heartbeat for 5s (died, or " \
                           "the host is unreachable)"
    assert "no restarts are left (0 of 0 used)" in outcome.message
    assert outcome.failures == (failure(0, 1.0),)     # the survivors' failures: consequences, reported with it


def test_a_node_lost_with_restarts_left_is_waited_for_until_a_stated_time_then_rejoins() -> None:
    job = Job(2, 2, max_restarts=1)
    a, b = job.join("host0", node_rank=0), job.join("host1", node_rank=1)
    job.step(0.0)
    for now in (2.0, 4.0, 5.5):
        job.beat(a)
        paused = job.step(now)
    assert paused is not None and paused.number == 1 and paused.nodes == ()
    assert paused.note.startswith(f"lost host1 (node {b.node_id}, ranks 2-3): ")
    assert "waiting until " in paused.note and "(join_timeout 30s) for 1 node(s) to join, restart 1 of 1" in paused.note
    again = job.join("host1", node_rank=1)           # its agent is started again
    job.beat(a)
    resumed = job.step(6.0)
    assert resumed is not None and resumed.number == 2 and resumed.restart_count == 1
    assert [node.node_id for node in resumed.nodes] == [a.node_id, again.node_id]
