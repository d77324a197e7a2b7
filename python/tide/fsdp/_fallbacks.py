"""Every reason a param group, or one call of a handled group, stays stock FSDP2: what enable
logs and lists in ``TideFSDP.fallbacks`` (per group) and what ``_dispatch.foreach_reduce`` logs
once (per reduce-scatter call). Where a reason comes from the ranks' placement (nodes, hosts,
transports), ``_placement`` computes it with the placement itself."""

from __future__ import annotations

import operator
import weakref

import torch
import torch.distributed as dist

from .. import _tide
from . import _fsdp2, _hooks
from ._bucket import Bucket
from ._dtypes import TORCH_TO_TIDE


def group_reason(param_group: _fsdp2.FSDPParamGroup, group: dist.ProcessGroup | None,
                 param_name: _fsdp2.ParamName) -> str:
    """Why a param group stays stock FSDP2, from the group alone ("" if TIDE can take it)."""
    if not _fsdp2.is_sharded(param_group):
        return "not sharded (replicate(): DDP mesh), so there is no all-gather or reduce-scatter to take"
    if group is None or group.size() <= 1:
        return "world size 1 (nothing to communicate)"
    device = param_group.device
    if device.type == "cuda":
        if not _tide.cuda_built:
            return "device cuda: this build of TIDE has no CUDA transport (built without nvcc)"
    elif device.type != "cpu":
        return f"device {device}: TIDE runs on CPU and CUDA devices"
    if _fsdp2.uses_post_forward_mesh(param_group):
        return "reshard_after_forward as an int (post-forward resharding to a smaller mesh)"
    reason = _fsdp2.custom_comm_reason(param_group)
    if reason:
        return reason
    if _fsdp2.keeps_unsharded_storage(param_group):
        return ("set_keep_unsharded_storage(True): FSDP2 keeps the unsharded parameters' storage "
                "at reshard, where TIDE hands the group's window back to its pool")
    if not any(_fsdp2.has_bytes(fp) for fp in param_group.fsdp_params):
        return "every param is zero-size (nothing to communicate)"
    for i, fp in enumerate(param_group.fsdp_params):
        name = param_name(fp, i)
        if not _fsdp2.has_bytes(fp) and _fsdp2.trainable(fp):
            # Frozen ones are left out of the window; a trainable one's empty gradient stock's own
            # reduce-scatter refuses (chunk_cat: "expects non-empty tensor"), so stock keeps it.
            return (f"{name} is zero-size {tuple(_fsdp2.unsharded_shape(fp))} and trainable (stock FSDP2's "
                    "reduce-scatter refuses its empty gradient)")
        if not _fsdp2.has_bytes(fp) and any(map(_fsdp2.has_extension, param_group.fsdp_params)):
            return f"{name} is zero-size in a group with all-gather extensions (fsdp_pre_all_gather)"
        if _fsdp2.releases_after_post_all_gather(fp):
            return (f"{name}'s all-gather extension frees its all-gather outputs after "
                    "fsdp_post_all_gather (fsdp_should_release_all_gather_outputs_after_post_all_gather), "
                    "outside the reshard where TIDE vacates the window they view")
        orig, comm = _fsdp2.dtypes(fp)
        if orig not in TORCH_TO_TIDE or comm not in TORCH_TO_TIDE:
            return f"{name} has dtype {orig} (communicated as {comm})"
        dim, shape, padded = _fsdp2.shard_dim(fp), _fsdp2.unsharded_shape(fp), _fsdp2.padded_shard_shape(fp)
        if dim == 0:
            d0 = shape[0] if len(shape) else 1
            if padded[0] != -(-d0 // group.size()):
                return f"{name}: padded shard {tuple(padded)} is not ceil(d0/W) rows"
        elif shape[dim] % group.size() != 0:  # FSDP2 itself refuses this today
            return f"{name} is sharded on dim {dim} of size {shape[dim]}, not a multiple of W = {group.size()}"
    return ""


def multi_node_reason(param_group: _fsdp2.FSDPParamGroup, param_name: _fsdp2.ParamName) -> str:
    """Why a group spanning several nodes stays stock ("" if TIDE can take it)."""
    for i, fp in enumerate(param_group.fsdp_params):
        if _fsdp2.shard_dim(fp) != 0:
            return (f"{param_name(fp, i)} is sharded on dim {_fsdp2.shard_dim(fp)} and the group spans "
                    "nodes: TIDE's across-node plans shard on dim 0 only")
    return ""


_dtype_of = operator.attrgetter("dtype")
_PLAIN = {torch.Tensor}
# A bucket's subsets -> their params' unsharded sizes, as stock's gradients have them.
_grad_sizes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _expected_grad_sizes(bucket: Bucket, subset: tuple[int, ...],
                         fsdp_params: list[_fsdp2.FSDPParam]) -> list[torch.Size]:
    sizes = _grad_sizes.setdefault(bucket, {})
    if subset not in sizes:
        sizes[subset] = [torch.Size(_fsdp2.unsharded_shape(fp)) for fp in fsdp_params]
    return sizes[subset]


def reduce_scatter_reason(bucket: Bucket, subset: tuple[int, ...], fsdp_params: list[_fsdp2.FSDPParam],
                          grads: list[torch.Tensor], call: _hooks.Call) -> str:
    """Why one reduce-scatter call of a handled group runs stock FSDP2 ("" if TIDE can take it);
    `call` is the hooked foreach_reduce call (_hooks.Call), `subset` the indices of `fsdp_params`
    in `bucket`. Per step these are array passes in C over the gradients (map over torch
    methods), no per-gradient Python: a group can hold hundreds of params."""
    comm = call.get("reduce_scatter_comm")
    if not _fsdp2.is_default_comm(comm, "reduce_scatter"):
        return f"a custom reduce-scatter comm ({type(comm).__name__})"
    reason = _fsdp2.custom_reduce_scatter_input_reason(call.get("prepare_reduce_scatter_inputs"))
    if reason:
        return reason
    if set(map(type, grads)) != _PLAIN:
        subclasses = sorted({type(g).__name__ for g in grads if type(g) is not torch.Tensor})
        # e.g. an all-gather extension whose unsharded param is a subclass (TwoTensor)
        return f"gradients are tensor subclasses ({', '.join(subclasses)}), not plain tensors"
    # A set of the dtypes, not dtype.__eq__ through map: torch.dtype.__eq__ returns NotImplemented
    # (truthy) for another dtype. One group mixes dtypes on torch >= 2.15 (bf16 weights beside
    # fp32 norms with param_dtype_override_fn), where stock reduces each in the promoted dtype.
    grad_dtypes = set(map(_dtype_of, grads))
    if len(grad_dtypes) != 1:
        return f"mixed gradient dtypes {sorted(map(str, grad_dtypes))}"
    grad_dtype = grads[0].dtype
    reduce_dtype = call.get("reduce_dtype") or grad_dtype
    if grad_dtype not in TORCH_TO_TIDE or reduce_dtype not in (torch.float32, grad_dtype):
        return f"gradient dtype {grad_dtype} with reduce dtype {reduce_dtype}"
    if reduce_dtype not in (torch.float32, torch.bfloat16):
        return f"reduce dtype {reduce_dtype} is pre-divided by stock FSDP2 against overflow"
    if not all(map(torch.Tensor.is_contiguous, grads)) or \
            list(map(torch.Tensor.size, grads)) != _expected_grad_sizes(bucket, subset, fsdp_params):
        return "non-contiguous or reshaped gradients"
    return ""
