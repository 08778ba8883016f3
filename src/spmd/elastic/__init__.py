"""torch's elastic package path: `multiprocessing.errors` (the `record` decorator), `utils.data`
(ElasticDistributedSampler, CyclingIterator) and `timer` (expiration timers) are served here.
Layer: run (spmdrun is spmd's elastic launcher)."""
