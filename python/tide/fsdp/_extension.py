"""FSDP2's all-gather extensions, gathered by TIDE: params whose sharded tensor defines
``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` (torchao's float8 training weights, torchao's
``NF4Tensor``, any user subclass).

For such a param FSDP2 all-gathers the *inputs* ``fsdp_pre_all_gather`` returns (one or more 1-D
tensors per param, any dtype: fp8 data and an fp32 scale, uint8 packed data, ...) and hands
``fsdp_post_all_gather`` one output per input: the W ranks' inputs back to back (rank-major) for a
param sharded on dim 0, concatenated along dim k for one sharded on dim k (chunk-cat). TIDE lays out
each input as a param of its own in the bucket's window, of u8 bytes (copied as they are, never
cast: TIDE computes on none of these dtypes) and sharded as the param, so the window holds exactly
those outputs, and ``fsdp_post_all_gather`` gets views of the window: FSDP2's copy-in of the inputs into
one flat buffer and its split copy-out never run, and the outputs (and so ``out=`` on the steps
after the first) are the same tensors every step. A plain param of the same group keeps its float
layout (cast from the shard into its slot, as in any bucket). The reduce-scatter side is TIDE's
usual one: gradients are plain tensors of the params' shapes.

The inputs' sizes and dtypes are fixed after the first all-gather (FSDP2 allocates its outputs once
from them); enable() asks for them once, by calling ``fsdp_pre_all_gather`` (as FSDP2's next
all-gather would: torchao's dynamic float8 scale all-reduces its amax over the mesh there, and every
rank calls enable; torch's random state is given back after it), and each all-gather checks them
again.

torchao's float8 weights skip ``fsdp_pre_all_gather``: TIDE's cast writes their e4m3 bytes straight
into the window from the high-precision shard and torchao's scale (_float8.py).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

import torch.distributed as dist

from .. import _tide
from . import _float8, _fsdp2
from ._dtypes import TIDE_TO_TORCH, TORCH_TO_TIDE


def uses_extension(param_group: _fsdp2.FSDPParamGroup) -> bool:
    return any(_fsdp2.has_extension(fp) for fp in param_group.fsdp_params)


def _probe_inputs(fp: _fsdp2.FSDPParam) -> list[torch.Tensor]:
    """The param's all-gather inputs, asked once at enable to size the layout: stock FSDP2 does
    not make this call, so what it draws from torch's random generators (an extension that rounds
    stochastically) is given back, and the next all-gather sees the stream stock's would."""
    device = _fsdp2.sharded_local_tensor(fp).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type="cuda"):
        return _fsdp2.extension_inputs(fp)


def _input_shape(fp: _fsdp2.FSDPParam, t: torch.Tensor, world: int, name: str) -> list[int]:
    """The bytes of all-gather input `t` of param `fp` as one u8 param of the layout, shaped so that
    TIDE's gather hands ``fsdp_post_all_gather`` what stock's copy-out does. On dim 0 that is the W
    ranks' inputs back to back. On dim k > 0 stock views each rank's input as the param's padded
    shard and concatenates the W of them along dim k (chunk-cat); the same shape in bytes (the
    last dim times the element size, an element's bytes being adjacent there) sharded on dim k
    makes TIDE place each rank's block where that concatenation puts it, in place."""
    dim = _fsdp2.shard_dim(fp)
    if dim == 0:
        return [world * t.numel() * t.element_size()]
    shard = list(_fsdp2.padded_shard_shape(fp))
    if t.numel() != math.prod(shard):
        raise ValueError(
            f"tide.fsdp: {name}: fsdp_pre_all_gather returned an input of {t.numel()} elements for a "
            f"param sharded on dim {dim}, expected the shard's {math.prod(shard)} ({shard}): FSDP2 "
            "views every input of a param sharded on a dim > 0 as the shard to concatenate them")
    shard[dim] *= world
    shard[-1] *= t.element_size()
    return shard


def _plain(t: torch.Tensor) -> torch.Tensor:
    """An all-gather input as the program reads it: its bytes at data_ptr(). A tensor subclass that
    runs its ops in ``__torch_dispatch__`` (a wrapper such as TwoTensor, e.g. an
    ``fsdp_pre_all_gather`` returning ``self`` or ``self.to(dtype)``) has no storage of its own
    (data_ptr() 0): it is copied into a plain tensor by its own copy_, as stock FSDP2's copy-in
    (``_foreach_copy_`` into the flat all-gather input) does. A plain tensor is read in place."""
    if not torch._C._dispatch_keys(t).has(torch._C.DispatchKey.Python):
        return t
    plain = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    with torch.no_grad():
        plain.copy_(t)
    return plain


class Entry:
    """One all-gather input in the bucket's gather layout: which layout param holds it (None for an
    empty input: no slot), its dtype and its numel per rank."""

    __slots__ = ("index", "dtype", "numel")

    def __init__(self, index: int | None, dtype: torch.dtype, numel: int) -> None:
        self.index, self.dtype, self.numel = index, dtype, numel

    def describe(self) -> list:
        return [str(self.dtype), self.numel]


def _same_e4m3(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal e4m3 bytes, a NaN (S.1111.111, either sign) equal to any NaN: the sign of a NaN
    cast from a NaN weight is not defined (torch's own CPU multiply gives either, by vector length)."""
    a, b = a.view(torch.uint8), b.view(torch.uint8)
    nan_a, nan_b = (a & 0x7F) == 0x7F, (b & 0x7F) == 0x7F
    return torch.equal(nan_a, nan_b) and torch.equal(a[~nan_a], b[~nan_b])


def _same_floats(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal fp32 tensors, a NaN equal to any NaN (a NaN weight's amax makes a NaN scale)."""
    nan_a, nan_b = a.isnan(), b.isnan()
    return torch.equal(nan_a, nan_b) and torch.equal(a[~nan_a].view(torch.int32), b[~nan_b].view(torch.int32))


class ExtensionGather:
    """The gather layout of a param group with extension params, and the hand-off to FSDP2: which
    tensors each param's all-gather reads, and the window views its outputs are."""

    def __init__(self, param_group: _fsdp2.FSDPParamGroup, param_name: _fsdp2.ParamName,
                 topology: _tide.Topology) -> None:
        self.world = topology.world
        self.fsdp_params = list(param_group.fsdp_params)
        self.entries: list[list[Entry]] = []  # per param, one Entry per all-gather input
        # Per param: whether TIDE casts its float8 all-gather itself (_float8.py), and why not.
        self.why_not_cast = [_float8.why_not_cast(fp, self.world) if _fsdp2.has_extension(fp) else None
                             for fp in self.fsdp_params]
        self.unchecked = any(why == "" for why in self.why_not_cast)  # the first all-gather compares
        specs = []
        self.names = [param_name(fp, i) for i, fp in enumerate(self.fsdp_params)]
        for i, (fp, name) in enumerate(zip(self.fsdp_params, self.names)):
            if self.why_not_cast[i] == "":  # e4m3 over the unsharded shape: FSDP2's rank-major output
                shard = _float8.shard(fp)
                self.entries.append([Entry(len(specs), _float8.E4M3, shard.numel())])
                specs.append(_tide.ParamSpec(name, list(_fsdp2.unsharded_shape(fp)), _tide.DType.e4m3,
                                             TORCH_TO_TIDE[shard.dtype], shard_dim=0))
                continue
            if not _fsdp2.has_extension(fp):
                orig, comm = _fsdp2.dtypes(fp)
                self.entries.append([Entry(len(specs), comm, _fsdp2.padded_shard_shape(fp).numel())])
                specs.append(_tide.ParamSpec(name, list(_fsdp2.unsharded_shape(fp)), TORCH_TO_TIDE[comm],
                                             TORCH_TO_TIDE[orig], shard_dim=_fsdp2.shard_dim(fp)))
                continue
            entries = []
            for j, t in enumerate(_probe_inputs(fp)):
                if t.numel() == 0:  # nothing to gather: its output is an empty tensor of its own
                    entries.append(Entry(None, t.dtype, 0))
                    continue
                entries.append(Entry(len(specs), t.dtype, t.numel()))
                specs.append(_tide.ParamSpec(f"{name}[all_gather_input {j}]", _input_shape(fp, t, self.world, name),
                                             _tide.DType.u8, _tide.DType.u8, shard_dim=_fsdp2.shard_dim(fp)))
            self.entries.append(entries)
        # None: every input is empty, nothing to gather (the group falls back: enable)
        self.layout = _tide.BucketLayout(specs, topology) if specs else None

    def describe(self) -> list:
        """What every rank must agree on (enable's identity check), per param: its all-gather
        inputs' dtypes and numels per rank, and whether TIDE casts them (None for a plain param)."""
        return [[*(e.describe() for e in entries), "cast by TIDE" if why == "" else "inputs"]
                if _fsdp2.has_extension(fp) else None
                for fp, entries, why in zip(self.fsdp_params, self.entries, self.why_not_cast)]

    def shards(self, fsdp_params: list[_fsdp2.FSDPParam], plain_shard: Callable[[int, int], torch.Tensor],
               reduce_amaxes: Callable[[torch.Tensor], torch.Tensor], capture: int = 0,
               path: str = "") -> list[torch.Tensor]:
        """What the all-gather program reads, one tensor per layout param: each extension param's
        all-gather inputs (``fsdp_pre_all_gather`` runs here, as in stock FSDP2's all-gather; it
        also records the metadata FSDP2 hands ``fsdp_post_all_gather``), the high-precision shard
        of a float8 weight TIDE casts (its scale in `self.scales`, from amaxes max-reduced over
        the ranks by `reduce_amaxes`), and `plain_shard(i)` for a plain param i. The inputs and
        scales must stay referenced until the program has read them. `capture`: the CUDA graph
        capture this all-gather is in (0: none), of group `path`; a float8 scale a replay could
        not compute again is refused there (_float8.scales)."""
        shards = []
        self.scales = [None] * len(self.layout.params)
        cast = [fp for fp, why in zip(fsdp_params, self.why_not_cast) if why == ""]
        scales = iter(_float8.scales(cast, capture, path, reduce_amaxes) if cast else ())
        for i, (fp, entries) in enumerate(zip(fsdp_params, self.entries)):
            if self.why_not_cast[i] == "":
                shard, scale = _float8.shard(fp), next(scales)
                self._check_cast_input(fp, entries[0], shard, scale)
                shards.append(shard)
                self.scales[entries[0].index] = scale
                continue
            if not _fsdp2.has_extension(fp):
                shards.append(plain_shard(i, entries[0].index))
                continue
            inputs = _fsdp2.extension_inputs(fp, clear=False)
            got = [(t.dtype, t.numel()) for t in inputs]
            want = [(e.dtype, e.numel) for e in entries]
            if got != want:
                raise RuntimeError(
                    f"tide.fsdp: {self.names[i]}: fsdp_pre_all_gather "
                    f"returned inputs {got} (dtype, numel), expected {want} as at tide.fsdp.enable "
                    "(FSDP2 too allocates its all-gather outputs once, from the first all-gather)")
            for t in inputs:
                if t.numel() == 0:  # no slot (its output is an empty tensor)
                    continue
                if not t.is_contiguous():  # FSDP2 flattens with view(-1): contiguous already
                    raise RuntimeError(f"tide.fsdp: an all-gather input of {_fsdp2.local_tensor_type(fp)} "
                                       "is not contiguous")
                shards.append(_plain(t))
        return shards

    def _check_cast_input(self, fp, entry: Entry, shard: torch.Tensor, scale: torch.Tensor) -> None:
        """What TIDE's cast will read is what enable laid out: the kernel reads the shard's bytes
        as the layout's dtype and numel, and the scale on the shard's device."""
        p = self.layout.params[entry.index]
        want = TIDE_TO_TORCH[p.shard_dtype]
        if (shard.dtype != want or shard.numel() != entry.numel or not shard.is_contiguous()
                or scale.device != shard.device):
            raise RuntimeError(
                f"tide.fsdp: {p.name}: torchao's float8 weight is now a {shard.dtype} shard of "
                f"{shard.numel()} elements (contiguous: {shard.is_contiguous()}; scale on {scale.device}), "
                f"expected a contiguous {want} shard of {entry.numel} with its scale on {shard.device} "
                "as at tide.fsdp.enable (model.to(dtype) after enable?): change the model before "
                "tide.fsdp.enable, or disable, change it and enable again")

    def scale_pointers(self) -> list[int]:
        """Per layout param, the address of its e4m3 cast's scale (0: none); [] without casts."""
        if not any(s is not None for s in self.scales):
            return []
        return [s.data_ptr() if s is not None else 0 for s in self.scales]

    def check_casts(self, fsdp_params: list[_fsdp2.FSDPParam], rank: int, group) -> None:
        """Once, after the first all-gather: TIDE's e4m3 bytes in the own slot and its scale are
        torchao's own (its ``fsdp_pre_all_gather`` on the same shard), on every rank; a difference
        anywhere raises on every rank (one all-reduce), naming the params that differ here."""
        self.unchecked = False
        differ = []
        for i, (fp, entries) in enumerate(zip(fsdp_params, self.entries)):
            if self.why_not_cast[i] != "":
                continue
            e = entries[0]
            data, s = _float8.torchao_cast(fp)
            mine = self.outputs[i][0][rank * e.numel:(rank + 1) * e.numel]
            if not (_same_e4m3(mine, data.reshape(-1)) and _same_floats(self.scales[e.index], s)):
                differ.append(self.layout.params[e.index].name)
        # The group's backend carries the flag: NCCL a device tensor, gloo a host one.
        device = self.outputs[0][0].device if "nccl" in str(dist.get_backend(group)) else "cpu"
        flag = torch.tensor([len(differ)], dtype=torch.int32, device=device)
        dist.all_reduce(flag, group=group)
        if int(flag.item()) > 0:
            raise RuntimeError(
                f"tide.fsdp: TIDE's float8 cast differs from torchao's own in {int(flag.item())} "
                f"(param, rank) pair(s) of the group (on this rank: {differ or 'none'}); please report "
                "it with the torch and torchao versions (tide.fsdp.disable(model) trains with stock FSDP2)")

    def input_numels(self) -> list[list[int]]:
        return [[e.numel for e in entries] for entries in self.entries]

    def input_dtypes(self) -> list[list[torch.dtype]]:
        return [[e.dtype for e in entries] for entries in self.entries]

    def set_outputs(self, raw: list[torch.Tensor]) -> None:
        """Builds, once, each param's all-gather outputs as FSDP2 keeps them (1-D, rank-major, the
        input's dtype) from `raw`, the bucket's per-layout-param tensors over its fixed address:
        the same tensor objects every step, so ``fsdp_post_all_gather(out=...)`` finds the outputs
        its first call wrapped."""
        self.outputs = [[raw[e.index].view(e.dtype) if e.index is not None
                         else torch.empty(0, dtype=e.dtype, device=raw[0].device) for e in entries]
                        for entries in self.entries]

    def copy_out(self, fsdp_params: list[_fsdp2.FSDPParam]) -> None:
        """Nothing to copy: each param's all-gather outputs are its window views (set once)."""
        for fp, outputs in zip(fsdp_params, self.outputs):
            _fsdp2.set_all_gather_outputs(fp, outputs)
