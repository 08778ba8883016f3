"""The shm transport: ranks on one host move data through a shared segment; hierarchical shm + tcp across hosts.

`names` is torch-free, so the launcher can sweep orphaned segments without importing torch.
"""
