"""The unsharded parameters' lifetime: once a group reshards, no use of its unsharded params (autograd's
saved tensors in a second-order backward, a user's view) may read window memory that another group
has since refilled. Stock FSDP2 frees their storage (``resize_(0)``), so such a use raises there; TIDE
must raise the same way, or, where stock does not raise, give the exact result.

Six fully_shard'ed blocks plus the root share fewer pooled windows than groups (remaps > 0): with the
storage left alive, a gradient penalty through them trained silently on another group's bytes. Ranks
as threads and as processes on CPU; as processes sharing one GPU on CUDA (skipped without one)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

import fsdp_harness as h
from rounding import reduction_bound_scale
import threaded_world
import tide
import tide.fsdp

DIM, BLOCKS, BATCH = 11, 6, 4
GROUPS = BLOCKS + 1
# Where torch can swap a storage's data pointer, TIDE frees the outputs' storage as stock does and
# the error is stock's own; elsewhere autograd refuses the saved tensor (docs/ARCHITECTURE.md).
SWAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_")
STALE_USE = ("out of bounds for storage of size 0" if SWAP
             else "modified by an inplace operation")

gpu = pytest.mark.skipif(not (tide.cuda_built and torch.cuda.is_available()),
                         reason="needs a CUDA build of TIDE and a GPU (the ranks share it, gloo as process group)")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(DIM, 6), nn.Linear(6, DIM)

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(torch.tanh(x))


def make() -> Net:
    """The same weights on every rank, from a generator of its own (thread-ranks share torch's)."""
    model, gen = Net(), torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.4 * torch.randn(p.shape, generator=gen))
    return model


def build(device, reshard: bool = True):
    model = make().to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))  # not the default: cuda where there is one
    for module in [*model.blocks, model]:
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard)
        if not reshard:  # nothing reshards before the step ends: stock keeps every storage
            module.set_reshard_after_backward(False, recurse=False)
    return model


def inputs(world):
    return torch.randn(BATCH * world, DIM, generator=torch.Generator().manual_seed(1))


def gradient_penalty(model, x):
    x = x.clone().requires_grad_()
    y = model(x).pow(2).sum()
    (g,) = torch.autograd.grad(y, x, create_graph=True)
    (y + g.pow(2).sum()).backward()


def own_gradients(device, x) -> list:
    """The gradients this rank hands the reduce-scatter, |.|: the unsharded model's (FSDP2 computes
    on the same values with the same ops) on this rank's batch, on its device."""
    model = make().to(device)
    gradient_penalty(model, x)
    return [p.grad.abs().cpu() for p in model.parameters()]


def reduction_bound(own: list, world: int, rank: int) -> list:
    """Per element of `rank`'s gradient shards, how far stock's and TIDE's averages of the ranks'
    gradients g_r may differ, summed in other orders (rounding.reduction_bound_scale). The
    gradients are the reduce-scatter's outputs: one reduction, nothing after it to amplify a
    difference."""
    bounds = []
    for per_rank in zip(*own):
        total = torch.stack(per_rank).double().sum(0)
        chunks = torch.chunk(reduction_bound_scale(world, world) * total, world)  # FSDP2's shards on dim 0
        bounds.append(chunks[rank] if rank < len(chunks) else chunks[0][:0])
    return bounds


def _outcome(model, x, handle=None) -> dict:
    try:
        gradient_penalty(model, x)
        for m in model.modules():  # the sharded params (with their gradients) back on the modules
            if isinstance(m, FSDPModule):
                m.reshard()
        out = {"grads": [p.grad.to_local().cpu() for p in model.parameters()]}
    except RuntimeError as e:
        out = {"error": (type(e).__name__, str(e))}
        if hasattr(model, "reset_iter_state"):  # the step died inside backward (torch >= 2.13)
            model.reset_iter_state()
    if handle is not None:
        out.update(counts=handle.counts(), buckets=len(handle.buckets), fallbacks=handle.fallbacks,
                   windows=sum(len(p.windows) for p in handle.pools))
        try:
            tide.fsdp.disable(model)
        except ValueError as e:  # no way back to a clean state on this torch: the process ends
            out["disable"] = str(e)
    return out


def penalty_rank(rank, world, device, reshard):
    if device.type == "cuda":  # stock's and TIDE's ranks compute their own gradients identically
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    x = inputs(world)[rank * BATCH:(rank + 1) * BATCH].to(device)
    stock = _outcome(build(device, reshard), x)
    model = build(device, reshard)
    return stock, _outcome(model, x, tide.fsdp.enable(model, timeout_ms=30000)), own_gradients(device, x)


def check_penalty(results, world, reshard):
    """TIDE against stock FSDP2 on the same ranks: each rank's own gradients are the same
    computation in both (the all-gather is exact), so the averaged gradients differ only by the
    reduction's order: bitwise at W = 2 (a sum of two numbers in either order, halved exactly),
    within reduction_bound at W = 3."""
    for rank, (stock, mine, _) in enumerate(results):
        where = f"W={world} reshard={reshard} rank {rank}"
        assert mine["buckets"] == GROUPS and mine["fallbacks"] == [], (where, mine)
        assert mine["counts"]["all_gathers"] >= GROUPS and mine["counts"]["remaps"] > 0, (where, mine["counts"])
        if reshard:
            # Stock fails on the resharded params' freed storage; so must TIDE, not train on.
            assert mine["windows"] < GROUPS, (where, mine["windows"])
            assert "storage of size 0" in stock["error"][1], (where, stock)
            assert "error" in mine, f"{where}: TIDE trained where stock raised {stock['error']}"
            assert mine["error"][0] == stock["error"][0] and STALE_USE in mine["error"][1], (where, mine["error"])
        else:
            assert "error" not in stock and "error" not in mine, (where, stock.get("error"), mine.get("error"))
            assert mine["counts"]["reduce_scatters"] == GROUPS, (where, mine["counts"])
            bounds = reduction_bound([own for _, _, own in results], world, rank)
            for i, (got, want, bound) in enumerate(zip(mine["grads"], stock["grads"], bounds)):
                if world == 2:
                    assert torch.equal(got, want), f"{where} param {i}: not bitwise equal to stock"
                excess = (got.double() - want.double()).abs() - bound
                assert (excess <= 0).all(), (f"{where} param {i}: |TIDE - stock| exceeds the reduction "
                                             f"bound by up to {excess.max().item()}")


@pytest.mark.parametrize("reshard", [True, False], ids=["resharded", "kept"])
@pytest.mark.parametrize("world", [2, 3])
def test_gradient_penalty_thread_ranks(world, reshard):
    results = threaded_world.run(world, lambda rank: penalty_rank(rank, world, torch.device("cpu"), reshard))
    check_penalty(results, world, reshard)


@pytest.mark.parametrize("device_type", ["cpu", pytest.param("cuda", marks=gpu)])
@pytest.mark.parametrize("reshard", [True, False], ids=["resharded", "kept"])
@pytest.mark.parametrize("world", [2, 3])
def test_gradient_penalty_process_ranks(world, reshard, device_type):
    check_penalty(h.run_processes(world, penalty_rank, reshard, device_type=device_type), world, reshard)


# --- a user's view of an unsharded param, kept across a reshard --------------------------------------

def _kept_view(model, device, world, rank) -> dict:
    kept, seen = {}, {}

    def keep(module, args, output):  # the unsharded weight, as user code in a forward sees it
        if "view" not in kept:
            kept["view"] = module.weight.detach()
        else:
            seen["same_data"] = torch.equal(kept["view"], module.weight)

    handle = model.blocks[0].a.register_forward_hook(keep)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = inputs(world)[rank * BATCH:(rank + 1) * BATCH].to(device)
    model(x).sum().backward()
    opt.step()
    view = kept["view"]
    out = {"nbytes": view.untyped_storage().nbytes()}
    try:
        out["row"] = view[0].cpu()  # a use of the resharded param: a view of its storage
    except RuntimeError as e:
        out["error"] = (type(e).__name__, str(e))
    model(x).sum().backward()  # gathered again: the kept view shows the group's new params
    handle.remove()
    out["same_data"] = seen["same_data"]
    out["now"] = model.blocks[0].a.weight.to_local().detach().cpu()
    return out


def view_rank(rank, world, device):
    stock = _kept_view(build(device), device, world, rank)
    model = build(device)
    handle = tide.fsdp.enable(model, timeout_ms=30000)
    mine = _kept_view(model, device, world, rank)
    mine.update(buckets=len(handle.buckets), counts=handle.counts(), windows=sum(len(p.windows) for p in handle.pools))
    tide.fsdp.disable(model)
    return stock, mine


def check_view(results):
    for rank, (stock, mine) in enumerate(results):
        assert mine["buckets"] == GROUPS and mine["windows"] < GROUPS and mine["counts"]["remaps"] > 0, mine
        assert stock["nbytes"] == 0 and "storage of size 0" in stock["error"][1], stock
        assert mine["nbytes"] == 0, f"rank {rank}: the resharded param still views {mine['nbytes']} B of window"
        assert "row" not in mine, f"rank {rank}: a resharded param's view read {mine['row']}"
        assert mine["error"] == stock["error"], (mine["error"], stock["error"])
        assert stock["same_data"] and mine["same_data"], (stock["same_data"], mine["same_data"])
        assert torch.equal(mine["now"], stock["now"])


needs_swap = pytest.mark.skipif(not SWAP, reason=(
    "this torch has no UntypedStorage._swap_data_ptr_: TIDE guards autograd's saved tensors only, "
    "a view read directly after a reshard is not caught (docs/ARCHITECTURE.md)"))


@needs_swap
def test_kept_view_thread_ranks():
    check_view(threaded_world.run(2, lambda rank: view_rank(rank, 2, torch.device("cpu"))))


@needs_swap
@pytest.mark.parametrize("device_type", ["cpu", pytest.param("cuda", marks=gpu)])
def test_kept_view_process_ranks(device_type):
    check_view(h.run_processes(2, view_rank, device_type=device_type))


# --- teardown while the backward's kernels are still queued -------------------------------------------

def queued_teardown_rank(rank, world, device):
    """A backward whose last kernels (block 0's, reading its group's fixed address) sit behind a
    sleep on the GPU when the host disables TIDE and drops its handle: the teardown must wait for
    them, not unmap the addresses under them (an illegal address, seen after a backward that raised)."""
    import gc
    import weakref

    x = inputs(world)[rank * BATCH:(rank + 1) * BATCH].to(device)
    stock = build(device)
    stock(x).sum().backward()
    model = build(device)
    handle = tide.fsdp.enable(model, timeout_ms=30000)

    def queue_behind_a_sleep(module, args, out):  # block 0's backward kernels wait ~0.5 s on the GPU
        out.register_hook(lambda grad: (torch.cuda._sleep(1 << 30), grad)[1])

    sleep = model.blocks[0].register_forward_hook(queue_behind_a_sleep)
    model(x).sum().backward()
    sleep.remove()
    queued = not torch.cuda.current_stream(device).query()  # the teardown below races the GPU
    leases = [weakref.ref(b.lease) for b in handle.buckets]
    tide.fsdp.disable(model)
    del handle
    gc.collect()
    freed = all(lease() is None for lease in leases)  # their address ranges were destroyed
    torch.cuda.synchronize(device)
    return {"queued": queued, "freed": freed,
            "equal": all(torch.equal(a.grad.to_local().cpu(), b.grad.to_local().cpu())
                         for a, b in zip(model.parameters(), stock.parameters()))}


@gpu
def test_cuda_teardown_waits_for_queued_readers_of_the_fixed_addresses():
    for rank, r in enumerate(h.run_processes(2, queued_teardown_rank, device_type="cuda")):
        assert isinstance(r, dict), f"rank {rank}: {r}"
        assert r["queued"], f"rank {rank}: the GPU was idle at the teardown, which then raced nothing"
        assert r["freed"], f"rank {rank}: the buckets' leases (their address ranges) outlived the teardown"
        assert r["equal"], f"rank {rank}: gradients differ from stock's (bitwise at W = 2)"
