"""spmdrun's argument parsing, LaunchConfig validation and Slurm detection (pure functions), and its imports."""

from __future__ import annotations

import subprocess
import sys

import pytest

from spmd.run.cli import launch_config, parse_endpoint, parse_nnodes
from spmd.run.config import DEFAULT_RDZV_PORT, EntryKind, LaunchConfig, RendezvousTimeouts, Std, StdPolicy
from spmd.run.slurm import detect, expand_hostlist, in_srun_step


def test_script_arguments_pass_through_untouched() -> None:
    config = launch_config(["--nproc-per-node", "4", "train.py", "--lr", "1e-3", "--nnodes", "7", "-m"], environ={})
    assert config.entrypoint == "train.py"
    assert config.args == ("--lr", "1e-3", "--nnodes", "7", "-m")
    assert config.nproc_per_node == 4
    assert (config.min_nodes, config.max_nodes) == (1, 1)
    assert not config.is_multinode and config.kind is EntryKind.SCRIPT
    assert config.omp_num_threads == 1  # torchrun's default when several workers share a node


def test_torchrun_spellings_module_and_no_python() -> None:
    config = launch_config(["--nproc_per_node=2", "--max_restarts", "3", "-m", "pkg.train", "x"], environ={})
    assert (config.kind, config.entrypoint, config.args, config.max_restarts) == (EntryKind.MODULE, "pkg.train",
                                                                                  ("x",), 3)
    assert launch_config(["--no-python", "echo", "hi"], environ={}).kind is EntryKind.BINARY
    with pytest.raises(ValueError, match="exclude each other"):
        launch_config(["-m", "--no-python", "x"], environ={})


def test_multinode_flags() -> None:
    config = launch_config(["--nnodes", "1:4", "--rdzv-endpoint", "node0:1234", "--rdzv-conf",
                         "join_timeout=5,last_call_timeout=0.5", "t.py"], environ={})
    assert (config.min_nodes, config.max_nodes, config.is_elastic) == (1, 4, True)
    assert (config.rdzv_host, config.rdzv_port, config.rdzv_id) == ("node0", 1234, "default")
    assert config.timeouts.join_timeout == 5 and config.timeouts.last_call_timeout == 0.5
    fixed = launch_config(["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "h", "--rdzv-id", "j", "t.py"],
                       environ={})
    assert (fixed.node_rank, fixed.rdzv_port, fixed.rdzv_id) == (1, DEFAULT_RDZV_PORT, "j")


def test_nproc_auto_and_cpu() -> None:
    assert launch_config(["--nproc-per-node", "cpu", "t.py"], environ={}).nproc_per_node >= 1
    assert launch_config(["--nproc-per-node", "auto", "t.py"], environ={}).nproc_per_node >= 1
    with pytest.raises(ValueError, match="--nproc-per-node 'lots'"):
        launch_config(["--nproc-per-node", "lots", "t.py"], environ={})


@pytest.mark.parametrize(("argv", "message"), [
    (["--nnodes", "2", "t.py"], "needs --rdzv-endpoint"),
    (["--nnodes", "3:2", "--rdzv-endpoint", "h", "t.py"], "1 <= MIN <= MAX"),
    (["--nnodes", "x", "t.py"], "N or MIN:MAX"),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h", "t.py"], "out of range"),
    (["--nnodes", "1:2", "--node-rank", "0", "--rdzv-endpoint", "h", "t.py"], "can't be combined with an elastic"),
    (["--standalone", "--nnodes", "2", "t.py"], "--standalone runs one node"),
    (["--nproc-per-node", "0", "t.py"], "at least 1"),
    (["--max-restarts", "-1", "t.py"], "--max-restarts"),
    (["--rdzv-endpoint", "h:port", "t.py"], "is not a number"),
    (["--rdzv-conf", "join=3", "t.py"], "expected key=seconds"),
    (["--rdzv-conf", "heartbeat_interval=5,heartbeat_timeout=6", "t.py"], "must exceed twice"),
    (["--redirects", "4", "t.py"], "0 \\(none\\)"),
    (["--tee", "a:1", "t.py"], "LOCAL_RANK:FLAG"),
    (["--local-ranks-filter", "0,x", "t.py"], "like 0,2,3"),
    (["--master-port", "70000", "t.py"], "not a TCP port"),
])
def test_bad_arguments_say_what_to_fix(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        launch_config(argv, environ={})


def test_missing_script_is_an_argparse_error() -> None:
    with pytest.raises(SystemExit):
        launch_config(["--nproc-per-node", "2"], environ={})


def test_endpoint_and_nnodes_parsing() -> None:
    assert parse_endpoint("[::1]:5") == ("::1", 5)
    assert parse_endpoint("[::1]") == ("::1", DEFAULT_RDZV_PORT)
    assert parse_endpoint("10.0.0.1:29500") == ("10.0.0.1", 29500)
    assert parse_nnodes("3") == (3, 3) and parse_nnodes("2:8") == (2, 8)
    with pytest.raises(ValueError, match="has no host"):
        parse_endpoint(":5")


def test_std_policies() -> None:
    assert StdPolicy.parse("3", "--tee").for_rank(5) is Std.ALL
    mixed = StdPolicy.parse("0:3,1:1", "--redirects")
    assert (mixed.for_rank(0), mixed.for_rank(1), mixed.for_rank(2)) == (Std.ALL, Std.OUT, Std.NONE)
    assert mixed.any() and not StdPolicy.parse("0", "--tee").any()
    config = launch_config(["-r", "1", "-t", "2", "--log-dir", "/tmp/x", "--local-ranks-filter", "0,2", "t.py"],
                        environ={})
    assert config.redirects.default is Std.OUT and config.tee.default is Std.ERR
    assert config.local_ranks_filter == frozenset({0, 2}) and config.log_dir == "/tmp/x"


def test_rendezvous_timeouts_parse() -> None:
    assert RendezvousTimeouts.parse("") == RendezvousTimeouts()
    with pytest.raises(ValueError, match="is not a number"):
        RendezvousTimeouts.parse("join_timeout=soon")
    with pytest.raises(ValueError, match="must be positive"):
        RendezvousTimeouts(join_timeout=0)


def test_launch_config_needs_an_entrypoint() -> None:
    with pytest.raises(ValueError, match="missing the training script"):
        LaunchConfig(entrypoint="")


# ---- Slurm -------------------------------------------------------------------------------------------------------

SRUN_ENV = {
    "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "3", "SLURM_STEP_NUM_TASKS": "3",
    "SLURM_PROCID": "2", "SLURM_STEP_NODELIST": "gpu[007-008],cpu1",
}


def test_slurm_hostlists() -> None:
    assert expand_hostlist("gpu[01-03,07],login") == ["gpu01", "gpu02", "gpu03", "gpu07", "login"]
    assert expand_hostlist("rack[1-2]-n[1-2]") == ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]
    assert expand_hostlist("single") == ["single"]
    assert expand_hostlist("") == []
    with pytest.raises(ValueError, match="can't parse Slurm host list"):
        expand_hostlist("gpu[a-b]")


def test_slurm_step_gives_the_node_set() -> None:
    assert in_srun_step(SRUN_ENV) and not in_srun_step({"SLURM_JOB_ID": "1"})  # a batch script is not a step
    found = detect(SRUN_ENV)
    assert (found.nnodes, found.node_rank, found.host) == (3, 2, "gpu007")
    assert found.port == DEFAULT_RDZV_PORT + 4242 % 1000
    config = launch_config(["--nproc-per-node", "8", "train.py"], environ=SRUN_ENV)
    assert (config.min_nodes, config.max_nodes, config.node_rank) == (3, 3, 2)
    assert (config.rdzv_host, config.rdzv_port, config.rdzv_id) == ("gpu007", found.port, "slurm-4242.0")
    explicit = launch_config(["--nnodes", "1", "train.py"], environ=SRUN_ENV)  # flags win over Slurm
    assert not explicit.is_multinode


def test_slurm_with_several_tasks_per_node_is_refused() -> None:
    with pytest.raises(ValueError, match="ntasks-per-node=1"):
        detect({**SRUN_ENV, "SLURM_STEP_NUM_TASKS": "6"})
    with pytest.raises(ValueError, match="SLURM_PROCID"):
        detect({key: value for key, value in SRUN_ENV.items() if key != "SLURM_PROCID"})


def test_rendezvous_token_comes_from_the_flag_the_environment_or_a_private_file(tmp_path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    token_file.chmod(0o600)
    args = ["--nnodes", "2", "--rdzv-endpoint", "h:1", "--rdzv-token-file", str(token_file), "t.py"]
    assert launch_config(args, environ={}).rdzv_token == "from-file"
    assert launch_config(args, environ={"SPMD_STORE_TOKEN": "from-env"}).rdzv_token == "from-env"
    assert launch_config(["--rdzv-token", "flag", *args], environ={"SPMD_STORE_TOKEN": "e"}).rdzv_token == "flag"
    assert "from-file" not in repr(launch_config(args, environ={}))
    token_file.chmod(0o644)
    with pytest.raises(ValueError, match=r"open to others.*chmod 600"):
        launch_config(args, environ={})
    with pytest.raises(ValueError, match="can't read --rdzv-token-file"):
        launch_config(["--rdzv-token-file", str(tmp_path / "missing"), "t.py"], environ={})


def test_torchs_legacy_launcher_passes_local_rank_and_meets_at_the_master_address() -> None:
    from spmd import launch

    config = launch.parse_args(["--nproc_per_node=2", "train.py", "--lr", "1"], environ={})
    assert config.local_rank_arg and config.args == ("--lr", "1") and not config.is_multinode
    assert not launch.parse_args(["--use_env", "train.py"], environ={}).local_rank_arg
    assert not launch_config(["train.py"], environ={}).local_rank_arg            # spmdrun: LOCAL_RANK only
    multinode = launch.parse_args(["--nnodes=2", "--node_rank=1", "--master_addr=10.0.0.5", "train.py"], environ={})
    assert (multinode.rdzv_host, multinode.rdzv_port, multinode.node_rank) == ("10.0.0.5", 29500, 1)
    assert multinode.master_addr is None and multinode.master_port is None    # the workers' store: a free port
    with pytest.raises(ValueError, match="--no-python needs --use-env"):
        launch.parse_args(["--no-python", "echo"], environ={})


def test_the_launcher_and_its_agent_start_without_importing_torch() -> None:
    """spmdrun's agent (rendezvous, workers, the SIGUSR1 status report) never imports torch: that import costs
    seconds of start-up on every launch and every restart round."""
    code = "import sys, spmd.run.cli, spmd.run.agent, spmd.run.torchrun; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
