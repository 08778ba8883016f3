"""Alias of `spmd.device_mesh` under torch's older path (`_tensor.device_mesh`). Layer: tensor."""

from spmd.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["DeviceMesh", "init_device_mesh"]
