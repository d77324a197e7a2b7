"""FSDP2's all-gather extensions, gathered by TIDE: params whose sharded tensor defines
``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` (torchao's float8 training weights, torchao's
``NF4Tensor``, any user subclass).

For such a param FSDP2 all-gathers the *inputs* ``fsdp_pre_all_gather`` returns (one or more 1-D
tensors per param, any dtype: fp8 data and an fp32 scale, uint8 packed data, ...) and hands
``fsdp_post_all_gather`` one output per input, each the W ranks' inputs back to back (rank-major).
TIDE lays out each input as a param of its own in the bucket's window, of u8 bytes (copied as they
are, never cast: TIDE computes on none of these dtypes), so the window holds exactly those rank-major
outputs, and ``fsdp_post_all_gather`` gets views of the window: FSDP2's copy-in of the inputs into
one flat buffer and its split copy-out never run, and the outputs (and so ``out=`` on the steps
after the first) are the same tensors every step. A plain param of the same group keeps its float
layout (cast from the shard into its slot, as in any bucket). The reduce-scatter side is TIDE's
usual one: gradients are plain tensors of the params' shapes.

The inputs' sizes and dtypes are fixed after the first all-gather (FSDP2 allocates its outputs once
from them); enable() asks for them once, by calling ``fsdp_pre_all_gather`` (as FSDP2's next
all-gather would: torchao's dynamic float8 scale all-reduces its amax over the mesh there, and every
rank calls enable), and each all-gather checks them again.
"""

from __future__ import annotations

from typing import Callable

import torch

from .. import _tide
from . import _fsdp2
from ._bucket import TORCH_TO_TIDE


def uses_extension(param_group: _fsdp2.FSDPParamGroup) -> bool:
    return any(_fsdp2.has_extension(fp) for fp in param_group.fsdp_params)


class Entry:
    """One all-gather input in the bucket's gather layout: which layout param holds it, its dtype
    and its numel per rank."""

    __slots__ = ("index", "dtype", "numel")

    def __init__(self, index: int, dtype: torch.dtype, numel: int) -> None:
        self.index, self.dtype, self.numel = index, dtype, numel

    def describe(self) -> list:
        return [str(self.dtype), self.numel]


class ExtensionGather:
    """The gather layout of a param group with extension params, and the hand-off to FSDP2: which
    tensors each param's all-gather reads, and the window views its outputs are."""

    def __init__(self, param_group: _fsdp2.FSDPParamGroup, param_name: _fsdp2.ParamName,
                 topology: _tide.Topology) -> None:
        self.world = topology.world
        self.fsdp_params = list(param_group.fsdp_params)
        self.entries: list[list[Entry]] = []  # per param, one Entry per all-gather input
        specs = []
        for i, fp in enumerate(param_group.fsdp_params):
            name = param_name(fp, i)
            if not _fsdp2.has_extension(fp):
                orig, comm = _fsdp2.dtypes(fp, param_group)
                self.entries.append([Entry(len(specs), comm, _fsdp2.padded_shard_shape(fp).numel())])
                specs.append(_tide.ParamSpec(name, list(_fsdp2.unsharded_shape(fp)), TORCH_TO_TIDE[comm],
                                             TORCH_TO_TIDE[orig], shard_dim=_fsdp2.shard_dim(fp)))
                continue
            entries = []
            for j, t in enumerate(_fsdp2.extension_inputs(fp)):
                entries.append(Entry(len(specs), t.dtype, t.numel()))
                nbytes = self.world * t.numel() * t.element_size()
                specs.append(_tide.ParamSpec(f"{name}[all_gather_input {j}]", [nbytes],
                                             _tide.DType.u8, _tide.DType.u8, shard_dim=0))
            self.entries.append(entries)
        self.layout = _tide.BucketLayout(specs, topology)

    def describe(self) -> list:
        """What every rank must agree on (enable's identity check), per param: its all-gather
        inputs' dtypes and numels per rank (None for a plain param)."""
        return [[e.describe() for e in entries] if _fsdp2.has_extension(fp) else None
                for fp, entries in zip(self.fsdp_params, self.entries)]

    def shards(self, fsdp_params: list[_fsdp2.FSDPParam],
               plain_shard: Callable[[int, int], torch.Tensor]) -> list[torch.Tensor]:
        """What the all-gather program reads, one tensor per layout param: each extension param's
        all-gather inputs (``fsdp_pre_all_gather`` runs here, as in stock FSDP2's all-gather; it
        also records the metadata FSDP2 hands ``fsdp_post_all_gather``), and `plain_shard(i)` for
        a plain param i. The inputs must stay referenced until the program has read them."""
        shards = []
        for i, (fp, entries) in enumerate(zip(fsdp_params, self.entries)):
            if not _fsdp2.has_extension(fp):
                shards.append(plain_shard(i, entries[0].index))
                continue
            inputs = _fsdp2.extension_inputs(fp, clear=False)
            got = [(t.dtype, t.numel()) for t in inputs]
            want = [(e.dtype, e.numel) for e in entries]
            if got != want:
                raise RuntimeError(
                    f"tide.fsdp: {self.layout.params[entries[0].index].name}: fsdp_pre_all_gather "
                    f"returned inputs {got} (dtype, numel), expected {want} as at tide.fsdp.enable "
                    "(FSDP2 too allocates its all-gather outputs once, from the first all-gather)")
            for t in inputs:
                if not t.is_contiguous():  # FSDP2 flattens with view(-1): contiguous already
                    raise RuntimeError(f"tide.fsdp: an all-gather input of {_fsdp2.local_tensor_type(fp)} "
                                       "is not contiguous")
                shards.append(t)
        return shards

    def input_numels(self) -> list[list[int]]:
        return [[e.numel for e in entries] for entries in self.entries]

    def input_dtypes(self) -> list[list[torch.dtype]]:
        return [[e.dtype for e in entries] for entries in self.entries]

    def set_outputs(self, raw: list[torch.Tensor]) -> None:
        """Builds, once, each param's all-gather outputs as FSDP2 keeps them (1-D, rank-major, the
        input's dtype) from `raw`, the bucket's per-layout-param tensors over its fixed address:
        the same tensor objects every step, so ``fsdp_post_all_gather(out=...)`` finds the outputs
        its first call wrapped."""
        self.outputs = [[raw[e.index].view(e.dtype) for e in entries] for entries in self.entries]

    def copy_out(self, fsdp_params: list[_fsdp2.FSDPParam]) -> None:
        """Nothing to copy: each param's all-gather outputs are its window views (set once)."""
        for fp, outputs in zip(fsdp_params, self.outputs):
            _fsdp2.set_all_gather_outputs(fp, outputs)
