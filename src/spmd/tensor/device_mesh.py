"""Alias of `spmd.device_mesh` at torch's `tensor.device_mesh` path (torch serves DeviceMesh there too).
Layer: tensor."""

from spmd.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["DeviceMesh", "init_device_mesh"]
