"""Starting ranks: spawned processes by default, or the processes torchrun already started."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


@contextlib.contextmanager
def rendezvous():
    """The port spawned ranks meet on (join_world), held by this process's store from before they
    start until they end: the OS picks it when the store binds it, so no other process can take it
    in between. (A port found free, closed and handed to the ranks can be: under parallel test
    processes, rank 0's bind then failed with EADDRINUSE.)"""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        yield store.port
    finally:
        del store


def join_world(port: int, rank: int, world: int, backend: str) -> None:
    """In a spawned rank: the default process group, over the store rendezvous() hosts on `port`."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)


def ranks_share_gpus(device: str, ranks_here: int) -> bool:
    """More ranks on this host than GPUs: several ranks per GPU (single-GPU emulation)."""
    return device == "cuda" and ranks_here > torch.cuda.device_count()


def backend_for(device: str, ranks_here: int) -> str:
    # NCCL refuses two ranks on one GPU; gloo then carries FSDP2's process group.
    return "nccl" if device == "cuda" and not ranks_share_gpus(device, ranks_here) else "gloo"


# tide-bench compares against stock NCCL collectives on machines that may be shared: NVLink
# multicast (NVLS) can take a shared host's GPUs out of service, so it stays off unless the user
# explicitly set these (TIDE itself never uses multicast).
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def exit_rank() -> None:
    """Ends a spawned rank's process once its result is saved: after a barrier, since under torchrun
    rank 0 hosts the store that the others may still be using, and without the interpreter's finalization.
    DTensor specs cached past the model keep FSDP2's device mesh, and with it the gloo group, alive
    past destroy_process_group; the group's worker thread can still hold the last reference to a
    finished collective's tensors, and a thread that drops one during finalization takes the GIL,
    which aborts the process ("terminate called without an active exception",
    pytorch/pytorch#190489): a 2-rank world that exits right after gloo collectives, its group
    kept alive, aborts in a third to a half of its runs."""
    if dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _no_multicast() -> None:
    for key, value in NO_MULTICAST.items():
        os.environ.setdefault(key, value)


def _spawned(rank, world, port, device, fn, args, out_dir):
    _no_multicast()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    else:  # ranks share this host's cores: one share each, not every core per rank
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    join_world(port, rank, world, backend_for(device, world))
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        exit_rank()
    finally:  # reached on an error only
        dist.destroy_process_group()


def run_ranks(world: int, device: str, fn, *args) -> list:
    """Runs fn(rank, world, *args) on `world` fresh processes; returns their results in rank order."""
    with tempfile.TemporaryDirectory(prefix="tide-bench-") as out_dir, rendezvous() as port:
        mp.start_processes(_spawned, args=(world, port, device, fn, args, out_dir),
                           nprocs=world, join=True, start_method="spawn")
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def run_torchrun(device: str, fn, *args) -> list | None:
    """In a torchrun-started process: runs fn on this rank; rank 0 gets every rank's result."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    _no_multicast()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device == "cuda":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    if not dist.is_initialized():
        dist.init_process_group(backend_for(device, int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    result = fn(rank, world, *args)
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(result, gathered, dst=0)
    return gathered
