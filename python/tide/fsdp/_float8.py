"""torchao's float8 weights, cast by TIDE: for a param whose sharded tensor is torchao's
``WeightWithDynamicFloat8CastTensor`` (what ``Float8LinearConfig(enable_fsdp_float8_all_gather=True)``
makes), TIDE skips its ``fsdp_pre_all_gather`` tensor: the all-gather's cast writes
e4m3(shard x scale) straight into the rank's slot (saturated, one fp32 multiply, as torchao's eager
cast), the copy engines push it, and ``fsdp_post_all_gather`` gets the window's e4m3 view with the
scale as its metadata, as from torchao's own ``fsdp_pre_all_gather``. The scale is torchao's own:
its precomputed scale (``precompute_float8_dynamic_scale_for_fsdp``) or, per all-gather, its
``amax_to_scale`` of the weight's amax (torchao's ``tensor_to_amax``) max-reduced over the shard
group, where TIDE exchanges a group's amaxes in one collective of its own (AmaxExchange) instead
of torchao's all-reduce per weight, so that CUDA graphs capture it over any backend. What
torchao's eager cast costs beside one pass (a multiply and a clamp through fp32 temporaries, then
the conversion) and the copy of the fp8 shard into the slot are gone.

Only for the torchao releases whose cast TIDE was checked against (KNOWN_TORCHAO) and the cases it
covers; everything else takes the generic extension path (_extension.py), whose result is
torchao's by construction. The first all-gather of each bucket compares TIDE's bytes and scale
with torchao's own ``fsdp_pre_all_gather`` on every rank, and raises on every rank if they differ.
"""

from __future__ import annotations

from typing import Callable

import torch

from .. import _tide
from . import _fsdp2
from ._capture import not_capturable
from ._memory import bytes_at

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


def scales(fps: list, capture: int, path: str,
           reduce_amaxes: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """Per float8 weight of `fps` (each one TIDE casts), its scale for this all-gather as torchao's
    ``fsdp_pre_all_gather`` computes it, recorded for ``fsdp_post_all_gather`` as FSDP2 records
    torchao's own metadata: its precomputed scale, or a dynamic one, torchao's ``amax_to_scale`` of
    its amax max-reduced over the shard group. torchao all-reduces each weight's amax on its own (a
    collective a CUDA graph captures only over NCCL); here `reduce_amaxes` (an AmaxExchange) reduces
    all of the group's at once, in a collective a graph captures on any backend. The max is exact,
    so the scales are torchao's bitwise. In a CUDA graph capture (`capture`, of group `path`) a
    precomputed scale is refused: precompute_float8_dynamic_scale_for_fsdp makes new tensors every
    step, and a replay would read the captured step's."""
    from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax
    weights = [_fsdp2.sharded_local_tensor(fp) for fp in fps]
    found = [w._precomputed_scale for w in weights]
    if capture and any(s is not None for s in found):
        raise not_capturable(path, "its float8 weights use torchao's precomputed scales "
                             "(precompute_float8_dynamic_scale_for_fsdp makes new tensors every "
                             "step; a replay would read the captured step's)",
                             "capture with dynamic scales (torchao's default, as torchtitan trains)")
    dynamic = [k for k, s in enumerate(found) if s is None]
    if dynamic:
        # fp32 holds a bf16 or fp16 amax exactly; amax_to_scale is elementwise, so each weight's
        # scale is what torchao's call on its own amax makes.
        amaxes = torch.stack([tensor_to_amax(weights[k]._tensor).float() for k in dynamic])
        computed = amax_to_scale(reduce_amaxes(amaxes), E4M3)
        for j, k in enumerate(dynamic):
            found[k] = computed[j]
    result = []
    for fp, w, s in zip(fps, weights, found):
        if s.dtype != torch.float32 or s.numel() != 1:
            raise RuntimeError(f"tide.fsdp: torchao's float8 scale is {s.dtype} of shape {tuple(s.shape)}, "
                               "expected one float32 (torchao changed?)")
        s = s.contiguous()
        _fsdp2.record_extension_inputs(fp, (s,), [w._tensor.size()])
        result.append(s)
    return result


class AmaxExchange:
    """The max over the shard group's ranks of `count` fp32 amaxes per rank (the float8 weights of
    one group TIDE casts), as one TIDE all-gather of every rank's amaxes into a small window of the
    group's pool, then the max over the ranks on the current stream: what torchao's amax all-reduce
    computes, by a collective that CUDA graphs capture (its replays exchange the amaxes again)."""

    def __init__(self, count: int, topology: _tide.Topology, rank: int, bucket_id: int,
                 across_nodes: _tide.AcrossNodesOptions) -> None:
        spec = _tide.ParamSpec("float8 amaxes", [topology.world * count], _tide.DType.fp32, _tide.DType.fp32)
        self.layout = _tide.BucketLayout([spec], topology)
        self.program = _tide.plan_all_gather(self.layout, rank, bucket_id, across_nodes)
        self.count, self.rank, self.world = count, rank, topology.world

    def __call__(self, amaxes: torch.Tensor, pool, capture: int, path: str, lease) -> torch.Tensor:
        """The max over ranks of `amaxes` (this rank's, `count` fp32 on the pool's device), using a
        window of `pool` (a _pool.WindowPool) during a CUDA graph capture `capture` (0: none) of
        group `path`, whose windows `lease` (a _window.WindowLease) holds."""
        if amaxes.dtype != torch.float32 or amaxes.shape != (self.count,) or not amaxes.is_contiguous():
            raise ValueError(f"tide.fsdp: param group {path}: float8 amaxes are {amaxes.dtype} of shape "
                             f"{tuple(amaxes.shape)}, expected {self.count} contiguous float32")
        p = self.layout.params[0]
        windows = pool.of_size(self.program.window_bytes)
        window = windows.acquire(capture=capture, path=path, lease=lease)
        try:
            stream = torch.cuda.current_stream(pool.device) if pool.device.type == "cuda" else None
            if stream is not None:
                window.use_on(stream, capture)
            window.run(self.program, [amaxes.data_ptr()])
            gathered = bytes_at(window.shared.data_ptr(self.rank) + p.window_offset,
                                self.world * p.slot_bytes, pool.device)
            maxima = gathered.view(self.world, p.slot_bytes)[:, :4 * self.count].view(torch.float32).amax(0)
            if stream is not None:  # the window is written again after the max has read it
                window.set_ready(stream.record_event(), capture)
            if capture:
                lease.record(window, capture)
        finally:
            windows.release(window)
        return maxima


def torchao_cast(fp) -> tuple:
    """torchao's own all-gather input and scale for the param's current shard (its
    ``fsdp_pre_all_gather``, called directly: FSDP2's record is left alone)."""
    local = _fsdp2.sharded_local_tensor(fp)
    (data,), (s,) = local.fsdp_pre_all_gather(_fsdp2.shard_mesh(fp))
    return data, s
