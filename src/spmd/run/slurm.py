"""Slurm: derive the node set and the rendezvous endpoint from the environment `srun` gives each task.

Layer: run. Pure functions of an environment mapping. The contract: `srun --ntasks-per-node=1 spmdrun
--nproc-per-node 8 train.py` starts one agent per node; each reads the step's node count, its own task id
(its node rank) and the step's node list, whose first host hosts the rendezvous. Nothing Slurm sets is secret
(job ids and host lists are visible to every user), so no rendezvous token is derived here: the agent warns unless
the batch script exports SPMD_STORE_TOKEN (srun passes it on) or names a --rdzv-token-file.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

from spmd.run.config import DEFAULT_RDZV_PORT

_PORT_SPREAD = 1000  # jobs sharing a node get different rendezvous ports: DEFAULT_RDZV_PORT + job id mod this


@dataclasses.dataclass(frozen=True)
class SlurmNodeSet:
    """What an agent learns from Slurm: how many nodes, which one it is, and where to meet."""

    nnodes: int
    node_rank: int
    host: str
    port: int
    job_id: str


def in_srun_step(environ: Mapping[str, str]) -> bool:
    """True inside a task started by `srun` (SLURM_STEP_NUM_NODES is set per step, not in the batch script)."""
    return "SLURM_JOB_ID" in environ and "SLURM_STEP_NUM_NODES" in environ


def _int(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except KeyError:
        raise ValueError(f"spmdrun: running under srun, but Slurm did not set {name}") from None
    except ValueError:
        raise ValueError(f"spmdrun: Slurm variable {name}={environ[name]!r} is not an integer") from None


def detect(environ: Mapping[str, str]) -> SlurmNodeSet:
    """The node set of the current `srun` step; ValueError when the step runs more than one agent per node."""
    nnodes = _int(environ, "SLURM_STEP_NUM_NODES")
    ntasks = _int(environ, "SLURM_STEP_NUM_TASKS") if "SLURM_STEP_NUM_TASKS" in environ else nnodes
    if ntasks != nnodes:
        raise ValueError(f"spmdrun: this srun step runs {ntasks} tasks on {nnodes} nodes; spmdrun starts the "
                         f"workers itself, so run one per node: srun --ntasks-per-node=1 spmdrun ...")
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or ""
    hosts = expand_hostlist(nodelist)
    if not hosts:
        raise ValueError("spmdrun: running under srun, but SLURM_STEP_NODELIST / SLURM_JOB_NODELIST is empty")
    job_id = environ["SLURM_JOB_ID"]
    step = environ.get("SLURM_STEP_ID", "0")
    seed = int(job_id) + int(step) if job_id.isdigit() and step.isdigit() else 0
    return SlurmNodeSet(nnodes=nnodes, node_rank=_int(environ, "SLURM_PROCID"), host=hosts[0],
                        port=DEFAULT_RDZV_PORT + seed % _PORT_SPREAD, job_id=f"slurm-{job_id}.{step}")


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets: 'a[1,2],b' -> ['a[1,2]', 'b']."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [part for part in parts if part]


def _expand_range(spec: str, hostlist: str) -> list[str]:
    """'01-03,7' -> ['01', '02', '03', '7'] (zero padding kept, as Slurm does)."""
    values = []
    for item in spec.split(","):
        low, sep, high = item.partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise ValueError(f"spmdrun: can't parse Slurm host list {hostlist!r} (range {item!r})")
        if not sep:
            values.append(low)
            continue
        width = len(low)
        values.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return values


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand Slurm's compressed host list: 'gpu[01-02,07],login' -> ['gpu01', 'gpu02', 'gpu07', 'login']."""
    hosts: list[str] = []
    for part in _split_top_level(hostlist.strip()):
        match = re.search(r"\[([^\]]*)\]", part)
        if match is None:
            hosts.append(part)
            continue
        head, tail = part[:match.start()], part[match.end():]
        for value in _expand_range(match.group(1), hostlist):
            hosts.extend(expand_hostlist(head + value + tail))  # tail may hold another bracket
    return hosts
