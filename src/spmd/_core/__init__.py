"""Layer 0: errors, environment, logging and deadlines. Imports nothing from spmd."""
