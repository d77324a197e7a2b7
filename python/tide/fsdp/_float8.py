"""torchao's float8 weights, cast by TIDE: for a param whose sharded tensor is torchao's
``WeightWithDynamicFloat8CastTensor`` (what ``Float8LinearConfig(enable_fsdp_float8_all_gather=True)``
makes), TIDE skips its ``fsdp_pre_all_gather`` tensor: the all-gather's cast writes
e4m3(shard x scale) straight into the rank's slot (saturated, one fp32 multiply, as torchao's eager
cast), the copy engines push it, and ``fsdp_post_all_gather`` gets the window's e4m3 view with the
scale as its metadata, as from torchao's own ``fsdp_pre_all_gather``. The scale is torchao's own:
its precomputed scale (``precompute_float8_dynamic_scale_for_fsdp``) or, per all-gather, its
``tensor_to_scale`` with the amax all-reduced over the shard mesh, as its ``fsdp_pre_all_gather``
computes it (its abs, max and all-reduce stay torchao's). What torchao's eager cast costs beside
one pass (a multiply and a clamp through fp32 temporaries, then the conversion) and the copy of
the fp8 shard into the slot are gone.

Only for the torchao releases whose cast TIDE was checked against (KNOWN_TORCHAO) and the cases it
covers; everything else takes the generic extension path (_extension.py), whose result is
torchao's by construction. The first all-gather of each bucket compares TIDE's bytes and scale
with torchao's own ``fsdp_pre_all_gather`` on every rank, and raises on every rank if they differ.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import _fsdp2
from ._capture import not_capturable

# torchao releases whose float8 weight cast (x.to(float32) * scale, clamp to +-448, to e4m3fn) and
# fsdp_pre_all_gather TIDE reproduces; others use the generic path.
KNOWN_TORCHAO = ("0.17.", "0.18.")
E4M3 = torch.float8_e4m3fn


def _torchao_weight_class():
    try:
        import torchao
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
    except ImportError:
        return None
    return WeightWithDynamicFloat8CastTensor if torchao.__version__.startswith(KNOWN_TORCHAO) else None


def why_not_cast(fp, world: int) -> str:
    """"" when TIDE casts this param's float8 all-gather itself, else why not (it then takes the
    generic extension path)."""
    cls = _torchao_weight_class()
    local = _fsdp2.sharded_local_tensor(fp)
    if cls is None or type(local) is not cls:
        return "not torchao's float8 weight (of a release in KNOWN_TORCHAO)"
    if "fsdp_pre_all_gather" in vars(local) or "fsdp_post_all_gather" in vars(local):
        return "its extension methods were replaced on the tensor"
    if local._dtype != E4M3:
        return f"its float8 dtype is {local._dtype}, TIDE casts to {E4M3}"
    if local._tensor.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"its shard is {local._tensor.dtype}"
    if _fsdp2.offloaded(fp):
        return "its shard is offloaded to the CPU"
    if _fsdp2.shard_dim(fp) != 0 or _fsdp2.unsharded_shape(fp)[0] % world != 0:
        return "its shard is padded or not on dim 0 (torchao's own cast does not pad it either)"
    if not local._tensor.is_contiguous():
        return "its shard is not contiguous"
    return ""


def shard(fp) -> torch.Tensor:
    """The high-precision shard the cast reads."""
    local = _fsdp2.sharded_local_tensor(fp)
    if not isinstance(getattr(local, "_tensor", None), torch.Tensor):
        raise RuntimeError(f"tide.fsdp: a float8 weight TIDE casts is now a {type(local).__name__}, not "
                           "torchao's float8 weight as at tide.fsdp.enable: change the model before "
                           "tide.fsdp.enable, or disable, change it and enable again")
    return local._tensor


def scale(fp, capture: int = 0, path: str = "") -> torch.Tensor:
    """The param's scale for this all-gather, as torchao's ``fsdp_pre_all_gather`` computes it (for
    a dynamic scale: an all-reduce of the amax over the shard mesh, so every rank calls this for
    the same params in the same order), recorded for ``fsdp_post_all_gather`` as FSDP2 records
    torchao's own metadata. In a CUDA graph capture (`capture`, of group `path`) the scale must
    be one a replay computes again: a dynamic one over a process group whose all-reduce is
    captured (NCCL's)."""
    local = _fsdp2.sharded_local_tensor(fp)
    if capture:
        _refuse_uncapturable_scale(local, fp, path)
    if local._precomputed_scale is not None:
        s = local._precomputed_scale
    else:
        from torchao.float8.float8_utils import tensor_to_scale
        s = tensor_to_scale(local._tensor, local._dtype, reduce_amax=True, device_mesh=_fsdp2.shard_mesh(fp))
    if s.dtype != torch.float32 or s.numel() != 1:
        raise RuntimeError(f"tide.fsdp: torchao's float8 scale is {s.dtype} of shape {tuple(s.shape)}, "
                           "expected one float32 (torchao changed?)")
    s = s.contiguous()
    _fsdp2.record_extension_inputs(fp, (s,), [local._tensor.size()])
    return s


def _refuse_uncapturable_scale(local, fp, path: str) -> None:
    if local._precomputed_scale is not None:
        raise not_capturable(path, "its float8 weights use torchao's precomputed scales "
                             "(precompute_float8_dynamic_scale_for_fsdp makes new tensors every "
                             "step; a replay would read the captured step's)",
                             "capture with dynamic scales (torchao's default, as torchtitan trains)")
    backends = {str(dist.get_backend(g)) for g in _fsdp2.shard_mesh(fp).get_all_groups()}
    backend = next((b for b in sorted(backends) if "nccl" not in b), None)
    if backend is not None:
        raise not_capturable(path, "its float8 weights' dynamic scales all-reduce their amax over "
                             f"the '{backend}' shard group (torchao's tensor_to_scale), which "
                             "cannot be captured", "give the group an NCCL backend (one GPU per "
                             "rank), or capture without float8 all-gather")


def torchao_cast(fp) -> tuple:
    """torchao's own all-gather input and scale for the param's current shard (its
    ``fsdp_pre_all_gather``, called directly: FSDP2's record is left alone)."""
    local = _fsdp2.sharded_local_tensor(fp)
    (data,), (s,) = local.fsdp_pre_all_gather(_fsdp2.shard_mesh(fp))
    return data, s
