"""The schedules as pure functions: (ranks, microbatches, stages per rank) -> a compute-only program per rank.

Layer: pipelining. Nothing here runs a model or communicates. Each generator reproduces the order of torch's
schedule of the same name (tests compare them action for action), written as the phases the papers describe.
`add_communication` lowers a compute-only program by inserting the sends and receives the runtime executes.

Stages per rank (`stages_per_rank`, the virtual stages) sit round-robin (`loop`: rank r holds r, r + R, ...)
except for the V schedules (ZBV, DualPipeV), where rank r holds stages r and 2R - 1 - r (actions.stage_to_rank).
Letters in comments: R ranks, n microbatches, v stages per rank.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from spmd.pipelining.actions import (
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    ActionKind,
    B,
    F,
    I,
    Placement,
    Program,
    ScheduleError,
    W,
    stage_to_rank,
)


def _check_sizes(name: str, num_ranks: int, n_microbatches: int, stages_per_rank: int = 1) -> None:
    for what, value in (("ranks", num_ranks), ("microbatches", n_microbatches), ("stages per rank", stages_per_rank)):
        if value < 1:
            raise ScheduleError(f"{name}: the number of {what} must be at least 1, got {value}")


def gpipe(num_ranks: int, n_microbatches: int) -> Program:
    """GPipe: every forward, then every backward (fill, drain); one stage per rank.

    >>> gpipe(2, 2)
    {0: [0F0, 0F1, 0B0, 0B1], 1: [1F0, 1F1, 1B0, 1B1]}
    """
    _check_sizes("GPipe", num_ranks, n_microbatches)
    return {rank: [Action(rank, F, mb) for mb in range(n_microbatches)]
            + [Action(rank, B, mb) for mb in range(n_microbatches)] for rank in range(num_ranks)}


def one_f_one_b(num_ranks: int, n_microbatches: int) -> Program:
    """1F1B: warm up with forwards, then alternate one forward and one backward, then drain the backwards; at most
    num_ranks - rank microbatches are live on a rank. Needs at least as many microbatches as ranks.

    >>> one_f_one_b(2, 3)[0]
    [0F0, 0F1, 0B0, 0F2, 0B1, 0B2]
    """
    _check_sizes("1F1B", num_ranks, n_microbatches)
    if n_microbatches < num_ranks:
        raise ScheduleError(f"1F1B needs at least as many microbatches as stages: got {n_microbatches} "
                            f"microbatches for {num_ranks} stages")
    program: Program = {}
    for rank in range(num_ranks):
        warmup = num_ranks - 1 - rank
        actions: list[Action | None] = [Action(rank, F, mb) for mb in range(warmup)]   # warmup
        for mb in range(n_microbatches - warmup):                                       # steady: 1F, 1B
            actions += [Action(rank, F, warmup + mb), Action(rank, B, mb)]
        actions += [Action(rank, B, mb) for mb in range(n_microbatches - warmup, n_microbatches)]   # cooldown
        program[rank] = actions
    return program


def looped_bfs(num_ranks: int, n_microbatches: int, stages_per_rank: int) -> Program:
    """Breadth-first looping (arXiv 2211.05953): each local stage runs every microbatch's forward before the next
    local stage starts; backwards go the reverse way."""
    _check_sizes("LoopedBFS", num_ranks, n_microbatches, stages_per_rank)
    program: Program = {}
    for rank in range(num_ranks):
        stages = [rank + local * num_ranks for local in range(stages_per_rank)]
        program[rank] = ([Action(stage, F, mb) for stage in stages for mb in range(n_microbatches)]
                         + [Action(stage, B, mb) for stage in reversed(stages)
                            for mb in reversed(range(n_microbatches))])
    return program


def _rounds(name: str, num_ranks: int, n_microbatches: int) -> int:
    """Microbatches per round of the interleaved schedules: n split into max(1, n // R) equal rounds."""
    rounds = max(1, n_microbatches // num_ranks)
    if n_microbatches % rounds:
        raise ScheduleError(f"{name}: {n_microbatches} microbatches don't split into {rounds} equal rounds "
                            f"(n // ranks for {num_ranks} ranks); use a multiple of {num_ranks}, or fewer than "
                            f"{2 * num_ranks}")
    return n_microbatches // rounds


def _looped_one_f_one_b(rank: int, num_ranks: int, n_microbatches: int, stages_per_rank: int, warmup: int,
                        per_round: int, zero_bubble: bool) -> list[Action | None]:
    """Interleaved 1F1B on one rank (arXiv 2104.04473), and with `zero_bubble` its ZB1P variant (arXiv 2401.10241):
    backward split into I and W, the W of the oldest backward filling each slot after the first `rank` ones.

    Op k (of n*v forwards) runs the forward of local stage (k // per_round) % v: a round of microbatches through
    one local stage, then the next; backwards visit the local stages the other way round.
    """
    def forward_stage(op: int) -> int:
        return (op // per_round) % stages_per_rank * num_ranks + rank

    def backward_stage(op: int) -> int:
        return (stages_per_rank - 1 - (op - warmup) // per_round % stages_per_rank) * num_ranks + rank

    total = n_microbatches * stages_per_rank
    next_mb: dict[tuple[int, ActionKind], int] = collections.defaultdict(int)
    pending_weights: collections.deque[Action] = collections.deque()
    actions: list[Action | None] = []

    def add(stage: int, kind: ActionKind) -> None:
        mb = next_mb[stage, kind]
        next_mb[stage, kind] = mb + 1
        actions.append(Action(stage, kind, mb))
        if kind is I:
            pending_weights.append(Action(stage, W, mb))

    for op in range(total + warmup):
        if op < total:                                   # warmup and steady state: a forward
            add(forward_stage(op), F)
        if op >= warmup:                                 # steady state and cooldown: a backward
            add(backward_stage(op), I if zero_bubble else B)
            if zero_bubble and op - warmup >= rank:      # ZB1P: the first `rank` backwards keep their W for later
                actions.append(pending_weights.popleft())
    actions += pending_weights                           # the weight gradients still owed
    return actions


def interleaved_1f1b(num_ranks: int, n_microbatches: int, stages_per_rank: int) -> Program:
    """Interleaved 1F1B (Megatron's virtual pipeline): 1F1B over `stages_per_rank` round-robin stages per rank,
    depth-first (a round of microbatches through one local stage, then the next). Any n that splits into
    max(1, n // R) equal rounds."""
    _check_sizes("Interleaved1F1B", num_ranks, n_microbatches, stages_per_rank)
    per_round = _rounds("Interleaved1F1B", num_ranks, n_microbatches)
    return {rank: _looped_one_f_one_b(rank, num_ranks, n_microbatches, stages_per_rank,
                                      min((stages_per_rank - 1) * per_round + 2 * (num_ranks - 1 - rank),
                                          n_microbatches * stages_per_rank),
                                      per_round, zero_bubble=False) for rank in range(num_ranks)}


def interleaved_zero_bubble(num_ranks: int, n_microbatches: int, stages_per_rank: int) -> Program:
    """Interleaved zero bubble (ZB1P, arXiv 2401.10241): interleaved 1F1B with half the warmup, each backward split
    into input (I) and weight (W) gradients, and the Ws filling the slots where 1F1B would idle."""
    _check_sizes("InterleavedZeroBubble", num_ranks, n_microbatches, stages_per_rank)
    per_round = _rounds("InterleavedZeroBubble", num_ranks, n_microbatches)
    return {rank: _looped_one_f_one_b(rank, num_ranks, n_microbatches, stages_per_rank,
                                      min((stages_per_rank - 1) * per_round + num_ranks - 1 - rank,
                                          n_microbatches * stages_per_rank),
                                      per_round, zero_bubble=True) for rank in range(num_ranks)}


def zbv_zero_bubble(num_ranks: int, n_microbatches: int) -> Program:
    """ZB-V (arXiv 2401.10241, section 6): two stages per rank placed in a V (rank r holds r and 2R - 1 - r),
    backward split into I and W. Zero bubble when F, I and W take equal time.

    Built for max(2R - 1, n) microbatches, then the ones past n are dropped.
    """
    _check_sizes("ZBVZeroBubble", num_ranks, n_microbatches)
    n_built = max(2 * num_ranks - 1, n_microbatches)
    return {rank: [a for a in _zbv_rank(rank, num_ranks, n_built) if a.microbatch is not None
                   and a.microbatch < n_microbatches] for rank in range(num_ranks)}


def _zbv_rank(rank: int, num_ranks: int, n_built: int) -> list[Action]:
    down, up = rank, 2 * num_ranks - 1 - rank          # the V's two stages on this rank
    count: dict[tuple[int, ActionKind], int] = collections.defaultdict(int)
    actions: list[Action] = []

    def add(stage: int, *kinds: ActionKind) -> None:
        for kind in kinds:
            actions.append(Action(stage, kind, count[stage, kind]))
            count[stage, kind] += 1

    for _ in range(2 * (num_ranks - rank) - 1):        # warmup: fill the way down
        add(down, F)
    for _ in range(rank):
        add(up, F)
        add(down, F)
    for _ in range(num_ranks - rank):                  # warmup: first backwards on the way up
        add(up, F, I, W)
    while count[up, F] < count[down, F] or count[down, F] < n_built:   # steady state
        if count[down, F] < n_built:
            add(down, F)
        add(down, I, W)
        add(up, F, I, W)
    for _ in range(rank):                              # cooldown: input gradients first, weights after
        add(down, I)
        add(up, I)
    for _ in range(num_ranks - rank):
        add(down, I, W)
    for stage in (up, down):
        while count[stage, W] < count[stage, I]:
            add(stage, W)
    return actions


def dualpipe_v(num_ranks: int, n_microbatches: int) -> Program:
    """DualPipeV (DeepSeek-V3, arXiv 2412.19437; the V-shaped half of DualPipe): two stages per rank in a V, the
    steady state issuing one stage's forward together with the other's backward (OVERLAP_F_B) so communication
    of one hides behind computation of the other. Needs at least 2R microbatches."""
    _check_sizes("DualPipeV", num_ranks, n_microbatches)
    if n_microbatches < 2 * num_ranks:
        raise ScheduleError(f"DualPipeV needs at least as many microbatches as stages: got {n_microbatches} "
                            f"microbatches for {2 * num_ranks} stages on {num_ranks} ranks")
    return {rank: _dualpipe_v_rank(rank, num_ranks, n_microbatches) for rank in range(num_ranks)}


def _dualpipe_v_rank(rank: int, num_ranks: int, n_microbatches: int) -> list[Action | None]:
    down, up = rank, 2 * num_ranks - 1 - rank
    next_f: dict[int, int] = collections.defaultdict(int)
    next_b: dict[int, int] = collections.defaultdict(int)       # B and I share the backward count
    pending_weights: collections.deque[Action] = collections.deque()
    actions: list[Action | None] = []

    def forward(stage: int) -> Action:
        next_f[stage] += 1
        return Action(stage, F, next_f[stage] - 1)

    def backward(stage: int, split: bool = False) -> Action:
        next_b[stage] += 1
        if split:
            pending_weights.append(Action(stage, W, next_b[stage] - 1))
        return Action(stage, I if split else B, next_b[stage] - 1)

    def overlap(forward_stage: int, backward_stage: int) -> Action:
        return Action(-1, ActionKind.OVERLAP_F_B, None, (forward(forward_stage), backward(backward_stage)))

    def weight_if_pending() -> None:
        if pending_weights:
            actions.append(pending_weights.popleft())

    tail = num_ranks - rank - 1
    actions += [forward(down) for _ in range(2 * tail)]         # 1: forwards down the V
    for _ in range(rank + 1):                                   # 2: both stages' forwards
        actions += [forward(down), forward(up)]
    for _ in range(tail):                                       # 3: zero-bubble backwards of the up stage
        actions.append(backward(up, split=True))
        weight_if_pending()
        actions.append(forward(up))
    for i in range(n_microbatches - 2 * num_ranks + rank + 1):  # 4: steady state, F and B overlapped
        if i == 0 and rank == num_ranks - 1:                    # the V's tip: not overlapped, a shorter bubble
            actions += [forward(down), backward(up)]
        else:
            actions.append(overlap(down, up))
        actions.append(overlap(up, down))
    for _ in range(tail):                                       # 5: the up stage's forwards run out
        actions += [backward(up), overlap(up, down)]
    split = False                                               # 6: drain; the second half splits off W
    for i in range(rank + 1):
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        actions.append(backward(up, split))
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        actions.append(backward(down, split))
    for _ in range(tail):                                       # 7
        weight_if_pending()
        actions.append(backward(down, split))
    for _ in range(rank + 1):                                   # 8: the weight gradients still owed
        weight_if_pending()
    return actions


PROGRAMS: dict[str, tuple[Callable[..., Program], Placement, bool]] = {
    # name -> (generator, placement, takes stages_per_rank)
    "GPipe": (gpipe, "loop", False),
    "1F1B": (one_f_one_b, "loop", False),
    "Interleaved1F1B": (interleaved_1f1b, "loop", True),
    "LoopedBFS": (looped_bfs, "loop", True),
    "InterleavedZeroBubble": (interleaved_zero_bubble, "loop", True),
    "ZBVZeroBubble": (zbv_zero_bubble, "v", False),
    "DualPipeV": (dualpipe_v, "v", False),
}


def build(name: str, num_ranks: int, n_microbatches: int, stages_per_rank: int = 1) -> Program:
    """The compute-only program of the schedule `name` (a key of PROGRAMS, case-insensitive).

    The V schedules always hold two stages per rank; the others hold `stages_per_rank` (1 for GPipe and 1F1B).
    """
    key = {k.lower(): k for k in PROGRAMS}.get(name.lower())
    if key is None:
        raise ScheduleError(f"unknown schedule {name!r}; the schedules are {', '.join(PROGRAMS)}")
    generator, placement, multi = PROGRAMS[key]
    fixed = 2 if placement == "v" else 1
    if not multi and stages_per_rank != fixed:
        raise ScheduleError(f"{key} holds {fixed} stage{'s' * (fixed > 1)} per rank, not {stages_per_rank}")
    return generator(num_ranks, n_microbatches, stages_per_rank) if multi else generator(num_ranks, n_microbatches)


def placement_of(name: str) -> Placement:
    """How the schedule `name` places its stages on ranks ('loop' or 'v')."""
    return PROGRAMS[{k.lower(): k for k in PROGRAMS}[name.lower()]][1]


def add_communication(program: Program, placement: dict[int, int]) -> Program:
    """Lower a compute-only program: after each computation, send what it produced to a stage on another rank, and
    place the receive of it in the receiving rank's program at that moment (see Note: where receives go). Idle
    slots (None) are dropped. `placement` maps every stage to its rank.

    Note: where receives go
    The ranks' programs are played together, round after round, each rank placing its next computation once what
    it consumes from another rank has a receive placed (its sender's computation placed before) or, on its own
    rank, was placed before; placing a computation appends its sends to its rank and the matching receives to the
    receiving ranks, as torch's lowering does. So every two ranks list the messages between them in one order,
    each send in the sender's program where its receive is in the receiver's: what NCCL needs, which matches
    messages by their order alone (tags are ignored) and runs a rank's operations with a peer one after another,
    a large send waiting for its receive (posting a receive earlier than its sender's turn could hang the GPUs
    or pair the wrong messages). Receives are posted early but never waited on early: the runtime waits at the
    computation that consumes one, which is where validate_program's simulation waits too.
    """
    num_stages = len(placement)

    def remote(stage: int, other: int) -> bool:
        return 0 <= other < num_stages and placement[other] != placement[stage]

    def consumed(c: Action) -> Action | None:
        """The message computation `c` waits for from another rank, as its receive; None if it needs none."""
        if c.kind is F and remote(c.stage, c.stage - 1):
            return Action(c.stage, RECV_F, c.microbatch)
        if c.kind in (B, I) and remote(c.stage, c.stage + 1):
            return Action(c.stage, RECV_B, c.microbatch)
        return None

    def produced(c: Action) -> list[tuple[Action, Action]]:
        """The (send, receive) pairs of what computation `c` hands to a stage on another rank."""
        if c.kind is F and remote(c.stage, c.stage + 1):
            return [(Action(c.stage, SEND_F, c.microbatch), Action(c.stage + 1, RECV_F, c.microbatch))]
        if c.kind in (B, I) and remote(c.stage, c.stage - 1):
            return [(Action(c.stage, SEND_B, c.microbatch), Action(c.stage - 1, RECV_B, c.microbatch))]
        return []

    pending = {rank: collections.deque((index, a) for index, a in enumerate(actions) if a is not None)
               for rank, actions in program.items()}
    lowered: Program = {rank: [] for rank in program}
    received: dict[int, set[Action]] = {rank: set() for rank in program}
    while any(pending.values()):
        progress = False
        for rank in sorted(pending):
            if not pending[rank]:
                continue
            _, action = pending[rank][0]
            needs = [r for r in map(consumed, action.computations) if r is not None]
            if not all(r in received[rank] for r in needs):
                continue
            pending[rank].popleft()
            lowered[rank].append(action)
            for c in action.computations:
                for send, receive in produced(c):
                    lowered[rank].append(send)
                    receiver = placement[receive.stage]
                    lowered[receiver].append(receive)
                    received[receiver].add(receive)
            progress = True
        if not progress:
            raise ScheduleError(_hang(program, pending, received, consumed, placement))
    return lowered


def _hang(program: Program, pending: dict[int, collections.deque[tuple[int, Action]]],
          received: dict[int, set[Action]], consumed: Callable[[Action], Action | None],
          placement: dict[int, int]) -> str:
    """What a program that can't be lowered would do: hang, each rank's next computation waiting for a message
    its sender computes only after it."""
    reasons = []
    for rank, queue in sorted(pending.items()):
        if not queue:
            continue
        index, action = queue[0]
        missing = next(r for r in map(consumed, action.computations) if r is not None and r not in received[rank])
        sender = missing.stage - 1 if missing.kind is RECV_F else missing.stage + 1
        kind = "forward" if missing.kind is RECV_F else "backward"
        reasons.append(f"rank {rank} is blocked at action {index} ({action}): it needs what stage {sender} on rank "
                       f"{placement[sender]} sends after its {kind} of microbatch {missing.microbatch}, which that "
                       f"rank reaches only after this")
    rows = "\n".join(f"  rank {rank}: {' '.join('.' if a is None else str(a) for a in actions)}"
                     for rank, actions in sorted(program.items()))
    return "the program would hang: no rank can run its next action:\n" + "\n".join(
        f"  {reason}" for reason in reasons) + f"\nthe program:\n{rows}"


def add_data_parallel(program: Program, n_microbatches: int, max_active_stages: int = 3) -> Program:
    """Add the actions of data-parallel stages to a lowered program, as torch's runtime lowers its programs:
    UNSHARD a stage before its computations, keeping at most `max_active_stages` stages unsharded (the next ones
    the rank computes: fetched ahead, the others RESHARDed), and REDUCE_GRAD a stage after its last backward
    (the n_microbatches-th B or W) and the sends that follow it. For stages that aren't data parallel the runtime
    does nothing on these actions (runtime.py, Note: data-parallel stages)."""
    lowered: Program = {}
    for rank, actions in program.items():
        steps = [a for a in actions if a is not None]
        out: list[Action | None] = []
        active: list[int] = []
        backwards: collections.Counter[int] = collections.Counter()
        due: list[int] = []                  # stages whose REDUCE_GRAD follows the current run of sends
        for k, action in enumerate(steps):
            if due and action.kind not in (SEND_F, SEND_B):
                out += [Action(stage, ActionKind.REDUCE_GRAD) for stage in due]
                due = []
            if action.is_compute:
                ahead = _next_stages(steps[k:], max_active_stages)
                out += [Action(stage, ActionKind.RESHARD) for stage in active if stage not in ahead]
                out += [Action(stage, ActionKind.UNSHARD) for stage in ahead if stage not in active]
                active = [stage for stage in active if stage in ahead] + [s for s in ahead if s not in active]
                for single in action.computations:
                    if single.kind in (B, W):
                        backwards[single.stage] += 1
                        if backwards[single.stage] == n_microbatches:
                            due.append(single.stage)
            out.append(action)
        out += [Action(stage, ActionKind.REDUCE_GRAD) for stage in due]
        out += [Action(stage, ActionKind.RESHARD) for stage in active]
        lowered[rank] = out
    return lowered


def _next_stages(actions: list[Action], count: int) -> list[int]:
    """The first `count` distinct stages the computations in `actions` compute, in order."""
    found: list[int] = []
    for action in actions:
        for single in (action.computations if action.is_compute else ()):
            if single.stage not in found:
                found.append(single.stage)
                if len(found) == count:
                    return found
    return found


def placement_for(program: Program, style: Placement) -> dict[int, int]:
    """The placement `style` gives the stages a program computes over its ranks."""
    num_stages = 1 + max((c.stage for actions in program.values() for a in actions if a is not None
                          for c in a.computations), default=-1)
    return stage_to_rank(len(program), num_stages, style)
