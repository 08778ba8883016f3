"""torch's elastic package path; only `multiprocessing.errors` (the `record` decorator) is aliased here.
Layer: run (spmdrun is spmd's elastic launcher)."""
