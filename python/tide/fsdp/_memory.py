"""Tensors over memory TIDE owns (a window's data, a bucket's fixed address): views, never copies."""

from __future__ import annotations

import ctypes

import torch


class DeviceBytes:
    """`nbytes` of device memory at `ptr`, as a __cuda_array_interface__ for a zero-copy tensor."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None, "stream": None}


def bytes_at(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over the `nbytes` at `ptr` (device memory on a CUDA `device`, else host)."""
    if device.type == "cuda":
        return torch.as_tensor(DeviceBytes(ptr, nbytes), device=device)
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8)
