"""torch's composable APIs at their module paths: `replicate` (DDP by hooks), `replicate_with_fsdp` (DDP on
FSDP2's machinery), `checkpoint` (activation checkpointing by hooks), `contract`, and FSDP2's older home `fsdp`.

Layer: _composable (L4: may import ddp and fsdp).
"""

from spmd._composable.checkpoint_activation import checkpoint
from spmd._composable.contract import _get_registry, contract
from spmd._composable.replicate import replicate

__all__ = ["_get_registry", "checkpoint", "contract", "replicate"]
