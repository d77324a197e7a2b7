"""tide.fsdp: TIDE's zero-copy all-gather and mixed-precision reduce-scatter inside FSDP2.

    model = ...; fully_shard(layer) for each layer; fully_shard(model)
    tide.fsdp.enable(model)      # after fully_shard, while the model is sharded (not mid-step)
    ...train as usual...
    tide.fsdp.disable(model)     # back to stock FSDP2

What changes for a handled FSDP2 param group ("bucket"):
- all-gather: each rank casts its shard straight into its slot of a window and pushes it to the same
  slot on every peer; the window *is* the unsharded parameters' storage, so FSDP2's copy-out
  (``split_with_sizes_copy``) never runs;
- reduce-scatter: per-parameter gradients are read in place and reduced in fp32 (or the reduce
  dtype) into the shard, staging in the slots the all-gather vacated; FSDP2's copy-in
  (``chunk_cat``) and its full-group reduce-dtype buffer never exist. Everything after the
  reduce-scatter (divide factors, HSDP all-reduce, ``+=`` into ``.grad``, post-accumulate hooks)
  is stock FSDP2's own code.

Memory: a bucket's unsharded parameters keep one address for the life of the model (a reserved
address range), and the memory behind it comes from small pools of windows shared by the buckets
of a process group's ranks, one pool per size class (a root's embedding and head do not size the
layers' slots), so memory stays that of the buckets unsharded at once (prefetch depth), not of the
model. Autograd's saved views of parameters stay valid because the address never changes.

On CUDA devices the windows are VMM windows (cuMemCreate; peers map each other's through file
descriptors passed between the rank processes) and each bucket's fixed address is a reserved
device address range (CudaAddressRange) the current slot is mapped into; the all-gather runs on
FSDP2's all-gather stream and the reduce-scatter on its reduce-scatter stream, ordered by events.
The ranks of a node must be processes on one host.

Across nodes (``enable(..., ranks_per_node=N, network=...)``): groups spanning several nodes run
TIDE's across-node programs. On CPU over the host executor's host transport (virtual nodes of one
host, as CI tests them); on CUDA over CUDA IPC when every rank is on this host (windows mapped by
every rank, the receiver's kernel pulling from the sender's window) or NCCL (a communicator per
pooled window; not run on a GPU yet). Windows then hold the reduce-scatter's staging too.

Not handled (such buckets fall back to stock FSDP2, with one log line saying why): ranks on
several hosts without ranks_per_node, a node whose ranks are on several hosts, CPU ranks on
several hosts, NCCL with ranks sharing a GPU, world size 1, ``reshard_after_forward`` as an int (post-forward resharding to a smaller mesh), CPU offload,
tensor-subclass extensions (``fsdp_pre_all_gather``), DTensor parameters (TP/EP), non-dim-0
placements, dtypes other than fp32/bf16/fp16. A reduce-scatter with an fp16 reduce dtype
(pre-divide) runs stock for that call. Gradients larger than a pool window (accumulated in an fp32
reduce dtype for bf16 params) stage in a second pool of windows of their size, made when first
needed.
"""

from __future__ import annotations

import ctypes
import inspect
import itertools
import logging
import math
import os
import socket

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard import _fsdp_collectives as _collectives
from torch.distributed.fsdp._fully_shard import _fsdp_param as _param_mod
from torch.distributed.fsdp._fully_shard import _fsdp_param_group as _group_mod

from . import _tide
from .distributed import store_bootstrap

log = logging.getLogger("tide.fsdp")

_TORCH_TO_TIDE = {torch.bfloat16: _tide.DType.bf16, torch.float16: _tide.DType.fp16,
                  torch.float32: _tide.DType.fp32}
_TIDE_TO_TORCH = {v: k for k, v in _TORCH_TO_TIDE.items()}


def _param_name(fp, index: int) -> str:
    info = getattr(fp, "_module_info", None)
    return getattr(fp, "_param_fqn", None) or getattr(info, "param_name", None) or f"param{index}"


def _dtypes(fp, param_group) -> tuple:
    """(sharded dtype, unsharded/communication dtype) of a param. FSDPParam sets its own dtype
    attributes only at lazy init (first forward); enable() may run before that."""
    orig = fp.sharded_param.dtype
    return orig, (param_group.mp_policy.param_dtype or orig)

# The stock functions, captured once; TIDE's replacements dispatch to them for unhandled buckets.
_STOCK = {
    "foreach_all_gather": _group_mod.foreach_all_gather,
    "foreach_all_gather_copy_out": _group_mod.foreach_all_gather_copy_out,
    "foreach_reduce": _group_mod.foreach_reduce,
    "foreach_reduce_scatter_copy_in": _collectives.foreach_reduce_scatter_copy_in,
    "free_unsharded_param": _param_mod.FSDPParam.free_unsharded_param,
}
_FOREACH_REDUCE_SIGNATURE = inspect.signature(_STOCK["foreach_reduce"])
_FOREACH_ALL_GATHER_SIGNATURE = inspect.signature(_STOCK["foreach_all_gather"])
_logged: set = set()


def _log_once(key, message, *args) -> None:
    if key not in _logged:
        _logged.add(key)
        log.warning(message, *args)


# --- version adapter: where param groups live, how an AllGatherResult is built -----------------

def _param_groups(module: torch.nn.Module) -> list:
    """(module path, FSDPParamGroup) for every param group under `module`, in module order
    (identical on every rank). The path comes from the module tree: FSDP2 sets its own
    ``_module_fqn`` only at lazy init (first forward)."""
    groups, seen = [], set()
    for path, m in module.named_modules():
        get_state = getattr(m, "_get_fsdp_state", None)
        if get_state is None:
            continue
        state = get_state()
        found = getattr(state, "_fsdp_param_groups", None)  # torch >= 2.12: a list per module
        if found is None:
            single = getattr(state, "_fsdp_param_group", None)  # torch 2.11
            found = [single] if single is not None else []
        for g in found:
            if id(g) not in seen:
                seen.add(id(g))
                groups.append((path or "<root>", g))
    return groups


class _DeviceBytes:
    """`nbytes` of device memory at `ptr`, as a __cuda_array_interface__ for a zero-copy tensor."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None, "stream": None}


def _all_gather_result(output: torch.Tensor, fsdp_params, numels: list, event=None) -> tuple:
    fields = dict(all_gather_output=output, all_gather_event=event, all_gather_work=None,
                  param_all_gather_input_dtypes=[[output.dtype] for _ in fsdp_params],
                  param_all_gather_input_numels=[[n] for n in numels],
                  all_gather_input_split_sizes=list(numels))
    return _collectives.AllGatherResult(**{f: fields[f] for f in _collectives.AllGatherResult._fields})


# --- windows: pools per process group's ranks and size class ----------------------------------------------------------

class _Slot:
    """One pooled window and the executor that runs programs on it. On CUDA, `ready` is the event
    after which the window may be written again (its last reader's stream recorded it)."""

    def __init__(self, window, executor):
        self.window, self.executor = window, executor
        self.ready = None  # torch.cuda.Event or None

    def use_on(self, stream) -> None:
        """CUDA: the next program on this slot runs on `stream`, after the slot's last use."""
        if self.ready is not None:
            stream.wait_event(self.ready)
        self.executor.set_stream(stream.cuda_stream)


class _WindowPool:
    """Windows of one size shared by every bucket of a process group. Every rank acquires and
    releases at the same points of FSDP2's schedule, so pool decisions agree across ranks and a new
    window (a collective) is created by all ranks together. On CUDA the windows are VMM windows
    (their data can be mapped at each bucket's fixed address)."""

    def __init__(self, group, slot_bytes: int, timeout_ms, name: str, device: torch.device, topology,
                 transport):
        self.group, self.slot_bytes, self.timeout_ms, self.device = group, slot_bytes, timeout_ms, device
        self.topology, self.transport = topology, transport  # transport: see _transport
        self.name = name
        self.bootstrap = store_bootstrap(group, name)
        self.wide: dict = {}  # window bytes -> _WindowPool, for reduce-scatters that outgrow a slot
        self.free: list[_Slot] = []
        self.slots: list[_Slot] = []
        self.pending: list = []  # buckets whose params were freed; released at the next acquire
        self.stats_enabled = False

    def acquire(self) -> _Slot:
        self.release_pending()
        if self.free:
            return self.free.pop()
        if self.device.type == "cuda":
            # IPC between nodes: every rank's window is mapped (all on this host). NCCL: a
            # communicator per window, since windows can have an all-gather and a reduce-scatter
            # in flight at once and NCCL needs one order of operations per communicator.
            comm = _tide.NcclComm.create(self.bootstrap) if self.transport == "nccl" else None
            reach = _tide.CudaReach.host if self.transport == "ipc" else _tide.CudaReach.node
            window = _tide.CudaWindow.create(self.bootstrap, self.slot_bytes, self.topology,
                                             _tide.CudaMemory.vmm, reach)
            executor = _tide.CudaExecutor(window, torch.cuda.current_stream(self.device).cuda_stream,
                                          self.timeout_ms, comm)
        else:
            window = _tide.HostWindow.create(self.bootstrap, self.slot_bytes)
            executor = _tide.HostExecutor(window, self.timeout_ms)
        slot = _Slot(window, executor)
        self.slots.append(slot)
        if self.stats_enabled and hasattr(executor, "enable_stats"):
            executor.enable_stats(True)
        return slot

    def release(self, slot: _Slot) -> None:
        self.free.append(slot)

    def wide_pool(self, window_bytes: int) -> "_WindowPool":
        """The pool of `window_bytes` windows for reduce-scatters whose gradients do not fit a slot
        (gradient accumulation keeps bf16 params' unsharded gradients in an fp32 reduce dtype:
        twice the slot). Same decision, same name on every rank: created together."""
        pool = self.wide.get(window_bytes)
        if pool is None:
            pool = _WindowPool(self.group, window_bytes, self.timeout_ms,
                               f"{self.name}/wide/{window_bytes}", self.device, self.topology,
                               self.transport)
            pool.stats_enabled = self.stats_enabled
            self.wide[window_bytes] = pool
        return pool

    def all_slots(self) -> list:
        return self.slots + [slot for pool in self.wide.values() for slot in pool.all_slots()]

    def total_bytes(self) -> int:
        return len(self.slots) * self.slot_bytes + sum(p.total_bytes() for p in self.wide.values())

    def release_pending(self) -> None:
        for bucket in self.pending:
            bucket.release_slot()
        self.pending.clear()


# --- buckets --------------------------------------------------------------------------------------

class _Bucket:
    """One FSDP2 param group handled by TIDE: its layout, plans, fixed address and current slot."""

    def __init__(self, bucket_id: int, param_group, group, fsdp_params, layout, net):
        self.id, self.param_group, self.group = bucket_id, param_group, group
        self.fsdp_params = list(fsdp_params)
        self.index = {id(p): i for i, p in enumerate(self.fsdp_params)}
        self.layout, self.net = layout, net
        self.rank = group.rank()
        self.ag_program = _tide.plan_all_gather(layout, self.rank, bucket_id, net)
        # Across nodes the reduce-scatter stages partial sums after the bucket's window: a slot
        # holds the largest of the two programs' windows (a subset's is never larger).
        self.window_bytes = max(self.ag_program.window_bytes,
                                _tide.plan_reduce_scatter(layout, self.rank, _tide.ReduceOptions(),
                                                          bucket_id, net).window_bytes)
        self.rs_programs: dict = {}
        self.pool: _WindowPool | None = None
        self.range = None
        self.param_outputs: list[torch.Tensor] = []
        self.slot: _Slot | None = None
        self.vacated = False

    def attach(self, pool: _WindowPool) -> None:
        self.pool = pool
        self.cuda = pool.device.type == "cuda"
        self.range = (_tide.CudaAddressRange if self.cuda else _tide.HostAddressRange)(pool.slot_bytes)
        self.freed = None  # CUDA: event on the compute stream after the params' last use

    def _ensure_param_outputs(self) -> None:
        # One tensor per param over the bucket's fixed address, each with its own storage starting at
        # the param (FSDP2 views it with as_strided(storage_offset=0)); created once, never resized.
        if self.param_outputs:
            return
        for p, fp in zip(self.layout.params, self.fsdp_params):
            nbytes = self.layout.world * p.slot_bytes
            if self.cuda:
                raw = torch.as_tensor(_DeviceBytes(self.range.ptr + p.window_offset, nbytes),
                                      device=self.pool.device)
            else:
                raw = torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(self.range.ptr + p.window_offset),
                                       dtype=torch.uint8)
            self.param_outputs.append(raw.view(_TIDE_TO_TORCH[p.dtype]))

    def _map_slot(self) -> None:
        if self.cuda:
            # The range is remapped by the host: the params' last readers (kernels on the compute
            # stream, recorded when FSDP2 freed them) must be done with the old mapping.
            if self.freed is not None:
                self.freed.synchronize()
            self.range.map_data_of(self.slot.window)
        else:
            self.slot.window.map_data_into(self.range)

    def all_gather(self, stream=None):
        if self.slot is None:
            self.slot = self.pool.acquire()
            self._map_slot()
        elif self.vacated:  # freed, then gathered again before anyone else took the slot
            self.pool.pending.remove(self)
        self.vacated = False
        self._ensure_param_outputs()
        shards = []
        for p, fp in zip(self.layout.params, self.fsdp_params):
            data = fp._sharded_param_data
            if data.dtype != _TIDE_TO_TORCH[p.shard_dtype] or not data.is_contiguous():
                raise RuntimeError(f"tide.fsdp: bucket {self.id}: sharded data of {p.name} is "
                                   f"{data.dtype}, contiguous={data.is_contiguous()}; expected "
                                   f"contiguous {_TIDE_TO_TORCH[p.shard_dtype]}")
            shards.append(data.data_ptr())
        event = None
        if self.cuda:
            # On FSDP2's all-gather stream, after the compute stream (optimizer steps write the
            # shards) and after the slot's previous user; FSDP2 waits on the event before use.
            stream = stream or torch.cuda.current_stream(self.pool.device)
            stream.wait_stream(torch.cuda.current_stream(self.pool.device))
            self.slot.use_on(stream)
            self.slot.executor.run(self.ag_program, shards)
            event = stream.record_event()
        else:
            self.slot.executor.run(self.ag_program, shards)
        return _all_gather_result(self.param_outputs[0], self.fsdp_params,
                                  [p.shard_numel for p in self.layout.params], event)

    def copy_out(self) -> None:
        for fp, out in zip(self.fsdp_params, self.param_outputs):
            if not fp.all_gather_outputs or fp.all_gather_outputs[0] is not out:
                fp.all_gather_outputs = [out]

    def on_params_freed(self) -> None:
        if self.slot is not None and not self.vacated:
            if self.cuda:  # the params' last readers were enqueued on the current stream
                self.freed = torch.cuda.current_stream(self.pool.device).record_event()
                self.slot.ready = self.freed
            self.vacated = True
            self.pool.pending.append(self)

    def release_slot(self) -> None:
        if self.slot is not None:
            self.pool.release(self.slot)
        self.slot, self.vacated = None, False

    def take_staging_slot(self) -> _Slot:
        """The slot the reduce-scatter stages in: the one the all-gather vacated (Slot-Reuse), or
        a pool slot when this bucket's params are still in use (reshard_after_backward=False)."""
        if self.slot is not None and self.vacated:
            self.pool.pending.remove(self)
            slot, self.slot, self.vacated = self.slot, None, False
            return slot
        return self.pool.acquire()

    def rs_program(self, subset: tuple, grad_dtype: torch.dtype, reduce_dtype: torch.dtype,
                   options_key: tuple):
        key = (subset, grad_dtype, reduce_dtype, options_key)
        program = self.rs_programs.get(key)
        if program is None:
            specs = [_tide.ParamSpec(self.layout.params[i].name, list(self.layout.params[i].shape),
                                     _TORCH_TO_TIDE[grad_dtype], _TORCH_TO_TIDE[reduce_dtype])
                     for i in subset]
            layout = _tide.BucketLayout(specs, self.layout.topology)
            kind, prescale = options_key
            options = _tide.ReduceOptions(kind=kind, prescale=prescale)
            program = (layout, _tide.plan_reduce_scatter(layout, self.rank, options, self.id, self.net))
            self.rs_programs[key] = program
        return program


class _TideReduceScatterComm:
    """Stands in for FSDP2's reduce-scatter comm inside stock ``foreach_reduce``: the full-group
    input buffer it allocates is a one-element stand-in (copy-in is skipped for it), and the
    "collective" is TIDE-RS from the per-parameter gradients straight into the output shard."""

    def __init__(self, bucket: _Bucket, subset: tuple, divide_factor):
        self.bucket, self.subset, self.divide_factor = bucket, subset, divide_factor
        self.input_standin: torch.Tensor | None = None
        self.grads: list[torch.Tensor] | None = None

    def allocate(self, size, *, dtype, device):
        if self.input_standin is None:
            numel = math.prod(size)
            self.input_standin = torch.empty(1, dtype=dtype, device=device).expand(numel)
            return self.input_standin
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group=None, op=None, async_op=False):
        if input_tensor is not self.input_standin or self.grads is None:
            raise RuntimeError("tide.fsdp: reduce-scatter called without TIDE's gradient hand-off "
                               "(FSDP2 internals changed?)")
        bucket, grads = self.bucket, self.grads
        if op == dist.ReduceOp.AVG:
            options_key = (_tide.ReduceKind.avg, 1.0)
        elif op == dist.ReduceOp.SUM:
            options_key = (_tide.ReduceKind.sum, 1.0)
        else:  # PREMUL_SUM(1 / gradient_divide_factor)
            options_key = (_tide.ReduceKind.sum, 1.0 / float(self.divide_factor))
        layout, program = bucket.rs_program(self.subset, grads[0].dtype, output_tensor.dtype, options_key)
        outputs, offset = [], 0
        base, itemsize = output_tensor.data_ptr(), output_tensor.element_size()
        for p in layout.params:  # stock's flat output layout: padded shards back to back
            outputs.append(base + offset * itemsize)
            offset += p.shard_numel
        if program.window_bytes > bucket.pool.slot_bytes:
            staging_pool = bucket.pool.wide_pool(program.window_bytes)
            slot = staging_pool.acquire()
        else:
            staging_pool, slot = bucket.pool, bucket.take_staging_slot()
        try:
            if bucket.cuda:  # stock foreach_reduce calls this on its reduce-scatter stream
                stream = torch.cuda.current_stream(bucket.pool.device)
                slot.use_on(stream)
                slot.executor.run(program, [g.data_ptr() for g in grads], outputs)
                for g in grads:  # read in place on this stream; freed by the compute stream
                    g.record_stream(stream)
                slot.ready = stream.record_event()
            else:
                slot.executor.run(program, [g.data_ptr() for g in grads], outputs)
        finally:
            staging_pool.release(slot)
            self.grads = None
        return None


# --- the three replaced functions (installed in _fsdp_param_group's namespace) --------------------

def _bucket_of(fsdp_params):
    if not fsdp_params:
        return None
    bucket = getattr(fsdp_params[0], "_tide_bucket", None)
    if bucket is None:
        return None
    if any(getattr(fp, "_tide_bucket", None) is not bucket for fp in fsdp_params):
        return None
    return bucket


def _foreach_all_gather(*args, **kwargs):
    a = _FOREACH_ALL_GATHER_SIGNATURE.bind(*args, **kwargs).arguments
    fsdp_params = a["fsdp_params"]
    bucket = _bucket_of(fsdp_params)
    if bucket is None or len(fsdp_params) != len(bucket.fsdp_params):
        return _STOCK["foreach_all_gather"](*args, **kwargs)
    with torch.no_grad():
        return bucket.all_gather(a.get("all_gather_stream") if bucket.cuda else None)


def _foreach_all_gather_copy_out(all_gather_result, fsdp_params, group, *args, **kwargs):
    bucket = _bucket_of(fsdp_params)
    if bucket is None or all_gather_result.all_gather_output is not (bucket.param_outputs or [None])[0]:
        return _STOCK["foreach_all_gather_copy_out"](all_gather_result, fsdp_params, group, *args, **kwargs)
    if all_gather_result.all_gather_event is not None:  # as stock: compute waits for the gather
        torch.cuda.current_stream(bucket.pool.device).wait_event(all_gather_result.all_gather_event)
    bucket.copy_out()
    return None


def _foreach_reduce(*args, **kwargs):
    bound = _FOREACH_REDUCE_SIGNATURE.bind(*args, **kwargs)
    a = bound.arguments
    fsdp_params, grads = a["fsdp_params"], a["unsharded_grads"]
    bucket = _bucket_of(fsdp_params)
    if bucket is None:
        return _STOCK["foreach_reduce"](*args, **kwargs)
    reason = _reduce_fallback_reason(bucket, fsdp_params, grads, a)
    if reason:
        _log_once(("rs", bucket.id, reason), "tide.fsdp: bucket %d: this reduce-scatter runs stock "
                  "FSDP2: %s", bucket.id, reason)
        return _STOCK["foreach_reduce"](*args, **kwargs)
    subset = tuple(bucket.index[id(fp)] for fp in fsdp_params)
    comm = _TideReduceScatterComm(bucket, subset, a.get("gradient_divide_factor"))
    _pending_comms.append(comm)
    try:
        a["reduce_scatter_comm"] = comm
        return _STOCK["foreach_reduce"](*bound.args, **bound.kwargs)
    finally:
        _pending_comms.remove(comm)


_pending_comms: list = []


def _reduce_fallback_reason(bucket, fsdp_params, grads, a) -> str:
    grad_dtypes = {g.dtype for g in grads}
    if len(grad_dtypes) != 1:
        return f"mixed gradient dtypes {sorted(map(str, grad_dtypes))}"
    grad_dtype = grads[0].dtype
    reduce_dtype = a.get("reduce_dtype") or grad_dtype
    if grad_dtype not in _TORCH_TO_TIDE or reduce_dtype not in (torch.float32, grad_dtype):
        return f"gradient dtype {grad_dtype} with reduce dtype {reduce_dtype}"
    if reduce_dtype not in (torch.float32, torch.bfloat16):
        return f"reduce dtype {reduce_dtype} is pre-divided by stock FSDP2 against overflow"
    if any(not g.is_contiguous() or tuple(g.shape) != tuple(fp._orig_size)
           for g, fp in zip(grads, fsdp_params)):
        return "non-contiguous or reshaped gradients"
    return ""


def _foreach_reduce_scatter_copy_in(unsharded_grads, reduce_scatter_input, world_size):
    for comm in _pending_comms:
        if reduce_scatter_input is comm.input_standin:
            comm.grads = list(unsharded_grads)  # keeps them alive until TIDE-RS has read them
            return None
    return _STOCK["foreach_reduce_scatter_copy_in"](unsharded_grads, reduce_scatter_input, world_size)


def _free_unsharded_param(self):
    bucket = getattr(self, "_tide_bucket", None)
    if bucket is None:
        return _STOCK["free_unsharded_param"](self)
    bucket.on_params_freed()
    return None


def _install() -> None:
    _group_mod.foreach_all_gather = _foreach_all_gather
    _group_mod.foreach_all_gather_copy_out = _foreach_all_gather_copy_out
    _group_mod.foreach_reduce = _foreach_reduce
    _collectives.foreach_reduce_scatter_copy_in = _foreach_reduce_scatter_copy_in
    _param_mod.FSDPParam.free_unsharded_param = _free_unsharded_param


# --- public API -----------------------------------------------------------------------------------

class TideFSDP:
    """What ``enable`` did: the handled buckets, the fallbacks (with reasons) and the pools."""

    def __init__(self):
        self.buckets: list[_Bucket] = []
        self.fallbacks: list[tuple] = []  # (param group fqn, reason)
        self.pools: list[_WindowPool] = []

    def pool_bytes(self) -> int:
        """Bytes of window memory this rank holds now (all pools)."""
        return sum(p.total_bytes() for p in self.pools)

    def enable_sm_stats(self, enabled: bool = True) -> None:
        """CUDA: time TIDE's kernels (cast, reduce) from now on (off by default: it adds events)."""
        for pool in self.pools:
            for slot in pool.all_slots():
                if hasattr(slot.executor, "enable_stats"):
                    slot.executor.reset_stats()
                    slot.executor.enable_stats(enabled)
            pool.stats_enabled = enabled
            for wide in pool.wide.values():
                wide.stats_enabled = enabled

    def sm_cta_us(self) -> float:
        """CUDA: SM time of TIDE's kernels since enable_sm_stats, in CTA-microseconds (CTAs x kernel
        time; copies and flags use no SMs). Synchronizes the executors. 0 on CPU."""
        total = 0.0
        for pool in self.pools:
            for slot in pool.all_slots():
                if hasattr(slot.executor, "stats"):
                    st = slot.executor.stats()
                    total += st.cast_cta_us + st.reduce_cta_us
        return total

    def __repr__(self):
        return (f"TideFSDP({len(self.buckets)} buckets handled, {len(self.fallbacks)} fallbacks, "
                f"{sum(len(p.all_slots()) for p in self.pools)} pooled windows)")


_enabled: dict = {}  # id(module) -> TideFSDP
_bucket_ids = itertools.count()


NETWORKS = ("auto", "ipc", "nccl")

_placement_cache: dict = {}


def _placements(group, device: torch.device) -> list:
    """(host name, GPU uuid or "") of every rank of `group`, in group-rank order: where windows can
    be mapped (one host) and whether NCCL can run (one rank per GPU). Asked once per group and
    device type, over the store."""
    ranks = tuple(dist.get_process_group_ranks(group))
    cache_key = (ranks, device.type)
    if cache_key not in _placement_cache:
        gpu = ""
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            gpu = str(getattr(props, "uuid", "")) or f"{props.name}#{getattr(props, 'pci_bus_id', device.index)}"
        store = dist.distributed_c10d._get_default_store()
        key = f"tide/placement/{device.type}/{'-'.join(map(str, ranks))}"  # once per group and process
        store.set(f"{key}/{group.rank()}", f"{socket.gethostname()}|{gpu}")
        _placement_cache[cache_key] = [tuple(store.get(f"{key}/{q}").decode().split("|", 1))
                                       for q in range(group.size())]
    return _placement_cache[cache_key]


def transport_for(placements: list, device_type: str, topology, network: str):
    """(transport between the group's nodes, "") or (None, why the group falls back), from where
    the group's ranks are: `placements` is (host, GPU uuid or "") per group rank. The transport is
    None for one node, "host" (CPU: the host executor's), "ipc" (CUDA IPC, every rank on this
    host) or "nccl" (one communicator per window, node-local work still by CUDA IPC). Pure, so
    tide-bench refuses a configuration with the same decision before anything runs."""
    hosts = [h for h, _ in placements]
    one_host = len(set(hosts)) == 1
    if topology.nodes == 1:
        if not one_host:
            return None, (f"ranks on several hosts ({', '.join(sorted(set(hosts)))}) as one node: "
                          "declare the nodes with enable(ranks_per_node=...), e.g. LOCAL_WORLD_SIZE")
        return None, ""
    for n in range(topology.nodes):
        node_hosts = set(hosts[n * topology.local:(n + 1) * topology.local])
        if len(node_hosts) > 1:
            return None, f"node {n}'s ranks are on several hosts ({', '.join(sorted(node_hosts))})"
    if device_type == "cpu":
        if network == "nccl":
            return None, "network='nccl' on CPU devices (their network is TIDE's host transport)"
        if not one_host:
            return None, "CPU ranks on several hosts (the host transport needs them on one host)"
        return "host", ""
    transport = ("ipc" if one_host else "nccl") if network == "auto" else network
    if transport == "ipc" and not one_host:
        return None, "network='ipc' needs every rank of the group on this host"
    if transport == "nccl" and len(set(placements)) < len(placements):  # (host, GPU) pairs
        return None, "network='nccl' with ranks sharing a GPU (NCCL refuses two ranks on one GPU)"
    return transport, ""


def _launcher_ranks_per_node() -> int | None:
    """LOCAL_WORLD_SIZE, as torchrun sets it (the ranks of one node), or None where it is unset."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    if not value:
        return None
    if not value.isdigit() or int(value) <= 0:
        raise ValueError(f"tide.fsdp.enable: LOCAL_WORLD_SIZE = {value!r}, expected a positive int "
                         "(or pass ranks_per_node)")
    return int(value)


def topology_for(ranks: list, ranks_per_node):
    """(topology, "") of a process group's global `ranks`, or (None, why not). Without
    ranks_per_node the group is one node; with it, global rank g is on node g // ranks_per_node,
    and the group must hold as many ranks of every node it spans, node after node (TIDE's rank =
    node * local + local rank)."""
    if ranks_per_node is None:
        return _tide.Topology.single_node(len(ranks)), ""
    nodes = [g // ranks_per_node for g in ranks]
    distinct = list(dict.fromkeys(nodes))
    local = len(ranks) // len(distinct)
    if nodes != [n for n in distinct for _ in range(local)]:
        return None, (f"ranks {ranks} are not node-major with as many on every node "
                      f"(ranks_per_node={ranks_per_node})")
    return _tide.Topology(len(distinct), local), ""


def _bucket_fallback_reason(param_group, group) -> str:
    if group is None or group.size() <= 1:
        return "world size 1 (nothing to communicate)"
    if param_group.device.type == "cuda":
        if not _tide.cuda_built:
            return "device cuda: this build of TIDE has no CUDA transport (built without nvcc)"
    elif param_group.device.type != "cpu":
        return f"device {param_group.device}: TIDE runs on CPU and CUDA devices"
    if getattr(param_group, "_use_post_forward_mesh", False):
        return "reshard_after_forward as an int (post-forward resharding to a smaller mesh)"
    for i, fp in enumerate(param_group.fsdp_params):
        name = _param_name(fp, i)
        if fp.offload_to_cpu:
            return "CPU offload"
        if getattr(fp, "is_dtensor", False):
            return f"{name} is a DTensor parameter (TP/EP)"
        if hasattr(fp._sharded_local_tensor, "fsdp_pre_all_gather"):
            return f"{name} uses an all-gather extension (fsdp_pre_all_gather)"
        if fp.fsdp_placement.dim != 0:
            return f"{name} is sharded on dim {fp.fsdp_placement.dim}"
        orig, comm = _dtypes(fp, param_group)
        if orig not in _TORCH_TO_TIDE or comm not in _TORCH_TO_TIDE:
            return f"{name} has dtype {orig} (communicated as {comm})"
        d0 = fp._orig_size[0] if len(fp._orig_size) else 1
        if fp.padded_sharded_param_size[0] != -(-d0 // group.size()):
            return f"{name}: padded shard {tuple(fp.padded_sharded_param_size)} is not ceil(d0/W) rows"
    return ""


SIZE_CLASS_RATIO = 1.25


def _size_classes(buckets: list) -> list:
    """Buckets grouped into pools of similar window size: each pool's slots are as large as its
    largest bucket, so one pool for a root (embedding + head) and the layers would size every
    layer's slot for the root. A class holds sizes within SIZE_CLASS_RATIO of its smallest.
    Deterministic in the layouts, hence the same on every rank."""
    classes: list = []
    for b in sorted(buckets, key=lambda b: (b.window_bytes, b.id)):
        if classes and b.window_bytes <= SIZE_CLASS_RATIO * classes[-1][0].window_bytes:
            classes[-1].append(b)
        else:
            classes.append([b])
    return classes


def enable(module: torch.nn.Module, *, timeout_ms: int | None = None, ranks_per_node: int | None = None,
           net=None, network: str = "auto") -> TideFSDP:
    """Turns TIDE on for every FSDP2 param group under `module` (call after ``fully_shard``, with the
    model sharded: before the first step or between steps). Returns what was handled.

    ranks_per_node: declares nodes of that many consecutive global ranks (default: LOCAL_WORLD_SIZE
    as torchrun sets it; unset: every group is one node); groups that span several
    run TIDE's across-node programs (recursive-doubling all-gather, two-phase reduce-scatter)
    between them, with `net` (a tide.NetOptions: 16 MiB chunks by default) pacing the network
    steps. ``tide.NetOptions(wire_dtype=tide.DType.bf16)`` sends the reduce-scatter's partial sums
    as bf16 between nodes: half the bytes, but LOSSY (one bf16 rounding per transfer; results are
    no longer bitwise equal to stock FSDP2's). A group on one node must have its ranks on one host.

    network: what carries those steps on CUDA devices. "auto" (default): CUDA IPC when every rank
    of the group is on this host (virtual nodes), else NCCL; "ipc"; "nccl" (a communicator per
    pooled window, one rank per GPU). On CPU the host executor's host transport carries them
    (virtual nodes of one host; "nccl" falls back)."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"tide.fsdp.enable: module is {type(module).__name__}, expected an nn.Module")
    if id(module) in _enabled:
        raise ValueError("tide.fsdp.enable: TIDE is already enabled on this module")
    if timeout_ms is not None and (not isinstance(timeout_ms, int) or timeout_ms <= 0):
        raise ValueError(f"tide.fsdp.enable: timeout_ms = {timeout_ms!r}, expected a positive int")
    if ranks_per_node is not None and (not isinstance(ranks_per_node, int) or ranks_per_node <= 0):
        raise ValueError(f"tide.fsdp.enable: ranks_per_node = {ranks_per_node!r}, expected a positive int")
    if ranks_per_node is None:
        ranks_per_node = _launcher_ranks_per_node()
    if net is not None and not isinstance(net, _tide.NetOptions):
        raise TypeError(f"tide.fsdp.enable: net is {type(net).__name__}, expected tide.NetOptions")
    net = net if net is not None else _tide.NetOptions()
    if network not in NETWORKS:
        raise ValueError(f"tide.fsdp.enable: network = {network!r}, expected one of {NETWORKS}")
    groups = _param_groups(module)
    if not groups:
        raise ValueError("tide.fsdp.enable: no FSDP2 param groups under this module; call "
                         "fully_shard(...) on it (or its submodules) first")
    _install()
    result = TideFSDP()
    by_ranks: dict = {}  # (ranks, device) -> buckets
    for fqn, pg in groups:
        if any(getattr(fp, "_tide_bucket", None) is not None for fp in pg.fsdp_params):
            raise ValueError(f"tide.fsdp.enable: param group {fqn} is already handled by TIDE")
        for fp in pg.fsdp_params:
            if fp.sharded_state != _param_mod.ShardedState.SHARDED:
                raise ValueError(f"tide.fsdp.enable: param group {fqn} is {fp.sharded_state}; "
                                 "enable TIDE while the model is sharded (outside forward/backward)")
        group = getattr(pg, "_all_gather_process_group", None) if hasattr(pg, "mesh_info") else None
        topology, transport, reason = None, None, _bucket_fallback_reason(pg, group)
        if not reason:
            topology, reason = topology_for(dist.get_process_group_ranks(group), ranks_per_node)
        if not reason:
            transport, reason = transport_for(_placements(group, pg.device), pg.device.type,
                                              topology, network)
        if reason:
            result.fallbacks.append((fqn, reason))
            log.warning("tide.fsdp: param group %s falls back to stock FSDP2: %s", fqn, reason)
            continue
        specs = [_tide.ParamSpec(_param_name(fp, i), list(fp._orig_size),
                                 _TORCH_TO_TIDE[_dtypes(fp, pg)[1]], _TORCH_TO_TIDE[_dtypes(fp, pg)[0]])
                 for i, fp in enumerate(pg.fsdp_params)]
        layout = _tide.BucketLayout(specs, topology)
        bucket = _Bucket(next(_bucket_ids), pg, group, pg.fsdp_params, layout, net)
        # FSDP2 may give each param group its own process-group object over the same ranks; TIDE
        # talks through windows, not the group, so those buckets share pools.
        key = (tuple(dist.get_process_group_ranks(group)), str(pg.device))
        by_ranks.setdefault(key, []).append((bucket, transport))
        result.buckets.append(bucket)
    for (ranks, _), entries in by_ranks.items():
        transport = entries[0][1]  # a function of the ranks and the device: the same for all
        for members in _size_classes([b for b, _ in entries]):
            name = f"tide/pool/{'-'.join(map(str, ranks))}/{members[0].id}"
            pool = _WindowPool(members[0].group, max(b.window_bytes for b in members), timeout_ms,
                               name, members[0].param_group.device, members[0].layout.topology,
                               transport)
            result.pools.append(pool)
            for b in members:
                b.attach(pool)
    for b in result.buckets:
        for fp in b.fsdp_params:
            # A stock all-gather may have run before: its tensors must not back TIDE's params.
            fp.all_gather_outputs = []
            if hasattr(fp, "_unsharded_param"):
                del fp._unsharded_param
            fp._tide_bucket = b
    _enabled[id(module)] = result
    return result


def disable(module: torch.nn.Module) -> None:
    """Turns TIDE off for `module` (with the model sharded); FSDP2's stock path takes over."""
    result = _enabled.pop(id(module), None)
    if result is None:
        raise ValueError("tide.fsdp.disable: TIDE is not enabled on this module")
    for b in result.buckets:
        for fp in b.fsdp_params:
            if fp.sharded_state != _param_mod.ShardedState.SHARDED:
                _enabled[id(module)] = result
                raise ValueError("tide.fsdp.disable: the model is not sharded; call it between steps")
    for pool in result.pools:
        pool.release_pending()
    for b in result.buckets:
        for fp in b.fsdp_params:
            del fp._tide_bucket
            fp.all_gather_outputs = []
            if hasattr(fp, "_unsharded_param"):
                del fp._unsharded_param
