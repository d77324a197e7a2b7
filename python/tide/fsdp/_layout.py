"""TIDE's all-gather through FSDP2's official layout hook (PyTorch main, for torch 2.15; not in
2.14.1), where the version offers it: instead of hooking foreach_all_gather,
foreach_all_gather_copy_out and FSDPParam.free_unsharded_param, enable() installs, per handled
param group, a ``BackendOwnedAllGatherLayout`` with ``module.set_all_gather_layout(...)``:

- ``prepare_output``: checks that FSDP's flat input is the bucket's (one payload per param, the
  padded shard, the communication dtype) and selects TIDE's layout for the call;
- ``copy_in``: packs nothing (TIDE's program reads each shard where it lies): a one-element stand-in
  for the "independent input storage", as ReduceScatterComm's input;
- ``comm`` (installed with the layout): runs the bucket's all-gather program, which casts each
  shard into its slot and pushes it to every peer's window at the bucket's fixed address; its
  ``allocate`` gives a stand-in too (no rank-major output buffer exists);
- ``finalize_outputs``: returns the per-param views of the fixed address, with no buffers (backend
  owned): FSDP adopts them once, and later finalizes return the same objects (already refilled in
  place by the collective, so FSDP copies nothing);
- ``release_output``: after reshard, the window goes back to the pool as the vacated window the
  reduce-scatter stages in (Slot-Reuse); idempotent.

The reduce-scatter side keeps TIDE's hooks (foreach_reduce, foreach_reduce_scatter_copy_in):
docs/ARCHITECTURE.md says why. Written against the contract of _all_gather_layout.py in the stored
PyTorch main revision that has BackendOwnedAllGatherLayout (the tests' fake says which).
"""

from __future__ import annotations

import math

import torch

from . import _dispatch, _fsdp2
from ._bucket import TIDE_TO_TORCH

# The hooks TIDE still needs when every handled group's all-gather goes through a layout.
RS_HOOKS = ("foreach_reduce", "foreach_reduce_scatter_copy_in")

_classes: dict = {}  # id(layout api module) -> (layout class, comm class)


def _standin(numel: int, dtype, device) -> torch.Tensor:
    return torch.empty(1 if numel else 0, dtype=dtype, device=device).expand(numel)


def _make_classes(api):
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

    class TideAllGatherComm(AllGather):
        """The layout's collective: TIDE's all-gather program into the bucket's window."""

        def __init__(self, bucket):
            self.bucket = bucket
            self.calls = 0

        def allocate(self, size, *, dtype, device):
            return _standin(math.prod(int(s) for s in size), dtype, device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            bucket = self.bucket
            bucket.check_state(None)
            # FSDP calls this on its all-gather stream (after its copy-in stream): TIDE's program
            # reads the shards and writes the window on it; FSDP records the event after.
            stream = torch.cuda.current_stream(bucket.pool.device) if bucket.cuda else None
            with torch.no_grad():
                bucket.all_gather(stream)
            self.calls += 1
            return None

    class TideAllGatherLayout(api.BackendOwnedAllGatherLayout):
        """One handled param group's all-gather layout: outputs are views of its fixed address."""

        def __init__(self, bucket):
            self.bucket = bucket
            self.comm = TideAllGatherComm(bucket)
            self.finalized = self.released = 0

        def prepare_output(self, input_metadata):
            bucket = self.bucket
            expected = [p.shard_numel for p in bucket.layout.params]
            dtypes = {TIDE_TO_TORCH[p.dtype] for p in bucket.layout.params}
            if (list(input_metadata.input_split_sizes) != expected or dtypes != {input_metadata.dtype}
                    or input_metadata.world_size != bucket.layout.world):
                # The default layout would copy a rank-major output into the adopted outputs,
                # which are TIDE's window: refuse instead of writing it behind TIDE's back.
                raise RuntimeError(
                    f"tide.fsdp: param group {bucket.path}: FSDP's all-gather input "
                    f"{list(input_metadata.input_split_sizes)} {input_metadata.dtype} (W = "
                    f"{input_metadata.world_size}) is not the bucket's {expected} {sorted(map(str, dtypes))} "
                    f"(W = {bucket.layout.world}): the group changed after tide.fsdp.enable")
            return bucket  # per-call metadata: valid until finalized (the bucket outlives the call)

        def copy_in(self, all_gather_inputs, all_gather_output, all_gather_input_split_sizes,
                    all_gather_input_numel, rank):
            return _standin(all_gather_input_numel, all_gather_output.dtype, all_gather_output.device), \
                all_gather_output

        def finalize_outputs(self, metadata):
            bucket = self.bucket
            if bucket.window is None or bucket.vacated:
                raise RuntimeError(f"tide.fsdp: param group {bucket.path}: FSDP finalizes an all-gather "
                                   "TIDE's comm did not run (another comm replaced the layout's?)")
            bucket._ensure_param_outputs()
            self.finalized += 1
            # No buffers: the storage is TIDE's (the fixed address), kept across reshard.
            return api.AllGatherOutputs(tensors=[[t] for t in bucket.param_outputs])

        def release_output(self):
            bucket = self.bucket
            if bucket.window is None or bucket.vacated:
                return  # no output active: idempotent
            bucket.on_params_freed()  # the vacated window: the reduce-scatter's staging (Slot-Reuse)
            self.released += 1

    return TideAllGatherLayout, TideAllGatherComm


def layout_for(bucket):
    api = _fsdp2.layout_api()
    if id(api) not in _classes:
        _classes[id(api)] = _make_classes(api)
    return _classes[id(api)][0](bucket)


def _reachable(bucket) -> bool:
    """Whether the version's layout hook can take this bucket's all-gather (not for a module with
    several param groups: the setter would be ambiguous; not with all-gather extensions, which
    the hook's layouts exclude: those keep TIDE's function hooks)."""
    return (_fsdp2.has_all_gather_layout() and _fsdp2.layout_owner(bucket.param_group) is not None
            and bucket.gather is None)


def replacements_for(buckets) -> dict:
    """The hook replacements TIDE needs beside its layouts: the reduce-scatter's two when every
    bucket's all-gather goes through a layout, else all five."""
    if buckets and all(_reachable(b) for b in buckets):
        return {name: _dispatch.REPLACEMENTS[name] for name in RS_HOOKS}
    return _dispatch.REPLACEMENTS


def install(buckets) -> None:
    """Installs a TIDE layout on every bucket the version's layout hook can reach."""
    for b in buckets:
        if _reachable(b):
            b.ag_layout = layout_for(b)
            _fsdp2.install_all_gather_layout(b.param_group, b.ag_layout)


def uninstall(buckets) -> None:
    for b in buckets:
        if getattr(b, "ag_layout", None) is not None:
            _fsdp2.remove_all_gather_layout(b.param_group)
            b.ag_layout = None
