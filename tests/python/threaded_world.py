"""Ranks as threads of one process, as FSDP2's multi-threaded tests run them: torch.distributed's
"threaded" backend over one HashStore. run(world, fn) calls fn(rank) on every thread-rank and
returns the results in rank order; an exception on any rank is re-raised (with its rank), and a
rank still running after `timeout_s` fails the call instead of hanging it."""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.multi_threaded_pg import (
    ProcessLocalGroup, ThreadLocalWorld, _install_threaded_pg, _uninstall_threaded_pg)

# torch 2.11's destroy_process_group finalizes the world's `comms` (torchcomms communicators), which
# its own ThreadLocalWorld lacks: destroying a thread-rank's group raised AttributeError. A threaded
# world has no such communicator.
if not hasattr(ThreadLocalWorld, "comms"):
    ThreadLocalWorld.comms = property(lambda self: [])


class RankError(Exception):
    def __init__(self, rank, error):
        super().__init__(f"rank {rank}: {type(error).__name__}: {error}")
        self.rank, self.error = rank, error


def run(world: int, fn, timeout_s: float = 120.0, raise_errors: bool = True) -> list:
    """fn(rank) on `world` thread-ranks. With raise_errors=False, a rank's exception is its result."""
    if not torch.cuda.is_available():
        # Where CUDA is unavailable, torch's FakeTensorMode (DTensor's sharding propagation) installs
        # a no-op CUDA device guard at its first use; two thread-ranks doing that at once crash
        # torch 2.11 (seen with its CUDA build on a machine without a GPU). Done here first, once.
        torch._C._ensureCUDADeviceGuardSet()
    _install_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)  # a group registry per thread
    store = dist.HashStore()
    results: list = [None] * world
    errors: dict = {}

    def worker(rank):
        dist.init_process_group(backend="threaded", rank=rank, world_size=world, store=store)
        try:
            results[rank] = fn(rank)
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            errors[rank] = e
            results[rank] = e
            if raise_errors:
                ProcessLocalGroup.exception_handle(e)  # wakes ranks blocked in a collective
        finally:
            dist.destroy_process_group()

    threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in range(world)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s)
        stuck = [r for r, t in enumerate(threads) if t.is_alive()]
        if stuck:
            raise TimeoutError(f"thread-ranks {stuck} still running after {timeout_s} s (a hang)")
    finally:
        ProcessLocalGroup.reset()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        _uninstall_threaded_pg()
    if raise_errors and errors:
        rank = min(errors)
        raise RankError(rank, errors[rank]) from errors[rank]
    return results
