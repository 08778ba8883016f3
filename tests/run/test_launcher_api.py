"""spmd.launcher.api (torch's launcher API): elastic_launch runs a function or a program in this node's workers
and returns each worker's return value by global rank; a failure raises ChildFailedError naming the rank and its
exception, after max_restarts restarts; what can't reach a worker, or can't be served, is refused before
anything starts. Real processes (the workers import the standard library only). The same API against torch's,
on a training script, is in tests/test_porting.py."""

from __future__ import annotations

import sys

import pytest

from spmd.launcher.api import LaunchConfig, _agent_config, elastic_launch
from spmd.run.config import EntryKind
from spmd.run.failure import ChildFailedError
from tests.run import launch_targets

pytestmark = pytest.mark.timeout(120)


def _config(**overrides: object) -> LaunchConfig:
    return LaunchConfig(**{"min_nodes": 1, "max_nodes": 1, "nproc_per_node": 2, "rdzv_backend": "c10d",
                           "max_restarts": 0, **overrides})


def test_a_function_returns_each_workers_value_by_global_rank() -> None:
    assert elastic_launch(_config(), launch_targets.rank_and_world)(10) == {0: (10, 2, 0), 1: (11, 2, 1)}


def test_a_program_runs_in_every_worker_and_returns_none_for_each(capfd: pytest.CaptureFixture[str]) -> None:
    returned = elastic_launch(_config(), sys.executable)("-c", "import os; print('worker', os.environ['RANK'])")
    assert returned == {0: None, 1: None}
    out = capfd.readouterr().out
    assert "[rank0]: worker 0" in out and "[rank1]: worker 1" in out


def test_a_failing_worker_raises_child_failed_error_naming_its_rank_and_exception() -> None:
    with pytest.raises(ChildFailedError) as raised:
        elastic_launch(_config(), launch_targets.fail_on_rank_1)()
    assert raised.value.first.rank == 1
    assert "KeyError" in str(raised.value) and "no such shard" in str(raised.value)


def test_max_restarts_restarts_the_group_and_the_retry_returns() -> None:
    assert elastic_launch(_config(max_restarts=1), launch_targets.fail_first_attempt)() == {0: 1, 1: 1}


def test_what_cant_reach_a_worker_or_be_served_is_refused_before_anything_starts() -> None:
    with pytest.raises(ValueError, match=r"use a module-level function \(not a lambda"):
        elastic_launch(_config(), lambda: None)()
    with pytest.raises(ValueError, match=r"rdzv_backend 'etcd' is not served"):
        elastic_launch(_config(rdzv_backend="etcd", rdzv_endpoint="node0:2379"), sys.executable)()
    with pytest.raises(ValueError, match=r"entrypoint is None"):
        elastic_launch(_config(), None)()


def test_torchs_fields_map_to_spmdruns() -> None:
    one_node = _agent_config(_config(rdzv_endpoint="localhost:0", run_id="job", rdzv_timeout=30,
                                     rdzv_configs={"last_call_timeout": 2}, shutdown_timeout=7), "p", EntryKind.BINARY,
                             ("a",))
    assert one_node.rdzv_host is None and one_node.rdzv_id == "job" and one_node.args == ("a",)
    assert one_node.timeouts.join_timeout == 30 and one_node.timeouts.last_call_timeout == 2
    assert one_node.shutdown_grace == 7 and one_node.max_restarts == 0
    elastic = _agent_config(_config(min_nodes=1, max_nodes=4, rdzv_endpoint="node0:29400",
                                    rdzv_configs={"timeout": 60}), "p", EntryKind.BINARY, ())
    assert (elastic.rdzv_host, elastic.rdzv_port, elastic.is_elastic) == ("node0", 29400, True)
    assert elastic.timeouts.join_timeout == 60
    assert LaunchConfig(1, 1, 1).max_restarts == 3 and LaunchConfig(1, 1, 1).rdzv_backend == "etcd"   # torch's


def test_logs_specs_send_each_ranks_output_to_its_log_file(tmp_path, capfd: pytest.CaptureFixture[str]) -> None:
    from spmd.elastic.multiprocessing import DefaultLogsSpecs, Std

    logs = DefaultLogsSpecs(log_dir=str(tmp_path / "logs"), redirects={1: Std.OUT}, tee=Std.NONE)
    elastic_launch(_config(run_id="job", logs_specs=logs), sys.executable)(
        "-c", "import os; print('worker', os.environ['RANK'])")
    assert (tmp_path / "logs" / "job" / "attempt_0" / "1" / "stdout.log").read_text().strip() == "worker 1"
    out = capfd.readouterr().out
    assert "[rank0]: worker 0" in out and "worker 1" not in out       # rank 1's output went to its file only
    with pytest.raises(TypeError, match="logs_specs must be a LogsSpecs"):
        elastic_launch(_config(logs_specs="logs"), sys.executable)()


def test_std_parses_as_torchs() -> None:
    from torch.distributed.elastic.multiprocessing import Std as TorchStd

    from spmd.elastic.multiprocessing import Std

    for text in ("0", "3", "0:3,1:0,2:1,3:2"):
        ours, theirs = Std.from_str(text), TorchStd.from_str(text)
        if isinstance(theirs, dict):
            assert {rank: int(flag) for rank, flag in ours.items()} == {rank: int(f) for rank, f in theirs.items()}
        else:
            assert int(ours) == int(theirs)


def test_a_signal_to_the_agent_raises_torchs_signal_exception() -> None:
    """A worker sends SIGTERM to its agent (this process, where elastic_launch runs it): the workers are stopped
    and elastic_launch raises SignalException with the signal, as torch's does."""
    import signal

    from spmd.elastic.multiprocessing.api import SignalException

    kill_parent = ("import os, signal, time; os.environ['RANK'] == '0' and os.kill(os.getppid(), signal.SIGTERM); "
                   "time.sleep(60)")
    with pytest.raises(SignalException, match="got signal SIGTERM") as raised:
        elastic_launch(_config(), sys.executable)("-c", kill_parent)
    assert raised.value.sigval == signal.SIGTERM
