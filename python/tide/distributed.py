"""Glue to torch.distributed shared by tide.fsdp and tide-bench."""

from __future__ import annotations

import datetime
import itertools

import torch.distributed as dist

from . import _tide


def wait_for_ranks(store, keys: list, timeout_ms: int, what: str) -> None:
    """Waits until every rank's key in `keys` (index = rank) is set, at most `timeout_ms`; else a
    TimeoutError naming `what` and the ranks whose keys are missing."""
    try:
        store.wait(keys, datetime.timedelta(milliseconds=timeout_ms))
    except Exception as e:  # noqa: BLE001 - c10d raises DistStoreError / RuntimeError by version
        missing = [q for q, k in enumerate(keys) if not store.check([k])]
        if not missing:
            raise
        raise TimeoutError(f"{what}: waited {timeout_ms} ms for ranks {missing}") from e


def store_bootstrap(group, prefix: str, timeout_ms: int | None = None) -> _tide.CallbackBootstrap:
    """A TIDE bootstrap over the default torch.distributed Store: no extra service, works with gloo
    and NCCL process groups alike. `prefix` must be unique per window family and equal on all ranks.
    Each exchange waits at most `timeout_ms` (default: TIDE_TIMEOUT_MS) for the other ranks."""
    store = dist.distributed_c10d._get_default_store()
    rank, world = group.rank(), group.size()
    rounds = itertools.count()
    wait_ms = timeout_ms or _tide.default_timeout_ms()

    def allgather(mine: bytes) -> list:
        r = next(rounds)
        keys = [f"{prefix}/{r}/{q}" for q in range(world)]
        store.set(keys[rank], mine)
        wait_for_ranks(store, keys, wait_ms, f"tide: rank {rank} in bootstrap '{prefix}' (exchange {r})")
        return [store.get(k) for k in keys]

    return _tide.CallbackBootstrap(rank, world, allgather)


def nccl_comm(group, prefix: str = "tide/nccl") -> _tide.NcclComm:
    """A TIDE NCCL communicator over the ranks of a torch.distributed process group (NCCL rank i =
    group rank i = TIDE rank i), for CudaExecutor's network ops across nodes. Its unique id travels
    through the default Store; NCCL itself is the libnccl PyTorch loaded (or TIDE_NCCL_LIB). Call
    it on every rank of `group`, with the CUDA device already set; `prefix` unique per call."""
    return _tide.NcclComm.create(store_bootstrap(group, prefix))
