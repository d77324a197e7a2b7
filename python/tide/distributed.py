"""Glue to torch.distributed shared by tide.fsdp and tide-bench."""

from __future__ import annotations

import itertools

import torch.distributed as dist

from . import _tide


def store_bootstrap(group, prefix: str) -> _tide.CallbackBootstrap:
    """A TIDE bootstrap over the default torch.distributed Store: no extra service, works with gloo
    and NCCL process groups alike. `prefix` must be unique per window family and equal on all ranks."""
    store = dist.distributed_c10d._get_default_store()
    rank, world = group.rank(), group.size()
    rounds = itertools.count()

    def allgather(mine: bytes) -> list:
        r = next(rounds)
        store.set(f"{prefix}/{r}/{rank}", mine)
        return [store.get(f"{prefix}/{r}/{q}") for q in range(world)]

    return _tide.CallbackBootstrap(rank, world, allgather)


def nccl_comm(group, prefix: str = "tide/nccl") -> _tide.NcclComm:
    """A TIDE NCCL communicator over the ranks of a torch.distributed process group (NCCL rank i =
    group rank i = TIDE rank i), for CudaExecutor's network ops across nodes. Its unique id travels
    through the default Store; NCCL itself is the libnccl PyTorch loaded (or TIDE_NCCL_LIB). Call
    it on every rank of `group`, with the CUDA device already set; `prefix` unique per call."""
    return _tide.NcclComm.create(store_bootstrap(group, prefix))
