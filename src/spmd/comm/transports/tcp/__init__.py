"""The tcp transport: an authenticated full mesh of sockets, ring and direct algorithms, zero-copy receives."""
