"""The per-node agent: join the rendezvous, run this node's workers each round, stop and restart them, report.

Layer: run. One Agent per node, driven from its main thread (workers must be started from the main thread: see
spmd.run.bootstrap.set_parent_death_signal). The agent that owns the rendezvous endpoint hosts the store and the
Coordinator (spmd.run.rendezvous); a one-node job without an endpoint uses an in-process HashStore instead.

Note: the workers' store
Workers call `init_process_group()` with no arguments, which builds a TCPStore at MASTER_ADDR:MASTER_PORT hosted
by worker rank 0. Each round gets a fresh one: the node with group rank 0 picks a free port (or --master-port) and
a fresh random SPMD_STORE_TOKEN and publishes them through the rendezvous, whose own store only agents holding
the job's token (--rdzv-token, SPMD_STORE_TOKEN, --rdzv-token-file; made up when one node hosts the whole job)
can read. The agents' own store is never handed
to workers, so a restarted round can't see keys of the one before and a stale worker can't disturb the agents.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import signal
import socket
import tempfile
import threading
import time
import types

from spmd._core import env as environment
from spmd._core.errors import StoreAuthError, StoreError
from spmd.comm.debug import collect_statuses, describe_ranks
from spmd.comm.store.base import HashStore, Store
from spmd.comm.transports.shm.names import remove_orphan_segments
from spmd.comm.transports.tcp.address import AddressChoice, choose_address
from spmd.run.config import EntryKind, LaunchConfig, Std
from spmd.run.failure import ChildFailedError, WorkerFailure, format_summary, root_cause
from spmd.run.process import Console, Watchdog, WorkerGroup, WorkerSpec
from spmd.run.rendezvous import Coordinator, Heartbeat, NodeInfo, Outcome, RendezvousClient, Round
from spmd.run.timer import FileTimerRequest, FileTimerServer

BOOTSTRAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bootstrap.py")
HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
STATUS_SIGNAL = signal.SIGUSR1   # "what is every rank doing?" (see Agent._on_status_request)
UNPROTECTED_WARNING = (
    "WARNING: the rendezvous store at {endpoint} has no token: anyone who can reach it can read the workers' "
    "store address and token, join the job or end it. Give every agent the same secret with --rdzv-token TOKEN, "
    "SPMD_STORE_TOKEN=TOKEN or --rdzv-token-file PATH (chmod 600); under Slurm, export SPMD_STORE_TOKEN="
    "$(openssl rand -hex 16) in the batch script before srun.")


class LaunchError(RuntimeError):
    """The launch can't proceed (a busy port, an unreachable rendezvous); the message says what to change."""


class Interrupted(BaseException):
    """The agent received SIGINT/SIGTERM/SIGHUP; raised once, from the signal handler, in the main thread."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class SignalException(Exception):
    """torch's elastic `SignalException`: a launch from Python (elastic_launch) was stopped by a signal to its agent;
    `sigval` is the signal."""

    def __init__(self, msg: str, sigval: signal.Signals) -> None:
        super().__init__(msg)
        self.sigval = sigval


def result_file(payload: str, rank: int) -> str:
    """Where the worker of global `rank` of a CALLABLE launch pickles its return value: beside the payload."""
    return os.path.join(os.path.dirname(payload), f"return_{rank}.pickle")


def port_is_free(port: int) -> bool:
    """Whether a TCP server could listen on `port` on every interface right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", port))
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                return False
            raise
    return True


def free_port() -> int:
    """A port nothing listens on now (the OS's choice); its user binds it moments later."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("0.0.0.0", 0))
        return sock.getsockname()[1]


def is_local_host(host: str) -> bool:
    """Whether `host` names this machine: one of its addresses can be bound here."""
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    for *_, address in infos:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((address[0], 0))
                return True
            except OSError:
                continue
    return False


def node_address(config: LaunchConfig) -> AddressChoice:
    """The address other nodes reach this one at, and where it came from: --local-addr, else (SPMD_SOCKET_ADDR,
    SPMD_SOCKET_IFNAME, or the local address of the route towards the rendezvous endpoint); loopback for a
    one-node job."""
    if config.local_addr is not None:
        try:   # resolved here once: workers publish an address
            return AddressChoice(socket.gethostbyname(config.local_addr), f"spmdrun --local-addr {config.local_addr}")
        except OSError as error:
            raise LaunchError(f"spmdrun: --local-addr {config.local_addr!r} is not an address and does not resolve "
                              f"on {socket.gethostname()} ({error}); give an IPv4 address of this node") from None
    if not config.is_multinode:
        return AddressChoice("127.0.0.1", "one node")
    try:
        choice = choose_address(config.rdzv_host)
    except ValueError as error:
        raise LaunchError(str(error)) from None
    return AddressChoice(choice.address, f"spmdrun's choice ({choice.source})")


class Agent:
    """Runs one node's part of a job. `run()` returns the process exit status for the launcher."""

    def __init__(self, config: LaunchConfig, console: Console | None = None) -> None:
        self.config = config
        self.console = console or Console()
        self.hostname = socket.gethostname()
        self.store: Store | None = None
        self.coordinator: Coordinator | None = None
        self.heartbeat: Heartbeat | None = None
        self.client: RendezvousClient | None = None
        self.me: NodeInfo | None = None
        self.address_source = ""   # where self.me's address came from, for the workers' errors
        self.workers: WorkerGroup | None = None
        self.workers_store: tuple[str, int, str, int] | None = None   # the running round's: address, port, token, size
        self.watchdog: Watchdog | None = None
        self.timer_server: FileTimerServer | None = None   # the workers' `expires` timers (TORCHELASTIC_ENABLE_...)
        self.timer_file: str | None = None
        self._raise_on_signal = True
        self._member = False  # whether this node is in the latest round (else it waits, and may leave alone)
        self.outcome: Outcome | None = None  # how the job ended, once it has
        self.stopped_by: signal.Signals | None = None   # the signal that stopped this agent, if one did
        self.last_ranks: list[int] = []  # the global ranks of this node's workers in the latest round it ran
        self._log_root, self._own_log_root = self._make_log_root()

    # ---- entry -------------------------------------------------------------------------------------------
    def run(self) -> int:
        previous = {signum: signal.signal(signum, self._on_signal) for signum in HANDLED_SIGNALS}
        previous[STATUS_SIGNAL] = signal.signal(STATUS_SIGNAL, self._on_status_request)
        try:
            try:
                self.watchdog = Watchdog()
                self._start_timer_server()
                return self._run()
            finally:
                self._raise_on_signal = False  # from here on a signal can't interrupt the cleanup
        except Interrupted as interrupt:
            return self._stop_for_signal(interrupt.signum)
        except LaunchError as error:
            self._say(str(error))
            return 1
        except StoreError as error:
            self._say(f"lost the rendezvous: {str(error).rstrip('.')}. If another node's agent died, its log says why.")
            return 1
        except OSError as error:
            self._say(f"spmdrun: could not run the workers: {error}")
            return 1
        finally:
            self._stop_workers(signal.SIGTERM)
            if self.watchdog is not None:
                self.watchdog.close()
            if self.timer_server is not None:
                self.timer_server.stop()
            self._shut_down()
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def raise_if_failed(self, status: int, what: str) -> None:
        """For launches from Python: nothing if `status` (run()'s) is 0, else ChildFailedError naming the workers
        that failed, SignalException when a signal stopped the agent, or RuntimeError with the agent's reason
        (a lost rendezvous)."""
        if status == 0:
            return
        if self.stopped_by is not None:
            raise SignalException(f"{what}: run {self.config.rdzv_id} stopped: process {os.getpid()} got signal "
                                  f"{self.stopped_by.name}", sigval=self.stopped_by)
        outcome = self.outcome
        failures = [WorkerFailure.from_json(f) for f in (outcome.failures if outcome is not None else [])]
        message = outcome.message if outcome is not None else "the agent stopped"
        if failures:
            raise ChildFailedError(failures, f"{what} run {self.config.rdzv_id}; {message}")
        raise RuntimeError(f"{what}: run {self.config.rdzv_id} failed: {message}")

    def _on_signal(self, signum: int, frame: types.FrameType | None) -> None:
        if self._raise_on_signal:  # once: later signals let the stop that is already running finish
            self._raise_on_signal = False
            raise Interrupted(signum)

    def _on_status_request(self, signum: int, frame: types.FrameType | None) -> None:
        """SIGUSR1: print what every rank of the job is doing (a hung job's "where is everyone", without waiting
        for a collective's timeout), asked in a thread: the main thread this handler interrupted may hold the
        console's lock, and the ranks take up to seconds to answer."""
        threading.Thread(target=self._print_status, name="spmdrun-status", daemon=True).start()

    def _print_status(self) -> None:
        """Every rank's flight recorder and where its thread is, through the workers' store (each rank's status
        service answers, even while it computes or waits; see spmd.comm.debug)."""
        from spmd.comm.store.tcp import TCPStore

        if self.workers_store is None:
            self._say(f"{STATUS_SIGNAL.name}: no workers are running on this node")
            return
        host, port, token, world_size = self.workers_store
        try:
            store = TCPStore(host, port, timeout=5, token=token)
            try:
                statuses = collect_statuses(store, list(range(world_size)))
            finally:
                store.close()
        except (StoreError, OSError) as error:
            self._say(f"{STATUS_SIGNAL.name}: could not reach the workers' store at {host}:{port} ({error})")
            return
        self._say(f"{STATUS_SIGNAL.name}: what every rank is doing:\n  " + "\n  ".join(describe_ranks(statuses)))

    def _run(self) -> int:
        self._connect()
        self.outcome = self._follow_rounds()
        return self._report(self.outcome)

    # ---- rendezvous --------------------------------------------------------------------------------------
    def _connect(self) -> None:
        config = self.config
        store, hosting = self._open_store()
        self.store = store
        if hosting:
            self.coordinator = Coordinator(store.clone(), config.rdzv_id, config.min_nodes, config.max_nodes,
                                           config.max_restarts, config.timeouts, now=time.monotonic())
            self.coordinator.start()
        address = node_address(config)
        self.address_source = address.source
        self.client = RendezvousClient(store, config.rdzv_id)
        self.me = self.client.join(address.address, self.hostname, config.nproc_per_node, config.node_rank, os.getpid())
        self.heartbeat = Heartbeat(store.clone(), config.rdzv_id, self.me.node_id, config.timeouts.heartbeat_interval)
        self.heartbeat.start()

    def _open_store(self) -> tuple[Store, bool]:
        """(store, whether this agent hosts it and the coordinator)."""
        config = self.config
        timeout = config.timeouts.join_timeout
        if not config.is_multinode:
            return HashStore(timeout=timeout), True
        from spmd.comm.store.tcp import TCPStore  # only multi-node jobs need sockets for the rendezvous

        host, port = config.rdzv_host, config.rdzv_port
        assert host is not None
        wants_host = config.node_rank == 0 or (config.node_rank is None and is_local_host(host))
        token = config.rdzv_token
        if token is None and wants_host and config.max_nodes == 1:
            token = secrets.token_hex(16)  # no other agent can take part, so none needs to know it
        if token is None:
            self._say(UNPROTECTED_WARNING.format(endpoint=f"{host}:{port}"))
        if wants_host:
            try:
                return TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout,
                                token=token), True
            except StoreError as error:
                if port_is_free(port):
                    raise LaunchError(f"spmdrun: can't host the rendezvous at {host}:{port}: {error}") from None
                if config.node_rank == 0:
                    raise LaunchError(f"spmdrun: can't host the rendezvous at {host}:{port}: port {port} is "
                                      f"already in use on {self.hostname} (another job?). Pick another "
                                      f"--rdzv-endpoint port.") from None
                # Elastic agents on the endpoint's host race to host it; the losers join as clients.
        try:
            return TCPStore(host, port, is_master=False, timeout=timeout, token=token), False
        except StoreAuthError as error:
            raise LaunchError(f"spmdrun: the rendezvous at {host}:{port} and this agent do not share a token "
                              f"(this agent has {'none' if token is None else 'one'}): every agent of the "
                              f"job must use the same --rdzv-token, SPMD_STORE_TOKEN or --rdzv-token-file "
                              f"({error})") from None
        except StoreError as error:
            raise LaunchError(f"spmdrun: could not join the rendezvous at {host}:{port} within {timeout:g}s "
                              f"({error}). Is the agent of node 0 running with the same --rdzv-endpoint?") from None

    def _check_helpers(self) -> None:
        for helper in (self.coordinator, self.heartbeat):
            if helper is not None and helper.error is not None:
                raise LaunchError(f"spmdrun: lost the rendezvous store: {helper.error}")

    def _follow_rounds(self) -> Outcome:
        """Steps 4-7 of the rendezvous protocol, until the job is closed."""
        assert self.client is not None and self.me is not None
        seen: Round | None = None
        pending: Round | None = None  # a round this node is in, waiting for its workers' store address
        running: Round | None = None
        while True:
            self._check_helpers()
            outcome = self.client.outcome()
            if outcome is not None:
                return outcome
            latest = self.client.latest_round()
            if latest is not None and (seen is None or latest.number > seen.number):
                self._stop_workers(signal.SIGTERM)
                seen, running = latest, None
                self._member = latest.group_rank(self.me.node_id) is not None
                pending = self._enter_round(latest)
            if pending is not None:
                master = self.client.master(pending.number)
                if master is not None:
                    # stopped on any exit from here
                    self.workers = WorkerGroup(self.console, self.hostname, self.watchdog)
                    self.workers.start(self._worker_specs(pending, *master))
                    self.workers_store = (*master, pending.world_size)
                    pending, running = None, pending
            if running is not None and self.workers is not None and self._round_finished(running):
                running = None
            time.sleep(self.config.monitor_interval)

    def _enter_round(self, new: Round) -> Round | None:
        """Announce a new round; returns it if this node takes part (after publishing the store if rank 0)."""
        assert self.client is not None and self.me is not None
        group_rank = new.group_rank(self.me.node_id)
        if not new.nodes:
            self._say(f"round {new.number}: {new.note or 'too few nodes; waiting for more'}")
            return None
        if group_rank is None:
            self._say(f"round {new.number}: the job is full ({len(new.nodes)} nodes); this node waits")
            return None
        offset = new.rank_offset(self.me.node_id)
        self._say(f"round {new.number}: {len(new.nodes)} node(s), world size {new.world_size}; this node is "
                  f"group rank {group_rank} running ranks {offset}-{offset + self.me.nproc - 1} "
                  f"(restart {new.restart_count} of {self.config.max_restarts})")
        if group_rank == 0:
            port = self.config.master_port
            if port is None:
                port = free_port()
            elif not port_is_free(port):
                self.client.close(Outcome("error", f"spmdrun: --master-port {port} is already in use on "
                                          f"{self.hostname} (another job?). Pick another port, or leave "
                                          "--master-port out to get a free one."))
                return None
            self.client.publish_master(new.number, self.config.master_addr or self.me.addr, port,
                                       secrets.token_hex(16))
        return new

    def _round_finished(self, current: Round) -> bool:
        """Poll the workers; on a failure stop the rest and report it, when all succeeded report done."""
        assert self.client is not None and self.me is not None and self.workers is not None
        codes = self.workers.poll()
        if any(code not in (None, 0) for code in codes):
            failures = self.workers.failures()
            # Report before stopping the rest: the coordinator compares reports by time to find the root cause.
            self.client.report_failures(current.number, self.me.node_id, [f.to_json() for f in failures])
            self._say(f"round {current.number}: {root_cause(failures).headline()}; stopping this node's workers")
            self._stop_workers(signal.SIGTERM)
            return True
        if all(code == 0 for code in codes):
            self._stop_workers(signal.SIGTERM)  # reaps and drains their output
            self.client.report_done(current.number, self.me.node_id)
            return True
        return False

    # ---- workers -----------------------------------------------------------------------------------------
    def _worker_specs(self, current: Round, master_addr: str, master_port: int, token: str) -> list[WorkerSpec]:
        assert self.me is not None
        config = self.config
        offset = current.rank_offset(self.me.node_id)
        group_rank = current.group_rank(self.me.node_id)
        specs = []
        for local_rank in range(config.nproc_per_node):
            rank = offset + local_rank
            local_rank_arg = [f"--local-rank={local_rank}"] if config.local_rank_arg else []
            argv = (config.python, BOOTSTRAP, config.kind.value, config.entrypoint, *local_rank_arg, *config.args)
            attempt_dir = os.path.join(self._log_root, f"attempt_{current.number}", str(local_rank))
            env = dict(os.environ)
            env.setdefault("PYTHONUNBUFFERED", "1")  # prints reach the console when made, not at exit
            if config.omp_num_threads is not None:
                env.setdefault("OMP_NUM_THREADS", str(config.omp_num_threads))
            env.update({
                "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(current.world_size),
                "LOCAL_WORLD_SIZE": str(config.nproc_per_node), "GROUP_RANK": str(group_rank),
                "GROUP_WORLD_SIZE": str(len(current.nodes)), "MASTER_ADDR": master_addr,
                "MASTER_PORT": str(master_port), "RESTART_COUNT": str(current.restart_count),
                "MAX_RESTARTS": str(config.max_restarts), "SPMD_ROUND": str(current.number),
                "SPMD_RUN_ID": config.rdzv_id, "SPMD_STORE_TOKEN": token,
                "SPMD_ERROR_FILE": os.path.join(attempt_dir, "error.json"), "SPMD_AGENT_PID": str(os.getpid()),
                # torchrun's names, so scripts written for it find their restart count and run id
                "TORCHELASTIC_RESTART_COUNT": str(current.restart_count),
                "TORCHELASTIC_MAX_RESTARTS": str(config.max_restarts), "TORCHELASTIC_RUN_ID": config.rdzv_id,
            })
            if self.timer_file is not None:   # where FileTimerClient sends its `expires` timers
                env["TORCHELASTIC_TIMER_FILE"] = self.timer_file
            if config.kind is EntryKind.CALLABLE:  # where the worker leaves its return value (launcher.api)
                env["SPMD_RESULT_FILE"] = result_file(config.entrypoint, rank)
            if config.is_multinode:  # its workers publish the address it chose (spmd.comm.transports.tcp.address)
                env["SPMD_SOCKET_ADDR"] = self.me.addr
                env["SPMD_SOCKET_ADDR_FROM"] = self.address_source
            redirect, tee = config.redirects.for_rank(local_rank), config.tee.for_rank(local_rank)
            to_file = redirect | tee
            shown = config.local_ranks_filter is None or local_rank in config.local_ranks_filter
            specs.append(WorkerSpec(
                rank=rank, local_rank=local_rank, argv=argv, env=env, error_file=env["SPMD_ERROR_FILE"],
                stdout_log=os.path.join(attempt_dir, "stdout.log") if to_file & Std.OUT else None,
                stderr_log=os.path.join(attempt_dir, "stderr.log") if to_file & Std.ERR else None,
                stdout_to_console=shown and not redirect & Std.OUT,
                stderr_to_console=shown and not redirect & Std.ERR))
        self.last_ranks = [spec.rank for spec in specs]
        return specs

    def _start_timer_server(self) -> None:
        """With TORCHELASTIC_ENABLE_FILE_TIMER=1 (torchrun's switch), serve the workers' expiration timers (see
        spmd.run.timer) from a FIFO, at TORCHELASTIC_TIMER_FILE or in this node's log directory."""
        if not environment.file_timer_enabled():
            return
        path = environment.timer_file() or os.path.join(self._log_root, "timer.fifo")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.timer_server = FileTimerServer(path, self.config.rdzv_id, max_interval=0.1, log_event=self._timer_event)
        self.timer_server.start()
        self.timer_file = path

    def _timer_event(self, name: str, request: FileTimerRequest | None) -> None:
        """A worker's timer expired: say which rank and which block, before the server kills it."""
        if name != "timer expired" or request is None:
            return
        workers = self.workers.workers if self.workers is not None else []
        ranks = [worker.spec.rank for worker in workers if worker.pid == request.worker_pid]
        who = f"worker rank {ranks[0]}" if ranks else "a worker"
        how = signal.Signals(request.signal).name if request.signal > 0 else "no signal (its client asked for none)"
        self._say(f"{who} (pid {request.worker_pid}): its timer for {request.scope_id!r} expired; killing it with "
                  f"{how}")

    def _stop_workers(self, signum: int) -> None:
        """Stop this node's workers; then remove the shared-memory names of any killed in group set-up."""
        if self.workers is not None:
            self.workers.stop(signum, self.config.shutdown_grace)
            self.workers, self.workers_store = None, None
            remove_orphan_segments()

    # ---- the end -----------------------------------------------------------------------------------------
    def _report(self, outcome: Outcome) -> int:
        self._stop_workers(signal.SIGTERM)
        if outcome.status == "succeeded":
            return 0
        if outcome.status == "failed" and (outcome.failures or outcome.lost):
            failures = [WorkerFailure.from_json(failure) for failure in outcome.failures]
            self.console.message(format_summary(failures, f"run {self.config.rdzv_id}; {outcome.message}",
                                                outcome.lost))
        else:
            self._say(outcome.message)
        return 1

    def _stop_for_signal(self, signum: int) -> int:
        self.stopped_by = signal.Signals(signum)
        name = self.stopped_by.name
        self._stop_workers(signum)
        if self.client is not None and self.me is not None:
            with contextlib.suppress(StoreError, OSError):
                if self._member:
                    self._say(f"got {name}: stopped this node's workers; stopping the job")
                    self.client.close(Outcome("interrupted", f"spmdrun: stopped by {name} to the agent on "
                                              f"{self.hostname}"))
                else:  # a waiting node leaves without disturbing the running job
                    self._say(f"got {name}: leaving the rendezvous")
                    self.client.leave(self.me.node_id)
        return 128 + signum

    def _shut_down(self) -> None:
        """Acknowledge the end, let the other agents see it (if hosting), then release the store and logs."""
        with contextlib.suppress(StoreError, OSError):
            if self.client is not None and self.me is not None:
                self.client.ack(self.me.node_id)
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self.coordinator is not None:
            self.coordinator.stop()
            if self.config.is_multinode:
                with contextlib.suppress(StoreError, OSError):
                    self.coordinator.wait_for_acks(self.config.timeouts.close_timeout)
        if self.store is not None:
            self.store.close()
        if self._own_log_root:
            shutil.rmtree(self._log_root, ignore_errors=True)

    def _make_log_root(self) -> tuple[str, bool]:
        """Where per-rank logs and error files go, and whether it is a private temporary directory to delete."""
        config = self.config
        if config.log_dir is not None:
            return os.path.join(config.log_dir, config.rdzv_id), False
        root = tempfile.mkdtemp(prefix=f"spmdrun-{config.rdzv_id}-")
        if config.redirects.any() or config.tee.any():
            self._say(f"per-rank logs go to {root}")
            return root, False
        return root, True

    def _say(self, text: str) -> None:
        node = f" node {self.me.node_id}" if self.me is not None and self.config.is_multinode else ""
        self.console.message(text if text.startswith("spmdrun") else f"spmdrun ({self.hostname}{node}): {text}")
