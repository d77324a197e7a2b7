"""TIDE's versions of the FSDP2 functions it hooks (_hooks.py installs them): handled buckets go to
TIDE, everything else to the stock function."""

from __future__ import annotations

import logging
import threading

import torch
import torch.distributed as dist

from . import _capture, _fallbacks, _fsdp2, _hooks
from ._bucket import Bucket, ReduceScatterComm
from ._capture import not_capturable

log = logging.getLogger("tide.fsdp")
_logged: set = set()
_local = threading.local()  # reduce-scatter comms between foreach_reduce and its copy-in (per rank thread)


def _log_once(key: tuple, message: str, *args: object) -> None:
    if key not in _logged:
        _logged.add(key)
        log.warning(message, *args)


def _bucket_of(fsdp_params: list[_fsdp2.FSDPParam] | None) -> Bucket | None:
    if not fsdp_params:
        return None
    bucket = getattr(fsdp_params[0], "_tide_bucket", None)
    if bucket is None or any(getattr(fp, "_tide_bucket", None) is not bucket for fp in fsdp_params):
        return None
    return bucket


def foreach_all_gather(*args: object, **kwargs: object) -> _fsdp2.AllGatherResult | None:
    call = _hooks.Call("foreach_all_gather", args, kwargs)
    fsdp_params = call.get("fsdp_params")
    bucket = _bucket_of(fsdp_params)
    if bucket is not None and len(fsdp_params) != len(bucket.fsdp_params):
        _refuse_stock_capture(bucket, "this all-gather", "it gathers part of the group")
        bucket = None
    if bucket is None:
        return _hooks.stock("foreach_all_gather")(*args, **kwargs)
    bucket.check_state(call.get("all_gather_comm"))
    with torch.no_grad():
        return bucket.all_gather(call.get("all_gather_stream") if bucket.cuda else None)


def foreach_all_gather_copy_out(all_gather_result: _fsdp2.AllGatherResult, fsdp_params: list[_fsdp2.FSDPParam],
                                group: dist.ProcessGroup, *args: object, **kwargs: object) -> None:
    bucket = _bucket_of(fsdp_params)
    if bucket is None:
        return _hooks.stock("foreach_all_gather_copy_out")(all_gather_result, fsdp_params, group, *args, **kwargs)
    if not bucket.owns(all_gather_result):
        # A stock all-gather's output for a bucket TIDE owns: copying it out would build the params
        # on a buffer TIDE's next all-gather never writes (a silent wrong result).
        raise RuntimeError(f"tide.fsdp: param group {bucket.path}: an all-gather that TIDE did not run "
                           "is being copied out (an unshard issued before tide.fsdp.enable, or code "
                           "that replaced foreach_all_gather without calling the original)")
    if all_gather_result.all_gather_event is not None:  # as stock: compute waits for the gather
        torch.cuda.current_stream(bucket.pool.device).wait_event(all_gather_result.all_gather_event)
    bucket.copy_out()
    return None


def foreach_reduce(*args: object, **kwargs: object) -> object:
    call = _hooks.Call("foreach_reduce", args, kwargs)
    fsdp_params, grads = call.get("fsdp_params"), call.get("unsharded_grads")
    bucket = _bucket_of(fsdp_params)
    if bucket is None:
        return _hooks.stock("foreach_reduce")(*args, **kwargs)
    subset = tuple(map(bucket.index.__getitem__, map(id, fsdp_params)))
    reason = _fallbacks.reduce_scatter_reason(bucket, subset, fsdp_params, grads, call)
    if reason:
        _refuse_stock_capture(bucket, "this reduce-scatter", reason)
        _log_once(("rs", bucket.path, reason), "tide.fsdp: param group %s: this reduce-scatter runs "
                  "stock FSDP2: %s", bucket.path, reason)
        return _hooks.stock("foreach_reduce")(*args, **kwargs)
    if call.get("all_reduce_group") is not None and call.get("all_reduce_grads"):  # HSDP, not a no-sync micro-batch
        _refuse_stock_capture(bucket, "this reduce-scatter's all-reduce across replicas (HSDP)",
                              "stock FSDP2 runs it after TIDE's reduce-scatter",
                              call.get("all_reduce_group"))
    comm = ReduceScatterComm(bucket, subset, call.get("gradient_divide_factor"))
    pending = _pending_comms()
    pending.append(comm)
    try:
        args, kwargs = call.with_argument("reduce_scatter_comm", comm)
        with _fsdp2.gradients_in_place(fsdp_params, grads):
            return _hooks.stock("foreach_reduce")(*args, **kwargs)
    finally:
        pending.remove(comm)


def _refuse_stock_capture(bucket: Bucket, what: str, reason: str,
                          group: dist.ProcessGroup | None = None) -> None:
    """A collective stock FSDP2 runs (`what`, because of `reason`) is captured by the process
    group's own (`group`, by default the bucket's): NCCL's can be, gloo's cannot (ranks sharing a
    GPU), which is refused here, naming the group and the reason."""
    if _capture.current_capture(bucket.pool.device):
        backend = str(dist.get_backend(group or bucket.group))
        if "nccl" not in backend:
            raise not_capturable(bucket.path, f"{what} runs stock FSDP2 ({reason}) over a "
                                 f"'{backend}' process group", "remove the cause, or give the "
                                 "group an NCCL backend, whose collectives can be captured")


def _pending_comms() -> list[ReduceScatterComm]:
    if not hasattr(_local, "comms"):
        _local.comms = []
    return _local.comms


def foreach_reduce_scatter_copy_in(unsharded_grads: list[torch.Tensor], reduce_scatter_input: torch.Tensor,
                                   world_size: int) -> None:
    for comm in _pending_comms():
        if reduce_scatter_input is comm.input_standin:
            comm.grads = list(unsharded_grads)  # keeps them alive until TIDE-RS has read them
            return None
    return _hooks.stock("foreach_reduce_scatter_copy_in")(unsharded_grads, reduce_scatter_input, world_size)


def free_unsharded_param(self: _fsdp2.FSDPParam) -> None:
    bucket = getattr(self, "_tide_bucket", None)
    if bucket is None:
        return _hooks.stock("free_unsharded_param")(self)
    bucket.on_param_freed(self)
    return None


def unshard(self: _fsdp2.FSDPParamGroup, *args: object, **kwargs: object) -> None:
    """FSDP2's unshard, after TIDE decided whether the unsharded parameters FSDP2 holds can be
    trusted (Bucket.before_unshard)."""
    bucket = _bucket_of(self.fsdp_params)
    if bucket is not None:
        _forget_evaluations(self, bucket)
        bucket.before_unshard()
    return _hooks.stock("unshard")(self, *args, **kwargs)


def _forget_evaluations(param_group: _fsdp2.FSDPParamGroup, bucket: Bucket) -> None:
    """Where a forward with autograd on begins: FSDP2 records forwards under torch.no_grad too (an
    evaluation), in the order its next backward prefetches by, and clears the record only when a
    backward ends. After an evaluation, that backward's last group then prefetches the group the
    evaluation recorded last, whose own backward has run: an all-gather that nothing reads, which
    a CUDA graph captured there would record and every replay repeat. The record goes
    when every group in it is TIDE's and ran only forwards under torch.no_grad since its last
    backward; one that may hold a forward with autograd on stays (its backward will come). Only
    a group with such a record looks (a step after no evaluation costs nothing here)."""
    if not (_fsdp2.in_forward(param_group) and torch.is_grad_enabled() and bucket.no_grad_forwards_only()):
        return
    recorded = _fsdp2.recorded_forward_groups(param_group)
    if recorded and all((b := _bucket_of(g.fsdp_params)) is not None and b.no_grad_forwards_only()
                        for g in recorded):
        _fsdp2.forget_recorded_forwards(param_group)


REPLACEMENTS = {
    "foreach_all_gather": foreach_all_gather,
    "foreach_all_gather_copy_out": foreach_all_gather_copy_out,
    "foreach_reduce": foreach_reduce,
    "foreach_reduce_scatter_copy_in": foreach_reduce_scatter_copy_in,
    "free_unsharded_param": free_unsharded_param,
    "unshard": unshard,
}
