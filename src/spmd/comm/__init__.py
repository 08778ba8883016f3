"""Layer 1, the communication layer (C10D): stores, process groups, transports, collectives, P2P."""
