"""torch scripts port by changing the import: tutorial scripts, written as the public tutorials write them, run
unchanged under torch's own launcher and distributed package, and, after the textual swap of torch's
distributed package for `spmd` (and torch's DistributedDataParallel for spmd's), under spmdrun; both launches
run 2 real processes and must agree."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

SCRIPTS = pathlib.Path(__file__).parent / "porting"
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}


def port(source: str) -> str:
    """The textual swap a user makes: torch's DistributedDataParallel for spmd's, torch's distributed package
    for spmd."""
    source = source.replace("from torch.nn.parallel import DistributedDataParallel",
                            "from spmd import DistributedDataParallel")
    source = source.replace("torch.nn.parallel.DistributedDataParallel", "spmd.DistributedDataParallel")
    source = source.replace("import torch.distributed as dist", "import spmd as dist")
    return source.replace("torch.distributed", "spmd")


def _launch(launcher: str, script: pathlib.Path, out: pathlib.Path) -> None:
    src = str(pathlib.Path(__file__).parents[1] / "src")
    env = {**os.environ, **CPU_ONLY, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", launcher, "--standalone", "--nproc-per-node", "2", str(script), str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env, cwd=script.parent)
    assert result.returncode == 0, f"{launcher} failed:\n{result.stdout}\n{result.stderr}"


def _run_both(name: str, tmp_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """Launch the script under torch's launcher and its port under spmdrun; returns their output prefixes."""
    source = (SCRIPTS / name).read_text()
    ported = port(source)
    assert "torch.distributed" not in ported and "torch.nn.parallel" not in ported
    (tmp_path / "torch").mkdir()
    (tmp_path / "spmd").mkdir()
    original, swapped = tmp_path / "torch" / name, tmp_path / "spmd" / name
    original.write_text(source)
    swapped.write_text(ported)
    _launch("torch.distributed.run", original, tmp_path / "torch" / "out")
    _launch("spmd.run", swapped, tmp_path / "spmd" / "out")
    return tmp_path / "torch" / "out", tmp_path / "spmd" / "out"


def test_port_swaps_the_imports() -> None:
    ported = port("import torch.distributed as dist\nfrom torch.distributed.fsdp import fully_shard\n"
                  "from torch.nn.parallel import DistributedDataParallel as DDP\n"
                  "m = torch.nn.parallel.DistributedDataParallel(m)\n")
    assert ported == ("import spmd as dist\nfrom spmd.fsdp import fully_shard\n"
                      "from spmd import DistributedDataParallel as DDP\nm = spmd.DistributedDataParallel(m)\n")


@pytest.mark.timeout(400)
def test_ddp_tutorial_trains_the_same_weights_as_under_torch(tmp_path: pathlib.Path) -> None:
    torch_out, spmd_out = _run_both("ddp_tutorial.py", tmp_path)
    expected, got = torch.load(torch_out), torch.load(spmd_out)
    assert expected["backend"] == got["backend"] == "gloo"
    assert expected["state"].keys() == got["state"].keys()
    for key, value in expected["state"].items():
        torch.testing.assert_close(got["state"][key], value, rtol=1e-6, atol=1e-7, msg=key)


@pytest.mark.timeout(400)
def test_collectives_tutorial_receives_what_torch_receives(tmp_path: pathlib.Path) -> None:
    torch_out, spmd_out = _run_both("collectives_tutorial.py", tmp_path)
    for rank in range(2):
        expected = torch.load(f"{torch_out}{rank}", weights_only=False)
        got = torch.load(f"{spmd_out}{rank}", weights_only=False)
        assert expected.keys() == got.keys()
        for key, value in expected.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(got[key], value), (rank, key, got[key], value)
            else:
                assert got[key] == value, (rank, key)


@pytest.mark.timeout(400)
def test_fsdp2_tutorial_trains_the_same_weights_as_under_torch(tmp_path: pathlib.Path) -> None:
    torch_out, spmd_out = _run_both("fsdp2_tutorial.py", tmp_path)
    expected, got = torch.load(torch_out), torch.load(spmd_out)
    torch.testing.assert_close(got["local"], expected["local"])
    torch.testing.assert_close(got["replicated"], expected["replicated"])
    assert expected["state"].keys() == got["state"].keys()
    for key, value in expected["state"].items():
        torch.testing.assert_close(got["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)
