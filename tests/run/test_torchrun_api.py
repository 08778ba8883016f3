"""torch.distributed.run's functions at spmd.run: a program that launches torchrun from Python (`main(argv)`,
or `run(args)` after adding its own flags to `get_args_parser()`) runs its job under spmd's agent, in this
process, with real worker processes; torch's parser reads the same flags into the same fields."""

from __future__ import annotations

import pathlib

import pytest

import spmd.run
from spmd.run import ChildFailedError

WORKER = """import os, pathlib, sys
rank = int(os.environ["RANK"])
pathlib.Path(sys.argv[1], f"rank{rank}").write_text(os.environ["WORLD_SIZE"] + " " + " ".join(sys.argv[2:]))
sys.exit(3 if sys.argv[2:] == ["--fail"] and rank == 1 else 0)
"""


@pytest.fixture
def script(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return path


@pytest.mark.timeout(60)
def test_main_runs_the_job_and_returns_none(script: pathlib.Path, tmp_path: pathlib.Path) -> None:
    assert spmd.run.main(["--nproc-per-node", "2", str(script), str(tmp_path), "--lr", "1"]) is None
    assert [(tmp_path / f"rank{rank}").read_text() for rank in (0, 1)] == ["2 --lr 1", "2 --lr 1"]


@pytest.mark.timeout(60)
def test_a_failed_worker_raises_child_failed_error_naming_it(script: pathlib.Path, tmp_path: pathlib.Path) -> None:
    with pytest.raises(ChildFailedError, match=r"(?s)job failed \(spmd\.run run .*rank 1 \(local rank 1\).*exit code 3"
                       ) as raised:
        spmd.run.main(["--standalone", "--nproc_per_node=2", str(script), str(tmp_path), "--fail"])
    assert [failure.rank for failure in raised.value.failures] == [1]


@pytest.mark.timeout(60)
def test_run_takes_the_extended_parsers_flags(script: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """The wrapper's pattern: its own flag on torchrun's parser, removed before the launch."""
    parser = spmd.run.get_args_parser()
    parser.add_argument("--my-tool-flag", default=None)
    args = parser.parse_args(["--my-tool-flag", "x", "--nproc-per-node", "1", str(script), str(tmp_path)])
    assert args.my_tool_flag == "x"
    del args.my_tool_flag
    spmd.run.run(args)
    assert (tmp_path / "rank0").read_text() == "1 "
    with pytest.raises(ValueError, match="does not exist"):
        spmd.run.run(spmd.run.parse_args([str(tmp_path / "missing.py")]))


def test_parse_args_reads_torchruns_flags_into_torchruns_fields() -> None:
    """Flags given are read alike; unset ones default to None in spmd's parser ("not given": Slurm's variables
    may fill in the nodes), where torch's has values such as nnodes "1:1"."""
    import torch.distributed.run as torchrun

    argv = ["--standalone", "--nproc_per_node=4", "--max-restarts", "2", "--rdzv-conf", "join_timeout=5",
            "--log_dir", "/tmp/logs", "-r", "3", "--tee", "1", "--local-ranks-filter", "0", "-m", "pkg.train",
            "--epochs", "3"]
    ours, theirs = spmd.run.parse_args(argv), torchrun.parse_args(argv)
    for field in ("standalone", "nproc_per_node", "max_restarts", "rdzv_conf", "log_dir", "redirects", "tee",
                  "local_ranks_filter", "module", "no_python", "training_script", "training_script_args"):
        assert getattr(ours, field) == getattr(theirs, field), field
