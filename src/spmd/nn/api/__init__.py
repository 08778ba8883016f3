"""torch's `nn.api` module path: RemoteModule (remote_module.py)."""
