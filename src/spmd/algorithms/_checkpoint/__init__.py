"""torch's `algorithms._checkpoint` package path: activation checkpointing and offloading wrappers."""
