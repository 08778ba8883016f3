"""Store stress: throughput, latency under a stranger flood, and server memory, spmd's TCPStore against torch's.

    python benchmarks/store_stress.py [--clients 4] [--ops 2000] [--repeats 3] [--flood-seconds 8] [--pin]

Loopback only. Each store's server runs in its own child process (so its RSS is read from /proc), the load
comes from `--clients` client processes doing `--ops` timed set/get/add calls on own and shared keys, and
spmd and torch runs alternate. The flood is one process opening raw TCP connections to the port in a loop
(connect-and-close, garbage, silent sockets held open, at most `--flood-held` at once). Every wait is bounded
by `--time-limit`; a store that stalls is reported as such. `--pin` puts the flood on a CPU of its own, as a
remote attacker's would be, so what remains is the server's own cost of the flood.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import select
import socket
import statistics
import subprocess
import sys
import time

HOST = "127.0.0.1"
TOKEN = "store-stress-token"


# ---- child roles -------------------------------------------------------------------------------------------

def open_store(kind: str, port: int, master: bool):
    if kind == "spmd":
        from spmd.comm.store.tcp import TCPStore
        return TCPStore(HOST, port, is_master=master, wait_for_workers=False, timeout=30, token=TOKEN)
    import datetime

    import torch.distributed as tdist
    return tdist.TCPStore(HOST, port, is_master=master, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))


def serve(kind: str) -> None:
    """Run a store server, print its port, exit when stdin closes."""
    store = open_store(kind, 0, master=True)
    print(store.port, flush=True)
    sys.stdin.read()
    del store


def client(kind: str, port: int, rank: int, ops: int) -> None:
    """Connect, pre-set keys, print "ready", wait for a line on stdin, then time `ops` calls; print JSON."""
    store = open_store(kind, port, master=False)
    own = [f"c{rank}/{i}" for i in range(64)]
    for key in own:
        store.set(key, b"v" * 32)
    store.set("shared/v", b"s" * 32)
    print("ready", flush=True)
    sys.stdin.readline()
    latencies = []
    start = time.monotonic()
    for i in range(ops):
        t0 = time.perf_counter()
        step = i % 5
        if step == 0:
            store.set(own[i % 64], b"v" * 32)
        elif step == 1:
            store.get(own[(i * 7) % 64])
        elif step == 2:
            store.add("shared/n", 1)
        elif step == 3:
            store.set("shared/v", b"s" * 32)
        else:
            store.get("shared/v")
        latencies.append(time.perf_counter() - t0)
    end = time.monotonic()
    print(json.dumps({"start": start, "end": end, "lat": latencies}), flush=True)


def flood(port: int, seconds: float, max_held: int) -> None:
    """Open raw connections to `port` until stdin closes or `seconds` pass; print counts as JSON."""
    rng = random.Random(0)
    held: list[socket.socket] = []
    counts = {"close": 0, "garbage": 0, "held": 0, "refused": 0}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if select.select([sys.stdin], [], [], 0)[0]:
            break
        sock = socket.socket()
        sock.settimeout(0.5)
        try:
            sock.connect((HOST, port))
            kind = rng.randrange(3)
            if kind == 0:
                sock.close()
                counts["close"] += 1
            elif kind == 1:
                sock.sendall(rng.randbytes(rng.randrange(1, 4096)))
                sock.close()
                counts["garbage"] += 1
            else:
                held.append(sock)
                counts["held"] += 1
                if len(held) > max_held:
                    held.pop(0).close()
        except OSError:
            sock.close()
            counts["refused"] += 1
    for sock in held:
        sock.close()
    print(json.dumps(counts), flush=True)


# ---- driver ------------------------------------------------------------------------------------------------

class Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self, cap: float = float("inf")) -> float:
        return max(0.1, min(cap, self.end - time.monotonic()))


CPUS: dict[str, set[int] | None] = {"flood": None, "store": None}   # --pin: who runs where


def child(*args: str, stdin=subprocess.PIPE) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cpus = CPUS["flood" if args[0] == "flood" else "store"]
    return subprocess.Popen([sys.executable, __file__, *args], stdin=stdin, stdout=subprocess.PIPE, text=True,
                            env=env, preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus))


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def percentile(sorted_values: list[float], q: float) -> float:
    """The q-quantile (0..1) of an ascending list, nearest-rank."""
    index = min(len(sorted_values) - 1, max(0, round(q * len(sorted_values) + 0.5) - 1))
    return sorted_values[index]


def run_load(kind: str, port: int, clients: int, ops: int, deadline: Deadline, on_wait=None) -> dict | None:
    """One timed load; None when the clients did not finish in time (the store stalled)."""
    procs = [child("client", kind, str(port), str(rank), str(ops)) for rank in range(clients)]
    try:
        for proc in procs:
            if not wait_line(proc, deadline.left(60)):
                return None
        for proc in procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        outputs = []
        for proc in procs:
            while on_wait is not None and proc.poll() is None and not select.select([proc.stdout], [], [], 0.05)[0]:
                on_wait()
                if deadline.left() <= 0.1:
                    return None
            line = wait_line(proc, deadline.left(60))
            if not line:
                return None
            outputs.append(json.loads(line))
    finally:
        for proc in procs:
            stop(proc)
    lat = sorted(x for out in outputs for x in out["lat"])
    span = max(o["end"] for o in outputs) - min(o["start"] for o in outputs)
    return {"ops_s": clients * ops / span, "p50": percentile(lat, 0.5), "p99": percentile(lat, 0.99),
            "worst": lat[-1]}


def wait_line(proc: subprocess.Popen, timeout: float) -> str:
    if select.select([proc.stdout], [], [], timeout)[0]:
        return proc.stdout.readline().strip()
    return ""


def stop(proc: subprocess.Popen) -> None:
    try:
        proc.stdin.close()
    except OSError:
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def settle_rss(pid: int, baseline: int, deadline: Deadline, bound: float = 12.0) -> tuple[int, float]:
    """Poll the server's RSS until it is within target of `baseline` or unchanged for 2 s (at most `bound` s);
    returns (RSS, seconds waited)."""
    start = time.monotonic()
    last, last_change = rss_bytes(pid), start
    while time.monotonic() - start < min(bound, deadline.left()):
        time.sleep(0.1)
        now = rss_bytes(pid)
        if rss_target_met(baseline, now):
            return now, time.monotonic() - start
        if now != last:
            last, last_change = now, time.monotonic()
        elif time.monotonic() - last_change > 2.0 and time.monotonic() - start > 6.0:
            break   # stable, and past the 5 s handshake timeout
    return last, time.monotonic() - start


def rss_target_met(baseline: int, after: int) -> bool:
    return after - baseline <= max(2 << 20, baseline // 10)


def flooded_load(kind: str, port: int, args: argparse.Namespace, deadline: Deadline, on_wait) -> tuple[dict | None,
                                                                                                  dict]:
    """One timed load while a flooder runs against `port`; (the load's result, the flooder's counts)."""
    flooder = child("flood", str(port), str(args.flood_seconds), str(args.flood_held))
    time.sleep(0.5)   # let the flood ramp up to its held sockets before the load starts
    run = run_load(kind, port, args.clients, args.ops, deadline, on_wait=on_wait)
    line = ""
    try:
        with contextlib.suppress(BrokenPipeError):   # it may have reached its own time bound
            flooder.stdin.write("stop\n")
            flooder.stdin.flush()
        line = wait_line(flooder, 10)
    finally:
        stop(flooder)
    return run, json.loads(line) if line else {}


def med(runs: list[dict], field: str) -> float:
    return statistics.median(run[field] for run in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--ops", type=int, default=2000, help="timed calls per client")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--flood-held", type=int, default=500, help="silent sockets held open at most")
    parser.add_argument("--flood-seconds", type=float, default=20.0, help="bound on one flood's duration")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="bound on the whole run in seconds (default 90 + 30 per repeat)")
    parser.add_argument("--pin", action="store_true",
                        help="run the flood on the last CPU and the servers and clients on the others, as a remote "
                             "attacker's CPU would not be this host's (the no-flood runs are pinned the same way)")
    args = parser.parse_args()
    if args.pin:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            parser.error("--pin needs at least 2 CPUs")
        CPUS["flood"], CPUS["store"] = {cpus[-1]}, set(cpus[:-1])
    deadline = Deadline(args.time_limit if args.time_limit is not None else 90.0 + 30.0 * args.repeats)

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _common import human_bytes, machine_line
    pinned = f"; flood pinned to CPU {sorted(CPUS['flood'])}, stores to {sorted(CPUS['store'])}" if args.pin else ""
    print(f"# store stress: {args.clients} clients x {args.ops} ops, {args.repeats} repeats; {machine_line()}"
          f"{pinned}\n")

    servers = {kind: child("serve", kind) for kind in ("spmd", "torch")}
    try:
        ports = {kind: int(wait_line(proc, 60)) for kind, proc in servers.items()}
        quiet: dict[str, list[dict]] = {"spmd": [], "torch": []}
        for _ in range(args.repeats):
            for kind in ("spmd", "torch"):
                result = run_load(kind, ports[kind], args.clients, args.ops, deadline)
                if result is None:
                    raise RuntimeError(f"{kind} load did not finish within the time limit")
                quiet[kind].append(result)

        flooded: dict[str, dict | None] = {}
        rss: dict[str, dict] = {}
        counts: dict[str, dict] = {}
        for kind in ("spmd", "torch"):
            pid = servers[kind].pid
            before = rss_bytes(pid)
            peak = [before]
            runs: list[dict] = []
            # torch's store stalls under the flood, costing the whole time limit: it gets one flooded run
            for _ in range(args.repeats if kind == "spmd" else 1):
                run, counts[kind] = flooded_load(kind, ports[kind], args, deadline,
                                                 on_wait=lambda peak=peak, pid=pid: peak.append(rss_bytes(pid)))
                peak.append(rss_bytes(pid))
                if run is None:
                    break
                runs.append(run)
            flooded[kind] = None if len(runs) < (args.repeats if kind == "spmd" else 1) else {
                field: med(runs, field) for field in runs[0]}
            if kind == "spmd" and flooded[kind] is None and deadline.left() <= 0.1:
                raise RuntimeError("spmd's flooded runs did not finish within --time-limit; raise it")
            after, waited = settle_rss(pid, before, deadline)
            rss[kind] = {"before": before, "peak": max(peak), "after": after, "waited": waited}
    finally:
        for proc in servers.values():
            stop(proc)

    print("## Throughput (no flood), median of repeats\n")
    print("| store | ops/s | p50 µs | p99 µs | worst µs |")
    print("|---|---:|---:|---:|---:|")
    for kind in ("spmd", "torch"):
        runs = quiet[kind]
        print(f"| {kind} | {med(runs, 'ops_s'):,.0f} | {med(runs, 'p50') * 1e6:.0f} | {med(runs, 'p99') * 1e6:.0f}"
              f" | {med(runs, 'worst') * 1e6:.0f} |")
    print(f"\nspmd / torch ops/s: {med(quiet['spmd'], 'ops_s') / med(quiet['torch'], 'ops_s'):.2f}\n")

    print(f"## Legitimate latency under a stranger flood (spmd: median of {args.repeats} flooded runs; torch: one)\n")
    print("| store | flood | ops/s | p50 µs | p99 µs | worst µs | flood connections |")
    print("|---|---|---:|---:|---:|---:|---|")
    for kind in ("spmd", "torch"):
        runs = quiet[kind]
        print(f"| {kind} | no | {med(runs, 'ops_s'):,.0f} | {med(runs, 'p50') * 1e6:.0f} |"
              f" {med(runs, 'p99') * 1e6:.0f} | {med(runs, 'worst') * 1e6:.0f} | |")
        run = flooded[kind]
        flood_desc = ", ".join(f"{k} {v}" for k, v in counts[kind].items()) or "no report"
        if run is None:
            print(f"| {kind} | yes | STALLED (clients did not finish in time) | | | | {flood_desc} |")
        else:
            print(f"| {kind} | yes | {run['ops_s']:,.0f} | {run['p50'] * 1e6:.0f} | {run['p99'] * 1e6:.0f} |"
                  f" {run['worst'] * 1e6:.0f} | {flood_desc} |")

    print("\n## Server RSS around the flood\n")
    print("| store | before | peak | after | settled in |")
    print("|---|---:|---:|---:|---:|")
    for kind in ("spmd", "torch"):
        r = rss[kind]
        print(f"| {kind} | {human_bytes(r['before'])} | {human_bytes(r['peak'])} | {human_bytes(r['after'])} |"
              f" {r['waited']:.1f} s |")

    print("\n## Targets (spmd)\n")
    spmd_quiet_p99 = med(quiet["spmd"], "p99")
    run = flooded["spmd"]
    p99_ok = run is not None and run["p99"] <= 2 * spmd_quiet_p99
    p99_text = "stalled" if run is None else f"{run['p99'] / spmd_quiet_p99:.2f}x"
    r = rss["spmd"]
    ratio = med(quiet["spmd"], "ops_s") / med(quiet["torch"], "ops_s")
    print("| target | measured | met |")
    print("|---|---|---|")
    print(f"| p99 under flood within 2x of without | {p99_text} | {'yes' if p99_ok else 'NO'} |")
    print(f"| RSS back within max(10%, 2 MiB) of before | {human_bytes(r['before'])} -> {human_bytes(r['after'])} |"
          f" {'yes' if rss_target_met(r['before'], r['after']) else 'NO'} |")
    print(f"| ops/s at least torch's | {ratio:.2f}x | {'yes' if ratio >= 1 else 'NO'} |")
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        serve(sys.argv[2])
    elif len(sys.argv) > 1 and sys.argv[1] == "client":
        client(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    elif len(sys.argv) > 1 and sys.argv[1] == "flood":
        flood(int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
