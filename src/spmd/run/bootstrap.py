"""Worker bootstrap: what each worker process runs first, before the user's script.

Layer: run. The agent starts every worker as `python .../spmd/run/bootstrap.py KIND TARGET ARGS...` (a file, not
`-m spmd.run.bootstrap`: importing the spmd package imports torch, seconds per worker the script may not need).
So this file imports the standard library only. It
  1. arms a parent-death signal, so the worker dies with its agent even if the agent is SIGKILLed;
  2. runs the user's script (`script`), module (`module`) or program (`binary`, by exec) with the argv, sys.path
     and `__main__` it would have had when started directly; or (`callable`, spmd.launcher.api) a function and
     its arguments read from the private file the launching process pickled them into, with that process's
     sys.path (and its main script run again as `__mp_main__`, as multiprocessing's spawn does, for a function
     defined there), the function's return value pickled into $SPMD_RESULT_FILE;
  3. on an uncaught exception, writes the exception and its traceback (the user's frames only) as JSON to
     $SPMD_ERROR_FILE, which the agent reads to report the failure; no decorator in the user's script.
spmd.run.spawn reuses `set_parent_death_signal` and `write_error_file` for its own children.
"""

import sys

if __name__ == "__main__":
    # Running as a file put this directory first on sys.path, where its modules (config, process, ...) would
    # shadow the user's own; remove it before importing anything else.
    del sys.path[0]

import ctypes
import json
import os
import pickle
import runpy
import signal
import socket
import time
import traceback
import types

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def set_parent_death_signal(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when its parent dies; exit now if the parent is already gone.

    The kernel sends the signal when the *thread* that forked us exits, so agents start workers from their main
    thread. Checking getppid() after arming closes the race where the parent died before prctl ran. On other
    systems this does nothing; the agent still stops its workers on every exit path it controls.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        os._exit(1)


def format_user_traceback(error: BaseException, skip: set[str] | None = None) -> str:
    """The formatted traceback of `error` starting in the user's code: the leading frames of this bootstrap, of
    runpy and of the files in `skip` (absolute paths) are dropped."""
    launcher = {os.path.abspath(__file__), os.path.abspath(runpy.__file__), *(skip or set())}
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        filename = tb.tb_frame.f_code.co_filename
        if filename != "<frozen runpy>" and os.path.abspath(filename) not in launcher:
            break
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(error), error, tb))


def write_error_file(path: str, error: BaseException, formatted: str, rank: int | None) -> None:
    """Record `error` at `path` as JSON: type, message, traceback, rank, host, pid, timestamp.

    The agent (spmd.run.failure.read_error_file) reads the same keys. Written to a temporary name and renamed,
    so the agent never reads half a file.
    """
    record = {
        "type": type(error).__qualname__,
        "message": str(error),
        "traceback": formatted,
        "rank": rank,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "timestamp": time.time(),
    }
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as file:
        json.dump(record, file)
    os.replace(tmp, path)


def _call(payload_path: str) -> None:
    """The `callable` kind: the launching process's sys.path and main script, then the call, then its result."""
    with open(payload_path, "rb") as file:
        payload = pickle.load(file)  # written by this user's launching process into its private directory
    sys.path[:] = payload["sys_path"]
    main_path = payload["main_path"]
    if main_path is not None:  # the function may live in the launching script's __main__
        main = types.ModuleType("__mp_main__")
        main.__file__ = main_path
        sys.modules["__mp_main__"] = sys.modules["__main__"] = main
        with open(main_path, "rb") as source:
            exec(compile(source.read(), main_path, "exec"), main.__dict__)
    fn, args = pickle.loads(payload["call"])
    result = fn(*args)
    path = os.environ["SPMD_RESULT_FILE"]
    with open(f"{path}.tmp", "wb") as file:
        pickle.dump(result, file)
    os.replace(f"{path}.tmp", path)


def _run(kind: str, target: str, args: list[str]) -> None:
    sys.argv = [target, *args]
    if kind == "callable":
        _call(target)
        return
    if kind == "binary":
        os.execvp(target, sys.argv)
    if kind == "module":
        sys.path.insert(0, os.getcwd())
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
        runpy.run_path(target, run_name="__main__")


def main() -> None:
    kind, target, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    set_parent_death_signal(int(os.environ["SPMD_AGENT_PID"]))
    try:
        _run(kind, target, args)
    except SystemExit:
        raise
    except BaseException as error:  # recorded for the agent, then reported as Python would
        formatted = format_user_traceback(error)
        error_file = os.environ.get("SPMD_ERROR_FILE")
        if error_file:
            rank = os.environ.get("RANK")
            write_error_file(error_file, error, formatted, int(rank) if rank else None)
        if isinstance(error, KeyboardInterrupt):
            raise
        sys.stderr.write(formatted)
        sys.stderr.flush()
        sys.exit(1)


if __name__ == "__main__":
    main()
