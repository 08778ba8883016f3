"""`python -m spmd.run ...`: the same as the `spmdrun` command."""

from spmd.run.cli import main

if __name__ == "__main__":
    main()
