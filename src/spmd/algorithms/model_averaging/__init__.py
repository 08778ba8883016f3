"""Model averaging (torch's `algorithms.model_averaging` package): average the parameters of the ranks' model
replicas every few steps, for post-local SGD (`spmd.optim.PostLocalSGDOptimizer`)."""
