"""Pipeline parallelism: torch.distributed.pipelining's API on spmd's point-to-point operations.

Layer 4. Stages stream microbatches along a pipeline group; each schedule is a pure function to a program per
rank (programs.py), proven by validate.py before the runtime (runtime.py, the only module that communicates)
executes it.
"""
