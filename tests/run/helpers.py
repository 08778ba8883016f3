"""Helpers for the launcher's process tests: run `spmdrun`, follow its output, check processes by pid."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from spmd.run.agent import Agent
from spmd.run.cli import launch_config
from spmd.run.process import Console

SPMDRUN = (sys.executable, "-m", "spmd.run")


def is_alive(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie waiting to be reaped counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):     # gone before the open, or between the open and the read
        return False


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll `condition` until it holds; AssertionError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def run_agent(*argv: str, cwd: str | None = None) -> tuple[int, str, str]:
    """Run one agent in this process (its workers are real processes); returns (status, stdout, stderr) of its
    console. Saves the seconds a launcher process spends importing; the CLI entry itself is tested elsewhere."""
    out, err = io.BytesIO(), io.BytesIO()
    here = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        code = Agent(launch_config(list(argv), environ={}), console=Console(out, err)).run()
    finally:
        os.chdir(here)
    return code, out.getvalue().decode(), err.getvalue().decode()


def spmdrun(*args: str, timeout: float = 90.0, cwd: str | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run `spmdrun args` to completion and return its exit code, stdout and stderr."""
    return subprocess.run([*SPMDRUN, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, **(env or {})})


class Launcher:
    """A running `spmdrun` whose output (stdout and stderr merged) is collected line by line as it comes."""

    def __init__(self, *args: str, env: dict[str, str] | None = None,
                 wrap: Callable[[list[str]], list[str]] | None = None) -> None:
        """`wrap` turns the command line into the one to run (e.g. inside a network namespace); it must exec."""
        argv = [*SPMDRUN, *args]
        self.popen = subprocess.Popen(wrap(argv) if wrap else argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, env={**os.environ, **(env or {})})
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for_line(self, text: str, timeout: float) -> None:
        wait_until(lambda: any(text in line for line in self.lines), timeout,
                   f"{text!r} in the launcher's output:\n{self.output}")

    def finish(self, timeout: float) -> int:
        """Wait for the launcher to exit (kill it if it does not) and for its output to end."""
        try:
            code = self.popen.wait(timeout)
        finally:
            self.kill()
        self._reader.join(timeout=10)
        return code

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()
