"""tide.fsdp with params sharded on dims > 0 (FSDP2's shard_placement_fn, as torchtitan shards MoE
experts when the FSDP degree exceeds the expert count), ranks as threads of one process
(threaded_world.py). TIDE must take those groups (no fallback), gather each rank's block straight
into place and reduce-scatter the gradients' blocks where they lie: none of FSDP2's layout copies
runs, nor the chunk + cat that stock does for dims > 0 in its copy-out and before its reduce-scatter.
Parameters must be bitwise stock's at W = 2 and 4 (fsdp_harness.compare says why)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp_harness as h
import threaded_world
import tide.fsdp
from test_fsdp_conformance import params_of, step

_construct = threading.Lock()  # torch's global RNG: one thread-rank builds its model at a time

# FSDP2's layout copies, and aten.cat: stock's copy-out and gradient chunk-cat for dims > 0 (the
# models below use no cat of their own).
COPIES = ("split_with_sizes_copy", "chunk_cat", "all_gather_copy_in", "aten.cat")


class CopyCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = dict.fromkeys(COPIES, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for op in COPIES:
            if op in str(func):
                self.counts[op] += 1
        return func(*args, **(kwargs or {}))


class Experts(nn.Module):
    """Grouped experts as torchtitan holds them: w1 [E, dim, hidden], w2 [E, hidden, dim]."""

    def __init__(self, experts, dim, hidden):
        super().__init__()
        self.w1 = nn.Parameter(0.2 * torch.randn(experts, dim, hidden))
        self.w2 = nn.Parameter(0.2 * torch.randn(experts, hidden, dim))

    def forward(self, x):  # x: [E, tokens, dim]
        return x + torch.bmm(F.silu(torch.bmm(x, self.w1)), self.w2)


class TinyMoE(nn.Module):
    """Two experts (the batch rows of make()'s tokens), so W = 4 ranks exceed the expert count."""

    def __init__(self, layers=2, dim=8, hidden=16):
        super().__init__()
        self.embed = nn.Embedding(h.VOCAB, dim)
        self.layers = nn.ModuleList(Experts(2, dim, hidden) for _ in range(layers))
        self.head = nn.Linear(dim, h.VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x).float()


def make_moe(w1_dim=2):
    """Experts sharded on their hidden dim (w1 on dim 2, w2 on dim 1), embed and head on dim 0."""
    with _construct:
        torch.manual_seed(0)
        model = TinyMoE()
    for layer in model.layers:
        placements = {id(layer.w1): Shard(w1_dim), id(layer.w2): Shard(1)}
        fully_shard(layer, shard_placement_fn=lambda p, placements=placements: placements.get(id(p)))
    fully_shard(model)
    return model


def make_llama_dim1():
    """make()'s Llama with every matrix sharded on dim 1 (vectors stay on dim 0)."""
    with _construct:
        torch.manual_seed(0)
        model = h.TinyLlama(layers=3)
    on_dim1 = dict(shard_placement_fn=lambda p: Shard(1) if p.ndim > 1 else None)
    for block in model.blocks:
        fully_shard(block, **on_dim1)
    fully_shard(model, **on_dim1)
    return model


def train(model, steps=2):
    gen = torch.Generator().manual_seed(100 + torch.distributed.get_rank())
    counter = CopyCounter()
    with counter:
        for _ in range(steps):
            step(model, gen)
    return params_of(model), counter.counts


@pytest.mark.parametrize("world", [2, 4])
def test_grouped_experts_sharded_on_dims_1_and_2(world):
    h.compare(world, make_moe, train, groups=3, stock_copy="aten.cat")


@pytest.mark.parametrize("world", [2, 4])
def test_every_matrix_sharded_on_dim_1(world):
    h.compare(world, make_llama_dim1, train, groups=4, stock_copy="aten.cat")


def test_inner_shard_dims_across_nodes_fall_back_naming_the_param():
    def rank_fn(rank):
        model = make_moe()
        handle = tide.fsdp.enable(model, timeout_ms=30000, ranks_per_node=1)
        tide.fsdp.disable(model)
        return handle

    for handle in threaded_world.run(2, rank_fn):
        reasons = dict(handle.fallbacks)
        assert set(reasons) == {"layers.0", "layers.1"}, handle.fallbacks
        assert "layers.0.w1 is sharded on dim 2 and the group spans nodes" in reasons["layers.0"], reasons
        assert len(handle.buckets) == 1  # the root (dim 0) across two virtual nodes


def test_ranks_that_shard_a_param_on_different_dims_get_desync_error():
    def rank_fn(rank):
        return tide.fsdp.enable(make_moe(w1_dim=2 if rank == 0 else 1), timeout_ms=20000)

    results = threaded_world.run(2, rank_fn, raise_errors=False)
    for rank, r in enumerate(results):
        assert isinstance(r, tide.DesyncError), f"rank {rank}: {r!r}"
        assert "sharded on dim 2 vs layers.0.w1 [2, 8, 16]" in str(r), str(r)
