"""torch scripts port by changing the import: tutorial scripts, written as the public tutorials write them, run
unchanged under torch's own launcher and distributed package, and, after the textual swap of torch's
distributed package for `spmd` (and torch's DistributedDataParallel for spmd's), under spmdrun; both launches
run 2 real processes and must agree."""

from __future__ import annotations

import contextlib
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys

import pytest
import torch

SCRIPTS = pathlib.Path(__file__).parent / "porting"
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
TORCH_LAUNCHER = "torch.distributed.run"


def port(source: str) -> str:
    """The textual swap a user makes: torch's DistributedDataParallel for spmd's, torch's distributed package
    for spmd."""
    source = source.replace("from torch.nn.parallel import DistributedDataParallel",
                            "from spmd import DistributedDataParallel")
    source = source.replace("torch.nn.parallel.DistributedDataParallel", "spmd.DistributedDataParallel")
    source = source.replace("import torch.distributed as dist", "import spmd as dist")
    return source.replace("torch.distributed", "spmd")


TUTORIALS = ["ddp_tutorial.py", "collectives_tutorial.py", "fsdp2_tutorial.py", "fsdp1_tutorial.py", "tp_tutorial.py",
             "pipelining_tutorial.py", "zero_tutorial.py", "join_tutorial.py", "fsdp1_comm_hook_tutorial.py",
             "rpc_param_server_tutorial.py"]
# Each launcher runs the tutorials in one job, one after another in the same workers, each as its own `__main__`
# with its output prefix as argv[1] (each destroys its world and the next initializes a new one), so their launch
# and imports are paid once. Under torch's launcher each tutorial gets a store of its own, hosted by rank 0 on the
# next of the ports given (--ports): in torchrun's one store, gloo's next default group could read the addresses
# its destroyed predecessor left there and wait on them for good.
IN_TURN = """import os
import runpy
import sys

args = sys.argv[1:]
ports = args.pop(1).split(",") if args[0] == "--ports" else None
if ports is not None:
    args = args[1:]
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
for i, (script, out) in enumerate(zip(args[0::2], args[1::2])):
    if ports is not None:
        os.environ["MASTER_PORT"] = ports[i]
    sys.argv = [script, out]
    runpy.run_path(script, run_name="__main__")
"""


def free_ports(count: int) -> list[int]:
    """`count` distinct free ports below the kernel's ephemeral range: the last tutorial binds its port minutes
    after the pick, and a port from the ephemeral range may by then be the local end of any connection the other
    test workers opened (EADDRINUSE, seen once in make test). All are held while they are picked, so they are
    distinct (two tutorials on one port would meet the first one's store)."""
    ranges = pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(ranges.read_text().split()[0]) if ranges.exists() else 32768      # Linux's default
    candidates = random.Random().sample(range(max(1024, low - 12000), low), 200)
    with contextlib.ExitStack() as held:
        ports: list[int] = []
        for port in candidates:
            sock = held.enter_context(socket.socket())
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            ports.append(port)
            if len(ports) == count:
                return ports
    raise RuntimeError(f"no {count} free ports below the ephemeral range (from {low})")


def _script_env() -> dict[str, str]:
    """The environment a script runs in: CPU only, and this checkout's spmd first on the path."""
    src = str(pathlib.Path(__file__).parents[1] / "src")
    return {**os.environ, **CPU_ONLY, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}


def _launch(launcher: str, directory: pathlib.Path, names: list[str]) -> None:
    env = _script_env()
    (directory / "in_turn.py").write_text(IN_TURN)
    scripts = [str(arg) for name in names for arg in (directory / name, directory / f"{name}.out")]
    if launcher == TORCH_LAUNCHER:
        scripts = ["--ports", ",".join(map(str, free_ports(len(names)))), *scripts]
    _run_launcher([sys.executable, "-m", launcher, "--standalone", "--nproc-per-node", "2", "in_turn.py", *scripts],
                  launcher, env, directory)


def _run_launcher(command: list[str], launcher: str, env: dict[str, str], cwd: pathlib.Path) -> None:
    result = _run_once(command, launcher, env, cwd)
    for _ in range(4):
        if not (launcher.startswith("torch.") and "Signal 6 (SIGABRT)" in result.stderr):
            break
        # The oracle, not the code under test: in one run in six to ten here a torch worker dies of SIGABRT in
        # gloo's teardown at exit ("terminate called without an active exception"; the FSDP1 tutorial's 1 in 6
        # of its launches, and three in a row once in a full suite run). Up to four more launches; spmd's side
        # gets no second one.
        result = _run_once(command, launcher, env, cwd)
    assert result.returncode == 0, f"{launcher} failed:\n{result.stdout}\n{result.stderr}"
    assert launcher != "spmd.launch" or "deprecated" in result.stderr      # torch's warning, on both launchers


def _run_once(command: list[str], launcher: str, env: dict[str, str], cwd: pathlib.Path,
              ) -> subprocess.CompletedProcess[str]:
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
                          start_new_session=True) as launched:
        try:
            stdout, stderr = launched.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            launched.terminate()        # a launcher stops its workers on SIGTERM; killed, it would leave them
            try:
                stdout, stderr = launched.communicate(timeout=30)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(launched.pid, signal.SIGKILL)
            raise AssertionError(f"{launcher} ran past 300 s:\n{stdout}\n{stderr}") from None
    return subprocess.CompletedProcess(command, launched.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[pathlib.Path, pathlib.Path]]:
    """Every tutorial run under torch's launcher and its port under spmdrun: {tutorial: (torch's output prefix,
    spmd's)}."""
    root = tmp_path_factory.mktemp("porting")
    for side in ("torch", "spmd"):
        (root / side).mkdir()
    for name in TUTORIALS:
        source = (SCRIPTS / name).read_text()
        ported = port(source)
        assert "torch.distributed" not in ported and "torch.nn.parallel" not in ported
        (root / "torch" / name).write_text(source)
        (root / "spmd" / name).write_text(ported)
    _launch(TORCH_LAUNCHER, root / "torch", TUTORIALS)
    _launch("spmd.run", root / "spmd", TUTORIALS)
    return {name: (root / "torch" / f"{name}.out", root / "spmd" / f"{name}.out") for name in TUTORIALS}


def test_port_swaps_the_imports() -> None:
    ported = port("import torch.distributed as dist\nfrom torch.distributed.fsdp import fully_shard\n"
                  "from torch.nn.parallel import DistributedDataParallel as DDP\n"
                  "m = torch.nn.parallel.DistributedDataParallel(m)\n")
    assert ported == ("import spmd as dist\nfrom spmd.fsdp import fully_shard\n"
                      "from spmd import DistributedDataParallel as DDP\nm = spmd.DistributedDataParallel(m)\n")


@pytest.mark.timeout(600)
def test_ddp_tutorial_trains_the_same_weights_as_under_torch(launched: dict) -> None:
    torch_out, spmd_out = launched["ddp_tutorial.py"]
    expected, got = torch.load(torch_out), torch.load(spmd_out)
    assert expected["backend"] == got["backend"] == "gloo"
    assert expected["state"].keys() == got["state"].keys()
    for key, value in expected["state"].items():
        torch.testing.assert_close(got["state"][key], value, rtol=1e-6, atol=1e-7, msg=key)


@pytest.mark.timeout(600)
def test_collectives_tutorial_receives_what_torch_receives(launched: dict) -> None:
    torch_out, spmd_out = launched["collectives_tutorial.py"]
    for rank in range(2):
        expected = torch.load(f"{torch_out}{rank}", weights_only=False)
        got = torch.load(f"{spmd_out}{rank}", weights_only=False)
        assert expected.keys() == got.keys()
        for key, value in expected.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(got[key], value), (rank, key, got[key], value)
            else:
                assert got[key] == value, (rank, key)


@pytest.mark.timeout(600)
def test_fsdp2_tutorial_trains_the_same_weights_as_under_torch(launched: dict) -> None:
    torch_out, spmd_out = launched["fsdp2_tutorial.py"]
    expected, got = torch.load(torch_out), torch.load(spmd_out)
    torch.testing.assert_close(got["local"], expected["local"])
    torch.testing.assert_close(got["replicated"], expected["replicated"])
    assert expected["state"].keys() == got["state"].keys()
    for key, value in expected["state"].items():
        torch.testing.assert_close(got["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.timeout(600)
def test_fsdp1_tutorial_checkpoints_restarts_and_trains_as_under_torch(launched: dict) -> None:
    torch_out, spmd_out = launched["fsdp1_tutorial.py"]
    expected, got = torch.load(torch_out), torch.load(spmd_out)
    assert got["wrapped"] == expected["wrapped"] == 3            # the root and the policy's two units
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(expected["losses"]), rtol=1e-5, atol=1e-6)
    assert got["losses"][3:5] == got["losses"][5:]               # the restart trains on as the uninterrupted run
    for part in ("state", "optim"):
        assert list(got[part]) == list(expected[part])
        for key, value in expected[part].items():
            torch.testing.assert_close(got[part][key], value, rtol=1e-5, atol=1e-6, msg=(part, key))


@pytest.mark.timeout(600)
def test_tensor_parallel_tutorial_trains_the_same_weights_as_under_torch(launched: dict) -> None:
    torch_out, spmd_out = launched["tp_tutorial.py"]
    expected, got = torch.load(torch_out), torch.load(spmd_out)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(expected["losses"]), rtol=1e-5, atol=1e-6)
    assert expected["state"].keys() == got["state"].keys()
    for key, value in expected["state"].items():
        torch.testing.assert_close(got["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.timeout(600)
def test_pipelining_tutorial_cuts_and_trains_the_same_stages_as_under_torch(launched: dict) -> None:
    torch_out, spmd_out = launched["pipelining_tutorial.py"]
    for rank in range(2):
        expected, got = torch.load(f"{torch_out}{rank}"), torch.load(f"{spmd_out}{rank}")
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(expected["losses"]),
                                   rtol=1e-5, atol=1e-6)
        assert list(got["state"]) == list(expected["state"])           # the same cut, the model's names
        for key, value in expected["state"].items():
            torch.testing.assert_close(got["state"][key], value, rtol=1e-5, atol=1e-6, msg=(rank, key))


@pytest.mark.timeout(600)
def test_zero_tutorial_trains_the_same_weights_as_under_torch(launched: dict) -> None:
    torch_out, spmd_out = launched["zero_tutorial.py"]
    expected, got = torch.load(torch_out), torch.load(spmd_out)
    for run in ("zero", "plain"):
        assert expected[run].keys() == got[run].keys()
        for key, value in expected[run].items():
            torch.testing.assert_close(got[run][key], value, rtol=1e-5, atol=1e-6, msg=(run, key))
    for key, value in got["plain"].items():                   # ZeRO changes where the state lives, not the result
        torch.testing.assert_close(got["zero"][key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.timeout(600)
def test_join_tutorial_trains_and_counts_as_under_torch(launched: dict) -> None:
    torch_out, spmd_out = launched["join_tutorial.py"]
    expected, got = torch.load(torch_out), torch.load(spmd_out)
    assert torch.equal(got["counts"], expected["counts"]), (got["counts"], expected["counts"])
    for key, value in expected["plain"].items():
        torch.testing.assert_close(got["plain"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    # Under Join, a rank out of inputs steps ZeRO on the gradients DDP's shadow reduction wrote (the others'
    # average), so its parameters train as plain Adam's; torch's shadow reduction writes none and its joined rank
    # steps on its last, stale gradients.
    for key, value in got["plain"].items():
        torch.testing.assert_close(got["zero"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert any(not torch.allclose(expected["zero"][key], value) for key, value in expected["plain"].items())


@pytest.mark.timeout(600)
def test_fsdp1_comm_hook_tutorial_trains_the_same_weights_as_under_torch(launched: dict) -> None:
    torch_out, spmd_out = launched["fsdp1_comm_hook_tutorial.py"]
    expected, got = torch.load(torch_out), torch.load(spmd_out)
    for run in ("reduce_scatter", "allreduce"):
        assert expected[run].keys() == got[run].keys()
        for key, value in expected[run].items():
            torch.testing.assert_close(got[run][key], value, rtol=1e-6, atol=1e-7, msg=(run, key))


@pytest.mark.timeout(600)
def test_a_script_for_torchs_legacy_launcher_gets_its_local_rank_argument_under_spmd_launch(
        tmp_path: pathlib.Path) -> None:
    source = (SCRIPTS / "legacy_launch_tutorial.py").read_text()
    env = _script_env()
    outputs = {}
    for side, launcher, text in (("torch", "torch.distributed.launch", source),
                                 ("spmd", port("torch.distributed.launch"), port(source))):
        (tmp_path / side).mkdir()
        script = tmp_path / side / "legacy_launch_tutorial.py"
        script.write_text(text)
        _run_launcher([sys.executable, "-m", launcher, "--standalone", "--nproc_per_node", "2", str(script),
                       str(tmp_path / side / "out")], launcher, env, tmp_path / side)
        outputs[side] = torch.load(tmp_path / side / "out")
    assert port("torch.distributed.launch") == "spmd.launch"
    assert outputs["torch"]["local_ranks"] == outputs["spmd"]["local_ranks"] == [0, 1]
    for key, value in outputs["torch"]["state"].items():
        torch.testing.assert_close(outputs["spmd"]["state"][key], value, rtol=1e-6, atol=1e-7, msg=key)


@pytest.mark.timeout(300)
def test_spmd_and_the_spmd_backend_run_under_torchs_launcher(tmp_path: pathlib.Path) -> None:
    """torchrun's agent hosts the job's store on MASTER_PORT: spmd's world rendezvouses there (rank 0 used to
    try to serve a store of its own on that port), and so does torch's default group over "spmd"."""
    command = [sys.executable, "-m", TORCH_LAUNCHER, "--standalone", "--nproc-per-node", "2",
               str(SCRIPTS / "under_torchrun.py"), str(tmp_path / "seen")]
    result = _run_once(command, TORCH_LAUNCHER, _script_env(), tmp_path)
    assert result.returncode == 0, f"torchrun failed:\n{result.stdout}\n{result.stderr}"
    for rank in (0, 1):
        seen = torch.load(tmp_path / f"seen.{rank}")
        assert seen["spmd sum"] == seen["torch sum"] == 3.0 and seen["ddp"]
        assert seen["torch sees"] == (rank, 2, "spmd") and seen["left"] == (False, False)


@pytest.mark.timeout(600)
def test_a_job_launched_from_python_returns_what_torchs_launcher_api_returns(tmp_path: pathlib.Path) -> None:
    source = (SCRIPTS / "elastic_launch_tutorial.py").read_text()
    env = _script_env()
    returned = {}
    for side, text in (("torch", source), ("spmd", port(source))):
        (tmp_path / side).mkdir()
        script = tmp_path / side / "elastic_launch_tutorial.py"
        script.write_text(text)
        _run_launcher([sys.executable, str(script), str(tmp_path / side / "out")], f"{side}.launcher", env,
                      tmp_path / side)
        returned[side] = torch.load(tmp_path / side / "out")
    assert "from spmd.launcher.api import LaunchConfig, elastic_launch" in port(source)
    assert sorted(returned["torch"]) == sorted(returned["spmd"]) == [0, 1]
    for rank in (0, 1):
        theirs, ours = returned["torch"][rank], returned["spmd"][rank]
        assert (ours["rank"], ours["world_size"]) == (theirs["rank"], theirs["world_size"]) == (rank, 2)
        for key, value in theirs["state"].items():
            torch.testing.assert_close(ours["state"][key], value, rtol=1e-6, atol=1e-7, msg=key)


@pytest.mark.timeout(600)
def test_rpc_parameter_server_tutorial_trains_the_same_weights_as_under_torch(launched: dict) -> None:
    torch_out, spmd_out = launched["rpc_param_server_tutorial.py"]
    expected, got = torch.load(torch_out), torch.load(spmd_out)
    assert got["losses"] == expected["losses"]
    assert torch.equal(got["answer"], expected["answer"])
    for value, want in zip(got["weights"], expected["weights"], strict=True):
        assert torch.equal(value, want)


def _zeros_like(state: object) -> object:
    """The structure of a state dict, tensors zeroed and other leaves None (what a load fills)."""
    if isinstance(state, dict):
        return {key: _zeros_like(value) for key, value in state.items()}
    if isinstance(state, list):
        return [_zeros_like(value) for value in state]
    return torch.zeros_like(state) if isinstance(state, torch.Tensor) else None


@pytest.mark.timeout(600)
def test_spmd_loads_the_checkpoint_torchs_fsdp1_tutorial_saved(launched: dict, tmp_path: pathlib.Path) -> None:
    """A job moving to spmd resumes from its torch checkpoints: the one torch's FSDP1 tutorial run wrote (two ranks'
    shards, optimizer state included) loads as torch's own dcp_to_torch_save reads it."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    import spmd.checkpoint as spmd_dcp

    checkpoint = launched["fsdp1_tutorial.py"][0].parent / "fsdp1_checkpoint"
    dcp_to_torch_save(checkpoint, tmp_path / "full.pt")
    want = torch.load(tmp_path / "full.pt", weights_only=False)
    got = _zeros_like(want)
    spmd_dcp.load(got, checkpoint_id=str(checkpoint))

    def check(got: object, want: object, where: str) -> None:
        if isinstance(want, dict):
            assert isinstance(got, dict) and got.keys() == want.keys(), where
            for key in want:
                check(got[key], want[key], f"{where}.{key}")
        elif isinstance(want, list):
            for index, (item, expected) in enumerate(zip(got, want, strict=True)):
                check(item, expected, f"{where}.{index}")
        elif isinstance(want, torch.Tensor):
            assert torch.equal(got, want), where
        else:
            assert got == want, where

    check(got, want, "")
    assert any(isinstance(v, torch.Tensor) for v in got["app"]["model"].values())
