"""The shm transport: ranks on one host move data through a shared segment; hierarchical shm + tcp across hosts.

`backend="shm"` builds `local.LocalShmTransport` for a group on one host and `hierarchical.HierarchicalTransport`
for a group spanning hosts (`spmd.comm.transports.base.create_transport` picks; named "shm" and "shm+tcp").

`names` is torch-free, so the launcher can sweep orphaned segments without importing torch.
"""
