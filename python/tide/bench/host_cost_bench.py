"""tide-bench host-cost: the host (CPU) time a training step spends in FSDP2's communication path,
stock vs TIDE, with a model whose compute is tiny (issue 18: TIDE's hooks, planning lookups and
binding calls must cost no more than stock FSDP2's own copy-in / copy-out / collective launches).

Each rank trains the same model of `layers` FSDP2 param groups (`linears` small Linear layers
each, two params apiece: `--linears 192` makes 384-param groups, a mixture-of-experts layer's
experts as modules; the root holds no parameters of its own) twice:
- stock: FSDP2 over a "fake" process group (torch's no-op backend: every collective returns at
  once), so the figure is FSDP2's own host work per step with collectives that cost nothing, a
  lower bound on stock's host cost (a real NCCL launch adds ~5-10 us per collective);
- TIDE: tide.fsdp over the real group (CUDA executor: copies and flags are enqueued, not waited on).
The host time of a step is forward + backward up to the last enqueued operation (the GPU is
synchronized after each step, outside the timed region). Reported: medians over the timed steps,
per step and per param group (divided by the groups: each is gathered twice and reduced once).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

DIM = 64


class _Block(nn.Module):
    def __init__(self, linears: int):
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(linears))

    def forward(self, x):
        for linear in self.linears:
            x = x + linear(torch.relu(x))
        return x


def _model(layers: int, linears: int, device, mesh):
    torch.manual_seed(0)
    model = nn.Sequential(*[_Block(linears) for _ in range(layers)]).to(device)
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _host_ms(model, device, steps: int, warmup: int, after_warmup=lambda: None) -> list:
    x = torch.randn(8, DIM, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda _device: None
    times = []
    for i in range(warmup + steps):
        if i == warmup:
            after_warmup()
        sync(device)
        dist.barrier()
        start = time.perf_counter()
        model(x).sum().backward()
        host = time.perf_counter() - start
        sync(device)
        if i >= warmup:
            times.append(1000.0 * host)
    return times


def run_host_cost(rank: int, world: int, opts: dict) -> dict:
    """One rank's figures. `opts["device"]` "cuda" (what tide-bench runs) or "cpu" (the tests run
    the same code there; its times do not mean what the GPU's do, see the CLI)."""
    import tide.fsdp
    from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401 - registers "fake"

    kind = opts.get("device", "cuda")
    device = torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")
    fake = dist.new_group(list(range(world)), backend="fake")
    stock = _host_ms(_model(opts["layers"], opts.get("linears", 2), device, DeviceMesh.from_group(fake, kind)), device,
                     opts["steps"], opts["warmup"])
    model = _model(opts["layers"], opts.get("linears", 2), device, DeviceMesh.from_group(dist.group.WORLD, kind))
    handle = tide.fsdp.enable(model)
    mine = _host_ms(model, device, opts["steps"], opts["warmup"], handle.reset_counts)
    counts = handle.counts()
    tide.fsdp.disable(model)
    groups = len(handle.buckets) + len(handle.fallbacks)  # the blocks' (the root holds no params)
    if handle.fallbacks or groups != opts["layers"]:
        raise RuntimeError(f"tide-bench host-cost: TIDE handled {len(handle.buckets)} of {groups} param "
                           f"groups (fallbacks: {handle.fallbacks}); the TIDE column would be stock")
    return {"groups": groups, "linears": opts.get("linears", 2), "stock_ms": statistics.median(stock), "tide_ms": statistics.median(mine),
            "tide_all_gathers": counts["all_gathers"], "tide_remaps": counts["remaps"],
            "steps": opts["steps"]}
