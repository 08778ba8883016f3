"""The named communication hooks (torch's `DDPCommHookType` and `register_ddp_comm_hook`): pick a hook by
name, as configuration files and launch flags do, instead of importing it.

Layer: ddp. Each member's value registers its hook on a DDP module: `DDPCommHookType.FP16_COMPRESS.value(
model=ddp, state=group)`, or `register_ddp_comm_hook(DDPCommHookType.FP16_COMPRESS, ddp, group)`. For the
PowerSGD members `state` is the process group (or None) and the PowerSGDState is made here, with torch's
settings: rank 1 or 2, compression from iteration 1000.
"""

from __future__ import annotations

import enum
import functools
from typing import Any

from spmd.comm.group import ProcessGroup
from spmd.ddp.comm_hooks import Hook, allreduce_hook, bf16_compress_hook, fp16_compress_hook, noop_hook
from spmd.ddp.powersgd import PowerSGDState, batched_powerSGD_hook, powerSGD_hook
from spmd.ddp.quantization_hooks import quantization_perchannel_hook, quantization_pertensor_hook

__all__ = ["DDPCommHookType", "register_ddp_comm_hook"]


def _register(model: Any, state: object, comm_hook: Hook) -> None:
    model.register_comm_hook(state, comm_hook)


def _register_powersgd(model: Any, state: ProcessGroup | None, comm_hook: Hook, matrix_approximation_rank: int,
                       start_powerSGD_iter: int = 1_000) -> None:
    powersgd_state = PowerSGDState(process_group=state, matrix_approximation_rank=matrix_approximation_rank,
                                   start_powerSGD_iter=start_powerSGD_iter)
    model.register_comm_hook(powersgd_state, comm_hook)


class DDPCommHookType(enum.Enum):
    """spmd's DDP communication hooks by name; each value registers its hook: `.value(model=, state=)`."""

    ALLREDUCE = enum.member(functools.partial(_register, comm_hook=allreduce_hook))
    FP16_COMPRESS = enum.member(functools.partial(_register, comm_hook=fp16_compress_hook))
    BF16_COMPRESS = enum.member(functools.partial(_register, comm_hook=bf16_compress_hook))
    QUANTIZE_PER_TENSOR = enum.member(functools.partial(_register, comm_hook=quantization_pertensor_hook))
    QUANTIZE_PER_CHANNEL = enum.member(functools.partial(_register, comm_hook=quantization_perchannel_hook))
    POWER_SGD = enum.member(functools.partial(_register_powersgd, comm_hook=powerSGD_hook,
                                              matrix_approximation_rank=1))
    POWER_SGD_RANK2 = enum.member(functools.partial(_register_powersgd, comm_hook=powerSGD_hook,
                                                    matrix_approximation_rank=2))
    BATCHED_POWER_SGD = enum.member(functools.partial(_register_powersgd, comm_hook=batched_powerSGD_hook,
                                                      matrix_approximation_rank=1))
    BATCHED_POWER_SGD_RANK2 = enum.member(functools.partial(_register_powersgd, comm_hook=batched_powerSGD_hook,
                                                            matrix_approximation_rank=2))
    NOOP = enum.member(functools.partial(_register, comm_hook=noop_hook))


def register_ddp_comm_hook(comm_hook_type: DDPCommHookType, model: Any, state: object = None) -> None:
    """Register the hook `comm_hook_type` names on the DDP module `model`, with `state` (see the module doc)."""
    comm_hook_type.value(model=model, state=state)
