"""FSDP2's all-gather extensions (fsdp_pre_all_gather / fsdp_post_all_gather) under TIDE, on CPU:
ranks are spawned processes with gloo as FSDP2's process group.

- torchao float8 training with ``enable_fsdp_float8_all_gather=True`` (fp8 all-gather inputs: gloo
  has no fp8, so stock FSDP2 cannot gather a group of float8 weights alone on CPU; TIDE's host
  transport moves the bytes), dynamic and precomputed scales, W = 2 and 3: bitwise equal to the
  same training with fp8 all-gather off (fp32 params: the tensorwise scale is 448 / max|W|, and a
  max is exact however it is reduced);
- torchao's NF4Tensor (QLoRA: frozen NF4 base weights, three inputs of int8 / bf16 / uint8);
- a custom two-input extension on plain tensors (both pre-all-gather signatures), and PyTorch's own
  test subclass TwoTensor with its test's functions, against stock FSDP2.

Each asserts that TIDE handled every group (no fallback, its all-gathers counted) and that none of
FSDP2's layout copies ran. On the code before extensions were handled, every such group fell back.
"""

from __future__ import annotations

import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

import fsdp_harness as h
import tide.fsdp
from tide.fsdp import _fsdp2

try:
    import torchao  # noqa: F401
    HAVE_TORCHAO = True
except ImportError:
    HAVE_TORCHAO = False
needs_torchao = pytest.mark.skipif(not HAVE_TORCHAO, reason="torchao is not installed (pip install torchao)")

DIM, HIDDEN, IN = 48, 96, 16  # multiples of 16 (float8 matmul) and of W = 2, 3 (even shards)


# --- torchao float8 ---------------------------------------------------------------------------------

class Float8Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = h.RMSNorm(DIM)
        self.up, self.down = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x):
        return x + self.down(F.silu(self.up(self.norm(x))))


class Float8Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(IN, DIM, bias=False)
        self.blocks = nn.ModuleList(Float8Block() for _ in range(2))
        self.out = nn.Linear(DIM, IN, bias=False)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def build_float8(fp8_all_gather: bool, only_float8_groups: bool = False, weight_dtype=None, **fsdp_kwargs):
    from torchao.float8 import CastConfig, Float8LinearConfig, convert_to_float8_training
    torch.manual_seed(0)
    model = Float8Model()
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=fp8_all_gather,
                                cast_config_weight=CastConfig(target_dtype=weight_dtype))
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn not in ("inp", "out"))
    for b in model.blocks:
        if only_float8_groups:  # a group of float8 weights alone: all-gathered as fp8
            fully_shard([b.up, b.down], **fsdp_kwargs)
        fully_shard(b, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)
    return model


def train_steps(model, after_step=None, steps=3):
    """SGD on Float8Model's input; after_step(model) after each optimizer step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    counter = h.OpCounter()
    with counter:
        for _ in range(steps):
            model(torch.randn(4, IN, generator=gen)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if after_step is not None:
                after_step(model)
    return [p.to_local().detach().clone() for p in model.parameters()], counter.counts


def train_float8(model, precompute: bool, steps=3):
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
    return train_steps(model, precompute_float8_dynamic_scale_for_fsdp if precompute else None, steps)


def _summary(handle, ops) -> dict:
    gathers = [b.gather for b in handle.buckets if b.gather is not None]
    return {"buckets": len(handle.buckets), "fallbacks": list(handle.fallbacks), "counts": handle.counts(),
            "ops": dict(ops), "extension_buckets": len(gathers),
            # float8 weights whose e4m3 bytes TIDE's cast wrote (no fsdp_pre_all_gather tensor)
            "tide_casts": sum(why == "" for g in gathers for why in g.why_not_cast)}


def _with_tide(model, train, **kwargs):
    handle = tide.fsdp.enable(model, timeout_ms=60000, **kwargs)
    try:
        params, ops = train(model)
    finally:
        tide.fsdp.disable(model)
    return params, _summary(handle, ops)


def _inner(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors a tensor subclass holds (its __tensor_flatten__, recursively): a wrapper
    subclass's torch.equal may compare one of them only, or not be implemented."""
    if not is_traceable_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [x for n in names for x in _inner(getattr(t, n))]


def _equal(a, b) -> bool:
    """Bitwise equal, every inner tensor of a subclass too."""
    return all(torch.equal(x, y) for p, q in zip(a, b) for x, y in zip(_inner(p), _inner(q), strict=True))


def scenario_float8(precompute: bool, only_float8_groups: bool = False, ranks_per_node=None) -> dict:
    def train(m):
        return train_float8(m, precompute)
    nodes = {}
    if ranks_per_node:  # virtual nodes: TIDE's across-node programs, small network chunks
        nodes = {"ranks_per_node": ranks_per_node,
                 "across_nodes": tide.AcrossNodesOptions(chunk_bytes=256, max_chunks_in_flight=2, ring_depth=2)}
    on, tide_on = _with_tide(build_float8(True, only_float8_groups), train, **nodes)
    off, tide_off = _with_tide(build_float8(False, only_float8_groups), train, **nodes)
    stock_off, _ = train(build_float8(False, only_float8_groups))
    return {"tide": tide_on, "tide_off": tide_off, "vs_tide_off": _equal(on, off),
            "vs_stock_off": _equal(on, stock_off)}


def scenario_float8_generic() -> dict:
    """torchao's float8 weights that TIDE does not cast (e5m2 weights): the generic extension path
    (torchao's fsdp_pre_all_gather, its fp8 inputs gathered as bytes), still bitwise equal to stock
    FSDP2 with fp8 all-gather off."""
    on, tide_on = _with_tide(build_float8(True, weight_dtype=torch.float8_e5m2), lambda m: train_float8(m, False))
    stock_off, _ = train_float8(build_float8(False, weight_dtype=torch.float8_e5m2), False)
    return {"tide": tide_on, "vs_stock_off": _equal(on, stock_off)}


def scenario_float8_uneven() -> dict:
    """A float8 weight whose dim 0 (64) W = 3 does not divide: torchao does not pad its fp8 input, so
    the ranks' inputs differ in size; enable must raise DesyncError on every rank (stock FSDP2
    aborts inside its all-gather)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, 64, bias=False), nn.Linear(64, 64, bias=False))
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
                               module_filter_fn=lambda m, fqn: fqn == "1")
    fully_shard(model)
    try:
        tide.fsdp.enable(model, timeout_ms=60000)
        tide.fsdp.disable(model)
        return {"error_text": ""}
    except tide.DesyncError as e:
        return {"error_text": str(e)}


# --- torchao's training subclasses ----------------------------------------------------------------

def _training_config(name: str):
    """torchao's training weight subclasses that run on CPU: prototype quantized training (int8
    mixed precision: fp32 inputs; int8 weight-only: int8 data and a scale; BitNet: 2-bit packed
    data, its scale all-reduced in fsdp_pre_all_gather) and MoE training's float8 rowwise weight
    wrapper (its inputs cast to the param dtype)."""
    from torchao.prototype import quantized_training as qt
    if name == "moe_float8_rowwise":
        from torchao.prototype.moe_training.config import Float8TrainingOpConfig, Float8TrainingRecipe
        return Float8TrainingOpConfig.from_recipe(Float8TrainingRecipe.FP8_ROWWISE)
    return {"int8_mixed_precision": qt.int8_mixed_precision_training, "int8_weight_only":
            qt.int8_weight_only_quantized_training, "bitnet": qt.bitnet_training}[name]()


def build_quantized_training(name: str, model: nn.Module | None = None):
    """`model` (Float8Model by default) with torchao's `name` training weights on the blocks'
    linears (the root's stay plain: one group of plain params), a group per block and the root."""
    from torchao import quantize_
    torch.manual_seed(0)
    model = model or Float8Model()
    quantize_(model, _training_config(name),
              filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and fqn not in ("inp", "out"))
    for b in getattr(model, "blocks", []):
        fully_shard(b)
    fully_shard(model)
    return model


def scenario_quantized_training(name: str, after_step=None) -> dict:
    """torchao's training subclass `name` against stock FSDP2; after_step(model) after each step
    (BitNet's precomputed scales)."""
    stock, _ = train_steps(build_quantized_training(name), after_step)
    mine, summary = _with_tide(build_quantized_training(name), lambda m: train_steps(m, after_step))
    return {"tide": summary, "vs_stock": _equal(mine, stock),
            "weights": sorted({type(p).__name__ for p in mine})}


def _precompute_bitnet_scale(model) -> None:
    from torchao.prototype.quantized_training import precompute_bitnet_scale_for_fsdp
    precompute_bitnet_scale_for_fsdp(model)


def scenario_quantized_training_uneven(name: str) -> dict:
    """torchao's training weight `name` on a dim 0 (64) W = 3 does not divide: what enable raises
    on this rank, and how long it took (stock FSDP2 fails in its collective)."""
    model = build_quantized_training(name, nn.Sequential(nn.Linear(IN, 64, bias=False), nn.Linear(64, 64, bias=False)))
    start = time.monotonic()
    try:
        tide.fsdp.enable(model, timeout_ms=UNEVEN_TIMEOUT_MS)
        tide.fsdp.disable(model)
        error = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        error = (type(e).__name__, str(e))
    return {"error": error, "seconds": time.monotonic() - start}


UNEVEN_TIMEOUT_MS = 30000  # a rank that waited it out would raise TimeoutError, not the DesyncError


# --- torchao NF4 (QLoRA) ----------------------------------------------------------------------------

def _nf4():
    """torchao's (to_nf4, linear_nf4): moved in torchao 0.18."""
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4, to_nf4
    except ImportError:  # torchao <= 0.17
        from torchao.dtypes.nf4tensor import linear_nf4, to_nf4
    return to_nf4, linear_nf4


class QLoRALinear(nn.Module):
    def __init__(self, dim: int, rank: int = 4):
        super().__init__()
        to_nf4, _ = _nf4()
        weight = (dim ** -0.5 * torch.randn(dim, dim)).to(torch.bfloat16)
        self.weight = nn.Parameter(to_nf4(weight, block_size=64, scaler_block_size=256), requires_grad=False)
        self.lora_a = nn.Parameter(0.1 * torch.randn(rank, dim))
        self.lora_b = nn.Parameter(0.1 * torch.randn(dim, rank))

    def forward(self, x):
        _, linear_nf4 = _nf4()
        return linear_nf4(x.bfloat16(), self.weight).float() + x @ self.lora_a.T @ self.lora_b.T


def build_nf4():
    torch.manual_seed(0)
    model = nn.Sequential(*[QLoRALinear(256) for _ in range(2)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model


def train_nf4(model, steps=3):
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    counter = h.OpCounter()
    with counter:
        for _ in range(steps):
            model(torch.randn(2, 256, generator=gen)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    return [p.to_local().detach().clone() for p in model.parameters() if p.requires_grad], counter.counts


def _nf4_inner(model) -> list:
    model.unshard()
    for layer in model:
        layer.unshard()
    inner = [getattr(layer.weight, n).clone() for layer in model
             for n in ("quantized_scalers", "quantization_factor", "quantized_data", "scaler_mean")]
    model.reshard()
    for layer in model:
        layer.reshard()
    return inner


def scenario_nf4() -> dict:
    stock_model = build_nf4()
    stock_weights = _nf4_inner(stock_model)
    stock, _ = train_nf4(stock_model)
    model = build_nf4()
    handle = tide.fsdp.enable(model, timeout_ms=60000)
    try:
        weights = _nf4_inner(model)
        mine, ops = train_nf4(model)
    finally:
        tide.fsdp.disable(model)
    return {"tide": _summary(handle, ops), "weights_equal": _equal(weights, stock_weights),
            "vs_stock": _equal(mine, stock), "finite": all(bool(p.isfinite().all()) for p in mine)}


# --- a custom two-input extension, and PyTorch's TwoTensor ----------------------------------------

class SplitTensor(torch.Tensor):
    """An fp32 tensor all-gathered as two bf16 inputs, a head and the rest (head + rest ~= the
    value), and unsharded as their fp32 sum: a plain tensor, so its gradients are plain too.
    Written as PyTorch's test subclass BFloat16AllGatherTensor is (a wrapper over ``_data``)."""

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, data.stride(), data.storage_offset(),
                                                   dtype=data.dtype, device=data.device)

    def __init__(self, data: torch.Tensor):
        self._data = data

    def _inputs(self):
        head = self._data.to(torch.bfloat16)
        return (head, (self._data - head.float()).to(torch.bfloat16)), "split"

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        assert metadata == "split", metadata
        head, rest = all_gather_outputs
        if out is not None:
            with torch.no_grad(), _unsafe_preserve_version_counter(out):
                out.copy_(head.float() + rest.float())
            return None
        full = head.float() + rest.float()
        return full, (full,)

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        import torch.utils._pytree as pytree
        out = func(*pytree.tree_map_only(cls, lambda x: x._data, args),
                   **pytree.tree_map_only(cls, lambda x: x._data, kwargs or {}))
        return pytree.tree_map_only(torch.Tensor, cls, out)

    def __tensor_flatten__(self):
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, outer_size, outer_stride):
        return inner_tensors["_data"]


class SplitTensorV1(SplitTensor):
    def fsdp_pre_all_gather(self, mesh):  # the old signature
        return self._inputs()


class SplitTensorV2(SplitTensor):
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        assert isinstance(module, nn.Module) and len(outer_size) == 2
        return self._inputs()


def build_split(version: int):
    cls = SplitTensorV1 if version == 1 else SplitTensorV2
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 16, bias=False), nn.ReLU(), nn.Linear(16, 8, bias=False))
                            for _ in range(3)])
    for mlp in model:
        for lin in (mlp[0], mlp[2]):
            lin.weight = nn.Parameter(cls(lin.weight.detach().clone()))
        fully_shard(mlp)
    fully_shard(model)
    return model


def build_two_tensor():
    from torch.testing._internal.two_tensor import TwoTensor
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 16, bias=False), nn.ReLU(), nn.Linear(16, 8, bias=False))
                            for _ in range(3)])
    for mlp in model:
        for lin in (mlp[0], mlp[2]):
            lin.weight = nn.Parameter(TwoTensor(lin.weight, lin.weight.clone()))
        fully_shard(mlp)
    fully_shard(model)
    return model


def _two_tensor_pre(self, mesh):  # as PyTorch's test_fully_shard_extensions.py (v1)
    return (self.a, self.b), None


def _two_tensor_post(self, all_gather_outputs, metadata, param_dtype, *, out=None):
    from torch.testing._internal.two_tensor import TwoTensor
    a, b = all_gather_outputs
    if out is not None:  # the outputs must be the ones the first call wrapped (no copy)
        assert a.untyped_storage().data_ptr() == out.a.untyped_storage().data_ptr()
        assert b.untyped_storage().data_ptr() == out.b.untyped_storage().data_ptr()
        return None
    return TwoTensor(a, b).to(param_dtype), (a, b)


def train_mlp(model, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    counter = h.OpCounter()
    with counter:
        for _ in range(steps):
            model(torch.randn(2, 8, generator=gen)).sum().backward()
            opt.step()
            opt.zero_grad()
    return [p.to_local().detach().clone() for p in model.parameters()], counter.counts


def scenario_split(version: int) -> dict:
    stock, _ = train_mlp(build_split(version))
    mine, summary = _with_tide(build_split(version), train_mlp)
    return {"tide": summary, "vs_stock": _equal(mine, stock)}


def scenario_two_tensor() -> dict:
    from torch.testing._internal.two_tensor import TwoTensor
    TwoTensor.fsdp_pre_all_gather = _two_tensor_pre
    TwoTensor.fsdp_post_all_gather = _two_tensor_post
    try:
        stock, _ = train_mlp(build_two_tensor())
        mine, summary = _with_tide(build_two_tensor(), train_mlp)
    finally:
        del TwoTensor.fsdp_pre_all_gather, TwoTensor.fsdp_post_all_gather
    return {"tide": summary, "vs_stock": _equal(mine, stock)}


def build_monkey_patched(two_tensor: bool = False):
    """Plain weights given the extension methods after ``fully_shard``, on the local tensors (as
    PyTorch's test_all_gather_extensions_monkey_patch does): FSDP2 sets them up at its lazy init,
    which runs after ``tide.fsdp.enable`` when enable is called before the first forward.
    two_tensor: TwoTensor weights (a != b) as in that test, so ``self.to(torch.bfloat16)`` is a
    TwoTensor input: a wrapper with no storage of its own (data_ptr() 0)."""
    from torch.testing._internal.two_tensor import TwoTensor
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 16, bias=False), nn.ReLU(), nn.Linear(16, 8, bias=False))
                            for _ in range(3)])
    for mlp in model:
        if two_tensor:
            for lin in (mlp[0], mlp[2]):
                lin.weight = nn.Parameter(TwoTensor(lin.weight, lin.weight * 0.5 + 0.1))
        fully_shard(mlp)
    fully_shard(model)
    for name, param in model.named_parameters():
        local = param._local_tensor
        local.fsdp_pre_all_gather = _bf16_pre.__get__(local)
        local.fsdp_post_all_gather = _bf16_post.__get__(local)
    return model


def _bf16_pre(self, mesh, outer_size, outer_stride, module, mp_policy):  # the test's (v2 signature)
    return (self.to(torch.bfloat16),), None


@torch.no_grad()
def _bf16_post(self, all_gather_outputs, metadata, param_dtype, *, out=None):
    (tensor,) = all_gather_outputs
    assert metadata is None and tensor.dtype == torch.bfloat16
    if out is not None:
        with _unsafe_preserve_version_counter(out):
            out.copy_(tensor.view(out.shape))  # the test's copy_(tensor), for any shard dim
        return None
    upcast = tensor.to(param_dtype)
    return upcast, (tensor, upcast)


def scenario_monkey_patched(two_tensor: bool = False) -> dict:
    def train(m):  # a TwoTensor's torch.equal compares its a only: compare a and b
        params, ops = train_mlp(m)
        return [t for p in params for t in ((p.a, p.b) if two_tensor else (p,))], ops
    stock, _ = train(build_monkey_patched(two_tensor))
    mine, summary = _with_tide(build_monkey_patched(two_tensor), train)
    return {"tide": summary, "vs_stock": _equal(mine, stock)}


# --- extensions as stock FSDP2 runs them: shard dims, freeing, RNG, late methods, empty inputs -----

def build_bf16_extension(shard_dim: int = 0, attach: bool = True, pre=None):
    """PyTorch's bf16 all-gather test extension (``_bf16_pre``/``_bf16_post``: its post-all-gather
    allocates an fp32 upcast, an inner tensor) on every weight, each group sharded on `shard_dim`."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 16, bias=False), nn.ReLU(), nn.Linear(16, 8, bias=False))
                            for _ in range(3)])
    placement = {"shard_placement_fn": lambda p: Shard(shard_dim)} if shard_dim else {}
    for mlp in model:
        fully_shard(mlp, **placement)
    fully_shard(model, **placement)
    if attach:
        attach_bf16_extension(model, pre)
    return model


def attach_bf16_extension(model, pre=None) -> None:
    for param in model.parameters():
        local = param._local_tensor
        local.fsdp_pre_all_gather = (pre or _bf16_pre).__get__(local)
        local.fsdp_post_all_gather = _bf16_post.__get__(local)


def _unsharded_weights(model) -> list:
    """Every param unsharded (FSDP2's unshard), cloned, then resharded."""
    model.unshard()
    for mlp in model:
        mlp.unshard()
    weights = [p.detach().clone() for p in model.parameters()]
    model.reshard()
    for mlp in model:
        mlp.reshard()
    return weights


def scenario_shard_dim(shard_dim: int) -> dict:
    """An extension param sharded on dim `shard_dim`: stock chunk-cats each rank's input along the
    dim before fsdp_post_all_gather; TIDE must hand it the same."""
    stock_model = build_bf16_extension(shard_dim)
    stock_weights = _unsharded_weights(stock_model)
    stock, _ = train_mlp(stock_model)
    model = build_bf16_extension(shard_dim)
    handle = tide.fsdp.enable(model, timeout_ms=60000)
    try:
        weights = _unsharded_weights(model)
        mine, ops = train_mlp(model)
    finally:
        tide.fsdp.disable(model)
    return {"tide": _summary(handle, ops), "weights_equal": _equal(weights, stock_weights),
            "vs_stock": _equal(mine, stock)}


def _after_reshard(model) -> dict:
    """After a training step: the bytes the params' inner tensors still hold (stock frees them at
    reshard), those of them that are not all-gather outputs (the extension's own allocations, an
    upcast here), and what reading a resharded weight kept from the unsharded param does."""
    train_mlp(model, steps=1)
    resident = own = 0
    for fp in _fsdp_params(model):
        outputs = {o.untyped_storage()._cdata for o in fp.all_gather_outputs}
        for t in fp._unsharded_inner_tensors:
            resident += t.untyped_storage().size()
            own += 0 if t.untyped_storage()._cdata in outputs else t.untyped_storage().size()
    model.unshard()
    for mlp in model:
        mlp.unshard()
    kept = model[0][0].weight
    model.reshard()
    for mlp in model:
        mlp.reshard()
    try:
        stale = f"read {float(kept[0].sum())}"  # a row view checks its storage's size
    except RuntimeError as e:
        stale = f"RuntimeError: {e}"
    return {"resident": resident, "own_resident": own, "stale": stale}


def _fsdp_params(model) -> list:
    return [fp for _, pg in _fsdp2.param_groups(model) for fp in pg.fsdp_params]


def scenario_inner_tensors_freed() -> dict:
    stock = _after_reshard(build_bf16_extension())
    model = build_bf16_extension()
    handle = tide.fsdp.enable(model, timeout_ms=60000)
    try:
        mine = _after_reshard(model)
    finally:
        tide.fsdp.disable(model)
    return {"stock": stock, "tide_run": mine, "buckets": len(handle.buckets), "fallbacks": handle.fallbacks}


def _stochastic_pre(self, mesh, outer_size, outer_stride, module, mp_policy):
    """bf16 with stochastic rounding: draws from torch's global generator at every all-gather."""
    noise = (torch.rand(self.shape) - 0.5) * 2.0 ** -8
    return ((self * (1 + noise)).to(torch.bfloat16),), None


def scenario_rng_stream() -> dict:
    """An extension that draws from torch's global generator: enable must leave the stream where
    stock's is, so the training is bitwise stock's."""
    stock, _ = train_mlp(build_bf16_extension(pre=_stochastic_pre))  # seeds torch's generator
    mine, summary = _with_tide(build_bf16_extension(pre=_stochastic_pre), train_mlp)
    return {"tide": summary, "vs_stock": _equal(mine, stock)}


def scenario_attached_after_enable() -> dict:
    """Extension methods attached after enable, before the first forward (FSDP2 sets them up at
    its lazy init): stock trains with them, so TIDE must too."""
    stock_model = build_bf16_extension(attach=False)
    attach_bf16_extension(stock_model)
    stock, _ = train_mlp(stock_model)
    model = build_bf16_extension(attach=False)
    handle = tide.fsdp.enable(model, timeout_ms=60000)
    attach_bf16_extension(model)
    try:
        mine, ops = train_mlp(model)
    finally:
        tide.fsdp.disable(model)
    return {"tide": _summary(handle, ops), "vs_stock": _equal(mine, stock)}


def _pre_with_empty_input(self, mesh, outer_size, outer_stride, module, mp_policy):
    return (self.to(torch.bfloat16), torch.empty(0, dtype=torch.float32)), None


@torch.no_grad()
def _post_with_empty_input(self, all_gather_outputs, metadata, param_dtype, *, out=None):
    tensor, empty = all_gather_outputs
    assert empty.numel() == 0 and empty.dtype == torch.float32, empty
    return _bf16_post(self, (tensor,), metadata, param_dtype, out=out)


def scenario_empty_input() -> dict:
    """fsdp_pre_all_gather returning an empty input beside a real one: stock gathers nothing for
    it and hands fsdp_post_all_gather an empty output."""
    def build():
        model = build_bf16_extension(attach=False)
        for param in model.parameters():
            local = param._local_tensor
            local.fsdp_pre_all_gather = _pre_with_empty_input.__get__(local)
            local.fsdp_post_all_gather = _post_with_empty_input.__get__(local)
        return model
    stock, _ = train_mlp(build())
    mine, summary = _with_tide(build(), train_mlp)
    return {"tide": summary, "vs_stock": _equal(mine, stock)}


def scenario_enable_twice() -> dict:
    """enable on a block, then on the model holding it: the error names the block's group."""
    model = build_bf16_extension(attach=False)
    tide.fsdp.enable(model[1], timeout_ms=60000)
    try:
        tide.fsdp.enable(model, timeout_ms=60000)
        error = ""
    except ValueError as e:
        error = str(e)
    finally:
        tide.fsdp.disable(model[1])
    return {"error_text": error}


def scenario_float8_shard_dim_1() -> dict:
    """torchao float8 weights sharded on dim 1 (torchtitan's layout for MoE experts): TIDE's
    generic extension path against stock FSDP2, fp8 all-gather on."""
    def train(m):
        return train_float8(m, False)
    kwargs = {"shard_placement_fn": lambda p: Shard(1) if p.ndim == 2 else Shard(0)}
    on, tide_on = _with_tide(build_float8(True, **kwargs), train)
    stock_on, _ = train(build_float8(True, **kwargs))
    return {"tide": tide_on, "vs_stock_on": _equal(on, stock_on)}


def scenario_float8_nan() -> dict:
    """A NaN in a float8 weight at the first all-gather: the first-all-gather check compares NaNs
    as NaNs (their sign is not defined), so TIDE trains on as stock does."""
    model = build_float8(True)
    with torch.no_grad():
        model.blocks[0].up.weight.to_local()._tensor.view(-1)[dist.get_rank()] = float("nan")
    handle = tide.fsdp.enable(model, timeout_ms=60000)
    try:
        loss = model(torch.randn(4, IN)).sum()
        loss.backward()
        error = ""
    except RuntimeError as e:
        error = str(e)
    finally:
        tide.fsdp.disable(model)
    return {"error_text": error, "tide_casts": _summary(handle, {})["tide_casts"]}


def scenario_float8_stock_on(**fsdp_kwargs) -> dict:
    """TIDE against stock FSDP2 both with fp8 all-gather on (every group mixes float8 weights with
    plain params, so stock gathers uint8, which gloo carries)."""
    def train(m):
        return train_float8(m, False)
    on, tide_on = _with_tide(build_float8(True, **fsdp_kwargs), train)
    stock_on, _ = train(build_float8(True, **fsdp_kwargs))
    return {"tide": tide_on, "vs_stock_on": _equal(on, stock_on)}


def scenario_float8_cast_checked() -> dict:
    """TIDE's e4m3 bytes made with another scale than torchao's (a fault put in on purpose): the
    first all-gather's comparison with torchao's own cast must raise, on every rank."""
    from tide.fsdp import _float8
    right = _float8.scales
    _float8.scales = lambda *args: [s * 2 for s in right(*args)]
    model = build_float8(True)
    handle = tide.fsdp.enable(model, timeout_ms=60000)
    try:
        model(torch.randn(4, IN)).sum().backward()
        error = ""
    except RuntimeError as e:
        error = str(e)
    finally:
        _float8.scales = right
    casts = _summary(handle, {})["tide_casts"]
    try:
        tide.fsdp.disable(model)
    except ValueError:
        pass
    return {"error_text": error, "tide_casts": casts}


def scenario_float8_scales_at_capture() -> dict:
    """torchao's float8 scales as a CUDA graph capture computes them (_float8.scales, given the
    capture id a capture has, after one step made the amax exchange's window): a dynamic scale is
    torchao's own (its amax max-reduced by TIDE's exchange, which a graph captures), a precomputed
    one (a new tensor every step) is refused."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
    from tide.fsdp import _float8
    model = build_float8(True)
    handle = tide.fsdp.enable(model, timeout_ms=60000)
    train_float8(model, False)
    bucket = next(b for b in handle.buckets if b.amax_exchange is not None)
    fps = [fp for fp, why in zip(bucket.fsdp_params, bucket.gather.why_not_cast) if why == ""]
    seen = {}
    for name in ("dynamic", "precomputed"):
        if name == "precomputed":
            precompute_float8_dynamic_scale_for_fsdp(model)
        try:
            mine = _float8.scales(fps, 1, bucket.path,
                                  lambda amaxes: bucket.amax_exchange(amaxes, bucket.pool, 1, bucket.path, bucket.lease))
            seen[name] = all(torch.equal(s, _float8.torchao_cast(fp)[1]) for fp, s in zip(fps, mine))
        except RuntimeError as e:
            seen[name] = str(e)
    tide.fsdp.disable(model)
    return {"weights": len(fps), **seen}


SCENARIOS = {
    "float8_scales_at_capture": (scenario_float8_scales_at_capture, (2,), True),
    "float8_dynamic": (lambda: scenario_float8(False), (2, 3), True),
    "float8_precomputed": (lambda: scenario_float8(True), (2, 3), True),
    "float8_only_groups": (lambda: scenario_float8(False, only_float8_groups=True), (2,), True),
    "float8_virtual_nodes": (lambda: scenario_float8(True, ranks_per_node=2), (4,), True),
    # torchtitan's usual float8 setting: bf16 params, fp32 reduce
    "float8_bf16": (lambda: scenario_float8_stock_on(mp_policy=MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32)), (2,), True),
    "float8_no_reshard": (lambda: scenario_float8_stock_on(reshard_after_forward=False), (2,), True),
    "float8_generic": (scenario_float8_generic, (2,), True),
    "float8_uneven": (scenario_float8_uneven, (3,), True),
    "nf4": (scenario_nf4, (2,), True),
    "int8_mixed_precision": (lambda: scenario_quantized_training("int8_mixed_precision"), (2,), True),
    "int8_weight_only": (lambda: scenario_quantized_training("int8_weight_only"), (2,), True),
    "bitnet": (lambda: scenario_quantized_training("bitnet"), (2,), True),
    "bitnet_precomputed": (lambda: scenario_quantized_training("bitnet", _precompute_bitnet_scale), (2,), True),
    "moe_float8_rowwise": (lambda: scenario_quantized_training("moe_float8_rowwise"), (2,), True),
    "int8_mixed_precision_uneven": (lambda: scenario_quantized_training_uneven("int8_mixed_precision"), (3,), True),
    "bitnet_uneven": (lambda: scenario_quantized_training_uneven("bitnet"), (3,), True),
    "split_v1": (lambda: scenario_split(1), (2,), False),
    "split_v2": (lambda: scenario_split(2), (2,), False),
    "two_tensor": (scenario_two_tensor, (2,), False),
    "monkey_patched": (scenario_monkey_patched, (2,), False),
    "monkey_patched_two_tensor": (lambda: scenario_monkey_patched(two_tensor=True), (2,), False),
    "shard_dim_0": (lambda: scenario_shard_dim(0), (2,), False),
    "shard_dim_1": (lambda: scenario_shard_dim(1), (2,), False),
    "inner_tensors_freed": (scenario_inner_tensors_freed, (2,), False),
    "rng_stream": (scenario_rng_stream, (2,), False),
    "attached_after_enable": (scenario_attached_after_enable, (2,), False),
    "empty_input": (scenario_empty_input, (2,), False),
    "enable_twice": (scenario_enable_twice, (2,), False),
    "float8_shard_dim_1": (scenario_float8_shard_dim_1, (2,), True),
    "float8_nan": (scenario_float8_nan, (2,), True),
    "float8_cast_checked": (scenario_float8_cast_checked, (2,), True),  # last: leaves a broken step
}


def _worker(rank, world, port, names, out_dir):
    h.join_world(port, rank, world, "gloo")
    results = {}
    try:
        for name in names:
            try:
                results[name] = SCENARIOS[name][0]()
            except Exception as e:  # noqa: BLE001 - reported to the test
                results[name] = {"error": f"{type(e).__name__}: {e}"}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        h.exit_rank()
    finally:  # reached on an error only
        dist.destroy_process_group()


_cache: dict = {}


def results(world: int) -> dict:
    """Every scenario that runs at `world` (one spawned world per W), per rank."""
    if world not in _cache:
        names = [n for n, (_, worlds, torchao_only) in SCENARIOS.items()
                 if world in worlds and (HAVE_TORCHAO or not torchao_only)]
        with tempfile.TemporaryDirectory() as out_dir, h.rendezvous() as port:
            mp.start_processes(_worker, args=(world, port, names, out_dir), nprocs=world,
                               join=True, start_method="spawn")
            per_rank = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]
        _cache[world] = {n: [per_rank[r][n] for r in range(world)] for n in names}
    return _cache[world]


def _assert_handled(r: dict, groups: int, extension_groups: int, reduce_scatters: bool = True):
    tide_run = r["tide"]
    assert tide_run["fallbacks"] == [] and tide_run["buckets"] == groups, tide_run
    assert tide_run["extension_buckets"] == extension_groups, tide_run
    assert tide_run["counts"]["all_gathers"] > 0, tide_run
    assert (tide_run["counts"]["reduce_scatters"] > 0) == reduce_scatters, tide_run
    assert not any(tide_run["ops"].values()), f"FSDP2 layout copies ran: {tide_run['ops']}"


def handled_ranks(world: int, case: str, groups: int, extension_groups: int) -> list[tuple[int, dict]]:
    """Each rank's result of `case`, after checking it ran without error and TIDE handled its
    `groups` param groups (`extension_groups` of them through the extension path) with no copies."""
    ranks = list(enumerate(results(world)[case]))
    for rank, r in ranks:
        assert "error" not in r, f"rank {rank}: {r}"
        _assert_handled(r, groups=groups, extension_groups=extension_groups)
    return ranks


@needs_torchao
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("scale", ["dynamic", "precomputed"])
def test_float8_all_gather_is_handled_and_bitwise_equal_to_it_off(world, scale):
    for rank, r in handled_ranks(world, f"float8_{scale}", groups=3, extension_groups=2):
        _assert_handled({"tide": r["tide_off"]}, groups=3, extension_groups=0)
        assert r["tide"]["tide_casts"] == 4, r["tide"]  # every float8 weight cast by TIDE
        # fp8 bytes: the float8 weights' all-gather moves a quarter of fp32's
        assert r["tide"]["counts"]["all_gather_bytes"] < r["tide_off"]["counts"]["all_gather_bytes"]
        assert r["vs_tide_off"], f"rank {rank}: fp8 all-gather on differs from off (both TIDE)"
        if world == 2:  # every reduction a sum of two numbers: bitwise against stock too
            assert r["vs_stock_off"], f"rank {rank}: differs from stock FSDP2 with fp8 all-gather off"


@needs_torchao
def test_float8_weights_tide_does_not_cast_take_the_generic_path():
    for rank, r in handled_ranks(2, "float8_generic", groups=3, extension_groups=2):
        assert r["tide"]["tide_casts"] == 0, r["tide"]
        assert r["vs_stock_off"], f"rank {rank}: differs from stock FSDP2 with fp8 all-gather off"


@needs_torchao
def test_float8_weights_with_uneven_shards_raise_on_every_rank():
    for rank, r in enumerate(results(3)["float8_uneven"]):
        assert "disagree" in r.get("error_text", "") and "float8_e4m3fn" in r["error_text"], f"rank {rank}: {r}"


@needs_torchao
def test_float8_cast_differing_from_torchao_raises_on_every_rank():
    for rank, r in enumerate(results(2)["float8_cast_checked"]):
        assert r.get("tide_casts") == 4, f"rank {rank}: {r}"
        assert "float8 cast differs from torchao's own" in r["error_text"], f"rank {rank}: {r}"


@needs_torchao
def test_float8_scales_at_capture_are_torchaos_or_refused_when_precomputed():
    for rank, r in enumerate(results(2)["float8_scales_at_capture"]):
        assert "error" not in r and r["weights"] == 2, f"rank {rank}: {r}"
        assert r["dynamic"] is True, f"rank {rank}: TIDE's amax exchange made other scales: {r}"
        assert r["precomputed"].startswith(
            "tide.fsdp: param group blocks.0: its float8 weights use torchao's precomputed scales"), r
        assert "which a CUDA graph cannot replay" in r["precomputed"], r


@needs_torchao
def test_float8_groups_of_float8_weights_alone():
    """Groups holding float8 weights alone all-gather fp8 inputs only: gloo has no fp8, so stock
    FSDP2 cannot run this on CPU ("Invalid scalar type"); TIDE's host transport moves the bytes."""
    for rank, r in handled_ranks(2, "float8_only_groups", groups=5, extension_groups=2):
        assert r["tide"]["tide_casts"] == 4, r["tide"]
        assert r["vs_tide_off"] and r["vs_stock_off"], f"rank {rank}: {r}"


@needs_torchao
@pytest.mark.parametrize("case", ["bf16", "no_reshard"])
def test_float8_matches_stock_with_fp8_all_gather_on(case):
    """bf16 params (fp32 reduce) and reshard_after_forward=False: bitwise equal to stock FSDP2
    with fp8 all-gather on (W = 2)."""
    for rank, r in handled_ranks(2, f"float8_{case}", groups=3, extension_groups=2):
        assert r["tide"]["tide_casts"] == 4, r["tide"]
        assert r["vs_stock_on"], f"rank {rank}: differs from stock FSDP2 with fp8 all-gather on"


@needs_torchao
def test_float8_across_virtual_nodes():
    """W = 4 as 2 nodes of 2: the fp8 bytes go through TIDE's across-node all-gather."""
    for rank, r in handled_ranks(4, "float8_virtual_nodes", groups=3, extension_groups=2):
        assert r["tide"]["tide_casts"] == 4, r["tide"]
        assert r["vs_tide_off"], f"rank {rank}: fp8 all-gather on differs from off (both TIDE)"


@needs_torchao
def test_nf4_frozen_weights_are_gathered_as_stock():
    for rank, r in handled_ranks(2, "nf4", groups=2, extension_groups=2):
        assert r["weights_equal"], f"rank {rank}: the unsharded NF4 tensors differ from stock's"
        assert r["finite"] and r["vs_stock"], f"rank {rank}: LoRA params differ from stock's: {r}"


def cpu_rowwise_scaled_mm() -> bool:
    """Whether this torch's CPU _scaled_mm takes rowwise scales, as MoE training's float8 rowwise
    recipe needs on CPU (torch 2.11's takes per-tensor scales only)."""
    a = torch.zeros(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


@needs_torchao
@pytest.mark.parametrize("case, weight", [
    ("int8_mixed_precision", "Int8MixedPrecisionTrainingLinearWeight"),
    ("int8_weight_only", "Int8QuantizedTrainingLinearWeight"),
    ("bitnet", "BitNetTrainingLinearWeight"),
    ("bitnet_precomputed", "BitNetTrainingLinearWeight"),
    pytest.param("moe_float8_rowwise", "Float8TrainingWeightWrapperTensor", marks=pytest.mark.skipif(
        not cpu_rowwise_scaled_mm(), reason=f"torch {torch.__version__}'s CPU _scaled_mm takes "
        "per-tensor scales only; MoE training's float8 rowwise recipe needs rowwise ones"))])
def test_torchao_training_subclass_matches_stock(case, weight):
    """torchao's training weight subclasses (W = 2): TIDE gathers their fsdp_pre_all_gather inputs
    (fp32, int8 with scales, packed 2-bit) in every group, bitwise equal to stock FSDP2, every
    inner tensor of the trained weights compared."""
    for rank, r in handled_ranks(2, case, groups=3, extension_groups=2):
        assert weight in r["weights"], f"rank {rank}: torchao's {weight} is not what trained: {r['weights']}"
        assert r["vs_stock"], f"rank {rank}: differs from stock FSDP2"


@needs_torchao
def test_bitnet_with_uneven_shards_raises_desync_error_naming_the_param():
    """BitNet packs its shard into 2-bit bytes without padding: at W = 3 on 64 rows the ranks'
    inputs differ in size, and every rank raises the same DesyncError naming the weight."""
    errors = [r["error"] for r in results(3)["bitnet_uneven"]]
    for rank, error in enumerate(errors):
        assert error is not None and error[0] == "DesyncError", f"rank {rank}: {error}"
        assert "disagree on param group 0" in error[1] and "0.weight [64, 16]" in error[1], f"rank {rank}: {error}"
    assert len(set(errors)) == 1, errors


@needs_torchao
def test_exception_on_one_rank_inside_enable_reaches_every_rank():
    """int8 mixed precision at W = 3 on 64 rows: FSDP2 asserts the padded shard size inside
    fsdp_pre_all_gather on rank 2 alone (its shard has 20 rows, not 22), during enable's probe.
    Every rank raises the same DesyncError naming rank 2 and the assertion at once, rather than
    the others' TimeoutError after UNEVEN_TIMEOUT_MS."""
    per_rank = results(3)["int8_mixed_precision_uneven"]
    errors = [r["error"] for r in per_rank]
    for rank, r in enumerate(per_rank):
        assert r["error"] is not None and r["error"][0] == "DesyncError", f"rank {rank}: {r}"
        assert r["error"][1].startswith(
            "tide.fsdp.enable: global rank 2 raised AssertionError at param group <root>: "), r
        assert "padded sharded size torch.Size([22, 16])" in r["error"][1], f"rank {rank}: {r}"
        assert r["seconds"] < UNEVEN_TIMEOUT_MS / 1000, f"rank {rank}: waited out the timeout: {r}"
    assert len(set(errors)) == 1, errors


@pytest.mark.parametrize("version", [1, 2])
def test_custom_two_input_extension_matches_stock(version):
    for rank, r in handled_ranks(2, f"split_v{version}", groups=3, extension_groups=3):
        assert r["vs_stock"], f"rank {rank}: differs from stock FSDP2"


def test_pytorch_two_tensor_extension_matches_stock():
    """PyTorch's own test subclass: the all-gathers are TIDE's; its gradients are TwoTensors, so
    their reduce-scatters run stock (logged), as TIDE reduces plain gradients only."""
    for rank, r in enumerate(results(2)["two_tensor"]):
        assert "error" not in r, f"rank {rank}: {r}"
        tide_run = r["tide"]
        assert tide_run["fallbacks"] == [] and tide_run["extension_buckets"] == 3, tide_run
        assert tide_run["counts"]["all_gathers"] > 0 and tide_run["counts"]["reduce_scatters"] == 0, tide_run
        assert tide_run["ops"]["all_gather_copy_in"] == 0 and tide_run["ops"]["split_with_sizes_copy"] == 0
        assert r["vs_stock"], f"rank {rank}: differs from stock FSDP2"


def test_extension_methods_attached_after_fully_shard_match_stock():
    """Methods attached after fully_shard, before the first forward: enable sets them up as FSDP2's
    lazy init does (before, enable raised AttributeError: no '_extensions_data')."""
    for rank, r in handled_ranks(2, "monkey_patched", groups=3, extension_groups=3):
        assert r["vs_stock"], f"rank {rank}: differs from stock FSDP2"


def test_wrapper_subclass_all_gather_input_matches_stock():
    """fsdp_pre_all_gather returning a wrapper subclass (TwoTensor's self.to(bf16), as PyTorch's
    test_all_gather_extensions_monkey_patch): no storage, data_ptr() 0; TIDE copies it into a plain
    tensor as stock's copy-in does (before: "Executor::run: inputs[0] = null, expected a buffer")."""
    for rank, r in enumerate(results(2)["monkey_patched_two_tensor"]):
        assert "error" not in r, f"rank {rank}: {r}"
        tide_run = r["tide"]
        assert tide_run["fallbacks"] == [] and tide_run["extension_buckets"] == 3, tide_run
        assert tide_run["counts"]["all_gathers"] > 0, tide_run
        assert tide_run["ops"]["all_gather_copy_in"] == 0 and tide_run["ops"]["split_with_sizes_copy"] == 0
        assert r["vs_stock"], f"rank {rank}: differs from stock FSDP2"


# --- extensions as stock FSDP2 runs them -------------------------------------------------------------

@pytest.mark.parametrize("shard_dim", [0, 1])
def test_extension_param_sharded_on_any_dim_matches_stock(shard_dim):
    """Stock hands fsdp_post_all_gather each input chunk-catted along the shard dim; on dim 1
    TIDE handed it the rank-major bytes (the weight off by up to 0.68, silently)."""
    for rank, r in handled_ranks(2, f"shard_dim_{shard_dim}", groups=3, extension_groups=3):
        assert r["weights_equal"], f"rank {rank}: the unsharded weights differ from stock's"
        assert r["vs_stock"], f"rank {rank}: training differs from stock FSDP2"


def test_extension_inner_tensors_are_freed_at_reshard_as_stock():
    for rank, r in enumerate(results(2)["inner_tensors_freed"]):
        assert "error" not in r, f"rank {rank}: {r}"
        assert r["buckets"] == 3 and r["fallbacks"] == [], r
        assert r["stock"]["resident"] == 0, r  # the reference frees them
        assert r["tide_run"]["own_resident"] == 0, f"rank {rank}: the extension's tensors stay resident: {r}"
        # Inner tensors that are all-gather outputs view TIDE's window: emptied where torch can swap
        # a storage's bytes; on torch 2.11 released through their version counter (they hold no
        # bytes of their own, and autograd refuses a stale use: _fsdp2.UnshardedStorage).
        if _fsdp2.UnshardedStorage.SWAP:
            assert r["tide_run"]["resident"] == 0, f"rank {rank}: inner tensors stay resident: {r}"
        assert r["stock"]["stale"].startswith("RuntimeError"), r
        assert r["tide_run"]["stale"].startswith("RuntimeError"), f"rank {rank}: a stale read passed: {r}"


def test_enable_leaves_the_random_stream_as_stock():
    """enable asks fsdp_pre_all_gather for the inputs' sizes once, a call stock does not make; an
    extension drawing random numbers there must not shift the stream."""
    for rank, r in handled_ranks(2, "rng_stream", groups=3, extension_groups=3):
        assert r["vs_stock"], f"rank {rank}: differs from stock FSDP2"


def test_extension_methods_attached_after_enable_match_stock():
    for rank, r in handled_ranks(2, "attached_after_enable", groups=3, extension_groups=3):
        assert r["vs_stock"], f"rank {rank}: differs from stock FSDP2"


def test_empty_all_gather_input_matches_stock():
    for rank, r in handled_ranks(2, "empty_input", groups=3, extension_groups=3):
        assert r["vs_stock"], f"rank {rank}: differs from stock FSDP2"


def test_enable_on_a_module_holding_a_handled_group_names_that_group():
    for rank, r in enumerate(results(2)["enable_twice"]):
        text = r.get("error_text", "")
        assert "param group 1 is already handled" in text and "<root>" not in text, f"rank {rank}: {r}"


@needs_torchao
def test_float8_sharded_on_dim_1_matches_stock():
    for rank, r in handled_ranks(2, "float8_shard_dim_1", groups=3, extension_groups=2):
        assert r["tide"]["tide_casts"] == 0, r["tide"]  # dim 1: torchao's own cast (generic path)
        assert r["vs_stock_on"], f"rank {rank}: differs from stock FSDP2 with fp8 all-gather on"


@needs_torchao
def test_float8_nan_weight_passes_the_first_all_gather_check():
    for rank, r in enumerate(results(2)["float8_nan"]):
        assert r.get("tide_casts") == 4 and r.get("error_text") == "", f"rank {rank}: {r}"


def test_e4m3_comparison_takes_any_nan_for_a_nan():
    from tide.fsdp._extension import _same_e4m3, _same_floats
    a = torch.tensor([0x7F, 0x01, 0xFF, 0x80], dtype=torch.uint8)
    assert _same_e4m3(a, torch.tensor([0xFF, 0x01, 0x7F, 0x80], dtype=torch.uint8))
    assert not _same_e4m3(a, torch.tensor([0x7F, 0x02, 0xFF, 0x80], dtype=torch.uint8))
    assert not _same_e4m3(a, torch.tensor([0x7E, 0x01, 0xFF, 0x80], dtype=torch.uint8))
    nan = torch.tensor([float("nan")])
    assert _same_floats(nan, -nan) and not _same_floats(nan, torch.tensor([1.0]))
    assert not _same_floats(torch.tensor([0.0]), torch.tensor([-0.0]))
