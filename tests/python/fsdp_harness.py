"""A small Llama-style model trained under FSDP2 with TIDE on and off, ranks as spawned processes
(on CPU, or sharing CUDA devices: several ranks per GPU, gloo as FSDP2's process group).

Each scenario trains the same model from the same seed three times, in step: stock FSDP2, TIDE,
TIDE again (run_scenario). The worker reports, per scenario, the gradient and parameter
differences against stock each step and their largest share of the reduction's bound, whether the
two TIDE runs were bitwise identical, the FSDP2 layout-conversion ops that ran (counted with a
TorchDispatchMode), the pooled windows and the fallbacks.

compare() does the same side by side on thread-ranks (threaded_world.py), for the tests that train
their own models there.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import threaded_world
import tide
import tide.fsdp
from tide.bench.launch import exit_rank, join_world, rendezvous
from rounding import BF16_UNIT_ROUNDOFF, FP32_UNIT_ROUNDOFF, reduction_bound_scale

DIM, HEADS, KV_HEADS, HIDDEN, VOCAB = 32, 4, 2, 88, 67  # 88 and 67: dim 0 not divisible by 3 or 4


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) + 0.1 * torch.randn(dim))

    def forward(self, x):
        # In the activations' dtype, as Llama's norm: an fp32 weight beside bf16 activations
        # (per-param mixed precision) would otherwise promote the next layer's input.
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight).to(x.dtype)


class Block(nn.Module):
    def __init__(self, checkpointed: bool):
        super().__init__()
        hd = DIM // HEADS
        self.attn_norm, self.mlp_norm = RMSNorm(DIM), RMSNorm(DIM)
        self.q = nn.Linear(DIM, DIM, bias=False)
        self.k = nn.Linear(DIM, KV_HEADS * hd, bias=False)
        self.v = nn.Linear(DIM, KV_HEADS * hd, bias=False)
        self.o = nn.Linear(DIM, DIM, bias=False)
        self.gate = nn.Linear(DIM, HIDDEN, bias=False)
        self.up = nn.Linear(DIM, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)
        self.mix = nn.Parameter(1 + 0.1 * torch.randn(2, DIM))  # d0 = 2 < W for W = 3, 4
        self.checkpointed = checkpointed

    def _forward(self, x):
        b, s, _ = x.shape
        hd = DIM // HEADS
        h = self.attn_norm(x)
        q = self.q(h).view(b, s, HEADS, hd).transpose(1, 2)
        k = self.k(h).view(b, s, KV_HEADS, hd).transpose(1, 2).repeat_interleave(HEADS // KV_HEADS, 1)
        v = self.v(h).view(b, s, KV_HEADS, hd).transpose(1, 2).repeat_interleave(HEADS // KV_HEADS, 1)
        # A weight used through a view (w.T) as well: autograd saves the view, which must stay valid.
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, DIM)
        x = x * self.mix[0] + att @ self.o.weight.T
        h = self.mlp_norm(x)
        return x * self.mix[1] + self.down(F.silu(self.gate(h)) * self.up(h))

    def forward(self, x):
        if self.checkpointed:
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


class TinyLlama(nn.Module):
    def __init__(self, layers=5, tied=False, checkpointed=False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(checkpointed) for _ in range(layers))
        self.norm = RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)).float()


SCENARIOS = {
    # name: (world sizes it runs at, options)
    "fp32": ((2, 3, 4), {}),
    "bf16_params_fp32_reduce": ((2, 3, 4), {"mp": (torch.bfloat16, torch.float32)}),
    "bf16_params_bf16_reduce": ((2, 3), {"mp": (torch.bfloat16, torch.bfloat16)}),
    "no_reshard_after_forward": ((2, 3), {"reshard": False}),
    "reshard_after_forward_int": ((4,), {"reshard": 2}),
    "explicit_prefetch": ((2, 3), {"prefetch": True}),
    "activation_checkpointing": ((2, 3), {"checkpointed": True}),
    "gradient_accumulation": ((2, 3), {"accumulate": 2}),
    "gradient_accumulation_bf16": ((2,), {"accumulate": 2, "mp": (torch.bfloat16, torch.float32)}),
    # gloo has no PREMUL_SUM: the stock reference for a divide factor sums and post-divides.
    "sum_reduction": ((2, 3), {"divide_factor": 1.0, "stock": {"force_sum": True}}),
    "custom_divide_factor": ((2, 3), {"divide_factor": 5.0, "stock": {"force_sum": True},
                                      "inexact": "x*(1/5) summed vs (sum x)/5"}),
    "force_sum_reduction": ((2,), {"force_sum": True}),
    "tied_embeddings": ((2, 3), {"tied": True}),
    "hsdp_2x2": ((4,), {"hsdp": True}),
    # Sharded params and gradients in host memory (pinned on CUDA): TIDE gathers from there.
    "cpu_offload": ((2, 3), {"offload": True}),
    "cpu_offload_bf16": ((2,), {"offload": True, "mp": (torch.bfloat16, torch.float32)}),
    # A process-group object per layer over the same ranks (as FSDP2 can make): pools still shared.
    "group_per_layer": ((2, 3), {"group_per_layer": True}),
    # Virtual nodes: across-node programs between nodes of ranks_per_node ranks (CUDA: over IPC).
    "virtual_nodes": ((2, 3, 4), {"ranks_per_node": 1, "net": 256}),
    "virtual_nodes_2x2": ((4,), {"ranks_per_node": 2, "net": 512}),
    "virtual_nodes_bf16": ((4,), {"ranks_per_node": 2, "net": 512, "mp": (torch.bfloat16, torch.float32)}),
    # bf16 partial sums between the nodes (AcrossNodesOptions.wire_dtype): lossy, within tolerance of stock.
    "virtual_nodes_bf16_wire": ((4,), {"ranks_per_node": 2, "net": 512, "wire": "bf16"}),
    # NCCL between the nodes: with one GPU per rank it runs (CUDA on several GPUs); ranks sharing a
    # GPU (NCCL refuses them) and CPU (its network is the host transport) fall back.
    "nccl_network": ((2,), {"ranks_per_node": 1, "net": 4096, "network": "nccl"}),
    # Nodes from the launcher: LOCAL_WORLD_SIZE (as torchrun sets it) instead of ranks_per_node.
    "launcher_nodes": ((4,), {"ranks_per_node": 2, "from_env": True, "net": 1024}),
    # Nodes of 3 ranks at W = 4: 3 + 1 ranks, not a nodes x local grid: every group falls back.
    "uneven_nodes": ((4,), {"ranks_per_node": 3, "net": 512}),
}

COUNTED_OPS = ("split_with_sizes_copy", "chunk_cat", "all_gather_copy_in")


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = {name: 0 for name in COUNTED_OPS}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        for op in COUNTED_OPS:
            if op in name:
                self.counts[op] += 1
        return func(*args, **(kwargs or {}))


def build(opts, world, device):
    torch.manual_seed(0)  # initialised on CPU: the same weights on every device
    model = TinyLlama(tied=opts.get("tied", False), checkpointed=opts.get("checkpointed", False)).to(device)
    kwargs = {}
    if "mp" in opts:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=opts["mp"][0], reduce_dtype=opts["mp"][1])
    if "reshard" in opts:
        kwargs["reshard_after_forward"] = opts["reshard"]
    if opts.get("offload"):
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    if opts.get("hsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        kwargs["mesh"] = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("replicate", "shard"))
    for module in [*model.blocks, model]:  # blocks, then the root
        if opts.get("group_per_layer"):
            from torch.distributed.device_mesh import DeviceMesh
            kwargs["mesh"] = DeviceMesh.from_group(dist.new_group(list(range(world))), device.type)
        fully_shard(module, **kwargs)
    if opts.get("prefetch"):
        blocks = list(model.blocks)
        for i, block in enumerate(blocks):
            if i + 1 < len(blocks):
                block.set_modules_to_forward_prefetch([blocks[i + 1]])
            if i > 0:
                block.set_modules_to_backward_prefetch([blocks[i - 1]])
    for module in [*model.blocks, model]:  # these setters are per FSDP module, not recursive
        if "divide_factor" in opts:
            module.set_gradient_divide_factor(opts["divide_factor"])
        if opts.get("force_sum"):
            module.set_force_sum_reduction_for_comms(True)
    return model


LR = 0.05


def _enable(model, opts):
    kwargs = {}
    if "ranks_per_node" in opts:  # small network chunks: many network steps per bucket
        kwargs = {"ranks_per_node": opts["ranks_per_node"],
                  "across_nodes": tide.AcrossNodesOptions(chunk_bytes=opts["net"], max_chunks_in_flight=2, ring_depth=2,
                                                          wire_dtype=getattr(tide.DType, opts.get("wire", "fp32"))),
                  "transport": opts.get("network", "auto")}
    launcher = os.environ.pop("LOCAL_WORLD_SIZE", None)
    if opts.get("from_env"):  # the launcher's LOCAL_WORLD_SIZE stands for ranks_per_node
        os.environ["LOCAL_WORLD_SIZE"] = str(kwargs.pop("ranks_per_node"))
    try:
        return tide.fsdp.enable(model, **kwargs)
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
        if launcher is not None:
            os.environ["LOCAL_WORLD_SIZE"] = launcher


def _loss(model, tokens):
    return F.cross_entropy(model(tokens).view(-1, VOCAB), tokens.roll(-1, 1).view(-1))


def _backward(model, batches, counter):
    with counter:
        for m, tokens in enumerate(batches):
            model.set_requires_gradient_sync(m == len(batches) - 1)
            _loss(model, tokens).backward()


def _local(tensors) -> list:
    return [t.to_local().detach().cpu().clone() for t in tensors]


def _full_tensor(sp) -> torch.Tensor:
    """sp.full_tensor(), gathered through host memory: on CUDA tensors over gloo (ranks sharing a
    GPU), full_tensor()'s functional all-gather ends the process with SIGSEGV (torch 2.11). FSDP2's
    shard on its last mesh dim is torch.chunk's, on the placement's dim (uneven: padded here)."""
    dim, group = sp.placements[-1].dim, sp.device_mesh.get_group(-1)
    world, full = dist.get_world_size(group), sp.shape[dim]
    sizes = [len(c) for c in torch.arange(full).chunk(world)] + [0] * world
    rows = -(-full // world)
    local = sp.to_local().detach().cpu()
    pad = list(local.shape)
    pad[dim] = rows - local.shape[dim]
    padded = torch.cat([local, local.new_zeros(pad)], dim)
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p.narrow(dim, 0, sizes[r]) for r, p in enumerate(parts)], dim).to(sp.device)


def reduction_bounds(stock, mirror, opts, world, device, batches) -> list:
    """Per element of this rank's gradient shards, how far stock's and TIDE's reductions of the
    ranks' gradients g_r may differ (rounding.reduction_bound_scale times sum_r |g_r|), with u the
    reduce dtype's unit roundoff (bf16's where the reduce dtype or the partial sums between nodes
    are bf16: each such rounding is one of the bound's). sum_r |g_r| comes from `mirror`, the model
    unsharded with `stock`'s parameters now, on this rank's micro-batches (|g| of each summed: at
    least |their sum|)."""
    with torch.no_grad():
        for unsharded, sp in zip(mirror.parameters(), stock.parameters()):
            unsharded.copy_(_full_tensor(sp))
    compute = mirror.to(opts["mp"][0]) if "mp" in opts else mirror
    magnitude = [torch.zeros(p.shape, dtype=torch.float32, device=device) for p in compute.parameters()]
    for tokens in batches:
        compute.zero_grad()
        _loss(compute, tokens).backward()
        for total, p in zip(magnitude, compute.parameters()):
            total += p.grad.float().abs()
    mirror.float()
    for total in magnitude:
        dist.all_reduce(total)
    bf16 = opts.get("mp", (None, None))[1] == torch.bfloat16 or opts.get("wire") == "bf16"
    u = BF16_UNIT_ROUNDOFF if bf16 else FP32_UNIT_ROUNDOFF
    scale = reduction_bound_scale(world, opts.get("divide_factor") or world, u)
    return [distribute_tensor(scale * total, sp.device_mesh, sp.placements, src_data_rank=None)
            .to_local().cpu() for total, sp in zip(magnitude, stock.parameters())]


def _ratio(diff: torch.Tensor, bound: torch.Tensor) -> float:
    """The largest diff / bound (<= 1: within the bound); a difference where the bound is 0 is inf."""
    return torch.where(bound > 0, diff / bound, torch.where(diff > 0, float("inf"), 0.0)).max().item()


def run_scenario(opts, world, device, steps=3):
    """Stock FSDP2 and two TIDE runs of the same model, in step: each step every model takes the
    same micro-batches, and the step's gradients (one reduction) and updated parameters of TIDE's
    runs are compared with stock's, before TIDE's runs take stock's parameters for the next step.
    So a difference cannot grow over steps: the comparison stays within the one reduction's bound
    (reduction_bounds; at W = 2 bitwise), plus the update's own rounding for the parameters."""
    stock_opts = {**opts, **opts.get("stock", {})}
    stock = build(stock_opts, world, device)
    torch.manual_seed(0)
    mirror = TinyLlama(tied=opts.get("tied", False), checkpointed=opts.get("checkpointed", False)).to(device)
    runs = [build(opts, world, device) for _ in range(2)]
    handles = [_enable(model, opts) for model in runs]
    counters = [OpCounter() for _ in range(3)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=LR) for m in (stock, *runs)]
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    bitwise, reproducible, max_diff, max_ratio = True, True, 0.0, 0.0
    try:
        for _ in range(steps):
            batches = [torch.randint(0, VOCAB, (2, 8), generator=gen).to(device)
                       for _ in range(opts.get("accumulate", 1))]
            bounds = reduction_bounds(stock, mirror, opts, world, device, batches)
            grads, params = [], []
            for model, opt, counter in zip((stock, *runs), optimizers, counters):
                _backward(model, batches, counter)
                grads.append(_local(p.grad for p in model.parameters()))
                opt.step()
                opt.zero_grad()
                params.append(_local(model.parameters()))
            (stock_grads, *tide_grads), (stock_params, *tide_params) = grads, params
            reproducible &= all(map(torch.equal, *tide_grads)) and all(map(torch.equal, *tide_params))
            for got, want, bound, p_got, p_want in zip(tide_grads[0], stock_grads, bounds,
                                                       tide_params[0], stock_params):
                bitwise &= torch.equal(got, want) and torch.equal(p_got, p_want)
                if not got.numel():
                    continue
                diff = (got.double() - want.double()).abs()
                # SGD's update p - lr g from the same p: lr g rounds (u of it, unless fused) and so
                # does the result (u of it), on each side; lr is fl(0.05) on both.
                u = FP32_UNIT_ROUNDOFF
                update = (LR * (1 + u) * (bound.double() + u * (got.double().abs() + want.double().abs()))
                          + u * (p_got.double().abs() + p_want.double().abs()))
                p_diff = (p_got.double() - p_want.double()).abs()
                max_diff = max(max_diff, diff.max().item(), p_diff.max().item())
                max_ratio = max(max_ratio, _ratio(diff, bound.double()), _ratio(p_diff, update))
            with torch.no_grad():  # the next step starts from stock's parameters on every run
                for model in runs:
                    for p, sp in zip(model.parameters(), stock.parameters()):
                        p.to_local().copy_(sp.to_local())
    finally:
        for model in runs:
            tide.fsdp.disable(model)
    handle = handles[0]
    return {
        "bitwise_vs_stock": bitwise,
        "max_abs_diff": max_diff,
        "max_ratio": max_ratio,
        "reproducible": reproducible,
        "stock_ops": counters[0].counts,
        "tide_ops": counters[1].counts,
        "buckets": len(handle.buckets),
        "fallbacks": [reason for _, reason in handle.fallbacks],
        "pooled_windows": sum(len(p.windows) for p in handle.pools),
        "pools": len(handle.pools),
        "wide_windows": sum(len(w.windows) for p in handle.pools for w in p.sized.values()
                            if w.window_bytes > p.window_bytes),
        "param_groups": len(handle.buckets) + len(handle.fallbacks),
        "nodes": sorted({b.layout.topology.nodes for b in handle.buckets}),
        "transports": sorted({str(p.transport) for p in handle.pools}),
        "ranks_share_gpus": device.type == "cuda" and world > torch.cuda.device_count(),
        "device_type": device.type,
    }


def _worker(rank, world, port, names, out_dir, device_type):
    device = torch.device("cpu")
    if device_type == "cuda":  # ranks share the GPUs; NCCL refuses that, gloo does not
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        # Bitwise comparisons need run-to-run identical compute (cuBLAS workspaces, no atomics).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    join_world(port, rank, world, "gloo")
    results = {}
    try:
        for name in names:
            try:
                results[name] = run_scenario(SCENARIOS[name][1], world, device)
            except Exception as e:  # noqa: BLE001 - reported to the test
                results[name] = {"error": f"{type(e).__name__}: {e}"}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        exit_rank()
    finally:  # reached on an error only
        dist.destroy_process_group()


def run_world(world: int, device_type: str = "cpu") -> dict:
    """Runs every scenario that applies to `world` on `device_type` ("cpu" or "cuda"); returns
    {scenario: [result per rank]}."""
    names = [n for n, (worlds, opts) in SCENARIOS.items() if world in worlds]
    with tempfile.TemporaryDirectory() as out_dir, rendezvous() as port:
        mp.start_processes(_worker, args=(world, port, names, out_dir, device_type), nprocs=world,
                           join=True, start_method="spawn")
        per_rank = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]
    return {n: [per_rank[r][n] for r in range(world)] for n in names}


# --- thread-ranks: stock FSDP2 and TIDE side by side ----------------------------------------------

def assert_handled(handle, ops, groups):
    """TIDE took all `groups` groups (no fallback), counted its collectives, and none of the copies
    `ops` counts (FSDP2's layout copies, by op name) ran."""
    assert len(handle.buckets) == groups and handle.fallbacks == [], (handle, handle.fallbacks)
    counts = handle.counts()
    assert counts["all_gathers"] > 0 and counts["reduce_scatters"] > 0, counts
    assert not any(ops.values()), f"TIDE ran layout copies {ops}"


def compare(world, build, train, groups, before_train=None, stock_copy="chunk_cat"):
    """Stock FSDP2 vs TIDE on `world` thread-ranks: each rank trains build() with train(model) ->
    (params, counts of the copies), once stock and once with TIDE (before_train(model, handle)
    between enable and training), and asserts that the counter saw stock run `stock_copy`, that
    TIDE handled the model (assert_handled) and that its parameters are bitwise stock's. They are
    at any W whose divisions by a group's size are exact (W a power of two): the threaded backend
    reduces the ranks' gradients in rank order, as TIDE does, and divides the sum by the group's
    size where TIDE multiplies it by 1/size, the same for a power of two. Returns per rank
    (max |TIDE - stock|, handle, TIDE's counts)."""

    def rank_fn(rank):
        stock, stock_ops = train(build())
        model = build()
        handle = tide.fsdp.enable(model, timeout_ms=30000)
        if before_train:
            before_train(model, handle)
        try:
            mine, ops = train(model)
        finally:
            tide.fsdp.disable(model)
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(mine, stock) if a.numel())
        return diff, handle, stock_ops, ops

    results = threaded_world.run(world, rank_fn)
    for rank, (diff, handle, stock_ops, ops) in enumerate(results):
        assert stock_ops[stock_copy] > 0, f"rank {rank}: the counter sees no {stock_copy} of stock's: {stock_ops}"
        assert_handled(handle, ops, groups)
        assert diff == 0, f"rank {rank}: not bitwise equal to stock FSDP2 (max |TIDE - stock| = {diff})"
    return [(diff, handle, ops) for diff, handle, _, ops in results]


# --- any function on ranks as spawned processes ------------------------------------------------------

def _fn_worker(rank, world, port, fn, args, out_dir, device_type):
    device = torch.device("cpu")
    if device_type == "cuda":  # ranks share the GPUs; NCCL refuses that, gloo does not
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    join_world(port, rank, world, "gloo")
    try:
        torch.save(fn(rank, world, device, *args), os.path.join(out_dir, f"rank{rank}.pt"))
        exit_rank()
    finally:  # reached on an error only
        dist.destroy_process_group()


def run_processes(world: int, fn, *args, device_type: str = "cpu") -> list:
    """fn(rank, world, device, *args) on `world` spawned processes (gloo; on CUDA the ranks share the
    GPUs); returns the results in rank order. `fn` must be importable (a module-level function) and
    return what torch.save can store (an exception as its text)."""
    with tempfile.TemporaryDirectory() as out_dir, rendezvous() as port:
        mp.start_processes(_fn_worker, args=(world, port, fn, args, out_dir, device_type),
                           nprocs=world, join=True, start_method="spawn")
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]
