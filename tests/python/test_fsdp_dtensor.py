"""tide.fsdp with DTensor parameters (issue 19): FSDP2 shards a DTensor parameter over its FSDP mesh
dimension and all-gathers / reduce-scatters the *local* tensors; TIDE's layout applies to those,
and the unsharded parameter is the DTensor stock FSDP2 builds, over TIDE's window. Ranks are
threads of one process (CPU, the "threaded" backend). Each case trains the same model with stock
FSDP2 and with TIDE, asserts TIDE handled every group (no fallback, its collectives counted, no
FSDP2 layout copy ran) and compares: with FSDP degree 2 every reduction TIDE does is a sum of two
numbers, so the parameters must be bitwise equal."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import fsdp_harness as h

DIM, HEADS, HIDDEN, VOCAB = 32, 4, 64, 48
_construct = threading.Lock()  # torch's global RNG: one thread-rank builds its model at a time
_meshes = threading.local()


class TPBlock(nn.Module):
    """A Llama-style block written for tensor parallelism: heads are counted from the local
    projection (Colwise q/k/v/gate/up, Rowwise o/down), so it runs with and without TP."""

    def __init__(self):
        super().__init__()
        self.attn_norm, self.mlp_norm = h.RMSNorm(DIM), h.RMSNorm(DIM)
        self.q, self.k, self.v = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.o = nn.Linear(DIM, DIM, bias=False)
        self.gate, self.up = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(DIM, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        hd = DIM // HEADS
        n = self.attn_norm(x)
        q, k, v = (p(n).view(b, s, -1, hd).transpose(1, 2) for p in (self.q, self.k, self.v))
        # Attention written out (no mask): DTensor has no CPU SDPA sharding rule.
        att = torch.softmax(q @ k.transpose(-1, -2) * hd ** -0.5, dim=-1) @ v
        att = att.transpose(1, 2).reshape(b, s, -1)
        x = x + self.o(att)
        n = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(n)) * self.up(n))


class TPModel(nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(TPBlock() for _ in range(layers))
        self.norm = h.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        weight = self.embed.weight
        if isinstance(weight, DTensor):  # full-DTensor mode: every input a DTensor on the mesh too
            tokens = DTensor.from_local(tokens, weight.device_mesh, [Replicate()] * weight.device_mesh.ndim)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x)).float()
        return logits.to_local() if isinstance(logits, DTensor) else logits


TP_PLAN = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
           "o": RowwiseParallel(), "gate": ColwiseParallel(), "up": ColwiseParallel(),
           "down": RowwiseParallel()}


def seeded_model():
    with _construct:
        torch.manual_seed(0)
        return TPModel()


def tp_fsdp():
    """TP = 2 x FSDP = 2: blocks tensor-parallel over "tp", every module sharded over "dp"."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = seeded_model()
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], TP_PLAN)
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def hsdp_tp():
    """HSDP 2 (replicate) x 2 (shard) x TP 2: W = 8."""
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
    model = seeded_model()
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], TP_PLAN)
        fully_shard(block, mesh=mesh["replicate", "shard"])
    fully_shard(model, mesh=mesh["replicate", "shard"])
    return model


def full_mesh_dtensor():
    """Every parameter a DTensor replicated over one mesh of four ranks, FSDP2 told which of its
    dims it shards over (``dp_mesh_dims``), as torchtitan's full-DTensor mode builds models: FSDP
    over "dp", the parameters replicated over the other dimension."""
    from torch.distributed.fsdp import DataParallelMeshDims

    if not hasattr(_meshes, "full"):
        # One mesh per rank for both builds: DTensor caches specs by mesh equality, so a second,
        # equal mesh would give the parameters the first one, and fully_shard would refuse them.
        _meshes.full = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    mesh = _meshes.full
    model = seeded_model()
    for name, param in list(model.named_parameters()):
        owner_name, _, attr = name.rpartition(".")
        dt = distribute_tensor(param.detach(), mesh, [Replicate(), Replicate()])
        setattr(model.get_submodule(owner_name), attr, nn.Parameter(dt))
    dims = DataParallelMeshDims(shard="dp")
    for block in model.blocks:
        fully_shard(block, mesh=mesh, dp_mesh_dims=dims)
    fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    return model


def train(model, steps=2):
    gen = torch.Generator().manual_seed(7)  # the same tokens on every rank: TP ranks share a batch
    counter = h.OpCounter()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with counter:
        for _ in range(steps):
            tokens = torch.randint(0, VOCAB, (2, 8), generator=gen)
            loss = F.cross_entropy(model(tokens).view(-1, VOCAB), tokens.roll(-1, 1).view(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
    params = [p.to_local().detach().clone() if isinstance(p, DTensor) else p.detach().clone()
              for p in model.parameters()]
    return params, counter.counts


def params_are_dtensors(model, handle):
    assert any(isinstance(p, DTensor) for p in model.parameters())


def test_tensor_parallel_2_by_fsdp_2():
    h.compare(4, tp_fsdp, train, groups=3, before_train=params_are_dtensors)


def test_hsdp_2_by_2_by_tensor_parallel_2():
    h.compare(8, hsdp_tp, train, groups=3, before_train=params_are_dtensors)


def test_dtensor_on_the_full_mesh():
    if not hasattr(torch.distributed.fsdp, "DataParallelMeshDims"):
        pytest.skip(f"torch {torch.__version__} has no DataParallelMeshDims (full-mesh DTensor FSDP2)")
    h.compare(4, full_mesh_dtensor, train, groups=3, before_train=params_are_dtensors)
