"""Transports: what moves one group's bytes (the contract and registry in `base`; threads, tcp, shm).

Layer: comm. A transport imports only the contract, the reduction kernels, work/debug, stores and `_core`.
"""
