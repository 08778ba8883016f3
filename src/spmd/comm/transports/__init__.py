"""Transports: what moves one group's bytes. `base` holds the contract (the ops, the devices a transport
moves, what a caller's stream means) and the registry; `threads`, `tcp/` and `shm/` are the transports, and a
torch ProcessGroup (gloo, nccl) joins them as `torch_pg` (issue 11).

Layer: comm. A transport imports only the contract, the reduction kernels, work/debug, stores and `_core`
(tests/test_layering.py checks it), never the public edge (world, group, collectives) above it.
"""
