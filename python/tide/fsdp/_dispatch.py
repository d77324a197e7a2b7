"""TIDE's versions of the FSDP2 functions it hooks (_hooks.py installs them): handled buckets go to
TIDE, everything else to the stock function."""

from __future__ import annotations

import logging
import threading

import torch

from . import _fsdp2, _hooks
from ._bucket import TORCH_TO_TIDE, ReduceScatterComm

log = logging.getLogger("tide.fsdp")
_logged: set = set()
_local = threading.local()  # reduce-scatter comms between foreach_reduce and its copy-in (per rank thread)


def _log_once(key, message, *args) -> None:
    if key not in _logged:
        _logged.add(key)
        log.warning(message, *args)


def _bucket_of(fsdp_params, all_gather=False):
    if not fsdp_params:
        return None
    bucket = getattr(fsdp_params[0], "_tide_bucket", None)
    if bucket is None or any(getattr(fp, "_tide_bucket", None) is not bucket for fp in fsdp_params):
        return None
    if all_gather and getattr(bucket, "ag_layout", None) is not None:
        return None  # torch >= 2.15: its all-gather goes through FSDP's layout hook (_layout.py)
    return bucket


def foreach_all_gather(*args, **kwargs):
    call = _hooks.Call("foreach_all_gather", args, kwargs)
    fsdp_params = call.get("fsdp_params")
    bucket = _bucket_of(fsdp_params, all_gather=True)
    if bucket is None or len(fsdp_params) != len(bucket.fsdp_params):
        return _hooks.stock("foreach_all_gather")(*args, **kwargs)
    bucket.check_state(call.get("all_gather_comm"))
    with torch.no_grad():
        return bucket.all_gather(call.get("all_gather_stream") if bucket.cuda else None)


def foreach_all_gather_copy_out(all_gather_result, fsdp_params, group, *args, **kwargs):
    bucket = _bucket_of(fsdp_params, all_gather=True)
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


def foreach_reduce(*args, **kwargs):
    call = _hooks.Call("foreach_reduce", args, kwargs)
    fsdp_params, grads = call.get("fsdp_params"), call.get("unsharded_grads")
    bucket = _bucket_of(fsdp_params)
    if bucket is None:
        return _hooks.stock("foreach_reduce")(*args, **kwargs)
    reason = _reduce_fallback_reason(fsdp_params, grads, call)
    if reason:
        _log_once(("rs", bucket.path, reason), "tide.fsdp: param group %s: this reduce-scatter runs "
                  "stock FSDP2: %s", bucket.path, reason)
        return _hooks.stock("foreach_reduce")(*args, **kwargs)
    subset = tuple(bucket.index[id(fp)] for fp in fsdp_params)
    comm = ReduceScatterComm(bucket, subset, call.get("gradient_divide_factor"))
    pending = _pending_comms()
    pending.append(comm)
    try:
        args, kwargs = call.with_argument("reduce_scatter_comm", comm)
        with _fsdp2.gradients_in_place(fsdp_params, grads):
            return _hooks.stock("foreach_reduce")(*args, **kwargs)
    finally:
        pending.remove(comm)


def _pending_comms() -> list:
    if not hasattr(_local, "comms"):
        _local.comms = []
    return _local.comms


def _reduce_fallback_reason(fsdp_params, grads, call) -> str:
    comm = call.get("reduce_scatter_comm")
    if not _fsdp2.is_default_comm(comm, "reduce_scatter"):
        return f"a custom reduce-scatter comm ({type(comm).__name__})"
    subclasses = sorted({type(g).__name__ for g in grads if type(g) is not torch.Tensor})
    if subclasses:  # e.g. an all-gather extension whose unsharded param is a subclass (TwoTensor)
        return f"gradients are tensor subclasses ({', '.join(subclasses)}), not plain tensors"
    grad_dtypes = {g.dtype for g in grads}
    if len(grad_dtypes) != 1:
        return f"mixed gradient dtypes {sorted(map(str, grad_dtypes))}"
    grad_dtype = grads[0].dtype
    reduce_dtype = call.get("reduce_dtype") or grad_dtype
    if grad_dtype not in TORCH_TO_TIDE or reduce_dtype not in (torch.float32, grad_dtype):
        return f"gradient dtype {grad_dtype} with reduce dtype {reduce_dtype}"
    if reduce_dtype not in (torch.float32, torch.bfloat16):
        return f"reduce dtype {reduce_dtype} is pre-divided by stock FSDP2 against overflow"
    if any(not g.is_contiguous() or tuple(g.shape) != tuple(fp._orig_size)
           for g, fp in zip(grads, fsdp_params)):
        return "non-contiguous or reshaped gradients"
    return ""


def foreach_reduce_scatter_copy_in(unsharded_grads, reduce_scatter_input, world_size):
    for comm in _pending_comms():
        if reduce_scatter_input is comm.input_standin:
            comm.grads = list(unsharded_grads)  # keeps them alive until TIDE-RS has read them
            return None
    return _hooks.stock("foreach_reduce_scatter_copy_in")(unsharded_grads, reduce_scatter_input, world_size)


def free_unsharded_param(self):
    bucket = getattr(self, "_tide_bucket", None)
    if bucket is None or getattr(bucket, "ag_layout", None) is not None:  # layout: release_output
        return _hooks.stock("free_unsharded_param")(self)
    bucket.on_params_freed()
    return None


REPLACEMENTS = {
    "foreach_all_gather": foreach_all_gather,
    "foreach_all_gather_copy_out": foreach_all_gather_copy_out,
    "foreach_reduce": foreach_reduce,
    "foreach_reduce_scatter_copy_in": foreach_reduce_scatter_copy_in,
    "free_unsharded_param": free_unsharded_param,
}
