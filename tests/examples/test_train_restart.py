"""Fault tolerance end to end: under `spmdrun --max-restarts 1`, a worker of the trainer killed with kill -9
mid-training is restarted with its group, the job resumes from the last complete checkpoint by itself (the same
flags: --resume finds it) and finishes with the final loss of an uninterrupted run, bit for bit.

The uninterrupted run is the same training on 2 thread ranks in this process: data parallelism over 2 ranks
sums two gradients, and a + b == b + a in IEEE arithmetic, so the transport does not change a bit. The kill
comes once the first checkpoint is complete and while 50 steps remain, which no timing can let the job finish
first.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal

from tests.run.helpers import Launcher, wait_until

from .test_train_checkpoints import run
from .test_train_gpt import SCRIPT, TINY

TIMEOUT = 150.0
STEPS = ["--steps", "60", "--checkpoint-every", "10", "--log-every", "20", "--eval-every", "1000"]


def workers_of(agent: int) -> dict[int, int]:
    """RANK -> pid of the live worker processes the agent `agent` started."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            if parent != agent:
                continue
            with open(f"/proc/{entry}/environ", "rb") as environ:
                variables = dict(item.split(b"=", 1) for item in environ.read().split(b"\0") if b"=" in item)
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
        if b"RANK" in variables:
            found[int(variables[b"RANK"])] = int(entry)
    return found


def test_a_worker_killed_mid_training_is_restarted_and_the_job_resumes(tmp_path: pathlib.Path) -> None:
    checkpoints, metrics = tmp_path / "checkpoints", tmp_path / "metrics.jsonl"
    launcher = Launcher("--nproc-per-node", "2", "--max-restarts", "1", str(SCRIPT), *TINY, *STEPS,
                        "--backend", "shm", "--checkpoint-dir", str(checkpoints), "--resume",
                        "--metrics-file", str(metrics))
    try:
        wait_until(lambda: (checkpoints / "step-000010" / "metadata.json").is_file(), TIMEOUT,
                   "the first checkpoint")
        victim = workers_of(launcher.popen.pid)[1]
        os.kill(victim, signal.SIGKILL)
        assert launcher.popen.wait(timeout=TIMEOUT) == 0, launcher.output
    finally:
        if launcher.popen.poll() is None:
            launcher.popen.kill()
            launcher.popen.wait()
    output = launcher.output
    assert "signal SIGKILL" in output and "restart 1 of 1" in output, output
    assert f"resumed from {checkpoints} at step" in output, output
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    final = [record for record in records if record.get("step") == 60 and "loss" in record]
    assert len(final) == 1, records

    uninterrupted = run(2, tmp_path / "uninterrupted", *STEPS[:2], "--log-every", "20")
    assert uninterrupted["step"][-1] == 60
    assert final[0]["loss"] == uninterrupted["train"][-1]
    assert final[0]["grad_norm"] == uninterrupted["grad_norm"][-1]
