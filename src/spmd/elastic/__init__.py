"""torch's elastic package path: `multiprocessing.errors` (the `record` decorator) and `utils.data`
(ElasticDistributedSampler, CyclingIterator) are served here.
Layer: run (spmdrun is spmd's elastic launcher)."""
