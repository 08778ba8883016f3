"""torch's elastic multiprocessing path; see `errors`. Layer: run."""
